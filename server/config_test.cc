#include "server/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/http_server.h"
#include "storage/dram_arena.h"
#include "tests/status_matchers.h"
#include "yaml-cpp/yaml.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ParseAdmissionTest, AcceptsAlwaysAndReadCounts) {
  EXPECT_EQ(*ParseAdmission("always"), 0u);
  EXPECT_EQ(*ParseAdmission("reads>=2"), 2u);
  for (const char* bad : {"", "sometimes", "reads>=0", "reads>=300", "reads>2"}) {
    EXPECT_THAT(ParseAdmission(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

class ConfigFileTest : public ::testing::Test {
 protected:
  // `text` as a config file is refused (InvalidArgument), when loaded or
  // validated, saying `says`.
  void ExpectInvalid(const std::string& text, const char* says) {
    DaemonConfig bad;
    absl::Status st = LoadConfigFile(Write(text), &bad);
    if (st.ok()) st = ValidateConfig(bad);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_THAT(std::string(st.message()), HasSubstr(says)) << text;
  }
  std::string Write(const std::string& text) {
    path_ = ::testing::TempDir() + "/kvdepot_config_test.yaml";
    std::ofstream(path_) << text;
    return path_;
  }
  std::string path_;
};

TEST_F(ConfigFileTest, AppliesKnownKeys) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("listen: 0.0.0.0:6000\n"
                                 "dram_capacity: 2GiB\n"
                                 "max_batch_keys: 77\n"
                                 "session_lease: 10s\n"
                                 "hugepages: off\n"
                                 "nvme_direct_reads: true\n"
                                 "low_watermark: 0.5\n"),
                           &c));
  EXPECT_EQ(c.listen, "0.0.0.0:6000");
  EXPECT_EQ(c.store.dram_capacity, uint64_t{2} << 30);
  EXPECT_EQ(c.store.max_batch_keys, 77u);
  EXPECT_EQ(c.store.default_lease, absl::Seconds(10));
  EXPECT_EQ(c.store.hugepages, HugePageMode::kOff);
  EXPECT_TRUE(c.store.nvme_direct_reads);
  EXPECT_EQ(c.store.low_watermark, 0.5);
  EXPECT_EQ(c.data_dir, "./kvdepot-data");  // untouched default
  EXPECT_OK(ValidateConfig(c));
}

