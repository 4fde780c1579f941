// device_memory.h over the CUDA runtime. Part of kvdepot_gpu_cuda.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "gpu/device_memory.h"
#include "gpu/internal/cuda_status.h"
#include "gpu/internal/host_memory_args.h"

namespace kvdepot {

namespace gpu_internal {

// Every runtime call whose failure kvdepot returns passes its error through
// here, so this is also where the failure is cleared from the thread's
// last-error state: left there, a later cudaGetLastError() -- the engine's
// after its own kernel launch (PyTorch checks every launch that way), or
// anyone's -- would report it as its own error. Only the non-sticky state
// clears; a sticky error (a faulted kernel) stays, as it must.
absl::Status CudaStatus(int error, absl::string_view what) {
  const auto e = static_cast<cudaError_t>(error);
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(e),
                                           ": ", cudaGetErrorString(e));
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return absl::FailedPreconditionError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    case cudaErrorHostMemoryAlreadyRegistered:
      return absl::AlreadyExistsError(message);
    case cudaErrorHostMemoryNotRegistered:
      return absl::NotFoundError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace gpu_internal

using gpu_internal::CudaStatus;

absl::string_view GpuBackendName() { return "cuda"; }

absl::Status SynchronizeStream(StreamRef stream) {
  return CudaStatus(
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream.native)),
      "cudaStreamSynchronize");
}

absl::StatusOr<DeviceEvent> DeviceEvent::Create() {
  cudaEvent_t event = nullptr;
  absl::Status s =
      CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags");
  if (!s.ok()) return s;
  return DeviceEvent(event);
}

absl::Status DeviceEvent::Record(StreamRef stream) {
  return CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(native_),
                                    static_cast<cudaStream_t>(stream.native)),
                    "cudaEventRecord");
}

absl::StatusOr<bool> DeviceEvent::IsComplete() {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(native_));
  if (e == cudaErrorNotReady) {
    // Not an error: the work is still running. Cleared all the same, so
    // that no later cudaGetLastError() on this thread takes it for one.
    (void)cudaGetLastError();
    return false;
  }
  absl::Status s = CudaStatus(e, "cudaEventQuery");
  if (!s.ok()) return s;
  return true;
}

absl::Status DeviceEvent::Synchronize() {
  return CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(native_)),
                    "cudaEventSynchronize");
}

absl::Status DeviceEvent::MakeStreamWait(StreamRef stream) const {
  // Flags 0 (cudaEventWaitDefault). An event never recorded is complete to
  // the runtime, so the wait is empty, as documented.
  return CudaStatus(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native),
                          static_cast<cudaEvent_t>(native_), 0),
      "cudaStreamWaitEvent");
}

void DeviceEvent::Release() {
  // As HostBuffer::Release: nothing useful to do on failure.
  if (native_ != nullptr &&
      cudaEventDestroy(static_cast<cudaEvent_t>(native_)) != cudaSuccess) {
    (void)cudaGetLastError();
  }
  native_ = nullptr;
}

absl::StatusOr<int> GetCurrentDevice() {
  int device = 0;
  absl::Status s = CudaStatus(cudaGetDevice(&device), "cudaGetDevice");
  if (!s.ok()) return s;
  return device;
}

absl::Status SetCurrentDevice(int device) {
  return CudaStatus(cudaSetDevice(device),
                    absl::StrCat("cudaSetDevice(", device, ")"));
}

void HostBuffer::Release() {
  // Nothing useful to do on failure (e.g. the runtime is already unloading
  // at exit): the memory goes with the process. The error is cleared so
  // that no later cudaGetLastError() takes it for its own (see CudaStatus).
  if (data_ != nullptr && cudaFreeHost(data_) != cudaSuccess) {
    (void)cudaGetLastError();
  }
  data_ = nullptr;
  size_ = 0;
}

absl::StatusOr<HostBuffer> AllocateHostBuffer(size_t bytes) {
  if (bytes == 0) return HostBuffer();
  void* p = nullptr;
  // Portable: usable from every device's context. Mapped: kernels reach it
  // through its host address (unified addressing).
  absl::Status s = CudaStatus(
      cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
      absl::StrCat("cudaHostAlloc(", bytes, ")"));
  if (!s.ok()) return s;
  return HostBuffer(static_cast<char*>(p), bytes);
}

absl::Status RegisterHostMemory(void* data, size_t bytes) {
  if (absl::Status st = gpu_internal::CheckRegisterArgs(data, bytes); !st.ok()) {
    return st;
  }
  // The kernels dereference the host address itself (HostBuffer works the
  // same way), which registered memory allows only where this attribute is
  // set (every 64-bit Linux system with unified addressing).
  int device = 0;
  absl::Status s = CudaStatus(cudaGetDevice(&device), "cudaGetDevice");
  if (!s.ok()) return s;
  int same_address = 0;
  s = CudaStatus(
      cudaDeviceGetAttribute(&same_address,
                             cudaDevAttrCanUseHostPointerForRegisteredMem,
                             device),
      "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)");
  if (!s.ok()) return s;
  if (same_address == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device,
        " cannot access registered host memory at its host address"));
  }
  // Portable: usable from every device's context. Mapped: in the device
  // address space (implied by unified addressing; explicit here).
  return CudaStatus(
      cudaHostRegister(data, bytes,
                       cudaHostRegisterPortable | cudaHostRegisterMapped),
      absl::StrCat("cudaHostRegister(", bytes, " bytes)"));
}

absl::Status UnregisterHostMemory(void* data) {
  if (absl::Status st = gpu_internal::CheckUnregisterArgs(data); !st.ok()) {
    return st;
  }
  return CudaStatus(cudaHostUnregister(data), "cudaHostUnregister");
}

}  // namespace kvdepot
