// Sending one active message on a UCP endpoint (UcxEndpoint::SendMessage,
// UcxWorker::MessageSender::Reply).
#ifndef KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_
#define KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/types/span.h"

namespace kvdepot::transport_internal {

// Progress thread of ep's worker. Posts ucp_am_send_nbx of message `id`,
// eagerly and with a reply endpoint for the receiver; the strings live
// until UCX is done with them. A failed send is not reported here: it
// shows as the endpoint's failure.
void PostMessage(ucp_ep_h ep, uint16_t id, std::string header,
                 std::string payload);

// Like PostMessage, with `data` sent as rendezvous (UCP_AM_SEND_FLAG_RNDV:
// the receiver takes it into memory of its choice, UcxWorker::Receive).
// `data` is not copied: it must stay valid until `sent` runs (once, on
// ep's progress thread, or here when the send ends at once) with how the
// send ended.
void PostDataMessage(ucp_ep_h ep, uint16_t id, std::string header,
                     absl::Span<const char> data,
                     absl::AnyInvocable<void(ucs_status_t) &&> sent);
// The same with the data in `pieces`, one after the other (an IOV send
// when there are several).
void PostDataMessage(ucp_ep_h ep, uint16_t id, std::string header,
                     std::vector<absl::Span<const char>> pieces,
                     absl::AnyInvocable<void(ucs_status_t) &&> sent);

}  // namespace kvdepot::transport_internal

#endif  // KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_
