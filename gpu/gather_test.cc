// Property tests of Gather/Scatter against the reference addressing of
// internal/test_cache.h. Written against gather.h only: gather_test runs them
// on the CPU twin, gather_cuda_test on the CUDA kernels (memory from
// AllocateHostBuffer is device-accessible there).
#include "gpu/gather.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "gpu/device_memory.h"
#include "gpu/internal/test_cache.h"
#include "gpu/kv_layout.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using gpu_testing::FilledBuffer;
using gpu_testing::kAllDtypes;
using gpu_testing::kAllLayouts;
using gpu_testing::SameBytes;
using gpu_testing::TestCache;
using ::kvdepot::testing::StatusIs;
using ::testing::HasSubstr;

absl::Status GatherSync(const KvLayout& layout, const KvCacheView& cache,
                        absl::Span<const int64_t> ids, LayerRange layers,
                        absl::Span<void* const> dst) {
  absl::Status s = Gather(layout, cache, ids, layers, dst, StreamRef{});
  if (!s.ok()) return s;
  return SynchronizeStream(StreamRef{});
}

absl::Status ScatterSync(const KvLayout& layout, const KvCacheView& cache,
                         absl::Span<const int64_t> ids, LayerRange layers,
                         absl::Span<const void* const> src) {
  absl::Status s = Scatter(layout, cache, ids, layers, src, StreamRef{});
  if (!s.ok()) return s;
  return SynchronizeStream(StreamRef{});
}


bool AllBytesAre(absl::string_view s, char c) {
  return std::all_of(s.begin(), s.end(), [c](char x) { return x == c; });
}

// A random layout of the given kind and dtype: small dimensions, with head
// sizes that make rows both 16-byte multiples and odd sizes.
KvLayout RandomLayout(KvCacheLayout kind, KvDtype dtype, std::mt19937_64& rng) {
  auto pick = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  constexpr int kHeadSizes[] = {1, 3, 8, 16, 24, 40, 64, 72, 128};
  const bool cross = kind == KvCacheLayout::kCrossLayerNhd ||
                     kind == KvCacheLayout::kCrossLayerHnd;
  const bool latent = kind == KvCacheLayout::kMla || (cross && pick(0, 1) == 0);
  KvLayoutSpec s;
  s.layout = kind;
  s.dtype = dtype;
  s.num_layers = pick(1, 5);
  s.num_components = latent ? 1 : 2;
  s.block_size = pick(1, 17);
  s.num_kv_heads = latent ? 1 : pick(1, 5);
  s.head_size = kHeadSizes[pick(0, std::size(kHeadSizes) - 1)];
  return KvLayout::Create(s).value();
}

// Objects in staging memory with `guard` bytes of 0x5A on each side (the
// object itself starts `shift` bytes into its guard), to catch overruns and
// to test unaligned pointers.
struct GuardedObjects {
  static constexpr size_t kGuard = 32;
  std::vector<HostBuffer> buffers;
  std::vector<void*> ptrs;
  size_t bytes = 0;

  GuardedObjects(size_t count, size_t object_bytes, std::mt19937_64* rng,
                 char fill = 0x5A)
      : bytes(object_bytes) {
    for (size_t i = 0; i < count; ++i) {
      buffers.push_back(FilledBuffer(object_bytes + 2 * kGuard, fill));
      // Half aligned (16 + 16), half at a random offset.
      const size_t shift =
          rng == nullptr || (*rng)() % 2 == 0 ? kGuard : 16 + (*rng)() % 16;
      ptrs.push_back(buffers.back().data() + shift);
    }
  }
  absl::string_view object(size_t i) const {
    return absl::string_view(static_cast<const char*>(ptrs[i]), bytes);
  }
  // True if every byte outside the objects still holds 0x5A.
  bool GuardsIntact() const {
    for (size_t i = 0; i < buffers.size(); ++i) {
      const char* base = buffers[i].data();
      const size_t shift = static_cast<const char*>(ptrs[i]) - base;
      if (!AllBytesAre(absl::string_view(base, shift), 0x5A) ||
          !AllBytesAre(absl::string_view(base + shift + bytes,
                                         buffers[i].size() - shift - bytes),
                       0x5A)) {
        return false;
      }
    }
    return true;
  }
  std::vector<const void*> const_ptrs() const {
    return std::vector<const void*>(ptrs.begin(), ptrs.end());
  }
};

