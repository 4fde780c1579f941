// KvLayout: the shape of an inference engine's paged KV cache, and of the
// transfer objects kvdepot stores for it.
//
// An engine keeps its attention KV cache in fixed-size blocks of
// `block_size` tokens. kvdepot stores one *transfer object* per block: all
// layers of that block, in one canonical byte order that does not depend on
// how the engine lays the cache out in memory:
//
//   for layer l in [0, num_layers):
//     for component c in [0, num_components):    K then V; or the MLA latent
//       for token t in [0, block_size):
//         for head h in [0, num_kv_heads):
//           head_size elements of `dtype`, as the engine stores them
//
// i.e. a row-major [num_layers, num_components, block_size, num_kv_heads,
// head_size] array (token-major "NHD" inside each layer and component).
// Objects are layer-major, so a prefix of an object covers its first layers
// and bytes [l * LayerBytes(), (l + 1) * LayerBytes()) are layer l. Element
// bytes are copied verbatim (little-endian, as every supported device stores
// them); nothing is converted.
//
// Because the object format is canonical, engines whose caches differ only in
// physical layout (vLLM FlashAttention NHD or HND, FlashInfer, per-layer or
// cross-layer tensors) produce identical objects for identical KV values and
// may share blocks. The fingerprint therefore covers exactly what changes the
// object bytes -- the object format version, num_layers, num_components,
// block_size, num_kv_heads, head_size and dtype -- and NOT the physical
// layout (KvCacheLayout). What the layout cannot know and that also changes
// the bytes (the model and its revision, the tensor-parallel rank and size
// that select this engine's heads, KV quantization scales) belongs in the
// model name given to NamespaceFor().
//
// Thread-safe: a KvLayout is an immutable value.
#ifndef KVDEPOT_GPU_KV_LAYOUT_H_
#define KVDEPOT_GPU_KV_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// Element type of the cache. The values are part of the fingerprint's
// canonical serialization (through KvDtypeName); never renumber or rename.
enum class KvDtype : uint8_t {
  kFloat16 = 1,     // 2 bytes
  kBFloat16 = 2,    // 2 bytes
  kFloat8E4M3 = 3,  // 1 byte (fp8 e4m3)
  kFloat32 = 4,     // 4 bytes
};

// Bytes per element; 0 for a value outside the enum.
size_t KvDtypeBytes(KvDtype dtype);
// "f16", "bf16", "f8e4m3", "f32"; "invalid" for a value outside the enum.
absl::string_view KvDtypeName(KvDtype dtype);

// How an engine lays its paged cache out in memory. N = num_blocks of the
// cache, C = num_components, T = block_size, H = num_kv_heads, D = head_size;
// shapes are row-major (the last dimension is contiguous).
enum class KvCacheLayout : uint8_t {
  // vLLM FlashAttention, one tensor per layer [2, N, T, H, D] (K at [0], V
  // at [1]; stride order NHD).
  kFlashAttnNhd = 1,
  // vLLM FlashAttention with the HND stride order: logically the same shape,
  // physically [2, N, H, T, D].
  kFlashAttnHnd = 2,
  // FlashInfer, one tensor per layer [N, 2, T, H, D].
  kFlashInferNhd = 3,
  // FlashInfer with the HND stride order: physically [N, 2, H, T, D].
  kFlashInferHnd = 4,
  // MLA (DeepSeek-style latent attention), one tensor per layer [N, T, D]:
  // one latent vector per token. Requires num_components == 1 and
  // num_kv_heads == 1; D is the latent size (e.g. 576).
  kMla = 5,
  // One tensor for all layers, block-major: [N, L, C, T, H, D], so one
  // block's object is one contiguous run of the cache. C may be 1 (MLA,
  // with H == 1) or 2.
  kCrossLayerNhd = 6,
  // Cross-layer with the HND stride order: physically [N, L, C, H, T, D].
  kCrossLayerHnd = 7,
};

absl::string_view KvCacheLayoutName(KvCacheLayout layout);

// Layers [begin, end) of a transfer object.
struct LayerRange {
  int begin = 0;
  int end = 0;
};

class KvLayout;
// InvalidArgument unless `layers` is a non-empty range within the layout
// (what Gather and Scatter check first).
absl::Status ValidateLayerRange(const KvLayout& layout, LayerRange layers);

