// A fake CUDA runtime for testing kvdepot's CUDA build without a GPU.
// One device (FAKE_CUDA_DEVICES overrides). "Device" memory is host memory
// (cudaMalloc), told apart by cudaPointerGetAttributes; page-locked memory
// is cudaHostAlloc'd or cudaHostRegister'ed host memory. Streams are
// ASYNCHRONOUS: each is a worker thread running its queued work in order,
// after a random delay (0..FAKE_CUDA_MAX_DELAY_US, default 300 us) before
// each item. The legacy default stream (0, cudaStreamLegacy,
// cudaStreamPerThread) is one more such stream; its implicit
// synchronization with blocking streams is NOT modelled.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "fake_cuda.h"

namespace fake_cuda {

thread_local uint3 tl_thread_idx;
thread_local uint3 tl_block_idx;
thread_local dim3 tl_grid_dim;
thread_local dim3 tl_block_dim;

namespace {

int EnvInt(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : dflt;
}

std::atomic<int> g_max_delay_us{EnvInt("FAKE_CUDA_MAX_DELAY_US", 300)};
std::atomic<int> g_sticky{cudaSuccess};
std::atomic<uint64_t> g_executed{0};
std::atomic<uint64_t> g_launches{0};
std::atomic<uint64_t> g_not_ready{0};

absl::Mutex g_inject_mu;
int g_fail_launch_in = -1;   // guarded by g_inject_mu
int g_fault_kernel_in = -1;  // guarded by g_inject_mu
KernelObserver g_observer;   // guarded by g_inject_mu

// PauseStreams: while false, no worker starts a work item.
absl::Mutex g_pause_mu;
bool g_running = true;  // guarded by g_pause_mu

void WaitUntilRunning() {
  absl::MutexLock lock(&g_pause_mu);
  g_pause_mu.Await(absl::Condition(&g_running));
}

thread_local cudaError_t tl_last_error = cudaSuccess;
thread_local int tl_device = 0;

int NumDevices() { return EnvInt("FAKE_CUDA_DEVICES", 1); }

cudaError_t Fail(cudaError_t e) {
  if (e != cudaSuccess) tl_last_error = e;
  return e;
}

cudaError_t Sticky() { return static_cast<cudaError_t>(g_sticky.load()); }

class Stream {
 public:
  explicit Stream(unsigned /*flags*/) {
    worker_ = std::thread([this] { Run(); });
  }
  ~Stream() { Stop(); }

  void Enqueue(std::function<void()> f) {
    absl::MutexLock lock(&mu_);
    q_.push_back(std::move(f));
    ++enqueued_;
  }
  uint64_t Mark() {
    absl::MutexLock lock(&mu_);
    return enqueued_;
  }
  bool Reached(uint64_t target) {
    absl::MutexLock lock(&mu_);
    return completed_ >= target;
  }
  void WaitFor(uint64_t target) {
    absl::MutexLock lock(&mu_);
    auto reached = [&] { return completed_ >= target; };
    mu_.Await(absl::Condition(&reached));
  }
  void Drain() { WaitFor(Mark()); }
  uint64_t Pending() {
    absl::MutexLock lock(&mu_);
    return enqueued_ - completed_;
  }
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      stop_ = true;
    }
    worker_.join();
  }

