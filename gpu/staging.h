// StagingPipeline: moves transfer objects between an engine's paged cache
// and a transport through a ring of staging host buffers, so that the device
// copy of one piece overlaps the network transfer of another.
//
// A save gathers each block's object (or a piece of it, see
// StagingOptions::layers_per_piece; or those of several blocks,
// blocks_per_piece) into a free ring buffer and hands the
// bytes to the caller's SaveSink; a load asks the caller's LoadSource to fill
// a free buffer with a piece and scatters it into the cache. Two threads run
// the two stages: the device stage (the gather or scatter of each piece
// enqueued on the pipeline's stream, with an event per ring buffer; it
// waits for a piece's event only when no other piece can be launched, so
// the device copies piece after piece without a gap) and the transfer stage
// (the caller's callback). With N buffers the first stage runs up to N
// pieces ahead of the second, so piece i + 1 is gathered while piece i is
// sent, and piece i + 1 is received while piece i is scattered.
//
// The cache view is checked once, when a transfer starts (as Gather checks
// it, including in the CUDA build that the device reaches every tensor),
// and the ring buffers once, when the pipeline is made; the pieces' copies
// check nothing more.
//
// Loads stream per layer: objects are layer-major (kv_layout.h), so a piece
// is a run of whole layers, and a layer is done once every block's piece
// holding it has been scattered. PendingTransfer::WaitForLayer(l) lets the
// engine start layer l's attention as soon as layer l has arrived, while
// later layers are still in flight. With PieceOrder::kLayerMajor the pieces
// go in layer order across blocks, so layers complete in order, early.
//
// Per-layer device events: the pipeline has one DeviceEvent per layer,
// recorded on its stream right after the launch of the last piece holding
// that layer (for a load, its last scatter; for a save, its last gather).
// PendingTransfer::WaitForLayerOn(l, stream) makes the engine's stream wait
// for that event on the device, so the engine can enqueue layer l's
// attention without its launch thread waiting for the copy: the host waits
// only until the copies are enqueued, not until they have run.
//
// The transport is the caller's: a SaveSink/LoadSource may block (a UCX or
// gRPC transfer); it runs on the pipeline's transfer thread, one call at a
// time, and must not throw. Its bytes span is valid only during the call.
//
// Buffers are page-locked in the CUDA build (AllocateHostBuffer), so the
// kernels read and write them directly.
//
// Thread-safe. Transfers run one after another in the order they were
// started; each uses the whole ring.
#ifndef KVDEPOT_GPU_STAGING_H_
#define KVDEPOT_GPU_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/kv_layout.h"

namespace kvdepot {

// Receives bytes [offset, offset + bytes.size()) of the transfer object of
// block_ids[index]. Pieces of one object arrive in increasing offset order;
// every byte of every object arrives exactly once unless a call fails. A
// non-OK return fails the transfer.
using SaveSink = absl::AnyInvocable<absl::Status(size_t index, uint64_t offset,
                                                 absl::Span<const char> bytes)>;
// Must fill all of `dst` with bytes [offset, offset + dst.size()) of the
// transfer object of block_ids[index]. Same order as SaveSink. A non-OK
// return fails the transfer.
using LoadSource = absl::AnyInvocable<absl::Status(
    size_t index, uint64_t offset, absl::Span<char> dst)>;

enum class PieceOrder : uint8_t {
  // For each group of layers, every block's piece of it: layers complete in
  // order, the first after about 1/num_layers of the bytes.
  kLayerMajor,
  // Each object's pieces back to back: one object at a time reaches the
  // transport, in order (for transports that stream whole objects).
  kObjectMajor,
};

struct StagingOptions {
  // Buffers in the ring, at least 2 (one in each stage).
  int num_buffers = 4;
  // Layers per piece: each buffer holds this many layers of one block's
  // object. 0 (or more than num_layers): whole objects.
  int layers_per_piece = 0;
  // Blocks per piece: each buffer holds these many blocks' pieces of the
  // same layers, copied together (one launch for up to 192 blocks of up to
  // 64 layers in the CUDA build; the transport still gets a call per block's
  // piece). More than 1 where one block's piece is small (a layer
  // of a 16-token block is 64 KiB for Llama-3-8B), so that a launch per
  // block would cost more than its copy. With kObjectMajor only for whole
  // objects (layers_per_piece 0), so that objects still reach the
  // transport one at a time.
  int blocks_per_piece = 1;
  PieceOrder order = PieceOrder::kLayerMajor;
};

namespace staging_internal {
struct Transfer;
}  // namespace staging_internal

// One save or load started by a StagingPipeline. Destroying it waits for the
// transfer to finish (it may be writing the engine's cache). It may outlive
// the pipeline.
//
// Thread-safe, but a SaveSink or LoadSource must not wait on (or destroy) a
// transfer of its own pipeline: the pipeline's threads are running it.
class PendingTransfer {
 public:
  PendingTransfer(const PendingTransfer&) = delete;
  PendingTransfer& operator=(const PendingTransfer&) = delete;
  ~PendingTransfer();

