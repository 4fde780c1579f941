// Microbenchmarks of the engine: index lookups and arena allocation.
// Run: build/storage/storage_benchmark [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "storage/checksum.h"
#include "storage/dram_arena.h"
#include "storage/tiered_store.h"

namespace kvdepot {
namespace {

std::string KeyOf(uint64_t i) {
  std::string k(32, '\0');  // vLLM-sized keys: 32 bytes
  for (int b = 0; b < 8; ++b) k[b] = static_cast<char>(i >> (8 * b));
  return k;
}

// KeyOf(0 .. n-1) in a scattered order (stride 7919, prime to n), so that
// consecutive lookups touch unrelated entries.
std::vector<std::string> ScatteredKeys(int n) {
  std::vector<std::string> keys;
  keys.reserve(n);
  for (int i = 0; i < n; ++i) keys.push_back(KeyOf((uint64_t{7919} * i) % n));
  return keys;
}

std::unique_ptr<TieredStore> FilledStore(int n, uint64_t block) {
  StoreOptions o;
  o.dram_capacity = static_cast<uint64_t>(n) * 256 + (64 << 20);
  o.background_eviction = false;
  o.hugepages = HugePageMode::kOff;
  auto store = std::move(NewTieredStore(o, SystemClock())).value();
  auto session = store->OpenSession(absl::ZeroDuration(), "bench").value();
  std::vector<std::string> keys;
  std::vector<PutSpec> specs;
  std::string bytes(block, 'b');
  uint64_t sum = BlockChecksum(bytes);
  for (int i = 0; i < n; i += 1024) {
    keys.clear();
    specs.clear();
    for (int j = i; j < std::min(n, i + 1024); ++j) keys.push_back(KeyOf(j));
    for (const auto& k : keys) specs.push_back(PutSpec{k, "", block});
    auto r = store->BeginPut(session.id, "bench", specs).value();
    for (size_t s = 0; s < specs.size(); ++s) {
      std::memcpy(store->dram_region().base + r.slots[s].offset, bytes.data(),
                  block);
    }
    std::vector<uint64_t> sums(specs.size(), sum);
    (void)store->CommitPut(session.id, r.id, sums).value();
  }
  return store;
}

// Engine lookups per second on one thread, batches of 64 keys (all hits).
void BM_Lookup(benchmark::State& state) {
  const int n = 1 << 18;
  auto store = FilledStore(n, 64);
  const std::vector<std::string> keys = ScatteredKeys(n);
  std::vector<absl::string_view> batch(64);
  size_t pos = 0;
  for (auto _ : state) {
    for (auto& v : batch) v = keys[pos++ % n];
    auto r = store->Lookup(0, "bench", batch, false, false);
    benchmark::DoNotOptimize(r);
  }
  state.SetItemsProcessed(state.iterations() * batch.size());
}
BENCHMARK(BM_Lookup);

// The same lookups with pin, each batch unpinned after it (what a get
// does): the pin takes the blocks off the eviction lists and the unpin puts
// them back.
void BM_LookupPinned(benchmark::State& state) {
  const int n = 1 << 18;
  auto store = FilledStore(n, 64);
  auto session = store->OpenSession(absl::ZeroDuration(), "pins").value();
  const std::vector<std::string> keys = ScatteredKeys(n);
  std::vector<absl::string_view> batch(64);
  size_t pos = 0;
  for (auto _ : state) {
    for (auto& v : batch) v = keys[pos++ % n];
    auto r = store->Lookup(session.id, "bench", batch, false, true);
    if (!r.ok() || r->pin_id == 0 || !store->Unpin(session.id, r->pin_id).ok()) {
      state.SkipWithError("pinned lookup failed");
      break;
    }
  }
  state.SetItemsProcessed(state.iterations() * batch.size());
}
BENCHMARK(BM_LookupPinned);

// Baseline in the same run: the simplest index a user might write, an
// absl::flat_hash_map from std::string behind one absl::Mutex, same keys and
// batch shape. The ratio BM_Lookup/BM_BaselineMapLookup is what to report.
void BM_BaselineMapLookup(benchmark::State& state) {
  const int n = 1 << 18;
  absl::Mutex mu;
  absl::flat_hash_map<std::string, uint64_t> map;
  for (int i = 0; i < n; ++i) map.emplace(KeyOf(i), i);
  const std::vector<std::string> keys = ScatteredKeys(n);
  size_t pos = 0;
  for (auto _ : state) {
    uint64_t found = 0;
    absl::MutexLock lock(&mu);
    for (int b = 0; b < 64; ++b) {
      auto it = map.find(keys[pos++ % n]);
      found += it != map.end() ? it->second : 0;
    }
    benchmark::DoNotOptimize(found);
  }
  state.SetItemsProcessed(state.iterations() * 64);
}
BENCHMARK(BM_BaselineMapLookup);

void BM_ArenaAllocFree(benchmark::State& state) {
  auto arena =
      std::move(DramArena::Create(1 << 30, HugePageMode::kOff)).value();
  const size_t size = state.range(0);
  std::vector<uint64_t> live;
  for (auto _ : state) {
    live.push_back(arena->Allocate(size).value());
    if (live.size() == 64) {
      for (uint64_t off : live) arena->Free(off);
      live.clear();
    }
  }
  for (uint64_t off : live) arena->Free(off);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ArenaAllocFree)->Arg(64)->Arg(4096)->Arg(256 << 10)->Arg(2 << 20);

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  // As in kvdepotd: Debian's Abseil checks every Mutex operation for
  // deadlock cycles unless told not to.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
