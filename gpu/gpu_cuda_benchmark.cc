// The CUDA build's gather/scatter and staging pipeline against their
// hardware limits, measured side by side in one run (issue 6's GPU check;
// run by tests/gpu/run_gpu_checks.sh on a machine with an NVIDIA GPU):
//
//   gather / scatter (device cache <-> device transfer objects) vs
//     cudaMemcpyAsync device-to-device of the same bytes (aim >= 0.70): as
//     one copy of all of them (the peak, which the aim is judged against)
//     and as 64 copies of one object each (the baseline, for information);
//   the staging pipeline's save (cache -> pinned host ring -> a sink that
//     takes the bytes) vs cudaMemcpyAsync device-to-pinned-host of the same
//     bytes (aim >= 0.80), likewise as 64 copies and as one.
//
// Every layout, a Llama-3-8B-shaped cache (32 layers, 16-token blocks,
// 8 KV heads of 128, bf16: 2 MiB objects; one fp8 case too) and
// DeepSeek-shaped MLA latents; 64 of 128 cache blocks moved per call, A B
// A B for --rounds rounds, the best round of each side; a round counts only
// when every call of all sides in it succeeded (every CUDA call is
// checked), and the first failed round ends that layout's measurement.
//
// The device-side figures measure the device, not the host: each timed
// window is kRepeats calls (8 x 64 x 2 MiB = 1 GiB for the Llama shape),
// queued while a host function holds the stream (so the host's work --
// Gather's validation, ~2 cudaPointerGetAttributes per buffer, and 64
// cudaMemcpyAsync calls -- is done before the device starts), timed with
// CUDA events recorded after the hold. The host time to queue one call is
// reported beside it (JSON "host_us"). The staging save is timed on the
// host, start to Wait(), as a caller sees it.
//
// Prints one line per measurement as it is made (flushed, so a run killed
// at a limit leaves the lines so far) and a JSON object (--json FILE).
// Exits 77 when no GPU is present, 1 on any error (a measurement with no
// successful round prints FAILED and no ratio).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
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
// Calls per timed device window. 8 keeps the queued work (8 x 64 copies
// for the baseline) well inside what a stream queues without blocking the
// host, which would stall behind the hold (see Gate).
constexpr int kRepeats = 8;
// How long the hold waits for the host to finish queuing at most; past it
// the window opens anyway and the measurement is marked "(gate timeout)".
constexpr std::chrono::seconds kGateLimit{5};

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
  // Best of the rounds in which every call of all sides succeeded; 0 when
  // no round did (the measurement is then reported as failed, without a
  // ratio). baseline: 64 copies of one object each; peak: one copy of the
  // same bytes.
  double ours_gbps = 0, baseline_gbps = 0, peak_gbps = 0;
  double host_us = 0;  // host time to queue one of our calls (best round)
  bool gate_timeout = false;
  // Issue 6's aim for this measurement, judged against the peak (one copy
  // of the same bytes: what "a cudaMemcpy of the same bytes" is; 64
  // separate copies can be slower than one, and would flatter us).
  double aim = 0;
};

// A stream held by a host function until Open() (or kGateLimit): work
// queued behind it starts only once the host has queued all of it.
// Not thread-safe except Open() against the host function.
class Gate {
 public:
  // Queues the hold on `stream`. REQUIRES: this Gate outlives the hold
  // (the caller synchronizes on later work of the stream before it goes).
  bool Hold(cudaStream_t stream) {
    return Ok(cudaLaunchHostFunc(stream, &Gate::Wait, this), "cudaLaunchHostFunc");
  }
  void Open() { open_.store(true, std::memory_order_release); }
  // True when the hold gave up waiting (the host could not queue
  // everything in time: the window may include host time).
  bool timed_out() const { return timed_out_.load(std::memory_order_acquire); }

 private:
  static void CUDART_CB Wait(void* self) {
    Gate* g = static_cast<Gate*>(self);
    const auto deadline = std::chrono::steady_clock::now() + kGateLimit;
    while (!g->open_.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > deadline) {
        g->timed_out_.store(true, std::memory_order_release);
        return;
      }
      std::this_thread::yield();
    }
  }
  std::atomic<bool> open_{false};
  std::atomic<bool> timed_out_{false};
};

