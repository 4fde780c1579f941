// The CPU twin of gather_cuda.cc: the same validation (transfer_plan.h), then
// memcpy on the calling thread. Part of kvdepot_gpu_cpu.
#include <cstring>
#include <type_traits>

#include "gpu/gather.h"
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

absl::Status Gather(const KvLayout& layout, const KvCacheView& cache,
                    absl::Span<const int64_t> block_ids, LayerRange layers,
                    absl::Span<void* const> dst, StreamRef /*stream*/) {
  ASSIGN_OR_RETURN(const CacheGeometry g,
                   gpu_internal::PlanTransfer(layout, cache, block_ids, layers,
                                              gpu_internal::AsConstBuffers(dst),
                                              /*allow_repeats=*/true));
  CopyObjects</*kToCache=*/false>(g, block_ids, layers, dst);
  return absl::OkStatus();
}

absl::Status Scatter(const KvLayout& layout, const KvCacheView& cache,
                     absl::Span<const int64_t> block_ids, LayerRange layers,
                     absl::Span<const void* const> src, StreamRef /*stream*/) {
  ASSIGN_OR_RETURN(const CacheGeometry g,
                   gpu_internal::PlanTransfer(layout, cache, block_ids, layers,
                                              src, /*allow_repeats=*/false));
  CopyObjects</*kToCache=*/true>(g, block_ids, layers, src);
  return absl::OkStatus();
}

}  // namespace kvdepot
