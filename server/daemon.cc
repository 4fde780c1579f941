#include "server/daemon.h"

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "server/logging.h"
#include "server/version.h"
#include "storage/dram_arena.h"  // FreeHugetlbBytes
#include "storage/rocksdb_crc32c.h"
#include "storage/status_macros.h"
#include "transport/net_devices.h"
#include "transport/ucx_context.h"  // transport_internal::CgroupMemoryLeft, MeminfoValue

namespace kvdepot {
namespace {

// Whether `st` is a write refused for want of room (ENOSPC: no free
// blocks or no free inodes; RocksDB's NoSpace, "disk full"), not another
// error met where space is short (a corrupt database, another format).
bool IsNoSpace(const absl::Status& st) {
  return (absl::IsUnavailable(st) || absl::IsResourceExhausted(st)) &&
         (absl::StrContains(st.message(), "No space left on device") ||
          absl::StrContains(st.message(), ": disk full ("));
}

// `listen` ("HOST:PORT", validated) with the port it got.
std::string ListenedOn(const std::string& listen, int port) {
  absl::StatusOr<HostPort> split = SplitHostPort(listen);
  return JoinHostPort(split.ok() ? split->host : listen, port);
}

}  // namespace

Daemon::Daemon(const DaemonConfig& config, std::shared_ptr<spdlog::logger> logger)
    : config_(config), log_(std::move(logger)) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(
    const DaemonConfig& config, std::shared_ptr<spdlog::logger> logger) {
  RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<Daemon> d(new Daemon(config, std::move(logger)));
  RETURN_IF_ERROR(d->Init());
  return d;
}

StoreStats Daemon::StatsForMetrics() const {
  StoreStats st = store_->Stats();
  if (!nvme_unopened_.empty()) {
    // An NVMe tier configured and not opened (a full file system at start)
    // takes no writes: so say its gauge and the log's reminders, and
    // KvdepotNvmeNotWritable (which wants a capacity) fires.
    st.nvme_write_error = nvme_unopened_;
    st.nvme.capacity_bytes = nvme_configured_capacity_;
  }
  return st;
}

absl::Status Daemon::Init() {
  ASSIGN_OR_RETURN(data_dir_, DataDir::Open(config_.data_dir));
  for (const std::string& w : data_dir_->warnings()) log_->warn("{}", w);

  registry_ = std::make_shared<prometheus::Registry>();
  metrics_ = std::make_unique<ServerMetrics>(*registry_,
                                             config_.metrics_namespace_labels);
  metrics_->SetStartTime(absl::Now());
  StoreOptions store_options = config_.store;
  store_options.nvme_path = data_dir_->path() + "/nvme";
  if (std::string w = NvmeHeadroomWarning(store_options.nvme_capacity,
                                          data_dir_->FilesystemBytes());
      !w.empty()) {
    log_->warn("{}", w);
  }
  RETURN_IF_ERROR(CheckDramFitsMemoryLimit(
      store_options.dram_capacity, store_options.hugepages,
      transport_internal::CgroupMemoryLeft("/proc/self/cgroup",
                                           "/sys/fs/cgroup"),
      // The arena's pool (2 MiB pages), not the host's default size.
      FreeHugetlbBytes(),
      // Without prefaulting, a tier larger than the host's free memory is
      // the operator's deliberate overcommit.
      store_options.prefault_dram
          ? transport_internal::MeminfoValue("MemAvailable")
          : std::nullopt));
  absl::StatusOr<std::unique_ptr<TieredStore>> store =
      NewTieredStore(store_options, SystemClock());
  if (!store.ok() && store_options.nvme_capacity > 0 &&
      IsNoSpace(store.status())) {
    // RocksDB writes a new MANIFEST at every open, which a full file system
    // refuses: without this the daemon would not start at all (and crash
    // loop under systemd or Kubernetes) where a full disk should only stop
    // the NVMe tier. Its blocks stay on disk, untouched, for the next start
    // with room.
    log_->error(
        "NVMe tier not opened: its file system is full ({}); serving from "
        "DRAM alone until kvdepotd is restarted with room under {} (the "
        "tier's blocks are kept)",
        store.status().ToString(), store_options.nvme_path);
    nvme_unopened_ = absl::StrCat("not opened at start, its file system full (",
                                  store.status().message(),
                                  "); restart kvdepotd once there is room");
    nvme_configured_capacity_ = store_options.nvme_capacity;
    store_options.nvme_capacity = 0;
    store = NewTieredStore(store_options, SystemClock());
  }
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  // The tier gauges exist from the first scrape on, not from the
  // maintenance loop's first pass a second later.
  metrics_->UpdateFromStats(StatsForMetrics());

  if (!config_.metrics_listen.empty()) {
    status_page_ = std::make_unique<StatusPage>(
        StatusPage::Sources{[this] { return StatsForMetrics(); },
                            [this] { return registry_->Collect(); },
                            [this] {
                              // NOT_SERVING until the gRPC server is up, as its
                              // health check: the metrics port opens first.
                              absl::MutexLock lock(&mu_);
                              return grpc_serving_ && !shut_down_;
                            }},
        *SystemClock());
    status_page_->StartSampler();
    HttpServerOptions http;
    http.listen = config_.metrics_listen;
    http.threads = config_.metrics_threads;
    http.request_timeout = config_.metrics_request_timeout;
    ASSIGN_OR_RETURN(
        http_server_,
        HttpServer::Start(http, MetricsPortRoutes(*registry_, *status_page_),
                          log_));
    metrics_address_ = ListenedOn(config_.metrics_listen, http_server_->port());
  }

  quota_file_ = std::make_unique<QuotaFile>(data_dir_->path() + "/quotas");
  RETURN_IF_ERROR(quota_file_->Load(*store_));
  service_ = std::make_unique<KvDepotService>(*store_, *metrics_, *SystemClock(), log_);
  service_->set_quota_file(quota_file_.get());
  service_->set_admin_from_any_peer(config_.admin_peers == "any");
  if (config_.ucx_enabled) {
    DataPlaneOptions data_plane_options;
    data_plane_options.ucx = config_.ucx;
    ChooseUcxDevices(data_plane_options.ucx);
    data_plane_options.workers = config_.ucx_workers;
    data_plane_options.request_workers = config_.ucx_workers;
    data_plane_options.max_colocated_workers = config_.ucx_colocated_workers;
    data_plane_options.max_buffers_per_session =
        static_cast<uint32_t>(config_.ucx_max_buffers_per_session);
    data_plane_options.on_refused = [metrics = metrics_.get()](absl::StatusCode code) {
      metrics->RecordUcxRefused(code);
    };
    // This very executable (main.cc runs the sandbox when started with
    // kUcxAddressSandboxFlag): the file it was started from, even if a
    // newer one replaced it since, so the sandbox's UCX is the daemon's.
    data_plane_options.address_sandbox = "/proc/self/exe";
    absl::StatusOr<std::unique_ptr<DataPlane>> data_plane = DataPlane::Create(
        data_plane_options, store_->dram_region(),
        [this](SessionId session, const absl::Status& why) {
          service_->SessionLost(session, why);
        },
        log_);
    if (data_plane.ok()) {
      data_plane_ = *std::move(data_plane);
      service_->set_data_plane(data_plane_.get(), config_.ucx_transfer_timeout);
    } else {
      log_->warn("UCX data plane off ({}); clients use the gRPC byte path",
                 data_plane.status().ToString());
    }
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config_.listen, grpc::InsecureServerCredentials(), &port);
  // gRPC sets SO_REUSEPORT by default: a second kvdepotd on this address
  // would start and take a share of the connections (clients landing on a
  // daemon that does not know their session or blocks). One per address.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service_.get());
  grpc::ResourceQuota quota("kvdepotd");
  quota.SetMaxThreads(config_.grpc_max_threads);
  quota.Resize(config_.grpc_memory_limit);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             config_.grpc_max_streams_per_connection);
  if (config_.grpc_keepalive > absl::ZeroDuration()) {
    // gRPC never gives up on a connection whose peer vanished without a
    // FIN (its host lost power): pings find it. Also while no call is open
    // (a client whose requests go over UCX has none) and for as long as the
    // connection lives without data.
    const int64_t time_ms = absl::ToInt64Milliseconds(config_.grpc_keepalive);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(time_ms));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                               static_cast<int>(std::min<int64_t>(time_ms, 20000)));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  // Chunks are <= 1 MiB. A batch of max_batch_keys blocks must fit too, or
  // gRPC would refuse it as RESOURCE_EXHAUSTED ("no room" in our contract):
  // with 256-byte keys and parents a block's entry weighs about 600 bytes
  // (PullBlocks: key, parent, checksum, buffer range), so 1 KiB each.
  const int max_message = static_cast<int>(std::max<uint64_t>(
      uint64_t{32} << 20, uint64_t{config_.store.max_batch_keys} * 1024 + (1 << 20)));
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", config_.listen, " (address in use or invalid?)"));
  }
  grpc_address_ = ListenedOn(config_.listen, port);
  server_->GetHealthCheckService()->SetServingStatus(true);
  {
    absl::MutexLock lock(&mu_);
    grpc_serving_ = true;
  }

  maintenance_ = std::thread([this] { MaintenanceLoop(); });
  DramRegion dram = store_->dram_region();
  log_->debug("DRAM tier mapped at {} ({} bytes)",
              static_cast<const void*>(dram.base), dram.size);
  StoreStats st = store_->Stats();
  log_->info(
      "kvdepotd {} ({}) listening on {}; metrics on {}; UCX data plane {}; "
      "DRAM tier {} bytes (at most {} blocks); NVMe tier {} bytes holding {} "
      "blocks ({}reads; RocksDB CRC32C: {}; at most {} blocks); data dir {}",
      kVersion, kGitCommit, grpc_address_,
      metrics_address_.empty() ? "off" : metrics_address_,
      data_plane_ == nullptr         ? "off"
      : data_plane_->shared_memory() ? "on (shared memory for local clients)"
                                     : "on",
      dram.size, DramMaxBlocks(config_.store), st.nvme.capacity_bytes,
      st.nvme.blocks,
      config_.store.nvme_direct_reads ? "O_DIRECT " : "buffered ",
      std::string(RocksCrc32cImplementation()), NvmeMaxBlocks(config_.store),
      data_dir_->path());
  return absl::OkStatus();
}

