// StatusPage: what kvdepotd's operator page shows (`/` and `/status.json` on
// the metrics port): health, version, uptime, tiers, hit ratios, throughput,
// latency percentiles, top namespaces, sessions, integrity errors.
//
// Windowed figures ("last minute") come from a ring of per-second samples of
// the Prometheus counters, taken by a sampler thread: rates are counter
// deltas over the window, latency percentiles are interpolated from the
// deltas of the kvdepot_request_duration_seconds buckets (as PromQL's
// histogram_quantile). Memory is bounded: kWindow / period samples, plus one
// entry per second that saw integrity errors in the last hour.
//
// Thread-safe.
#ifndef KVDEPOT_SERVER_STATUS_PAGE_H_
#define KVDEPOT_SERVER_STATUS_PAGE_H_

#include <prometheus/client_metric.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/http_server.h"
#include "storage/clock.h"
#include "storage/tiered_store.h"

namespace kvdepot {

// One reading of the counters the status page needs over time.
struct StatusSample {
  absl::Time time;
  // From the kvdepot_* metric families (sums over their labels).
  double lookup_keys = 0;  // kvdepot_lookup_keys_total
  double lookup_hits = 0;  // ... {result="hit"}
  double prefix_keys = 0;  // kvdepot_lookup_prefix_keys_asked_total
  double prefix_hits = 0;  // kvdepot_lookup_prefix_hit_keys_total
  double bytes_in = 0;     // kvdepot_bytes_total{direction="in"}
  double bytes_out = 0;
  double requests = 0;          // kvdepot_requests_total
  double integrity_errors = 0;  // kvdepot_integrity_errors_total
  // kvdepot_request_duration_seconds buckets by op (cumulative; the last
  // bucket's upper bound is +Inf).
  std::map<std::string, std::vector<prometheus::ClientMetric::Bucket>> latency;
  // From StoreStats.
  uint64_t demotions = 0;
  uint64_t promotions = 0;
};

// Reads a sample's metric fields out of a registry collection.
StatusSample SampleMetrics(
    const std::vector<prometheus::MetricFamily>& families, absl::Time time);

// Per-second rate of a counter that went from `from` to `to` in `span`; 0 for
// an empty span, never negative.
double CounterRate(double from, double to, absl::Duration span);

// The q-quantile (0 < q <= 1) of the observations a histogram gained between
// two readings of its cumulative buckets, interpolated linearly inside the
// bucket it falls in; the highest finite bound when it falls in +Inf.
// nullopt when nothing was observed. `from` may be empty (all zero) or must
// have `to`'s bounds.
std::optional<double> HistogramQuantile(
    double q, const std::vector<prometheus::ClientMetric::Bucket>& from,
    const std::vector<prometheus::ClientMetric::Bucket>& to);

// A fixed-capacity ring of samples, oldest overwritten first. Not
// thread-safe.
class SampleRing {
 public:
  // REQUIRES: capacity >= 1.
  explicit SampleRing(size_t capacity);

  void Push(StatusSample sample);
  size_t size() const { return size_; }
  // REQUIRES: size() > 0.
  const StatusSample& Latest() const;
  // The oldest sample taken no more than `window` before Latest() (Latest()
  // itself when there is no older one). REQUIRES: size() > 0.
  const StatusSample& WindowStart(absl::Duration window) const;

 private:
  // i-th sample from the oldest.
  const StatusSample& At(size_t i) const;

  std::vector<StatusSample> ring_;
  size_t next_ = 0;  // where the next Push writes
  size_t size_ = 0;
};

class StatusPage {
 public:
  // "Last minute" figures span this much time.
  static constexpr absl::Duration kWindow = absl::Seconds(60);
  // Integrity errors are also counted over this much time.
  static constexpr absl::Duration kErrorWindow = absl::Hours(1);
  // Namespaces listed, by keys looked up (then bytes).
  static constexpr size_t kTopNamespaces = 10;

  // Called from the sampler thread (store_stats, metrics) and the HTTP
  // threads (serving): thread-safe, and alive as long as this object.
  struct Sources {
    std::function<StoreStats()> store_stats;
    // The registry's metric families (prometheus::Registry::Collect).
    std::function<std::vector<prometheus::MetricFamily>()> metrics;
    // False while the daemon drains for shutdown.
    std::function<bool()> serving;
  };

  // Takes a first sample. `clock` must outlive this object; `sample_period`
  // is the sampler's period (the ring holds kWindow of them). REQUIRES:
  // 0 < sample_period <= kWindow.
  StatusPage(Sources sources, const Clock& clock,
             absl::Duration sample_period = absl::Seconds(1));
  // Stops the sampler.
  ~StatusPage();
  StatusPage(const StatusPage&) = delete;
  StatusPage& operator=(const StatusPage&) = delete;

  // Starts a thread that calls TakeSample() every sample period until
  // destruction. At most once.
  void StartSampler();
  // Reads the sources once and pushes a sample.
  void TakeSample();

  // The body of /status.json (documented field by field in status_page.cc).
  std::string Json();
  // The body of `/`: one self-contained page that polls /status.json.
  static const char* Html();

 private:
  void SamplerLoop();

  const Sources sources_;
  const Clock& clock_;
  const absl::Duration period_;
  const absl::Time start_;

  absl::Mutex mu_;
  SampleRing ring_ ABSL_GUARDED_BY(mu_);
  StoreStats store_ ABSL_GUARDED_BY(mu_);  // at the latest sample
  // (time, count) of samples that saw new integrity errors, kErrorWindow.
  std::deque<std::pair<absl::Time, uint64_t>> errors_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Time> last_error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sampler_;
};

// The routes of kvdepotd's metrics port: /metrics (the Prometheus text
// exposition of `registry`), / (the status page) and /status.json (of
// `page`). Both must outlive the server that serves them.
absl::flat_hash_map<std::string, HttpHandler> MetricsPortRoutes(
    prometheus::Registry& registry, StatusPage& page);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_STATUS_PAGE_H_
