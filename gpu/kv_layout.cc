#include "gpu/kv_layout.h"

#include <xxhash.h>

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "storage/block_key.h"

namespace kvdepot {
namespace {

// a * b, or false when it exceeds `limit`. Operands are non-negative.
bool CheckedMul(uint64_t a, uint64_t b, uint64_t limit, uint64_t* out) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r) || r > limit) return false;
  *out = r;
  return true;
}

bool IsKnownLayout(KvCacheLayout layout) {
  switch (layout) {
    case KvCacheLayout::kFlashAttnNhd:
    case KvCacheLayout::kFlashAttnHnd:
    case KvCacheLayout::kFlashInferNhd:
    case KvCacheLayout::kFlashInferHnd:
    case KvCacheLayout::kMla:
    case KvCacheLayout::kCrossLayerNhd:
    case KvCacheLayout::kCrossLayerHnd:
      return true;
  }
  return false;
}

// The layouts whose tensors always hold K and V.
bool IsKvPairLayout(KvCacheLayout layout) {
  switch (layout) {
    case KvCacheLayout::kFlashAttnNhd:
    case KvCacheLayout::kFlashAttnHnd:
    case KvCacheLayout::kFlashInferNhd:
    case KvCacheLayout::kFlashInferHnd:
      return true;
    default:
      return false;
  }
}

}  // namespace

size_t KvDtypeBytes(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat16:
    case KvDtype::kBFloat16:
      return 2;
    case KvDtype::kFloat8E4M3:
      return 1;
    case KvDtype::kFloat32:
      return 4;
  }
  return 0;
}

absl::string_view KvDtypeName(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat16:
      return "f16";
    case KvDtype::kBFloat16:
      return "bf16";
    case KvDtype::kFloat8E4M3:
      return "f8e4m3";
    case KvDtype::kFloat32:
      return "f32";
  }
  return "invalid";
}

absl::string_view KvCacheLayoutName(KvCacheLayout layout) {
  switch (layout) {
    case KvCacheLayout::kFlashAttnNhd:
      return "flash-attn-nhd";
    case KvCacheLayout::kFlashAttnHnd:
      return "flash-attn-hnd";
    case KvCacheLayout::kFlashInferNhd:
      return "flashinfer-nhd";
    case KvCacheLayout::kFlashInferHnd:
      return "flashinfer-hnd";
    case KvCacheLayout::kMla:
      return "mla";
    case KvCacheLayout::kCrossLayerNhd:
      return "cross-layer-nhd";
    case KvCacheLayout::kCrossLayerHnd:
      return "cross-layer-hnd";
  }
  return "invalid";
}

absl::StatusOr<KvLayout> KvLayout::Create(const KvLayoutSpec& s) {
  if (!IsKnownLayout(s.layout)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown cache layout ", static_cast<int>(s.layout)));
  }
  if (KvDtypeBytes(s.dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype ", static_cast<int>(s.dtype)));
  }
  const struct {
    const char* name;
    int value;
  } dims[] = {{"num_layers", s.num_layers},
              {"block_size", s.block_size},
              {"num_kv_heads", s.num_kv_heads},
              {"head_size", s.head_size}};
  for (const auto& d : dims) {
    if (d.value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(d.name, " is ", d.value, "; it must be at least 1"));
    }
  }
  if (s.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_layers is ", s.num_layers, "; the limit is ", kMaxLayers));
  }
  if (s.num_components != 1 && s.num_components != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_components is ", s.num_components,
                     "; it must be 2 (K and V) or 1 (an MLA latent)"));
  }
  const absl::string_view name = KvCacheLayoutName(s.layout);
  if (IsKvPairLayout(s.layout) && s.num_components != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", name, " layout holds K and V (2 components), not ",
        s.num_components, "; use mla or a cross-layer layout for a latent"));
  }
  if (s.layout == KvCacheLayout::kMla && s.num_components != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the mla layout holds one latent vector per token (1 component), "
        "not ",
        s.num_components));
  }
  if (s.num_components == 1 && s.num_kv_heads != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a one-component (MLA latent) layout has num_kv_heads 1, not ",
        s.num_kv_heads));
  }
  // chunk = block_size x num_kv_heads x head_size x element bytes, checked
  // against the 32-bit kernel index; the object then fits easily in 64 bits
  // (at most 2 x kMaxLayers chunks).
  uint64_t chunk = KvDtypeBytes(s.dtype);
  for (int d : {s.block_size, s.num_kv_heads, s.head_size}) {
    if (!CheckedMul(chunk, static_cast<uint64_t>(d), kMaxChunkBytes, &chunk)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_size x num_kv_heads x head_size x ", KvDtypeBytes(s.dtype),
          " bytes (", s.block_size, " x ", s.num_kv_heads, " x ", s.head_size,
          ") exceeds the ", kMaxChunkBytes,
          "-byte limit of one component of one layer of one block"));
    }
  }
  return KvLayout(s);
}

