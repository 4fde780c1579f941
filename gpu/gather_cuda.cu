// The gather/scatter kernels (see internal/copy_kernel.h for the launch
// interface and gather_cuda.cc for the host side). Kept free of Abseil and
// project headers so nvcc compiles only this.
//
// One thread block per chunk (one component of one layer of one block).
// Its threads stride over the chunk in vectors of 16, 4 or 1 bytes (the
// widest that every address and size allows), so a warp touches consecutive
// addresses of the object and, within each head-size row, of the cache.
// Contiguous chunks (NHD) are a flat copy; strided ones (HND) locate each
// vector's (token, head) row with two 32-bit divisions.
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/internal/copy_kernel.h"

namespace kvdepot::gpu_internal {
namespace {

constexpr int kThreads = 256;

template <typename V, bool kContiguous, bool kToCache>
__global__ void __launch_bounds__(kThreads)
    CopyChunks(const __grid_constant__ CopyLaunch p) {
  const uint32_t chunk = blockIdx.x;
  const uint32_t c = chunk % p.num_components;
  const uint32_t l = (chunk / p.num_components) % p.num_layers;
  const uint32_t i = chunk / (p.num_components * p.num_layers);
  char* const cache = p.layer_base[l] + p.block_offset[i] +
                      static_cast<int64_t>(c) * p.component_stride;
  V* const object = reinterpret_cast<V*>(
      p.object[i] +
      (static_cast<int64_t>(l) * p.num_components + c) * p.chunk_bytes);
  const uint32_t n = p.chunk_bytes / sizeof(V);
  if constexpr (kContiguous) {
    V* const run = reinterpret_cast<V*>(cache);
    for (uint32_t k = threadIdx.x; k < n; k += kThreads) {
      if constexpr (kToCache) {
        run[k] = object[k];
      } else {
        object[k] = run[k];
      }
    }
  } else {
    const uint32_t per_row = p.row_bytes / sizeof(V);
    for (uint32_t k = threadIdx.x; k < n; k += kThreads) {
      const uint32_t row = k / per_row;
      const uint32_t col = k - row * per_row;
      const uint32_t t = row / p.num_heads;
      const uint32_t h = row - t * p.num_heads;
      V* const v =
          reinterpret_cast<V*>(cache + t * p.token_stride + h * p.head_stride) +
          col;
      if constexpr (kToCache) {
        *v = object[k];
      } else {
        object[k] = *v;
      }
    }
  }
}

template <typename V>
int Launch(const CopyLaunch& p, bool contiguous, bool to_cache,
           cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.num_blocks) *
                        static_cast<unsigned>(p.num_layers) *
                        static_cast<unsigned>(p.num_components);
  if (contiguous) {
    if (to_cache) {
      CopyChunks<V, true, true><<<grid, kThreads, 0, stream>>>(p);
    } else {
      CopyChunks<V, true, false><<<grid, kThreads, 0, stream>>>(p);
    }
  } else {
    if (to_cache) {
      CopyChunks<V, false, true><<<grid, kThreads, 0, stream>>>(p);
    } else {
      CopyChunks<V, false, false><<<grid, kThreads, 0, stream>>>(p);
    }
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchCopyChunks(const CopyLaunch& p, int vector_bytes, bool contiguous,
                     bool to_cache, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (vector_bytes) {
    case 16:
      return Launch<uint4>(p, contiguous, to_cache, s);
    case 4:
      return Launch<uint32_t>(p, contiguous, to_cache, s);
    default:
      return Launch<uint8_t>(p, contiguous, to_cache, s);
  }
}

}  // namespace kvdepot::gpu_internal
