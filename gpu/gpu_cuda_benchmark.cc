// The CUDA build's gather/scatter and staging pipeline against their
// hardware limits, measured side by side in one run (issue 6's GPU check;
// run by tests/gpu/run_gpu_checks.sh on a machine with an NVIDIA GPU):
//
//   gather / scatter (device cache <-> device transfer objects) vs
//     cudaMemcpyAsync device-to-device of the same bytes (aim >= 0.70);
//   the staging pipeline's save (cache -> pinned host ring -> a sink that
//     takes the bytes) vs cudaMemcpyAsync device-to-pinned-host of the same
//     bytes (aim >= 0.80).
//
// Every layout, a Llama-3-8B-shaped cache (32 layers, 16-token blocks,
// 8 KV heads of 128, bf16: 2 MiB objects) and DeepSeek-shaped MLA latents;
// 64 of 128 cache blocks moved per round, A B A B for --rounds rounds, the
// best round of each side. Prints one line per measurement and a JSON
// object (--json FILE). Exits 77 when no GPU is present, 1 on any error.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/kv_layout.h"
#include "gpu/staging.h"

namespace kvdepot {
namespace {

constexpr int64_t kCacheBlocks = 128;
constexpr int kMoved = 64;

bool Ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "gpu_cuda_benchmark: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

bool Ok(const absl::Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "gpu_cuda_benchmark: %s: %s\n", what, s.ToString().c_str());
  return false;
}

struct Result {
  std::string layout, what;
  double ours_gbps = 0, baseline_gbps = 0;
};

// Seconds of `fn` on `stream`, measured with events.
template <typename Fn>
double Timed(cudaStream_t stream, Fn&& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, stream);
  fn();
  cudaEventRecord(b, stream);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1e3;
}

bool RunLayout(const std::string& name, const KvLayout& layout, int rounds,
               std::vector<Result>* out) {
  cudaStream_t stream;
  if (!Ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream")) {
    return false;
  }
  const StreamRef ref{stream};
  const size_t object = layout.object_bytes();
  const uint64_t tensor_bytes = layout.TensorBytes(kCacheBlocks).value();
  // The cache, filled with random bytes.
  std::vector<void*> tensors(layout.num_tensors());
  std::vector<char> host(tensor_bytes);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= host.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&host[i], &v, 8);
  }
  for (void*& t : tensors) {
    if (!Ok(cudaMalloc(&t, tensor_bytes), "cudaMalloc cache")) return false;
    cudaMemcpy(t, host.data(), tensor_bytes, cudaMemcpyHostToDevice);
  }
  KvCacheView view;
  view.num_blocks = kCacheBlocks;
  for (void* t : tensors) view.tensors.push_back(t);
  // Every other block, shuffled.
  std::vector<int64_t> ids;
  for (int i = 0; i < kMoved; ++i) ids.push_back(2 * i);
  std::shuffle(ids.begin(), ids.end(), rng);
  // Device transfer objects (one allocation, kMoved objects) and the
  // baseline's contiguous source of the same size.
  char* objects = nullptr;
  char* flat = nullptr;
  const size_t total = object * kMoved;
  if (!Ok(cudaMalloc(&objects, total), "cudaMalloc objects") ||
      !Ok(cudaMalloc(&flat, total), "cudaMalloc flat")) {
    return false;
  }
  std::vector<void*> dst;
  for (int i = 0; i < kMoved; ++i) dst.push_back(objects + i * object);
  const std::vector<const void*> src(dst.begin(), dst.end());

  double best_gather = 0, best_scatter = 0, best_d2d = 0;
  bool ok = true;
  for (int r = 0; r < rounds && ok; ++r) {
    const double g = Timed(stream, [&] {
      ok &= Ok(Gather(layout, view, ids, layout.AllLayers(), dst, ref), "Gather");
    });
    const double d = Timed(stream, [&] {
      for (int i = 0; i < kMoved; ++i) {
        cudaMemcpyAsync(objects + i * object, flat + i * object, object,
                        cudaMemcpyDeviceToDevice, stream);
      }
    });
    const double s = Timed(stream, [&] {
      ok &= Ok(Scatter(layout, view, ids, layout.AllLayers(), src, ref), "Scatter");
    });
    best_gather = std::max(best_gather, total / g / 1e9);
    best_scatter = std::max(best_scatter, total / s / 1e9);
    best_d2d = std::max(best_d2d, total / d / 1e9);
  }
  ok &= Ok(cudaStreamSynchronize(stream), "sync");
  out->push_back({name, "gather vs D2D memcpy", best_gather, best_d2d});
  out->push_back({name, "scatter vs D2D memcpy", best_scatter, best_d2d});

  // Staging: save into a sink that only takes the bytes, against a raw
  // device-to-pinned-host copy of the same bytes.
  absl::StatusOr<HostBuffer> pinned = AllocateHostBuffer(total);
  ok &= Ok(pinned.status(), "pinned host buffer");
  StagingOptions options;
  options.layers_per_piece = std::max(1, layout.num_layers() / 4);
  absl::StatusOr<std::unique_ptr<StagingPipeline>> pipeline =
      StagingPipeline::Create(layout, ref, options);
  ok &= Ok(pipeline.status(), "StagingPipeline");
  double best_save = 0, best_d2h = 0;
  for (int r = 0; r < rounds && ok; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<PendingTransfer>> t = (*pipeline)->StartSave(
        view, ids, [](size_t, uint64_t, absl::Span<const char>) {
          return absl::OkStatus();
        });
    ok &= Ok(t.status(), "StartSave") && Ok((*t)->Wait(), "save");
    auto t1 = std::chrono::steady_clock::now();
    best_save = std::max(
        best_save, total / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    const double h = Timed(stream, [&] {
      for (int i = 0; i < kMoved; ++i) {
        cudaMemcpyAsync(pinned->data() + i * object, objects + i * object,
                        object, cudaMemcpyDeviceToHost, stream);
      }
    });
    best_d2h = std::max(best_d2h, total / h / 1e9);
  }
  out->push_back({name, "staging save vs D2H memcpy", best_save, best_d2h});
  pipeline->reset();
  for (void* t : tensors) cudaFree(t);
  cudaFree(objects);
  cudaFree(flat);
  cudaStreamDestroy(stream);
  return ok;
}

