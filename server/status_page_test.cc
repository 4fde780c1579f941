#include "server/status_page.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"
#include "storage/fake_clock.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Buckets = std::vector<prometheus::ClientMetric::Bucket>;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Cumulative buckets with bounds 1 ms, 10 ms, 100 ms, +Inf.
Buckets Cumulative(uint64_t a, uint64_t b, uint64_t c, uint64_t inf) {
  return {{a, 0.001}, {b, 0.01}, {c, 0.1}, {inf, kInf}};
}

TEST(HistogramQuantileTest, InterpolatesInsideTheBucket) {
  // 10 below 1 ms, 80 in (1, 10] ms, 10 in (10, 100] ms.
  Buckets to = Cumulative(10, 90, 100, 100);
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.5, {}, to), 0.001 + 0.009 * 40 / 80);
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.99, {}, to), 0.01 + 0.09 * 9 / 10);
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.05, {}, to), 0.001 * 5 / 10);
}

TEST(HistogramQuantileTest, CountsOnlyTheDeltaBetweenReadings) {
  // 1000 fast observations before the window, 10 slow ones in it.
  Buckets from = Cumulative(1000, 1000, 1000, 1000);
  Buckets to = Cumulative(1000, 1000, 1010, 1010);
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.5, from, to), 0.01 + 0.09 * 0.5);
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.99, from, to), 0.01 + 0.09 * 0.99);
}

TEST(HistogramQuantileTest, InfBucketGivesTheHighestFiniteBound) {
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.5, {}, Cumulative(0, 0, 0, 4)), 0.1);
  EXPECT_DOUBLE_EQ(*HistogramQuantile(0.99, {}, Cumulative(0, 0, 99, 100)),
                   0.1);
}

TEST(HistogramQuantileTest, NothingObservedOrMismatchedBucketsIsNull) {
  EXPECT_FALSE(HistogramQuantile(0.5, {}, Cumulative(0, 0, 0, 0)));
  Buckets same = Cumulative(3, 4, 5, 6);
  EXPECT_FALSE(HistogramQuantile(0.5, same, same));
  EXPECT_FALSE(HistogramQuantile(0.5, {{1, 0.001}}, same));
  EXPECT_FALSE(HistogramQuantile(0.5, {}, {}));
}

TEST(CounterRateTest, PerSecondOverTheSpanNeverNegative) {
  EXPECT_DOUBLE_EQ(CounterRate(10, 70, absl::Seconds(60)), 1.0);
  EXPECT_DOUBLE_EQ(CounterRate(10, 70, absl::ZeroDuration()), 0.0);
  EXPECT_DOUBLE_EQ(CounterRate(70, 10, absl::Seconds(60)), 0.0);
}

StatusSample At(int seconds) {
  StatusSample s;
  s.time = absl::FromUnixSeconds(seconds);
  s.requests = seconds;
  return s;
}

TEST(SampleRingTest, KeepsTheNewestAndFindsTheWindowStart) {
  SampleRing ring(3);
  ring.Push(At(1));
  EXPECT_EQ(ring.Latest().requests, 1);
  EXPECT_EQ(ring.WindowStart(absl::Seconds(60)).requests, 1);
  for (int t = 2; t <= 5; ++t) ring.Push(At(t));  // wraps: holds 3, 4, 5
  EXPECT_EQ(ring.size(), 3u);
  EXPECT_EQ(ring.Latest().requests, 5);
  EXPECT_EQ(ring.WindowStart(absl::Seconds(60)).requests, 3);
  EXPECT_EQ(ring.WindowStart(absl::Seconds(1)).requests, 4);
  EXPECT_EQ(ring.WindowStart(absl::ZeroDuration()).requests, 5);
  for (int t = 6; t <= 100; ++t) ring.Push(At(t));
  EXPECT_EQ(ring.WindowStart(absl::Seconds(60)).requests, 98);
}

LookupResult Hits(int hits, int misses) {
  LookupResult r;
  for (int i = 0; i < hits; ++i)
    r.entries.push_back({true, Tier::kDram, 1, 0, 0});
  for (int i = 0; i < misses; ++i) r.entries.push_back({});
  r.prefix_hits = static_cast<uint32_t>(hits);
  return r;
}

class StatusPageTest : public ::testing::Test {
 protected:
  StatusPageTest() : metrics_(registry_) {}