class GatherPropertyTest
    : public ::testing::TestWithParam<std::tuple<KvCacheLayout, KvDtype>> {
 protected:
  // A deterministic generator per (layout, dtype, trial).
  std::mt19937_64 Rng(int trial) const {
    const auto [kind, dtype] = GetParam();
    return std::mt19937_64(static_cast<uint64_t>(kind) * 1000003 +
                           static_cast<uint64_t>(dtype) * 1009 + trial);
  }
  static constexpr int kTrials = 6;
};

TEST_P(GatherPropertyTest, GatherThenScatterRestoresExactlyTheGatheredBlocks) {
  const auto [kind, dtype] = GetParam();
  for (int trial = 0; trial < kTrials; ++trial) {
    std::mt19937_64 rng = Rng(trial);
    const KvLayout layout = RandomLayout(kind, dtype, rng);
    const int64_t num_blocks = 1 + rng() % 12;
    SCOPED_TRACE(absl::StrCat(layout.DebugString(), " blocks=", num_blocks,
                              " trial=", trial));
    TestCache cache(layout, num_blocks);
    cache.FillRandom(rng);
    const std::string before = cache.Snapshot();

    // Up to 2 x num_blocks ids: repeats are likely.
    std::vector<int64_t> ids(1 + rng() % (2 * num_blocks));
    for (int64_t& id : ids) id = static_cast<int64_t>(rng() % num_blocks);
    GuardedObjects objects(ids.size(), layout.object_bytes(), &rng);
    ASSERT_OK(GatherSync(layout, cache.view(), ids, layout.AllLayers(),
                         objects.ptrs));
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE(SameBytes(objects.object(i), cache.ExpectedObject(ids[i])))
          << "object " << i << " (block " << ids[i] << ")";
    }
    EXPECT_TRUE(objects.GuardsIntact());
    EXPECT_EQ(cache.Snapshot(), before) << "gather wrote to the cache";

    // Scatter each distinct block once into a zeroed cache.
    std::vector<int64_t> distinct;
    std::vector<const void*> sources;
    absl::flat_hash_set<int64_t> seen;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (seen.insert(ids[i]).second) {
        distinct.push_back(ids[i]);
        sources.push_back(objects.ptrs[i]);
      }
    }
    TestCache restored(layout, num_blocks);
    ASSERT_OK(ScatterSync(layout, restored.view(), distinct, layout.AllLayers(),
                          sources));
    const std::string zeros(layout.object_bytes(), '\0');
    for (int64_t b = 0; b < num_blocks; ++b) {
      // Rows cover every byte of the tensors, so this checks all of them.
      EXPECT_TRUE(SameBytes(restored.ExpectedObject(b),
                            seen.contains(b) ? cache.ExpectedObject(b) : zeros))
          << "block " << b << (seen.contains(b) ? " (scattered)" : "");
    }
  }
}

