#include "transport/internal/ucs_status.h"

#include "absl/strings/str_cat.h"

namespace kvdepot::transport_internal {

absl::Status UcsToStatus(ucs_status_t status, std::string_view what) {
  if (status == UCS_OK || status == UCS_INPROGRESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat(std::string(what), ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(message);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SOME_CONNECTS_FAILED:
      return absl::UnavailableError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_OUT_OF_RANGE:
      return absl::OutOfRangeError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_UNSUPPORTED:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_NO_ELEM:
      return absl::FailedPreconditionError(message);
    default:
      // Link and endpoint failures (a dead peer, a broken path) come in
      // numbered ranges.
      if (UCS_IS_LINK_ERROR(status) || UCS_IS_ENDPOINT_ERROR(status)) {
        return absl::UnavailableError(message);
      }
      return absl::InternalError(message);
  }
}

}  // namespace kvdepot::transport_internal
