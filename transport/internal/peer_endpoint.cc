#include "transport/internal/peer_endpoint.h"

#include <string>

#include "absl/status/status.h"
#include "transport/internal/ucs_status.h"

namespace kvdepot::transport_internal {
namespace {

constexpr size_t kAddressPadding = 16 * 1024;

}  // namespace

absl::StatusOr<ucp_ep_h> CreatePeerEndpoint(ucp_worker_h worker,
                                            std::string_view peer_address,
                                            ucp_err_handler_cb_t on_error,
                                            void* arg) {
  if (peer_address.empty()) {
    return absl::InvalidArgumentError("empty UCX worker address");
  }
  // UCX 1.13 unpacks the address without its length: a malformed one is
  // read past its end. There it finds the same bytes in every process
  // (UcxAddressSandbox tries an address in another before kvdepotd takes
  // it), and bytes that end UCX's walk soon: 0xff ends a device list
  // (UCP_NULL_RESOURCE) and a transport list (the LAST flag), and no length
  // it can read makes UCX skip past this much.
  std::string padded(peer_address);
  padded.append(kAddressPadding, '\xff');
  ucp_ep_params_t params = {};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(padded.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  if (on_error != nullptr) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = on_error;
    params.err_handler.arg = arg;
  }
  ucp_ep_h ep = nullptr;
  ucs_status_t st = ucp_ep_create(worker, &params, &ep);
  if (st != UCS_OK) return UcsToStatus(st, "ucp_ep_create");
  return ep;
}

}  // namespace kvdepot::transport_internal