TEST_P(GatherPropertyTest, LayerRangesMoveOnlyTheirLayers) {
  const auto [kind, dtype] = GetParam();
  for (int trial = 0; trial < kTrials; ++trial) {
    std::mt19937_64 rng = Rng(100 + trial);
    const KvLayout layout = RandomLayout(kind, dtype, rng);
    const int64_t num_blocks = 1 + rng() % 8;
    const int first = static_cast<int>(rng() % layout.num_layers());
    const int end =
        first + 1 + static_cast<int>(rng() % (layout.num_layers() - first));
    const LayerRange range{first, end};
    SCOPED_TRACE(absl::StrCat(layout.DebugString(), " layers [", first, ", ",
                              end, ") trial=", trial));
    TestCache cache(layout, num_blocks);
    cache.FillRandom(rng);

    std::vector<int64_t> ids(num_blocks);
    for (int64_t b = 0; b < num_blocks; ++b) ids[b] = b;
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(1 + rng() % num_blocks);
    GuardedObjects slices(ids.size(), (end - first) * layout.layer_bytes(),
                          &rng);
    ASSERT_OK(GatherSync(layout, cache.view(), ids, range, slices.ptrs));
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE(
          SameBytes(slices.object(i), cache.ExpectedObject(ids[i], range)))
          << "slice " << i;
      // The slice is that part of the whole object.
      ASSERT_TRUE(
          SameBytes(slices.object(i),
                    absl::string_view(cache.ExpectedObject(ids[i]))
                        .substr(first * layout.layer_bytes(), slices.bytes)));
    }
    EXPECT_TRUE(slices.GuardsIntact());

    TestCache restored(layout, num_blocks);
    ASSERT_OK(
        ScatterSync(layout, restored.view(), ids, range, slices.const_ptrs()));
    const absl::flat_hash_set<int64_t> chosen(ids.begin(), ids.end());
    for (int64_t b = 0; b < num_blocks; ++b) {
      const std::string got = restored.ExpectedObject(b);
      const size_t lo = first * layout.layer_bytes();
      const size_t hi = end * layout.layer_bytes();
      EXPECT_TRUE(AllBytesAre(absl::string_view(got).substr(0, lo), '\0'))
          << "block " << b << ": a layer before the range was written";
      EXPECT_TRUE(AllBytesAre(absl::string_view(got).substr(hi), '\0'))
          << "block " << b << ": a layer after the range was written";
      const std::string want = chosen.contains(b)
                                   ? cache.ExpectedObject(b, range)
                                   : std::string(hi - lo, '\0');
      EXPECT_TRUE(SameBytes(absl::string_view(got).substr(lo, hi - lo), want))
          << "block " << b;
    }
  }
}

