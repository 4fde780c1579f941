#include "gpu/staging.h"

#include <pthread.h>

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "gpu/internal/checked_copy.h"
#include "gpu/internal/transfer_plan.h"
#include "storage/status_macros.h"

namespace kvdepot {

namespace staging_internal {

// Layers [first_layer, end_layer) of the objects of block_ids[index] ..
// block_ids[index + count - 1], back to back in one buffer.
struct Piece {
  size_t index;
  size_t count;
  int first_layer;
  int end_layer;
};

// The state of one transfer, shared by the pipeline's two stage threads and
// the PendingTransfer handle.
//
// The ring protocol: piece k uses buffer k % N. The first stage (device for a
// save, transport for a load) starts piece k once the second stage has
// finished piece k - N (k < drained + N), and the second stage starts piece
// k once the first has finished it (k < staged). So each buffer belongs to
// one stage at a time, and the first stage runs at most N pieces ahead.
struct Transfer {
  // Constant after construction.
  bool save = false;
  // The cache's geometry, checked once when the transfer started.
  gpu_internal::CacheGeometry geometry;
  std::vector<int64_t> block_ids;
  std::vector<Piece> pieces;
  // Called only by the transport thread.
  SaveSink sink;
  LoadSource source;
  // The pipeline's per-layer events (StagingPipeline::layer_events_), kept
  // here so that WaitForLayerOn works after the pipeline is gone. Recorded
  // by the device stage thread only.
  std::shared_ptr<std::vector<DeviceEvent>> layer_events;

  // Device stage thread only. Per layer: pieces holding it not yet
  // launched; at 0 the layer's event is recorded.
  std::vector<size_t> layer_unlaunched;

  mutable absl::Mutex mu;
  size_t staged ABSL_GUARDED_BY(mu) = 0;   // pieces through the first stage
  size_t drained ABSL_GUARDED_BY(mu) = 0;  // pieces through the second stage
  // Per layer: pieces holding it that the device stage has not finished.
  std::vector<size_t> layer_pending ABSL_GUARDED_BY(mu);
  // Per layer: every copy of it is enqueued on the pipeline's stream and its
  // layer event recorded after them.
  std::vector<bool> layer_enqueued ABSL_GUARDED_BY(mu);
  // The first error; once set, both stages stop at their next piece.
  absl::Status status ABSL_GUARDED_BY(mu);
  // Both stages have returned: nothing of this transfer runs any more.
  bool done ABSL_GUARDED_BY(mu) = false;

  // InvalidArgument for a layer outside [0, num_layers).
  absl::Status CheckLayer(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (layer >= 0 && static_cast<size_t>(layer) < layer_pending.size()) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " is outside [0, ", layer_pending.size(), ")"));
  }

  void Fail(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (status.ok()) status = std::move(s);
  }
};

}  // namespace staging_internal

using staging_internal::Piece;
using staging_internal::Transfer;

// ---------------------------------------------------------------------------
// PendingTransfer

PendingTransfer::PendingTransfer(std::shared_ptr<Transfer> t)
    : transfer_(std::move(t)) {}

PendingTransfer::~PendingTransfer() { Wait().IgnoreError(); }

bool PendingTransfer::IsDone() const {
  absl::MutexLock lock(&transfer_->mu);
  return transfer_->done;
}

absl::Status PendingTransfer::Wait() {
  Transfer& t = *transfer_;
  absl::MutexLock lock(&t.mu);
  t.mu.Await(absl::Condition(&t.done));
  return t.status;
}

bool PendingTransfer::IsLayerDone(int layer) const {
  const Transfer& t = *transfer_;
  absl::MutexLock lock(&t.mu);
  return layer >= 0 && static_cast<size_t>(layer) < t.layer_pending.size() &&
         t.layer_pending[layer] == 0;
}

absl::Status PendingTransfer::WaitForLayer(int layer) {
  Transfer& t = *transfer_;
  absl::MutexLock lock(&t.mu);
  RETURN_IF_ERROR(t.CheckLayer(layer));
  // A failed transfer answers only once it is done, so that a caller who
  // falls back (recomputes the blocks) never races a scatter still running.
  auto ready = [&t, layer]() ABSL_SHARED_LOCKS_REQUIRED(t.mu) {
    return t.layer_pending[layer] == 0 || t.done;
  };
  t.mu.Await(absl::Condition(&ready));
  if (t.layer_pending[layer] == 0) return absl::OkStatus();
  return t.status;
}

