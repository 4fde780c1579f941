// Gather and scatter between an engine's paged KV cache and contiguous
// transfer objects (the canonical format of kv_layout.h).
//
// Two implementations with identical semantics, chosen at link time:
// kvdepot_gpu_cuda (gather_cuda.cc/.cu: kernels enqueued on the caller's
// stream) and kvdepot_gpu_cpu (gather_cpu.cc: memcpy on the calling thread,
// done when the call returns). Link `kvdepot_gpu` to get the CUDA one where
// CUDA was found at configure time, else the CPU one.
//
// Memory: in the CUDA build every buffer (each cache tensor of
// TensorBytes(num_blocks), each object of the layer range's bytes) must be
// reachable by the current device: its device memory, managed memory, or
// page-locked host memory such as a HostBuffer or RegisterHostMemory's.
// Both the first and the last byte of each buffer are checked; pageable
// host memory (unless the device can access it: HMM/ATS), a buffer that
// runs past the end of its registration or allocation (its ends of two
// kinds), and another device's memory are rejected with InvalidArgument.
// A sticky CUDA error met there comes back as that error (Internal). In the CPU
// build every pointer is host memory.
//
// Thread-safe: the functions keep no state. Concurrent calls must not write
// the same bytes (a scatter into blocks another call reads or writes, or two
// gathers into one destination).
#ifndef KVDEPOT_GPU_GATHER_H_
#define KVDEPOT_GPU_GATHER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/device_memory.h"
#include "gpu/kv_layout.h"

namespace kvdepot {

// An engine's paged cache: where its tensors are, and how many blocks each
// holds. Borrowed: the memory belongs to the engine and must outlive every
// call (and every staging transfer) given the view.
struct KvCacheView {
  // The per-layer layouts: layout.num_layers() pointers, tensor of layer l
  // at tensors[l]. The cross-layer layouts: exactly one pointer. Each tensor
  // is KvLayout::TensorBytes(num_blocks) bytes.
  std::vector<void*> tensors;
  // Blocks the cache holds; valid block ids are [0, num_blocks).
  int64_t num_blocks = 0;
};

// Copies `layers` of the blocks `block_ids` out of `cache`: dst[i] receives
// bytes [layers.begin * layer_bytes, layers.end * layer_bytes) of the
// transfer object of block_ids[i] (layers.begin == 0 and the full range:
// the whole object, object_bytes). Block ids may repeat.
//
// Validates everything before touching any memory, and returns
// InvalidArgument (writing nothing) if: the view has the wrong number of
// tensors, a null tensor, or no blocks; a block id is outside [0,
// num_blocks); dst.size() != block_ids.size() or a dst pointer is null; the
// layer range is empty or outside [0, num_layers); two destinations share a
// byte (the same pointer for two ids included: each needs memory of its
// own, else the CUDA copies would race and tear the objects); a destination
// shares a byte with a cache tensor (any tensor of the view, not only the
// range's layers); (CUDA) a buffer is not reachable by the current device
// (see "Memory" above). Cache tensors may share memory with each other
// (layers sharing one KV cache pass the same tensor). Each destination
// spans the layer range's bytes; the overlap checks cost O(n log n).
//
// The CUDA build enqueues the copy on `stream` and returns; dst is complete
// once the stream's work up to here has finished (SynchronizeStream, an
// event). It reads the cache in stream order: work that writes those blocks
// must be ordered before it on `stream`. A launch failure returns Internal
// (or the code closest to the CUDA error); dst contents are then unspecified
// and launches enqueued before the failure may still be running, so
// synchronize `stream` before reusing the memory. The CPU build ignores
// `stream` and has finished when it returns.
absl::Status Gather(const KvLayout& layout, const KvCacheView& cache,
                    absl::Span<const int64_t> block_ids, LayerRange layers,
                    absl::Span<void* const> dst, StreamRef stream);

// The reverse of Gather: src[i] holds bytes [layers.begin * layer_bytes,
// layers.end * layer_bytes) of the transfer object of block_ids[i], and its
// layers are written into that block of `cache`. Nothing else in the cache
// changes.
//
// Returns InvalidArgument, writing nothing, on the same conditions as Gather
// and if a block id repeats: a scatter writes each block at most once (two
// sources for one block would race on the device). Sources may overlap each
// other (they are only read: one buffer may feed several blocks), but not a
// cache tensor.
absl::Status Scatter(const KvLayout& layout, const KvCacheView& cache,
                     absl::Span<const int64_t> block_ids, LayerRange layers,
                     absl::Span<const void* const> src, StreamRef stream);

}  // namespace kvdepot

#endif  // KVDEPOT_GPU_GATHER_H_