TEST_P(GatherPropertyTest, OutOfRangeIdsAreRejectedBeforeAnythingIsWritten) {
  const auto [kind, dtype] = GetParam();
  std::mt19937_64 rng = Rng(200);
  const KvLayout layout = RandomLayout(kind, dtype, rng);
  const int64_t num_blocks = 1 + rng() % 8;
  SCOPED_TRACE(layout.DebugString());
  TestCache cache(layout, num_blocks);
  cache.FillRandom(rng);
  const std::string before = cache.Snapshot();
  for (int64_t bad : {int64_t{-1}, num_blocks, num_blocks + 1000,
                      std::numeric_limits<int64_t>::min(),
                      std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(absl::StrCat("bad id ", bad));
    // Valid ids first: an implementation that copied while validating would
    // already have written them.
    const std::vector<int64_t> ids = {0, num_blocks - 1, bad};
    GuardedObjects dst(ids.size(), layout.object_bytes(), nullptr,
                       /*fill=*/static_cast<char>(0xAB));
    EXPECT_THAT(
        GatherSync(layout, cache.view(), ids, layout.AllLayers(), dst.ptrs),
        StatusIs(absl::StatusCode::kInvalidArgument));
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_TRUE(AllBytesAre(dst.object(i), static_cast<char>(0xAB)))
          << "destination " << i << " was written";
    }

    GuardedObjects src(ids.size(), layout.object_bytes(), nullptr,
                       /*fill=*/0x11);
    EXPECT_THAT(ScatterSync(layout, cache.view(), ids, layout.AllLayers(),
                            src.const_ptrs()),
                StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_EQ(cache.Snapshot(), before) << "scatter wrote to the cache";
  }
}

INSTANTIATE_TEST_SUITE_P(AllLayoutsAndDtypes, GatherPropertyTest,
                         ::testing::Combine(::testing::ValuesIn(kAllLayouts),
                                            ::testing::ValuesIn(kAllDtypes)),
                         [](const auto& param_info) {
                           std::string name = absl::StrCat(
                               KvCacheLayoutName(std::get<0>(param_info.param)),
                               "_", KvDtypeName(std::get<1>(param_info.param)));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Engines with different physical layouts but the same model shape hold the
// same logical tensors; their objects must be byte-identical (the canonical
// format, and why the fingerprint leaves the layout out).
void ExpectLayoutsAgree(const std::vector<KvLayoutSpec>& specs) {
  std::mt19937_64 rng(7);
  const int64_t num_blocks = 5;
  const KvLayout first = KvLayout::Create(specs[0]).value();
  // The logical content: one random row per (layer, block, component,
  // token, head).
  std::vector<std::string> logical;
  for (size_t i = 0; i < static_cast<size_t>(num_blocks) *
                             first.object_bytes() / first.row_bytes();
       ++i) {
    std::string row(first.row_bytes(), '\0');
    for (char& c : row) c = static_cast<char>(rng());
    logical.push_back(std::move(row));
  }
  const std::vector<int64_t> ids = {3, 0, 4, 3};
  std::vector<std::string> reference;  // objects of specs[0]
  for (const KvLayoutSpec& spec : specs) {
    const KvLayout layout = KvLayout::Create(spec).value();
    SCOPED_TRACE(layout.DebugString());
    EXPECT_EQ(layout.Fingerprint(), first.Fingerprint());
    TestCache cache(layout, num_blocks);
    size_t next = 0;
    for (int64_t b = 0; b < num_blocks; ++b) {
      cache.ForEachRow(b, layout.AllLayers(),
                       [&](int, int, int, int, char* row) {
                         const std::string& v = logical[next++];
                         std::copy(v.begin(), v.end(), row);
                       });
    }
    GuardedObjects objects(ids.size(), layout.object_bytes(), nullptr);
    ASSERT_OK(GatherSync(layout, cache.view(), ids, layout.AllLayers(),
                         objects.ptrs));
    for (size_t i = 0; i < ids.size(); ++i) {
      if (reference.size() < ids.size()) {
        reference.emplace_back(objects.object(i));
      } else {
        EXPECT_TRUE(SameBytes(objects.object(i), reference[i]))
            << "object " << i;
      }
    }
  }
}

TEST(GatherTest, PhysicalLayoutsOfOneModelGiveIdenticalObjects) {
  std::vector<KvLayoutSpec> mha;
  for (KvCacheLayout kind :
       {KvCacheLayout::kFlashAttnNhd, KvCacheLayout::kFlashAttnHnd,
        KvCacheLayout::kFlashInferNhd, KvCacheLayout::kFlashInferHnd,
        KvCacheLayout::kCrossLayerNhd, KvCacheLayout::kCrossLayerHnd}) {
    mha.push_back(
        KvLayout::Mha(kind, 3, 4, 3, 8, KvDtype::kBFloat16).value().spec());
  }
  ExpectLayoutsAgree(mha);

  std::vector<KvLayoutSpec> mla;
  for (KvCacheLayout kind : {KvCacheLayout::kMla, KvCacheLayout::kCrossLayerNhd,
                             KvCacheLayout::kCrossLayerHnd}) {
    mla.push_back(
        KvLayout::Mla(kind, 3, 4, 40, KvDtype::kFloat8E4M3).value().spec());
  }
  ExpectLayoutsAgree(mla);
}

TEST(GatherTest, HndObjectsAreTokenMajor) {
  // A hand-made case: 1 layer, 2 tokens, 2 heads, head_size 1, fp8. In the
  // HND cache K holds [h0t0, h0t1, h1t0, h1t1]; the object is token-major.
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashInferHnd, 1, 2, 2,
                                        1, KvDtype::kFloat8E4M3)
                              .value();
  TestCache cache(layout, 1);
  // [N=1, 2, H=2, T=2, D=1]: K then V, each head-major.
  const char physical[] = {1, 2, 3, 4, 5, 6, 7, 8};
  std::copy(std::begin(physical), std::end(physical), cache.tensor(0));
  GuardedObjects object(1, layout.object_bytes(), nullptr);
  const int64_t id = 0;
  ASSERT_OK(GatherSync(layout, cache.view(), absl::MakeConstSpan(&id, 1),
                       layout.AllLayers(), object.ptrs));
  // (t0,h0) (t0,h1) (t1,h0) (t1,h1) for K, then for V.
  EXPECT_EQ(object.object(0), absl::string_view("\1\3\2\4\5\7\6\10", 8));
}

TEST(GatherTest, ScatterRejectsRepeatedIdsWithoutWriting) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 2, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  TestCache cache(layout, 4);
  std::mt19937_64 rng(1);
  cache.FillRandom(rng);
  const std::string before = cache.Snapshot();
  const std::vector<int64_t> ids = {1, 2, 1};
  GuardedObjects src(ids.size(), layout.object_bytes(), nullptr, 0x22);
  EXPECT_THAT(ScatterSync(layout, cache.view(), ids, layout.AllLayers(),
                          src.const_ptrs()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(cache.Snapshot(), before);
}

TEST(GatherTest, RejectsMalformedCallsWithoutWriting) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnHnd, 3, 4, 2,
                                        16, KvDtype::kBFloat16)
                              .value();
  TestCache cache(layout, 4);
  const std::vector<int64_t> ids = {0, 3};
  GuardedObjects dst(ids.size(), layout.object_bytes(), nullptr,
                     static_cast<char>(0xAB));
  auto gather = [&](const KvCacheView& view, LayerRange range,
                    std::vector<void*> ptrs) {
    return GatherSync(layout, view, ids, range, ptrs);
  };
  const auto kInvalid = StatusIs(absl::StatusCode::kInvalidArgument);

  KvCacheView view = cache.view();
  view.tensors.pop_back();
  EXPECT_THAT(gather(view, layout.AllLayers(), dst.ptrs), kInvalid);
  view = cache.view();
  view.tensors.push_back(cache.tensor(0));
  EXPECT_THAT(gather(view, layout.AllLayers(), dst.ptrs), kInvalid);
  view = cache.view();
  view.tensors[1] = nullptr;
  EXPECT_THAT(gather(view, layout.AllLayers(), dst.ptrs), kInvalid);
  view = cache.view();
  view.num_blocks = 0;
  EXPECT_THAT(gather(view, layout.AllLayers(), dst.ptrs), kInvalid);

  for (LayerRange bad : {LayerRange{0, 0}, LayerRange{2, 1}, LayerRange{-1, 2},
                         LayerRange{1, 4}}) {
    EXPECT_THAT(gather(cache.view(), bad, dst.ptrs), kInvalid)
        << "[" << bad.begin << ", " << bad.end << ")";
  }
  EXPECT_THAT(gather(cache.view(), layout.AllLayers(), {dst.ptrs[0]}),
              kInvalid);
  EXPECT_THAT(gather(cache.view(), layout.AllLayers(), {dst.ptrs[0], nullptr}),
              kInvalid);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(AllBytesAre(dst.object(i), static_cast<char>(0xAB)));
  }
  EXPECT_THAT(gather(cache.view(), LayerRange{1, 4}, dst.ptrs).message(),
              HasSubstr("layer range [1, 4)"));
}