TEST_F(ConfigFileTest, RejectsUnknownKeysAndBadValues) {
  DaemonConfig c;
  EXPECT_THAT(LoadConfigFile(Write("dram_capacty: 1GiB\n"), &c),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoadConfigFile(Write("dram_capacity: lots\n"), &c),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoadConfigFile(Write("listen: [a, b]\n"), &c),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoadConfigFile("/nonexistent/kvdepot.yaml", &c),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// An integer too large for its field is an error, never wrapped or clamped
// into range (4294967297 once became max_batch_keys 1).
TEST_F(ConfigFileTest, RejectsIntegersTooLargeForTheirField) {
  for (const char* key :
       {"max_batch_keys", "grpc_max_threads", "grpc_max_streams_per_connection",
        "metrics_namespace_labels", "ucx_workers", "ucx_colocated_workers",
        "ucx_max_buffers_per_session"}) {
    for (const char* value : {"4294967297", "18446744073709551615", "100001"}) {
      DaemonConfig c;
      absl::Status st = LoadConfigFile(Write(absl::StrCat(key, ": ", value, "\n")), &c);
      if (st.ok()) st = ValidateConfig(c);
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << key << ": " << value;
    }
  }
  DaemonConfig c;
  EXPECT_THAT(LoadConfigFile(Write("max_batch_keys: 4294967297\n"), &c),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoadConfigFile(Write("max_batch_keys: 18446744073709551616\n"), &c),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // The largest values in range are taken as written.
  ASSERT_OK(LoadConfigFile(Write("max_batch_keys: 65536\n"
                                 "metrics_namespace_labels: 100000\n"),
                           &c));
  EXPECT_EQ(c.store.max_batch_keys, 65536u);
  EXPECT_EQ(c.metrics_namespace_labels, 100000);
  EXPECT_OK(ValidateConfig(c));
}

TEST(ConfigFileTest2, ShippedExampleMatchesTheDefaults) {
  // deploy/kvdepot.yaml documents every key at its default; keep it true.
  DaemonConfig from_file;
  ASSERT_OK(LoadConfigFile(KVDEPOT_EXAMPLE_CONFIG, &from_file));
  DaemonConfig defaults;
  EXPECT_EQ(from_file.listen, defaults.listen);
  EXPECT_EQ(from_file.metrics_listen, defaults.metrics_listen);
  EXPECT_EQ(from_file.data_dir, defaults.data_dir);
  EXPECT_EQ(from_file.store.dram_capacity, defaults.store.dram_capacity);
  EXPECT_EQ(from_file.store.hugepages, defaults.store.hugepages);
  EXPECT_EQ(from_file.store.prefault_dram, defaults.store.prefault_dram);
  EXPECT_EQ(from_file.store.nvme_capacity, defaults.store.nvme_capacity);
  EXPECT_EQ(from_file.store.nvme_use_wal, defaults.store.nvme_use_wal);
  EXPECT_EQ(from_file.store.nvme_direct_reads,
            defaults.store.nvme_direct_reads);
  EXPECT_EQ(from_file.store.nvme_max_unflushed_age, defaults.store.nvme_max_unflushed_age);
  EXPECT_EQ(from_file.store.nvme_admit_min_reads, defaults.store.nvme_admit_min_reads);
  EXPECT_EQ(from_file.persist_on_shutdown, defaults.persist_on_shutdown);
  EXPECT_EQ(from_file.store.high_watermark, defaults.store.high_watermark);
  EXPECT_EQ(from_file.store.low_watermark, defaults.store.low_watermark);
  EXPECT_EQ(from_file.store.max_block_bytes, defaults.store.max_block_bytes);
  EXPECT_EQ(from_file.store.dram_max_blocks, defaults.store.dram_max_blocks);
  EXPECT_EQ(from_file.store.nvme_max_blocks, defaults.store.nvme_max_blocks);
  EXPECT_EQ(from_file.store.max_batch_keys, defaults.store.max_batch_keys);
  EXPECT_EQ(from_file.store.default_lease, defaults.store.default_lease);
  EXPECT_EQ(from_file.store.create_namespaces, defaults.store.create_namespaces);
  EXPECT_EQ(from_file.store.max_namespaces, defaults.store.max_namespaces);
  EXPECT_EQ(from_file.store.max_sessions, defaults.store.max_sessions);
  EXPECT_EQ(from_file.store.max_pinned_blocks, defaults.store.max_pinned_blocks);
  EXPECT_EQ(from_file.store.max_pinned_blocks_per_session,
            defaults.store.max_pinned_blocks_per_session);
  EXPECT_EQ(from_file.grpc_max_threads, defaults.grpc_max_threads);
  EXPECT_EQ(from_file.grpc_memory_limit, defaults.grpc_memory_limit);
  EXPECT_EQ(from_file.grpc_max_streams_per_connection,
            defaults.grpc_max_streams_per_connection);
  EXPECT_EQ(from_file.grpc_keepalive, defaults.grpc_keepalive);
  EXPECT_EQ(from_file.drain_timeout, defaults.drain_timeout);
  EXPECT_EQ(from_file.stream_idle_timeout, defaults.stream_idle_timeout);
  EXPECT_EQ(from_file.log_level, defaults.log_level);
  EXPECT_EQ(from_file.ucx_enabled, defaults.ucx_enabled);
  // The file's ucx mapping goes over the defaults when loaded, so compare
  // the mapping as written: a default left out of it would not show above.
  std::map<std::string, std::string> shipped_ucx;
  for (const auto& kv : YAML::LoadFile(KVDEPOT_EXAMPLE_CONFIG)["ucx"]) {
    shipped_ucx[kv.first.as<std::string>()] = kv.second.as<std::string>();
  }
  EXPECT_EQ(shipped_ucx, defaults.ucx);
  EXPECT_EQ(from_file.ucx_workers, defaults.ucx_workers);
  EXPECT_EQ(from_file.ucx_colocated_workers, defaults.ucx_colocated_workers);
  EXPECT_EQ(from_file.ucx_max_buffers_per_session,
            defaults.ucx_max_buffers_per_session);
  EXPECT_EQ(from_file.ucx_transfer_timeout, defaults.ucx_transfer_timeout);
  EXPECT_EQ(from_file.metrics_threads, defaults.metrics_threads);
  EXPECT_EQ(from_file.metrics_request_timeout, defaults.metrics_request_timeout);
}

TEST_F(ConfigFileTest, UcxSettingsAreAMapping) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("ucx:\n  TLS: tcp\n  NET_DEVICES: lo\n"
                                 "ucx_workers: 2\n"
                                 "ucx_colocated_workers: 0\n"),
                           &c));
  // Over the defaults (the TCP segment sizes stay).
  EXPECT_EQ(c.ucx, (std::map<std::string, std::string>{
                       {"TLS", "tcp"},
                       {"NET_DEVICES", "lo"},
                       {"TCP_TX_SEG_SIZE", "512k"},
                       {"TCP_RX_SEG_SIZE", "512k"}}));
  // A default given again, however prefixed, is replaced.
  DaemonConfig again;
  ASSERT_OK(LoadConfigFile(Write("ucx:\n  UCX_TCP_RX_SEG_SIZE: 1m\n"), &again));
  EXPECT_EQ(again.ucx, (std::map<std::string, std::string>{
                           {"TCP_TX_SEG_SIZE", "512k"},
                           {"UCX_TCP_RX_SEG_SIZE", "1m"}}));
  EXPECT_EQ(c.ucx_workers, 2);
  EXPECT_EQ(c.ucx_colocated_workers, 0);
  EXPECT_OK(ValidateConfig(c));
  DaemonConfig bad;
  EXPECT_THAT(LoadConfigFile(Write("ucx: tcp\n"), &bad),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoadConfigFile(Write("ucx:\n  TLS: [tcp]\n"), &bad),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A misspelled setting, and a value UCX refuses, named with their line:
  // UCX itself warned and went without the first, and the second turned
  // the data plane off.
  absl::Status st =
      LoadConfigFile(Write("ucx:\n  TLS: tcp\n  TCP_TX_SEGSIZE: 1m\n"), &bad);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(st.message()),
              ::testing::AllOf(HasSubstr("ucx.TCP_TX_SEGSIZE at line 3"),
                               HasSubstr("no setting")));
  st = LoadConfigFile(Write("ucx:\n  RNDV_THRESH: soon\n"), &bad);
  EXPECT_THAT(std::string(st.message()),
              ::testing::AllOf(HasSubstr("ucx.RNDV_THRESH at line 2"),
                               HasSubstr("refuses")));
  bad.ucx_workers = 0;
  EXPECT_THAT(ValidateConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = DaemonConfig{};
  bad.ucx_colocated_workers = 5000;
  EXPECT_THAT(ValidateConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ValidateConfigTest, ChecksCrossFieldRules) {
  DaemonConfig c;
  EXPECT_OK(ValidateConfig(c));
  c.store.low_watermark = 0.99;
  c.store.high_watermark = 0.9;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  c = DaemonConfig{};
  c.listen = "nowhere";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  c = DaemonConfig{};
  c.store.dram_capacity = 1000;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  // The arena's limit is a configuration error (exit 2) before anything
  // else at start can fail on so large a tier (MemAvailable: exit 1).
  c.store.dram_capacity = DramArena::kMaxCapacity;
  EXPECT_OK(ValidateConfig(c));
  c.store.dram_capacity = DramArena::kMaxCapacity + 1;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(ValidateConfig(c).message()),
              HasSubstr("1MiB to 256GiB"));
}

// HOST:PORT with a host and a port that fits 16 bits: "127.0.0.1:99999"
// listened on 34463 (99999 mod 65536), and a bad metrics_listen failed only
// when civetweb could not bind it (exit 1, which systemd restarts forever,
// instead of a configuration error's 2).
TEST(ValidateConfigTest, ListenAddressesAreHostAndPort) {
  for (const char* good :
       {"127.0.0.1:0", "0.0.0.0:65535", "localhost:9551", "kvdepot-0.kvdepot.ns.svc:1",
        "[::1]:50551", "[::]:0", "[fe80::1%eth0]:80", "host_name.example.:80"}) {
    EXPECT_OK(CheckListenAddress(good)) << good;
  }
  for (const char* bad :
       {"127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:", "127.0.0.1:-1",
        "127.0.0.1:+80", "127.0.0.1:80x", "127.0.0.1:000080", ":9551", "9551",
        "nowhere", "", "::1:80", "[::1]80", "[::1", "[]:80", "[nothost]:80",
        "[127.0.0.1]:80", "999.1.1.1:80", "1.2.3:80", "a host:80", "-host:80",
        "host/x:80"}) {
    EXPECT_THAT(CheckListenAddress(bad), StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
  EXPECT_THAT(CheckListenAddress("127.0.0.1:99999").message(),
              HasSubstr("port '99999' is not 0..65535"));

  DaemonConfig c;
  c.listen = "127.0.0.1:99999";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("listen: '127.0.0.1:99999'"));
  c = DaemonConfig{};
  c.metrics_listen = "127.0.0.1:70000";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("metrics_listen: "));
  c.metrics_listen = "nohost";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  c.metrics_listen = "";  // no metrics endpoint
  EXPECT_OK(ValidateConfig(c));
  c.metrics_listen = "localhost:0";
  EXPECT_OK(ValidateConfig(c));
  // An IPv6 metrics address with a civetweb that cannot bind one is a
  // configuration error too, not a start failure.
  c.metrics_listen = "[::1]:9551";
  if (HttpServer::SupportsIpv6()) {
    EXPECT_OK(ValidateConfig(c));
  } else {
    EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST_F(ConfigFileTest, MetricsPortThreadsAndTimeoutAreReadAndChecked) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("metrics_threads: 256\n"
                                 "metrics_request_timeout: 500ms\n"),
                           &c));
  EXPECT_EQ(c.metrics_threads, 256);
  EXPECT_EQ(c.metrics_request_timeout, absl::Milliseconds(500));
  EXPECT_OK(ValidateConfig(c));
  for (int threads : {0, 3, 1025}) {
    DaemonConfig bad;
    bad.metrics_threads = threads;
    EXPECT_THAT(ValidateConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument))
        << threads;
  }
  // Longer than Prometheus's scrape timeout would let idle connections
  // starve scrapes again.
  for (absl::Duration timeout : {absl::Milliseconds(50), absl::Seconds(11)}) {
    DaemonConfig bad;
    bad.metrics_request_timeout = timeout;
    EXPECT_THAT(ValidateConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument))
        << timeout;
  }
}