// The fields of a layout, as an engine reports them. KvLayout::Create
// validates them.
struct KvLayoutSpec {
  KvCacheLayout layout = KvCacheLayout::kFlashAttnNhd;
  int num_layers = 0;
  // 2: K and V. 1: one latent vector per token (MLA).
  int num_components = 2;
  // Tokens per block.
  int block_size = 0;
  // KV heads held by this engine (this tensor-parallel rank); 1 for MLA.
  int num_kv_heads = 0;
  // Elements per head vector (MLA: the latent size).
  int head_size = 0;
  KvDtype dtype = KvDtype::kBFloat16;
};

class KvLayout {
 public:
  // Limits of a valid layout: one component of one layer of one block (a
  // "chunk", block_size x num_kv_heads x head_size elements) is below 2 GiB
  // (the gather kernels index it with 32 bits), and num_layers is at most
  // kMaxLayers.
  static constexpr int kMaxLayers = 4096;
  static constexpr uint64_t kMaxChunkBytes = (uint64_t{1} << 31) - 1;
  // Version of the canonical object format, part of the fingerprint. Bump it
  // when the byte order above changes.
  static constexpr int kObjectFormatVersion = 1;

  // Returns InvalidArgument, naming the field, unless: every dimension is
  // positive; num_components is 1 or 2; the FlashAttention and FlashInfer
  // layouts have 2 components (K and V); a one-component (MLA) layout has
  // num_kv_heads == 1; kMla has one component; dtype and layout are values
  // of their enums; the sizes stay within the limits above (no overflow).
  static absl::StatusOr<KvLayout> Create(const KvLayoutSpec& spec);

  // Shorthands for Create: a K/V (multi-head or grouped-query attention)
  // layout, and a one-latent MLA layout (per-layer kMla, or cross-layer).
  static absl::StatusOr<KvLayout> Mha(KvCacheLayout layout, int num_layers,
                                      int block_size, int num_kv_heads,
                                      int head_size, KvDtype dtype);
  static absl::StatusOr<KvLayout> Mla(KvCacheLayout layout, int num_layers,
                                      int block_size, int latent_size,
                                      KvDtype dtype);

  const KvLayoutSpec& spec() const { return spec_; }
  KvCacheLayout layout() const { return spec_.layout; }
  int num_layers() const { return spec_.num_layers; }
  int num_components() const { return spec_.num_components; }
  int block_size() const { return spec_.block_size; }
  int num_kv_heads() const { return spec_.num_kv_heads; }
  int head_size() const { return spec_.head_size; }
  KvDtype dtype() const { return spec_.dtype; }
  LayerRange AllLayers() const { return LayerRange{0, spec_.num_layers}; }

  // True for the one-tensor layouts (kCrossLayer*).
  bool cross_layer() const;
  // How many tensor base pointers a KvCacheView of this layout holds:
  // num_layers for the per-layer layouts, 1 for the cross-layer ones.
  int num_tensors() const;

  size_t element_bytes() const { return KvDtypeBytes(spec_.dtype); }
  // head_size x element bytes: one token's vector for one head.
  uint64_t row_bytes() const;
  // block_size x num_kv_heads x row_bytes: one component of one layer of
  // one block.
  uint64_t chunk_bytes() const;
  // num_components x chunk_bytes: one layer of one block's object.
  uint64_t layer_bytes() const;
  // num_layers x layer_bytes: one block's transfer object.
  uint64_t object_bytes() const;

  // Bytes of each tensor of a cache of `num_blocks` blocks (each per-layer
  // tensor, or the one cross-layer tensor). InvalidArgument if num_blocks <
  // 1 or the size overflows int64.
  absl::StatusOr<uint64_t> TensorBytes(int64_t num_blocks) const;

  // The canonical serialization the fingerprint hashes, e.g.
  // "kvdepot-kv-object/v1 layers=32 components=2 block=16 heads=8
  // head_size=128 dtype=bf16". Stable across releases and platforms.
  std::string ObjectFormat() const;
  // XXH3-64 (seed 0) of ObjectFormat(). Two layouts have the same
  // fingerprint iff their objects have the same byte format.
  uint64_t Fingerprint() const;
  // "<model_name>/<fingerprint as 16 lower-case hex digits>", e.g.
  // "llama3-8b-instruct/tp0of2/9c1e0d2a4b5f6e78". `model_name` names what
  // the layout does not (see the file comment). Returns InvalidArgument if
  // the result is not a valid namespace (storage/block_key.h: 1..128
  // characters of [A-Za-z0-9._:/@+=-]).
  absl::StatusOr<std::string> NamespaceFor(absl::string_view model_name) const;

  // ObjectFormat() plus the physical layout, for logs.
  std::string DebugString() const;

 private:
  explicit KvLayout(const KvLayoutSpec& spec) : spec_(spec) {}

  KvLayoutSpec spec_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_GPU_KV_LAYOUT_H_