// Two destinations that share bytes would be written by two copies at once
// (torn objects on the device, the last writer on the CPU): refused, in
// both builds, with nothing written. Destinations that only touch are fine;
// the range checked is the layer range's, not the whole object's.
TEST(GatherTest, RejectsOverlappingDestinationsWithoutWriting) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnHnd, 3, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  TestCache cache(layout, 4);
  std::mt19937_64 rng(31);
  cache.FillRandom(rng);
  const size_t object = layout.object_bytes();
  const size_t layer = layout.layer_bytes();
  HostBuffer buffer = FilledBuffer(3 * object, static_cast<char>(0xAB));
  char* const base = buffer.data();
  const std::vector<int64_t> ids = {0, 1};
  const auto kInvalid = StatusIs(absl::StatusCode::kInvalidArgument);

  const absl::Status same =
      GatherSync(layout, cache.view(), ids, layout.AllLayers(), {base, base});
  EXPECT_THAT(same, kInvalid);
  EXPECT_THAT(same.message(),
              HasSubstr("object buffer 1 overlaps object buffer 0"));
  // One byte short of apart, in either order.
  EXPECT_THAT(GatherSync(layout, cache.view(), ids, layout.AllLayers(),
                         {base, base + object - 1}),
              kInvalid);
  EXPECT_THAT(GatherSync(layout, cache.view(), {0, 1, 2}, layout.AllLayers(),
                         {base + 2 * object, base + object - 1, base}),
              kInvalid);
  // A one-layer range: destinations one layer apart do not overlap, one
  // byte closer they do.
  EXPECT_THAT(GatherSync(layout, cache.view(), ids, LayerRange{1, 2},
                         {base + layer - 1, base}),
              kInvalid);
  EXPECT_TRUE(AllBytesAre(absl::string_view(base, buffer.size()),
                          static_cast<char>(0xAB)))
      << "a rejected gather wrote";

  ASSERT_OK(GatherSync(layout, cache.view(), ids, LayerRange{1, 2},
                       {base + layer, base}));
  EXPECT_TRUE(SameBytes(absl::string_view(base, layer),
                        cache.ExpectedObject(1, LayerRange{1, 2})));
  EXPECT_TRUE(SameBytes(absl::string_view(base + layer, layer),
                        cache.ExpectedObject(0, LayerRange{1, 2})));
}

