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
// best round of each side; a round counts only when every call of both
// sides in it succeeded (every CUDA call is checked), and the first failed
// round ends that layout's measurement. Prints one line per measurement
// and a JSON object (--json FILE). Exits 77 when no GPU is present, 1 on
// any error (a measurement with no successful round prints FAILED and no
// ratio).
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
  // Best of the rounds in which every call of both sides succeeded; 0 when
  // no round did (the pair is then reported as failed, without a ratio).
  double ours_gbps = 0, baseline_gbps = 0;
};

// Seconds of `fn` on `stream`, measured with events; `fn` returns false
// when a call it made failed. Returns a negative value when `fn` or any
// event call failed (errors of asynchronous work surface at the
// synchronize).
template <typename Fn>
double Timed(cudaStream_t stream, Fn&& fn) {
  cudaEvent_t a, b;
  if (!Ok(cudaEventCreate(&a), "cudaEventCreate")) return -1;
  if (!Ok(cudaEventCreate(&b), "cudaEventCreate")) {
    cudaEventDestroy(a);
    return -1;
  }
  bool ok = Ok(cudaEventRecord(a, stream), "cudaEventRecord");
  ok = fn() && ok;
  ok = Ok(cudaEventRecord(b, stream), "cudaEventRecord") && ok;
  ok = Ok(cudaEventSynchronize(b), "cudaEventSynchronize") && ok;
  float ms = 0;
  ok = ok && Ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ok && ms > 0 ? ms / 1e3 : -1;
}

