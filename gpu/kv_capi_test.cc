// Tests of the C ABI (kv_capi.h) through the shipped CPU library
// (libkvdepot_kv_cpu.so), called as a C caller would: plain structs,
// integer codes, caller-owned message buffers. The reference is
// Gather/Scatter of the CPU twin linked into this test directly.
#include "gpu/kv_capi.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/internal/test_cache.h"
#include "gpu/kv_layout.h"

extern "C" int kv_capi_test_c_gather(int32_t num_layers, int32_t block_size,
                                     int32_t num_kv_heads, int32_t head_size,
                                     void* const* tensors, int64_t num_blocks,
                                     const int64_t* block_ids,
                                     size_t num_block_ids,
                                     void* const* objects,
                                     uint64_t* object_bytes, char* err,
                                     size_t err_cap);

namespace kvdepot {
namespace {

using gpu_testing::kAllDtypes;
using gpu_testing::kAllLayouts;
using gpu_testing::TestCache;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int kInvalidArgument = KVDEPOT_KV_INVALID_ARGUMENT;

// A small layout of the given kind: 3 layers, 5 tokens, 3 heads (1 for the
// one-latent layouts), head size 24.
KvLayout SmallLayout(KvCacheLayout kind, KvDtype dtype) {
  KvLayoutSpec s;
  s.layout = kind;
  s.dtype = dtype;
  s.num_layers = 3;
  s.num_components = kind == KvCacheLayout::kMla ? 1 : 2;
  s.block_size = 5;
  s.num_kv_heads = kind == KvCacheLayout::kMla ? 1 : 3;
  s.head_size = 24;
  return KvLayout::Create(s).value();
}

kvdepot_kv_layout_spec CSpec(const KvLayout& layout) {
  kvdepot_kv_layout_spec s;
  s.layout = static_cast<int32_t>(layout.layout());
  s.dtype = static_cast<int32_t>(layout.dtype());
  s.num_layers = layout.num_layers();
  s.num_components = layout.num_components();
  s.block_size = layout.block_size();
  s.num_kv_heads = layout.num_kv_heads();
  s.head_size = layout.head_size();
  return s;
}

// What a call returned: its code and the message it wrote (through a
// 256-byte buffer, as a C caller would pass one).
struct Result {
  int code = -1;
  std::string message;
};
std::ostream& operator<<(std::ostream& os, const Result& r) {
  return os << "code " << r.code << " (" << kvdepot_kv_status_name(r.code)
            << "): \"" << r.message << "\"";
}

MATCHER_P(HasCode, code, "") { return arg.code == code; }
MATCHER(IsOk, "") { return arg.code == 0 && arg.message.empty(); }

// Objects of `bytes` each, filled with `fill`.
struct Objects {
  Objects(size_t count, size_t bytes, char fill)
      : storage(count, std::string(bytes, fill)) {
    for (std::string& s : storage) ptrs.push_back(s.data());
  }
  std::vector<std::string> storage;
  std::vector<void*> ptrs;
  std::vector<const void*> const_ptrs() const {
    return std::vector<const void*>(ptrs.begin(), ptrs.end());
  }
};

// The C ABI's calls on a TestCache, with the message captured.
class CCaller {
 public:
  CCaller(const KvLayout& layout, const TestCache& cache)
      : spec_(CSpec(layout)), num_blocks_(cache.num_blocks()) {
    for (int i = 0; i < cache.num_tensors(); ++i) {
      tensors_.push_back(cache.tensor(i));
    }
  }

  kvdepot_kv_layout_spec& spec() { return spec_; }
  std::vector<void*>& tensors() { return tensors_; }
  int64_t& num_blocks() { return num_blocks_; }

  Result Gather(const std::vector<int64_t>& ids, LayerRange layers,
                const std::vector<void*>& objects) {
    Result r;
    char err[256];
    std::memset(err, 'X', sizeof(err));
    r.code = kvdepot_kv_gather(&spec_, tensors_.data(), tensors_.size(),
                               num_blocks_, ids.data(), ids.size(),
                               layers.begin, layers.end, objects.data(),
                               /*stream=*/nullptr, err, sizeof(err));
    r.message = err;
    return r;
  }

