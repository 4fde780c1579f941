#include "transport/internal/send_message.h"

#include <memory>
#include <utility>

namespace kvdepot::transport_internal {
namespace {

// One message in flight: its bytes live until UCX's send completes.
struct OutgoingMessage {
  std::string header;
  std::string payload;
};

void OnMessageSent(void* request, ucs_status_t /*status*/, void* user_data) {
  delete static_cast<OutgoingMessage*>(user_data);
  ucp_request_free(request);
}

}  // namespace

void PostMessage(ucp_ep_h ep, uint16_t id, std::string header,
                 std::string payload) {
  auto* m = new OutgoingMessage{std::move(header), std::move(payload)};
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                       UCP_OP_ATTR_FIELD_USER_DATA;
  // Eager: the receiver's handler gets the message whole. Reply: it can
  // answer a sender it has no endpoint to.
  param.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  param.cb.send = &OnMessageSent;
  param.user_data = m;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep, id, m->header.data(), m->header.size(),
                      m->payload.data(), m->payload.size(), &param);
  // Done (or failed) at once: the callback will not run.
  if (!UCS_PTR_IS_PTR(request)) delete m;
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
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                       UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY;
  param.cb.send = &OnDataMessageSent;
  param.user_data = m;
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