int Main(int argc, char** argv) {
  int rounds = 5;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gpu_cuda_benchmark [--rounds N] [--json FILE]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "gpu_cuda_benchmark: no CUDA device; skipping\n");
    return 77;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  struct Case {
    const char* name;
    KvCacheLayout kind;
  } cases[] = {
      {"flash_attn_nhd", KvCacheLayout::kFlashAttnNhd},
      {"flash_attn_hnd", KvCacheLayout::kFlashAttnHnd},
      {"flashinfer_nhd", KvCacheLayout::kFlashInferNhd},
      {"mla", KvCacheLayout::kMla},
      {"cross_layer_nhd", KvCacheLayout::kCrossLayerNhd},
      {"cross_layer_hnd", KvCacheLayout::kCrossLayerHnd},
  };
  std::vector<Result> results;
  bool ok = true;
  for (const Case& c : cases) {
    KvLayout layout =
        c.kind == KvCacheLayout::kMla
            ? KvLayout::Mla(c.kind, 32, 16, 576, KvDtype::kBFloat16).value()
            : KvLayout::Mha(c.kind, 32, 16, 8, 128, KvDtype::kBFloat16).value();
    ok &= RunLayout(c.name, layout, rounds, &results);
  }
  std::string json = absl::StrFormat(
      "{\"tool\":\"gpu_cuda_benchmark\",\"gpu\":\"%s\",\"moved_blocks\":%d,"
      "\"rounds\":%d,\"results\":[",
      prop.name, kMoved, rounds);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const double ratio = r.baseline_gbps > 0 ? r.ours_gbps / r.baseline_gbps : 0;
    std::printf("%-16s %-28s %8.2f GB/s vs %8.2f GB/s  ratio %.2f\n",
                r.layout.c_str(), r.what.c_str(), r.ours_gbps, r.baseline_gbps,
                ratio);
    absl::StrAppendFormat(&json,
                          "%s{\"layout\":\"%s\",\"what\":\"%s\",\"gbps\":%.3f,"
                          "\"baseline_gbps\":%.3f,\"ratio\":%.4f}",
                          i ? "," : "", r.layout, r.what, r.ours_gbps,
                          r.baseline_gbps, ratio);
  }
  json += "]}\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f != nullptr) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) { return kvdepot::Main(argc, argv); }
