// UcxContext: one UCP context (ucp_init) for a process: the UCX
// configuration, the transports UCX found, and memory registration.
//
// Thread-safe. A context must outlive every worker and region made from it.
#ifndef KVDEPOT_TRANSPORT_UCX_CONTEXT_H_
#define KVDEPOT_TRANSPORT_UCX_CONTEXT_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "transport/memory_region.h"

namespace kvdepot {

struct UcxContextOptions {
  // UCX settings passed through to ucp_config_modify, over whatever UCX_*
  // environment variables say. Names as the environment variables have
  // them, with or without "UCX_": {"TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"},
  // {"TCP_TX_SEG_SIZE", "512k"}. Create fails with InvalidArgument for a
  // name UCX has no setting of, or a value it refuses (CheckUcxSetting).
  //
  // UCX 1.13 ignores a transport setting given with its transport's prefix
  // ("TCP_TX_SEG_SIZE": "invalid configuration" warning) and applies it
  // without ("TX_SEG_SIZE") to every transport that has a setting of that
  // name. So the prefix of the transports in kTransportPrefixes is dropped
  // here; settings of other transports must be given without theirs. (The
  // posix and sysv transports name their shared-memory settings MM_<name>
  // inside their tables: "MM_FIFO_SIZE" sets both; "MM_" is not dropped.)
  std::map<std::string, std::string> config;
  // Shows in UCX's logs and tools.
  std::string name = "kvdepot";
};

// The transport prefixes UcxContextOptions::config drops.
inline constexpr const char* kTransportPrefixes[] = {
    "TCP_", "POSIX_", "SYSV_", "CMA_", "SELF_", "XPMEM_", "KNEM_"};
// The name UCX is given for setting `key` of UcxContextOptions::config:
// without "UCX_" and a prefix of kTransportPrefixes ("UCX_TCP_TX_SEG_SIZE",
// "TCP_TX_SEG_SIZE" and "TX_SEG_SIZE" are one setting).
std::string UcxSettingName(std::string_view key);
// Whether UCX takes setting `key` (a key of UcxContextOptions::config, as
// UcxSettingName names it) with `value`, asked of UCX's own configuration
// tables: UCP's, UCS's, and those of every transport module installed,
// whether or not this machine has its devices (one configuration serves a
// fleet). InvalidArgument naming the setting when no table has it (UCX
// 1.13 only warns, once per worker, and goes on without it) or when a
// table that has it refuses `value` (UCX turns the data plane, or that
// transport, off). Not thread-safe with the first loading of UCX's
// modules: call it before workers are made (Create calls it).
//
// That asks UCX's internal configuration API, whose signatures change
// between releases: CMake enables it (KVDEPOT_UCX_CONFIG_TABLES) only where
// the calls used compile and link (UCX 1.13, Debian 12's). Elsewhere the
// check is CheckUcxSettingByUcp's, and a name no table has is found only
// by UCX's own warning when workers are made.
absl::Status CheckUcxSetting(std::string_view key, std::string_view value);
// What UCX's public API checks of a setting: ucp_config_modify on a fresh
// configuration. It refuses a bad value of UCP's or UCS's own settings;
// every other name is taken (UCX keeps it for the transports).
absl::Status CheckUcxSettingByUcp(std::string_view key, std::string_view value);
// Whether CheckUcxSetting asks UCX's configuration tables (this build's UCX
// has the internal API it uses) rather than CheckUcxSettingByUcp.
bool UcxSettingsCheckedAgainstTables();
// The value `config` (a UcxContextOptions::config) gives the setting UCX
// calls `name` (of several keys that name it, the last in the map), or
// nullopt: UCX_TLS, TLS and tls are all "TLS" here.
std::optional<std::string> UcxConfigValue(
    const std::map<std::string, std::string>& config, std::string_view name);

// UCX's names of its shared-memory transports, aliases included.
inline constexpr absl::string_view kSharedMemoryTransports[] = {
    "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"};
// Whether UCX may use one of `transports` under the TLS setting of
// `config` (else the environment's UCX_TLS, else UCX's default, "all"): a
// list names the transports allowed ("all" allows every one), or, when it
// begins with "^", those excluded.
bool UcxTlsAllows(const std::map<std::string, std::string>& config,
                  absl::Span<const absl::string_view> transports);

// This machine as the data plane names it (machine id + boot id): a client
// and a daemon with equal ids may share memory.
std::string LocalHostId();

// The segment sizes of UCX's TCP transport. Two peers must agree: UCX 1.13
// aborts a process that receives a segment larger than its own RX size
// (tcp_ep.c "Assertion hdr->length <= rx_seg_size"), so each side's tx
// must be at most the other's rx (transport/README, caveat 5).
struct TcpSegmentSizes {
  uint64_t tx = 0;
  uint64_t rx = 0;
};
// Whether a peer with `theirs` can talk TCP to a process with `ours`.
inline bool TcpSegmentsFit(const TcpSegmentSizes& ours,
                           const TcpSegmentSizes& theirs) {
  return theirs.tx <= ours.rx && ours.tx <= theirs.rx;
}

class UcxContext {
 public:
  // ucp_init with one-sided RMA and wakeup (event fd) support. Returns
  // InvalidArgument for a bad setting, Unavailable when UCX finds no usable
  // transport (e.g. UCX_TLS names none present here).
  static absl::StatusOr<std::unique_ptr<UcxContext>> Create(
      const UcxContextOptions& options);

  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  // REQUIRES: every worker and region made from this context is gone.
  ~UcxContext();