absl::Status PendingTransfer::WaitForLayerOn(int layer, StreamRef stream) {
  Transfer& t = *transfer_;
  {
    absl::MutexLock lock(&t.mu);
    RETURN_IF_ERROR(t.CheckLayer(layer));
    // As WaitForLayer, a failure is answered only once nothing of the
    // transfer runs; but copies already enqueued need no host wait.
    auto ready = [&t, layer]() ABSL_SHARED_LOCKS_REQUIRED(t.mu) {
      return t.layer_pending[layer] == 0 || t.layer_enqueued[layer] || t.done;
    };
    t.mu.Await(absl::Condition(&ready));
    // Done: the device stage saw the copies finish (an event synchronized
    // on the host), so anything enqueued from now on runs after them.
    if (t.layer_pending[layer] == 0) return absl::OkStatus();
    if (!t.layer_enqueued[layer]) return t.status;  // done, failed
  }
  // Outside the lock: a later record of the event (a later transfer's copies
  // of the layer) only lengthens the wait, see staging.h.
  return (*t.layer_events)[layer].MakeStreamWait(stream);
}

// ---------------------------------------------------------------------------
// StagingPipeline

absl::StatusOr<std::unique_ptr<StagingPipeline>> StagingPipeline::Create(
    const KvLayout& layout, StreamRef stream, StagingOptions options) {
  if (options.num_buffers < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_buffers is ", options.num_buffers, "; the ring needs at least 2"));
  }
  if (options.layers_per_piece < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers_per_piece is ", options.layers_per_piece, "; it must be >= 0"));
  }
  if (options.layers_per_piece == 0 ||
      options.layers_per_piece > layout.num_layers()) {
    options.layers_per_piece = layout.num_layers();
  }
  if (options.blocks_per_piece < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks_per_piece is ", options.blocks_per_piece, "; it must be >= 1"));
  }
  if (options.order == PieceOrder::kObjectMajor &&
      options.blocks_per_piece > 1 &&
      options.layers_per_piece < layout.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "object-major pieces of ", options.blocks_per_piece,
        " blocks must hold whole objects (layers_per_piece 0), else objects "
        "would reach the transport interleaved; layers_per_piece is ",
        options.layers_per_piece, " of ", layout.num_layers()));
  }
  size_t buffer_bytes = 0;
  if (__builtin_mul_overflow(static_cast<size_t>(options.blocks_per_piece) *
                                 static_cast<size_t>(options.layers_per_piece),
                             layout.layer_bytes(), &buffer_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks_per_piece ", options.blocks_per_piece, " x layers_per_piece ",
        options.layers_per_piece, " x ", layout.layer_bytes(),
        " bytes per layer overflows a buffer size"));
  }
  ASSIGN_OR_RETURN(const int device, GetCurrentDevice());
  std::vector<HostBuffer> buffers;
  buffers.reserve(options.num_buffers);
  std::vector<const void*> pointers;
  std::vector<DeviceEvent> events;
  for (int i = 0; i < options.num_buffers; ++i) {
    ASSIGN_OR_RETURN(HostBuffer b, AllocateHostBuffer(buffer_bytes));
    pointers.push_back(b.data());
    buffers.push_back(std::move(b));
    ASSIGN_OR_RETURN(DeviceEvent e, DeviceEvent::Create());
    events.push_back(std::move(e));
  }
  auto layer_events = std::make_shared<std::vector<DeviceEvent>>();
  layer_events->reserve(layout.num_layers());
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSIGN_OR_RETURN(DeviceEvent e, DeviceEvent::Create());
    layer_events->push_back(std::move(e));
  }
  // Once, so that no piece checks them again.
  RETURN_IF_ERROR(
      gpu_internal::CheckObjectBuffers(pointers, buffer_bytes, device));
  std::unique_ptr<StagingPipeline> pipeline(new StagingPipeline(
      layout, stream, options, device, buffer_bytes, std::move(buffers),
      std::move(events), std::move(layer_events)));
  RETURN_IF_ERROR(pipeline->StartThreads());
  return pipeline;
}

