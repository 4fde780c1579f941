// Endpoint creation shared by UcxEndpoint and PeerMonitor.
#ifndef KVDEPOT_TRANSPORT_INTERNAL_PEER_ENDPOINT_H_
#define KVDEPOT_TRANSPORT_INTERNAL_PEER_ENDPOINT_H_

#include <ucp/api/ucp.h>

#include <string_view>

#include "absl/status/statusor.h"

namespace kvdepot::transport_internal {

// Progress thread only. ucp_ep_create to the worker whose address is
// `peer_address`, with UCP_ERR_HANDLING_MODE_PEER and `on_error(arg, ...)`
// as its error handler, or with no error handling when `on_error` is null.
// InvalidArgument for an empty address; UCX's error otherwise.
absl::StatusOr<ucp_ep_h> CreatePeerEndpoint(ucp_worker_h worker,
                                            std::string_view peer_address,
                                            ucp_err_handler_cb_t on_error,
                                            void* arg);

}  // namespace kvdepot::transport_internal

#endif  // KVDEPOT_TRANSPORT_INTERNAL_PEER_ENDPOINT_H_
