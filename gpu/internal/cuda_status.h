// absl::Status from CUDA runtime errors (kvdepot_gpu_cuda only).
#ifndef KVDEPOT_GPU_INTERNAL_CUDA_STATUS_H_
#define KVDEPOT_GPU_INTERNAL_CUDA_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot::gpu_internal {

// OK for cudaSuccess (0). Otherwise "<what>: <error name>: <description>"
// with the closest code: ResourceExhausted for out of memory,
// FailedPrecondition for no device or an unusable driver, InvalidArgument
// for invalid values, AlreadyExists / NotFound for host memory registered
// already / not registered, Internal for the rest. `error` is a cudaError_t.
// A failure also clears the thread's last-error state (cudaGetLastError),
// since the caller hears of it from the returned status: a later kernel
// launch's check must not report it again.
absl::Status CudaStatus(int error, absl::string_view what);

}  // namespace kvdepot::gpu_internal

#endif  // KVDEPOT_GPU_INTERNAL_CUDA_STATUS_H_
