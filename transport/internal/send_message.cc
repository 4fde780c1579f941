#include "transport/internal/send_message.h"

#include <memory>
#include <utility>

namespace kvdepot::transport_internal {
namespace {

// One message in flight: its bytes live until UCX's send completes.
struct OutgoingMessage {
  std::string header;
  std::string payload;
  // Where this message is counted until its send ends (or null).
  std::shared_ptr<UnsentMessages> unsent;
  size_t weight = 0;
};

void OnMessageSent(void* request, ucs_status_t /*status*/, void* user_data) {
  std::unique_ptr<OutgoingMessage> m(static_cast<OutgoingMessage*>(user_data));
  if (m->unsent != nullptr) {
    m->unsent->count -= 1;
    m->unsent->bytes -= m->weight;
  }
  ucp_request_free(request);
}

// ucp_am_send_nbx's parameters: `flags` (always with a reply endpoint for
// the receiver, so it can answer a sender it has no endpoint to), and
// `sent(request, status, user_data)` when the send ends later.
ucp_request_param_t SendParam(uint32_t flags, ucp_send_nbx_callback_t sent,
                              void* user_data) {
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                       UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = flags | UCP_AM_SEND_FLAG_REPLY;
  param.cb.send = sent;
  param.user_data = user_data;
  return param;
}

}  // namespace

void PostMessage(ucp_ep_h ep, uint16_t id, std::string header,
                 std::string payload, std::shared_ptr<UnsentMessages> unsent) {
  auto* m = new OutgoingMessage{std::move(header), std::move(payload), nullptr, 0};
  // Eager: the receiver's handler gets the message whole.
  ucp_request_param_t param = SendParam(UCP_AM_SEND_FLAG_EAGER, &OnMessageSent, m);
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep, id, m->header.data(), m->header.size(),
                      m->payload.data(), m->payload.size(), &param);
  // Done (or failed) at once: the callback will not run.
  if (!UCS_PTR_IS_PTR(request)) {
    delete m;
    return;
  }
  if (unsent != nullptr) {
    m->weight = MessageWeight(m->header.size(), m->payload.size());
    unsent->count += 1;
    unsent->bytes += m->weight;
    m->unsent = std::move(unsent);
  }
}

namespace {

struct OutgoingDataMessage {
  std::string header;
  std::vector<ucp_dt_iov_t> iov;
  absl::AnyInvocable<void(ucs_status_t) &&> sent;
};

void OnDataMessageSent(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<OutgoingDataMessage> m(static_cast<OutgoingDataMessage*>(user_data));
  ucp_request_free(request);
  if (m->sent) std::move(m->sent)(status);
}

}  // namespace

void PostDataMessage(ucp_ep_h ep, uint16_t id, std::string header,
                     absl::Span<const char> data,
                     absl::AnyInvocable<void(ucs_status_t) &&> sent) {
  PostDataMessage(ep, id, std::move(header),
                  std::vector<absl::Span<const char>>{data}, std::move(sent));
}

void PostDataMessage(ucp_ep_h ep, uint16_t id, std::string header,
                     std::vector<absl::Span<const char>> pieces,
                     absl::AnyInvocable<void(ucs_status_t) &&> sent) {
  auto* m = new OutgoingDataMessage{std::move(header), {}, std::move(sent)};
  ucp_request_param_t param = SendParam(UCP_AM_SEND_FLAG_RNDV, &OnDataMessageSent, m);
  const void* buffer = nullptr;
  size_t count = 0;
  if (pieces.size() == 1) {
    buffer = pieces[0].data();
    count = pieces[0].size();
  } else {
    for (const absl::Span<const char>& p : pieces) {
      m->iov.push_back({const_cast<char*>(p.data()), p.size()});
    }
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
    buffer = m->iov.data();
    count = m->iov.size();
  }
  ucs_status_ptr_t request = ucp_am_send_nbx(ep, id, m->header.data(),
                                             m->header.size(), buffer, count, &param);
  if (UCS_PTR_IS_PTR(request)) return;  // the callback ends it
  std::unique_ptr<OutgoingDataMessage> done(m);
  if (done->sent) std::move(done->sent)(UCS_PTR_STATUS(request));
}

}  // namespace kvdepot::transport_internal
