#include "storage/rocksdb_crc32c.h"

#include <dlfcn.h>

#include <array>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kvdepot {
namespace {

// The mangled name of rocksdb::crc32c::Extend(uint32_t, const char*, size_t)
// (RocksDB 6 to 9).
constexpr char kExtendSymbol[] = "_ZN7rocksdb6crc32c6ExtendEjPKcm";

// Bit-at-a-time tables, only for a process where neither the crc32
// instruction nor librocksdb's code can be had (should not happen).
uint32_t ExtendPortable(uint32_t crc, const char* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
    return t;
  }();
  uint32_t l = ~crc;
  for (size_t i = 0; i < n; ++i) {
    l = table[(l ^ static_cast<uint8_t>(data[i])) & 0xFF] ^ (l >> 8);
  }
  return ~l;
}

#if defined(__x86_64__)
// Long buffers run as three interleaved streams, so the crc32 instruction's
// latency (3 cycles) is hidden: each round feeds kStripe bytes to each
// stream and joins them. CRC registers are linear, so the register after
// A|B|C (|B| = |C| = kStripe) is
//   Shift(Shift(reg(A)) ^ reg0(B)) ^ reg0(C),
// where reg0 starts from 0 and Shift advances a register over kStripe zero
// bytes: a GF(2)-linear map, kept as four byte-indexed tables.
constexpr size_t kStripe = 4096;

struct ShiftTables {
  uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) uint32_t ZeroFeed(uint32_t reg, size_t n) {
  uint64_t l = reg;
  for (size_t i = 0; i < n / 8; ++i) l = _mm_crc32_u64(l, 0);
  return static_cast<uint32_t>(l);
}

const ShiftTables& StripeShift() {
  static const ShiftTables* tables = [] {
    auto* t = new ShiftTables;
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        t->t[k][b] = ZeroFeed(b << (8 * k), kStripe);
      }
    }
    return t;
  }();
  return *tables;
}

inline uint32_t Shift(const ShiftTables& s, uint32_t reg) {
  return s.t[0][reg & 0xFF] ^ s.t[1][(reg >> 8) & 0xFF] ^
         s.t[2][(reg >> 16) & 0xFF] ^ s.t[3][reg >> 24];
}

// RocksDB's convention: `crc` is a finished CRC (0 for none yet); the
// register runs inverted.
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc,
                                                       const char* data,
                                                       size_t n) {
  uint64_t l = ~crc & 0xFFFFFFFFu;
  while (n > 0 && (reinterpret_cast<uintptr_t>(data) & 7) != 0) {
    l = _mm_crc32_u8(static_cast<uint32_t>(l), static_cast<uint8_t>(*data));
    ++data;
    --n;
  }
  if (n >= 3 * kStripe) {
    const ShiftTables& shift = StripeShift();
    while (n >= 3 * kStripe) {
      uint64_t l1 = 0, l2 = 0;
      for (size_t i = 0; i < kStripe; i += 8) {
        uint64_t w0, w1, w2;
        std::memcpy(&w0, data + i, 8);
        std::memcpy(&w1, data + kStripe + i, 8);
        std::memcpy(&w2, data + 2 * kStripe + i, 8);
        l = _mm_crc32_u64(l, w0);
        l1 = _mm_crc32_u64(l1, w1);
        l2 = _mm_crc32_u64(l2, w2);
      }
      const uint32_t ab =
          Shift(shift, static_cast<uint32_t>(l)) ^ static_cast<uint32_t>(l1);
      l = Shift(shift, ab) ^ static_cast<uint32_t>(l2);
      data += 3 * kStripe;
      n -= 3 * kStripe;
    }
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, data, 8);
    l = _mm_crc32_u64(l, word);
    data += 8;
    n -= 8;
  }
  while (n > 0) {
    l = _mm_crc32_u8(static_cast<uint32_t>(l), static_cast<uint8_t>(*data));
    ++data;
    --n;
  }
  return ~static_cast<uint32_t>(l);
}

bool CpuHasSse42() { return __builtin_cpu_supports("sse4.2"); }
#else
bool CpuHasSse42() { return false; }
#endif

// KVDEPOT_ROCKSDB_CRC32C=librocksdb keeps librocksdb's own code (to compare).
bool Declined() {
  const char* env = std::getenv("KVDEPOT_ROCKSDB_CRC32C");
  return env != nullptr && std::strcmp(env, "librocksdb") == 0;
}

Crc32cExtendFn Chosen() {
#if defined(__x86_64__)
  if (CpuHasSse42() && !Declined()) return ExtendSse42;
#endif
  Crc32cExtendFn theirs = LibRocksdbCrc32cExtend();
  return theirs != nullptr ? theirs : ExtendPortable;
}

}  // namespace

Crc32cExtendFn LibRocksdbCrc32cExtend() {
  return reinterpret_cast<Crc32cExtendFn>(dlsym(RTLD_NEXT, kExtendSymbol));
}

absl::string_view RocksCrc32cImplementation() {
#if defined(__x86_64__)
  // librocksdb binds its calls to the first definition in the process's
  // lookup order: this executable's, when the link exported it.
  void* bound = dlsym(RTLD_DEFAULT, kExtendSymbol);
  void* theirs = reinterpret_cast<void*>(LibRocksdbCrc32cExtend());
  if (bound == nullptr || theirs == nullptr || bound == theirs) {
    return "librocksdb's (kvdepot's crc32c is not bound in this process)";
  }
  if (!CpuHasSse42()) return "librocksdb's (the CPU has no SSE4.2)";
  if (Declined()) return "librocksdb's (KVDEPOT_ROCKSDB_CRC32C=librocksdb)";
  return "crc32 instruction (SSE4.2)";
#else
  return "librocksdb's (not x86-64)";
#endif
}

}  // namespace kvdepot

#if defined(__x86_64__)
namespace rocksdb {
namespace crc32c {

// Takes the place of librocksdb's definition (see rocksdb_crc32c.h).
__attribute__((visibility("default"))) uint32_t Extend(uint32_t init_crc,
                                                       const char* data,
                                                       size_t n) {
  static const kvdepot::Crc32cExtendFn impl = kvdepot::Chosen();
  return impl(init_crc, data, n);
}

}  // namespace crc32c
}  // namespace rocksdb
#endif