void Daemon::ChooseUcxDevices(std::map<std::string, std::string>& ucx) const {
  if (std::optional<std::string> named = UcxNetDevicesSetting(ucx)) {
    log_->info("UCX data plane on network devices {} (as its settings name them)",
               *named);
    // UCX takes any name and leaves out what it does not find, silently.
    if (std::vector<std::string> missing = MissingNetDevices(*named);
        !missing.empty()) {
      log_->warn(
          "UCX NET_DEVICES names {}, which this host does not have (no "
          "/sys/class/net/NAME, or /sys/class/infiniband/DEV/ports/PORT for "
          "DEV:PORT): UCX leaves it out without a word, and the data plane "
          "is reported on while clients that cannot reach it over the devices "
          "left (with none left, likely every client) fall back to gRPC",
          absl::StrJoin(missing, ", "));
    }
    return;
  }
  UcxDeviceChoice devices = UcxDevicesFor(config_.listen);
  if (devices.confined()) {
    ucx["NET_DEVICES"] = *devices.net_devices;
    log_->info("UCX data plane on network devices {} ({})", *devices.net_devices,
               devices.why);
    return;
  }
  log_->warn(
      "UCX data plane on every network device ({}): over TCP, UCX 1.13 serves "
      "reads and writes of this process's memory to any peer that reaches its "
      "ports; keep those networks trusted, or name the devices in the config "
      "(ucx: NET_DEVICES)",
      devices.why);
}