// Who may make admin calls: local (the default) or any.
TEST_F(ConfigFileTest, AdminPeersIsLocalOrAny) {
  EXPECT_EQ(DaemonConfig{}.admin_peers, "local");
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("admin_peers: any\n"), &c));
  EXPECT_EQ(c.admin_peers, "any");
  EXPECT_OK(ValidateConfig(c));
  DaemonConfig bad;
  ASSERT_OK(LoadConfigFile(Write("admin_peers: everyone\n"), &bad));
  EXPECT_THAT(ValidateConfig(bad),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The store's limits on sessions, namespaces and pins are set from the file
// (they had no key: a node sized for more clients could not raise them).
TEST_F(ConfigFileTest, SessionNamespaceAndPinLimitsAreReadAndChecked) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("max_sessions: 200000\n"
                                 "max_namespaces: 100\n"
                                 "max_pinned_blocks: 1000000\n"
                                 "max_pinned_blocks_per_session: 4096\n"),
                           &c));
  EXPECT_EQ(c.store.max_sessions, 200000u);
  EXPECT_EQ(c.store.max_namespaces, 100u);
  EXPECT_EQ(c.store.max_pinned_blocks, 1000000u);
  EXPECT_EQ(c.store.max_pinned_blocks_per_session, 4096u);
  EXPECT_OK(ValidateConfig(c));
  DaemonConfig pins;
  ASSERT_OK(LoadConfigFile(Write("max_pins: 5000\nmax_pins_per_session: 50\n"),
                           &pins));
  EXPECT_EQ(pins.store.max_pins, 5000u);
  EXPECT_EQ(pins.store.max_pins_per_session, 50u);
  EXPECT_OK(ValidateConfig(pins));

  ExpectInvalid("max_sessions: 0\n", "max_sessions");
  ExpectInvalid("max_sessions_per_peer: 0\n", "max_sessions_per_peer");
  ExpectInvalid("max_pins_per_session: 0\n", "max_pins_per_session");
  ExpectInvalid("max_pins: 10\nmax_pins_per_session: 11\n", "max_pins");
  ExpectInvalid("max_sessions: 1048577\n", "max_sessions");
  ExpectInvalid("max_namespaces: 0\n", "max_namespaces");
  ExpectInvalid("max_namespaces: 65537\n", "max_namespaces");
  ExpectInvalid("max_pinned_blocks: 4294967296\n", "too large");
  // Below max_batch_keys (1024 by default) the largest pinned lookup could
  // never be made.
  ExpectInvalid("max_pinned_blocks_per_session: 1023\n", "max_batch_keys");
  ExpectInvalid(
      "max_batch_keys: 64\nmax_pinned_blocks_per_session: "
      "128\nmax_pinned_blocks: 100\n",
      "max_pinned_blocks_per_session");
  DaemonConfig low;
  ASSERT_OK(LoadConfigFile(Write("max_batch_keys: 64\n"
                                 "max_pinned_blocks_per_session: 64\n"
                                 "max_pinned_blocks: 64\n"),
                           &low));
  EXPECT_OK(ValidateConfig(low));
}

