// The launch interface between gather_cuda.cc (host code, compiled by the
// C++ compiler) and gather_cuda.cu (the kernels, compiled by nvcc). Plain
// C++ with no Abseil or CUDA headers, so nvcc compiles only the kernels.
#ifndef KVDEPOT_GPU_INTERNAL_COPY_KERNEL_H_
#define KVDEPOT_GPU_INTERNAL_COPY_KERNEL_H_

#include <cstdint>

namespace kvdepot::gpu_internal {

// Bounds of one launch, so that CopyLaunch fits the 4 KiB kernel-parameter
// limit every CUDA version accepts. Larger calls take several launches.
inline constexpr int kLaunchMaxLayers = 64;
inline constexpr int kLaunchMaxBlocks = 192;

// One kernel launch: thread block x copies one chunk (one component of one
// layer of one block) between the cache and a transfer object. Passed by
// value as the kernel's parameter (no device allocation, no copy to keep
// alive after the launch).
struct CopyLaunch {
  // Layer l of this launch: the cache's chunk of block 0, component 0.
  char* layer_base[kLaunchMaxLayers];
  // Block i of this launch: block id x block stride.
  int64_t block_offset[kLaunchMaxBlocks];
  // Block i of this launch: where this launch's first layer starts in its
  // object.
  char* object[kLaunchMaxBlocks];
  int64_t component_stride;
  // Row (t, h) of a chunk is at t x token_stride + h x head_stride (strided
  // chunks only).
  int64_t token_stride;
  int64_t head_stride;
  uint32_t row_bytes;    // strided chunks only
  uint32_t chunk_bytes;  // < 2^31 (KvLayout::kMaxChunkBytes)
  int32_t num_heads;
  int32_t num_layers;  // in this launch, <= kLaunchMaxLayers
  int32_t num_components;
  int32_t num_blocks;  // in this launch, <= kLaunchMaxBlocks
};
static_assert(sizeof(CopyLaunch) <= 4096, "kernel parameters exceed 4 KiB");

// Enqueues one launch on `stream` (a cudaStream_t) and returns the launch's
// cudaError_t (0: cudaSuccess). `vector_bytes` (16, 4 or 1) must divide
// every address, offset, stride and size in `p`. `contiguous`: each chunk is
// one run of chunk_bytes in the cache (strides unused). `to_cache`: scatter
// (object -> cache), else gather.
int LaunchCopyChunks(const CopyLaunch& p, int vector_bytes, bool contiguous,
                     bool to_cache, void* stream);

}  // namespace kvdepot::gpu_internal

#endif  // KVDEPOT_GPU_INTERNAL_COPY_KERNEL_H_