  std::unique_ptr<StatusPage> NewPage(
      absl::Duration period = absl::Seconds(1)) {
    return std::make_unique<StatusPage>(
        StatusPage::Sources{[this] { return stats_; },
                            [this] { return registry_.Collect(); },
                            [this] { return serving_; }},
        clock_, period);
  }
  // Advances the clock by `seconds`, sampling each `period`.
  void Run(StatusPage& page, int seconds, int period = 1) {
    for (int i = 0; i < seconds; i += period) {
      clock_.Advance(absl::Seconds(period));
      page.TakeSample();
    }
  }

  FakeClock clock_;
  prometheus::Registry registry_;
  ServerMetrics metrics_;
  StoreStats stats_;
  bool serving_ = true;
};

TEST_F(StatusPageTest, HitRatiosOverTheLastMinuteAndSinceStart) {
  auto page = NewPage();
  metrics_.RecordLookup("a", /*prefix=*/true, Hits(8, 2));
  Run(*page, 30);
  EXPECT_THAT(
      page->Json(),
      HasSubstr(R"("hit_ratio":{"last_minute":0.8,"since_start":0.8})"));
  EXPECT_THAT(
      page->Json(),
      HasSubstr(R"("prefix_hit_ratio":{"last_minute":0.8,"since_start":0.8})"));
  EXPECT_THAT(page->Json(), HasSubstr(R"("window_seconds":30,)"));

  // 31 s later the first lookup has left the window (and the ring wrapped).
  metrics_.RecordLookup("a", /*prefix=*/false, Hits(0, 10));
  Run(*page, 31);
  std::string json = page->Json();
  EXPECT_THAT(json,
              HasSubstr(R"("hit_ratio":{"last_minute":0,"since_start":0.4})"));
  EXPECT_THAT(
      json, HasSubstr(R"("lookup_keys":{"last_minute":10,"since_start":20})"));
  EXPECT_THAT(json, HasSubstr(R"("window_seconds":60,)"));
  EXPECT_THAT(
      json,
      HasSubstr(
          R"("prefix_hit_ratio":{"last_minute":null,"since_start":0.8})"));

  Run(*page, 60);
  json = page->Json();
  EXPECT_THAT(
      json, HasSubstr(R"("hit_ratio":{"last_minute":null,"since_start":0.4})"));
  EXPECT_THAT(json,
              HasSubstr(R"("lookup_keys":{"last_minute":0,"since_start":20})"));
}

TEST_F(StatusPageTest, RatesAndLatencyPercentilesOverTheWindow) {
  auto page = NewPage();
  metrics_.AddBytesIn(600 << 20);
  for (int i = 0; i < 100; ++i) {
    metrics_.RecordRequest("Lookup", absl::StatusCode::kOk,
                           absl::Microseconds(2000));
  }
  Run(*page, 60);
  std::string json = page->Json();
  EXPECT_THAT(json,
              HasSubstr(absl::StrCat(R"("bytes_in_per_second":)", 10 << 20,
                                     R"(,"bytes_out_per_second":0,)")));
  EXPECT_THAT(json, HasSubstr(R"("requests_per_second":1.66667})"));
  // 2 ms falls in the (1 ms, 2.5 ms] bucket.
  EXPECT_THAT(
      json, HasSubstr(R"({"op":"Lookup","requests":100,"p50_seconds":0.00175,)"
                      R"("p99_seconds":0.002485})"));

  // A minute of slow Reads later, Lookup had no requests in the window.
  for (int i = 0; i < 10; ++i) {
    metrics_.RecordRequest("Read", absl::StatusCode::kOk, absl::Seconds(5));
  }
  Run(*page, 60);
  json = page->Json();
  EXPECT_THAT(json,
              HasSubstr(R"({"op":"Lookup","requests":0,"p50_seconds":null,)"
                        R"("p99_seconds":null})"));
  EXPECT_THAT(json,
              HasSubstr(R"({"op":"Read","requests":10,"p50_seconds":6.25,)"));
  EXPECT_THAT(json, HasSubstr(R"("bytes_in_per_second":0,)"));
  EXPECT_THAT(
      json,
      HasSubstr(
          R"("totals":{"bytes_in":629145600,"bytes_out":0,"requests":110})"));
}

