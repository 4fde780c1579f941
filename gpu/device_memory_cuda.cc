// device_memory.h over the CUDA runtime. Part of kvdepot_gpu_cuda.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "gpu/device_memory.h"
#include "gpu/internal/cuda_status.h"

namespace kvdepot {

namespace gpu_internal {

absl::Status CudaStatus(int error, absl::string_view what) {
  const auto e = static_cast<cudaError_t>(error);
  if (e == cudaSuccess) return absl::OkStatus();
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
  // at exit): the memory goes with the process.
  if (data_ != nullptr) (void)cudaFreeHost(data_);
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

}  // namespace kvdepot
