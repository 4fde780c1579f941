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
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/tiered_store.h"

namespace kvdepot {

// The `namespace` label shared by namespaces past the labelled ones: not a
// valid namespace name, so a namespace named "other" keeps its own.
inline constexpr char kOtherNamespacesLabel[] = "(other)";

class ServerMetrics {
 public:
  // `registry` must outlive this object. `namespace_labels` namespaces (the
  // first seen) get their own value of the `namespace` label; the others
  // share "(other)", so a client inventing namespaces cannot grow the scrape
  // without bound.
  explicit ServerMetrics(prometheus::Registry& registry,
                         int namespace_labels = 32);
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // One finished RPC: counts kvdepot_requests_total{op,code} and observes
  // kvdepot_request_duration_seconds{op}.
  void RecordRequest(const std::string& op, absl::StatusCode code,
                     absl::Duration elapsed);
  // One lookup of namespace `ns`: every key asked counts once in
  // kvdepot_lookup_keys_total{namespace,result,tier} (a miss has tier
  // "none"; a block a pinned lookup promoted has tier "nvme", though the
  // reply says DRAM), so hits / all is the hit ratio. A prefix lookup also
  // counts its keys asked and its leading hits (the prefix hit ratio's two
  // sides).
  void RecordLookup(absl::string_view ns, bool prefix, const LookupResult& result);
  // Block bytes through the gRPC byte path.
  void AddBytesIn(uint64_t n) { bytes_in_.Increment(static_cast<double>(n)); }
  void AddBytesOut(uint64_t n) { bytes_out_.Increment(static_cast<double>(n)); }
  // Block bytes through the UCX data plane (PullBlocks in, PushBlocks out),
  // `in_place` of them copied by the daemon itself into or out of a
  // co-located client's shared memory.
  void AddUcxBytesIn(uint64_t n, uint64_t in_place) {
    ucx_bytes_in_.Increment(static_cast<double>(n));
    ucx_in_place_in_.Increment(static_cast<double>(in_place));
  }
  void AddUcxBytesOut(uint64_t n, uint64_t in_place) {
    ucx_bytes_out_.Increment(static_cast<double>(n));
    ucx_in_place_out_.Increment(static_cast<double>(in_place));
  }

  // DRAM bytes held for transfers UCX has not ended (slots of a put
  // abandoned while a co-located client did not answer): +n when held, -n
  // when freed (kvdepot_ucx_held_bytes).
  void AddUcxHeldBytes(int64_t n) { ucx_held_bytes_.Increment(static_cast<double>(n)); }
  // Co-located clients' own UCX workers (DataPlane::colocated_workers),
  // kvdepot_ucx_colocated_workers.
  void SetUcxColocatedWorkers(int n) {
    ucx_colocated_workers_.Set(static_cast<double>(n));
  }
  // kvdepot_ucx_request_links.
  void SetUcxRequestLinks(size_t n) { ucx_request_links_.Set(static_cast<double>(n)); }
  void SetUcxEndpointsClosing(size_t n) {
    ucx_endpoints_closing_.Set(static_cast<double>(n));
  }

  // One PushBlocks / PullBlocks request that came over UCX instead of gRPC
  // (kvdepot_ucx_requests_total{op}; it is also counted, when finished, in
  // kvdepot_requests_total).
  void RecordUcxRequest(const std::string& op);
  // One request over UCX answered at once with `code`, unserved (a limit
  // of DataPlaneOptions, an ended session, kvdepotd stopping):
  // kvdepot_ucx_requests_refused_total{code}. Not in kvdepot_requests_total.
  void RecordUcxRefused(absl::StatusCode code);

  // kvdepot_start_time_seconds: when the daemon started (unix seconds), so
  // that restarts show as changes of it. 0 until set.
  void SetStartTime(absl::Time start) {
    start_time_.Set(absl::ToDoubleSeconds(start - absl::UnixEpoch()));
  }

