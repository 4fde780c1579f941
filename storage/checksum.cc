#include "storage/checksum.h"

#if KVDEPOT_HAVE_XXH3_DISPATCH
// The same XXH3-64, with the widest vector unit the CPU has (AVX2, AVX-512)
// chosen at run time; without the dispatcher, libxxhash's SSE2 build.
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#define KVDEPOT_XXH3_64 XXH3_64bits_dispatch
#define KVDEPOT_XXH3_64_UPDATE XXH3_64bits_update_dispatch
#else
#include <xxhash.h>
#define KVDEPOT_XXH3_64 XXH3_64bits
#define KVDEPOT_XXH3_64_UPDATE XXH3_64bits_update
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "absl/time/clock.h"

namespace kvdepot {

uint64_t BlockChecksum(const void* data, size_t size) {
  return KVDEPOT_XXH3_64(data, size);
}

namespace {

struct FreeState {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

// A reset XXH3 state of this thread's.
XXH3_state_t* FreshState() {
  thread_local std::unique_ptr<XXH3_state_t, FreeState> state(
      XXH3_createState());
  XXH3_64bits_reset(state.get());
  return state.get();
}

// Copies `n` bytes (a multiple of 64) from `src` (in cache) to `dst`
// (64-byte aligned) with non-temporal stores where the CPU has them: the
// lines go to memory without being read into the cache first.
void StreamOut(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  for (size_t i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace

std::optional<uint64_t> CopyToMemoryWithChecksumUntil(char* dst, const char* src,
                                                      size_t size,
                                                      absl::Time deadline) {
  // 16 KiB pieces, each copied into a buffer of this thread's (L1), hashed
  // there and streamed out: what is hashed is what is written, whatever
  // happens to `src` meanwhile. The deadline is checked before every MiB.
  constexpr size_t kPiece = 16 * 1024;
  constexpr size_t kPiecesPerCheck = (1 << 20) / kPiece;
  const bool timed = deadline != absl::InfiniteFuture();
  if (timed && absl::Now() >= deadline) return std::nullopt;
  alignas(64) thread_local char bounce[kPiece];
  XXH3_state_t* state = FreshState();
  // Up to dst's first 64-byte boundary with plain stores.
  size_t off = std::min<size_t>(
      size, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(bounce, src, off);
  KVDEPOT_XXH3_64_UPDATE(state, bounce, off);
  std::memcpy(dst, bounce, off);
  for (size_t piece = 0; off < size; ++piece) {
    if (timed && piece > 0 && piece % kPiecesPerCheck == 0 &&
        absl::Now() >= deadline) {
#if defined(__SSE2__)
      _mm_sfence();
#endif
      return std::nullopt;
    }
    const size_t n = std::min(kPiece, size - off);
    std::memcpy(bounce, src + off, n);
    KVDEPOT_XXH3_64_UPDATE(state, bounce, n);
    const size_t whole = n - n % 64;
    StreamOut(dst + off, bounce, whole);
    std::memcpy(dst + off + whole, bounce + whole, n - whole);
    off += n;
  }
#if defined(__SSE2__)
  _mm_sfence();  // the streamed stores are visible before anything after
#endif
  return XXH3_64bits_digest(state);
}

uint64_t CopyToMemoryWithChecksum(char* dst, const char* src, size_t size) {
  return *CopyToMemoryWithChecksumUntil(dst, src, size, absl::InfiniteFuture());
}

namespace {

// 64 KiB: well inside any L2 cache, and a multiple of XXH3's 1 KiB block,
// so the streaming state hashes whole blocks straight from `dst` instead of
// buffering them. (8 to 256 KiB pieces measured the same here: the hash
// from cache adds about a quarter to the copy.)
constexpr size_t kPiece = 64 * 1024;

// Copies `size` bytes in pieces of kPiece, each hashed into `state` right
// after it is written.
void CopyAndHash(XXH3_state_t* state, char* dst, const char* src, size_t size) {
  for (size_t off = 0; off < size; off += kPiece) {
    const size_t n = std::min(kPiece, size - off);
    std::memcpy(dst + off, src + off, n);
    KVDEPOT_XXH3_64_UPDATE(state, dst + off, n);
  }
}

}  // namespace

uint64_t CopyWithChecksum(char* dst, const char* src, size_t size) {
  if (size <= kPiece) {
    std::memcpy(dst, src, size);
    return KVDEPOT_XXH3_64(dst, size);
  }
  XXH3_state_t* state = FreshState();
  CopyAndHash(state, dst, src, size);
  return XXH3_64bits_digest(state);
}

std::optional<uint64_t> CopyWithChecksumUntil(char* dst, const char* src,
                                              size_t size, absl::Time deadline) {
  constexpr size_t kStep = 1 << 20;
  if (size <= kStep) {
    if (absl::Now() >= deadline) return std::nullopt;
    return CopyWithChecksum(dst, src, size);
  }
  XXH3_state_t* state = FreshState();
  for (size_t off = 0; off < size; off += kStep) {
    if (absl::Now() >= deadline) return std::nullopt;
    CopyAndHash(state, dst + off, src + off, std::min(kStep, size - off));
  }
  return XXH3_64bits_digest(state);
}

}  // namespace kvdepot
