#include "gpu/kv_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;
using ::testing::HasSubstr;

// Llama-3-8B per tensor-parallel rank of 1: 32 layers, 8 KV heads of 128.
KvLayoutSpec Llama8b() {
  KvLayoutSpec s;
  s.layout = KvCacheLayout::kFlashAttnNhd;
  s.num_layers = 32;
  s.num_components = 2;
  s.block_size = 16;
  s.num_kv_heads = 8;
  s.head_size = 128;
  s.dtype = KvDtype::kBFloat16;
  return s;
}

MATCHER_P(InvalidWith, text, "") {
  *result_listener << "whose status is " << arg.status();
  return arg.status().code() == absl::StatusCode::kInvalidArgument &&
         arg.status().message().find(text) != absl::string_view::npos;
}

TEST(KvLayoutTest, SizesOfALlamaBlock) {
  const KvLayout l = KvLayout::Create(Llama8b()).value();
  EXPECT_EQ(l.element_bytes(), 2u);
  EXPECT_EQ(l.row_bytes(), 256u);
  EXPECT_EQ(l.chunk_bytes(), 16u * 8 * 256);
  EXPECT_EQ(l.layer_bytes(), 2u * 16 * 8 * 256);
  EXPECT_EQ(l.object_bytes(), 2u << 20);  // 2 MiB per 16-token block
  EXPECT_EQ(l.num_tensors(), 32);
  EXPECT_EQ(l.TensorBytes(1000).value(), 1000u * 2 * 16 * 8 * 256);
}

TEST(KvLayoutTest, SizesOfMlaAndCrossLayer) {
  const KvLayout mla =
      KvLayout::Mla(KvCacheLayout::kMla, 61, 64, 576, KvDtype::kFloat8E4M3)
          .value();
  EXPECT_EQ(mla.num_components(), 1);
  EXPECT_EQ(mla.num_kv_heads(), 1);
  EXPECT_EQ(mla.object_bytes(), 61u * 64 * 576);
  EXPECT_EQ(mla.TensorBytes(10).value(), 10u * 64 * 576);

  KvLayoutSpec s = Llama8b();
  s.layout = KvCacheLayout::kCrossLayerNhd;
  const KvLayout cross = KvLayout::Create(s).value();
  EXPECT_TRUE(cross.cross_layer());
  EXPECT_EQ(cross.num_tensors(), 1);
  EXPECT_EQ(cross.TensorBytes(3).value(), 3 * cross.object_bytes());
}

TEST(KvLayoutTest, DtypeSizes) {
  EXPECT_EQ(KvDtypeBytes(KvDtype::kFloat16), 2u);
  EXPECT_EQ(KvDtypeBytes(KvDtype::kBFloat16), 2u);
  EXPECT_EQ(KvDtypeBytes(KvDtype::kFloat8E4M3), 1u);
  EXPECT_EQ(KvDtypeBytes(KvDtype::kFloat32), 4u);
  EXPECT_EQ(KvDtypeBytes(static_cast<KvDtype>(0)), 0u);
}

TEST(KvLayoutTest, RejectsZeroAndNegativeDimensions) {
  for (const char* field :
       {"num_layers", "block_size", "num_kv_heads", "head_size"}) {
    for (int bad : {0, -3}) {
      KvLayoutSpec s = Llama8b();
      const std::string f = field;
      (f == "num_layers"     ? s.num_layers
       : f == "block_size"   ? s.block_size
       : f == "num_kv_heads" ? s.num_kv_heads
                             : s.head_size) = bad;
      EXPECT_THAT(KvLayout::Create(s), InvalidWith(field)) << field << bad;
    }
  }
}

TEST(KvLayoutTest, RejectsUnsupportedCombinations) {
  KvLayoutSpec s = Llama8b();
  s.num_components = 3;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("num_components"));

  s = Llama8b();
  s.num_components = 1;  // FlashAttention always holds K and V
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("flash-attn-nhd"));
  s.layout = KvCacheLayout::kFlashInferHnd;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("flashinfer-hnd"));

  s = Llama8b();
  s.layout = KvCacheLayout::kMla;  // MLA with K and V
  s.num_kv_heads = 1;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("mla layout"));

  s.num_components = 1;  // a latent with several heads
  s.num_kv_heads = 8;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("num_kv_heads 1"));
  s.layout = KvCacheLayout::kCrossLayerNhd;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("num_kv_heads 1"));

  s = Llama8b();
  s.dtype = static_cast<KvDtype>(9);
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("dtype"));
  s = Llama8b();
  s.layout = static_cast<KvCacheLayout>(0);
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("layout"));
}

