// kv_capi.h over gather.h and device_memory.h. Compiled into both shared
// libraries (libkvdepot_kv_cpu.so, libkvdepot_kv_cuda.so); which
// implementation it calls is decided by what each links.
//
// Invariant: every exported function runs its body inside Guarded(), so no
// exception leaves it, and converts C arguments to C++ ones only after
// checking them (a null pointer or a value outside an enum never reaches
// KvLayout or Gather as such).
#include "gpu/kv_capi.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/kv_layout.h"
#include "storage/status_macros.h"

namespace kvdepot {
namespace {

// The C values are the C++ ones: the ABI and the fingerprint both depend on
// them never changing.
static_assert(KVDEPOT_KV_LAYOUT_FLASH_ATTN_NHD ==
              static_cast<int>(KvCacheLayout::kFlashAttnNhd));
static_assert(KVDEPOT_KV_LAYOUT_FLASH_ATTN_HND ==
              static_cast<int>(KvCacheLayout::kFlashAttnHnd));
static_assert(KVDEPOT_KV_LAYOUT_FLASH_INFER_NHD ==
              static_cast<int>(KvCacheLayout::kFlashInferNhd));
static_assert(KVDEPOT_KV_LAYOUT_FLASH_INFER_HND ==
              static_cast<int>(KvCacheLayout::kFlashInferHnd));
static_assert(KVDEPOT_KV_LAYOUT_MLA == static_cast<int>(KvCacheLayout::kMla));
static_assert(KVDEPOT_KV_LAYOUT_CROSS_LAYER_NHD ==
              static_cast<int>(KvCacheLayout::kCrossLayerNhd));
static_assert(KVDEPOT_KV_LAYOUT_CROSS_LAYER_HND ==
              static_cast<int>(KvCacheLayout::kCrossLayerHnd));
static_assert(KVDEPOT_KV_DTYPE_FLOAT16 == static_cast<int>(KvDtype::kFloat16));
static_assert(KVDEPOT_KV_DTYPE_BFLOAT16 ==
              static_cast<int>(KvDtype::kBFloat16));
static_assert(KVDEPOT_KV_DTYPE_FLOAT8_E4M3 ==
              static_cast<int>(KvDtype::kFloat8E4M3));
static_assert(KVDEPOT_KV_DTYPE_FLOAT32 == static_cast<int>(KvDtype::kFloat32));

static_assert(KVDEPOT_KV_OK == static_cast<int>(absl::StatusCode::kOk));
static_assert(KVDEPOT_KV_INVALID_ARGUMENT ==
              static_cast<int>(absl::StatusCode::kInvalidArgument));
static_assert(KVDEPOT_KV_NOT_FOUND ==
              static_cast<int>(absl::StatusCode::kNotFound));
static_assert(KVDEPOT_KV_ALREADY_EXISTS ==
              static_cast<int>(absl::StatusCode::kAlreadyExists));
static_assert(KVDEPOT_KV_RESOURCE_EXHAUSTED ==
              static_cast<int>(absl::StatusCode::kResourceExhausted));
static_assert(KVDEPOT_KV_FAILED_PRECONDITION ==
              static_cast<int>(absl::StatusCode::kFailedPrecondition));
static_assert(KVDEPOT_KV_INTERNAL ==
              static_cast<int>(absl::StatusCode::kInternal));

// The struct layouts ctypes and other FFIs mirror field by field.
static_assert(sizeof(kvdepot_kv_layout_spec) == 7 * sizeof(int32_t));
static_assert(sizeof(kvdepot_kv_layout_info) == 32 &&
              offsetof(kvdepot_kv_layout_info, layer_bytes) == 8 &&
              offsetof(kvdepot_kv_layout_info, tensor_bytes_per_block) == 24);

// Writes `message` to err as kv_capi.h says (no allocation) and returns
// `code`.
int Report(absl::StatusCode code, absl::string_view message, char* err,
           size_t err_cap) noexcept {
  if (err != nullptr && err_cap > 0) {
    const size_t n = std::min(message.size(), err_cap - 1);
    // An OK status's empty message may have a null data(): no memcpy then.
    if (n > 0) std::memcpy(err, message.data(), n);
    err[n] = '\0';
  }
  return static_cast<int>(code);
}

// Runs fn (returning absl::Status) and reports its outcome. An exception
// (std::bad_alloc while building a vector or a status message, or anything
// else) is reported without allocating, so that nothing escapes.
template <typename Fn>
int Guarded(char* err, size_t err_cap, Fn&& fn) noexcept {
  try {
    const absl::Status status = std::forward<Fn>(fn)();
    return Report(status.code(), status.message(), err, err_cap);
  } catch (const std::bad_alloc&) {
    return Report(absl::StatusCode::kResourceExhausted, "out of memory", err,
                  err_cap);
  } catch (const std::exception& e) {
    return Report(absl::StatusCode::kInternal, e.what(), err, err_cap);
  } catch (...) {
    return Report(absl::StatusCode::kInternal, "unexpected exception", err,
                  err_cap);
  }
}

absl::StatusOr<KvLayout> LayoutFromSpec(const kvdepot_kv_layout_spec* spec) {
  if (spec == nullptr) {
    return absl::InvalidArgumentError("the layout spec is null");
  }
  // The C++ enums are 8 bits wide: a wider value must not wrap onto a
  // valid one. Values inside are checked by KvLayout::Create.
  if (spec->layout < 0 || spec->layout > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout ", spec->layout, " is not a KVDEPOT_KV_LAYOUT_ value"));
  }
  if (spec->dtype < 0 || spec->dtype > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", spec->dtype, " is not a KVDEPOT_KV_DTYPE_ value"));
  }
  KvLayoutSpec s;
  s.layout = static_cast<KvCacheLayout>(spec->layout);
  s.dtype = static_cast<KvDtype>(spec->dtype);
  s.num_layers = spec->num_layers;
  s.num_components = spec->num_components;
  s.block_size = spec->block_size;
  s.num_kv_heads = spec->num_kv_heads;
  s.head_size = spec->head_size;
  return KvLayout::Create(s);
}

// The checked arguments of a gather or scatter.
struct Transfer {
  KvLayout layout;
  KvCacheView cache;
  absl::Span<const int64_t> block_ids;
  LayerRange layers;
};

absl::StatusOr<Transfer> MakeTransfer(const kvdepot_kv_layout_spec* spec,
                                      void* const* cache_tensors,
                                      size_t num_tensors, int64_t num_blocks,
                                      const int64_t* block_ids,
                                      size_t num_block_ids, int32_t layer_begin,
                                      int32_t layer_end, const void* objects) {
  ASSIGN_OR_RETURN(KvLayout layout, LayoutFromSpec(spec));
  // Checked before the vector below is sized by it.
  if (num_tensors != static_cast<size_t>(layout.num_tensors())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout ", KvCacheLayoutName(layout.layout()), " with ",
        layout.num_layers(), " layers takes ", layout.num_tensors(),
        " cache tensors, got ", num_tensors));
  }
  if (cache_tensors == nullptr) {
    return absl::InvalidArgumentError("the cache tensor array is null");
  }
  if (num_block_ids > 0 && block_ids == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the block id array is null, with ", num_block_ids, " ids"));
  }
  if (num_block_ids > 0 && objects == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the object array is null, with ", num_block_ids, " ids"));
  }
  Transfer t{std::move(layout), KvCacheView{}, {}, {layer_begin, layer_end}};
  t.cache.tensors.assign(cache_tensors, cache_tensors + num_tensors);
  t.cache.num_blocks = num_blocks;
  t.block_ids = absl::MakeConstSpan(block_ids, num_block_ids);
  return t;
}

}  // namespace
}  // namespace kvdepot