StagingPipeline::StagingPipeline(
    const KvLayout& layout, StreamRef stream, StagingOptions options,
    int device, size_t buffer_bytes, std::vector<HostBuffer> buffers,
    std::vector<DeviceEvent> events,
    std::shared_ptr<std::vector<DeviceEvent>> layer_events)
    : layout_(layout),
      stream_(stream),
      options_(options),
      device_(device),
      buffer_bytes_(buffer_bytes),
      buffers_(std::move(buffers)),
      events_(std::move(events)),
      layer_events_(std::move(layer_events)) {}

absl::Status StagingPipeline::StartThreads() {
  // Out of threads (RLIMIT_NPROC, a container's pids limit) is an error for
  // the engine to hear of, not std::terminate in its process.
  try {
    device_thread_ = std::thread([this] { RunStage(Stage::kDevice); });
    transport_thread_ = std::thread([this] { RunStage(Stage::kTransport); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("staging pipeline: cannot start its threads: ", e.what()));
  }  // the destructor stops and joins the one that started
  // Linux limits thread names to 15 characters.
  pthread_setname_np(device_thread_.native_handle(), "kvd-stage-dev");
  pthread_setname_np(transport_thread_.native_handle(), "kvd-stage-xfer");
  return absl::OkStatus();
}

StagingPipeline::~StagingPipeline() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (device_thread_.joinable()) device_thread_.join();
  if (transport_thread_.joinable()) transport_thread_.join();
}

absl::StatusOr<std::unique_ptr<PendingTransfer>> StagingPipeline::StartSave(
    const KvCacheView& cache, absl::Span<const int64_t> block_ids,
    SaveSink sink) {
  if (!sink) return absl::InvalidArgumentError("the save sink is empty");
  ASSIGN_OR_RETURN(gpu_internal::CacheGeometry geometry,
                   gpu_internal::CheckCache(layout_, cache, device_));
  RETURN_IF_ERROR(gpu_internal::ValidateBlockIds(block_ids, cache.num_blocks,
                                                 /*allow_repeats=*/true));
  auto t = std::make_shared<Transfer>();
  t->geometry = std::move(geometry);
  t->save = true;
  t->block_ids.assign(block_ids.begin(), block_ids.end());
  t->sink = std::move(sink);
  return Start(std::move(t));
}

absl::StatusOr<std::unique_ptr<PendingTransfer>> StagingPipeline::StartLoad(
    const KvCacheView& cache, absl::Span<const int64_t> block_ids,
    LoadSource source) {
  if (!source) return absl::InvalidArgumentError("the load source is empty");
  ASSIGN_OR_RETURN(gpu_internal::CacheGeometry geometry,
                   gpu_internal::CheckCache(layout_, cache, device_));
  RETURN_IF_ERROR(gpu_internal::ValidateBlockIds(block_ids, cache.num_blocks,
                                                 /*allow_repeats=*/false));
  auto t = std::make_shared<Transfer>();
  t->geometry = std::move(geometry);
  t->save = false;
  t->block_ids.assign(block_ids.begin(), block_ids.end());
  t->source = std::move(source);
  return Start(std::move(t));
}

absl::StatusOr<std::unique_ptr<PendingTransfer>> StagingPipeline::Start(
    std::shared_ptr<Transfer> t) {
  const int layers = layout_.num_layers();
  const int step = options_.layers_per_piece;
  const size_t per = static_cast<size_t>(options_.blocks_per_piece);
  const size_t blocks = t->block_ids.size();
  auto piece = [&](size_t i, int first) {
    return Piece{i, std::min(per, blocks - i), first,
                 std::min(layers, first + step)};
  };
  t->pieces.reserve(((blocks + per - 1) / per) * ((layers + step - 1) / step));
  if (options_.order == PieceOrder::kLayerMajor) {
    for (int first = 0; first < layers; first += step) {
      for (size_t i = 0; i < blocks; i += per) {
        t->pieces.push_back(piece(i, first));
      }
    }
  } else {
    for (size_t i = 0; i < blocks; i += per) {
      for (int first = 0; first < layers; first += step) {
        t->pieces.push_back(piece(i, first));
      }
    }
  }
  t->layer_events = layer_events_;
  t->layer_unlaunched.assign(layers, 0);
  for (const Piece& p : t->pieces) {
    for (int l = p.first_layer; l < p.end_layer; ++l) ++t->layer_unlaunched[l];
  }
  {
    absl::MutexLock lock(&t->mu);
    t->layer_pending.assign(layers, blocks);
    t->layer_enqueued.assign(layers, false);
  }
  auto handle = std::unique_ptr<PendingTransfer>(new PendingTransfer(t));
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(t));
  return handle;
}

