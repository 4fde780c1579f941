// The device primitives kvdepot_gpu builds on: streams, staging host memory
// (allocated or registered) and the calling thread's device. Like gather.h,
// this interface has two implementations chosen at link time:
// device_memory_cuda.cc in kvdepot_gpu_cuda (CUDA runtime) and
// device_memory_cpu.cc in kvdepot_gpu_cpu (plain host memory, everything
// synchronous). A program links exactly one.
//
// Thread-safe: every function may be called from any thread.
//
// CUDA build: a failure that these functions (and Gather/Scatter) return is
// cleared from the calling thread's cudaGetLastError() state, so that the
// engine's own check after its next launch does not take it for its own.
#ifndef KVDEPOT_GPU_DEVICE_MEMORY_H_
#define KVDEPOT_GPU_DEVICE_MEMORY_H_

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// A borrowed handle to an ordered queue of device work. In the CUDA build
// `native` is a cudaStream_t (nullptr: the legacy default stream), owned by
// the caller; the CPU build ignores it and does all work on the calling
// thread before returning.
struct StreamRef {
  void* native = nullptr;
};

// "cuda" or "cpu": the implementation this program linked.
absl::string_view GpuBackendName();

// Blocks until all work enqueued on `stream` has finished. Returns the
// device's error (Internal, or the code closest to the CUDA error) if any of
// that work failed.
absl::Status SynchronizeStream(StreamRef stream);

// A point in a stream's work (a cudaEvent_t without timing), to wait for
// the work enqueued before it rather than for the whole stream. The CPU
// build's streams are synchronous: its events are complete once recorded
// (and before). Move-only; destroys its event on destruction. Only events
// made by Create may be used (a default-constructed one is empty).
class DeviceEvent {
 public:
  DeviceEvent() = default;
  DeviceEvent(DeviceEvent&& other) noexcept
      : native_(std::exchange(other.native_, nullptr)) {}
  DeviceEvent& operator=(DeviceEvent&& other) noexcept {
    if (this != &other) {
      Release();
      native_ = std::exchange(other.native_, nullptr);
    }
    return *this;
  }
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  ~DeviceEvent() { Release(); }

  // An event of the calling thread's current device (cudaEventCreateWithFlags
  // with cudaEventDisableTiming). The device's error if it cannot be made.
  static absl::StatusOr<DeviceEvent> Create();

  // Marks the work enqueued on `stream` so far (cudaEventRecord); `stream`
  // must belong to the event's device. Recording again moves the mark.
  absl::Status Record(StreamRef stream);
  // Whether the work before the mark has finished (cudaEventQuery): true
  // for an event never recorded. The device's error if that work failed.
  absl::StatusOr<bool> IsComplete();
  // Blocks until the work before the mark has finished
  // (cudaEventSynchronize); OK at once for an event never recorded. The
  // device's error if that work failed.
  absl::Status Synchronize();
  // Makes the work enqueued on `stream` after this call wait on the device
  // for the work before the mark (cudaStreamWaitEvent): the mark as it is
  // now; recording the event again later does not move this wait. Does not
  // block the host. `stream` may belong to another device. OK, and no wait,
  // for an event never recorded. The CPU build returns OK (its marked work
  // is done). A failure of the marked work is not reported here: it shows
  // in whatever synchronizes with it (and as the context's sticky error).
  absl::Status MakeStreamWait(StreamRef stream) const;

 private:
  explicit DeviceEvent(void* native) : native_(native) {}
  // Destroys native_ the way the linked implementation made it.
  void Release();

  void* native_ = nullptr;  // cudaEvent_t; null in the CPU build
};

// The calling thread's current device (cudaGetDevice); 0 in the CPU build.
absl::StatusOr<int> GetCurrentDevice();
// Makes `device` current on the calling thread (cudaSetDevice). The CPU
// build accepts only 0.
absl::Status SetCurrentDevice(int device);

// Host memory for staging transfers: page-locked and mapped into the device
// address space (cudaHostAlloc) in the CUDA build, so kernels and DMA reach it
// directly; page-aligned ordinary memory in the CPU build. Move-only; frees
// its memory on destruction.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Release(); }

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  friend absl::StatusOr<HostBuffer> AllocateHostBuffer(size_t bytes);
  HostBuffer(char* data, size_t size) : data_(data), size_(size) {}
  // Frees data_ the way the linked implementation allocated it.
  void Release();

  char* data_ = nullptr;
  size_t size_ = 0;
};

// Allocates `bytes` of staging memory, aligned to at least 4096 bytes (an
// empty buffer for 0). Returns ResourceExhausted when the memory is not
// available, or the device's error (e.g. FailedPrecondition without a
// device in the CUDA build).
absl::StatusOr<HostBuffer> AllocateHostBuffer(size_t bytes);

// Page-locks `bytes` of existing host memory at `data` and maps it for every
// device (cudaHostRegister with cudaHostRegisterPortable |
// cudaHostRegisterMapped), so that Gather/Scatter and DMA reach it through
// its host address: for staging memory that someone else allocated (e.g.
// UCX shared memory), which the CUDA build otherwise rejects as pageable.
// The memory must stay allocated until UnregisterHostMemory(data).
// Registering is slow (it pins every page): do it once per buffer, not per
// transfer.
//
// Returns InvalidArgument for a null `data` or zero `bytes` (both builds).
// CUDA build: AlreadyExists if part of the range is registered already
// (including cudaHostAlloc memory), FailedPrecondition without a usable
// device or where the device cannot use the host address of registered
// memory, else the closest code to the CUDA error. CPU build: nothing to
// pin; returns OK.
absl::Status RegisterHostMemory(void* data, size_t bytes);

// Undoes RegisterHostMemory(data) (`data` as registered). Returns
// InvalidArgument for null. CUDA build: NotFound if `data` is not the start
// of a registered range. CPU build: OK.
absl::Status UnregisterHostMemory(void* data);

}  // namespace kvdepot

#endif  // KVDEPOT_GPU_DEVICE_MEMORY_H_
