#include "server/quota_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "storage/block_key.h"
#include "storage/status_macros.h"

namespace kvdepot {

absl::Status QuotaFile::Load(TieredStore& store) {
  struct stat info;
  if (::stat(path_.c_str(), &info) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read ", path_, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, " is not a regular file (kvdepotd keeps the quotas there)"));
  }
  std::ifstream in(path_);
  if (!in) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read ", path_, ": ", std::strerror(errno)));
  }
  std::map<std::string, uint64_t> quotas;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    // kvdepotd writes "NAMESPACE BYTES" lines; a hand edit may leave blank
    // lines, "#" comments (no namespace starts with "#") and stray spaces.
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    std::vector<absl::string_view> parts =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    uint64_t bytes = 0;
    if (parts.size() != 2 || !ValidateNamespace(parts[0]).ok() ||
        !absl::SimpleAtoi(parts[1], &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ":", n, ": expected \"NAMESPACE BYTES\", got \"", line, "\""));
    }
    if (!quotas.emplace(std::string(parts[0]), bytes).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ":", n, ": namespace ", parts[0],
                       " has a quota on an earlier line"));
    }
  }
  for (const auto& [ns, bytes] : quotas) {
    // The file and the configuration disagree (more declared namespaces
    // than max_namespaces): a configuration error, which a restart does
    // not fix (kvdepotd exits 2, and systemd does not restart it).
    if (absl::Status set = store.SetQuota(ns, bytes); !set.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": namespace ", ns, ": ", set.message(),
          " (raise max_namespaces, or take lines out of the file)"));
    }
  }
  absl::MutexLock lock(&mu_);
  quotas_ = std::move(quotas);
  return absl::OkStatus();
}

absl::Status QuotaFile::Set(TieredStore& store, absl::string_view ns,
                            uint64_t max_bytes) {
  RETURN_IF_ERROR(ValidateNamespace(ns));
  absl::MutexLock lock(&mu_);
  // The store first: a quota it refuses (too many namespaces) must not
  // reach the file, or the next start would fail to load it.
  const uint64_t old_quota = store.Quota(ns);
  RETURN_IF_ERROR(store.SetQuota(ns, max_bytes));
  std::map<std::string, uint64_t> before = quotas_;
  // Declared before (by this file) or only now (SetQuota declared it).
  const bool was_declared = before.count(std::string(ns)) > 0;
  quotas_[std::string(ns)] = max_bytes;
  if (absl::Status st = WriteLocked(); !st.ok()) {
    quotas_ = std::move(before);
    // Take back all SetQuota did: a namespace it declared would otherwise
    // take puts (create_namespaces off) and never be reclaimed, until a
    // restart that knows nothing of it.
    (was_declared ? store.SetQuota(ns, old_quota) : store.Undeclare(ns))
        .IgnoreError();
    // A failure after the rename left the new quota in the file: put the
    // old one back (best effort), so a restart loads what the daemon runs.
    WriteLocked().IgnoreError();
    return st;
  }
  return absl::OkStatus();
}

absl::Status QuotaFile::Remove(TieredStore& store, absl::string_view ns) {
  RETURN_IF_ERROR(ValidateNamespace(ns));
  absl::MutexLock lock(&mu_);
  auto it = quotas_.find(std::string(ns));
  if (it != quotas_.end()) {
    // The file first: a declaration the file still held would come back
    // at the next start.
    const uint64_t old_quota = it->second;
    quotas_.erase(it);
    if (absl::Status st = WriteLocked(); !st.ok()) {
      quotas_[std::string(ns)] = old_quota;
      WriteLocked().IgnoreError();
      return st;
    }
  }
  return store.Undeclare(ns);
}

absl::Status QuotaFile::WriteLocked() {
  std::string text;
  for (const auto& [ns, bytes] : quotas_) absl::StrAppend(&text, ns, " ", bytes, "\n");
  const std::string tmp = path_ + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  auto fail = [&](const char* what) {
    absl::Status st = absl::UnavailableError(
        absl::StrCat("cannot ", what, " ", tmp, ": ", std::strerror(errno)));
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return st;
  };
  if (fd < 0) return fail("create");
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("write");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("sync");
  if (::close(fd) != 0) {
    fd = -1;
    return fail("close");
  }
  fd = -1;
  if (::rename(tmp.c_str(), path_.c_str()) != 0) return fail("rename");
  // The rename reaches the disk with its directory: until that is synced a
  // power loss can bring the old file back.
  const std::string dir = path_.substr(0, std::max<size_t>(path_.rfind('/'), 1));
  const int dir_fd = ::open(path_.find('/') == std::string::npos ? "." : dir.c_str(),
                            O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0 || ::fsync(dir_fd) != 0) {
    absl::Status st = absl::UnavailableError(absl::StrCat(
        "cannot sync the directory of ", path_, ": ", std::strerror(errno)));
    if (dir_fd >= 0) ::close(dir_fd);
    return st;
  }
  ::close(dir_fd);
  return absl::OkStatus();
}

}  // namespace kvdepot
