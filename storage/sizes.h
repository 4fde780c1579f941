// Sizes as people write them: "1GiB", "256KiB", "1.5GiB", "4096", and their
// shortest exact rendering. Shared by kvdepotd's flags and config file and by
// the tools.
#ifndef KVDEPOT_STORAGE_SIZES_H_
#define KVDEPOT_STORAGE_SIZES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// Parses "1GiB", "512MiB", "64KiB", "1.5GiB", "4096" (bytes; also KB/MB/GB/TB
// as powers of 1000 and K/M/G/T as powers of 1024; case-insensitive).
// A whole number of units is exact; a fraction rounds to the nearest byte
// (halves away from zero). Zero is accepted (callers bound the range).
// InvalidArgument for anything else: no digits, an unknown unit, a size
// past 2^64-1 bytes, or a non-zero size that rounds to 0 bytes ("0.4" is
// not "0", which callers such as `quota set` read as "no limit").
absl::StatusOr<uint64_t> ParseSize(absl::string_view text);

// "256KiB" for 262144, "2GiB", or "1000B" when not a whole KiB.
std::string FormatSize(uint64_t bytes);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_SIZES_H_
