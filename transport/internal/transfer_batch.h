// TransferBatch: the shared state behind a TransferHandle. The endpoint
// fills it on the progress thread (one UCX request per transfer, then a
// flush); UCX completion callbacks count the requests down; the last one
// publishes the per-transfer statuses to waiting callers.
//
// Thread-safe for the TransferHandle methods; the rest is progress thread
// only. A batch keeps itself alive while UCX holds requests that point at
// it, so it outlives its endpoint if need be.
#ifndef KVDEPOT_TRANSPORT_INTERNAL_TRANSFER_BATCH_H_
#define KVDEPOT_TRANSPORT_INTERNAL_TRANSFER_BATCH_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvdepot::transport_internal {

class TransferBatch : public std::enable_shared_from_this<TransferBatch> {
 public:
  // kReceive: the bytes of every transfer come in one UCX request, a
  // message's rendezvous data received into them (UcxWorker::Receive),
  // posted as the batch's last request (index size(), the flush of the
  // others). Each transfer ends as that request does.
  enum class Op { kGet, kPut, kReceive };

  TransferBatch(Op op, size_t transfers, absl::Time deadline);
  TransferBatch(const TransferBatch&) = delete;
  TransferBatch& operator=(const TransferBatch&) = delete;

  // --- Any thread (TransferHandle). ---
  bool IsReady() const;
  bool WaitUntil(absl::Time deadline) const;
  size_t size() const { return size_; }
  // Calls `done` once the batch is ready: at once on this thread when it
  // already is, else on the progress thread when it becomes ready (in the
  // order they were added).
  void OnReady(absl::AnyInvocable<void() &&> done);
  // Calls `done` once UCX holds no request of the batch (it finished): at
  // once on this thread when it has, else on the progress thread when it
  // does (or on the thread that destroyed the worker: WorkerDestroyed).
  // Ready and finished together unless the batch was abandoned.
  void OnReleased(absl::AnyInvocable<void() &&> done);
  // REQUIRES: IsReady(). Immutable from then on.
  const std::vector<absl::Status>& result() const { return result_; }

  // --- Before Seal (the submitting thread, then the progress thread). ---
  Op op() const { return op_; }
  absl::Time deadline() const { return deadline_; }
  // Called on the progress thread with i as each get's bytes arrive, while
  // the batch is not yet published (never after: its buffers may be gone).
  void SetEachGot(absl::AnyInvocable<void(size_t)> each_got) {
    each_got_ = std::move(each_got);
  }
  // Transfer i will not be posted; it ends with `status`.
  void Refuse(size_t i, absl::Status status);
  bool refused(size_t i) const { return refused_[i]; }
  // No transfer of the batch will be posted: those not refused yet end
  // with `why`, and the batch is sealed (it ends now).
  void RefuseRest(const absl::Status& why);

  // --- Progress thread only. ---
  // Request parameters whose callback reports transfer i (i == size() is
  // the flush, or a kReceive batch's receive) to this batch.
  ucp_request_param_t Param(size_t i);
  // Accounts for what a ucp_*_nbx call for transfer i returned: done at
  // once, failed at once, or a request whose callback comes later.
  void Posted(size_t i, ucs_status_ptr_t result);
  // Every request is posted. Publishes the result now if none is
  // outstanding; otherwise the last callback does. `keep` is held until
  // then (the endpoint's rkeys, which requests in flight still use).
  void Seal(std::shared_ptr<void> keep);
  // The batch fails with `reason` (first reason wins): every transfer not
  // yet done successfully ends with it. Requests still in flight are left
  // to end (the endpoint force-closes them).
  void Abort(absl::Status reason);
  bool finished() const { return finished_; }
  // Publishes the result now, with every transfer not yet done ending with
  // the abort reason (or Cancelled), although UCX still holds requests of
  // this batch: for endpoints whose force-close does not end their
  // requests (no peer error handling). The batch stays alive for those
  // requests' sake; abandoned() tells the caller its buffers may still be
  // written. No effect once finished.
  void Abandon();
  // Any thread, after IsReady().
  bool abandoned() const;
  // The UCP worker has been destroyed, and with it every request of the
  // batch UCX still held (their callbacks never come): publishes what is
  // not yet (Abandon) and finishes. On the thread that destroyed it.
  void WorkerDestroyed();
  // REQUIRES: finished(). How the batch's flush ended.
  const absl::Status& flush_status() const { return op_status_[size_]; }

 private:
  struct Slot {
    TransferBatch* batch;
    size_t index;
  };
  static void OnRequestDone(void* request, ucs_status_t status,
                            void* user_data);
  static void OnReceiveDone(void* request, ucs_status_t status, size_t length,
                            void* user_data);
  void Done(size_t i, ucs_status_t status);
  // Transfer i (not the flush) succeeded: runs each_got_ for a get.
  void Got(size_t i);
  void Finish();
  // Computes result_ and sets ready_ (and released_ unless abandoned:
  // ready and released are seen together then).
  void Publish(bool abandoned);

  using Callback = absl::AnyInvocable<void() &&>;
  using Callbacks = std::vector<Callback>;
  // Runs `done` now when *flag is set, else queues it in *queue (flag and
  // queue: ready_/on_ready_ or released_/on_released_, under mu_).
  void RunOrQueue(const bool* flag, Callbacks* queue, Callback done);

  const Op op_;
  const size_t size_;
  const absl::Time deadline_;

  // Progress thread only (and the submitting thread before it posts).
  std::vector<absl::Status> op_status_;  // size_ transfers, then the flush
  std::vector<bool> refused_;
  std::vector<bool> pending_;  // a UCX request is in flight
  std::vector<Slot> slots_;
  size_t outstanding_ = 0;
  bool sealed_ = false;
  bool finished_ = false;
  bool published_ = false;
  absl::Status abort_reason_;
  std::shared_ptr<TransferBatch> self_;  // while requests are in flight
  std::shared_ptr<void> keep_;
  absl::AnyInvocable<void(size_t)> each_got_;

  // Written once by Finish before ready_ is set; read-only after.
  std::vector<absl::Status> result_;
  mutable absl::Mutex mu_;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  Callbacks on_ready_ ABSL_GUARDED_BY(mu_);
  bool released_ ABSL_GUARDED_BY(mu_) = false;  // finished, seen under mu_
  Callbacks on_released_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot::transport_internal

#endif  // KVDEPOT_TRANSPORT_INTERNAL_TRANSFER_BATCH_H_
