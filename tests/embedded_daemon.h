// A kvdepotd embedded in a test process (Daemon::Start), for tests that
// need its internals: test sync points, a store to reach into.
#ifndef KVDEPOT_TESTS_EMBEDDED_DAEMON_H_
#define KVDEPOT_TESTS_EMBEDDED_DAEMON_H_

#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/config.h"
#include "server/daemon.h"
#include "tests/test_dir.h"

namespace kvdepot::testing {

// gRPC on a free loopback port, no metrics port, a fresh data dir
// (FreshTestDir(`dir_prefix`)), DRAM and NVMe tiers of 64 MiB, nothing
// persisted at shutdown. A test changes what it needs before starting it.
inline DaemonConfig EmbeddedDaemonConfig(const std::string& dir_prefix) {
  DaemonConfig config;
  config.listen = "127.0.0.1:0";
  config.metrics_listen = "";
  config.data_dir = FreshTestDir(dir_prefix);
  config.persist_on_shutdown = false;
  config.store.dram_capacity = uint64_t{64} << 20;
  config.store.nvme_capacity = uint64_t{64} << 20;
  return config;
}

// Starts `config` in this process, logging nowhere.
inline absl::StatusOr<std::unique_ptr<Daemon>> StartEmbeddedDaemon(
    const DaemonConfig& config) {
  return Daemon::Start(
      config, std::make_shared<spdlog::logger>(
                  "test", std::make_shared<spdlog::sinks::null_sink_mt>()));
}

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_EMBEDDED_DAEMON_H_
