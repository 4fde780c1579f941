// Test helper (header-only, for gpu/*_test.cc and the benchmark): a paged
// cache in staging memory, which both implementations can reach (page-locked
// in the CUDA build), with a reference address for every row.
//
// The reference addressing is written straight from the shapes documented in
// kv_layout.h, independently of internal/transfer_plan.cc, so tests that
// compare Gather/Scatter against it check the geometry, not just agree with
// it.
#ifndef KVDEPOT_GPU_INTERNAL_TEST_CACHE_H_
#define KVDEPOT_GPU_INTERNAL_TEST_CACHE_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/kv_layout.h"

namespace kvdepot {

// Readable test parameters (gtest finds them by argument-dependent lookup).
inline void PrintTo(KvCacheLayout layout, std::ostream* os) {
  *os << KvCacheLayoutName(layout);
}
inline void PrintTo(KvDtype dtype, std::ostream* os) { *os << KvDtypeName(dtype); }

}  // namespace kvdepot

namespace kvdepot::gpu_testing {

// Every layout and dtype, for tests that cover them all.
constexpr KvCacheLayout kAllLayouts[] = {
    KvCacheLayout::kFlashAttnNhd,  KvCacheLayout::kFlashAttnHnd,
    KvCacheLayout::kFlashInferNhd, KvCacheLayout::kFlashInferHnd,
    KvCacheLayout::kMla,           KvCacheLayout::kCrossLayerNhd,
    KvCacheLayout::kCrossLayerHnd};
constexpr KvDtype kAllDtypes[] = {KvDtype::kFloat16, KvDtype::kBFloat16,
                                  KvDtype::kFloat8E4M3, KvDtype::kFloat32};

class TestCache {
 public:
  // A zeroed cache of `num_blocks` blocks. Aborts if memory is short.
  TestCache(const KvLayout& layout, int64_t num_blocks)
      : layout_(layout), num_blocks_(num_blocks) {
    const uint64_t bytes = layout.TensorBytes(num_blocks).value();
    for (int i = 0; i < layout.num_tensors(); ++i) {
      tensors_.push_back(AllocateHostBuffer(bytes).value());
      std::memset(tensors_.back().data(), 0, bytes);  // bytes > 0
    }
  }

  const KvLayout& layout() const { return layout_; }
  int64_t num_blocks() const { return num_blocks_; }
  int num_tensors() const { return static_cast<int>(tensors_.size()); }
  char* tensor(int i) const { return tensors_[i].data(); }
  size_t tensor_bytes() const { return tensors_[0].size(); }

  KvCacheView view() const {
    KvCacheView v;
    for (const HostBuffer& t : tensors_) v.tensors.push_back(t.data());
    v.num_blocks = num_blocks_;
    return v;
  }

  // The head_size elements of (layer, block, component, token, head).
  char* Row(int l, int64_t b, int c, int t, int h) const {
    const int64_t C = layout_.num_components(), N = num_blocks_;
    const int64_t L = layout_.num_layers(), T = layout_.block_size();
    const int64_t H = layout_.num_kv_heads();
    // Row-major index over the physical shape without head_size.
    std::vector<std::pair<int64_t, int64_t>> dims;  // (index, extent)
    int tensor = l;
    switch (layout_.layout()) {
      case KvCacheLayout::kFlashAttnNhd:  // [2, N, T, H, D]
        dims = {{c, C}, {b, N}, {t, T}, {h, H}};
        break;
      case KvCacheLayout::kFlashAttnHnd:  // [2, N, H, T, D]
        dims = {{c, C}, {b, N}, {h, H}, {t, T}};
        break;
      case KvCacheLayout::kFlashInferNhd:  // [N, 2, T, H, D]
        dims = {{b, N}, {c, C}, {t, T}, {h, H}};
        break;
      case KvCacheLayout::kFlashInferHnd:  // [N, 2, H, T, D]
        dims = {{b, N}, {c, C}, {h, H}, {t, T}};
        break;
      case KvCacheLayout::kMla:  // [N, T, D]
        dims = {{b, N}, {t, T}};
        break;
      case KvCacheLayout::kCrossLayerNhd:  // [N, L, C, T, H, D]
        tensor = 0;
        dims = {{b, N}, {l, L}, {c, C}, {t, T}, {h, H}};
        break;
      case KvCacheLayout::kCrossLayerHnd:  // [N, L, C, H, T, D]
        tensor = 0;
        dims = {{b, N}, {l, L}, {c, C}, {h, H}, {t, T}};
        break;
    }
    int64_t index = 0;
    for (const auto& [i, extent] : dims) index = index * extent + i;
    return tensors_[tensor].data() + index * layout_.row_bytes();
  }

  // Calls f(l, c, t, h, row) for every row of block `b` in layers
  // [range.begin, range.end), in canonical object order.
  template <typename F>
  void ForEachRow(int64_t b, LayerRange range, F f) const {
    for (int l = range.begin; l < range.end; ++l) {
      for (int c = 0; c < layout_.num_components(); ++c) {
        for (int t = 0; t < layout_.block_size(); ++t) {
          for (int h = 0; h < layout_.num_kv_heads(); ++h) {
            f(l, c, t, h, Row(l, b, c, t, h));
          }
        }
      }
    }
  }

  // The object bytes of layers `range` of block `b`, assembled row by row
  // from the reference addressing.
  std::string ExpectedObject(int64_t b, LayerRange range) const {
    std::string out;
    ForEachRow(b, range, [&](int, int, int, int, const char* row) {
      out.append(row, layout_.row_bytes());
    });
    return out;
  }
  std::string ExpectedObject(int64_t b) const {
    return ExpectedObject(b, layout_.AllLayers());
  }

  void FillRandom(std::mt19937_64& rng) {
    for (HostBuffer& t : tensors_) {
      for (size_t i = 0; i < t.size(); i += 8) {
        const uint64_t r = rng();
        std::memcpy(t.data() + i, &r, std::min<size_t>(8, t.size() - i));
      }
    }
  }

  // Every byte of every tensor, for before/after comparisons.
  std::string Snapshot() const {
    std::string s;
    for (const HostBuffer& t : tensors_) s.append(t.data(), t.size());
    return s;
  }

 private:
  KvLayout layout_;
  int64_t num_blocks_;
  std::vector<HostBuffer> tensors_;
};

// A staging-memory buffer of `bytes`, filled with `fill`.
inline HostBuffer FilledBuffer(size_t bytes, char fill) {
  HostBuffer b = AllocateHostBuffer(bytes).value();
  if (bytes > 0) std::memset(b.data(), fill, bytes);
  return b;
}

// Equal byte strings, or where they first differ.
inline ::testing::AssertionResult SameBytes(absl::string_view got,
                                     absl::string_view want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "size " << got.size() << ", expected " << want.size();
  }
  auto [g, w] = std::mismatch(got.begin(), got.end(), want.begin());
  if (g == got.end()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "first difference at byte " << (g - got.begin()) << " of "
         << got.size() << ": " << int{static_cast<uint8_t>(*g)} << " vs "
         << int{static_cast<uint8_t>(*w)};
}

}  // namespace kvdepot::gpu_testing

#endif  // KVDEPOT_GPU_INTERNAL_TEST_CACHE_H_
