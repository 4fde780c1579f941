// DaemonConfig: everything kvdepotd can be told, from its YAML file and its
// command line (flags override the file). Defaults are the embedded,
// loopback-only setup a new user gets with no configuration at all.
#ifndef KVDEPOT_SERVER_CONFIG_H_
#define KVDEPOT_SERVER_CONFIG_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "storage/sizes.h"  // ParseSize, for flags and the config file
#include "storage/tiered_store.h"

namespace kvdepot {

struct DaemonConfig {
  std::string listen = "127.0.0.1:50551";
  // Who may make the admin calls (SetDraining, SetQuota, Verify, Compact):
  // "local", a process on this host owned by root or by kvdepotd's user
  // (kvdepotctl beside it: `kubectl exec`, ssh), or "any" peer (gRPC has
  // no authentication: only where every peer that can reach `listen` is
  // trusted). See KvDepotService::set_admin_from_any_peer.
  std::string admin_peers = "local";
  std::string metrics_listen = "127.0.0.1:9551";  // empty: no metrics endpoint
  // The metrics port's connections served at once, and how long one may
  // take to send its request (HttpServerOptions): idle or slow clients
  // delay a scrape only when they hold all the threads.
  int metrics_threads = 128;
  absl::Duration metrics_request_timeout = absl::Seconds(2);
  // Namespaces (the first seen) with their own `namespace` label value in
  // the lookup metrics; the rest are counted as "(other)".
  int metrics_namespace_labels = 32;
  std::string data_dir = "./kvdepot-data";
  // On SIGTERM, write DRAM-only blocks to the NVMe tier before exiting.
  bool persist_on_shutdown = true;
  std::string log_level = "info";  // trace, debug, info, warn, error
  std::string log_format = "text";  // text, json (one object per line)
  // Empty: stderr. A file is appended to and reopened on SIGHUP.
  std::string log_file;
  // Most threads of gRPC's synchronous server (health checks); the API runs
  // on gRPC's callback threads.
  int grpc_max_threads = 64;
  // gRPC's buffer memory for all connections (ResourceQuota): under load
  // gRPC slows reads instead of growing past it.
  uint64_t grpc_memory_limit = uint64_t{1} << 30;
  // Concurrent calls one client connection may have open.
  int grpc_max_streams_per_connection = 1024;
  // gRPC connections are pinged when idle this long, and closed when a ping
  // is not answered within min(20 s, this): a client whose host died
  // without closing its connections (power loss, a partition) does not
  // keep them, and their memory, for ever. Zero: no pings.
  absl::Duration grpc_keepalive = absl::Seconds(60);
  // How long SIGTERM waits for in-flight RPCs before cancelling them.
  absl::Duration drain_timeout = absl::Seconds(8);
  // A Read or Write stream that moves no message for this long is cancelled
  // (it holds DRAM outside any session lease).
  absl::Duration stream_idle_timeout = absl::Seconds(60);
  StoreOptions store = DaemonStoreDefaults();

  // UCX data plane (server/data_plane.h). When UCX cannot start (no usable
  // transport), kvdepotd logs why and serves the gRPC byte path only.
  bool ucx_enabled = true;
  // UCX settings passed through (names as UCX's environment variables, with
  // or without "UCX_"): e.g. TLS: tcp, NET_DEVICES: eth0. A config file's
  // `ucx` mapping goes over these defaults, setting by setting. The defaults are
  // what measurement here showed to matter: TCP segments of 512k instead of
  // 8k take loopback TCP from ~0.7 to several GB/s for 256 KiB blocks.
  std::map<std::string, std::string> ucx = {{"TCP_TX_SEG_SIZE", "512k"},
                                            {"TCP_RX_SEG_SIZE", "512k"}};
  // Progress threads of the data plane (2 measured 10-20% faster than 1
  // here, over TCP and shared memory alike).
  int ucx_workers = 2;
  // Co-located clients (shared memory) that get a UCX worker and progress
  // thread of their own (DataPlaneOptions::max_colocated_workers); beyond
  // it they are served over TCP.
  int ucx_colocated_workers = 64;
  // Buffers one session may register (DataPlaneOptions::
  // max_buffers_per_session); libkvdepot opens a new session past it.
  int ucx_max_buffers_per_session = 256;
  // Longest a PushBlocks / PullBlocks transfer may take; past it the
  // client's endpoint is closed and its session ended.
  absl::Duration ucx_transfer_timeout = absl::Seconds(10);

  // The daemon's store defaults differ from the library's in one respect:
  // it prefaults its DRAM tier at start.
  static StoreOptions DaemonStoreDefaults() {
    StoreOptions o;
    o.prefault_dram = true;
    o.nvme_capacity = uint64_t{8} << 30;  // in <data_dir>/nvme
    return o;
  }
};

// "always" (0) or "reads>=N" (N): which blocks leaving DRAM go to NVMe.
absl::StatusOr<uint32_t> ParseAdmission(absl::string_view text);
// "auto", "on"/"true", "off"/"false".
absl::StatusOr<HugePageMode> ParseHugePages(absl::string_view text);
// "30s", "500ms", "2m" (absl duration syntax). InvalidArgument when
// negative or infinite ("inf").
absl::StatusOr<absl::Duration> ParseDurationFlag(absl::string_view text);

// Checks a listen address: HOST:PORT, HOST an IPv4 address, a host name or
// an IPv6 address in brackets ("[::1]:9551"), PORT 0..65535 (0 picks a free
// one). InvalidArgument saying what is wrong.
absl::Status CheckListenAddress(absl::string_view address);

// Applies the keys of a YAML file to `config`. Unknown keys are an error (a
// typo must not silently fall back to a default), and so are a key given
// twice (at the top or in `ucx`, where "TLS" and "UCX_TLS" are one setting)
// and a key that is not a plain scalar. Every error is InvalidArgument;
// nothing throws.
absl::Status LoadConfigFile(const std::string& path, DaemonConfig* config);

// Cross-field checks (watermarks, sizes, addresses, session_lease within
// the store's [min_lease, max_lease]).
absl::Status ValidateConfig(const DaemonConfig& config);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CONFIG_H_
