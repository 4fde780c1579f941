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
  double number;
  if (i == 0 || !absl::SimpleAtod(s.substr(0, i), &number)) {
    return absl::InvalidArgumentError(absl::StrCat("bad size '", text, "'"));
  }
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(i)));
  static const std::map<std::string, double> kUnits = {
      {"", 1},          {"b", 1},
      {"k", 1024.0},    {"kib", 1024.0},           {"kb", 1e3},
      {"m", 1048576.0}, {"mib", 1048576.0},        {"mb", 1e6},
      {"g", 1073741824.0}, {"gib", 1073741824.0},  {"gb", 1e9},
      {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad size unit in '", text, "' (use B, KiB, MiB, GiB, TiB)"));
  }
  double bytes = number * it->second;
  if (bytes >= 1.8e19) {
    return absl::InvalidArgumentError(absl::StrCat("size '", text, "' is too large"));
  }
  return static_cast<uint64_t>(std::llround(bytes));
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