 private:
  void Run() {
    std::mt19937 rng(static_cast<unsigned>(
        std::hash<std::thread::id>()(std::this_thread::get_id())));
    while (true) {
      std::function<void()> f;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [&] { return !q_.empty() || stop_; };
        mu_.Await(absl::Condition(&ready));
        if (q_.empty()) return;
        f = std::move(q_.front());
        q_.pop_front();
      }
      WaitUntilRunning();  // taken off the queue, but not started
      const int max_delay = g_max_delay_us.load();
      if (max_delay > 0) {
        std::this_thread::sleep_for(
            std::chrono::microseconds(rng() % (max_delay + 1)));
      }
      if (Sticky() == cudaSuccess) f();  // a faulted context runs nothing
      g_executed.fetch_add(1);
      {
        absl::MutexLock lock(&mu_);
        ++completed_;
      }
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> q_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

struct Event {
  absl::Mutex mu;
  Stream* stream = nullptr;  // null: never recorded
  uint64_t target = 0;

  // The last record: its stream (null: never recorded) and that stream's
  // work count to reach.
  std::pair<Stream*, uint64_t> Recorded() {
    absl::MutexLock lock(&mu);
    return {stream, target};
  }
};

enum class Kind { kPinned, kRegistered, kDevice };
struct Range {
  size_t size;
  Kind kind;
  int device;
};

struct Registry {
  absl::Mutex mu;
  std::map<uintptr_t, Range> ranges;
  std::vector<std::unique_ptr<Stream>> streams;  // never freed before exit
  std::unique_ptr<Stream> legacy;

  ~Registry() {
    if (legacy) legacy->Stop();
    for (auto& s : streams) s->Stop();
  }

  Stream* Default() {
    absl::MutexLock lock(&mu);
    if (!legacy) legacy = std::make_unique<Stream>(0);
    return legacy.get();
  }

  // The range containing p.
  const Range* Find(const void* p, uintptr_t* start) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = ranges.upper_bound(a);
    if (it == ranges.begin()) return nullptr;
    --it;
    if (a >= it->first + it->second.size) return nullptr;
    if (start != nullptr) *start = it->first;
    return &it->second;
  }
  bool Overlaps(uintptr_t a, size_t n) {
    auto it = ranges.upper_bound(a + n - 1);
    if (it == ranges.begin()) return false;
    --it;
    return it->first + it->second.size > a;
  }
};

Registry& Reg() {
  static Registry* r = new Registry;  // workers stopped by the atexit below
  static bool once = [] {
    std::atexit([] { delete r; });
    return true;
  }();
  (void)once;
  return *r;
}

Stream* ToStream(cudaStream_t s) {
  const auto v = reinterpret_cast<uintptr_t>(s);
  if (v == 0 || v == 1 || v == 2) return Reg().Default();
  return reinterpret_cast<Stream*>(s);
}

}  // namespace

cudaError_t EnqueueKernel(cudaStream_t stream, std::function<void()> work,
                          const void* params, size_t params_size) {
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  {
    absl::MutexLock lock(&g_inject_mu);
    if (g_fail_launch_in >= 0 && g_fail_launch_in-- == 0) {
      return Fail(cudaErrorLaunchOutOfResources);
    }
  }
  g_launches.fetch_add(1);
  auto copy = std::make_shared<std::vector<char>>(
      static_cast<const char*>(params),
      static_cast<const char*>(params) + params_size);
  ToStream(stream)->Enqueue([work = std::move(work), copy] {
    KernelObserver observer;
    {
      absl::MutexLock lock(&g_inject_mu);
      if (g_fault_kernel_in >= 0 && g_fault_kernel_in-- == 0) {
        g_sticky.store(cudaErrorIllegalAddress);
        return;
      }
      observer = g_observer;
    }
    work();
    if (observer) observer(copy->data());
  });
  return cudaSuccess;
}

uint64_t PendingWork(cudaStream_t stream) {
  return ToStream(stream)->Pending();
}
uint64_t ExecutedWork() { return g_executed.load(); }
uint64_t KernelLaunches() { return g_launches.load(); }
uint64_t NotReadyQueries() { return g_not_ready.load(); }
void SetMaxDelayUs(int us) { g_max_delay_us.store(us); }
void FailLaunchAfter(int n) {
  absl::MutexLock lock(&g_inject_mu);
  g_fail_launch_in = n;
}
void FaultKernelAfter(int n) {
  absl::MutexLock lock(&g_inject_mu);
  g_fault_kernel_in = n;
}
void ClearStickyError() { g_sticky.store(cudaSuccess); }
void PauseStreams(bool paused) {
  absl::MutexLock lock(&g_pause_mu);
  g_running = !paused;
}
void SetKernelObserver(KernelObserver observer) {
  absl::MutexLock lock(&g_inject_mu);
  g_observer = std::move(observer);
}

}  // namespace fake_cuda