// The tiers' block bounds (the indexes' RAM) are read from the file; 0
// derives them from the capacities.
TEST_F(ConfigFileTest, BlockBoundsAreReadAndChecked) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("dram_capacity: 64MiB\n"
                                 "nvme_capacity: 1GiB\n"
                                 "dram_max_blocks: 1000\n"
                                 "nvme_max_blocks: 20000\n"),
                           &c));
  EXPECT_EQ(c.store.dram_max_blocks, 1000u);
  EXPECT_EQ(c.store.nvme_max_blocks, 20000u);
  EXPECT_EQ(DramMaxBlocks(c.store), 1000u);
  EXPECT_EQ(NvmeMaxBlocks(c.store), 20000u);
  EXPECT_OK(ValidateConfig(c));
  // The defaults: one block per 4 KiB of DRAM, per 16 KiB of NVMe.
  DaemonConfig derived;
  ASSERT_OK(LoadConfigFile(Write("dram_capacity: 64MiB\nnvme_capacity: 1GiB\n"),
                           &derived));
  EXPECT_EQ(derived.store.dram_max_blocks, 0u);
  EXPECT_EQ(DramMaxBlocks(derived.store), 16384u);
  EXPECT_EQ(NvmeMaxBlocks(derived.store), 65536u);
  EXPECT_EQ(DramBlockFloor(derived.store), 4096u);
  EXPECT_OK(ValidateConfig(derived));
  derived.store.nvme_capacity = 0;  // no NVMe tier: no bound to check
  EXPECT_EQ(NvmeMaxBlocks(derived.store), 0u);
  EXPECT_OK(ValidateConfig(derived));

  ExpectInvalid("dram_max_blocks: lots\n", "bad integer");
  ExpectInvalid("nvme_max_blocks: -1\n", "bad integer");
  // More than one block per 64 bytes is a count no tier could reach (a
  // size written as a count, most likely).
  ExpectInvalid("dram_capacity: 1MiB\ndram_max_blocks: 16385\n",
                "dram_max_blocks");
  ExpectInvalid("nvme_capacity: 1MiB\nnvme_max_blocks: 16385\n",
                "nvme_max_blocks");
  // A tier too small for one block of the default bound needs its own.
  ExpectInvalid("nvme_capacity: 8KiB\n", "nvme_max_blocks");
  DaemonConfig edge;
  ASSERT_OK(LoadConfigFile(Write("dram_capacity: 1MiB\ndram_max_blocks: 16384\n"
                                 "nvme_capacity: 8KiB\nnvme_max_blocks: 1\n"),
                           &edge));
  EXPECT_OK(ValidateConfig(edge));
}

