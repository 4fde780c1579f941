// Gather/Scatter over the CUDA kernels of gather_cuda.cu: the shared
// validation (transfer_plan.h), a device-accessibility check of every
// pointer, then launches of at most kLaunchMaxLayers x kLaunchMaxBlocks
// chunks each on the caller's stream. Part of kvdepot_gpu_cuda.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "gpu/gather.h"
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

// A kernel dereferencing pageable host memory would fault and poison the
// whole CUDA context (the engine's too), so every pointer is checked first
// unless the device can read pageable memory (HMM/ATS).
absl::Status CheckDeviceAccessible(const KvCacheView& cache,
                                   absl::Span<const void* const> objects) {
  int device = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  int pageable = 0;
  RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(
                     &pageable, cudaDevAttrPageableMemoryAccess, device),
                 "cudaDeviceGetAttribute(PageableMemoryAccess)"));
  if (pageable != 0) return absl::OkStatus();
  auto check = [](const void* p, absl::string_view what,
                  size_t index) -> absl::Status {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      (void)cudaGetLastError();  // not a CUDA pointer; clear the error
      attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type == cudaMemoryTypeUnregistered) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " ", index,
          " is pageable host memory, which this device cannot access; use "
          "device memory or page-locked host memory (AllocateHostBuffer)"));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < cache.tensors.size(); ++i) {
    RETURN_IF_ERROR(check(cache.tensors[i], "cache tensor", i));
  }
  for (size_t i = 0; i < objects.size(); ++i) {
    RETURN_IF_ERROR(check(objects[i], "object buffer", i));
  }
  return absl::OkStatus();
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

absl::Status Copy(const CacheGeometry& g, absl::Span<const int64_t> block_ids,
                  LayerRange layers, absl::Span<const void* const> objects,
                  bool to_cache, StreamRef stream) {
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

}  // namespace

absl::Status Gather(const KvLayout& layout, const KvCacheView& cache,
                    absl::Span<const int64_t> block_ids, LayerRange layers,
                    absl::Span<void* const> dst, StreamRef stream) {
  const absl::Span<const void* const> objects =
      gpu_internal::AsConstBuffers(dst);
  ASSIGN_OR_RETURN(
      const CacheGeometry g,
      gpu_internal::PlanTransfer(layout, cache, block_ids, layers, objects,
                                 /*allow_repeats=*/true));
  RETURN_IF_ERROR(CheckDeviceAccessible(cache, objects));
  return Copy(g, block_ids, layers, objects, /*to_cache=*/false, stream);
}

absl::Status Scatter(const KvLayout& layout, const KvCacheView& cache,
                     absl::Span<const int64_t> block_ids, LayerRange layers,
                     absl::Span<const void* const> src, StreamRef stream) {
  ASSIGN_OR_RETURN(const CacheGeometry g,
                   gpu_internal::PlanTransfer(layout, cache, block_ids, layers,
                                              src, /*allow_repeats=*/false));
  RETURN_IF_ERROR(CheckDeviceAccessible(cache, src));
  return Copy(g, block_ids, layers, src, /*to_cache=*/true, stream);
}

}  // namespace kvdepot
