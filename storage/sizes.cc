#include "storage/sizes.h"

#include <cctype>
#include <cmath>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvdepot {

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) {
    ++i;
  }
  const absl::string_view digits = s.substr(0, i);
  double number;
  if (i == 0 || !absl::SimpleAtod(digits, &number)) {
    return absl::InvalidArgumentError(absl::StrCat("bad size '", text, "'"));
  }
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(i)));
  static const std::map<std::string, uint64_t> kUnits = {
      {"", 1},          {"b", 1},
      {"k", uint64_t{1} << 10}, {"kib", uint64_t{1} << 10}, {"kb", 1000},
      {"m", uint64_t{1} << 20}, {"mib", uint64_t{1} << 20}, {"mb", 1000000},
      {"g", uint64_t{1} << 30}, {"gib", uint64_t{1} << 30}, {"gb", 1000000000},
      {"t", uint64_t{1} << 40}, {"tib", uint64_t{1} << 40}, {"tb", 1000000000000}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad size unit in '", text, "' (use B, KiB, MiB, GiB, TiB)"));
  }
  const uint64_t unit_bytes = it->second;
  auto too_large = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", text, "' is too large (at most 2^64-1 bytes)"));
  };
  if (digits.find('.') == absl::string_view::npos) {
    // A whole number: exact in integers (a double is exact only to 2^53).
    uint64_t n;
    if (!absl::SimpleAtoi(digits, &n) || (n != 0 && unit_bytes > ~uint64_t{0} / n)) {
      return too_large();  // only digits, so the only way SimpleAtoi fails
    }
    return n * unit_bytes;
  }
  // A fraction: to the nearest byte. 2^64 is exact as a double, and the
  // comparison is false for NaN and infinity too, so the conversion below
  // is always in range.
  const double bytes = std::round(number * static_cast<double>(unit_bytes));
  if (!(bytes < 0x1p64)) return too_large();
  if (bytes == 0 && number != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", text, "' is less than half a byte"));
  }
  return static_cast<uint64_t>(bytes);
}

std::string FormatSize(uint64_t bytes) {
  for (auto [shift, unit] : {std::pair{40, "TiB"}, std::pair{30, "GiB"},
                             std::pair{20, "MiB"}, std::pair{10, "KiB"}}) {
    uint64_t one = uint64_t{1} << shift;
    if (bytes >= one && bytes % one == 0) return absl::StrCat(bytes >> shift, unit);
  }
  return absl::StrCat(bytes, "B");
}

}  // namespace kvdepot