// An object in a cache tensor's memory: a gather would write over the cache
// it reads, a scatter read the cache it writes. Refused with the cache
// unchanged, for any tensor of the view (not only the range's layers); an
// object right after a tensor's last byte is fine.
TEST(GatherTest, RejectsObjectsInsideTheCacheWithoutWriting) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashInferNhd, 3, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  constexpr int64_t kBlocks = 4;
  const size_t tensor = layout.TensorBytes(kBlocks).value();
  const size_t object = layout.object_bytes();
  // The three tensors back to back in one buffer, room for an object after.
  HostBuffer memory = FilledBuffer(3 * tensor + object, 0);
  std::mt19937_64 rng(32);
  for (size_t i = 0; i < 3 * tensor; ++i) {
    memory.data()[i] = static_cast<char>(rng());
  }
  KvCacheView view;
  view.num_blocks = kBlocks;
  for (int l = 0; l < 3; ++l)
    view.tensors.push_back(memory.data() + l * tensor);
  const std::string before(memory.data(), memory.size());
  GuardedObjects outside(1, object, nullptr, 0x11);
  const std::vector<int64_t> ids = {2, 0};
  const auto kInvalid = StatusIs(absl::StatusCode::kInvalidArgument);

  for (char* inside : {memory.data() + tensor + 100,    // in tensor 1
                       memory.data() + 3 * tensor - 1,  // tensor 2's last byte
                       memory.data() + 3 * tensor - object}) {
    const absl::Status gathered = GatherSync(
        layout, view, ids, LayerRange{0, 1}, {outside.ptrs[0], inside});
    EXPECT_THAT(gathered, kInvalid);
    EXPECT_THAT(gathered.message(),
                HasSubstr("object buffer 1 overlaps cache tensor"));
    EXPECT_THAT(ScatterSync(layout, view, ids, layout.AllLayers(),
                            {outside.ptrs[0], inside}),
                kInvalid);
  }
  EXPECT_TRUE(std::string(memory.data(), memory.size()) == before)
      << "a rejected call wrote";
  EXPECT_TRUE(AllBytesAre(outside.object(0), 0x11));

  // Just past the last tensor: apart.
  char* const after = memory.data() + 3 * tensor;
  ASSERT_OK(GatherSync(layout, view, {2}, layout.AllLayers(), {after}));
  TestCache reference(layout, kBlocks);
  for (int l = 0; l < 3; ++l) {
    std::memcpy(reference.tensor(l), view.tensors[l], tensor);
  }
  EXPECT_TRUE(
      SameBytes(absl::string_view(after, object), reference.ExpectedObject(2)));
}

// Sources are only read: one buffer may feed several blocks. And layers may
// share one cache tensor (KV sharing passes the same pointer for each).
TEST(GatherTest, AcceptsOverlappingSourcesAndSharedTensors) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 2, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  TestCache cache(layout, 4);
  std::mt19937_64 rng(33);
  GuardedObjects src(1, layout.object_bytes(), &rng);
  for (size_t i = 0; i < layout.object_bytes(); ++i) {
    static_cast<char*>(src.ptrs[0])[i] = static_cast<char>(rng());
  }
  const std::vector<int64_t> ids = {3, 1};
  ASSERT_OK(ScatterSync(layout, cache.view(), ids, layout.AllLayers(),
                        {src.ptrs[0], src.ptrs[0]}));
  for (int64_t id : ids) {
    EXPECT_TRUE(SameBytes(cache.ExpectedObject(id), src.object(0)))
        << "block " << id;
  }

  KvCacheView shared = cache.view();
  shared.tensors[1] = shared.tensors[0];
  GuardedObjects dst(1, layout.object_bytes(), &rng);
  const int64_t id = 3;
  ASSERT_OK(GatherSync(layout, shared, absl::MakeConstSpan(&id, 1),
                       layout.AllLayers(), dst.ptrs));
  // Both layers of the object are layer 0's bytes.
  const std::string layer0 = cache.ExpectedObject(id, LayerRange{0, 1});
  EXPECT_TRUE(SameBytes(dst.object(0), layer0 + layer0));
}

