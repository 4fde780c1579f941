// Gather/scatter throughput of the linked implementation (the CPU twin in
// gpu_benchmark) against its physical limit measured side by side: memcpy of
// the same bytes into the same destinations, alternating with the gather or
// scatter in every iteration (A B A B).
//
// Reported per benchmark: the gather/scatter rate (bytes_per_second), the
// memcpy rate of the same iterations (memcpy_GBps), and their ratio
// (vs_memcpy: 1.0 = as fast as memcpy).
// Run: build/gpu/gpu_benchmark [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/internal/test_cache.h"
#include "gpu/kv_layout.h"

namespace kvdepot {
namespace {

using gpu_testing::TestCache;

constexpr int64_t kCacheBlocks = 32;
constexpr int kMovedBlocks = 16;

// A Llama-3-8B-shaped cache (32 layers, 16-token blocks, 8 KV heads of 128,
// bf16: 2 MiB objects, a 64 MiB cache); MLA: DeepSeek-shaped latents of 576.
KvLayout BenchLayout(KvCacheLayout kind) {
  if (kind == KvCacheLayout::kMla) {
    return KvLayout::Mla(kind, 32, 16, 576, KvDtype::kBFloat16).value();
  }
  return KvLayout::Mha(kind, 32, 16, 8, 128, KvDtype::kBFloat16).value();
}

double Seconds(std::chrono::steady_clock::time_point a,
               std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void Run(benchmark::State& state, KvCacheLayout kind, bool scatter) {
  const KvLayout layout = BenchLayout(kind);
  const size_t object = layout.object_bytes();
  TestCache cache(layout, kCacheBlocks);
  std::mt19937_64 rng(1);
  cache.FillRandom(rng);
  // Every other block, shuffled: not one contiguous run of the cache.
  std::vector<int64_t> ids;
  for (int i = 0; i < kMovedBlocks; ++i) ids.push_back(2 * i);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<HostBuffer> objects;
  std::vector<void*> ptrs;
  for (int i = 0; i < kMovedBlocks; ++i) {
    objects.push_back(gpu_testing::FilledBuffer(object, 1));
    ptrs.push_back(objects.back().data());
  }
  const std::vector<const void*> const_ptrs(ptrs.begin(), ptrs.end());
  // The baseline's other side: one contiguous run of the same bytes.
  HostBuffer flat = gpu_testing::FilledBuffer(object * kMovedBlocks, 2);

  double copy_s = 0, memcpy_s = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = scatter
                         ? Scatter(layout, cache.view(), ids,
                                   layout.AllLayers(), const_ptrs, StreamRef{})
                         : Gather(layout, cache.view(), ids, layout.AllLayers(),
                                  ptrs, StreamRef{});
    if (s.ok()) s = SynchronizeStream(StreamRef{});
    const auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < kMovedBlocks; ++i) {
      char* contiguous = flat.data() + i * object;
      if (scatter) {
        std::memcpy(contiguous, ptrs[i], object);
      } else {
        std::memcpy(ptrs[i], contiguous, object);
      }
    }
    const auto t2 = std::chrono::steady_clock::now();
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    benchmark::ClobberMemory();
    state.SetIterationTime(Seconds(t0, t1));
    copy_s += Seconds(t0, t1);
    memcpy_s += Seconds(t1, t2);
  }
  const double bytes =
      static_cast<double>(state.iterations()) * object * kMovedBlocks;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  if (copy_s > 0 && memcpy_s > 0) {
    state.counters["memcpy_GBps"] = bytes / memcpy_s / 1e9;
    state.counters["vs_memcpy"] = memcpy_s / copy_s;
  }
  state.SetLabel(std::string(GpuBackendName()));
}

void BM_Gather(benchmark::State& state, KvCacheLayout kind) {
  Run(state, kind, /*scatter=*/false);
}
void BM_Scatter(benchmark::State& state, KvCacheLayout kind) {
  Run(state, kind, /*scatter=*/true);
}

#define KVDEPOT_GPU_BENCH(name, kind)       \
  BENCHMARK_CAPTURE(BM_Gather, name, kind)  \
      ->UseManualTime()                     \
      ->Unit(benchmark::kMillisecond);      \
  BENCHMARK_CAPTURE(BM_Scatter, name, kind) \
      ->UseManualTime()                     \
      ->Unit(benchmark::kMillisecond)

KVDEPOT_GPU_BENCH(flash_attn_nhd, KvCacheLayout::kFlashAttnNhd);
KVDEPOT_GPU_BENCH(flash_attn_hnd, KvCacheLayout::kFlashAttnHnd);
KVDEPOT_GPU_BENCH(flashinfer_nhd, KvCacheLayout::kFlashInferNhd);
KVDEPOT_GPU_BENCH(mla, KvCacheLayout::kMla);
KVDEPOT_GPU_BENCH(cross_layer_nhd, KvCacheLayout::kCrossLayerNhd);
KVDEPOT_GPU_BENCH(cross_layer_hnd, KvCacheLayout::kCrossLayerHnd);

}  // namespace
}  // namespace kvdepot

BENCHMARK_MAIN();