using namespace fake_cuda;  // NOLINT

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = tl_last_error;
  tl_last_error = cudaSuccess;
  return e != cudaSuccess ? e : Sticky();
}

cudaError_t cudaPeekAtLastError(void) {
  return tl_last_error != cudaSuccess ? tl_last_error : Sticky();
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources:
      return "cudaErrorLaunchOutOfResources";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered:
      return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    default:
      return "cudaErrorUnknown(fake)";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  return cudaGetErrorName(e);  // good enough for messages
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = NumDevices();
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = tl_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= NumDevices()) return Fail(cudaErrorInvalidDevice);
  tl_device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                   int device) {
  if (device < 0 || device >= NumDevices()) return Fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrPageableMemoryAccess:
      *value = EnvInt("FAKE_CUDA_PAGEABLE", 0);
      break;
    case cudaDevAttrCanUseHostPointerForRegisteredMem:
      *value = 1;
      break;
    default:
      *value = 0;
  }
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr,
                                     const void* ptr) {
  // As the runtime documents it: errors of earlier asynchronous launches
  // (a sticky fault) come back from here too.
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  Registry& r = Reg();
  absl::MutexLock lock(&r.mu);
  const Range* range = r.Find(ptr, nullptr);
  std::memset(attr, 0, sizeof(*attr));
  if (range == nullptr) {
    attr->type = cudaMemoryTypeUnregistered;
    attr->device = -2;
    return cudaSuccess;
  }
  attr->device = range->device;
  attr->devicePointer = const_cast<void*>(ptr);
  if (range->kind == Kind::kDevice) {
    attr->type = cudaMemoryTypeDevice;
  } else {
    attr->type = cudaMemoryTypeHost;
    attr->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

static cudaError_t Allocate(void** p, size_t size, Kind kind) {
  if (p == nullptr) return Fail(cudaErrorInvalidValue);
  if (size == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  const size_t align = 4096;
  void* m = std::aligned_alloc(align, (size + align - 1) / align * align);
  if (m == nullptr) return Fail(cudaErrorMemoryAllocation);
  Registry& r = Reg();
  absl::MutexLock lock(&r.mu);
  r.ranges[reinterpret_cast<uintptr_t>(m)] = Range{size, kind, tl_device};
  *p = m;
  return cudaSuccess;
}

static cudaError_t Free(void* p, Kind kind) {
  if (p == nullptr) return cudaSuccess;
  Registry& r = Reg();
  {
    absl::MutexLock lock(&r.mu);
    auto it = r.ranges.find(reinterpret_cast<uintptr_t>(p));
    if (it == r.ranges.end() || it->second.kind != kind) {
      return Fail(cudaErrorInvalidValue);
    }
    r.ranges.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t size, unsigned int) {
  return Allocate(p, size, Kind::kPinned);
}
cudaError_t cudaFreeHost(void* p) { return Free(p, Kind::kPinned); }
cudaError_t cudaMalloc(void** p, size_t size) {
  return Allocate(p, size, Kind::kDevice);
}
cudaError_t cudaFree(void* p) { return Free(p, Kind::kDevice); }

cudaError_t cudaHostRegister(void* p, size_t size, unsigned int) {
  if (p == nullptr || size == 0) return Fail(cudaErrorInvalidValue);
  Registry& r = Reg();
  absl::MutexLock lock(&r.mu);
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (r.Overlaps(a, size)) return Fail(cudaErrorHostMemoryAlreadyRegistered);
  r.ranges[a] = Range{size, Kind::kRegistered, tl_device};
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* p) {
  Registry& r = Reg();
  absl::MutexLock lock(&r.mu);
  auto it = r.ranges.find(reinterpret_cast<uintptr_t>(p));
  if (it == r.ranges.end() || it->second.kind != Kind::kRegistered) {
    return Fail(cudaErrorHostMemoryNotRegistered);
  }
  r.ranges.erase(it);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  auto stream = std::make_unique<Stream>(flags);
  Registry& r = Reg();
  absl::MutexLock lock(&r.mu);
  *s = reinterpret_cast<cudaStream_t>(stream.get());
  r.streams.push_back(std::move(stream));
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithFlags(s, 0);
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  // The real one returns at once and lets the work finish; here the work
  // finishes first. The Stream stays allocated (events may name it).
  Stream* stream = ToStream(s);
  stream->Drain();
  stream->Stop();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  // After a fault the worker drops the rest of the work; wait for that too.
  ToStream(s)->Drain();
  return Sticky() != cudaSuccess ? Fail(Sticky()) : cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  return ToStream(s)->Pending() == 0 ? cudaSuccess : Fail(cudaErrorNotReady);
}

cudaError_t cudaDeviceSynchronize(void) {
  Registry& r = Reg();
  std::vector<Stream*> all;
  {
    absl::MutexLock lock(&r.mu);
    for (auto& s : r.streams) all.push_back(s.get());
  }
  r.Default()->Drain();
  for (Stream* s : all) s->Drain();
  return Sticky() != cudaSuccess ? Fail(Sticky()) : cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count,
                            cudaMemcpyKind, cudaStream_t s) {
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  ToStream(s)->Enqueue([=] { std::memcpy(dst, src, count); });
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t count,
                            cudaStream_t s) {
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  ToStream(s)->Enqueue([=] { std::memset(dst, value, count); });
  return cudaSuccess;
}

// Synchronous: on the legacy default stream, waited for.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count,
                       cudaMemcpyKind kind) {
  if (cudaError_t e = cudaMemcpyAsync(dst, src, count, kind, nullptr);
      e != cudaSuccess) {
    return e;
  }
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaMemset(void* dst, int value, size_t count) {
  if (cudaError_t e = cudaMemsetAsync(dst, value, count, nullptr);
      e != cudaSuccess) {
    return e;
  }
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new Event);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, 0);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  delete reinterpret_cast<Event*>(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t s) {
  if (event == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  Event* e = reinterpret_cast<Event*>(event);
  Stream* stream = ToStream(s);
  absl::MutexLock lock(&e->mu);
  e->stream = stream;
  e->target = stream->Mark();
  return cudaSuccess;
}

// The wait is an item on `s` that blocks its worker until the recorded
// stream has completed the work marked when this is called (the snapshot
// CUDA documents: a later record does not move it).
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t event,
                                unsigned int flags) {
  if (event == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (flags != 0) return Fail(cudaErrorInvalidValue);  // only the default
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  // (A pair, not a structured binding: C++17 lambdas cannot capture one.)
  const std::pair<Stream*, uint64_t> recorded =
      reinterpret_cast<Event*>(event)->Recorded();
  if (recorded.first == nullptr) return cudaSuccess;  // never recorded: no wait
  ToStream(s)->Enqueue(
      [recorded] { recorded.first->WaitFor(recorded.second); });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (Sticky() != cudaSuccess) return Fail(Sticky());
  Event* e = reinterpret_cast<Event*>(event);
  absl::MutexLock lock(&e->mu);
  if (e->stream == nullptr || e->stream->Reached(e->target)) return cudaSuccess;
  g_not_ready.fetch_add(1);
  // Whether the real runtime records cudaErrorNotReady as the last error is
  // not documented; by default this fake does (the pessimistic case).
  if (EnvInt("FAKE_CUDA_NOTREADY_SETS_LAST", 1) != 0)
    return Fail(cudaErrorNotReady);
  return cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  const auto [stream, target] = reinterpret_cast<Event*>(event)->Recorded();
  if (stream != nullptr) stream->WaitFor(target);
  return Sticky() != cudaSuccess ? Fail(Sticky()) : cudaSuccess;
}

}  // extern "C"
