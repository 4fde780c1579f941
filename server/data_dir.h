// DataDir: kvdepotd's data directory, created if missing and locked for the
// daemon's lifetime (flock on <dir>/LOCK, holding the owner's pid), so two
// daemons can never share one directory.
//
// Not thread-safe; owned by the daemon.
#ifndef KVDEPOT_SERVER_DATA_DIR_H_
#define KVDEPOT_SERVER_DATA_DIR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvdepot {

class DataDir {
 public:
  // FailedPrecondition when another process holds the lock (the message
  // names its pid); PermissionDenied / Internal when the directory cannot be
  // created or written.
  static absl::StatusOr<std::unique_ptr<DataDir>> Open(const std::string& path);
  ~DataDir();
  DataDir(const DataDir&) = delete;
  DataDir& operator=(const DataDir&) = delete;

  const std::string& path() const { return path_; }
  // Size of the filesystem the directory is on; 0 when it cannot be told.
  uint64_t FilesystemBytes() const;

 private:
  DataDir(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  const std::string path_;
  const int lock_fd_;
};

// The NVMe tier's files take more than its blocks: replaced and evicted
// blocks stay in blob files until garbage collection, which starts at 20%
// garbage (about 1.25x), plus RocksDB's metadata files; and while the
// filesystem is full the tier takes no writes until space comes back.
// Returns a warning for the log when `nvme_capacity` is over three quarters
// of a filesystem of `filesystem_bytes`; empty otherwise (0 is unknown).
std::string NvmeHeadroomWarning(uint64_t nvme_capacity, uint64_t filesystem_bytes);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DATA_DIR_H_
