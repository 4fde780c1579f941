/* A C ABI over gather/scatter (gather.h) and the device primitives
 * (device_memory.h), for callers that cannot link C++: the Python package
 * loads it with ctypes (client/python/kvdepot/kvshim.py).
 *
 * Shipped as two shared libraries with the same symbols, one per
 * implementation of gather.h:
 *   libkvdepot_kv_cpu.so   the CPU twin (host memory, synchronous)
 *   libkvdepot_kv_cuda.so  the CUDA kernels (device or page-locked host
 *                          memory; work enqueued on the caller's stream),
 *                          built where nvcc was found; static CUDA runtime
 * A process may load both: each exports only the kvdepot_kv_ functions
 * below, and keeps its C++ internals to itself.
 *
 * Conventions. Every function that can fail returns an int status: 0 (OK)
 * or the absl::StatusCode value (3 INVALID_ARGUMENT, 5 NOT_FOUND, 6
 * ALREADY_EXISTS, 9 FAILED_PRECONDITION, 13 INTERNAL, ...; absl codes are the
 * gRPC codes), and writes the message NUL-terminated into `err`, truncated
 * to `err_cap` bytes including the NUL ("" on success). `err` may be null
 * when `err_cap` is 0; with `err_cap` 0 nothing is written. Null pointers,
 * counts that do not match the layout and values outside the enums below
 * give INVALID_ARGUMENT. No C++ exception or abort crosses these functions.
 *
 * Thread-safe: the functions keep no state; concurrent calls must not write
 * the same bytes (see gather.h). The layout is validated on every call
 * (KvLayout::Create: a few integer checks), so there is no handle to create
 * or free.
 */
#ifndef KVDEPOT_GPU_KV_CAPI_H_
#define KVDEPOT_GPU_KV_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define KVDEPOT_KV_API __attribute__((visibility("default")))
#else
#define KVDEPOT_KV_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a signature or struct below changes incompatibly. */
#define KVDEPOT_KV_ABI_VERSION 1

/* Status codes returned here (the absl::StatusCode values; others may
 * appear, see kvdepot_kv_status_name). */
#define KVDEPOT_KV_OK 0
#define KVDEPOT_KV_INVALID_ARGUMENT 3
#define KVDEPOT_KV_NOT_FOUND 5
#define KVDEPOT_KV_ALREADY_EXISTS 6
#define KVDEPOT_KV_RESOURCE_EXHAUSTED 8
#define KVDEPOT_KV_FAILED_PRECONDITION 9
#define KVDEPOT_KV_INTERNAL 13

/* kvdepot::KvCacheLayout (kv_layout.h documents each shape). */
#define KVDEPOT_KV_LAYOUT_FLASH_ATTN_NHD 1
#define KVDEPOT_KV_LAYOUT_FLASH_ATTN_HND 2
#define KVDEPOT_KV_LAYOUT_FLASH_INFER_NHD 3
#define KVDEPOT_KV_LAYOUT_FLASH_INFER_HND 4
#define KVDEPOT_KV_LAYOUT_MLA 5
#define KVDEPOT_KV_LAYOUT_CROSS_LAYER_NHD 6
#define KVDEPOT_KV_LAYOUT_CROSS_LAYER_HND 7

/* kvdepot::KvDtype. */
#define KVDEPOT_KV_DTYPE_FLOAT16 1
#define KVDEPOT_KV_DTYPE_BFLOAT16 2
#define KVDEPOT_KV_DTYPE_FLOAT8_E4M3 3
#define KVDEPOT_KV_DTYPE_FLOAT32 4

/* kvdepot::KvLayoutSpec: the cache's shape, as an engine reports it. */
typedef struct kvdepot_kv_layout_spec {
  int32_t layout;         /* KVDEPOT_KV_LAYOUT_* */
  int32_t dtype;          /* KVDEPOT_KV_DTYPE_* */
  int32_t num_layers;     /* L */
  int32_t num_components; /* C: 2 (K and V) or 1 (an MLA latent) */
  int32_t block_size;     /* T: tokens per block */
  int32_t num_kv_heads;   /* H: KV heads of this engine (1 for MLA) */
  int32_t head_size;      /* D: elements per head (MLA: the latent size) */
} kvdepot_kv_layout_spec;

/* What a caller needs to size its tensors and objects. */
typedef struct kvdepot_kv_layout_info {
  int32_t num_tensors;   /* cache tensors: L per-layer, 1 cross-layer */
  int32_t element_bytes; /* of the dtype */
  uint64_t layer_bytes;  /* one layer of one block's object */
  uint64_t object_bytes; /* one block's whole object: L x layer_bytes */
  /* Bytes each cache tensor holds per block: a tensor of N blocks is N x
   * this (KvLayout::TensorBytes(1)). */
  uint64_t tensor_bytes_per_block;
} kvdepot_kv_layout_info;

/* KVDEPOT_KV_ABI_VERSION of the library. */
KVDEPOT_KV_API int kvdepot_kv_abi_version(void);

