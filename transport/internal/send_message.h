// Sending one active message on a UCP endpoint (UcxEndpoint::SendMessage,
// UcxWorker::MessageSender::Reply).
#ifndef KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_
#define KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/types/span.h"

namespace kvdepot::transport_internal {

// The messages UCX still holds for a peer (their sends not yet ended: the
// peer does not take them, or not as fast as they come), for a sender to
// bound them. Progress thread of the worker only.
struct UnsentMessages {
  size_t count = 0;
  size_t bytes = 0;  // each message's MessageWeight

  // Whether one more message of `weight` may wait besides these when at
  // most `cap` bytes may (0: no bound). The first always may.
  bool Admits(size_t cap, size_t weight) const {
    return cap == 0 || count == 0 || bytes + weight <= cap;
  }
};
// What one message of `header_bytes` + `payload_bytes` counts in
// UnsentMessages::bytes: its bytes and what UCX and we keep besides (the
// request, the strings), so that empty messages are bounded too.
constexpr size_t kMessageOverhead = 256;
inline size_t MessageWeight(size_t header_bytes, size_t payload_bytes) {
  return header_bytes + payload_bytes + kMessageOverhead;
}

// Progress thread of ep's worker. Posts ucp_am_send_nbx of message `id`,
// eagerly and with a reply endpoint for the receiver; the strings live
// until UCX is done with them. A failed send is not reported here: it
// shows as the endpoint's failure. With `unsent`, a message whose send
// does not end at once is counted there (MessageWeight) until it ends.
void PostMessage(ucp_ep_h ep, uint16_t id, std::string header,
                 std::string payload,
                 std::shared_ptr<UnsentMessages> unsent = nullptr);

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
