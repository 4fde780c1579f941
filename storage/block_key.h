// Limits and validation of the names the store accepts: keys (opaque bytes,
// 1..256) and namespaces (printable names such as
// "llama3-8b/bf16/nhd/b16/tp0").
#ifndef KVDEPOT_STORAGE_BLOCK_KEY_H_
#define KVDEPOT_STORAGE_BLOCK_KEY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

inline constexpr size_t kMaxKeyBytes = 256;
inline constexpr size_t kMaxNamespaceBytes = 128;

// Returns InvalidArgument for an empty key or one longer than kMaxKeyBytes.
// `what` names the field in the message ("key", "parent key").
absl::Status ValidateKey(absl::string_view key, absl::string_view what = "key");

// Returns InvalidArgument unless `ns` is 1..kMaxNamespaceBytes characters of
// [A-Za-z0-9._:/@+=-].
absl::Status ValidateNamespace(absl::string_view ns);

// Lower-case hex of `bytes`, cut to `max_bytes` input bytes with "..." (for
// log and error messages).
std::string KeyToHex(absl::string_view bytes, size_t max_bytes = 64);

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_BLOCK_KEY_H_
