// Checks on a peer's packed UCX remote key before ucp_ep_rkey_unpack sees
// it. UCX trusts packed keys: it has no length for them, and in UCX 1.13 a
// key whose shared-memory part cannot be attached (a crafted one, or the
// segment of a client that died before the daemon unpacked its key) makes
// ucp_ep_rkey_unpack release uninitialised transport keys and crash the
// process. A remote region larger than the segment behind the key would
// make a later transfer write past the mapping. So:
//
//  - any UCX: the key must parse: an MD bitmap, a memory type UCX knows,
//    and for each MD bit a size byte and that many bytes, all within the
//    string;
//  - UCX 1.13 (the layouts kvdepot was tested with; Debian 12): each
//    12-byte transport key is a System V segment {int32 shmid, uint64
//    address}: the segment must exist and [base, base + size) must lie
//    within [address, address + its size); each 24-byte key is a POSIX
//    segment {uint64 id, uint64 address, uint64 length}: [base, base + size)
//    must lie within [address, address + length), and the file UCX will map
//    (/proc/<pid>/fd/<fd> or /dev/shm/ucx_shm_posix_<id>) must be a UCX
//    segment in /dev/shm at least `length` long; 0- and 8-byte keys (tcp,
//    self, InfiniBand) carry nothing to check; keys of any other size are
//    refused.
//
// What is left: a segment that vanishes between this check and the unpack
// (microseconds); a local client naming a UCX segment of another process of
// its own user (the owner check ties keys to the user, not the process: a
// same-user process could read and write that memory anyway); POSIX keys
// of another PID namespace (UCX does not unpack those); on other UCX
// versions only the structure is checked.
#ifndef KVDEPOT_TRANSPORT_INTERNAL_RKEY_CHECK_H_
#define KVDEPOT_TRANSPORT_INTERNAL_RKEY_CHECK_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot::transport_internal {

// Whether this process's UCX is one whose shared-memory key layouts
// CheckPackedRkey knows (1.13). Asks UCX once.
bool KnownRkeyLayouts();

// Walks a packed key: checks its structure (an MD bitmap naming at least
// one MD, a memory type UCX knows, and for each MD bit a size byte and that
// many bytes, all within the string) and calls fn(md, transport_key) for
// each, in order, stopping at the first error it returns. Returns the
// offset just past the last transport key (UCX's trailing bytes follow),
// or InvalidArgument / fn's error.
absl::StatusOr<size_t> ForEachTransportKey(
    absl::string_view packed,
    absl::FunctionRef<absl::Status(int md, absl::string_view key)> fn);

// OK, or InvalidArgument saying what is wrong with the key for a remote
// region [base, base + size). With `owner`, each System V and POSIX segment
// the key names (with known layouts) must belong to that uid: a co-located
// client may only have the daemon reach its own user's shared memory.
absl::Status CheckPackedRkey(absl::string_view packed, uint64_t base,
                             uint64_t size, std::optional<uint32_t> owner);

// The key without its shared-memory transport keys (UCX 1.13's System V
// and POSIX layouts: their MD bits cleared, their bytes removed), for a
// peer on another host: its segments are not on this host, and a key that
// names one here (by chance or on purpose) must not attach it. Other keys,
// and trailing bytes, are kept. Unchanged when the layouts are not known.
// InvalidArgument when the key does not parse.
absl::StatusOr<std::string> StripSharedMemoryKeys(absl::string_view packed);

// The same with the layouts of UCX 1.13 assumed or not (for tests).
absl::Status CheckPackedRkeyForLayouts(absl::string_view packed, uint64_t base,
                                       uint64_t size, bool known_layouts,
                                       std::optional<uint32_t> owner = std::nullopt);

}  // namespace kvdepot::transport_internal

#endif  // KVDEPOT_TRANSPORT_INTERNAL_RKEY_CHECK_H_
