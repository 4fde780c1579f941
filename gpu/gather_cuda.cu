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

// Launched with cudaLaunchKernel, whose return value is this launch's own
// result. The alternative, <<<...>>> then cudaGetLastError(), would also
// return a non-sticky error left by any earlier runtime call on this thread
// (a refused cudaHostRegister, a bad cudaSetDevice, the engine's own), and
// report as failed a kernel that was enqueued and still writes the
// caller's buffers. The thread's last-error state is left as it was.
template <typename V, bool kContiguous, bool kToCache>
cudaError_t LaunchOne(const CopyLaunch& p, unsigned grid, cudaStream_t stream) {
  void* args[] = {const_cast<CopyLaunch*>(&p)};
  return cudaLaunchKernel(CopyChunks<V, kContiguous, kToCache>, dim3(grid),
                          dim3(kThreads), args, 0, stream);
}

template <typename V>
int Launch(const CopyLaunch& p, bool contiguous, bool to_cache,
           cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.num_blocks) *
                        static_cast<unsigned>(p.num_layers) *
                        static_cast<unsigned>(p.num_components);
  cudaError_t e;
  if (contiguous) {
    e = to_cache ? LaunchOne<V, true, true>(p, grid, stream)
                 : LaunchOne<V, true, false>(p, grid, stream);
  } else {
    e = to_cache ? LaunchOne<V, false, true>(p, grid, stream)
                 : LaunchOne<V, false, false>(p, grid, stream);
  }
  return static_cast<int>(e);
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
