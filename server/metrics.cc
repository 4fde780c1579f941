#include "server/metrics.h"

#include "server/version.h"

namespace kvdepot {

namespace {
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
      25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,  2.5,    10.0};
  return *b;
}
}  // namespace

ServerMetrics::ServerMetrics(prometheus::Registry& registry)
    : requests_(prometheus::BuildCounter()
                    .Name("kvdepot_requests_total")
                    .Help("RPCs finished, by operation and gRPC status code")
                    .Register(registry)),
      durations_(prometheus::BuildHistogram()
                     .Name("kvdepot_request_duration_seconds")
                     .Help("RPC latency by operation")
                     .Register(registry)),
      lookup_keys_(prometheus::BuildCounter()
                       .Name("kvdepot_lookup_keys_total")
                       .Help("Keys looked up, by result")
                       .Register(registry)),
      bytes_(prometheus::BuildCounter()
                 .Name("kvdepot_bytes_total")
                 .Help("Block bytes moved, by direction and transport")
                 .Register(registry)),
      tier_used_(prometheus::BuildGauge()
                     .Name("kvdepot_tier_used_bytes")
                     .Help("Bytes used in a tier (blocks, keys, reservations)")
                     .Register(registry)),
      tier_capacity_(prometheus::BuildGauge()
                         .Name("kvdepot_tier_capacity_bytes")
                         .Help("Capacity of a tier in bytes")
                         .Register(registry)),
      tier_blocks_(prometheus::BuildGauge()
                       .Name("kvdepot_tier_blocks")
                       .Help("Blocks stored in a tier")
                       .Register(registry)),
      evictions_(prometheus::BuildCounter()
                     .Name("kvdepot_evictions_total")
                     .Help("Blocks evicted, by tier and reason")
                     .Register(registry)),
      lookup_hits_(lookup_keys_.Add({{"result", "hit"}})),
      lookup_misses_(lookup_keys_.Add({{"result", "miss"}})),
      bytes_in_(bytes_.Add({{"direction", "in"}, {"transport", "grpc"}})),
      bytes_out_(bytes_.Add({{"direction", "out"}, {"transport", "grpc"}})),
      sessions_(prometheus::BuildGauge()
                    .Name("kvdepot_sessions_active")
                    .Help("Open client sessions")
                    .Register(registry)
                    .Add({})),
      pins_(prometheus::BuildGauge()
                .Name("kvdepot_pins_active")
                .Help("Live pins")
                .Register(registry)
                .Add({})),
      reservations_(prometheus::BuildGauge()
                        .Name("kvdepot_reservations_active")
                        .Help("Open two-phase put reservations")
                        .Register(registry)
                        .Add({})) {
  prometheus::BuildGauge()
      .Name("kvdepot_build_info")
      .Help("Build of the running daemon (value is always 1)")
      .Register(registry)
      .Add({{"version", kVersion}, {"commit", kGitCommit}})
      .Set(1);
}

void ServerMetrics::RecordRequest(const std::string& op, absl::StatusCode code,
                                  absl::Duration elapsed) {
  requests_.Add({{"op", op}, {"code", absl::StatusCodeToString(code)}})
      .Increment();
  prometheus::Histogram* h;
  {
    absl::MutexLock lock(&mu_);
    auto it = histograms_.find(op);
    if (it == histograms_.end()) {
      it = histograms_.emplace(op, &durations_.Add({{"op", op}}, LatencyBuckets()))
               .first;
    }
    h = it->second;
  }
  h->Observe(absl::ToDoubleSeconds(elapsed));
}

void ServerMetrics::RecordLookup(uint64_t hits, uint64_t misses) {
  lookup_hits_.Increment(static_cast<double>(hits));
  lookup_misses_.Increment(static_cast<double>(misses));
}

void ServerMetrics::UpdateFromStats(const StoreStats& st) {
  for (const auto& [name, tier] : {std::pair{"dram", &st.dram}, std::pair{"nvme", &st.nvme}}) {
    const prometheus::Labels labels = {{"tier", name}};
    tier_used_.Add(labels).Set(static_cast<double>(tier->used_bytes));
    tier_capacity_.Add(labels).Set(static_cast<double>(tier->capacity_bytes));
    tier_blocks_.Add(labels).Set(static_cast<double>(tier->blocks));
  }
  sessions_.Set(static_cast<double>(st.sessions));
  pins_.Set(static_cast<double>(st.pins));
  reservations_.Set(static_cast<double>(st.reservations));
  absl::MutexLock lock(&mu_);
  if (st.dram.evictions > last_evictions_) {
    evictions_.Add({{"tier", "dram"}, {"reason", "capacity"}})
        .Increment(static_cast<double>(st.dram.evictions - last_evictions_));
    last_evictions_ = st.dram.evictions;
  }
}

}  // namespace kvdepot