  // Copies gauges (tier usage, sessions, pins, reservations, draining) and counter
  // deltas (evictions, demotions, promotions, integrity errors, NVMe write
  // bytes) from a store snapshot. Called about once a second.
  void UpdateFromStats(const StoreStats& stats);

 private:
  struct NamespaceCounters {
    prometheus::Counter* hit_dram;
    prometheus::Counter* hit_nvme;
    prometheus::Counter* miss;
    prometheus::Counter* prefix_asked;
    prometheus::Counter* prefix_hit;
  };
  // A counter that mirrors a monotonic store counter.
  struct Mirror {
    prometheus::Counter* counter;
    uint64_t last = 0;
    void Advance(uint64_t now) {
      if (now > last) counter->Increment(static_cast<double>(now - last));
      last = now;
    }
  };

  // The counters of `ns`: its own labels while there are labels left and it
  // is `known` (exists in the store), else "(other)"'s.
  NamespaceCounters& CountersFor(absl::string_view ns, bool known);

  const size_t namespace_labels_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& durations_;
  prometheus::Family<prometheus::Counter>& lookup_keys_;
  prometheus::Family<prometheus::Counter>& prefix_asked_;
  prometheus::Family<prometheus::Counter>& prefix_hit_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Gauge>& tier_used_;
  prometheus::Family<prometheus::Gauge>& tier_capacity_;
  prometheus::Family<prometheus::Gauge>& tier_blocks_;
  prometheus::Family<prometheus::Counter>& evictions_;
  prometheus::Family<prometheus::Counter>& integrity_errors_;
  prometheus::Counter& bytes_in_;
  prometheus::Counter& bytes_out_;
  prometheus::Counter& ucx_bytes_in_;
  prometheus::Counter& ucx_bytes_out_;
  prometheus::Family<prometheus::Counter>& in_place_;
  prometheus::Counter& ucx_in_place_in_;
  prometheus::Counter& ucx_in_place_out_;
  prometheus::Family<prometheus::Counter>& ucx_requests_;
  prometheus::Counter& ucx_push_requests_;
  prometheus::Counter& ucx_pull_requests_;
  prometheus::Counter& ucx_pull_data_requests_;
  prometheus::Family<prometheus::Counter>& ucx_refused_;
  prometheus::Gauge& ucx_held_bytes_;
  prometheus::Gauge& ucx_colocated_workers_;
  prometheus::Gauge& ucx_request_links_;
  prometheus::Gauge& ucx_endpoints_closing_;
  prometheus::Gauge& sessions_;
  prometheus::Gauge& pins_;
  prometheus::Gauge& reservations_;
  prometheus::Gauge& draining_;
  prometheus::Gauge& nvme_writable_;
  prometheus::Gauge& start_time_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, prometheus::Histogram*> histograms_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, NamespaceCounters> namespaces_
      ABSL_GUARDED_BY(mu_);
  Mirror dram_evictions_ ABSL_GUARDED_BY(mu_);
  Mirror nvme_evictions_ ABSL_GUARDED_BY(mu_);
  Mirror dram_admin_evictions_ ABSL_GUARDED_BY(mu_);
  Mirror nvme_admin_evictions_ ABSL_GUARDED_BY(mu_);
  Mirror nvme_corrupt_evictions_ ABSL_GUARDED_BY(mu_);
  Mirror dram_corrupt_evictions_ ABSL_GUARDED_BY(mu_);
  Mirror nvme_integrity_errors_ ABSL_GUARDED_BY(mu_);
  Mirror dram_integrity_errors_ ABSL_GUARDED_BY(mu_);
  Mirror demotions_ ABSL_GUARDED_BY(mu_);
  Mirror demotion_failures_ ABSL_GUARDED_BY(mu_);
  Mirror room_wait_timeouts_ ABSL_GUARDED_BY(mu_);
  Mirror demotions_skipped_ ABSL_GUARDED_BY(mu_);
  Mirror promotions_ ABSL_GUARDED_BY(mu_);
  Mirror promotions_shed_ ABSL_GUARDED_BY(mu_);
  Mirror nvme_write_bytes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_METRICS_H_
