#include "server/metrics.h"

#include <algorithm>

#include "server/version.h"

namespace kvdepot {

namespace {
// From 5 us: Lookup, Unpin, KeepAlive and Stats mostly end under 50 us,
// and a quantile inside the first bucket is interpolation only. To 300 s:
// Verify, Compact and large Read/Write streams take longer than 10 s.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      5e-6,   10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3,
      2.5e-3, 5e-3,  10e-3, 25e-3, 50e-3,  100e-3, 250e-3, 500e-3,
      1.0,    2.5,   10.0,  30.0,  60.0,   300.0};
  return *b;
}
}  // namespace

namespace {

prometheus::Counter& SingleCounter(prometheus::Registry& registry,
                                   const std::string& name,
                                   const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Gauge& SingleGauge(prometheus::Registry& registry, const std::string& name,
                               const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

ServerMetrics::ServerMetrics(prometheus::Registry& registry,
                             int namespace_labels)
    : namespace_labels_(static_cast<size_t>(std::max(namespace_labels, 0))),
      requests_(prometheus::BuildCounter()
                    .Name("kvdepot_requests_total")
                    .Help("RPCs finished, by operation and gRPC status code")
                    .Register(registry)),
      durations_(prometheus::BuildHistogram()
                     .Name("kvdepot_request_duration_seconds")
                     .Help("RPC latency by operation")
                     .Register(registry)),
      lookup_keys_(prometheus::BuildCounter()
                       .Name("kvdepot_lookup_keys_total")
                       .Help("Keys looked up, by namespace, result and tier "
                             "(every key asked counts once: the hit ratio's "
                             "denominator is the sum over results)")
                       .Register(registry)),
      prefix_asked_(prometheus::BuildCounter()
                        .Name("kvdepot_lookup_prefix_keys_asked_total")
                        .Help("Keys asked by prefix lookups, by namespace")
                        .Register(registry)),
      prefix_hit_(
          prometheus::BuildCounter()
              .Name("kvdepot_lookup_prefix_hit_keys_total")
              .Help("Leading keys found by prefix lookups, by namespace")
              .Register(registry)),
      bytes_(prometheus::BuildCounter()
                 .Name("kvdepot_bytes_total")
                 .Help("Block bytes moved, by direction and transport. "
                       "in: over gRPC every block byte received, stored or "
                       "not (one already stored is dropped as it arrives, "
                       "one of a failed stream too); over UCX the bytes of "
                       "blocks stored (a client does not send a block the "
                       "daemon has)")
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
                     .Help("Blocks removed from a tier, by reason: capacity "
                           "(to make room), admin (Evict), corrupt (failed "
                           "its checksum)")
                     .Register(registry)),
      integrity_errors_(prometheus::BuildCounter()
                            .Name("kvdepot_integrity_errors_total")
                            .Help("Blocks whose bytes failed their XXH3-64 "
                                  "checksum, never served: on NVMe when read "
                                  "(dropped); in DRAM when demoted (dropped), "
                                  "copied to a co-located client (the copy "
                                  "refused with DATA_LOSS), or reported by a "
                                  "client that received it and confirmed by "
                                  "hashing the DRAM copy again (the DRAM copy "
                                  "dropped unless pinned or being demoted)")
                            .Register(registry)),
      bytes_in_(bytes_.Add({{"direction", "in"}, {"transport", "grpc"}})),
      bytes_out_(bytes_.Add({{"direction", "out"}, {"transport", "grpc"}})),
      ucx_bytes_in_(bytes_.Add({{"direction", "in"}, {"transport", "ucx"}})),
      ucx_bytes_out_(bytes_.Add({{"direction", "out"}, {"transport", "ucx"}})),
      in_place_(prometheus::BuildCounter()
                    .Name("kvdepot_ucx_in_place_bytes_total")
                    .Help("Of kvdepot_bytes_total{transport=\"ucx\"}: bytes "
                          "the daemon copied itself into or out of a "
                          "co-located client's shared memory (checked "
                          "against their checksum as they landed)")
                    .Register(registry)),
      ucx_in_place_in_(in_place_.Add({{"direction", "in"}})),
      ucx_in_place_out_(in_place_.Add({{"direction", "out"}})),
      ucx_requests_(prometheus::BuildCounter()
                        .Name("kvdepot_ucx_requests_total")
                        .Help("PushBlocks / PullBlocks requests that came "
                              "over UCX active messages instead of gRPC "
                              "(also counted in kvdepot_requests_total); "
                              "op=PullBlocksWithData: a put that came with "
                              "its blocks' bytes")
                        .Register(registry)),
      ucx_push_requests_(ucx_requests_.Add({{"op", "PushBlocks"}})),
      ucx_pull_requests_(ucx_requests_.Add({{"op", "PullBlocks"}})),
      ucx_pull_data_requests_(
          ucx_requests_.Add({{"op", "PullBlocksWithData"}})),
      ucx_refused_(prometheus::BuildCounter()
                       .Name("kvdepot_ucx_requests_refused_total")
                       .Help("Requests over UCX answered at once without being "
                             "served, by code: RESOURCE_EXHAUSTED (too many "
                             "in flight, for the daemon or the session), "
                             "NOT_FOUND (the session ended), UNAVAILABLE "
                             "(stopping), INVALID_ARGUMENT, "
                             "FAILED_PRECONDITION, PERMISSION_DENIED (not "
                             "over the session's own request link; not in "
                             "kvdepot_requests_total)")
                       .Register(registry)),
      ucx_held_bytes_(
          SingleGauge(registry, "kvdepot_ucx_held_bytes",
                      "DRAM bytes held for UCX transfers that UCX has not "
                      "ended: slots of puts and "
                      "blocks of gets abandoned while a co-located client did "
                      "not answer, freed when "
                      "UCX ends them or the session's worker goes")),
      ucx_colocated_workers_(
          SingleGauge(registry, "kvdepot_ucx_colocated_workers",
                      "UCX workers (each with a progress thread) of co-located "
                      "clients' sessions: "
                      "open ones, and ended ones still being stopped; at most "
                      "ucx_colocated_workers")),
      ucx_request_links_(
          SingleGauge(registry, "kvdepot_ucx_request_links",
                      "Client UCX workers the daemon's request worker keeps an "
                      "endpoint to, so that "
                      "their request connections need no wire-up answered by "
                      "kvdepotd: one per client "
                      "worker that opened a session and is still there")),
      ucx_endpoints_closing_(
          SingleGauge(registry, "kvdepot_ucx_endpoints_closing",
                      "UCX endpoints closing in order that wait for a client "
                      "that stopped answering (a stalled session's, or a "
                      "wire-up to a worker that never answered), each with "
                      "its socket open; at ucx max_endpoints_closing (1024) "
                      "new sessions get no UCX endpoint")),
      sessions_(SingleGauge(registry, "kvdepot_sessions_active",
                            "Open client sessions")),
      pins_(SingleGauge(registry, "kvdepot_pins_active", "Live pins")),
      reservations_(SingleGauge(registry, "kvdepot_reservations_active",
                                "Open two-phase put reservations")),
      draining_(SingleGauge(registry, "kvdepot_draining",
                            "1 while the daemon refuses new puts (kvdepotctl "
                            "drain, the SetDraining RPC, or "
                            "SIGTERM), else 0")),
      nvme_writable_(SingleGauge(
          registry, "kvdepot_nvme_writable",
          "0 while the NVMe tier takes no writes (disk full, I/O error: blocks "
          "leaving DRAM are dropped), else 1 (also when the tier is off)")),
      start_time_(SingleGauge(
          registry, "kvdepot_start_time_seconds",
          "When the daemon started, in seconds since the Unix epoch")) {
  prometheus::BuildGauge()
      .Name("kvdepot_build_info")
      .Help("Build of the running daemon (value is always 1)")
      .Register(registry)
      .Add({{"version", kVersion}, {"commit", kGitCommit}})
      .Set(1);
  // Every series with fixed labels exists from the start at 0, so that
  // increase() and rate() see the first event.
  absl::MutexLock lock(&mu_);
  auto eviction = [&](const char* tier, const char* reason) {
    return Mirror{&evictions_.Add({{"tier", tier}, {"reason", reason}})};
  };
  dram_evictions_ = eviction("dram", "capacity");
  nvme_evictions_ = eviction("nvme", "capacity");
  dram_admin_evictions_ = eviction("dram", "admin");
  nvme_admin_evictions_ = eviction("nvme", "admin");
  nvme_corrupt_evictions_ = eviction("nvme", "corrupt");
  dram_corrupt_evictions_ = eviction("dram", "corrupt");
  dram_integrity_errors_ = Mirror{&integrity_errors_.Add({{"tier", "dram"}})};
  for (absl::StatusCode code :
       {absl::StatusCode::kResourceExhausted, absl::StatusCode::kNotFound,
        absl::StatusCode::kUnavailable, absl::StatusCode::kInvalidArgument,
        absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kPermissionDenied}) {
    ucx_refused_.Add({{"code", absl::StatusCodeToString(code)}});
  }
  nvme_integrity_errors_ = Mirror{&integrity_errors_.Add({{"tier", "nvme"}})};
  demotions_ = Mirror{&SingleCounter(registry, "kvdepot_demotions_total",
                                     "DRAM blocks written to the NVMe tier")};
  demotion_failures_ = Mirror{&SingleCounter(
      registry, "kvdepot_demotion_failures_total",
      "DRAM blocks that could not be written to the NVMe tier (disk full, "
      "I/O error)")};
  room_wait_timeouts_ = Mirror{&SingleCounter(
      registry, "kvdepot_dram_room_wait_timeouts_total",
      "Puts and promotions that waited 5 s for the evictor to demote room in "
      "DRAM and then dropped blocks to make it, or failed: the NVMe tier "
      "demotes too slowly for the write load")};
  demotions_skipped_ = Mirror{&SingleCounter(
      registry, "kvdepot_demotions_skipped_total",
      "DRAM blocks not admitted to the NVMe tier (read too rarely)")};
  promotions_ = Mirror{&SingleCounter(
      registry, "kvdepot_promotions_total",
      "NVMe blocks read back into DRAM by pinned lookups (those a prefix "
      "lookup read after its first miss included: they are not hits)")};
  promotions_shed_ = Mirror{&SingleCounter(
      registry, "kvdepot_promotions_shed_total",
      "NVMe blocks pinned lookups reported as misses because the promotion "
      "queue was full (more load than the disk reads)")};
  nvme_write_bytes_ = Mirror{&SingleCounter(
      registry, "kvdepot_nvme_write_bytes_total",
      "Block bytes written to the NVMe tier")};
}

ServerMetrics::NamespaceCounters& ServerMetrics::CountersFor(absl::string_view ns,
                                                             bool known)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
  auto it = namespaces_.find(ns);
  if (it != namespaces_.end()) return it->second;
  // Only namespaces that exist get a label of their own: lookups in made-up
  // names would take the labels before real namespaces were looked up.
  const size_t labelled =
      namespaces_.size() - namespaces_.count(kOtherNamespacesLabel);
  const std::string label = known && labelled < namespace_labels_
                                ? std::string(ns)
                                : std::string(kOtherNamespacesLabel);
  if (auto other = namespaces_.find(label); other != namespaces_.end()) {
    return other->second;
  }
  auto keys = [&](const char* result, const char* tier) {
    return &lookup_keys_.Add({{"namespace", label}, {"result", result}, {"tier", tier}});
  };
  NamespaceCounters c{keys("hit", "dram"), keys("hit", "nvme"), keys("miss", "none"),
                      &prefix_asked_.Add({{"namespace", label}}),
                      &prefix_hit_.Add({{"namespace", label}})};
  return namespaces_.emplace(label, c).first->second;
}

void ServerMetrics::RecordUcxRequest(const std::string& op) {
  (op == "PushBlocks"   ? ucx_push_requests_
   : op == "PullBlocks" ? ucx_pull_requests_
                        : ucx_pull_data_requests_)
      .Increment();
}

void ServerMetrics::RecordUcxRefused(absl::StatusCode code) {
  ucx_refused_.Add({{"code", absl::StatusCodeToString(code)}}).Increment();
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

void ServerMetrics::RecordLookup(absl::string_view ns, bool prefix,
                                 const LookupResult& result) {
  uint64_t dram = 0, nvme = 0, miss = 0;
  for (const LookupEntry& e : result.entries) {
    if (!e.found) {
      ++miss;
    } else if (e.tier == Tier::kNvme || e.promoted) {
      // A promoted block is in DRAM now, but the hit is NVMe's: the hit
      // ratio by tier shows what each tier serves.
      ++nvme;
    } else {
      ++dram;
    }
  }
  absl::MutexLock lock(&mu_);
  NamespaceCounters& c = CountersFor(ns, result.namespace_known);
  if (dram) c.hit_dram->Increment(static_cast<double>(dram));
  if (nvme) c.hit_nvme->Increment(static_cast<double>(nvme));
  if (miss) c.miss->Increment(static_cast<double>(miss));
  if (prefix) {
    c.prefix_asked->Increment(static_cast<double>(result.entries.size()));
    c.prefix_hit->Increment(static_cast<double>(result.prefix_hits));
  }
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
  draining_.Set(st.draining ? 1 : 0);
  nvme_writable_.Set(st.nvme_write_error.empty() ? 1 : 0);
  absl::MutexLock lock(&mu_);
  dram_evictions_.Advance(st.dram.evictions);
  nvme_evictions_.Advance(st.nvme.evictions);
  dram_admin_evictions_.Advance(st.dram.admin_evictions);
  nvme_admin_evictions_.Advance(st.nvme.admin_evictions);
  nvme_corrupt_evictions_.Advance(st.integrity_errors);
  dram_corrupt_evictions_.Advance(st.dram_corrupt_evictions);
  nvme_integrity_errors_.Advance(st.integrity_errors);
  dram_integrity_errors_.Advance(st.dram_integrity_errors);
  demotions_.Advance(st.demotions);
  demotion_failures_.Advance(st.demotion_failures);
  room_wait_timeouts_.Advance(st.room_wait_timeouts);
  demotions_skipped_.Advance(st.demotions_skipped);
  promotions_.Advance(st.promotions);
  promotions_shed_.Advance(st.promotions_shed);
  nvme_write_bytes_.Advance(st.nvme_write_bytes);
}

}  // namespace kvdepot