/* "cpu" or "cuda": the gather/scatter implementation this library holds.
 * Static storage; never null. */
KVDEPOT_KV_API const char* kvdepot_kv_backend(void);

/* The name of a status code, e.g. "INVALID_ARGUMENT" for 3 (absl's
 * StatusCodeToString); "" for a value that is no code. Static storage. */
KVDEPOT_KV_API const char* kvdepot_kv_status_name(int code);

/* Validates `spec` (KvLayout::Create) and fills `*info`. INVALID_ARGUMENT,
 * naming the field, for a spec Create rejects. */
KVDEPOT_KV_API int kvdepot_kv_layout_describe(
    const kvdepot_kv_layout_spec* spec, kvdepot_kv_layout_info* info,
    char* err, size_t err_cap);

/* Gather (gather.h): objects[i] receives bytes [layer_begin x layer_bytes,
 * layer_end x layer_bytes) of the object of block block_ids[i], for i in
 * [0, num_block_ids); block ids may repeat. `cache_tensors` holds
 * `num_tensors` pointers (info.num_tensors), each a tensor of `num_blocks`
 * blocks; `objects` holds num_block_ids pointers, each to (layer_end -
 * layer_begin) x layer_bytes writable bytes (not checked: the C ABI carries
 * no sizes). `block_ids` and `objects` may be null only when num_block_ids
 * is 0 (nothing to do).
 *
 * Everything is validated before any byte moves: INVALID_ARGUMENT, writing
 * nothing, for a bad spec, a wrong tensor count, a null pointer, num_blocks
 * < 1, an id outside [0, num_blocks), an empty or out-of-range layer range,
 * two objects that share a byte (the same pointer for two ids included),
 * an object that shares a byte with any cache tensor (the tensors
 * themselves may share memory: layers sharing one KV cache), and in the
 * CUDA library a pointer the device cannot reach (pageable host memory:
 * register it with kvdepot_kv_register_host first). The overlap checks
 * take each object as (layer_end - layer_begin) x layer_bytes at its
 * pointer and each tensor as num_blocks blocks' bytes.
 *
 * `stream`: a cudaStream_t (null: the legacy default stream) on which the
 * CUDA library enqueues the copy and returns; the objects are complete once
 * that stream's work up to here has finished (kvdepot_kv_synchronize). The
 * CPU library ignores it and has finished when it returns. */
KVDEPOT_KV_API int kvdepot_kv_gather(const kvdepot_kv_layout_spec* spec,
                                     void* const* cache_tensors,
                                     size_t num_tensors, int64_t num_blocks,
                                     const int64_t* block_ids,
                                     size_t num_block_ids, int32_t layer_begin,
                                     int32_t layer_end, void* const* objects,
                                     void* stream, char* err, size_t err_cap);

/* Scatter: the reverse of kvdepot_kv_gather; objects[i] is read and its
 * layers written into block block_ids[i] of the cache, nothing else
 * changes. Same contract as kvdepot_kv_gather, and INVALID_ARGUMENT, writing
 * nothing, when a block id repeats; but objects may overlap each other
 * (they are only read), though still not a cache tensor. */
KVDEPOT_KV_API int kvdepot_kv_scatter(const kvdepot_kv_layout_spec* spec,
                                      void* const* cache_tensors,
                                      size_t num_tensors, int64_t num_blocks,
                                      const int64_t* block_ids,
                                      size_t num_block_ids, int32_t layer_begin,
                                      int32_t layer_end,
                                      const void* const* objects, void* stream,
                                      char* err, size_t err_cap);

/* Waits for the work enqueued on `stream` (a cudaStream_t; null: the legacy
 * default stream) and returns the device's error if any of it failed. The
 * CPU library returns OK at once. */
KVDEPOT_KV_API int kvdepot_kv_synchronize(void* stream, char* err,
                                          size_t err_cap);

/* The calling thread's current device (cudaGetDevice; 0 in the CPU
 * library). FAILED_PRECONDITION where the CUDA library finds no usable
 * device or driver: a cheap probe before the first transfer. */
KVDEPOT_KV_API int kvdepot_kv_current_device(int32_t* device, char* err,
                                             size_t err_cap);

/* Page-locks `bytes` of host memory at `data` for the device
 * (RegisterHostMemory in device_memory.h: cudaHostRegister in the CUDA
 * library, nothing to do in the CPU one). The memory must stay allocated
 * until kvdepot_kv_unregister_host(data). INVALID_ARGUMENT for null or 0
 * bytes; CUDA: ALREADY_EXISTS if already registered. */
KVDEPOT_KV_API int kvdepot_kv_register_host(void* data, size_t bytes,
                                            char* err, size_t err_cap);

/* Undoes kvdepot_kv_register_host(data). INVALID_ARGUMENT for null; CUDA:
 * NOT_FOUND if `data` does not start a registered range. */
KVDEPOT_KV_API int kvdepot_kv_unregister_host(void* data, char* err,
                                              size_t err_cap);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVDEPOT_GPU_KV_CAPI_H_ */
