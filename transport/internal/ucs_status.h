// Conversion of UCX status codes into absl::Status. The one place that maps
// ucs_status_t; everything above it speaks absl.
#ifndef KVDEPOT_TRANSPORT_INTERNAL_UCS_STATUS_H_
#define KVDEPOT_TRANSPORT_INTERNAL_UCS_STATUS_H_

#include <ucs/type/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace kvdepot::transport_internal {

// OK for UCS_OK (and UCS_INPROGRESS, which is not an error); otherwise a
// status whose message is "`what`: <UCX's description>". Peer, link and
// endpoint failures map to Unavailable, UCS_ERR_TIMED_OUT to
// DeadlineExceeded, cancellation to Cancelled, resource shortages to
// ResourceExhausted, bad parameters to InvalidArgument, everything else to
// Internal.
absl::Status UcsToStatus(ucs_status_t status, std::string_view what);

}  // namespace kvdepot::transport_internal

#endif  // KVDEPOT_TRANSPORT_INTERNAL_UCS_STATUS_H_
