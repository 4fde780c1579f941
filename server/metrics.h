// ServerMetrics: the Prometheus metrics of kvdepotd. Created from a registry
// that the caller (main, or a test) owns, and passed to the components that
// update them; there are no process-wide metric singletons.
//
// Thread-safe (prometheus-cpp metrics are).
#ifndef KVDEPOT_SERVER_METRICS_H_
#define KVDEPOT_SERVER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/tiered_store.h"

namespace kvdepot {

class ServerMetrics {
 public:
  // `registry` must outlive this object.
  explicit ServerMetrics(prometheus::Registry& registry);
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // One finished RPC: counts kvdepot_requests_total{op,code} and observes
  // kvdepot_request_duration_seconds{op}.
  void RecordRequest(const std::string& op, absl::StatusCode code,
                     absl::Duration elapsed);
  // Keys looked up, split by outcome (the denominator of the hit ratio).
  void RecordLookup(uint64_t hits, uint64_t misses);
  // Block bytes through the gRPC byte path.
  void AddBytesIn(uint64_t n) { bytes_in_.Increment(static_cast<double>(n)); }
  void AddBytesOut(uint64_t n) { bytes_out_.Increment(static_cast<double>(n)); }

  // Copies gauges (tier usage, sessions, pins, reservations) and counter
  // deltas (evictions) from a store snapshot. Called about once a second.
  void UpdateFromStats(const StoreStats& stats);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& durations_;
  prometheus::Family<prometheus::Counter>& lookup_keys_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Gauge>& tier_used_;
  prometheus::Family<prometheus::Gauge>& tier_capacity_;
  prometheus::Family<prometheus::Gauge>& tier_blocks_;
  prometheus::Family<prometheus::Counter>& evictions_;
  prometheus::Counter& lookup_hits_;
  prometheus::Counter& lookup_misses_;
  prometheus::Counter& bytes_in_;
  prometheus::Counter& bytes_out_;
  prometheus::Gauge& sessions_;
  prometheus::Gauge& pins_;
  prometheus::Gauge& reservations_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, prometheus::Histogram*> histograms_
      ABSL_GUARDED_BY(mu_);
  uint64_t last_evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_METRICS_H_
