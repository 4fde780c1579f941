// DataDir: kvdepotd's data directory, created if missing and locked for the
// daemon's lifetime (flock on <dir>/LOCK, holding the owner's pid), so two
// daemons can never share one directory.
//
// Not thread-safe; owned by the daemon.
#ifndef KVDEPOT_SERVER_DATA_DIR_H_
#define KVDEPOT_SERVER_DATA_DIR_H_

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

 private:
  DataDir(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  const std::string path_;
  const int lock_fd_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DATA_DIR_H_
