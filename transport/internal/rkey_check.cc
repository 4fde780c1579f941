#include "transport/internal/rkey_check.h"

#include <fcntl.h>
#include <sys/ipc.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <ucs/memory/memory_type.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"

namespace kvdepot::transport_internal {
namespace {

template <typename T>
T Read(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// OK when the registered region [base, base + size) lies within the
// segment [start, start + length).
absl::Status CheckWithin(uint64_t base, uint64_t size, uint64_t start,
                         uint64_t length) {
  if (base >= start && base - start <= length && size <= length - (base - start)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "remote region [", base, ", +", size, ") is not inside its segment [",
      start, ", +", length, ")"));
}

// OK when `owner` is unset or is `uid`, the owner of segment `what`.
absl::Status CheckOwner(const std::string& what, uint32_t uid,
                        std::optional<uint32_t> owner) {
  if (!owner || *owner == uid) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "remote key names ", what, ", which belongs to uid ", uid,
      ", not to the client's uid ", *owner));
}

absl::Status CheckSysv(absl::string_view key, uint64_t base, uint64_t size,
                       std::optional<uint32_t> owner) {
  const int32_t shmid = Read<int32_t>(key.data());
  const uint64_t address = Read<uint64_t>(key.data() + 4);
  shmid_ds ds{};
  if (shmctl(shmid, IPC_STAT, &ds) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote key names System V segment ", shmid,
        ", which cannot be attached: ", std::strerror(errno)));
  }
  if (absl::Status mine = CheckOwner(absl::StrCat("System V segment ", shmid),
                                     ds.shm_perm.uid, owner);
      !mine.ok()) {
    return mine;
  }
  return CheckWithin(base, size, address, ds.shm_segsz);
}

// UCX 1.13's POSIX segment id: flags in the top bits; with kProcfs the
// owner's pid (low 30 bits) and its descriptor of the segment (next 30),
// otherwise the id in the name of a /dev/shm file (kShmOpen).
constexpr uint64_t kProcfs = uint64_t{1} << 63;
constexpr uint64_t kShmOpen = uint64_t{1} << 62;
constexpr uint64_t kPidNamespace = uint64_t{1} << 60;
constexpr uint64_t kLow30 = (uint64_t{1} << 30) - 1;
constexpr absl::string_view kUcxShmPrefix = "/dev/shm/ucx_shm_posix_";

absl::Status CheckPosix(absl::string_view key, uint64_t base, uint64_t size,
                        std::optional<uint32_t> owner) {
  const uint64_t id = Read<uint64_t>(key.data());
  const uint64_t address = Read<uint64_t>(key.data() + 8);
  const uint64_t length = Read<uint64_t>(key.data() + 16);
  if (absl::Status within = CheckWithin(base, size, address, length); !within.ok()) {
    return within;
  }
  // The file UCX will open and map: it must open, and hold `length` bytes
  // (a shorter file maps, then faults a transfer past its end).
  std::string path;
  if ((id & kProcfs) != 0) {
    // Another PID namespace: its pid means nothing here, and UCX does not
    // unpack such keys (the transport is unreachable).
    if ((id & kPidNamespace) != 0) return absl::OkStatus();
    path = absl::StrCat("/proc/", id & kLow30, "/fd/", (id >> 30) & kLow30);
    // Only a UCX segment: not any file some process has open, which the
    // daemon would otherwise map and write blocks into.
    char target[256] = {};
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n < 0 || absl::string_view(target, static_cast<size_t>(n))
                         .substr(0, kUcxShmPrefix.size()) != kUcxShmPrefix) {
      return absl::InvalidArgumentError(absl::StrCat(
          "remote key names ", path, ", which is not a UCX shared-memory segment"));
    }
  } else if ((id & kShmOpen) != 0) {
    path = absl::StrCat(kUcxShmPrefix, absl::Hex(id & ((uint64_t{1} << 60) - 1)));
  } else {
    return absl::InvalidArgumentError(
        "remote key names a POSIX segment outside /dev/shm (unsupported)");
  }
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote key names POSIX segment ", path, ", which cannot be opened: ",
        std::strerror(errno)));
  }
  struct stat st {};
  const bool stated = fstat(fd, &st) == 0;
  close(fd);
  if (stated) {
    if (absl::Status mine = CheckOwner(absl::StrCat("POSIX segment ", path),
                                       st.st_uid, owner);
        !mine.ok()) {
      return mine;
    }
  }
  if (!stated || static_cast<uint64_t>(st.st_size) < length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "POSIX segment ", path, " is smaller than the ", length,
        " bytes its key claims"));
  }
  return absl::OkStatus();
}

