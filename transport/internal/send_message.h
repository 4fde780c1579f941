// Sending one active message on a UCP endpoint (UcxEndpoint::SendMessage,
// UcxWorker::MessageSender::Reply).
#ifndef KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_
#define KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

namespace kvdepot::transport_internal {

// Progress thread of ep's worker. Posts ucp_am_send_nbx of message `id`,
// eagerly and with a reply endpoint for the receiver; the strings live
// until UCX is done with them. A failed send is not reported here: it
// shows as the endpoint's failure.
void PostMessage(ucp_ep_h ep, uint16_t id, std::string header,
                 std::string payload);

}  // namespace kvdepot::transport_internal

#endif  // KVDEPOT_TRANSPORT_INTERNAL_SEND_MESSAGE_H_