using kvdepot::Guarded;

extern "C" {

int kvdepot_kv_abi_version(void) { return KVDEPOT_KV_ABI_VERSION; }

const char* kvdepot_kv_backend(void) {
  // GpuBackendName returns a literal ("cpu" or "cuda"): NUL-terminated,
  // static storage.
  return kvdepot::GpuBackendName().data();
}

const char* kvdepot_kv_status_name(int code) {
  // absl::StatusCodeToString returns a std::string; these are its names.
  switch (static_cast<absl::StatusCode>(code)) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal: return "INTERNAL";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss: return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    default: return "";
  }
}

int kvdepot_kv_layout_describe(const kvdepot_kv_layout_spec* spec,
                               kvdepot_kv_layout_info* info, char* err,
                               size_t err_cap) {
  return Guarded(err, err_cap, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const kvdepot::KvLayout layout,
                     kvdepot::LayoutFromSpec(spec));
    if (info == nullptr) {
      return absl::InvalidArgumentError("the layout info pointer is null");
    }
    ASSIGN_OR_RETURN(const uint64_t per_block, layout.TensorBytes(1));
    info->num_tensors = layout.num_tensors();
    info->element_bytes = static_cast<int32_t>(layout.element_bytes());
    info->layer_bytes = layout.layer_bytes();
    info->object_bytes = layout.object_bytes();
    info->tensor_bytes_per_block = per_block;
    return absl::OkStatus();
  });
}

