#include "storage/checksum.h"

#if KVDEPOT_HAVE_XXH3_DISPATCH
// The same XXH3-64, with the widest vector unit the CPU has (AVX2, AVX-512)
// chosen at run time; without the dispatcher, libxxhash's SSE2 build.
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#define KVDEPOT_XXH3_64 XXH3_64bits_dispatch
#else
#include <xxhash.h>
#define KVDEPOT_XXH3_64 XXH3_64bits
#endif

namespace kvdepot {

uint64_t BlockChecksum(const void* data, size_t size) {
  return KVDEPOT_XXH3_64(data, size);
}

}  // namespace kvdepot
