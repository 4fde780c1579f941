#include "server/data_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace kvdepot {
namespace {

absl::Status ErrnoStatus(int err, const std::string& what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == EACCES || err == EPERM || err == EROFS) {
    return absl::PermissionDeniedError(msg);
  }
  return absl::InternalError(msg);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataDir>> DataDir::Open(const std::string& path) {
  // A directory kvdepotd makes is its own (0700): its blocks are users'
  // prompts, and the files in it are made under the process's umask.
  std::string clean = path;  // "dir/" is "dir"
  while (clean.size() > 1 && clean.back() == '/') clean.pop_back();
  const std::filesystem::path dir(clean);
  if (dir.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(dir.parent_path(), ec);
    if (ec) {
      return ErrnoStatus(ec.value(),
                         absl::StrCat("cannot create data dir ", path));
    }
  }
  if (::mkdir(clean.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("cannot create data dir ", path));
  }
  struct stat st;
  if (::stat(clean.c_str(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot use data dir ", path));
  }
  if (!S_ISDIR(st.st_mode)) {
    return ErrnoStatus(ENOTDIR, absl::StrCat("cannot use data dir ", path));
  }
  std::vector<std::string> warnings;
  // Only a directory its user owns can kvdepotd change; a volume mounted
  // for it (a Kubernetes emptyDir, 0777) is the platform's to set.
  if (st.st_uid == ::geteuid() && (st.st_mode & S_IRWXO) != 0) {
    warnings.push_back(absl::StrFormat(
        "data dir %s is open to other users (mode %04o): they can read the "
        "stored blocks, which come from users' prompts; chmod o-rwx it",
        path, st.st_mode & 07777));
  }
  std::string lock_path = path + "/LOCK";
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot open ", lock_path));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    char buf[32] = {0};
    ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    if (err == EWOULDBLOCK) {
      std::string owner = n > 0 ? std::string(absl::StripAsciiWhitespace(buf)) : "?";
      return absl::FailedPreconditionError(absl::StrCat(
          "data dir ", path, " is in use by another kvdepotd (pid ", owner, ")"));
    }
    return ErrnoStatus(err, absl::StrCat("cannot lock ", lock_path));
  }
  std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    int err = errno;
    if (err == ENOSPC || err == EDQUOT) {
      // The lock is the flock, held; the pid only names the holder. A full
      // filesystem must not keep kvdepotd from starting: DRAM still serves.
      warnings.push_back(absl::StrCat("cannot write the pid into ", lock_path,
                                      ": ", std::strerror(err)));
    } else {
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("cannot write ", lock_path));
    }
  }
  return std::unique_ptr<DataDir>(new DataDir(path, fd, std::move(warnings)));
}

DataDir::~DataDir() { ::close(lock_fd_); }  // releases the flock

uint64_t DataDir::FilesystemBytes() const {
  struct statvfs fs;
  if (statvfs(path_.c_str(), &fs) != 0) return 0;
  return static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
}

std::string NvmeHeadroomWarning(uint64_t nvme_capacity, uint64_t filesystem_bytes) {
  if (nvme_capacity == 0 || filesystem_bytes == 0 ||
      nvme_capacity <= filesystem_bytes / 4 * 3) {
    return "";
  }
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  return absl::StrFormat(
      "nvme_capacity (%.1f GiB) is over 3/4 of the data directory's "
      "filesystem (%.1f GiB): the NVMe tier's files hold up to about 1.25x "
      "its blocks until garbage collection catches up, and it takes no "
      "writes while the filesystem is full; lower nvme_capacity or give it "
      "a larger filesystem",
      nvme_capacity / kGiB, filesystem_bytes / kGiB);
}

absl::Status CheckDramFitsMemoryLimit(uint64_t dram_capacity,
                                      HugePageMode hugepages,
                                      std::optional<uint64_t> cgroup_left,
                                      uint64_t hugetlb_free_bytes,
                                      std::optional<uint64_t> mem_available) {
  if (hugepages == HugePageMode::kOn) return absl::OkStatus();
  if (hugepages == HugePageMode::kAuto && hugetlb_free_bytes >= dram_capacity) {
    return absl::OkStatus();
  }
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  if (cgroup_left.has_value() &&
      dram_capacity + kDramLimitReserve > *cgroup_left) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "dram_capacity (%.2f GiB) does not fit this process's memory limit: "
        "its cgroups (a container's or unit's limit, or a slice's above it) allow "
        "%.2f GiB more, and the DRAM tier is mapped and prefaulted at start, "
        "with about %.2f GiB for the rest of kvdepotd: the kernel would kill "
        "it. Lower dram_capacity, or raise the limit (kvdepotd needs "
        "dram_capacity plus grpc_memory_limit and about 1 GiB under load)",
        dram_capacity / kGiB, *cgroup_left / kGiB, kDramLimitReserve / kGiB));
  }
  if (mem_available.has_value() &&
      dram_capacity + kDramLimitReserve > *mem_available) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "dram_capacity (%.2f GiB) does not fit this host's available memory "
        "(MemAvailable %.2f GiB): the DRAM tier is mapped and prefaulted at "
        "start, with about %.2f GiB for the rest of kvdepotd, and the kernel "
        "would kill it. Lower dram_capacity or free memory",
        dram_capacity / kGiB, *mem_available / kGiB, kDramLimitReserve / kGiB));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
