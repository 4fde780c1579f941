// Microbenchmarks of the engine: index lookups and arena allocation.
// Run: build/storage/storage_benchmark [--benchmark_filter=...]
//
// The engine's lookups and the baseline's (BM_Lookup vs
// BM_BaselineMapLookup) are compared in one run, interleaved: unless the
// command line says otherwise, main() adds --benchmark_repetitions=4 and
// --benchmark_enable_random_interleaving=true, so every benchmark runs 4
// times with the repetitions of all of them shuffled together (A B B A ...,
// not all of A then all of B), and the library prints each one's mean,
// median, stddev and cv. Report the ratio of the medians. Every lookup's
// status and hit count is checked: a failed or missed lookup ends the
// benchmark with an error instead of a figure.
#include <benchmark/benchmark.h>

#include <cstring>
#include <string>
#include <string_view>
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
  // Every one of the n blocks stays, however small: a block bound whose
  // floor is the arena's smallest allocation raises none.
  o.dram_max_blocks = o.dram_capacity / DramArena::kMinAlloc;
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

constexpr int kBlocks = 1 << 18;
constexpr size_t kBatch = 64;

// One store of kBlocks blocks and its keys, filled once and shared by the
// engine's benchmarks: the library calls a benchmark function once per
// trial and repetition, and refilling each time would dominate the run.
TieredStore& SharedStore() {
  static TieredStore* const store = FilledStore(kBlocks, 64).release();
  return *store;
}
const std::vector<std::string>& SharedKeys() {
  static const auto* const keys =
      new std::vector<std::string>(ScatteredKeys(kBlocks));
  return *keys;
}

// Hits in `r` (every key asked must be found).
size_t Hits(const LookupResult& r) {
  size_t hits = 0;
  for (const LookupEntry& e : r.entries) hits += e.found ? 1 : 0;
  return hits;
}

// Engine lookups per second on one thread, batches of 64 keys (all hits).
void BM_Lookup(benchmark::State& state) {
  TieredStore& store = SharedStore();
  const std::vector<std::string>& keys = SharedKeys();
  std::vector<absl::string_view> batch(kBatch);
  size_t pos = 0;
  for (auto _ : state) {
    for (auto& v : batch) v = keys[pos++ % kBlocks];
    auto r = store.Lookup(0, "bench", batch, false, false);
    if (!r.ok() || Hits(*r) != kBatch) {
      state.SkipWithError(r.ok() ? "lookup missed a stored key"
                                 : "lookup failed");
      break;
    }
    benchmark::DoNotOptimize(r);
  }
  state.SetItemsProcessed(state.iterations() * batch.size());
}
BENCHMARK(BM_Lookup);

// The same lookups with pin, each batch unpinned after it (what a get
// does): the pin takes the blocks off the eviction lists and the unpin puts
// them back.
void BM_LookupPinned(benchmark::State& state) {
  TieredStore& store = SharedStore();
  static const SessionId session =
      store.OpenSession(absl::ZeroDuration(), "pins").value().id;
  const std::vector<std::string>& keys = SharedKeys();
  std::vector<absl::string_view> batch(kBatch);
  size_t pos = 0;
  for (auto _ : state) {
    for (auto& v : batch) v = keys[pos++ % kBlocks];
    auto r = store.Lookup(session, "bench", batch, false, true);
    if (!r.ok() || Hits(*r) != kBatch || r->pin_id == 0 ||
        !store.Unpin(session, r->pin_id).ok()) {
      state.SkipWithError("pinned lookup failed or missed");
      break;
    }
  }
  state.SetItemsProcessed(state.iterations() * batch.size());
}
BENCHMARK(BM_LookupPinned);

// Baseline in the same run: the simplest index a user might write, an
// absl::flat_hash_map from std::string behind one absl::Mutex, same keys and
// batch shape. The ratio of the medians of BM_Lookup and
// BM_BaselineMapLookup is what to report.
void BM_BaselineMapLookup(benchmark::State& state) {
  static absl::Mutex mu;
  static const auto* const map = [] {
    auto* m = new absl::flat_hash_map<std::string, uint64_t>();
    for (int i = 0; i < kBlocks; ++i) m->emplace(KeyOf(i), i);
    return m;
  }();
  const std::vector<std::string>& keys = SharedKeys();
  size_t pos = 0;
  for (auto _ : state) {
    size_t hits = 0;
    uint64_t sum = 0;
    {
      absl::MutexLock lock(&mu);
      for (size_t b = 0; b < kBatch; ++b) {
        auto it = map->find(keys[pos++ % kBlocks]);
        if (it != map->end()) {
          ++hits;
          sum += it->second;
        }
      }
    }
    if (hits != kBatch) {
      state.SkipWithError("baseline lookup missed a stored key");
      break;
    }
    benchmark::DoNotOptimize(sum);
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_BaselineMapLookup);

void BM_ArenaAllocFree(benchmark::State& state) {
  absl::StatusOr<std::unique_ptr<DramArena>> created =
      DramArena::Create(1 << 30, HugePageMode::kOff);
  if (!created.ok()) {
    state.SkipWithError("DramArena::Create failed");
    return;
  }
  DramArena& arena = **created;
  const size_t size = state.range(0);
  std::vector<uint64_t> live;
  for (auto _ : state) {
    absl::StatusOr<uint64_t> off = arena.Allocate(size);
    if (!off.ok()) {
      state.SkipWithError("DramArena::Allocate failed");
      break;
    }
    live.push_back(*off);
    if (live.size() == 64) {
      for (uint64_t o : live) arena.Free(o);
      live.clear();
    }
  }
  for (uint64_t o : live) arena.Free(o);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ArenaAllocFree)->Arg(64)->Arg(4096)->Arg(256 << 10)->Arg(2 << 20);

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  // As in kvdepotd: Debian's Abseil checks every Mutex operation for
  // deadlock cycles unless told not to.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // The engine and its baseline alternate in one run (BENCHMARKS.md):
  // repetitions, shuffled together, unless the command line sets them.
  std::vector<char*> args(argv, argv + argc);
  auto given = [&](std::string_view flag) {
    for (int i = 1; i < argc; ++i) {
      if (std::string_view(argv[i]).substr(0, flag.size()) == flag) return true;
    }
    return false;
  };
  static char kRepetitions[] = "--benchmark_repetitions=4";
  static char kInterleave[] = "--benchmark_enable_random_interleaving=true";
  if (!given("--benchmark_repetitions")) args.push_back(kRepetitions);
  if (!given("--benchmark_enable_random_interleaving")) {
    args.push_back(kInterleave);
  }
  int args_count = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&args_count, args.data());
  if (benchmark::ReportUnrecognizedArguments(args_count, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
