// The argument checks of RegisterHostMemory / UnregisterHostMemory, shared
// by both implementations (device_memory_cpu.cc, device_memory_cuda.cc) so
// that they refuse the same input with the same error.
#ifndef KVDEPOT_GPU_INTERNAL_HOST_MEMORY_ARGS_H_
#define KVDEPOT_GPU_INTERNAL_HOST_MEMORY_ARGS_H_

#include <cstddef>

#include "absl/status/status.h"

namespace kvdepot::gpu_internal {

inline absl::Status CheckRegisterArgs(const void* data, size_t bytes) {
  if (data == nullptr) {
    return absl::InvalidArgumentError(
        "cannot register host memory at a null address");
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError("cannot register 0 bytes of host memory");
  }
  return absl::OkStatus();
}

inline absl::Status CheckUnregisterArgs(const void* data) {
  if (data == nullptr) {
    return absl::InvalidArgumentError("cannot unregister a null address");
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::gpu_internal

#endif  // KVDEPOT_GPU_INTERNAL_HOST_MEMORY_ARGS_H_
