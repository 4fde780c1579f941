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

#include <algorithm>
#include <cstring>
#include <memory>

namespace kvdepot {

uint64_t BlockChecksum(const void* data, size_t size) {
  return KVDEPOT_XXH3_64(data, size);
}

uint64_t CopyWithChecksum(char* dst, const char* src, size_t size) {
  // 64 KiB: well inside any L2 cache, and a multiple of XXH3's 1 KiB
  // block, so the streaming state hashes whole blocks straight from `dst`
  // instead of buffering them. (8 to 256 KiB pieces measured the same here:
  // the hash from cache adds about a quarter to the copy.)
  constexpr size_t kPiece = 64 * 1024;
  if (size <= kPiece) {
    std::memcpy(dst, src, size);
    return KVDEPOT_XXH3_64(dst, size);
  }
  struct FreeState {
    void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
  };
  thread_local std::unique_ptr<XXH3_state_t, FreeState> state(
      XXH3_createState());
  XXH3_64bits_reset(state.get());
  for (size_t off = 0; off < size; off += kPiece) {
    const size_t n = std::min(kPiece, size - off);
    std::memcpy(dst + off, src + off, n);
    KVDEPOT_XXH3_64_UPDATE(state.get(), dst + off, n);
  }
  return XXH3_64bits_digest(state.get());
}

}  // namespace kvdepot
