#include "storage/checksum.h"

#include <xxhash.h>

namespace kvdepot {

uint64_t BlockChecksum(const void* data, size_t size) {
  return XXH3_64bits(data, size);
}

}  // namespace kvdepot
