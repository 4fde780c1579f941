// Daemon: one running kvdepotd. Owns the data dir lock, the TieredStore, the
// gRPC server (KvDepot + grpc.health.v1), the metrics endpoint and a
// maintenance thread (session expiry, metric gauges). main() builds one from
// a DaemonConfig; tests may embed one.
//
// Start() and Shutdown() are called from one thread; everything else is
// internal.
#ifndef KVDEPOT_SERVER_DAEMON_H_
#define KVDEPOT_SERVER_DAEMON_H_

#include <grpcpp/server.h>
#include <prometheus/registry.h>
#include <spdlog/logger.h>

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/config.h"
#include "server/data_dir.h"
#include "server/data_plane.h"
#include "server/http_server.h"
#include "server/kvdepot_service.h"
#include "server/metrics.h"
#include "server/status_page.h"
#include "storage/clock.h"
#include "storage/tiered_store.h"

namespace kvdepot {

class Daemon {
 public:
  // Opens the data dir, maps the DRAM tier and starts serving. Errors name
  // what failed (address in use, data dir locked, ...).
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const DaemonConfig& config, std::shared_ptr<spdlog::logger> logger);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Drains: reports NOT_SERVING, refuses new puts, waits up to
  // drain_timeout for in-flight RPCs, then stops. Idempotent.
  void Shutdown();

  // The bound addresses (the real port when 0 was asked).
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  TieredStore& store() { return *store_; }

 private:
  Daemon(const DaemonConfig& config, std::shared_ptr<spdlog::logger> logger);
  absl::Status Init();
  // The store's stats for the metrics and the maintenance loop's log, with
  // an NVMe tier not opened at start shown as one that takes no writes.
  StoreStats StatsForMetrics() const;
  // Keeps the data plane's UCX listeners on the devices where `listen` is,
  // unless `ucx` (or UCX_NET_DEVICES) names them (transport/net_devices.h),
  // and logs which.
  void ChooseUcxDevices(std::map<std::string, std::string>& ucx) const;
  void MaintenanceLoop();

  const DaemonConfig config_;
  const std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<DataDir> data_dir_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<TieredStore> store_;
  // Why the configured NVMe tier was not opened (its file system full at
  // start: the daemon serves from DRAM alone); empty when it was.
  std::string nvme_unopened_;
  uint64_t nvme_configured_capacity_ = 0;
  std::unique_ptr<QuotaFile> quota_file_;  // <data-dir>/quotas
  std::unique_ptr<KvDepotService> service_;
  // After service_ (destroyed before it: its lost-session callback and the
  // transfers' completions call into the service).
  std::unique_ptr<DataPlane> data_plane_;
  std::unique_ptr<grpc::Server> server_;
  std::string grpc_address_;
  std::string metrics_address_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // The gRPC server is up and answers its health check SERVING (what the
  // status page's `health` says too).
  bool grpc_serving_ ABSL_GUARDED_BY(mu_) = false;
  std::thread maintenance_;
  // The metrics port. Last, so destroyed first: its handlers read store_,
  // registry_ and mu_.
  std::unique_ptr<StatusPage> status_page_;
  std::unique_ptr<HttpServer> http_server_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DAEMON_H_
