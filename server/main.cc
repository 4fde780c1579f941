// kvdepotd: the kvdepot daemon.
//
//   kvdepotd [--config FILE.yaml] [--listen HOST:PORT] [--metrics-listen
//            HOST:PORT] [--data-dir DIR] [--dram-capacity SIZE] ...
//
// Flags override the YAML file; see README.md for every key. Exit codes: 0
// after a clean shutdown (SIGTERM/SIGINT), 1 when the daemon cannot start or
// fails (or a second SIGINT cut the shutdown short), 2 for a usage or
// configuration error.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "server/config.h"
#include "server/daemon.h"
#include "server/logging.h"
#include "server/version.h"
#include "storage/process_tuning.h"
#include "transport/ucx_address_sandbox.h"

namespace {

int Fail(int code, const std::string& msg) {
  std::fprintf(stderr, "kvdepotd: %s\n", msg.c_str());
  return code;
}

// Every client connection, RocksDB file and co-located UCX client (about 10
// each) is a descriptor; past the limit gRPC stops accepting connections
// for good. A shell's soft limit (often 1024) is raised to the hard one.
// Returns the limit in force; logs nothing (the logger does not exist yet).
rlim_t RaiseOpenFileLimit() {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    struct rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return raised.rlim_cur;
  }
  return limit.rlim_cur;
}

// Below this, a few hundred clients can run kvdepotd out of descriptors.
constexpr rlim_t kLowOpenFileLimit = 16384;