  // True once the transfer has finished, successfully or not: no callback
  // or device work of it is still running.
  bool IsDone() const;
  // Waits until IsDone(); returns the first error of any piece, else OK.
  absl::Status Wait();

  // True once layer `layer` is done with the cache for every block: for a
  // load, scattered into it; for a save, gathered out of it (the engine may
  // overwrite it).
  bool IsLayerDone(int layer) const;
  // Waits until IsLayerDone(layer) or the transfer has finished. Returns OK
  // if the layer is done, even if a later piece failed; otherwise the
  // transfer's error. InvalidArgument for a layer outside [0, num_layers).
  absl::Status WaitForLayer(int layer);

  // The device-side WaitForLayer: makes the work enqueued on `stream` (the
  // engine's, on any device) after this call wait on the device until
  // layer `layer`'s copies have finished (for a load, scattered into the
  // cache; for a save, gathered out of it), through the pipeline's event
  // for the layer (DeviceEvent::MakeStreamWait). The host waits only until
  // those copies are all enqueued on the pipeline's stream (or the layer is
  // done, or the transfer has finished), not until they have run. Returns
  // OK then. A layer already done adds no wait to `stream`. A transfer with
  // no blocks: OK at once.
  //
  // If the transfer fails before the layer's copies were all enqueued, this
  // waits until the transfer has finished (as WaitForLayer, so that a
  // caller who falls back never races a copy still running) and returns
  // its error. A failure after they were enqueued (a later piece's) does
  // not concern this layer: OK. A device fault in an enqueued copy is not
  // reported here: it comes back from Wait() (and is the context's sticky
  // error, which the engine's own work on `stream` meets too).
  // InvalidArgument for a layer outside [0, num_layers); the device's error
  // if `stream` cannot be made to wait.
  //
  // The events are the pipeline's, one per layer, and later transfers
  // record them again. A stream runs its transfers in order, so a late call
  // (after a later transfer has enqueued its copies of the same layer) may
  // make `stream` wait for those copies too: still correct, possibly
  // longer. Call it as soon as the engine needs the layer.
  absl::Status WaitForLayerOn(int layer, StreamRef stream);

 private:
  friend class StagingPipeline;
  explicit PendingTransfer(std::shared_ptr<staging_internal::Transfer> t);

  const std::shared_ptr<staging_internal::Transfer> transfer_;
};

class StagingPipeline {
 public:
  // Allocates `options.num_buffers` buffers of blocks_per_piece x
  // layers_per_piece x layer_bytes and starts the two stage threads. Device
  // work goes on `stream` (borrowed: it must outlive the pipeline) on the
  // calling thread's current device; give the pipeline a stream of its own (a
  // failed transfer waits for the whole stream before it ends). Also makes
  // an event per layer, on that device (see WaitForLayerOn).
  // InvalidArgument for bad options; the allocator's (or the event's) error
  // if the buffers (or their events) cannot be had.
  static absl::StatusOr<std::unique_ptr<StagingPipeline>> Create(
      const KvLayout& layout, StreamRef stream, StagingOptions options);

  StagingPipeline(const StagingPipeline&) = delete;
  StagingPipeline& operator=(const StagingPipeline&) = delete;
  // Finishes every transfer already started, then stops the threads.
  ~StagingPipeline();

