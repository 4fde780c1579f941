#include "transport/internal/transfer_batch.h"

#include <utility>

#include "transport/internal/ucs_status.h"

namespace kvdepot::transport_internal {

namespace {

// The status of a transfer UCX took and then failed: one that says its
// bytes may have moved in part, or may still move (transfer_handle.h:
// Unavailable, DeadlineExceeded or Cancelled), whatever UCS code it ended
// with. A fragment of an emulated put may have landed, a shared-memory
// write be queued; libkvdepot fences its worker before it hands back the
// buffers of a transfer that ended so (client.cc, MayLandLate), and
// UcsToStatus alone maps some failures (no memory or resource, an
// argument UCX found invalid) to codes that would not say it.
absl::Status TransferFailed(ucs_status_t status, std::string_view what) {
  absl::Status st = UcsToStatus(status, what);
  if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) ||
      absl::IsCancelled(st)) {
    return st;
  }
  return absl::UnavailableError(st.message());
}

}  // namespace

TransferBatch::TransferBatch(Op op, size_t transfers, absl::Time deadline)
    : op_(op),
      size_(transfers),
      deadline_(deadline),
      op_status_(transfers + 1),
      refused_(transfers, false),
      pending_(transfers + 1, false),
      slots_(transfers + 1) {
  for (size_t i = 0; i <= transfers; ++i) slots_[i] = Slot{this, i};
}

bool TransferBatch::IsReady() const {
  absl::MutexLock lock(&mu_);
  return ready_;
}

bool TransferBatch::WaitUntil(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(&ready_), deadline);
  return ready_;
}

void TransferBatch::OnReady(absl::AnyInvocable<void() &&> done) {
  RunOrQueue(&ready_, &on_ready_, std::move(done));
}

void TransferBatch::OnReleased(absl::AnyInvocable<void() &&> done) {
  RunOrQueue(&released_, &on_released_, std::move(done));
}

void TransferBatch::RunOrQueue(const bool* flag, Callbacks* queue, Callback done) {
  {
    absl::MutexLock lock(&mu_);
    if (!*flag) {
      queue->push_back(std::move(done));
      return;
    }
  }
  std::move(done)();
}

void TransferBatch::Refuse(size_t i, absl::Status status) {
  refused_[i] = true;
  op_status_[i] = std::move(status);
}

void TransferBatch::RefuseRest(const absl::Status& why) {
  for (size_t i = 0; i < size_; ++i) {
    if (!refused_[i]) Refuse(i, why);
  }
  Seal(nullptr);
}

ucp_request_param_t TransferBatch::Param(size_t i) {
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (op_ == Op::kReceive && i == size_) {
    param.cb.recv_am = &TransferBatch::OnReceiveDone;
  } else {
    param.cb.send = &TransferBatch::OnRequestDone;
  }
  param.user_data = &slots_[i];
  return param;
}

void TransferBatch::Posted(size_t i, ucs_status_ptr_t result) {
  if (result == nullptr) {  // done already
    Got(i);
    return;
  }
  if (UCS_PTR_IS_ERR(result)) {
    op_status_[i] = TransferFailed(UCS_PTR_STATUS(result),
                                   op_ == Op::kReceive ? "ucp_am_recv_data_nbx"
                                   : i == size_        ? "ucp_ep_flush_nbx"
                                   : op_ == Op::kGet   ? "ucp_get_nbx"
                                                       : "ucp_put_nbx");
    return;
  }
  pending_[i] = true;
  ++outstanding_;
}

void TransferBatch::OnRequestDone(void* request, ucs_status_t status,
                                  void* user_data) {
  const Slot* slot = static_cast<const Slot*>(user_data);
  ucp_request_free(request);
  slot->batch->Done(slot->index, status);
}

void TransferBatch::OnReceiveDone(void* request, ucs_status_t status,
                                  size_t /*length*/, void* user_data) {
  OnRequestDone(request, status, user_data);
}

void TransferBatch::Got(size_t i) {
  if (published_ || !each_got_) return;
  if (op_ == Op::kGet && i < size_) each_got_(i);
  if (op_ == Op::kReceive && i == size_) {
    for (size_t j = 0; j < size_; ++j) {
      if (!refused_[j]) each_got_(j);
    }
  }
}

void TransferBatch::Done(size_t i, ucs_status_t status) {
  pending_[i] = false;
  if (status != UCS_OK) {
    op_status_[i] = TransferFailed(status, i == size_ ? "flush" : "transfer");
  } else if (!abort_reason_.ok()) {
    // Ended after the batch was aborted (its deadline passed, or its
    // endpoint failed, and an orderly close let the peer take the rest
    // late): its caller has been told, or may have given up; it ends with
    // the abort's reason, not OK.
    op_status_[i] = abort_reason_;
  } else {
    Got(i);
  }
  --outstanding_;
  if (sealed_ && outstanding_ == 0) Finish();
}

void TransferBatch::Seal(std::shared_ptr<void> keep) {
  sealed_ = true;
  if (outstanding_ == 0) {
    Finish();
    return;
  }
  keep_ = std::move(keep);
  self_ = shared_from_this();
}

void TransferBatch::Abort(absl::Status reason) {
  if (abort_reason_.ok()) abort_reason_ = std::move(reason);
}

void TransferBatch::Finish() {
  finished_ = true;
  // Keep ourselves alive until the end of this call: dropping self_ may
  // release the last reference.
  std::shared_ptr<TransferBatch> self = std::move(self_);
  keep_.reset();
  if (!published_) {
    Publish(/*abandoned=*/false);  // ready and released at once
    return;
  }
  Callbacks run;
  {
    absl::MutexLock lock(&mu_);
    released_ = true;
    run.swap(on_released_);
  }
  for (Callback& c : run) std::move(c)();
}

void TransferBatch::Abandon() {
  if (finished_ || published_) return;
  if (abort_reason_.ok()) {
    abort_reason_ = absl::CancelledError("transfer abandoned");
  }
  // Requests still in flight have not succeeded: count them as failed.
  for (size_t i = 0; i <= size_; ++i) {
    if (pending_[i]) op_status_[i] = abort_reason_;
  }
  Publish(/*abandoned=*/true);
}

void TransferBatch::WorkerDestroyed() {
  if (finished_) return;
  Abandon();
  Finish();  // released now: nothing of UCX's can reach the buffers
}

bool TransferBatch::abandoned() const {
  absl::MutexLock lock(&mu_);
  return abandoned_;
}

void TransferBatch::Publish(bool abandoned) {
  published_ = true;
  const absl::Status& flush = op_status_[size_];
  result_.resize(size_);
  for (size_t i = 0; i < size_; ++i) {
    absl::Status s = op_status_[i];
    if (!refused_[i]) {
      // A get whose request completed has its bytes, whatever the flush
      // says; a put is only known to have landed once the flush succeeded,
      // a received transfer once the receive did.
      if (s.ok() && op_ != Op::kGet) s = flush;
      if (!s.ok() && !abort_reason_.ok()) s = abort_reason_;
    }
    result_[i] = std::move(s);
  }
  Callbacks ready, released;
  {
    absl::MutexLock lock(&mu_);
    abandoned_ = abandoned;
    ready_ = true;
    ready.swap(on_ready_);
    if (!abandoned) {  // from Finish: UCX holds no request either
      released_ = true;
      released.swap(on_released_);
    }
  }
  for (Callback& c : ready) std::move(c)();
  for (Callback& c : released) std::move(c)();
}

}  // namespace kvdepot::transport_internal
