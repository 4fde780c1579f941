// Gather/Scatter over the CUDA kernels of gather_cuda.cu: the shared
// validation (transfer_plan.h), a device-accessibility check of every
// pointer, then launches of at most kLaunchMaxLayers x kLaunchMaxBlocks
// chunks each on the caller's stream. Part of kvdepot_gpu_cuda.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "gpu/gather.h"
#include "gpu/internal/checked_copy.h"
#include "gpu/internal/copy_kernel.h"
#include "gpu/internal/cuda_status.h"
#include "gpu/internal/transfer_plan.h"
#include "storage/status_macros.h"

namespace kvdepot {
namespace {

using gpu_internal::CacheGeometry;
using gpu_internal::CopyLaunch;
using gpu_internal::CudaStatus;
using gpu_internal::kLaunchMaxBlocks;
using gpu_internal::kLaunchMaxLayers;

// A kernel dereferencing memory the device cannot reach faults and poisons
// the whole CUDA context (the engine's too), so every buffer is checked
// before anything is enqueued: its first and its last byte must each be
// device memory of the current device, managed memory, or page-locked host
// memory -- or pageable host memory where the device reads that (HMM/ATS)
// -- and both of the same kind (the same device's, for device memory).
// The last byte catches a buffer that runs past the end of its
// registration or allocation: past a cudaMalloc'd or page-locked range the
// address space is unmapped or someone else's, and a device that reads
// pageable memory would fault there all the same. Two
// cudaPointerGetAttributes per buffer, nothing cached (memory is freed and
// reused between calls). Not seen: a hole inside a buffer whose two ends
// are of one kind (two allocations with a gap between them).
//
// Device memory of another device is refused even where peer access to it
// is enabled: the runtime cannot tell whether it is without side effects,
// and an engine's cache and its staging live on its own device.
constexpr absl::string_view kReachable =
    "use device memory of the current device or page-locked host memory "
    "(AllocateHostBuffer, RegisterHostMemory)";

// What the runtime knows of byte `p`. Since CUDA 11 a plain host pointer is
// cudaSuccess with type cudaMemoryTypeUnregistered; cudaErrorInvalidValue
// (older drivers) means the same. Any other error is the context's (a
// sticky fault of an earlier kernel, the engine's own included) and is
// returned as it is, not taken for bad input.
absl::StatusOr<cudaPointerAttributes> Attributes(const void* p) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e == cudaErrorInvalidValue) {
    (void)cudaGetLastError();  // not a CUDA pointer; clear the error
    attr = cudaPointerAttributes{};
    attr.type = cudaMemoryTypeUnregistered;
  } else {
    RETURN_IF_ERROR(CudaStatus(e, "cudaPointerGetAttributes"));
  }
  return attr;
}

std::string Describe(const cudaPointerAttributes& attr) {
  switch (attr.type) {
    case cudaMemoryTypeUnregistered:
      return "pageable host memory";
    case cudaMemoryTypeDevice:
      return absl::StrCat("memory of device ", attr.device);
    case cudaMemoryTypeManaged:
      return "managed memory";
    default:
      return "page-locked host memory";
  }
}

// Why a kernel on `device` cannot dereference memory of `attr`; empty if
// it can.
std::string Unreachable(const cudaPointerAttributes& attr, int device,
                        bool pageable) {
  switch (attr.type) {
    case cudaMemoryTypeUnregistered:
      return pageable ? std::string()
                      : absl::StrCat(Describe(attr),
                                     ", which this device cannot access");
    case cudaMemoryTypeDevice:
      if (attr.device == device) return std::string();
      return absl::StrCat(Describe(attr), ", not of the current device ",
                          device, " (make that device current first)");
    default:  // page-locked host memory; managed memory
      return std::string();
  }
}

