// The CPU twin of device_memory_cuda.cc: no device, ordinary memory, every
// stream already synchronous. Part of kvdepot_gpu_cpu.
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "gpu/device_memory.h"
#include "gpu/internal/host_memory_args.h"

namespace kvdepot {
namespace {

constexpr size_t kAlignment = 4096;

}  // namespace

absl::string_view GpuBackendName() { return "cpu"; }

absl::Status SynchronizeStream(StreamRef /*stream*/) {
  return absl::OkStatus();
}

absl::StatusOr<DeviceEvent> DeviceEvent::Create() { return DeviceEvent(); }

// Work "enqueued" on a stream here has finished when its call returned.
absl::Status DeviceEvent::Record(StreamRef /*stream*/) {
  return absl::OkStatus();
}

absl::StatusOr<bool> DeviceEvent::IsComplete() { return true; }

absl::Status DeviceEvent::Synchronize() { return absl::OkStatus(); }

// The marked work finished before Record returned; nothing left to wait for.
absl::Status DeviceEvent::MakeStreamWait(StreamRef /*stream*/) const {
  return absl::OkStatus();
}

void DeviceEvent::Release() { native_ = nullptr; }

absl::StatusOr<int> GetCurrentDevice() { return 0; }

absl::Status SetCurrentDevice(int device) {
  if (device != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device, " does not exist: the CPU build has device 0 only"));
  }
  return absl::OkStatus();
}

void HostBuffer::Release() {
  std::free(data_);
  data_ = nullptr;
  size_ = 0;
}

absl::StatusOr<HostBuffer> AllocateHostBuffer(size_t bytes) {
  if (bytes == 0) return HostBuffer();
  if (bytes > SIZE_MAX - kAlignment) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  // aligned_alloc wants a multiple of the alignment.
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  return HostBuffer(static_cast<char*>(p), bytes);
}

// Host memory needs no pinning here; only the arguments are checked, so that
// callers see the CUDA build's InvalidArgument cases in tests.
absl::Status RegisterHostMemory(void* data, size_t bytes) {
  return gpu_internal::CheckRegisterArgs(data, bytes);
}

absl::Status UnregisterHostMemory(void* data) {
  return gpu_internal::CheckUnregisterArgs(data);
}

}  // namespace kvdepot
