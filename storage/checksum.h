// Block checksums: XXH3-64 of a block's bytes (seed 0), computed by writers
// and verified by the daemon before a block becomes visible.
#ifndef KVDEPOT_STORAGE_CHECKSUM_H_
#define KVDEPOT_STORAGE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvdepot {

uint64_t BlockChecksum(const void* data, size_t size);
inline uint64_t BlockChecksum(absl::string_view bytes) {
  return BlockChecksum(bytes.data(), bytes.size());
}

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_CHECKSUM_H_
