// /metrics of a real kvdepotd under traffic: the families deploy/ relies on
// (tests/deploy/exported_metrics.txt) are all exported, the lookup counters
// add up to the keys asked, and the namespace label stays bounded.
#include <signal.h>

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;
using testing::RunCommand;

std::string Scrape(const DaemonProcess& d) { return testing::ScrapeMetrics(d); }
double Value(const std::string& text, const std::string& series) {
  return testing::MetricValue(text, series);
}

// Polls /metrics (store counters are copied about once a second) until
// `series` reaches `at_least`; returns the last scrape.
std::string ScrapeUntil(const DaemonProcess& d, const std::string& series,
                        double at_least) {
  std::string text;
  for (int i = 0; i < 100; ++i) {
    text = Scrape(d);
    if (Value(text, series) >= at_least) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return text;
}

// Bug: the tier gauges appeared only at the maintenance loop's first pass,
// a second after the metrics port opened, and a scrape in between had no
// tier series (a gap in every capacity panel and rule after a restart).
TEST(MetricsTest, TheTierGaugesAreThereAtTheFirstScrape) {
  auto d = DaemonProcess::Start({"--dram-capacity", "8MiB"});
  ASSERT_OK(d);
  const std::string text = Scrape(**d);
  EXPECT_EQ(Value(text, "kvdepot_tier_capacity_bytes{tier=\"dram\"}"), 8 << 20)
      << text;
  EXPECT_EQ(Value(text, "kvdepot_tier_blocks{tier=\"dram\"}"), 0) << text;
}

TEST(MetricsTest, ExportsTheContractAndCountsLookupsWithDenominators) {
  auto d = DaemonProcess::Start({"--dram-capacity", "8MiB"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  auto client = std::move(Client::Connect(o)).value();

  // Three chained blocks, then a prefix lookup of four keys (3 hits, 1
  // miss), a plain lookup of two (1 hit, 1 miss), a read of a stored block
  // and one of a missing one (a Read's keys are lookups too, as the store
  // counts them), a GetInto of one stored and one missing, an eviction.
  const std::string bytes(64 << 10, 'm');
  std::vector<std::string> keys = {"k0", "k1", "k2"};
  std::vector<BlockToPut> puts = {{keys[0], "", bytes}, {keys[1], keys[0], bytes},
                                  {keys[2], keys[1], bytes}};
  ASSERT_OK(client->Put("metrics/ns", puts));
  std::vector<absl::string_view> prefix_keys = {"k0", "k1", "k2", "nope"};
  auto p = client->Lookup("metrics/ns", prefix_keys, /*prefix=*/true, /*pin=*/false);
  ASSERT_OK(p);
  EXPECT_EQ(p->prefix_hits, 3u);
  std::vector<absl::string_view> plain = {"k0", "nope"};
  ASSERT_OK(client->Lookup("metrics/ns", plain, /*prefix=*/false, /*pin=*/false));
  absl::string_view k0 = "k0";
  ASSERT_OK(client->Get("metrics/ns", {&k0, 1}));
  absl::string_view nope = "nope";
  EXPECT_FALSE(client->Get("metrics/ns", {&nope, 1}).ok());
  // GetInto of unregistered memory: a pinned Lookup, then a Read of the
  // hits that the Lookup counted already (1 hit, 1 miss, counted once).
  std::vector<absl::string_view> into_keys = {"k1", "nope"};
  std::string b1(bytes.size(), 0), b2(bytes.size(), 0);
  std::vector<absl::Span<char>> into = {absl::MakeSpan(b1), absl::MakeSpan(b2)};
  auto got = client->GetInto("metrics/ns", into_keys, into);
  ASSERT_OK(got);
  EXPECT_EQ(*got, (std::vector<bool>{true, false}));
  EXPECT_EQ(b1, bytes);
  absl::string_view k2 = "k2";
  ASSERT_OK(client->Evict("metrics/ns", {&k2, 1}, /*all=*/false));

  const std::string text = ScrapeUntil(
      **d, "kvdepot_evictions_total{reason=\"admin\",tier=\"dram\"}", 1);
  const std::string ns = "namespace=\"metrics/ns\"";
  EXPECT_EQ(Value(text, "kvdepot_lookup_keys_total{" + ns +
                            ",result=\"hit\",tier=\"dram\"}"),
            6);
  EXPECT_EQ(Value(text, "kvdepot_lookup_keys_total{" + ns +
                            ",result=\"miss\",tier=\"none\"}"),
            4);
  EXPECT_EQ(Value(text, "kvdepot_lookup_prefix_keys_asked_total{" + ns + "}"), 4);
  EXPECT_EQ(Value(text, "kvdepot_lookup_prefix_hit_keys_total{" + ns + "}"), 3);
  EXPECT_EQ(Value(text, "kvdepot_evictions_total{reason=\"admin\",tier=\"dram\"}"), 1);
  // Hits + misses = keys asked (4 + 2 + 1 + 1 + 2); bytes = what the client
  // moved.
  double keys_counted = 0;
  for (const char* series : {",result=\"hit\",tier=\"dram\"}", ",result=\"hit\",tier=\"nvme\"}",
                             ",result=\"miss\",tier=\"none\"}"}) {
    keys_counted += Value(text, "kvdepot_lookup_keys_total{" + ns + series);
  }
  EXPECT_EQ(keys_counted, 10);
  // The store's own counts (Stats, kvdepotctl status) agree: the GetInto's
  // Read of the keys its Lookup counted does not count them again.
  auto stats = client->Stats();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->lookup_keys(), 10u);
  EXPECT_EQ(stats->lookup_hits(), 6u);
  EXPECT_EQ(Value(text, "kvdepot_bytes_total{direction=\"in\",transport=\"grpc\"}"),
            3.0 * bytes.size());
  EXPECT_EQ(Value(text, "kvdepot_bytes_total{direction=\"out\",transport=\"grpc\"}"),
            2.0 * bytes.size());
  EXPECT_EQ(Value(text, "kvdepot_requests_total{code=\"OK\",op=\"Lookup\"}"), 3);
  // Series with fixed labels exist before their first event.
  EXPECT_EQ(Value(text, "kvdepot_integrity_errors_total{tier=\"nvme\"}"), 0);
  EXPECT_EQ(Value(text, "kvdepot_demotion_failures_total"), 0);
  EXPECT_EQ(Value(text, "kvdepot_dram_room_wait_timeouts_total"), 0);
  for (const char* code :
       {"RESOURCE_EXHAUSTED", "NOT_FOUND", "UNAVAILABLE", "INVALID_ARGUMENT",
        "FAILED_PRECONDITION", "PERMISSION_DENIED"}) {
    EXPECT_EQ(
        Value(text, absl::StrCat("kvdepot_ucx_requests_refused_total{code=\"",
                                 code, "\"}")),
        0)
        << code;
  }

  // The exposition passes Prometheus' own linter.
  testing::CommandResult lint = RunCommand(absl::StrCat(
      "command -v promtool >/dev/null || exit 77; curl -sf http://",
      (*d)->metrics_address(), "/metrics | promtool check metrics"));
  if (lint.exit_code != 77) {
    EXPECT_EQ(lint.exit_code, 0) << lint.out << lint.err;
  }

  // Every family the dashboards and alert rules use is exported.
  testing::CommandResult check = RunCommand(absl::StrCat(
      "/usr/bin/python3 " KVDEPOT_SOURCE_DIR "/tests/deploy/check_metric_names.py "
      "--metrics-url http://", (*d)->metrics_address(), "/metrics"));
  EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
}

// A pinned lookup of a block that only the NVMe tier holds promotes it to
// DRAM first: the reply says DRAM (where its bytes are now), but the hit is
// the NVMe tier's, so the hit ratio by tier shows what NVMe adds.
TEST(MetricsTest, PinnedLookupsCountPromotedBlocksAsNvmeHits) {
  const std::vector<std::string> args = {"--dram-capacity", "8MiB",
                                         "--nvme-capacity", "64MiB"};
  auto d = DaemonProcess::Start(args);
  ASSERT_OK(d);
  const std::string data_dir = (*d)->data_dir();
  {
    ClientOptions o;
    o.server = (*d)->address();
    auto client = std::move(Client::Connect(o)).value();
    const std::string bytes(64 << 10, 'p');
    BlockToPut b{"k0", "", bytes};
    ASSERT_OK(client->Put("promoted/ns", {&b, 1}));
  }
  // SIGTERM persists DRAM blocks to NVMe; after the restart the block is
  // on NVMe only.
  auto rc = (*d)->Stop(SIGTERM);
  ASSERT_OK(rc);
  ASSERT_EQ(*rc, 0);
  d->reset();
  auto again = DaemonProcess::Start(args, data_dir);
  ASSERT_OK(again);
  ClientOptions o;
  o.server = (*again)->address();
  auto client = std::move(Client::Connect(o)).value();
  absl::string_view k0 = "k0";
  const std::string hits = "kvdepot_lookup_keys_total{namespace=\"promoted/ns\",result=\"hit\",tier=";

  auto promoted = client->Lookup("promoted/ns", {&k0, 1}, /*prefix=*/false, /*pin=*/true);
  ASSERT_OK(promoted);
  ASSERT_TRUE(promoted->entries[0].found);
  EXPECT_EQ(promoted->entries[0].tier, v1::TIER_DRAM);
  ASSERT_OK(client->Unpin(promoted->pin_id));
  std::string text = Scrape(**again);
  EXPECT_EQ(Value(text, hits + "\"nvme\"}"), 1);
  EXPECT_EQ(Value(text, hits + "\"dram\"}"), 0);

  // Promoted, it is a DRAM hit from then on.
  auto second = client->Lookup("promoted/ns", {&k0, 1}, /*prefix=*/false, /*pin=*/true);
  ASSERT_OK(second);
  ASSERT_TRUE(second->entries[0].found);
  ASSERT_OK(client->Unpin(second->pin_id));
  text = Scrape(**again);
  EXPECT_EQ(Value(text, hits + "\"nvme\"}"), 1);
  EXPECT_EQ(Value(text, hits + "\"dram\"}"), 1);
}

// A real Prometheus scrapes the daemon and answers a query over its HTTP API.
TEST(MetricsTest, PrometheusScrapesTheDaemon) {
  if (RunCommand("command -v prometheus").exit_code != 0) {
    GTEST_SKIP() << "no prometheus binary (Debian package prometheus)";
  }
  auto d = DaemonProcess::Start({"--dram-capacity", "8MiB"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  auto client = std::move(Client::Connect(o)).value();
  absl::string_view k = "k";
  BlockToPut b{"stored", "", "bytes"};  // the namespace exists: it has a label
  ASSERT_OK(client->Put("scraped/ns", {&b, 1}));
  ASSERT_OK(client->Lookup("scraped/ns", {&k, 1}, false, false));

  const std::string dir = testing::MakeTempDir("prometheus");
  std::ofstream(dir + "/prometheus.yml")
      << "global: {scrape_interval: 1s}\n"
         "scrape_configs:\n"
         "  - job_name: kvdepot\n"
         "    static_configs: [{targets: ['" << (*d)->metrics_address() << "']}]\n";
  // Prometheus cannot pick its own port: try a few.
  int port = 0;
  int pid = 0;
  for (int attempt = 0; attempt < 5 && pid == 0; ++attempt) {
    port = 20000 + static_cast<int>(absl::ToUnixNanos(absl::Now()) % 20000);
    testing::CommandResult r = RunCommand(absl::StrCat(
        "prometheus --config.file=", dir, "/prometheus.yml --storage.tsdb.path=", dir,
        "/data --web.listen-address=127.0.0.1:", port, " > ", dir,
        "/prometheus.log 2>&1 & echo $!"));
    int candidate = 0;
    ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(r.out), &candidate));
    absl::SleepFor(absl::Seconds(1));
    if (kill(candidate, 0) == 0) pid = candidate;
  }
  ASSERT_NE(pid, 0) << "prometheus did not start";
  struct Killer {
    int pid;
    ~Killer() {
      kill(pid, SIGTERM);
      for (int i = 0; i < 100 && kill(pid, 0) == 0; ++i) absl::SleepFor(absl::Milliseconds(50));
      kill(pid, SIGKILL);
    }
  } killer{pid};

  std::string answer;
  for (int i = 0; i < 300; ++i) {
    answer = RunCommand(absl::StrCat("curl -sf 'http://127.0.0.1:", port,
                                     "/api/v1/query?query=kvdepot_lookup_keys_total"
                                     "%7Bnamespace%3D%22scraped%2Fns%22%2Cresult%3D%22miss%22%7D'"))
                 .out;
    if (answer.find("\"value\"") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_NE(answer.find("\"__name__\":\"kvdepot_lookup_keys_total\""), std::string::npos)
      << answer;
  EXPECT_NE(answer.find("\"1\"]"), std::string::npos) << answer;  // one miss
}

// kvdepot_draining is 1 while the daemon refuses puts (kvdepotctl drain,
// i.e. the SetDraining RPC), and kvdepot_start_time_seconds is when the
// daemon started: a new value at each restart, which KvdepotRestarting
// counts.
TEST(MetricsTest, DrainingAndStartTimeGauges) {
  const double before = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  auto d = DaemonProcess::Start({"--dram-capacity", "8MiB"});
  ASSERT_OK(d);
  const double after = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  std::string text = Scrape(**d);
  EXPECT_EQ(Value(text, "kvdepot_draining"), 0);
  const double started = Value(text, "kvdepot_start_time_seconds");
  EXPECT_GE(started, before - 1);
  EXPECT_LE(started, after + 1);

  testing::CommandResult drain = testing::RunCtl((*d)->address(), "drain");
  ASSERT_EQ(drain.exit_code, 0) << drain.out << drain.err;
  text = ScrapeUntil(**d, "kvdepot_draining", 1);  // copied once a second
  EXPECT_EQ(Value(text, "kvdepot_draining"), 1);
  testing::CommandResult undrain = testing::RunCtl((*d)->address(), "undrain");
  ASSERT_EQ(undrain.exit_code, 0) << undrain.out << undrain.err;
  ASSERT_TRUE(testing::PollUntil(
      [&] { return Value(Scrape(**d), "kvdepot_draining") == 0; }));

  // Restarted on the same data dir: a later start time.
  const std::string data_dir = (*d)->data_dir();
  auto rc = (*d)->Stop(SIGTERM);
  ASSERT_OK(rc);
  ASSERT_EQ(*rc, 0);
  d->reset();
  auto again = DaemonProcess::Start({"--dram-capacity", "8MiB"}, data_dir);
  ASSERT_OK(again);
  EXPECT_GT(Value(Scrape(**again), "kvdepot_start_time_seconds"), started);
}

TEST(MetricsTest, NamespaceLabelsAreBounded) {
  const std::string dir = testing::MakeTempDir("metrics-cfg");
  std::ofstream(dir + "/k.yaml") << "metrics_namespace_labels: 2\n";
  auto d = DaemonProcess::Start({"--config", dir + "/k.yaml"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  auto client = std::move(Client::Connect(o)).value();
  absl::string_view k = "k";
  // Lookups in names nothing was stored under take no label: they would
  // leave none for the namespaces that exist.
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK(client->Lookup(absl::StrCat("junk", i), {&k, 1}, false, false));
  }
  for (int i = 0; i < 3; ++i) {
    BlockToPut b{"stored", "", "bytes"};
    ASSERT_OK(client->Put(absl::StrCat("ns", i), {&b, 1}));
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(client->Lookup(absl::StrCat("ns", i), {&k, 1}, false, false));
  }
  const std::string text = Scrape(**d);
  auto misses = [&](const std::string& ns) {
    return Value(text, "kvdepot_lookup_keys_total{namespace=\"" + ns +
                           "\",result=\"miss\",tier=\"none\"}");
  };
  EXPECT_EQ(misses("junk0"), -1);
  EXPECT_EQ(misses("ns0"), 1);
  EXPECT_EQ(misses("ns1"), 1);
  EXPECT_EQ(misses("(other)"), 5);  // 4 junk lookups, then ns2's: 2 labels
  EXPECT_EQ(misses("ns2"), -1);
}

// The label the unlabelled namespaces share is no namespace's name: one
// named "other" keeps its own counts.
TEST(MetricsTest, ANamespaceNamedOtherIsNotTheOverflowLabel) {
  const std::string dir = testing::MakeTempDir("metrics-cfg");
  std::ofstream(dir + "/k.yaml") << "metrics_namespace_labels: 1\n";
  auto d = DaemonProcess::Start({"--config", dir + "/k.yaml"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  auto client = std::move(Client::Connect(o)).value();
  BlockToPut b{"k", "", "bytes"};
  ASSERT_OK(client->Put("other", {&b, 1}));
  absl::string_view k = "k";
  ASSERT_OK(client->Lookup("other", {&k, 1}, false, false));  // a hit
  ASSERT_OK(client->Lookup("junk", {&k, 1}, false, false));   // a miss
  const std::string text = Scrape(**d);
  auto keys = [&](const std::string& ns, const std::string& rest) {
    return Value(text, "kvdepot_lookup_keys_total{namespace=\"" + ns + "\"," + rest + "}");
  };
  EXPECT_EQ(keys("other", "result=\"hit\",tier=\"dram\""), 1);
  EXPECT_EQ(keys("other", "result=\"miss\",tier=\"none\""), 0);
  EXPECT_EQ(keys("(other)", "result=\"miss\",tier=\"none\""), 1);
}

}  // namespace
}  // namespace kvdepot