TEST_F(ConfigFileTest, GrpcKeepaliveIsReadAndChecked) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("grpc_keepalive: 5s\n"), &c));
  EXPECT_EQ(c.grpc_keepalive, absl::Seconds(5));
  EXPECT_OK(ValidateConfig(c));
  c.grpc_keepalive = absl::ZeroDuration();  // off
  EXPECT_OK(ValidateConfig(c));
  for (absl::Duration bad : {absl::Milliseconds(500), absl::Hours(25)}) {
    c.grpc_keepalive = bad;
    EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST_F(ConfigFileTest, NvmeMaxUnflushedAgeIsReadAndChecked) {
  DaemonConfig c;
  ASSERT_OK(LoadConfigFile(Write("nvme_max_unflushed_age: 2s\n"), &c));
  EXPECT_EQ(c.store.nvme_max_unflushed_age, absl::Seconds(2));
  EXPECT_OK(ValidateConfig(c));
  c.store.nvme_max_unflushed_age = absl::ZeroDuration();
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument));
}

// A key that is not a plain scalar names no setting: an error, never an
// exception (reading it as a string threw, and kvdepotd aborted).
TEST_F(ConfigFileTest, RejectsKeysThatAreNotPlainScalars) {
  for (const char* text : {"? [a, b]\n: 1\n", "? {a: 1}\n: 1\n", "? \n: 1\n",
                           "ucx:\n  ? [a, b]\n  : 1\n", "ucx:\n  ? {TLS: tcp}\n  : 1\n"}) {
    DaemonConfig c;
    absl::Status st = LoadConfigFile(Write(text), &c);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_THAT(std::string(st.message()), HasSubstr("not a plain scalar")) << text;
  }
}