void StagingPipeline::RunStage(Stage stage) {
  const int me = static_cast<int>(stage);
  // The device stage's thread works on the device current when the pipeline
  // was created; if it cannot, every transfer fails with that error.
  const absl::Status bound =
      stage == Stage::kDevice ? SetCurrentDevice(device_) : absl::OkStatus();
  while (true) {
    std::shared_ptr<Transfer> t;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, me]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return (!queue_.empty() && !taken_[me]) || (stop_ && queue_.empty());
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and every transfer finished
      t = queue_.front();
      taken_[me] = true;
    }
    if (!bound.ok()) {
      absl::MutexLock lock(&t->mu);
      t->Fail(bound);
    } else if (stage == Stage::kDevice) {
      RunDeviceStage(*t);
    } else {
      RunTransportStage(*t);
    }
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = ++stages_finished_ == 2;
      if (last) {
        queue_.pop_front();
        taken_[0] = taken_[1] = false;
        stages_finished_ = 0;
      }
    }
    if (last) {
      absl::MutexLock lock(&t->mu);
      t->done = true;
    }
  }
}

// The transport stage: piece after piece through the caller's sink or
// source, each once its buffer is the stage's (see Transfer).
void StagingPipeline::RunTransportStage(Transfer& t) {
  const bool first = !t.save;
  const size_t ring = buffers_.size();
  for (size_t k = 0; k < t.pieces.size(); ++k) {
    {
      absl::MutexLock lock(&t.mu);
      auto ready = [&t, first, k, ring]() ABSL_SHARED_LOCKS_REQUIRED(t.mu) {
        return !t.status.ok() || (first ? k < t.drained + ring : k < t.staged);
      };
      t.mu.Await(absl::Condition(&ready));
      if (!t.status.ok()) return;
    }
    absl::Status s = TransportPiece(t, k);
    absl::MutexLock lock(&t.mu);
    if (!s.ok()) {
      t.Fail(std::move(s));
      return;
    }
    (first ? t.staged : t.drained) = k + 1;
  }
}

// The device stage launches each piece's copy on the stream as soon as its
// buffer is the stage's, and records the buffer's event after it; a piece
// is finished (handed to the transport, or its buffer freed and its layers
// done) once its event has completed. It waits for an event only when it
// can launch nothing more, so the device runs the pieces back to back while
// the host waits, rather than idling through a launch and a stream
// synchronization per piece. Piece k and piece k + ring share a buffer and
// its event: k + ring is launched only once k has finished. After the launch
// of the last piece holding a layer, the layer's event is recorded too
// (RecordLayersLaunched), for WaitForLayerOn.
void StagingPipeline::RunDeviceStage(Transfer& t) {
  const size_t ring = buffers_.size();
  const size_t n = t.pieces.size();
  size_t launched = 0;  // pieces whose launch was tried
  size_t finished = 0;  // pieces whose event completed (a prefix)
  // Whether piece `launched` may be launched: its buffer is the stage's.
  auto may_launch = [&]() ABSL_SHARED_LOCKS_REQUIRED(t.mu) {
    return launched < n &&
           (t.save ? launched < t.drained + ring : launched < t.staged);
  };
  absl::Status error;
  while (finished < n) {
    bool launch = false;
    {
      absl::MutexLock lock(&t.mu);
      if (launched == finished) {
        // Nothing in flight: wait for a buffer, or for the transfer to fail.
        auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(t.mu) {
          return !t.status.ok() || may_launch();
        };
        t.mu.Await(absl::Condition(&ready));
      }
      if (!t.status.ok()) break;
      launch = may_launch();
    }
    // Nothing to launch: wait for the oldest piece in flight (there is
    // one). Else hand over the oldest first if it has finished, without
    // waiting, so that the transport is never kept waiting by launches.
    bool finish = !launch;
    if (launch && launched > finished) {
      absl::StatusOr<bool> done = events_[finished % ring].IsComplete();
      if (!done.ok()) {
        error = done.status();
        break;
      }
      finish = *done;  // then Synchronize returns at once
    }
    if (finish) {
      error = events_[finished % ring].Synchronize();
      if (!error.ok()) break;
      FinishDevicePiece(t, finished++);
      continue;
    }
    const size_t k = launched++;  // counted before: a failed launch may
                                  // have enqueued part of its copy
    error = LaunchPiece(t, k);
    if (error.ok()) error = events_[k % ring].Record(stream_);
    if (error.ok()) error = RecordLayersLaunched(t, k);
    if (!error.ok()) break;
  }
  if (launched > finished) {
    // Launches still running may be touching the cache or the buffers:
    // nothing of this transfer may run once the stage returns.
    absl::Status synced = SynchronizeStream(stream_);
    if (error.ok()) error = std::move(synced);
  }
  if (!error.ok()) {
    absl::MutexLock lock(&t.mu);
    t.Fail(std::move(error));
  }
}