absl::Status CheckBuffer(const void* p, uint64_t bytes, int device,
                         bool pageable, absl::string_view what, size_t index) {
  ASSIGN_OR_RETURN(const cudaPointerAttributes first, Attributes(p));
  std::string why = Unreachable(first, device, pageable);
  if (!why.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", index, " is ", why, "; ", kReachable));
  }
  if (bytes > 1) {
    ASSIGN_OR_RETURN(const cudaPointerAttributes last,
                     Attributes(static_cast<const char*>(p) + (bytes - 1)));
    why = Unreachable(last, device, pageable);
    // Both reachable, so device memory is the current device's at both.
    if (why.empty() && last.type != first.type) {
      why = absl::StrCat(Describe(last), ", its first byte ", Describe(first));
    }
    if (!why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " ", index, " (", bytes,
          " bytes) runs past the end of its memory: its last byte is ", why,
          "; ", kReachable));
    }
  }
  return absl::OkStatus();
}

// Whether `device` reads pageable host memory (HMM/ATS).
absl::StatusOr<bool> PageableAccess(int device) {
  int pageable = 0;
  RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(
                     &pageable, cudaDevAttrPageableMemoryAccess, device),
                 "cudaDeviceGetAttribute(PageableMemoryAccess)"));
  return pageable != 0;
}

absl::Status CheckTensors(const KvLayout& layout, const KvCacheView& cache,
                          int device, bool pageable) {
  // Validated by ResolveCache.
  ASSIGN_OR_RETURN(const uint64_t tensor_bytes,
                   layout.TensorBytes(cache.num_blocks));
  for (size_t i = 0; i < cache.tensors.size(); ++i) {
    RETURN_IF_ERROR(CheckBuffer(cache.tensors[i], tensor_bytes, device,
                                pageable, "cache tensor", i));
  }
  return absl::OkStatus();
}

absl::Status CheckObjects(absl::Span<const void* const> objects, uint64_t bytes,
                          int device, bool pageable) {
  for (size_t i = 0; i < objects.size(); ++i) {
    RETURN_IF_ERROR(
        CheckBuffer(objects[i], bytes, device, pageable, "object buffer", i));
  }
  return absl::OkStatus();
}

absl::Status CheckDeviceAccessible(const KvLayout& layout,
                                   const KvCacheView& cache, LayerRange layers,
                                   absl::Span<const void* const> objects) {
  int device = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  ASSIGN_OR_RETURN(const bool pageable, PageableAccess(device));
  RETURN_IF_ERROR(CheckTensors(layout, cache, device, pageable));
  return CheckObjects(
      objects,
      static_cast<uint64_t>(layers.end - layers.begin) * layout.layer_bytes(),
      device, pageable);
}

// The widest vector (16, 4 or 1 bytes) dividing every address, offset,
// stride and size the launch uses.
int VectorBytes(const CopyLaunch& p, bool contiguous) {
  uint64_t bits = p.chunk_bytes;
  if (p.num_components > 1) bits |= static_cast<uint64_t>(p.component_stride);
  if (!contiguous) {
    bits |= p.row_bytes | static_cast<uint64_t>(p.token_stride) |
            static_cast<uint64_t>(p.head_stride);
  }
  for (int l = 0; l < p.num_layers; ++l) {
    bits |= reinterpret_cast<uintptr_t>(p.layer_base[l]);
  }
  for (int i = 0; i < p.num_blocks; ++i) {
    bits |= static_cast<uint64_t>(p.block_offset[i]) |
            reinterpret_cast<uintptr_t>(p.object[i]);
  }
  if (bits % 16 == 0) return 16;
  if (bits % 4 == 0) return 4;
  return 1;
}

}  // namespace

