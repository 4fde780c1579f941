// Gather and Scatter split into their checks and their copy, for callers
// that copy many times with one cache view and the same buffers (the
// staging pipeline): the checks once, then only the copies. Both
// implementations provide these (gather_cpu.cc, gather_cuda.cc), with the
// semantics of Gather/Scatter (gather.h) taken together.
#ifndef KVDEPOT_GPU_INTERNAL_CHECKED_COPY_H_
#define KVDEPOT_GPU_INTERNAL_CHECKED_COPY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/internal/transfer_plan.h"
#include "gpu/kv_layout.h"

namespace kvdepot::gpu_internal {

// What Gather and Scatter check of the cache on every call: the view
// against the layout (ResolveCache) and, in the CUDA build, that `device`
// reaches every tensor (first and last byte). Returns its geometry, or
// InvalidArgument as Gather would (or the device's error when the CUDA build
// cannot ask it).
absl::StatusOr<CacheGeometry> CheckCache(const KvLayout& layout,
                                         const KvCacheView& cache, int device);

// What they check of the object buffers: none is null and, in the CUDA
// build, `device` reaches each one's `bytes` (first and last byte).
absl::Status CheckObjectBuffers(absl::Span<const void* const> objects,
                                uint64_t bytes, int device);

// The copy of Gather (`to_cache` false: cache -> objects) or Scatter,
// enqueued on `stream` (the CPU build: done on return), without any check.
// REQUIRES: `g` from CheckCache of the cache, on the current device; the ids
// in range (and distinct for a scatter), one object per id, the layer range
// valid, and the objects checked by CheckObjectBuffers for the range's
// bytes. Errors: a launch failure, as Gather's.
absl::Status CopyChecked(const CacheGeometry& g,
                         absl::Span<const int64_t> block_ids, LayerRange layers,
                         absl::Span<const void* const> objects, bool to_cache,
                         StreamRef stream);

}  // namespace kvdepot::gpu_internal

#endif  // KVDEPOT_GPU_INTERNAL_CHECKED_COPY_H_