// The sizes of UCX 1.13's shared-memory transport keys.
constexpr size_t kSysvKeySize = 12;
constexpr size_t kPosixKeySize = 24;

}  // namespace

absl::StatusOr<std::string> StripSharedMemoryKeys(absl::string_view packed) {
  if (!KnownRkeyLayouts()) return std::string(packed);
  uint64_t kept_map = 0;
  std::string kept;
  absl::StatusOr<size_t> end =
      ForEachTransportKey(packed, [&](int md, absl::string_view key) {
        if (key.size() != kSysvKeySize && key.size() != kPosixKeySize) {
          kept_map |= uint64_t{1} << md;
          kept.append(key.data() - 1, 1 + key.size());  // size byte and key
        }
        return absl::OkStatus();
      });
  if (!end.ok()) return end.status();
  std::string out(reinterpret_cast<const char*>(&kept_map), sizeof(kept_map));
  out.push_back(packed[sizeof(uint64_t)]);  // memory type
  out += kept;
  out.append(packed.data() + *end, packed.size() - *end);  // trailing bytes
  return out;
}

bool KnownRkeyLayouts() {
  static const bool known = [] {
    unsigned major = 0, minor = 0, release = 0;
    ucp_get_version(&major, &minor, &release);
    return major == 1 && minor == 13;
  }();
  return known;
}

absl::Status CheckPackedRkey(absl::string_view packed, uint64_t base,
                             uint64_t size, std::optional<uint32_t> owner) {
  return CheckPackedRkeyForLayouts(packed, base, size, KnownRkeyLayouts(),
                                   owner);
}

absl::StatusOr<size_t> ForEachTransportKey(
    absl::string_view packed,
    absl::FunctionRef<absl::Status(int md, absl::string_view key)> fn) {
  constexpr size_t kHeader = sizeof(uint64_t) + 1;  // MD bitmap, memory type
  if (packed.size() < kHeader) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote key of ", packed.size(), " bytes is shorter than its header"));
  }
  const uint64_t md_map = Read<uint64_t>(packed.data());
  const uint8_t mem_type = static_cast<uint8_t>(packed[8]);
  if (md_map == 0) {
    return absl::InvalidArgumentError("remote key names no memory domain");
  }
  if (mem_type >= UCS_MEMORY_TYPE_LAST) {
    return absl::InvalidArgumentError(
        absl::StrCat("remote key has unknown memory type ", mem_type));
  }
  size_t at = kHeader;
  for (int md = 0; md < 64; ++md) {
    if ((md_map & (uint64_t{1} << md)) == 0) continue;
    if (at >= packed.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "remote key ends before the key of memory domain ", md));
    }
    const size_t n = static_cast<uint8_t>(packed[at++]);
    if (n > packed.size() - at) {
      return absl::InvalidArgumentError(absl::StrCat(
          "remote key of memory domain ", md, " says ", n, " bytes, ",
          packed.size() - at, " are left"));
    }
    if (absl::Status st = fn(md, packed.substr(at, n)); !st.ok()) return st;
    at += n;
  }
  return at;
}

absl::Status CheckPackedRkeyForLayouts(absl::string_view packed, uint64_t base,
                                       uint64_t size, bool known_layouts,
                                       std::optional<uint32_t> owner) {
  return ForEachTransportKey(
             packed,
             [&](int md, absl::string_view key) -> absl::Status {
               if (!known_layouts) return absl::OkStatus();
               // Sizes of UCX 1.13's transport keys: 0 (tcp, self), 8
               // (InfiniBand), 12 (System V), 24 (POSIX in /dev/shm). Any
               // other could fail to unpack, and that crashes UCX 1.13:
               // refused.
               switch (key.size()) {
                 case 0:
                 case 8:
                   return absl::OkStatus();
                 case kSysvKeySize:
                   return CheckSysv(key, base, size, owner);
                 case kPosixKeySize:
                   return CheckPosix(key, base, size, owner);
                 default:
                   return absl::InvalidArgumentError(absl::StrCat(
                       "remote key of memory domain ", md, " has ",
                       key.size(),
                       " bytes, a layout this UCX version is not known to "
                       "unpack safely"));
               }
             })
      .status();
}

}  // namespace kvdepot::transport_internal