// While Shutdown drains and persists (minutes for a large DRAM tier), a
// second SIGINT (Ctrl-C again) ends the process at once, as SIGKILL would:
// what is committed to NVMe stays (that is SIGKILL's promise), blocks only
// in DRAM are lost. A repeated SIGTERM does not: scripts and supervisors
// resend it while they wait for the exit, and the shutdown must finish; it
// is answered with a line on stderr saying how to stop at once. SIGHUP is
// ignored.
// Writes with write(2) (the logger may be gone), detached: it may still
// wait when main returns.
void WatchSignalsDuringShutdown(sigset_t signals) noexcept try {
  std::thread([signals] {
    int sig = 0;
    while (sigwait(&signals, &sig) == 0) {
      if (sig == SIGINT) {
        constexpr char kMsg[] =
            "kvdepotd: second signal during shutdown (SIGINT): exiting now; "
            "blocks only in DRAM are lost\n";
        (void)!write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
        _exit(1);
      }
      if (sig == SIGTERM) {
        constexpr char kMsg[] =
            "kvdepotd: already shutting down (draining, then persisting DRAM "
            "to NVMe); SIGINT or SIGKILL ends it at once\n";
        (void)!write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
      }
    }
  }).detach();
} catch (const std::exception&) {
  // No thread to be had: the shutdown goes on, signals stay blocked.
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kvdepot::kUcxAddressSandboxFlag) {
    // Started by kvdepotd itself (transport/ucx_address_sandbox.h).
    return kvdepot::RunUcxAddressSandbox(std::vector<std::string>(argv + 2, argv + argc));
  }
  using kvdepot::DaemonConfig;
  kvdepot::TuneProcessForBlockIo();
  CLI::App app{"kvdepotd: KV-cache block store daemon for LLM inference"};
  std::string config_file;
  std::optional<std::string> listen, metrics_listen, data_dir, dram_capacity,
      log_level, hugepages, max_block_size, session_lease, nvme_capacity,
      nvme_admission;
  std::optional<bool> persist_on_shutdown;
  app.add_option("--config", config_file, "YAML configuration file")
      ->check(CLI::ExistingFile);
  app.add_option("--listen", listen, "gRPC address HOST:PORT (default 127.0.0.1:50551; port 0 picks one)");
  app.add_option("--metrics-listen", metrics_listen,
                 "Prometheus address HOST:PORT (default 127.0.0.1:9551; empty disables)");
  app.add_option("--data-dir", data_dir, "data directory (default ./kvdepot-data)");
  app.add_option("--dram-capacity", dram_capacity, "DRAM tier size, e.g. 1GiB (default 1GiB)");
  app.add_option("--max-block-size", max_block_size, "largest block accepted (default 256MiB)");
  app.add_option("--nvme-capacity", nvme_capacity,
                 "NVMe tier size in <data-dir>/nvme, e.g. 100GiB; 0 turns it off (default 8GiB)");
  app.add_option("--nvme-admission", nvme_admission,
                 "which blocks leaving DRAM go to NVMe: always | reads>=N (default always)");
  app.add_option("--persist-on-shutdown", persist_on_shutdown,
                 "write DRAM-only blocks to NVMe on SIGTERM (default true)");
  app.add_option("--session-lease", session_lease, "default session lease (default 30s)");
  app.add_option("--hugepages", hugepages, "auto|on|off (default auto)");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error (default info)");
  bool version = false;
  app.add_flag("--version", version, "print the version and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (version) {
    std::printf("kvdepotd %s (%s)\n", kvdepot::kVersion, kvdepot::kGitCommit);
    return 0;
  }

  DaemonConfig config;
  if (!config_file.empty()) {
    absl::Status st = kvdepot::LoadConfigFile(config_file, &config);
    if (!st.ok()) return Fail(2, std::string(st.message()));
  }
  auto size_flag = [](const std::optional<std::string>& flag, const char* name,
                      uint64_t* out) -> absl::Status {
    if (!flag) return absl::OkStatus();
    absl::StatusOr<uint64_t> n = kvdepot::ParseSize(*flag);
    if (!n.ok()) return absl::InvalidArgumentError(std::string(name) + ": " + std::string(n.status().message()));
    *out = *n;
    return absl::OkStatus();
  };
  if (listen) config.listen = *listen;
  if (metrics_listen) config.metrics_listen = *metrics_listen;
  if (data_dir) config.data_dir = *data_dir;
  if (log_level) config.log_level = *log_level;
  for (absl::Status st :
       {size_flag(dram_capacity, "--dram-capacity", &config.store.dram_capacity),
        size_flag(max_block_size, "--max-block-size", &config.store.max_block_bytes),
        size_flag(nvme_capacity, "--nvme-capacity", &config.store.nvme_capacity)}) {
    if (!st.ok()) return Fail(2, std::string(st.message()));
  }
  if (persist_on_shutdown) config.persist_on_shutdown = *persist_on_shutdown;
  if (nvme_admission) {
    absl::StatusOr<uint32_t> n = kvdepot::ParseAdmission(*nvme_admission);
    if (!n.ok()) return Fail(2, "--nvme-admission: " + std::string(n.status().message()));
    config.store.nvme_admit_min_reads = *n;
  }
  if (session_lease) {
    absl::StatusOr<absl::Duration> d = kvdepot::ParseDurationFlag(*session_lease);
    if (!d.ok()) return Fail(2, "--session-lease: " + std::string(d.status().message()));
    config.store.default_lease = *d;
  }
  if (hugepages) {
    absl::StatusOr<kvdepot::HugePageMode> mode = kvdepot::ParseHugePages(*hugepages);
    if (!mode.ok()) return Fail(2, "--hugepages: " + std::string(mode.status().message()));
    config.store.hugepages = *mode;
  }
  if (absl::Status st = kvdepot::ValidateConfig(config); !st.ok()) {
    return Fail(2, std::string(st.message()));
  }

  absl::StatusOr<kvdepot::Logger> log = kvdepot::MakeLogger(
      "kvdepotd", {config.log_level, config.log_format, config.log_file});
  if (!log.ok()) {
    return Fail(log.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1,
                std::string(log.status().message()));
  }
  std::shared_ptr<spdlog::logger> logger = log->logger;
  if (const rlim_t files = RaiseOpenFileLimit();
      files != 0 && files < kLowOpenFileLimit) {
    logger->warn(
        "open files limited to {} (ulimit -n; LimitNOFILE in a unit): each "
        "client connection takes one and each co-located UCX client about "
        "10; past the limit new connections are refused",
        static_cast<unsigned long long>(files));
  }

  // Signals are taken synchronously by this thread; block them before any
  // other thread starts so none of those receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto daemon = kvdepot::Daemon::Start(config, logger);
  if (!daemon.ok()) {
    logger->error("cannot start: {}", daemon.status().ToString());
    // A value only the store or the quotas file checks (a DRAM tier past
    // its limit, a malformed quota line): a configuration error, which a
    // restart will not fix.
    return daemon.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  int sig = 0;
  // SIGHUP reopens the log file (after logrotate moved it away).
  while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
    if (absl::Status st = log->reopen(); st.ok()) {
      logger->info("received SIGHUP, log file reopened");
    } else {
      logger->warn("received SIGHUP: {}", st.ToString());
    }
  }
  logger->info("received {}, shutting down (SIGINT again exits at once)",
               sig == SIGTERM ? "SIGTERM" : "SIGINT");
  WatchSignalsDuringShutdown(signals);
  (*daemon)->Shutdown();
  daemon->reset();
  return 0;
}
