// Block checksums: XXH3-64 of a block's bytes (seed 0), computed by writers
// and verified by the daemon before a block becomes visible.
#ifndef KVDEPOT_STORAGE_CHECKSUM_H_
#define KVDEPOT_STORAGE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

#include <optional>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvdepot {

uint64_t BlockChecksum(const void* data, size_t size);
inline uint64_t BlockChecksum(absl::string_view bytes) {
  return BlockChecksum(bytes.data(), bytes.size());
}

// Copies `size` bytes from `src` to `dst` (which must not overlap) and
// returns the BlockChecksum of the bytes as they landed in `dst`. The copy
// goes in pieces small enough to stay in cache, each hashed right after it
// is written, so checking a copy costs no second pass over memory.
uint64_t CopyWithChecksum(char* dst, const char* src, size_t size);

// CopyWithChecksum that stops once `deadline` has passed, checked before
// every MiB (so at most a MiB is written after it): nullopt then, with
// `dst` partly written. For copies into memory of another process that
// gives up at `deadline` (a co-located client's buffer).
std::optional<uint64_t> CopyWithChecksumUntil(char* dst, const char* src,
                                              size_t size, absl::Time deadline);

// The same for a destination that is not read again soon (the DRAM arena):
// pieces go through a small buffer of this thread's, are hashed there, and
// are written to `dst` with non-temporal stores, which spare the cache and
// the read of every destination line that plain stores make first.
uint64_t CopyToMemoryWithChecksum(char* dst, const char* src, size_t size);
// The same, stopping once `deadline` has passed (checked first and before
// every MiB, as CopyWithChecksumUntil): nullopt then, `dst` partly written.
std::optional<uint64_t> CopyToMemoryWithChecksumUntil(char* dst, const char* src,
                                                      size_t size, absl::Time deadline);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_CHECKSUM_H_