// One timed device window on `stream`: `fn` queues the work (returns false
// when a call it made failed) while a Gate holds the stream; events
// recorded after the hold and after the work time the device alone.
struct Window {
  double device_s = -1;  // negative: fn or a CUDA call failed
  double host_s = 0;     // the host's time in fn
  bool gate_timeout = false;
};

template <typename Fn>
Window Timed(cudaStream_t stream, Fn&& fn) {
  Window w;
  cudaEvent_t a, b;
  if (!Ok(cudaEventCreate(&a), "cudaEventCreate")) return w;
  if (!Ok(cudaEventCreate(&b), "cudaEventCreate")) {
    cudaEventDestroy(a);
    return w;
  }
  Gate gate;
  bool ok = gate.Hold(stream);
  ok = Ok(cudaEventRecord(a, stream), "cudaEventRecord") && ok;
  const auto t0 = std::chrono::steady_clock::now();
  ok = fn() && ok;
  w.host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ok = Ok(cudaEventRecord(b, stream), "cudaEventRecord") && ok;
  gate.Open();  // also on failure: the hold must end before `gate` goes
  ok = Ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize") && ok;
  float ms = 0;
  ok = ok && Ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  w.gate_timeout = gate.timed_out();
  if (ok && ms > 0) w.device_s = ms / 1e3;
  return w;
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

// `fn` kRepeats times; false at the first that fails.
template <typename Fn>
bool Repeat(Fn&& fn) {
  for (int i = 0; i < kRepeats; ++i) {
    if (!fn()) return false;
  }
  return true;
}

// Bytes per second of `bytes` moved `kRepeats` times in `w`; 0 when the
// window failed.
double Gbps(size_t bytes, const Window& w) {
  return w.device_s > 0 ? static_cast<double>(bytes) * kRepeats / w.device_s / 1e9 : 0;
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
  // baselines' contiguous source of the same size.
  const size_t total = object * kMoved;
  if (!Ok(cudaMalloc(&objects, total), "cudaMalloc objects") ||
      !Ok(cudaMalloc(&flat, total), "cudaMalloc flat")) {
    release();
    return false;
  }
  std::vector<void*> dst;
  for (int i = 0; i < kMoved; ++i) dst.push_back(objects + i * object);
  const std::vector<const void*> src(dst.begin(), dst.end());

  // A round counts only when every call of all sides succeeded: a failed
  // Gather can return at once, and its time would look like a fast one.
  Result gather{name, "gather vs D2D memcpy"};
  Result scatter{name, "scatter vs D2D memcpy"};
  gather.aim = scatter.aim = 0.70;
  bool ok = true;
  for (int r = 0; r < rounds && ok; ++r) {
    const Window g = Timed(stream, [&] {
      return Repeat([&] {
        return Ok(Gather(layout, view, ids, layout.AllLayers(), dst, ref), "Gather");
      });
    });
    const Window d = Timed(stream, [&] {
      return Repeat([&] {
        return CopyObjects(objects, flat, object, cudaMemcpyDeviceToDevice, stream,
                           "cudaMemcpyAsync D2D");
      });
    });
    const Window s = Timed(stream, [&] {
      return Repeat([&] {
        return Ok(Scatter(layout, view, ids, layout.AllLayers(), src, ref), "Scatter");
      });
    });
    const Window p = Timed(stream, [&] {
      return Repeat([&] {
        return Ok(cudaMemcpyAsync(objects, flat, total, cudaMemcpyDeviceToDevice, stream),
                  "cudaMemcpyAsync D2D (one copy)");
      });
    });
    if (g.device_s <= 0 || d.device_s <= 0 || s.device_s <= 0 || p.device_s <= 0) {
      ok = false;
      break;
    }
    const std::pair<Result*, const Window*> sides[] = {{&gather, &g}, {&scatter, &s}};
    for (const auto& [res, w] : sides) {
      if (Gbps(total, *w) > res->ours_gbps) {
        res->ours_gbps = Gbps(total, *w);
        res->host_us = w->host_s / kRepeats * 1e6;
      }
      res->baseline_gbps = std::max(res->baseline_gbps, Gbps(total, d));
      res->peak_gbps = std::max(res->peak_gbps, Gbps(total, p));
      res->gate_timeout = res->gate_timeout || w->gate_timeout || d.gate_timeout ||
                          p.gate_timeout;
    }
  }
  ok = Ok(cudaStreamSynchronize(stream), "sync") && ok;
  out->push_back(gather);
  out->push_back(scatter);

  // Staging: save into a sink that only takes the bytes (host-timed, as
  // a caller sees it), against raw device-to-pinned-host copies of the
  // same bytes (device-timed); with one block per piece (a launch each),
  // and with 8 (one launch for 8).
  absl::StatusOr<HostBuffer> pinned = AllocateHostBuffer(total);
  ok = Ok(pinned.status(), "pinned host buffer") && ok;
  absl::StatusOr<std::unique_ptr<StagingPipeline>> pipeline;
  for (const int blocks_per_piece : {1, 8}) {
    Result save{name, blocks_per_piece == 1
                          ? "staging save vs D2H memcpy"
                          : "staging save, 8 blocks per piece, vs D2H memcpy"};
    save.aim = 0.80;
    StagingOptions options;
    options.layers_per_piece = std::max(1, layout.num_layers() / 4);
    options.blocks_per_piece = blocks_per_piece;
    pipeline = StagingPipeline::Create(layout, ref, options);
    ok = Ok(pipeline.status(), "StagingPipeline") && ok;
    for (int r = 0; r < rounds && ok; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<std::unique_ptr<PendingTransfer>> t = (*pipeline)->StartSave(
          view, ids, [](size_t, uint64_t, absl::Span<const char>) {
            return absl::OkStatus();
          });
      const bool saved = Ok(t.status(), "StartSave") && Ok((*t)->Wait(), "save");
      auto t1 = std::chrono::steady_clock::now();
      const Window h = Timed(stream, [&] {
        return Repeat([&] {
          return CopyObjects(pinned->data(), objects, object, cudaMemcpyDeviceToHost,
                             stream, "cudaMemcpyAsync D2H");
        });
      });
      const Window hp = Timed(stream, [&] {
        return Repeat([&] {
          return Ok(cudaMemcpyAsync(pinned->data(), objects, total, cudaMemcpyDeviceToHost,
                                    stream),
                    "cudaMemcpyAsync D2H (one copy)");
        });
      });
      const double save_s = std::chrono::duration<double>(t1 - t0).count();
      if (!saved || h.device_s <= 0 || hp.device_s <= 0 || save_s <= 0) {
        ok = false;
        break;
      }
      if (total / save_s / 1e9 > save.ours_gbps) {
        save.ours_gbps = total / save_s / 1e9;
        save.host_us = save_s * 1e6;
      }
      save.baseline_gbps = std::max(save.baseline_gbps, Gbps(total, h));
      save.peak_gbps = std::max(save.peak_gbps, Gbps(total, hp));
      save.gate_timeout = save.gate_timeout || h.gate_timeout || hp.gate_timeout;
    }
    out->push_back(save);
    if (pipeline.ok()) pipeline->reset();
  }
  release();
  return ok;
}

// Issue 6's aims over the measurements reported so far.
struct AimTally {
  int met = 0, judged = 0;
};

// One measurement: a line on stdout (flushed) and its JSON object
// appended to `json`, with whether it meets its aim (against the one copy;
// a verdict reported, not an exit status: timings fail no run). Returns
// false for a measurement with no successful round.
bool Report(const Result& r, std::string* json, AimTally* aims) {
  const char* sep = json->back() == '[' ? "" : ",";
  const bool measured = r.ours_gbps > 0 && r.baseline_gbps > 0 && r.peak_gbps > 0;
  if (!measured) {
    std::printf("%-18s %-28s FAILED (no round succeeded)\n", r.layout.c_str(),
                r.what.c_str());
    absl::StrAppendFormat(json,
                          "%s{\"layout\":\"%s\",\"what\":\"%s\",\"failed\":true,"
                          "\"gbps\":null,\"baseline_gbps\":null,\"ratio\":null,"
                          "\"peak_gbps\":null,\"ratio_to_peak\":null}",
                          sep, r.layout, r.what);
    std::fflush(stdout);
    return false;
  }
  const double ratio = r.ours_gbps / r.baseline_gbps;
  const double to_peak = r.ours_gbps / r.peak_gbps;
  const bool met = to_peak >= r.aim;
  ++aims->judged;
  aims->met += met;
  std::printf(
      "%-18s %-28s %8.2f GB/s vs %8.2f GB/s (one copy) ratio %.2f: aim %.2f "
      "%s; vs %8.2f GB/s (64 copies) ratio %.2f; host %.0f us/call%s\n",
      r.layout.c_str(), r.what.c_str(), r.ours_gbps, r.peak_gbps, to_peak,
      r.aim, met ? "met" : "NOT met", r.baseline_gbps, ratio, r.host_us,
      r.gate_timeout ? " (gate timeout)" : "");
  absl::StrAppendFormat(
      json,
      "%s{\"layout\":\"%s\",\"what\":\"%s\",\"gbps\":%.3f,"
      "\"baseline_gbps\":%.3f,\"ratio\":%.4f,\"peak_gbps\":%.3f,"
      "\"ratio_to_peak\":%.4f,\"aim\":%.2f,\"aim_met\":%s,"
      "\"host_us\":%.1f,\"gate_timeout\":%s}",
      sep, r.layout, r.what, r.ours_gbps, r.baseline_gbps, ratio, r.peak_gbps,
      to_peak, r.aim, met ? "true" : "false", r.host_us,
      r.gate_timeout ? "true" : "false");
  std::fflush(stdout);
  return true;
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
    KvDtype dtype;
  } cases[] = {
      {"flash_attn_nhd", KvCacheLayout::kFlashAttnNhd, KvDtype::kBFloat16},
      {"flash_attn_hnd", KvCacheLayout::kFlashAttnHnd, KvDtype::kBFloat16},
      {"flashinfer_nhd", KvCacheLayout::kFlashInferNhd, KvDtype::kBFloat16},
      {"flashinfer_hnd", KvCacheLayout::kFlashInferHnd, KvDtype::kBFloat16},
      {"mla", KvCacheLayout::kMla, KvDtype::kBFloat16},
      {"cross_layer_nhd", KvCacheLayout::kCrossLayerNhd, KvDtype::kBFloat16},
      {"cross_layer_hnd", KvCacheLayout::kCrossLayerHnd, KvDtype::kBFloat16},
      // fp8 e4m3 (1-byte elements: 256-byte head rows, 1 MiB objects).
      {"flash_attn_hnd_fp8", KvCacheLayout::kFlashAttnHnd, KvDtype::kFloat8E4M3},
  };
  std::printf("gpu_cuda_benchmark: %s; %d of %lld blocks per call, %d calls per timed "
              "window, best of %d rounds\n",
              prop.name, kMoved, static_cast<long long>(kCacheBlocks), kRepeats, rounds);
  std::fflush(stdout);
  std::string json = absl::StrFormat(
      "{\"tool\":\"gpu_cuda_benchmark\",\"gpu\":\"%s\",\"moved_blocks\":%d,"
      "\"calls_per_window\":%d,\"rounds\":%d,\"results\":[",
      prop.name, kMoved, kRepeats, rounds);
  bool ok = true;
  AimTally aims;
  for (const Case& c : cases) {
    KvLayout layout =
        c.kind == KvCacheLayout::kMla
            ? KvLayout::Mla(c.kind, 32, 16, 576, c.dtype).value()
            : KvLayout::Mha(c.kind, 32, 16, 8, 128, c.dtype).value();
    std::vector<Result> results;
    ok = RunLayout(c.name, layout, rounds, &results) && ok;
    for (const Result& r : results) ok = Report(r, &json, &aims) && ok;
  }
  // The verdict on issue 6's aims (read by run_gpu_checks.sh's summary).
  std::printf(
      "aims: %d of %d measurements met their aim (ours / one copy of "
      "the same bytes: gather, scatter >= 0.70; staging save >= 0.80)\n",
      aims.met, aims.judged);
  absl::StrAppendFormat(&json,
                        "],\"aims_met\":%d,\"aims_judged\":%d,\"ok\":%s}\n",
                        aims.met, aims.judged, ok ? "true" : "false");
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