namespace gpu_internal {

absl::StatusOr<CacheGeometry> CheckCache(const KvLayout& layout,
                                         const KvCacheView& cache, int device) {
  ASSIGN_OR_RETURN(CacheGeometry g, ResolveCache(layout, cache));
  ASSIGN_OR_RETURN(const bool pageable, PageableAccess(device));
  RETURN_IF_ERROR(CheckTensors(layout, cache, device, pageable));
  return g;
}

absl::Status CheckObjectBuffers(absl::Span<const void* const> objects,
                                uint64_t bytes, int device) {
  RETURN_IF_ERROR(ValidateObjectBuffers(objects));
  ASSIGN_OR_RETURN(const bool pageable, PageableAccess(device));
  return CheckObjects(objects, bytes, device, pageable);
}

absl::Status CopyChecked(const CacheGeometry& g,
                         absl::Span<const int64_t> block_ids, LayerRange layers,
                         absl::Span<const void* const> objects, bool to_cache,
                         StreamRef stream) {
  CopyLaunch p{};
  p.component_stride = g.component_stride;
  p.chunk_bytes = static_cast<uint32_t>(g.chunk_bytes);
  p.num_heads = g.num_heads;
  p.num_components = g.num_components;
  if (g.contiguous) {
    p.row_bytes = p.chunk_bytes;
  } else {
    p.row_bytes = static_cast<uint32_t>(g.row_bytes);
    p.token_stride = g.token_stride;
    p.head_stride = g.head_stride;
  }
  const int64_t layer_bytes = g.num_components * g.chunk_bytes;
  for (int first = layers.begin; first < layers.end;
       first += kLaunchMaxLayers) {
    p.num_layers = std::min(layers.end - first, kLaunchMaxLayers);
    for (int l = 0; l < p.num_layers; ++l) {
      p.layer_base[l] = g.layer_base[first + l];
    }
    const int64_t object_offset = (first - layers.begin) * layer_bytes;
    for (size_t b = 0; b < block_ids.size(); b += kLaunchMaxBlocks) {
      p.num_blocks = static_cast<int32_t>(
          std::min<size_t>(block_ids.size() - b, kLaunchMaxBlocks));
      for (int i = 0; i < p.num_blocks; ++i) {
        p.block_offset[i] = block_ids[b + i] * g.block_stride;
        // The kernel writes through it only when gathering.
        p.object[i] =
            const_cast<char*>(static_cast<const char*>(objects[b + i])) +
            object_offset;
      }
      RETURN_IF_ERROR(CudaStatus(
          gpu_internal::LaunchCopyChunks(p, VectorBytes(p, g.contiguous),
                                         g.contiguous, to_cache, stream.native),
          to_cache ? "launching the scatter kernel"
                   : "launching the gather kernel"));
    }
  }
  return absl::OkStatus();
}

}  // namespace gpu_internal

absl::Status Gather(const KvLayout& layout, const KvCacheView& cache,
                    absl::Span<const int64_t> block_ids, LayerRange layers,
                    absl::Span<void* const> dst, StreamRef stream) {
  const absl::Span<const void* const> objects =
      gpu_internal::AsConstBuffers(dst);
  ASSIGN_OR_RETURN(
      const CacheGeometry g,
      gpu_internal::PlanTransfer(layout, cache, block_ids, layers, objects,
                                 /*to_cache=*/false));
  RETURN_IF_ERROR(CheckDeviceAccessible(layout, cache, layers, objects));
  return gpu_internal::CopyChecked(g, block_ids, layers, objects,
                                   /*to_cache=*/false, stream);
}

absl::Status Scatter(const KvLayout& layout, const KvCacheView& cache,
                     absl::Span<const int64_t> block_ids, LayerRange layers,
                     absl::Span<const void* const> src, StreamRef stream) {
  ASSIGN_OR_RETURN(const CacheGeometry g,
                   gpu_internal::PlanTransfer(layout, cache, block_ids, layers,
                                              src, /*to_cache=*/true));
  RETURN_IF_ERROR(CheckDeviceAccessible(layout, cache, layers, src));
  return gpu_internal::CopyChecked(g, block_ids, layers, src,
                                   /*to_cache=*/true, stream);
}

}  // namespace kvdepot
