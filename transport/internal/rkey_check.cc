#include "transport/internal/rkey_check.h"

#include <sys/ipc.h>
#include <sys/shm.h>
#include <ucp/api/ucp.h>
#include <ucs/memory/memory_type.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvdepot::transport_internal {
namespace {

template <typename T>
T Read(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// [base, base + size) within [start, start + length)?
bool Within(uint64_t base, uint64_t size, uint64_t start, uint64_t length) {
  return base >= start && base - start <= length &&
         size <= length - (base - start);
}

absl::Status CheckSysv(absl::string_view key, uint64_t base, uint64_t size) {
  const int32_t shmid = Read<int32_t>(key.data());
  const uint64_t address = Read<uint64_t>(key.data() + 4);
  shmid_ds ds{};
  if (shmctl(shmid, IPC_STAT, &ds) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote key names System V segment ", shmid,
        ", which cannot be attached: ", std::strerror(errno)));
  }
  if (!Within(base, size, address, ds.shm_segsz)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote region [", base, ", +", size, ") is not inside its segment [",
        address, ", +", ds.shm_segsz, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckPosix(absl::string_view key, uint64_t base, uint64_t size) {
  const uint64_t address = Read<uint64_t>(key.data() + 8);
  const uint64_t length = Read<uint64_t>(key.data() + 16);
  if (!Within(base, size, address, length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote region [", base, ", +", size, ") is not inside its segment [",
        address, ", +", length, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

bool KnownRkeyLayouts() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return major == 1 && minor == 13;
}

absl::Status CheckPackedRkey(absl::string_view packed, uint64_t base,
                             uint64_t size) {
  static const bool known = KnownRkeyLayouts();
  return CheckPackedRkey(packed, base, size, known);
}

absl::Status CheckPackedRkey(absl::string_view packed, uint64_t base,
                             uint64_t size, bool known_layouts) {
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
    const absl::string_view key = packed.substr(at, n);
    at += n;
    if (!known_layouts) continue;
    absl::Status st = absl::OkStatus();
    if (n == 12) st = CheckSysv(key, base, size);
    if (n == 24) st = CheckPosix(key, base, size);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::transport_internal