  // Starts saving the objects of `block_ids` (repeats allowed) from `cache`
  // to `sink`. REQUIRES: the blocks' contents are final: work that writes
  // them has finished or is ordered before the pipeline's stream; the
  // cache's memory stays allocated until the transfer is done (it is checked
  // here only). Returns InvalidArgument at once, calling nothing, if the
  // view or an id is invalid (as Gather), or the device's error if the CUDA
  // build cannot check the view.
  absl::StatusOr<std::unique_ptr<PendingTransfer>> StartSave(
      const KvCacheView& cache, absl::Span<const int64_t> block_ids,
      SaveSink sink);

  // Starts loading the objects of `block_ids` from `source` into `cache`.
  // REQUIRES: nothing else reads or writes those blocks until the returned
  // transfer's layers are done; the cache's memory stays allocated until the
  // transfer is done (it is checked here only). Returns InvalidArgument at
  // once, calling nothing, if the view or an id is invalid or an id repeats
  // (as Scatter), or the device's error as StartSave.
  absl::StatusOr<std::unique_ptr<PendingTransfer>> StartLoad(
      const KvCacheView& cache, absl::Span<const int64_t> block_ids,
      LoadSource source);

  // Bytes of each ring buffer (the largest piece: blocks_per_piece x
  // layers_per_piece x layer_bytes).
  size_t buffer_bytes() const { return buffer_bytes_; }

 private:
  enum class Stage { kDevice = 0, kTransport = 1 };

  StagingPipeline(const KvLayout& layout, StreamRef stream,
                  StagingOptions options, int device, size_t buffer_bytes,
                  std::vector<HostBuffer> buffers,
                  std::vector<DeviceEvent> events,
                  std::shared_ptr<std::vector<DeviceEvent>> layer_events);
  // Starts the device and transport stages' threads (Create's last step).
  absl::Status StartThreads();
  absl::StatusOr<std::unique_ptr<PendingTransfer>> Start(
      std::shared_ptr<staging_internal::Transfer> t);
  void RunStage(Stage stage);
  void RunDeviceStage(staging_internal::Transfer& t);
  void RunTransportStage(staging_internal::Transfer& t);
  // Enqueues piece `piece`'s copy between the cache and its buffer.
  absl::Status LaunchPiece(staging_internal::Transfer& t, size_t piece);
  // After piece `piece`'s launch: records the event of each layer whose
  // last piece it was, then marks those layers enqueued.
  absl::Status RecordLayersLaunched(staging_internal::Transfer& t,
                                    size_t piece);
  // Marks piece `piece` through the device stage (its copy has finished).
  void FinishDevicePiece(staging_internal::Transfer& t, size_t piece);
  size_t PieceBytesPerBlock(const staging_internal::Transfer& t,
                            size_t piece) const;
  absl::Status TransportPiece(staging_internal::Transfer& t, size_t piece);

  // Constant after construction.
  const KvLayout layout_;
  const StreamRef stream_;
  const StagingOptions options_;
  const int device_;
  const size_t buffer_bytes_;
  // Buffer k % N holds piece k of the running transfer; the ring protocol
  // in staging.cc gives each buffer to one stage at a time.
  const std::vector<HostBuffer> buffers_;
  // events_[k % N] marks the end of piece k's copy on the stream. Device
  // stage thread only.
  std::vector<DeviceEvent> events_;
  // (*layer_events_)[l] marks the end of the running transfer's copies of
  // layer l, once they are all launched. Recorded by the device stage
  // thread only; shared with every transfer (PendingTransfer::WaitForLayerOn
  // waits on them), which may outlive the pipeline.
  const std::shared_ptr<std::vector<DeviceEvent>> layer_events_;

  absl::Mutex mu_;
  // Started, unfinished transfers; the front one is running.
  std::deque<std::shared_ptr<staging_internal::Transfer>> queue_
      ABSL_GUARDED_BY(mu_);
  // Whether each stage (indexed by Stage) has taken the front transfer.
  bool taken_[2] ABSL_GUARDED_BY(mu_) = {false, false};
  int stages_finished_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  std::thread device_thread_;
  std::thread transport_thread_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_GPU_STAGING_H_
