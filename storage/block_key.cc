#include "storage/block_key.h"

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvdepot {

absl::Status ValidateKey(absl::string_view key, absl::string_view what) {
  if (key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  }
  if (key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", key.size(), " bytes; the limit is ",
                     kMaxKeyBytes));
  }
  return absl::OkStatus();
}

absl::Status ValidateNamespace(absl::string_view ns) {
  if (ns.empty()) return absl::InvalidArgumentError("namespace is empty");
  if (ns.size() > kMaxNamespaceBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace is ", ns.size(), " bytes; the limit is ",
                     kMaxNamespaceBytes));
  }
  for (char c : ns) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == ':' ||
              c == '/' || c == '@' || c == '+' || c == '=' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "namespace may contain only letters, digits and ._:/@+=-");
    }
  }
  return absl::OkStatus();
}

std::string KeyToHex(absl::string_view bytes, size_t max_bytes) {
  if (bytes.size() <= max_bytes) return absl::BytesToHexString(bytes);
  return absl::StrCat(absl::BytesToHexString(bytes.substr(0, max_bytes)),
                      "...");
}

}  // namespace kvdepot