TEST(KvLayoutTest, RejectsSizesThatOverflow) {
  KvLayoutSpec s = Llama8b();
  s.block_size = 1 << 20;
  s.num_kv_heads = 1 << 12;
  s.head_size = 1 << 12;  // 2^44 elements in one chunk
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("exceeds"));
  s.block_size = 2147483647;
  s.num_kv_heads = 2147483647;
  s.head_size = 2147483647;  // overflows 64 bits on the way
  s.dtype = KvDtype::kFloat32;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("exceeds"));

  s = Llama8b();
  s.num_layers = KvLayout::kMaxLayers + 1;
  EXPECT_THAT(KvLayout::Create(s), InvalidWith("num_layers"));

  const KvLayout l = KvLayout::Create(Llama8b()).value();
  EXPECT_THAT(l.TensorBytes(0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(l.TensorBytes(int64_t{1} << 50), InvalidWith("overflows"));
}

TEST(KvLayoutTest, FingerprintIsStable) {
  // Golden values: a change here changes every namespace and orphans every
  // stored block. Bump kObjectFormatVersion only when the object bytes
  // change.
  const KvLayout l = KvLayout::Create(Llama8b()).value();
  EXPECT_EQ(l.ObjectFormat(),
            "kvdepot-kv-object/v1 layers=32 components=2 block=16 heads=8 "
            "head_size=128 dtype=bf16");
  EXPECT_EQ(l.Fingerprint(), 0xb5631847c46f4926u);
  EXPECT_EQ(l.NamespaceFor("llama3-8b/tp0of1").value(),
            "llama3-8b/tp0of1/b5631847c46f4926");
  const KvLayout mla =
      KvLayout::Mla(KvCacheLayout::kMla, 61, 64, 576, KvDtype::kFloat8E4M3)
          .value();
  EXPECT_EQ(mla.Fingerprint(), 0x207ef77c8c11c5dau);
}

TEST(KvLayoutTest, FingerprintDiffersWhenAnyByteDeterminingFieldDiffers) {
  // Cross-layer accepts both component counts, so every field can vary.
  KvLayoutSpec base;
  base.layout = KvCacheLayout::kCrossLayerNhd;
  base.num_layers = 4;
  base.num_components = 1;
  base.block_size = 16;
  base.num_kv_heads = 1;
  base.head_size = 64;
  base.dtype = KvDtype::kFloat16;
  std::vector<KvLayoutSpec> variants = {base};
  auto vary = [&](auto change) {
    KvLayoutSpec s = base;
    change(s);
    variants.push_back(s);
  };
  vary([](KvLayoutSpec& s) { s.num_layers = 5; });
  vary([](KvLayoutSpec& s) { s.num_components = 2; });
  vary([](KvLayoutSpec& s) {
    s.num_components = 2;
    s.num_kv_heads = 2;
  });
  vary([](KvLayoutSpec& s) { s.block_size = 32; });
  vary([](KvLayoutSpec& s) { s.head_size = 128; });
  vary([](KvLayoutSpec& s) { s.dtype = KvDtype::kBFloat16; });
  vary([](KvLayoutSpec& s) { s.dtype = KvDtype::kFloat8E4M3; });
  vary([](KvLayoutSpec& s) { s.dtype = KvDtype::kFloat32; });
  // Same byte count as the base, different shape.
  vary([](KvLayoutSpec& s) {
    s.block_size = 32;
    s.head_size = 32;
  });
  absl::flat_hash_set<uint64_t> fingerprints;
  for (const KvLayoutSpec& s : variants) {
    const KvLayout l = KvLayout::Create(s).value();
    EXPECT_TRUE(fingerprints.insert(l.Fingerprint()).second)
        << l.DebugString() << " collides";
  }
}

TEST(KvLayoutTest, PhysicalLayoutIsNotPartOfTheFingerprint) {
  // Objects are canonical, so NHD, HND, FlashInfer and cross-layer engines
  // of one model share blocks.
  const uint64_t nhd = KvLayout::Create(Llama8b()).value().Fingerprint();
  for (KvCacheLayout kind :
       {KvCacheLayout::kFlashAttnHnd, KvCacheLayout::kFlashInferNhd,
        KvCacheLayout::kFlashInferHnd, KvCacheLayout::kCrossLayerNhd,
        KvCacheLayout::kCrossLayerHnd}) {
    KvLayoutSpec s = Llama8b();
    s.layout = kind;
    EXPECT_EQ(KvLayout::Create(s).value().Fingerprint(), nhd)
        << KvCacheLayoutName(kind);
  }
  EXPECT_EQ(KvLayout::Mla(KvCacheLayout::kMla, 2, 16, 576, KvDtype::kBFloat16)
                .value()
                .Fingerprint(),
            KvLayout::Mla(KvCacheLayout::kCrossLayerHnd, 2, 16, 576,
                          KvDtype::kBFloat16)
                .value()
                .Fingerprint());
}

TEST(KvLayoutTest, NamespaceForValidatesTheModelName) {
  const KvLayout l = KvLayout::Create(Llama8b()).value();
  const std::string ns = l.NamespaceFor("Qwen2.5-7B@rev3:tp1of2").value();
  EXPECT_EQ(ns.size(), std::string("Qwen2.5-7B@rev3:tp1of2/").size() + 16);
  EXPECT_THAT(l.NamespaceFor(""), InvalidWith("empty"));
  EXPECT_THAT(l.NamespaceFor("my model"), InvalidWith("only letters"));
  // 111 + "/" + 16 hex digits = 128, the namespace limit.
  EXPECT_TRUE(l.NamespaceFor(std::string(111, 'm')).ok());
  EXPECT_THAT(l.NamespaceFor(std::string(112, 'm')), InvalidWith("limit"));
}

}  // namespace
}  // namespace kvdepot