// kMoved cudaMemcpyAsync calls of `object` bytes each, every one checked.
bool CopyObjects(char* dst, const char* src, size_t object, cudaMemcpyKind kind,
                 cudaStream_t stream, const char* what) {
  for (int i = 0; i < kMoved; ++i) {
    if (!Ok(cudaMemcpyAsync(dst + i * object, src + i * object, object, kind,
                            stream),
            what)) {
      return false;
    }
  }
  return true;
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
  // Everything allocated below, freed on every return.
  std::vector<void*> tensors;
  char* objects = nullptr;
  char* flat = nullptr;
  auto release = [&] {
    for (void* t : tensors) cudaFree(t);
    cudaFree(objects);
    cudaFree(flat);
    cudaStreamDestroy(stream);
  };
  // The cache, filled with random bytes.
  std::vector<char> host(tensor_bytes);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= host.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&host[i], &v, 8);
  }
  for (int i = 0; i < layout.num_tensors(); ++i) {
    void* t = nullptr;
    if (!Ok(cudaMalloc(&t, tensor_bytes), "cudaMalloc cache")) {
      release();
      return false;
    }
    tensors.push_back(t);
    if (!Ok(cudaMemcpy(t, host.data(), tensor_bytes, cudaMemcpyHostToDevice),
            "cudaMemcpy cache")) {
      release();
      return false;
    }
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
  const size_t total = object * kMoved;
  if (!Ok(cudaMalloc(&objects, total), "cudaMalloc objects") ||
      !Ok(cudaMalloc(&flat, total), "cudaMalloc flat")) {
    release();
    return false;
  }
  std::vector<void*> dst;
  for (int i = 0; i < kMoved; ++i) dst.push_back(objects + i * object);
  const std::vector<const void*> src(dst.begin(), dst.end());

  // A round counts only when every call of both sides succeeded: a failed
  // Gather can return at once, and its time would look like a fast one.
  double best_gather = 0, best_scatter = 0, best_d2d = 0;
  bool ok = true;
  for (int r = 0; r < rounds && ok; ++r) {
    const double g = Timed(stream, [&] {
      return Ok(Gather(layout, view, ids, layout.AllLayers(), dst, ref), "Gather");
    });
    const double d = Timed(stream, [&] {
      return CopyObjects(objects, flat, object, cudaMemcpyDeviceToDevice, stream,
                         "cudaMemcpyAsync D2D");
    });
    const double s = Timed(stream, [&] {
      return Ok(Scatter(layout, view, ids, layout.AllLayers(), src, ref), "Scatter");
    });
    if (g <= 0 || d <= 0 || s <= 0) {
      ok = false;
      break;
    }
    best_gather = std::max(best_gather, total / g / 1e9);
    best_scatter = std::max(best_scatter, total / s / 1e9);
    best_d2d = std::max(best_d2d, total / d / 1e9);
  }
  ok = Ok(cudaStreamSynchronize(stream), "sync") && ok;
  out->push_back({name, "gather vs D2D memcpy", best_gather, best_d2d});
  out->push_back({name, "scatter vs D2D memcpy", best_scatter, best_d2d});

  // Staging: save into a sink that only takes the bytes, against a raw
  // device-to-pinned-host copy of the same bytes.
  absl::StatusOr<HostBuffer> pinned = AllocateHostBuffer(total);
  ok = Ok(pinned.status(), "pinned host buffer") && ok;
  StagingOptions options;
  options.layers_per_piece = std::max(1, layout.num_layers() / 4);
  absl::StatusOr<std::unique_ptr<StagingPipeline>> pipeline =
      StagingPipeline::Create(layout, ref, options);
  ok = Ok(pipeline.status(), "StagingPipeline") && ok;
  double best_save = 0, best_d2h = 0;
  for (int r = 0; r < rounds && ok; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<PendingTransfer>> t = (*pipeline)->StartSave(
        view, ids, [](size_t, uint64_t, absl::Span<const char>) {
          return absl::OkStatus();
        });
    const bool saved = Ok(t.status(), "StartSave") && Ok((*t)->Wait(), "save");
    auto t1 = std::chrono::steady_clock::now();
    const double h = Timed(stream, [&] {
      return CopyObjects(pinned->data(), objects, object, cudaMemcpyDeviceToHost,
                         stream, "cudaMemcpyAsync D2H");
    });
    const double save_s = std::chrono::duration<double>(t1 - t0).count();
    if (!saved || h <= 0 || save_s <= 0) {
      ok = false;
      break;
    }
    best_save = std::max(best_save, total / save_s / 1e9);
    best_d2h = std::max(best_d2h, total / h / 1e9);
  }
  out->push_back({name, "staging save vs D2H memcpy", best_save, best_d2h});
  if (pipeline.ok()) pipeline->reset();
  release();
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
  if (!Ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) {
    return 1;
  }
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
    // No successful round on either side: no figure, no ratio.
    const bool measured = r.ours_gbps > 0 && r.baseline_gbps > 0;
    if (measured) {
      const double ratio = r.ours_gbps / r.baseline_gbps;
      std::printf("%-16s %-28s %8.2f GB/s vs %8.2f GB/s  ratio %.2f\n",
                  r.layout.c_str(), r.what.c_str(), r.ours_gbps,
                  r.baseline_gbps, ratio);
      absl::StrAppendFormat(&json,
                            "%s{\"layout\":\"%s\",\"what\":\"%s\",\"gbps\":%.3f,"
                            "\"baseline_gbps\":%.3f,\"ratio\":%.4f}",
                            i ? "," : "", r.layout, r.what, r.ours_gbps,
                            r.baseline_gbps, ratio);
    } else {
      ok = false;
      std::printf("%-16s %-28s FAILED (no round succeeded)\n", r.layout.c_str(),
                  r.what.c_str());
      absl::StrAppendFormat(&json,
                            "%s{\"layout\":\"%s\",\"what\":\"%s\",\"failed\":true,"
                            "\"gbps\":null,\"baseline_gbps\":null,\"ratio\":null}",
                            i ? "," : "", r.layout, r.what);
    }
  }
  absl::StrAppendFormat(&json, "],\"ok\":%s}\n", ok ? "true" : "false");
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "gpu_cuda_benchmark: cannot write %s\n",
                   json_path.c_str());
      return 1;
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) { return kvdepot::Main(argc, argv); }
