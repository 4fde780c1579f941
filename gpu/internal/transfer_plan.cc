#include "gpu/internal/transfer_plan.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

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

namespace {

// A buffer's bytes [begin, end) as addresses; `index` names it in errors.
struct ByteRange {
  uintptr_t begin;
  uintptr_t end;
  size_t index;
};

ByteRange RangeOf(const void* p, uint64_t bytes, size_t index) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  // No allocation wraps around the address space; saturating keeps a bogus
  // pointer's range ordered rather than empty.
  uintptr_t end;
  if (__builtin_add_overflow(begin, bytes, &end)) end = UINTPTR_MAX;
  return ByteRange{begin, end, index};
}

// By start; ties by index, so that messages name buffers deterministically.
bool ByStart(const ByteRange& a, const ByteRange& b) {
  return a.begin < b.begin || (a.begin == b.begin && a.index < b.index);
}

}  // namespace

absl::Status CheckBuffersApart(const KvLayout& layout, const KvCacheView& cache,
                               absl::Span<const void* const> buffers,
                               uint64_t object_bytes, bool to_cache) {
  std::vector<ByteRange> objects;
  objects.reserve(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    objects.push_back(RangeOf(buffers[i], object_bytes, i));
  }
  std::sort(objects.begin(), objects.end(), ByStart);
  if (!to_cache) {
    // Sorted by start and equally long: an object overlaps an earlier one
    // exactly when it starts before the end of the one just before it. On
    // the device the two copies would race and leave torn objects (the CPU
    // twin would let the last writer win): refused in both builds.
    for (size_t k = 1; k < objects.size(); ++k) {
      if (objects[k].begin < objects[k - 1].end) {
        const size_t a = std::min(objects[k].index, objects[k - 1].index);
        const size_t b = std::max(objects[k].index, objects[k - 1].index);
        return absl::InvalidArgumentError(absl::StrCat(
            "object buffer ", b, " overlaps object buffer ", a,
            "; a gather writes every object, so each needs memory of its "
            "own"));
      }
    }
  }

  // Tensors may share bytes with each other (layers sharing one KV cache
  // pass the same tensor). All are equally long, so sorted by start they are
  // sorted by end too: of the tensors starting before an object ends, the
  // last reaches furthest, and the object meets one of them exactly when it
  // meets that one.
  ASSIGN_OR_RETURN(const uint64_t tensor_bytes,
                   layout.TensorBytes(cache.num_blocks));
  std::vector<ByteRange> tensors;
  tensors.reserve(cache.tensors.size());
  for (size_t i = 0; i < cache.tensors.size(); ++i) {
    tensors.push_back(RangeOf(cache.tensors[i], tensor_bytes, i));
  }
  std::sort(tensors.begin(), tensors.end(), ByStart);
  for (const ByteRange& o : objects) {
    auto after = std::partition_point(
        tensors.begin(), tensors.end(),
        [&o](const ByteRange& t) { return t.begin < o.end; });
    if (after == tensors.begin()) continue;
    const ByteRange& t = *std::prev(after);
    if (t.end <= o.begin) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "object buffer ", o.index, " overlaps cache tensor ", t.index, "; ",
        to_cache ? "a scatter would read an object out of the cache it writes"
                 : "a gather would write an object over the cache it reads",
        ", so objects need memory apart from the cache"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CacheGeometry> PlanTransfer(
    const KvLayout& layout, const KvCacheView& cache,
    absl::Span<const int64_t> block_ids, LayerRange layers,
    absl::Span<const void* const> buffers, bool to_cache) {
  ASSIGN_OR_RETURN(CacheGeometry g, ResolveCache(layout, cache));
  RETURN_IF_ERROR(ValidateLayerRange(layout, layers));
  if (buffers.size() != block_ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(block_ids.size(), " block ids but ", buffers.size(),
                     " object buffers; there must be one per block"));
  }
  RETURN_IF_ERROR(ValidateObjectBuffers(buffers));
  RETURN_IF_ERROR(ValidateBlockIds(block_ids, cache.num_blocks,
                                   /*allow_repeats=*/!to_cache));
  RETURN_IF_ERROR(CheckBuffersApart(
      layout, cache, buffers,
      static_cast<uint64_t>(layers.end - layers.begin) * layout.layer_bytes(),
      to_cache));
  return g;
}

}  // namespace kvdepot::gpu_internal