void Daemon::MaintenanceLoop() {
  // A nearly full file system's message carries the free byte count, which
  // other writers move every second: logged when it starts, ends or
  // changes otherwise, and every 10 minutes while it lasts.
  ConditionLog nvme_write_error(absl::Minutes(10));
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Seconds(1));
    if (stopping_) break;
    mu_.Unlock();
    int expired = store_->ExpireSessions();
    if (expired > 0) log_->info("{} session(s) expired", expired);
    if (int dropped = store_->RetryCorruptDrops(); dropped > 0) {
      log_->info(
          "{} corrupt DRAM block(s) dropped now that no reader pins them",
          dropped);
    }
    service_->CancelIdleStreams(config_.stream_idle_timeout);
    service_->LogLeftOut();
    if (data_plane_ != nullptr) data_plane_->LogLeftOut();
    if (data_plane_ != nullptr) {
      data_plane_->DetachIf(
          [this](SessionId id) { return !store_->HasSession(id); });
    }
    const StoreStats stats = StatsForMetrics();
    if (nvme_write_error.ShouldLog(stats.nvme_write_error, absl::Now())) {
      if (stats.nvme_write_error.empty()) {
        log_->info("NVMe tier takes writes again");
      } else {
        log_->warn("NVMe tier takes no writes: {}", stats.nvme_write_error);
      }
    }
    metrics_->UpdateFromStats(stats);
    if (data_plane_ != nullptr) {
      metrics_->SetUcxColocatedWorkers(data_plane_->colocated_workers());
      metrics_->SetUcxRequestLinks(data_plane_->request_links());
      metrics_->SetUcxEndpointsClosing(data_plane_->endpoints_closing());
    }
    mu_.Lock();
  }
}