  Result Scatter(const std::vector<int64_t>& ids, LayerRange layers,
                 const std::vector<const void*>& objects) {
    Result r;
    char err[256];
    std::memset(err, 'X', sizeof(err));
    r.code = kvdepot_kv_scatter(&spec_, tensors_.data(), tensors_.size(),
                                num_blocks_, ids.data(), ids.size(),
                                layers.begin, layers.end, objects.data(),
                                /*stream=*/nullptr, err, sizeof(err));
    r.message = err;
    return r;
  }

 private:
  kvdepot_kv_layout_spec spec_;
  std::vector<void*> tensors_;
  int64_t num_blocks_;
};

TEST(KvCapiTest, ReportsItsBackendVersionAndStatusNames) {
  EXPECT_STREQ(kvdepot_kv_backend(), "cpu");
  EXPECT_EQ(kvdepot_kv_abi_version(), KVDEPOT_KV_ABI_VERSION);
  for (int code = 0; code <= 16; ++code) {
    EXPECT_EQ(kvdepot_kv_status_name(code),
              absl::StatusCodeToString(static_cast<absl::StatusCode>(code)))
        << code;
  }
  EXPECT_STREQ(kvdepot_kv_status_name(17), "");
  EXPECT_STREQ(kvdepot_kv_status_name(-1), "");
}

TEST(KvCapiTest, DescribesEveryLayoutAsKvLayoutDoes) {
  for (KvCacheLayout kind : kAllLayouts) {
    for (KvDtype dtype : kAllDtypes) {
      const KvLayout layout = SmallLayout(kind, dtype);
      SCOPED_TRACE(layout.DebugString());
      const kvdepot_kv_layout_spec spec = CSpec(layout);
      kvdepot_kv_layout_info info;
      std::memset(&info, 0xFF, sizeof(info));
      char err[64];
      ASSERT_EQ(kvdepot_kv_layout_describe(&spec, &info, err, sizeof(err)), 0)
          << err;
      EXPECT_STREQ(err, "");
      EXPECT_EQ(info.num_tensors, layout.num_tensors());
      EXPECT_EQ(info.element_bytes, static_cast<int32_t>(layout.element_bytes()));
      EXPECT_EQ(info.layer_bytes, layout.layer_bytes());
      EXPECT_EQ(info.object_bytes, layout.object_bytes());
      EXPECT_EQ(info.tensor_bytes_per_block, layout.TensorBytes(1).value());
      EXPECT_EQ(7 * info.tensor_bytes_per_block, layout.TensorBytes(7).value());
    }
  }
}

class KvCapiLayoutTest
    : public ::testing::TestWithParam<std::tuple<KvCacheLayout, KvDtype>> {};

// Gather through the C ABI gives the same bytes as Gather itself, for
// whole objects (ids repeat) and a layer range; scatter through it changes
// exactly the cache bytes Scatter changes.
TEST_P(KvCapiLayoutTest, GatherAndScatterMatchTheCppCalls) {
  const auto [kind, dtype] = GetParam();
  const KvLayout layout = SmallLayout(kind, dtype);
  std::mt19937_64 rng(static_cast<uint64_t>(kind) * 10 +
                      static_cast<uint64_t>(dtype));
  constexpr int64_t kBlocks = 9;
  TestCache cache(layout, kBlocks);
  cache.FillRandom(rng);
  CCaller c(layout, cache);

  for (LayerRange layers : {layout.AllLayers(), LayerRange{1, 3},
                            LayerRange{2, 3}}) {
    SCOPED_TRACE(::testing::Message()
                 << "layers [" << layers.begin << ", " << layers.end << ")");
    const size_t bytes = (layers.end - layers.begin) * layout.layer_bytes();
    const std::vector<int64_t> ids = {8, 0, 3, 3, 5, 8, 1};
    Objects got(ids.size(), bytes, 'g');
    Objects want(ids.size(), bytes, 'w');
    ASSERT_THAT(c.Gather(ids, layers, got.ptrs), IsOk());
    ASSERT_TRUE(
        Gather(layout, cache.view(), ids, layers, want.ptrs, StreamRef{}).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(got.storage[i], want.storage[i]) << "object " << i;
      // And both are the reference bytes (so neither is all 'g' or 'w').
      EXPECT_EQ(got.storage[i], cache.ExpectedObject(ids[i], layers));
    }

    // Scatter distinct blocks' objects into zeroed caches, one through the C
    // ABI and one through Scatter, then compare every byte.
    const std::vector<int64_t> to = {4, 0, 7};
    const std::vector<const void*> src = {got.ptrs[0], got.ptrs[2],
                                          got.ptrs[4]};
    TestCache c_cache(layout, kBlocks);
    TestCache cpp_cache(layout, kBlocks);
    CCaller into(layout, c_cache);
    ASSERT_THAT(into.Scatter(to, layers, src), IsOk());
    ASSERT_TRUE(
        Scatter(layout, cpp_cache.view(), to, layers, src, StreamRef{}).ok());
    EXPECT_EQ(c_cache.Snapshot(), cpp_cache.Snapshot());
    EXPECT_EQ(c_cache.ExpectedObject(4, layers), got.storage[0]);
    EXPECT_EQ(c_cache.ExpectedObject(7, layers), got.storage[4]);
    EXPECT_EQ(c_cache.ExpectedObject(2, layers),
              std::string(bytes, '\0'));  // untouched
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllLayoutsAndDtypes, KvCapiLayoutTest,
    ::testing::Combine(::testing::ValuesIn(kAllLayouts),
                       ::testing::ValuesIn(kAllDtypes)),
    [](const auto& param_info) {
      std::string name =
          absl::StrCat(KvCacheLayoutName(std::get<0>(param_info.param)), "_",
                       KvDtypeName(std::get<1>(param_info.param)));
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

TEST(KvCapiTest, PlainCCallerGathersWholeObjects) {
  const KvLayout layout =
      KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 2, 4, 2, 8, KvDtype::kFloat16)
          .value();
  std::mt19937_64 rng(7);
  TestCache cache(layout, 5);
  cache.FillRandom(rng);
  std::vector<void*> tensors = {cache.tensor(0), cache.tensor(1)};
  const std::vector<int64_t> ids = {4, 2};
  Objects objects(2, layout.object_bytes(), 'o');
  uint64_t object_bytes = 0;
  char err[128];
  ASSERT_EQ(kv_capi_test_c_gather(2, 4, 2, 8, tensors.data(), 5, ids.data(),
                                  ids.size(), objects.ptrs.data(),
                                  &object_bytes, err, sizeof(err)),
            0)
      << err;
  EXPECT_EQ(object_bytes, layout.object_bytes());
  EXPECT_EQ(objects.storage[0], cache.ExpectedObject(4));
  EXPECT_EQ(objects.storage[1], cache.ExpectedObject(2));
}

// Every rejected call leaves the objects and the cache as they were.
class KvCapiErrorTest : public ::testing::Test {
 protected:
  KvCapiErrorTest()
      : layout_(SmallLayout(KvCacheLayout::kFlashAttnHnd, KvDtype::kBFloat16)),
        cache_(layout_, 6),
        objects_(3, layout_.object_bytes(), 'o') {
    std::mt19937_64 rng(3);
    cache_.FillRandom(rng);
    before_ = cache_.Snapshot();
  }

  // Expects INVALID_ARGUMENT with `substr` from both a gather and a scatter
  // made by `c`, and that neither wrote anything.
  void ExpectBothRejected(CCaller& c, const std::vector<int64_t>& ids,
                          LayerRange layers, absl::string_view substr) {
    const Result g = c.Gather(ids, layers, objects_.ptrs);
    EXPECT_THAT(g, HasCode(kInvalidArgument)) << g;
    EXPECT_THAT(g.message, HasSubstr(std::string(substr)));
    const Result s = c.Scatter(ids, layers, objects_.const_ptrs());
    EXPECT_THAT(s, HasCode(kInvalidArgument)) << s;
    EXPECT_THAT(s.message, HasSubstr(std::string(substr)));
    ExpectNothingWritten();
  }

  void ExpectNothingWritten() {
    for (const std::string& o : objects_.storage) {
      EXPECT_EQ(o, std::string(layout_.object_bytes(), 'o'));
    }
    EXPECT_TRUE(cache_.Snapshot() == before_) << "the cache changed";
  }

  const std::vector<int64_t> ids_ = {0, 5, 2};
  KvLayout layout_;
  TestCache cache_;
  Objects objects_;
  std::string before_;
};

TEST_F(KvCapiErrorTest, TheCallsSucceedBeforeAnythingIsBroken) {
  // The baseline the other cases break one argument of.
  CCaller c(layout_, cache_);
  EXPECT_THAT(c.Gather(ids_, layout_.AllLayers(), objects_.ptrs), IsOk());
  EXPECT_EQ(objects_.storage[1], cache_.ExpectedObject(5));
}

TEST_F(KvCapiErrorTest, OutOfRangeBlockIdsWriteNothing) {
  for (int64_t bad : {int64_t{6}, int64_t{-1}, INT64_MAX}) {
    CCaller c(layout_, cache_);
    ExpectBothRejected(c, {0, bad, 2}, layout_.AllLayers(), "block");
  }
}

TEST_F(KvCapiErrorTest, ScatterRejectsRepeatedIdsGatherAllowsThem) {
  CCaller c(layout_, cache_);
  const std::vector<int64_t> ids = {1, 4, 1};
  const Result s = c.Scatter(ids, layout_.AllLayers(), objects_.const_ptrs());
  EXPECT_THAT(s, HasCode(kInvalidArgument)) << s;
  EXPECT_THAT(s.message, HasSubstr("more than once"));
  ExpectNothingWritten();
  EXPECT_THAT(c.Gather(ids, layout_.AllLayers(), objects_.ptrs), IsOk());
  EXPECT_EQ(objects_.storage[0], objects_.storage[2]);
  EXPECT_EQ(objects_.storage[0], cache_.ExpectedObject(1));
}

// A gather into one buffer for two ids would tear the objects on a device:
// refused. Scatter sources are only read and may be shared.
TEST_F(KvCapiErrorTest, GatherRejectsOverlappingObjectsScatterAllowsThem) {
  CCaller c(layout_, cache_);
  void* const one = objects_.ptrs[0];
  const Result g = c.Gather({0, 1}, layout_.AllLayers(), {one, one});
  EXPECT_THAT(g, HasCode(kInvalidArgument)) << g;
  EXPECT_THAT(g.message, HasSubstr("object buffer 1 overlaps object buffer 0"));
  ExpectNothingWritten();

  EXPECT_THAT(c.Scatter({3, 4}, layout_.AllLayers(), {one, one}), IsOk());
  EXPECT_EQ(cache_.ExpectedObject(3), objects_.storage[0]);
  EXPECT_EQ(cache_.ExpectedObject(4), objects_.storage[0]);
}

// An object in a cache tensor's memory: refused for both directions, with
// nothing written, whichever tensor it is in.
TEST_F(KvCapiErrorTest, ObjectsInsideACacheTensorWriteNothing) {
  for (int t = 0; t < cache_.num_tensors(); ++t) {
    CCaller c(layout_, cache_);
    void* const inside = cache_.tensor(t) + layout_.layer_bytes();
    const std::vector<void*> objects = {objects_.ptrs[0], inside};
    const Result g = c.Gather({0, 5}, LayerRange{0, 1}, objects);
    EXPECT_THAT(g, HasCode(kInvalidArgument)) << g;
    EXPECT_THAT(g.message,
                HasSubstr(absl::StrCat("overlaps cache tensor ", t)));
    const Result s =
        c.Scatter({0, 5}, LayerRange{0, 1}, {objects_.ptrs[0], inside});
    EXPECT_THAT(s, HasCode(kInvalidArgument)) << s;
    EXPECT_THAT(s.message,
                HasSubstr(absl::StrCat("overlaps cache tensor ", t)));
  }
  ExpectNothingWritten();
}

TEST_F(KvCapiErrorTest, BadEnumValuesAreInvalidArguments) {
  // 257 and 258 would wrap onto valid 8-bit values (1, 2) if cast blindly.
  for (int32_t bad : {0, 8, 257, -1, INT32_MAX}) {
    CCaller c(layout_, cache_);
    c.spec().layout = bad;
    ExpectBothRejected(c, ids_, layout_.AllLayers(), "layout");
  }
  for (int32_t bad : {0, 5, 258, -2}) {
    CCaller c(layout_, cache_);
    c.spec().dtype = bad;
    ExpectBothRejected(c, ids_, layout_.AllLayers(), "dtype");
  }
}

TEST_F(KvCapiErrorTest, BadSpecsAndCountsAreInvalidArguments) {
  {
    CCaller c(layout_, cache_);
    c.spec().num_components = 1;  // FlashAttention needs K and V
    ExpectBothRejected(c, ids_, layout_.AllLayers(), "component");
  }
  {
    CCaller c(layout_, cache_);
    c.spec().head_size = 0;
    ExpectBothRejected(c, ids_, layout_.AllLayers(), "head_size");
  }
  {
    CCaller c(layout_, cache_);
    c.tensors().pop_back();  // 2 tensors for 3 layers
    ExpectBothRejected(c, ids_, layout_.AllLayers(), "cache tensors, got 2");
  }
  {
    CCaller c(layout_, cache_);
    c.num_blocks() = 0;
    ExpectBothRejected(c, {}, layout_.AllLayers(), "block");
  }
  for (LayerRange bad : {LayerRange{0, 0}, LayerRange{-1, 2}, LayerRange{0, 4},
                         LayerRange{2, 1}}) {
    CCaller c(layout_, cache_);
    ExpectBothRejected(c, ids_, bad, "layer");
  }
}

TEST_F(KvCapiErrorTest, NullPointersAreInvalidArguments) {
  const kvdepot_kv_layout_spec spec = CSpec(layout_);
  std::vector<void*> tensors;
  for (int i = 0; i < cache_.num_tensors(); ++i) {
    tensors.push_back(cache_.tensor(i));
  }
  char err[256];
  auto check = [&](int code, absl::string_view substr) {
    EXPECT_EQ(code, kInvalidArgument) << err;
    EXPECT_THAT(err, HasSubstr(std::string(substr)));
  };
  const size_t n = ids_.size();
  const int32_t L = layout_.num_layers();
  check(kvdepot_kv_gather(nullptr, tensors.data(), 3, 6, ids_.data(), n, 0, L,
                          objects_.ptrs.data(), nullptr, err, sizeof(err)),
        "spec is null");
  check(kvdepot_kv_gather(&spec, nullptr, 3, 6, ids_.data(), n, 0, L,
                          objects_.ptrs.data(), nullptr, err, sizeof(err)),
        "tensor array is null");
  check(kvdepot_kv_gather(&spec, tensors.data(), 3, 6, nullptr, n, 0, L,
                          objects_.ptrs.data(), nullptr, err, sizeof(err)),
        "block id array is null");
  check(kvdepot_kv_gather(&spec, tensors.data(), 3, 6, ids_.data(), n, 0, L,
                          nullptr, nullptr, err, sizeof(err)),
        "object array is null");
  check(kvdepot_kv_scatter(&spec, tensors.data(), 3, 6, ids_.data(), n, 0, L,
                           nullptr, nullptr, err, sizeof(err)),
        "object array is null");
  tensors[1] = nullptr;
  check(kvdepot_kv_scatter(&spec, tensors.data(), 3, 6, ids_.data(), n, 0, L,
                           objects_.const_ptrs().data(), nullptr, err,
                           sizeof(err)),
        "cache tensor 1 is null");
  tensors[1] = cache_.tensor(1);
  objects_.ptrs[2] = nullptr;
  check(kvdepot_kv_gather(&spec, tensors.data(), 3, 6, ids_.data(), n, 0, L,
                          objects_.ptrs.data(), nullptr, err, sizeof(err)),
        "object buffer 2 is null");
  objects_.ptrs[2] = objects_.storage[2].data();
  ExpectNothingWritten();

  kvdepot_kv_layout_info info;
  check(kvdepot_kv_layout_describe(nullptr, &info, err, sizeof(err)),
        "spec is null");
  check(kvdepot_kv_layout_describe(&spec, nullptr, err, sizeof(err)),
        "info pointer is null");
  check(kvdepot_kv_current_device(nullptr, err, sizeof(err)),
        "device pointer is null");

  // No ids: nothing to do, and the arrays may be null then.
  EXPECT_EQ(kvdepot_kv_gather(&spec, tensors.data(), 3, 6, nullptr, 0, 0, L,
                              nullptr, nullptr, err, sizeof(err)),
            0)
      << err;
  EXPECT_EQ(kvdepot_kv_scatter(&spec, tensors.data(), 3, 6, nullptr, 0, 0, L,
                               nullptr, nullptr, err, sizeof(err)),
            0)
      << err;
}

TEST_F(KvCapiErrorTest, MessagesAreTruncatedToTheCapacity) {
  const kvdepot_kv_layout_spec spec = CSpec(layout_);
  const std::vector<int64_t> bad = {0, 99, 2};
  std::vector<void*> tensors;
  for (int i = 0; i < cache_.num_tensors(); ++i) {
    tensors.push_back(cache_.tensor(i));
  }
  auto gather = [&](char* err, size_t cap) {
    return kvdepot_kv_gather(&spec, tensors.data(), tensors.size(), 6,
                             bad.data(), bad.size(), 0, 3,
                             objects_.ptrs.data(), nullptr, err, cap);
  };
  // The whole message, as Gather's status has it.
  const absl::Status want = Gather(layout_, cache_.view(), bad,
                                   layout_.AllLayers(), objects_.ptrs,
                                   StreamRef{});
  ASSERT_EQ(want.code(), absl::StatusCode::kInvalidArgument);
  const std::string full(want.message());
  ASSERT_GT(full.size(), 8u);
  char err[512];
  ASSERT_EQ(gather(err, sizeof(err)), kInvalidArgument);
  EXPECT_EQ(std::string(err), full);

  for (size_t cap : {size_t{0}, size_t{1}, size_t{2}, size_t{8},
                     full.size(), full.size() + 1}) {
    SCOPED_TRACE(::testing::Message() << "err_cap " << cap);
    std::memset(err, '#', sizeof(err));
    EXPECT_EQ(gather(err, cap), kInvalidArgument);
    if (cap == 0) {
      EXPECT_EQ(err[0], '#');  // nothing written
      continue;
    }
    const size_t n = std::min(cap - 1, full.size());
    EXPECT_EQ(std::string(err, n), full.substr(0, n));
    EXPECT_EQ(err[n], '\0');
    EXPECT_EQ(err[n + 1], '#');  // nothing past the capacity
  }
  // A null buffer with no capacity is allowed.
  EXPECT_EQ(gather(nullptr, 0), kInvalidArgument);
  // Success clears the message.
  std::memset(err, '#', sizeof(err));
  EXPECT_EQ(kvdepot_kv_gather(&spec, tensors.data(), tensors.size(), 6,
                              ids_.data(), ids_.size(), 0, 3,
                              objects_.ptrs.data(), nullptr, err, sizeof(err)),
            0);
  EXPECT_EQ(err[0], '\0');
  EXPECT_EQ(err[1], '#');
}

TEST(KvCapiDeviceTest, TheCpuLibraryHasDeviceZeroAndSynchronousStreams) {
  char err[128];
  int32_t device = -1;
  EXPECT_EQ(kvdepot_kv_current_device(&device, err, sizeof(err)), 0) << err;
  EXPECT_EQ(device, 0);
  EXPECT_EQ(kvdepot_kv_synchronize(nullptr, err, sizeof(err)), 0) << err;
  // The CPU library ignores the stream, whatever it is.
  int not_a_stream = 0;
  EXPECT_EQ(kvdepot_kv_synchronize(&not_a_stream, err, sizeof(err)), 0) << err;
}

TEST(KvCapiDeviceTest, RegisterHostChecksArgumentsAndOtherwiseSucceeds) {
  std::vector<char> buffer(4096);
  char err[128];
  EXPECT_EQ(kvdepot_kv_register_host(buffer.data(), buffer.size(), err,
                                     sizeof(err)),
            0)
      << err;
  EXPECT_STREQ(err, "");
  EXPECT_EQ(kvdepot_kv_unregister_host(buffer.data(), err, sizeof(err)), 0)
      << err;
  EXPECT_EQ(kvdepot_kv_register_host(nullptr, 64, err, sizeof(err)),
            kInvalidArgument);
  EXPECT_THAT(err, HasSubstr("null"));
  EXPECT_EQ(kvdepot_kv_register_host(buffer.data(), 0, err, sizeof(err)),
            kInvalidArgument);
  EXPECT_THAT(err, HasSubstr("0 bytes"));
  EXPECT_EQ(kvdepot_kv_unregister_host(nullptr, err, sizeof(err)),
            kInvalidArgument);
  EXPECT_THAT(err, StartsWith("cannot unregister"));
}

}  // namespace
}  // namespace kvdepot