absl::StatusOr<KvLayout> KvLayout::Mha(KvCacheLayout layout, int num_layers,
                                       int block_size, int num_kv_heads,
                                       int head_size, KvDtype dtype) {
  KvLayoutSpec s;
  s.layout = layout;
  s.num_layers = num_layers;
  s.num_components = 2;
  s.block_size = block_size;
  s.num_kv_heads = num_kv_heads;
  s.head_size = head_size;
  s.dtype = dtype;
  return Create(s);
}

absl::StatusOr<KvLayout> KvLayout::Mla(KvCacheLayout layout, int num_layers,
                                       int block_size, int latent_size,
                                       KvDtype dtype) {
  KvLayoutSpec s;
  s.layout = layout;
  s.num_layers = num_layers;
  s.num_components = 1;
  s.block_size = block_size;
  s.num_kv_heads = 1;
  s.head_size = latent_size;
  s.dtype = dtype;
  return Create(s);
}

bool KvLayout::cross_layer() const {
  return spec_.layout == KvCacheLayout::kCrossLayerNhd ||
         spec_.layout == KvCacheLayout::kCrossLayerHnd;
}

int KvLayout::num_tensors() const {
  return cross_layer() ? 1 : spec_.num_layers;
}

// Create() bounded chunk_bytes by 2^31 and num_layers by kMaxLayers, so
// none of these products can overflow.
uint64_t KvLayout::row_bytes() const {
  return uint64_t{element_bytes()} * static_cast<uint64_t>(spec_.head_size);
}

uint64_t KvLayout::chunk_bytes() const {
  return row_bytes() * static_cast<uint64_t>(spec_.block_size) *
         static_cast<uint64_t>(spec_.num_kv_heads);
}

uint64_t KvLayout::layer_bytes() const {
  return chunk_bytes() * static_cast<uint64_t>(spec_.num_components);
}

uint64_t KvLayout::object_bytes() const {
  return layer_bytes() * static_cast<uint64_t>(spec_.num_layers);
}

absl::StatusOr<uint64_t> KvLayout::TensorBytes(int64_t num_blocks) const {
  if (num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the cache has ", num_blocks, " blocks; it needs at least 1"));
  }
  const uint64_t per_block = cross_layer() ? object_bytes() : layer_bytes();
  uint64_t bytes;
  if (!CheckedMul(per_block, static_cast<uint64_t>(num_blocks),
                  std::numeric_limits<int64_t>::max(), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a cache of ", num_blocks, " blocks of ", per_block,
                     " bytes per tensor overflows a 64-bit size"));
  }
  return bytes;
}

std::string KvLayout::ObjectFormat() const {
  return absl::StrCat(
      "kvdepot-kv-object/v", kObjectFormatVersion, " layers=", spec_.num_layers,
      " components=", spec_.num_components, " block=", spec_.block_size,
      " heads=", spec_.num_kv_heads, " head_size=", spec_.head_size,
      " dtype=", KvDtypeName(spec_.dtype));
}

uint64_t KvLayout::Fingerprint() const {
  const std::string s = ObjectFormat();
  return XXH3_64bits(s.data(), s.size());
}

absl::StatusOr<std::string> KvLayout::NamespaceFor(
    absl::string_view model_name) const {
  if (model_name.empty()) {
    return absl::InvalidArgumentError("model name is empty");
  }
  std::string ns = absl::StrFormat("%s/%016x", model_name, Fingerprint());
  absl::Status valid = ValidateNamespace(ns);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model name \"", model_name, "\" makes namespace \"", ns,
                     "\" invalid: ", valid.message()));
  }
  return ns;
}

std::string KvLayout::DebugString() const {
  return absl::StrCat(ObjectFormat(),
                      " layout=", KvCacheLayoutName(spec_.layout));
}

absl::Status ValidateLayerRange(const KvLayout& layout, LayerRange layers) {
  if (layers.begin < 0 || layers.begin >= layers.end ||
      layers.end > layout.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range [", layers.begin, ", ", layers.end,
        ") is not a non-empty part of [0, ", layout.num_layers(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
