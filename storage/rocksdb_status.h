// The one place where a rocksdb::Status becomes an absl::Status. Everything
// in kvdepot that talks to RocksDB converts its results through
// FromRocksStatus, so the mapping of RocksDB failures to the codes the rest
// of the daemon (and, through gRPC, its clients) sees is decided once.
#ifndef KVDEPOT_STORAGE_ROCKSDB_STATUS_H_
#define KVDEPOT_STORAGE_ROCKSDB_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rocksdb {
class Status;
}  // namespace rocksdb

namespace kvdepot {

// Returns OK for an OK `status`; otherwise an absl::Status whose message is
// "<context>: <RocksDB's message>" and whose code is:
//   NotFound                         -> kNotFound
//   Corruption                       -> kDataLoss
//   InvalidArgument                  -> kInvalidArgument
//   NotSupported                     -> kUnimplemented
//   IOError with subcode NoSpace     -> kUnavailable, message says "disk full"
//   IOError (other), Busy, TryAgain,
//   TimedOut, Incomplete,
//   ShutdownInProgress               -> kUnavailable (the disk or the DB is
//                                       not usable right now; retry later)
//   Aborted                          -> kAborted
//   ColumnFamilyDropped, Expired     -> kFailedPrecondition
//   subcode MemoryLimit/SpaceLimit   -> kResourceExhausted
//   anything else                    -> kInternal
absl::Status FromRocksStatus(const rocksdb::Status& status,
                             absl::string_view context);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_ROCKSDB_STATUS_H_