absl::Status StagingPipeline::RecordLayersLaunched(Transfer& t, size_t k) {
  const Piece& p = t.pieces[k];
  absl::InlinedVector<int, 8> recorded;
  absl::Status error;
  for (int l = p.first_layer; l < p.end_layer; ++l) {
    if (--t.layer_unlaunched[l] != 0) continue;
    // After the layer's last copy on the stream: the event follows them all
    // (the stream runs in order).
    error = (*layer_events_)[l].Record(stream_);
    if (!error.ok()) break;
    recorded.push_back(l);
  }
  // Only once recorded: a WaitForLayerOn that sees the flag waits on this
  // record, not on the event's previous one.
  absl::MutexLock lock(&t.mu);
  for (int l : recorded) t.layer_enqueued[l] = true;
  return error;
}

void StagingPipeline::FinishDevicePiece(Transfer& t, size_t k) {
  absl::MutexLock lock(&t.mu);
  (t.save ? t.staged : t.drained) = k + 1;
  const Piece& p = t.pieces[k];
  for (int l = p.first_layer; l < p.end_layer; ++l) {
    t.layer_pending[l] -= p.count;
  }
}

// Block j of piece k lies at j x its bytes in the buffer.
size_t StagingPipeline::PieceBytesPerBlock(const Transfer& t, size_t k) const {
  const Piece& p = t.pieces[k];
  return static_cast<size_t>(p.end_layer - p.first_layer) *
         layout_.layer_bytes();
}

absl::Status StagingPipeline::LaunchPiece(Transfer& t, size_t k) {
  const Piece& p = t.pieces[k];
  const char* const buffer = buffers_[k % buffers_.size()].data();
  const size_t bytes = PieceBytesPerBlock(t, k);
  absl::InlinedVector<const void*, 8> objects(p.count);
  for (size_t j = 0; j < p.count; ++j) objects[j] = buffer + j * bytes;
  return gpu_internal::CopyChecked(
      t.geometry, absl::MakeConstSpan(t.block_ids).subspan(p.index, p.count),
      LayerRange{p.first_layer, p.end_layer}, objects, /*to_cache=*/!t.save,
      stream_);
}

absl::Status StagingPipeline::TransportPiece(Transfer& t, size_t k) {
  const Piece& p = t.pieces[k];
  char* const buffer = buffers_[k % buffers_.size()].data();
  const uint64_t offset = p.first_layer * layout_.layer_bytes();
  const size_t bytes = PieceBytesPerBlock(t, k);
  for (size_t j = 0; j < p.count; ++j) {
    char* const piece = buffer + j * bytes;
    absl::Status s =
        t.save
            ? t.sink(p.index + j, offset, absl::Span<const char>(piece, bytes))
            : t.source(p.index + j, offset, absl::Span<char>(piece, bytes));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