TEST_F(StatusPageTest, IntegrityErrorsInTheLastHour) {
  auto page = NewPage(absl::Seconds(10));
  EXPECT_THAT(page->Json(),
              HasSubstr(R"("integrity_errors":{"total":0,"last_hour":0,)"
                        R"("last_unix_seconds":null})"));
  stats_.integrity_errors = 2;
  metrics_.UpdateFromStats(stats_);
  Run(*page, 10, 10);
  const int64_t at = absl::ToUnixSeconds(clock_.Now());
  EXPECT_THAT(
      page->Json(),
      HasSubstr(absl::StrCat(R"("integrity_errors":{"total":2,"last_hour":2,)",
                             R"("last_unix_seconds":)", at, "}")));
  stats_.integrity_errors = 3;
  metrics_.UpdateFromStats(stats_);
  Run(*page, 1800, 10);
  EXPECT_THAT(page->Json(), HasSubstr(R"("total":3,"last_hour":3,)"));
  Run(*page, 1800, 10);  // the first two are now more than an hour old
  EXPECT_THAT(page->Json(), HasSubstr(R"("total":3,"last_hour":1,)"));
  Run(*page, 10, 10);
  EXPECT_THAT(page->Json(), HasSubstr(R"("total":3,"last_hour":0,)"));
}

TEST_F(StatusPageTest, StoreStateHealthAndTopNamespaces) {
  stats_.dram = {/*used_bytes=*/4096, /*capacity_bytes=*/1 << 20, /*blocks=*/3};
  stats_.sessions = 2;
  stats_.pins = 1;
  stats_.reservations = 4;
  stats_.promotions = 60;
  for (int i = 0; i < 12; ++i) {
    stats_.namespaces.push_back(
        {absl::StrCat("ns", i), 1, 100, uint64_t(i), 0});
  }
  stats_.namespaces.push_back({"<script>\"x\\", 1, 1000, 5, 5});
  auto page = NewPage();
  serving_ = false;
  const std::string json = page->Json();
  EXPECT_THAT(json, HasSubstr(R"("health":"NOT_SERVING")"));
  EXPECT_THAT(
      json,
      HasSubstr(
          R"("dram":{"used_bytes":4096,"capacity_bytes":1048576,"blocks":3})"));
  EXPECT_THAT(
      json,
      HasSubstr(
          R"("sessions":2,"pins":1,"pinned_blocks":0,"reservations":4,)"));
  EXPECT_THAT(json, HasSubstr(R"("promotions":{"total":60,"per_second":0})"));
  // By lookups, then bytes: ns11 .. ns6, the odd one (5 lookups, more bytes
  // than ns5), ns5, ns4, ns3; 13 in all.
  EXPECT_THAT(json,
              HasSubstr(R"("namespaces":{"count":13,"top":[{"name":"ns11",)"));
  EXPECT_THAT(
      json,
      HasSubstr(R"({"name":"\u003cscript\u003e\"x\\","blocks":1,"bytes":1000,)"
                R"("lookups":5,"hits":5},{"name":"ns5",)"));
  EXPECT_THAT(json, HasSubstr(R"({"name":"ns3",)"));
  EXPECT_THAT(json, Not(HasSubstr(R"({"name":"ns2",)")));

  serving_ = true;
  stats_.promotions = 120;
  Run(*page, 60);
  EXPECT_THAT(page->Json(), HasSubstr(R"("health":"SERVING")"));
  EXPECT_THAT(page->Json(),
              HasSubstr(R"("promotions":{"total":120,"per_second":1})"));
  EXPECT_THAT(page->Json(), HasSubstr(R"("uptime_seconds":60,)"));
}

TEST_F(StatusPageTest, RoutesServeMetricsPageAndJson) {
  auto page = NewPage();
  auto routes = MetricsPortRoutes(registry_, *page);
  HttpResponse metrics = routes.at("/metrics")();
  EXPECT_EQ(metrics.content_type, "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_THAT(metrics.body, HasSubstr("kvdepot_build_info{"));
  HttpResponse json = routes.at("/status.json")();
  EXPECT_EQ(json.content_type, "application/json");
  EXPECT_THAT(json.body, HasSubstr(R"({"health":"SERVING",)"));
  HttpResponse html = routes.at("/")();
  EXPECT_EQ(html.content_type, "text/html; charset=utf-8");
  EXPECT_THAT(html.body, HasSubstr("fetch(\"status.json\""));
  EXPECT_THAT(html.body,
              Not(HasSubstr("://")));  // nothing loads from elsewhere
  // A poll that gets no answer is aborted (a hung daemon left the fetch
  // pending forever, and no poll came after it), and a failed one says so
  // in the health badge, not only in the "updated" line.
  EXPECT_THAT(html.body, HasSubstr("new AbortController()"));
  EXPECT_THAT(html.body, HasSubstr("signal: controller.signal"));
  EXPECT_THAT(html.body, HasSubstr("const TIMEOUT_MS = 5000;"));
  EXPECT_THAT(html.body, HasSubstr("health.textContent = \"UNREACHABLE\""));
  EXPECT_THAT(html.body, Not(HasSubstr("innerHTML")));  // textContent only
}

}  // namespace
}  // namespace kvdepot