TEST(GatherTest, EmptyBlockListIsANoOp) {
  const KvLayout layout =
      KvLayout::Mla(KvCacheLayout::kMla, 2, 16, 576, KvDtype::kBFloat16)
          .value();
  TestCache cache(layout, 2);
  EXPECT_OK(GatherSync(layout, cache.view(), {}, layout.AllLayers(), {}));
  EXPECT_OK(ScatterSync(layout, cache.view(), {}, layout.AllLayers(), {}));
}

TEST(GatherTest, LargeCallsSpanSeveralKernelLaunches) {
  // More layers and blocks than one CUDA launch takes (64 x 192), in a
  // strided and a contiguous layout.
  for (KvCacheLayout kind :
       {KvCacheLayout::kFlashAttnHnd, KvCacheLayout::kCrossLayerNhd}) {
    const KvLayout layout =
        KvLayout::Mha(kind, 70, 2, 2, 8, KvDtype::kFloat16).value();
    SCOPED_TRACE(layout.DebugString());
    const int64_t num_blocks = 400;
    TestCache cache(layout, num_blocks);
    std::mt19937_64 rng(3);
    cache.FillRandom(rng);
    std::vector<int64_t> ids(300);
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int64_t>((i * 7) % num_blocks);
    }
    ids[299] = ids[0];  // and a repeat
    GuardedObjects objects(ids.size(), layout.object_bytes(), &rng);
    ASSERT_OK(GatherSync(layout, cache.view(), ids, layout.AllLayers(),
                         objects.ptrs));
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE(SameBytes(objects.object(i), cache.ExpectedObject(ids[i])))
          << "object " << i;
    }
    ids.pop_back();
    TestCache restored(layout, num_blocks);
    std::vector<const void*> src = objects.const_ptrs();
    src.pop_back();
    ASSERT_OK(
        ScatterSync(layout, restored.view(), ids, layout.AllLayers(), src));
    for (int64_t id : ids) {
      ASSERT_TRUE(
          SameBytes(restored.ExpectedObject(id), cache.ExpectedObject(id)))
          << "block " << id;
    }
  }
}

// A DeviceEvent recorded after a gather completes once the gather's bytes
// are there (in the CPU build, at once: its streams are synchronous).
TEST(GatherTest, AnEventRecordedAfterAGatherMarksItsEnd) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashInferHnd, 4, 16, 2,
                                        64, KvDtype::kBFloat16)
                              .value();
  TestCache cache(layout, 6);
  std::mt19937_64 rng(21);
  cache.FillRandom(rng);
  absl::StatusOr<DeviceEvent> event = DeviceEvent::Create();
  ASSERT_OK(event);
  absl::StatusOr<bool> complete = event->IsComplete();
  ASSERT_OK(complete);
  EXPECT_TRUE(*complete) << "an event never recorded is complete";
  const std::vector<int64_t> ids = {4, 1, 5};
  GuardedObjects objects(ids.size(), layout.object_bytes(), &rng);
  ASSERT_OK(Gather(layout, cache.view(), ids, layout.AllLayers(), objects.ptrs,
                   StreamRef{}));
  ASSERT_OK(event->Record(StreamRef{}));
  ASSERT_OK(event->Synchronize());
  complete = event->IsComplete();
  ASSERT_OK(complete);
  EXPECT_TRUE(*complete);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(SameBytes(objects.object(i), cache.ExpectedObject(ids[i])))
        << "object " << i;
  }
  // Moved, the event keeps working.
  DeviceEvent moved = std::move(*event);
  ASSERT_OK(moved.Record(StreamRef{}));
  EXPECT_OK(moved.Synchronize());
}

}  // namespace
}  // namespace kvdepot
