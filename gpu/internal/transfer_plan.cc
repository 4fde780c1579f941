#include "gpu/internal/transfer_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "storage/status_macros.h"

namespace kvdepot::gpu_internal {

absl::StatusOr<CacheGeometry> ResolveCache(const KvLayout& layout,
                                           const KvCacheView& cache) {
  if (static_cast<int64_t>(cache.tensors.size()) != layout.num_tensors()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", KvCacheLayoutName(layout.layout()),
                     " layout takes ", layout.num_tensors(),
                     layout.cross_layer() ? " tensor (one for all layers)"
                                          : " tensors (one per layer)",
                     "; the cache view has ", cache.tensors.size()));
  }
  for (size_t i = 0; i < cache.tensors.size(); ++i) {
    if (cache.tensors[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache tensor ", i, " is null"));
    }
  }
  // Bounds every offset below: the largest is inside one tensor.
  RETURN_IF_ERROR(layout.TensorBytes(cache.num_blocks).status());

  const int64_t row = static_cast<int64_t>(layout.row_bytes());
  const int64_t chunk = static_cast<int64_t>(layout.chunk_bytes());
  const int64_t num_blocks = cache.num_blocks;
  const int tokens = layout.block_size();
  const int heads = layout.num_kv_heads();
  const int components = layout.num_components();

  CacheGeometry g;
  g.row_bytes = row;
  g.chunk_bytes = chunk;
  g.num_tokens = tokens;
  g.num_heads = heads;
  g.num_components = components;
  // NHD rows by default; the HND cases swap the two.
  g.token_stride = heads * row;
  g.head_stride = row;
  int64_t layer_stride = 0;  // cross-layer only
  switch (layout.layout()) {
    case KvCacheLayout::kFlashAttnHnd:  // [2, N, H, T, D]
      g.token_stride = row;
      g.head_stride = tokens * row;
      [[fallthrough]];
    case KvCacheLayout::kFlashAttnNhd:  // [2, N, T, H, D]
      g.block_stride = chunk;
      g.component_stride = num_blocks * chunk;
      break;
    case KvCacheLayout::kFlashInferHnd:  // [N, 2, H, T, D]
      g.token_stride = row;
      g.head_stride = tokens * row;
      [[fallthrough]];
    case KvCacheLayout::kFlashInferNhd:  // [N, 2, T, H, D]
      g.block_stride = components * chunk;
      g.component_stride = chunk;
      break;
    case KvCacheLayout::kMla:  // [N, T, D]: one component, one head
      g.block_stride = chunk;
      g.component_stride = chunk;
      break;
    case KvCacheLayout::kCrossLayerHnd:  // [N, L, C, H, T, D]
      g.token_stride = row;
      g.head_stride = tokens * row;
      [[fallthrough]];
    case KvCacheLayout::kCrossLayerNhd:  // [N, L, C, T, H, D]
      layer_stride = components * chunk;
      g.block_stride = layout.num_layers() * layer_stride;
      g.component_stride = chunk;
      break;
  }
  g.contiguous = (tokens == 1 || g.token_stride == heads * row) &&
                 (heads == 1 || g.head_stride == row);
  g.layer_base.resize(layout.num_layers());
  for (int l = 0; l < layout.num_layers(); ++l) {
    g.layer_base[l] =
        layout.cross_layer()
            ? static_cast<char*>(cache.tensors[0]) + l * layer_stride
            : static_cast<char*>(cache.tensors[l]);
  }
  return g;
}

absl::Status ValidateBlockIds(absl::Span<const int64_t> block_ids,
                              int64_t num_blocks, bool allow_repeats) {
  for (size_t i = 0; i < block_ids.size(); ++i) {
    if (block_ids[i] < 0 || block_ids[i] >= num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("block id ", block_ids[i], " (at index ", i,
                       ") is outside the cache's [0, ", num_blocks, ")"));
    }
  }
  if (!allow_repeats && block_ids.size() > 1) {
    std::vector<int64_t> sorted(block_ids.begin(), block_ids.end());
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block id ", *dup,
                       " appears more than once; each block may be written "
                       "only once per call"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateObjectBuffers(absl::Span<const void* const> buffers) {
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("object buffer ", i, " is null"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CacheGeometry> PlanTransfer(
    const KvLayout& layout, const KvCacheView& cache,
    absl::Span<const int64_t> block_ids, LayerRange layers,
    absl::Span<const void* const> buffers, bool allow_repeats) {
  ASSIGN_OR_RETURN(CacheGeometry g, ResolveCache(layout, cache));
  RETURN_IF_ERROR(ValidateLayerRange(layout, layers));
  if (buffers.size() != block_ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(block_ids.size(), " block ids but ", buffers.size(),
                     " object buffers; there must be one per block"));
  }
  RETURN_IF_ERROR(ValidateObjectBuffers(buffers));
  RETURN_IF_ERROR(ValidateBlockIds(block_ids, cache.num_blocks, allow_repeats));
  return g;
}

}  // namespace kvdepot::gpu_internal
