/* Part of kv_capi_test: kv_capi.h used from plain C99 (compiled with
 * -std=c99 -Wpedantic -Werror), as a C program or an FFI sees it. */
#include <stddef.h>
#include <stdint.h>

#include "gpu/kv_capi.h"

/* Gathers whole objects of the FlashAttention NHD fp16 layout (L layers, T
 * tokens, H heads, D head size) through the C ABI, checking the layout's
 * sizes first; returns the status of the first call that fails, or the
 * gather's. *object_bytes receives the layout's object size. */
int kv_capi_test_c_gather(int32_t num_layers, int32_t block_size,
                          int32_t num_kv_heads, int32_t head_size,
                          void* const* tensors, int64_t num_blocks,
                          const int64_t* block_ids, size_t num_block_ids,
                          void* const* objects, uint64_t* object_bytes,
                          char* err, size_t err_cap) {
  kvdepot_kv_layout_spec spec;
  kvdepot_kv_layout_info info;
  int status;

  spec.layout = KVDEPOT_KV_LAYOUT_FLASH_ATTN_NHD;
  spec.dtype = KVDEPOT_KV_DTYPE_FLOAT16;
  spec.num_layers = num_layers;
  spec.num_components = 2;
  spec.block_size = block_size;
  spec.num_kv_heads = num_kv_heads;
  spec.head_size = head_size;
  status = kvdepot_kv_layout_describe(&spec, &info, err, err_cap);
  if (status != KVDEPOT_KV_OK) return status;
  *object_bytes = info.object_bytes;
  return kvdepot_kv_gather(&spec, tensors, (size_t)info.num_tensors,
                           num_blocks, block_ids, num_block_ids, 0,
                           spec.num_layers, objects, NULL, err, err_cap);
}
