// Stand-in for <cuda_runtime.h> when compiling gather_cuda.cu as HOST code
// (kernels_host.cc): the kernels become ordinary functions and
// cudaLaunchKernel enqueues a closure that runs every (block, thread) of
// the grid, in loops, on the stream's worker thread -- later, not at launch.
#ifndef FAKE_KINC_CUDA_RUNTIME_H_
#define FAKE_KINC_CUDA_RUNTIME_H_
#include <cuda_runtime_api.h>  // the real declarations and types

#include <cstddef>
#include <type_traits>

#include "fake_cuda.h"

#undef __launch_bounds__
#define __launch_bounds__(...)
#define threadIdx ::fake_cuda::tl_thread_idx
#define blockIdx ::fake_cuda::tl_block_idx
#define gridDim ::fake_cuda::tl_grid_dim
#define blockDim ::fake_cuda::tl_block_dim

template <typename P>
cudaError_t cudaLaunchKernel(void (*kernel)(P), dim3 grid, dim3 block,
                             void** args, size_t shared_mem,
                             cudaStream_t stream) {
  using Param = std::remove_cv_t<std::remove_reference_t<P>>;
  // Parameters are copied at launch, as CUDA does.
  const Param p = *static_cast<const Param*>(args[0]);
  return ::fake_cuda::EnqueueKernel(
      stream,
      [kernel, p, grid, block] {
        ::fake_cuda::tl_grid_dim = grid;
        ::fake_cuda::tl_block_dim = block;
        for (unsigned bz = 0; bz < grid.z; ++bz)
          for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx)
              for (unsigned tz = 0; tz < block.z; ++tz)
                for (unsigned ty = 0; ty < block.y; ++ty)
                  for (unsigned tx = 0; tx < block.x; ++tx) {
                    ::fake_cuda::tl_block_idx = uint3{bx, by, bz};
                    ::fake_cuda::tl_thread_idx = uint3{tx, ty, tz};
                    kernel(p);
                  }
      },
      &p, sizeof(p));
}

#endif  // FAKE_KINC_CUDA_RUNTIME_H_
