#include "storage/rocksdb_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "rocksdb/status.h"

namespace kvdepot {

absl::Status FromRocksStatus(const rocksdb::Status& status,
                             absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  using Code = rocksdb::Status::Code;
  using SubCode = rocksdb::Status::SubCode;
  std::string message = absl::StrCat(context, ": ", status.ToString());
  if (status.subcode() == SubCode::kNoSpace) {
    return absl::UnavailableError(absl::StrCat(context, ": disk full (",
                                               status.ToString(), ")"));
  }
  if (status.subcode() == SubCode::kMemoryLimit ||
      status.subcode() == SubCode::kSpaceLimit) {
    return absl::ResourceExhaustedError(message);
  }
  switch (status.code()) {
    case Code::kNotFound:
      return absl::NotFoundError(message);
    case Code::kCorruption:
      return absl::DataLossError(message);
    case Code::kInvalidArgument:
      return absl::InvalidArgumentError(message);
    case Code::kNotSupported:
      return absl::UnimplementedError(message);
    case Code::kIOError:
    case Code::kBusy:
    case Code::kTryAgain:
    case Code::kTimedOut:
    case Code::kIncomplete:
    case Code::kShutdownInProgress:
      return absl::UnavailableError(message);
    case Code::kAborted:
      return absl::AbortedError(message);
    case Code::kColumnFamilyDropped:
    case Code::kExpired:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace kvdepot