  // Registers [base, base + size) for one-sided access by peers (the server's
  // arena) or as a local source/destination of transfers (a client's
  // buffer), so that no transfer registers memory on the fly. The memory
  // must stay mapped until the region is destroyed. Host memory only:
  // InvalidArgument for memory UCX reports as device memory (a UCX built
  // with CUDA/ROCm support), a null base or a zero size; the UCX error when
  // registration fails.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* base,
                                                         size_t size);

  // Allocates `size` bytes through UCX and registers them (ucp_mem_map with
  // UCP_MEM_MAP_ALLOCATE). UCX takes memory a co-located peer can map
  // (posix shared memory) where its transports can, so one-sided transfers
  // from a peer on the same host are plain copies into it instead of
  // messages (see README.md, caveat 1). Every page exists when it returns
  // (prefaulted), so no transfer into it faults. Freed with the region.
  // ResourceExhausted for more than the host's available memory or what
  // this process's memory cgroup still allows, or where the pages cannot be
  // made (UCX's shared-memory file system is smaller; on kernels before
  // 5.14, without MADV_POPULATE_WRITE, that is a SIGBUS instead).
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t size);

  // The UCP handle, for UcxWorker. Thread-safe as UCX's context is.
  ucp_context_h handle() const { return context_; }

  // The TCP segment sizes this context's workers use (the environment,
  // then the options, as UCX's TCP transport reads them); nullopt when
  // UCX has no TCP transport here.
  const std::optional<TcpSegmentSizes>& tcp_segments() const {
    return tcp_segments_;
  }

 private:
  explicit UcxContext(ucp_context_h context) : context_(context) {}
  // ucp_mem_map of [base, base + size), or of `size` new bytes when base is
  // null; packs the rkey.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Map(void* base, size_t size);
  // Makes every page of [base, base + size) exist (MADV_POPULATE_WRITE, or
  // a write to each page where the kernel lacks it); ResourceExhausted
  // where the kernel cannot.
  static absl::Status Prefault(char* base, size_t size);

  const ucp_context_h context_;
  std::optional<TcpSegmentSizes> tcp_segments_;
};

namespace transport_internal {

// The value of `field` ("MemAvailable", "HugePages_Free") in a
// /proc/meminfo file: in bytes for a size ("... kB"), else the number as
// written (a page count); nullopt where absent or unreadable.
std::optional<uint64_t> MeminfoValue(absl::string_view field,
                                     const std::string& path = "/proc/meminfo");

// What the memory cgroups of a process still allow it (a container's or a
// systemd unit's limit less its usage, less the inactive page cache that
// would be reclaimed; the least over cgroup v1 and v2, and over the
// process's cgroup and its ancestors, e.g. a systemd slice), from its
// /proc/<pid>/cgroup file `proc_cgroup` and the cgroup file system mounted
// at `root` ("/sys/fs/cgroup"); where the cgroup that file names is not in
// that mount (a container sharing the host's cgroup namespace), the
// mount's root cgroup. nullopt where none has a limit it can read.
// /proc/meminfo shows the host's memory, not this.
std::optional<uint64_t> CgroupMemoryLeft(const std::string& proc_cgroup,
                                         const std::string& root);

}  // namespace transport_internal

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_UCX_CONTEXT_H_
