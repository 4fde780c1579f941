// DataDir: kvdepotd's data directory, created if missing and locked for the
// daemon's lifetime (flock on <dir>/LOCK, holding the owner's pid), so two
// daemons can never share one directory.
//
// Not thread-safe; owned by the daemon.
#ifndef KVDEPOT_SERVER_DATA_DIR_H_
#define KVDEPOT_SERVER_DATA_DIR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/dram_arena.h"  // HugePageMode

namespace kvdepot {

class DataDir {
 public:
  // Creates the directory (mode 0700) if missing. FailedPrecondition when
  // another process holds the lock (the message names its pid);
  // PermissionDenied / Internal when the directory cannot be created or
  // written.
  static absl::StatusOr<std::unique_ptr<DataDir>> Open(const std::string& path);
  ~DataDir();
  DataDir(const DataDir&) = delete;
  DataDir& operator=(const DataDir&) = delete;

  const std::string& path() const { return path_; }
  // Size of the filesystem the directory is on; 0 when it cannot be told.
  uint64_t FilesystemBytes() const;
  // For the log: the directory is open to other users, or the pid could not
  // be written into LOCK (a full filesystem; the lock is held all the same).
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  DataDir(std::string path, int lock_fd, std::vector<std::string> warnings)
      : path_(std::move(path)),
        lock_fd_(lock_fd),
        warnings_(std::move(warnings)) {}
  const std::string path_;
  const int lock_fd_;
  const std::vector<std::string> warnings_;
};

// The NVMe tier's files take more than its blocks: replaced and evicted
// blocks stay in blob files until garbage collection, which starts at 20%
// garbage (about 1.25x), plus RocksDB's metadata files; and while the
// filesystem is full the tier takes no writes until space comes back.
// Returns a warning for the log when `nvme_capacity` is over three quarters
// of a filesystem of `filesystem_bytes`; empty otherwise (0 is unknown).
std::string NvmeHeadroomWarning(uint64_t nvme_capacity, uint64_t filesystem_bytes);

// The DRAM tier is one mapping, prefaulted at start (and filled by puts
// anyway): in a memory cgroup (a container's limit, a unit's MemoryMax)
// that it does not fit, or on a host without the memory, the kernel kills
// kvdepotd before it logs a word. ResourceExhausted, saying what to change,
// when `dram_capacity` and kDramLimitReserve (the rest of the process) pass
// `cgroup_left`, what the process's cgroups still allow, or
// `mem_available`, the host's MemAvailable (nullopt: no limit known); OK
// otherwise, and where the tier will come from explicit hugepages, which
// neither counts: `hugepages` on, or auto with `hugetlb_free_bytes` (free
// 2 MiB hugepages, the arena's: FreeHugetlbBytes) enough for it.
inline constexpr uint64_t kDramLimitReserve = uint64_t{256} << 20;
absl::Status CheckDramFitsMemoryLimit(
    uint64_t dram_capacity, HugePageMode hugepages,
    std::optional<uint64_t> cgroup_left, uint64_t hugetlb_free_bytes,
    std::optional<uint64_t> mem_available = std::nullopt);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DATA_DIR_H_