// A key with nothing after it is YAML null. For metrics_listen and
// log_file, where the example config says empty disables it (or logs to
// stderr), that is the empty string; other keys say they have no value.
// Bug: every one was "'metrics_listen' must be a scalar".
TEST_F(ConfigFileTest, AnEmptyValueIsEmptyWhereEmptyMeansSomething) {
  for (const char* empty : {"", " ~", " null", " \"\""}) {
    DaemonConfig c;
    c.log_file = "/var/log/kvdepot/kvdepotd.log";
    ASSERT_OK(LoadConfigFile(Write(absl::StrCat("metrics_listen:", empty,
                                                "\nlog_file:", empty, "\n")),
                             &c))
        << "'" << empty << "'";
    EXPECT_EQ(c.metrics_listen, "") << "'" << empty << "'";
    EXPECT_EQ(c.log_file, "") << "'" << empty << "'";
    EXPECT_OK(ValidateConfig(c));
  }
  for (const char* key :
       {"listen", "data_dir", "dram_capacity", "drain_timeout", "hugepages",
        "ucx_enabled", "max_batch_keys"}) {
    DaemonConfig c;
    absl::Status st = LoadConfigFile(Write(absl::StrCat("\n", key, ":\n")), &c);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << key;
    EXPECT_THAT(std::string(st.message()),
                HasSubstr(absl::StrCat("'", key, "' at line 2 has no value")));
  }
  DaemonConfig c;
  absl::Status st = LoadConfigFile(Write("ucx:\n  TLS:\n"), &c);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("ucx.TLS at line 2 has no value"));
}

