// QuotaFile: the namespace quotas an operator set (kvdepotctl quota set),
// kept in <data-dir>/quotas so that they survive a restart. One line per
// namespace, "NAMESPACE BYTES" (0: no limit, but the namespace is declared:
// with create_namespaces off, clients may put only into namespaces an
// operator declared); the file is rewritten whole (temporary file,
// fsync, rename) on every change, so a crash leaves the old or the new one.
//
// Thread-safe.
#ifndef KVDEPOT_SERVER_QUOTA_FILE_H_
#define KVDEPOT_SERVER_QUOTA_FILE_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "storage/tiered_store.h"

namespace kvdepot {

class QuotaFile {
 public:
  explicit QuotaFile(std::string path) : path_(std::move(path)) {}

  // Reads the file and applies each quota to `store`. A missing file means
  // no quotas. Blank lines, "#" comments and extra spaces are allowed.
  // InvalidArgument (naming the line) for a malformed file, a namespace
  // given twice, or a path that is not a regular file; the store's error
  // (e.g. more namespaces than max_namespaces), naming the file.
  absl::Status Load(TieredStore& store);
  // Applies `ns`'s quota (0 for no limit) to `store`, then records it and
  // rewrites the file. On an error (the store refuses it, the write fails)
  // nothing changes, but a namespace the store created stays.
  absl::Status Set(TieredStore& store, absl::string_view ns, uint64_t max_bytes);
  // Removes `ns`'s quota and declaration (TieredStore::Undeclare) and its
  // line from the file. On a write error nothing changes.
  absl::Status Remove(TieredStore& store, absl::string_view ns);

 private:
  absl::Status WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  std::map<std::string, uint64_t> quotas_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_QUOTA_FILE_H_