void Daemon::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_) {
    log_->info(
        "draining: refusing new puts, sessions and reads, waiting up to {} for "
        "in-flight RPCs",
        absl::FormatDuration(config_.drain_timeout));
    server_->GetHealthCheckService()->SetServingStatus(false);
    service_->BeginShutdown();
    store_->SetDraining(true);
    // A scrub or compaction (kvdepotctl verify/compact) can run for
    // minutes, and gRPC's shutdown waits for its call: cut it short.
    store_->StopNvmeMaintenance();
    // gRPC's own Shutdown does not wait for callback-API streams, so wait
    // for ours here: in-flight Read/Write streams may finish (a Write may
    // complete its block; new blocks are refused by the store) until the
    // drain timeout, then whatever is left is cancelled.
    const absl::Time deadline = absl::Now() + config_.drain_timeout;
    // Polls `count` until it is 0 or the drain deadline has passed; returns
    // what is left. Every 1 ms at first, backing off to 10 ms: a count
    // reads the store's Stats, which takes its locks, and a long drain must
    // not compete with the calls it waits for.
    auto drain = [deadline](auto count) {
      absl::Duration pause = absl::Milliseconds(1);
      while (count() > 0 && absl::Now() < deadline) {
        absl::SleepFor(std::min(pause, deadline - absl::Now()));
        pause = std::min(pause * 2, absl::Milliseconds(10));
      }
      return count();
    };
    // Two-phase puts reserved before the drain may commit too: their
    // clients are still writing the slots (over Write streams or UCX) and
    // will call CommitPut; ending their sessions now would lose puts
    // already accepted.
    size_t left = drain([this] {
      return service_->active_streams() + store_->Stats().session_reservations;
    });
    if (left > 0) {
      log_->warn("drain timeout: cancelling {} stream(s), aborting {} reserved put(s)",
                 service_->active_streams(), store_->Stats().session_reservations);
    }
    // Requests that came over UCX: new ones are refused, those in flight
    // finish their transfers (until the drain timeout; Close below cuts
    // what is left short).
    if (data_plane_ != nullptr) {
      data_plane_->StopRequests();
      drain([this] { return data_plane_->requests_in_flight(); });
    }
    // Unary calls in progress finish too (a PushBlocks waiting on its
    // transfer, a pinned lookup promoting from NVMe). Then gRPC's own
    // shutdown needs no grace period: given one, it also spends it waiting
    // for idle client connections to acknowledge its GOAWAY (a client whose
    // requests go over UCX has no call in flight to read its socket), which
    // made SIGTERM take the whole second.
    drain([this] { return service_->active_calls(); });
    // Calls still waiting on UCX transfers end now (their transfers are
    // cancelled): before gRPC's Shutdown, which waits for every call to
    // finish (cancelling one does not finish it) -- until the transfer's
    // deadline, ucx_transfer_timeout, when this came after it.
    if (data_plane_ != nullptr) data_plane_->Close();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(50));
    server_->Wait();
    // Requests over UCX still in flight end soon (Close ended their
    // transfers; a lookup may still be promoting from NVMe). Their answers
    // use the data plane and the service: both must outlive them, so this
    // waits for every one.
    if (data_plane_ != nullptr) {
      absl::Time next_warning = absl::Now() + absl::Seconds(2);
      while (size_t n = data_plane_->requests_in_flight()) {
        if (absl::Now() >= next_warning) {
          log_->warn("waiting for {} UCX request(s) still in flight", n);
          next_warning = absl::Now() + absl::Seconds(5);
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    // Nothing is in flight any more: sessions still open end here, so that
    // the blocks their pins kept in DRAM (and those blocks' ancestors) are
    // saved below too; their open reservations were never committed.
    if (int ended = store_->EndAllSessions(); ended > 0) {
      log_->info("ended {} session(s) still open", ended);
    }
    if (config_.persist_on_shutdown && config_.store.nvme_capacity > 0 &&
        nvme_unopened_.empty()) {
      absl::StatusOr<uint64_t> n = store_->PersistDram();
      if (n.ok()) {
        // An NVMe tier smaller than DRAM evicts as it takes them: say
        // what it holds, which is what a restart serves.
        log_->info(
            "persisted {} DRAM block(s) to NVMe; it holds {} block(s) now", *n,
            store_->Stats().nvme.blocks);
      } else {
        log_->warn("persisting DRAM to NVMe failed: {}", n.status().ToString());
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (maintenance_.joinable()) maintenance_.join();
  if (server_) log_->info("kvdepotd stopped");
}

Daemon::~Daemon() { Shutdown(); }

}  // namespace kvdepot