// absl::ParseDuration takes "inf": no duration of ours may be infinite (an
// infinite drain_timeout let SIGTERM wait forever).
TEST_F(ConfigFileTest, RejectsInfiniteDurations) {
  for (const char* key : {"session_lease", "drain_timeout", "stream_idle_timeout",
                          "nvme_max_unflushed_age", "ucx_transfer_timeout"}) {
    for (const char* value : {"inf", "+inf", "-inf", "9223372036854775807h"}) {
      DaemonConfig c;
      absl::Status st = LoadConfigFile(Write(absl::StrCat(key, ": ", value, "\n")), &c);
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << key << ": " << value;
      EXPECT_THAT(std::string(st.message()), HasSubstr(key)) << key << ": " << value;
    }
  }
  for (const char* flag : {"inf", "-inf", "-1s"}) {
    EXPECT_THAT(ParseDurationFlag(flag), StatusIs(absl::StatusCode::kInvalidArgument)) << flag;
  }
  EXPECT_EQ(*ParseDurationFlag("90m"), absl::Minutes(90));
}

// The store clamps a lease into [min_lease, max_lease] (1s..1h): a default
// outside it is an error, not silently changed.
TEST_F(ConfigFileTest, SessionLeaseMustBeInTheStoresRange) {
  for (const char* value : {"0s", "999ms", "1h0m1s", "2h"}) {
    DaemonConfig c;
    ASSERT_OK(LoadConfigFile(Write(absl::StrCat("session_lease: ", value, "\n")), &c));
    absl::Status st = ValidateConfig(c);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << value;
    EXPECT_THAT(std::string(st.message()), HasSubstr("session_lease must be 1s..1h")) << value;
  }
  for (const char* value : {"1s", "30s", "1h"}) {
    DaemonConfig c;
    ASSERT_OK(LoadConfigFile(Write(absl::StrCat("session_lease: ", value, "\n")), &c));
    EXPECT_OK(ValidateConfig(c)) << value;
  }
}

// A repeated key is an error naming it, at the top and inside `ucx` (where
// "TLS" and "UCX_TLS" are one setting); the last one no longer wins.
TEST_F(ConfigFileTest, RejectsRepeatedKeys) {
  const std::pair<const char*, const char*> cases[] = {
      {"listen: 127.0.0.1:1\nlisten: 127.0.0.1:2\n", "'listen'"},
      {"drain_timeout: 1s\nlisten: 127.0.0.1:1\ndrain_timeout: 2s\n", "'drain_timeout'"},
      {"ucx: {TLS: tcp}\nucx: {NET_DEVICES: lo}\n", "'ucx'"},
      {"ucx:\n  TLS: tcp\n  TLS: shm\n", "ucx.TLS"},
      {"ucx:\n  TLS: tcp\n  UCX_TLS: shm\n", "ucx.UCX_TLS"},
  };
  for (const auto& [text, named] : cases) {
    DaemonConfig c;
    absl::Status st = LoadConfigFile(Write(text), &c);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_THAT(std::string(st.message()), HasSubstr(named)) << text;
  }
}

// Settings after a "---" (a second YAML document, as templates append
// overrides) were silently dropped, typos in them unseen: every document is
// read, and more than one with settings is refused. Empty ones (a leading
// or trailing "---", a file of comments) are fine.
TEST_F(ConfigFileTest, RejectsASecondDocumentWithSettings) {
  DaemonConfig c;
  absl::Status st = LoadConfigFile(
      Write("dram_capacity: 64MiB\n---\nbogus_key: 1\ndram_capacity: 1TiB\n"),
      &c);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("more than one YAML document"));
  DaemonConfig d;
  ASSERT_OK(LoadConfigFile(Write("---\ndram_capacity: 64MiB\n---\n"), &d));
  EXPECT_EQ(d.store.dram_capacity, uint64_t{64} << 20);
  DaemonConfig e;
  ASSERT_OK(LoadConfigFile(Write("# nothing set\n"), &e));
  EXPECT_EQ(e.store.dram_capacity, DaemonConfig{}.store.dram_capacity);
}

}  // namespace
}  // namespace kvdepot