int kvdepot_kv_gather(const kvdepot_kv_layout_spec* spec,
                      void* const* cache_tensors, size_t num_tensors,
                      int64_t num_blocks, const int64_t* block_ids,
                      size_t num_block_ids, int32_t layer_begin,
                      int32_t layer_end, void* const* objects, void* stream,
                      char* err, size_t err_cap) {
  return Guarded(err, err_cap, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(
        const kvdepot::Transfer t,
        kvdepot::MakeTransfer(spec, cache_tensors, num_tensors, num_blocks,
                              block_ids, num_block_ids, layer_begin,
                              layer_end, objects));
    return kvdepot::Gather(t.layout, t.cache, t.block_ids, t.layers,
                           absl::MakeConstSpan(objects, num_block_ids),
                           kvdepot::StreamRef{stream});
  });
}

int kvdepot_kv_scatter(const kvdepot_kv_layout_spec* spec,
                       void* const* cache_tensors, size_t num_tensors,
                       int64_t num_blocks, const int64_t* block_ids,
                       size_t num_block_ids, int32_t layer_begin,
                       int32_t layer_end, const void* const* objects,
                       void* stream, char* err, size_t err_cap) {
  return Guarded(err, err_cap, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(
        const kvdepot::Transfer t,
        kvdepot::MakeTransfer(spec, cache_tensors, num_tensors, num_blocks,
                              block_ids, num_block_ids, layer_begin,
                              layer_end, objects));
    return kvdepot::Scatter(t.layout, t.cache, t.block_ids, t.layers,
                            absl::MakeConstSpan(objects, num_block_ids),
                            kvdepot::StreamRef{stream});
  });
}

int kvdepot_kv_synchronize(void* stream, char* err, size_t err_cap) {
  return Guarded(err, err_cap, [&] {
    return kvdepot::SynchronizeStream(kvdepot::StreamRef{stream});
  });
}

int kvdepot_kv_current_device(int32_t* device, char* err, size_t err_cap) {
  return Guarded(err, err_cap, [&]() -> absl::Status {
    if (device == nullptr) {
      return absl::InvalidArgumentError("the device pointer is null");
    }
    ASSIGN_OR_RETURN(*device, kvdepot::GetCurrentDevice());
    return absl::OkStatus();
  });
}

int kvdepot_kv_register_host(void* data, size_t bytes, char* err,
                             size_t err_cap) {
  return Guarded(err, err_cap,
                 [&] { return kvdepot::RegisterHostMemory(data, bytes); });
}

int kvdepot_kv_unregister_host(void* data, char* err, size_t err_cap) {
  return Guarded(err, err_cap,
                 [&] { return kvdepot::UnregisterHostMemory(data); });
}

}  // extern "C"
