// Validation and cache geometry shared by both gather/scatter
// implementations, so the CPU twin and the CUDA kernels accept and reject
// exactly the same calls.
#ifndef KVDEPOT_GPU_INTERNAL_TRANSFER_PLAN_H_
#define KVDEPOT_GPU_INTERNAL_TRANSFER_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/gather.h"
#include "gpu/kv_layout.h"

namespace kvdepot::gpu_internal {

// Where the bytes of a cache are. One "chunk" is one component (K, V or the
// latent) of one layer of one block: block_size x num_kv_heads rows of
// row_bytes, which the object holds back to back in (token, head) order.
// All strides are in bytes.
struct CacheGeometry {
  // Layer l's chunk of block 0, component 0.
  std::vector<char*> layer_base;
  int64_t block_stride = 0;      // block b's chunk is b x block_stride on
  int64_t component_stride = 0;  // component c's is c x component_stride on
  int64_t token_stride = 0;      // row (t, h) of a chunk is at
  int64_t head_stride = 0;       //   t x token_stride + h x head_stride
  int64_t row_bytes = 0;
  int64_t chunk_bytes = 0;
  int num_tokens = 0;
  int num_heads = 0;
  int num_components = 0;
  // The chunk's rows lie back to back in canonical order (NHD layouts, or
  // one row per chunk): the chunk is one run of chunk_bytes.
  bool contiguous = false;
};

// Checks the view against the layout (tensor count, null tensors, num_blocks,
// overflow) and resolves its geometry.
absl::StatusOr<CacheGeometry> ResolveCache(const KvLayout& layout,
                                           const KvCacheView& cache);

// Checks that every id is in [0, num_blocks) and, unless `allow_repeats`,
// that none repeats.
absl::Status ValidateBlockIds(absl::Span<const int64_t> block_ids,
                              int64_t num_blocks, bool allow_repeats);

// Checks that no object buffer is null.
absl::Status ValidateObjectBuffers(absl::Span<const void* const> buffers);

// Checks that no object buffer (each `object_bytes` at its pointer) shares
// a byte with a cache tensor (each layout.TensorBytes(cache.num_blocks) at
// its pointer) and, for a gather (`to_cache` false: the objects are
// written), that no two objects share a byte. Cache tensors may share bytes
// with each other (layers that share one KV cache pass the same tensor);
// a scatter's sources may overlap (they are only read). InvalidArgument,
// naming the two buffers, otherwise. O((n + t) log(n + t)) for n objects
// and t tensors. REQUIRES: `cache` checked by ResolveCache.
absl::Status CheckBuffersApart(const KvLayout& layout, const KvCacheView& cache,
                               absl::Span<const void* const> buffers,
                               uint64_t object_bytes, bool to_cache);

// Everything Gather (`to_cache` false: `buffers` are the destinations,
// block ids may repeat) and Scatter (`to_cache` true: the sources, ids
// distinct) check before touching memory (see gather.h); returns the
// cache's geometry.
absl::StatusOr<CacheGeometry> PlanTransfer(
    const KvLayout& layout, const KvCacheView& cache,
    absl::Span<const int64_t> block_ids, LayerRange layers,
    absl::Span<const void* const> buffers, bool to_cache);

// Span<void* const> as Span<const void* const> (same pointers, read-only).
inline absl::Span<const void* const> AsConstBuffers(
    absl::Span<void* const> buffers) {
  return absl::Span<const void* const>(buffers.data(), buffers.size());
}

}  // namespace kvdepot::gpu_internal

#endif  // KVDEPOT_GPU_INTERNAL_TRANSFER_PLAN_H_
