// The CPU twin of gather_cuda.cc: the same validation (transfer_plan.h), then
// memcpy on the calling thread. Part of kvdepot_gpu_cpu.
#include <cstring>
#include <type_traits>

#include "gpu/gather.h"
#include "gpu/internal/checked_copy.h"
#include "gpu/internal/transfer_plan.h"
#include "storage/status_macros.h"

namespace kvdepot {
namespace {

using gpu_internal::CacheGeometry;

// Copies layers `layers` of each block between the cache (strided, per `g`)
// and its object (canonical order): object -> cache when kToCache.
template <bool kToCache>
void CopyObjects(
    const CacheGeometry& g, absl::Span<const int64_t> block_ids,
    LayerRange layers,
    absl::Span<std::conditional_t<kToCache, const void*, void*> const>
        objects) {
  using ObjectByte = std::conditional_t<kToCache, const char, char>;
  auto copy = [](char* cache, ObjectByte* object, int64_t bytes) {
    if constexpr (kToCache) {
      std::memcpy(cache, object, bytes);
    } else {
      std::memcpy(object, cache, bytes);
    }
  };
  for (size_t i = 0; i < block_ids.size(); ++i) {
    ObjectByte* object = static_cast<ObjectByte*>(objects[i]);
    for (int l = layers.begin; l < layers.end; ++l) {
      char* block = g.layer_base[l] + block_ids[i] * g.block_stride;
      for (int c = 0; c < g.num_components; ++c) {
        char* chunk = block + c * g.component_stride;
        if (g.contiguous) {
          copy(chunk, object, g.chunk_bytes);
          object += g.chunk_bytes;
          continue;
        }
        for (int t = 0; t < g.num_tokens; ++t) {
          for (int h = 0; h < g.num_heads; ++h) {
            copy(chunk + t * g.token_stride + h * g.head_stride, object,
                 g.row_bytes);
            object += g.row_bytes;
          }
        }
      }
    }
  }
}

}  // namespace

namespace gpu_internal {

absl::StatusOr<CacheGeometry> CheckCache(const KvLayout& layout,
                                         const KvCacheView& cache, int device) {
  RETURN_IF_ERROR(SetCurrentDevice(device));  // only device 0 exists
  return ResolveCache(layout, cache);
}

absl::Status CheckObjectBuffers(absl::Span<const void* const> objects,
                                uint64_t /*bytes*/, int device) {
  RETURN_IF_ERROR(SetCurrentDevice(device));
  RETURN_IF_ERROR(ValidateObjectBuffers(objects));
  return absl::OkStatus();
}

absl::Status CopyChecked(const CacheGeometry& g,
                         absl::Span<const int64_t> block_ids, LayerRange layers,
                         absl::Span<const void* const> objects, bool to_cache,
                         StreamRef /*stream*/) {
  if (to_cache) {
    CopyObjects</*kToCache=*/true>(g, block_ids, layers, objects);
  } else {
    // The objects are written: they were the caller's mutable dst.
    const absl::Span<void* const> dst(const_cast<void* const*>(objects.data()),
                                      objects.size());
    CopyObjects</*kToCache=*/false>(g, block_ids, layers, dst);
  }
  return absl::OkStatus();
}

}  // namespace gpu_internal

absl::Status Gather(const KvLayout& layout, const KvCacheView& cache,
                    absl::Span<const int64_t> block_ids, LayerRange layers,
                    absl::Span<void* const> dst, StreamRef stream) {
  const absl::Span<const void* const> objects =
      gpu_internal::AsConstBuffers(dst);
  ASSIGN_OR_RETURN(const CacheGeometry g,
                   gpu_internal::PlanTransfer(layout, cache, block_ids, layers,
                                              objects, /*to_cache=*/false));
  return gpu_internal::CopyChecked(g, block_ids, layers, objects,
                                   /*to_cache=*/false, stream);
}

absl::Status Scatter(const KvLayout& layout, const KvCacheView& cache,
                     absl::Span<const int64_t> block_ids, LayerRange layers,
                     absl::Span<const void* const> src, StreamRef stream) {
  ASSIGN_OR_RETURN(const CacheGeometry g,
                   gpu_internal::PlanTransfer(layout, cache, block_ids, layers,
                                              src, /*to_cache=*/true));
  return gpu_internal::CopyChecked(g, block_ids, layers, src,
                                   /*to_cache=*/true, stream);
}

}  // namespace kvdepot
