#include "transport/ucx_worker.h"

#include <poll.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "storage/status_macros.h"
#include "transport/internal/send_message.h"
#include "transport/internal/transfer_batch.h"
#include "transport/internal/ucs_status.h"

namespace kvdepot {

using transport_internal::UcsToStatus;

UcxWorker::UcxWorker(UcxContext& context, UcxWorkerOptions options)
    : context_(context),
      options_(std::move(options)),
      unsent_replies_(std::make_shared<transport_internal::UnsentMessages>()) {}

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(
    UcxContext& context, const UcxWorkerOptions& options) {
  std::unique_ptr<UcxWorker> worker(new UcxWorker(context, options));
  absl::Notification started;
  absl::Status start_status;
  UcxWorker* w = worker.get();
  {
    absl::MutexLock lock(&w->join_mu_);
    w->thread_ = std::thread(
        [w, &started, &start_status] { w->ThreadMain(&started, &start_status); });
    pthread_setname_np(w->thread_.native_handle(),
                       options.name.substr(0, 15).c_str());
  }
  started.WaitForNotification();
  if (!start_status.ok()) return start_status;  // ~UcxWorker joins
  return worker;
}

UcxWorker::~UcxWorker() { Stop(); }

void UcxWorker::ThreadMain(absl::Notification* started,
                           absl::Status* start_status) {
  thread_id_ = std::this_thread::get_id();
  absl::Status status = Init();
  if (!status.ok()) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    *start_status = std::move(status);
    thread_id_ = std::thread::id();
    finished_.Notify();
    started->Notify();
    return;
  }
  started->Notify();
  Loop();
  Shutdown();
  thread_id_ = std::thread::id();
  finished_.Notify();
}

absl::Status UcxWorker::Init() {
  ucp_worker_params_t params = {};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(context_.handle(), &params, &worker_);
  if (st != UCS_OK) return UcsToStatus(st, "ucp_worker_create");
  st = ucp_worker_get_efd(worker_, &event_fd_);
  if (st == UCS_OK) {
    ucp_address_t* address = nullptr;
    size_t length = 0;
    st = ucp_worker_get_address(worker_, &address, &length);
    if (st == UCS_OK) {
      address_.assign(reinterpret_cast<const char*>(address), length);
      ucp_worker_release_address(worker_, address);
    }
  }
  if (st != UCS_OK) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    return UcsToStatus(st, "UCX worker setup");
  }
  return absl::OkStatus();
}

ucs_status_t UcxWorker::OnWholeMessage(void* arg, const void* header,
                                       size_t header_length, void* data,
                                       size_t length,
                                       const ucp_am_recv_param_t* param) {
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    return UCS_OK;  // not received: UCX drops it
  }
  auto* entry = static_cast<WholeHandler*>(arg);
  ucp_ep_h reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0
                          ? param->reply_ep
                          : nullptr;
  entry->handler(absl::string_view(static_cast<const char*>(header), header_length),
                 absl::string_view(static_cast<const char*>(data), length),
                 MessageSender(entry->worker, reply_ep));
  return UCS_OK;  // the bytes are UCX's again
}

ucs_status_t UcxWorker::OnDataMessage(void* arg, const void* header,
                                      size_t header_length, void* data,
                                      size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* entry = static_cast<DataHandler*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // Eager bytes in a buffer UCX lets us keep are held there, not copied
  // (a peer sending large messages eagerly cost them twice in memory).
  const bool keep =
      rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  ucp_ep_h reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0
                          ? param->reply_ep
                          : nullptr;
  std::unique_ptr<IncomingData> in(
      keep ? new IncomingData(entry->worker, data, length, /*eager=*/!rndv,
                              std::string())
           : new IncomingData(
                 entry->worker, nullptr, length, /*eager=*/true,
                 std::string(static_cast<const char*>(data), length)));
  entry->handler(absl::string_view(static_cast<const char*>(header), header_length),
                 std::move(in), MessageSender(entry->worker, reply_ep));
  // A kept descriptor is UCX's until released (or, rendezvous, received),
  // which happens after this callback (IncomingData defers both).
  return keep ? UCS_INPROGRESS : UCS_OK;
}

UcxWorker::IncomingData::~IncomingData() {
  if (desc_ == nullptr) return;
  auto release = [w = worker_, desc = desc_] {
    if (w->worker_ != nullptr) ucp_am_data_release(w->worker_, desc);
  };
  if (worker_->OnProgressThread()) {
    worker_->Defer(std::move(release));
  } else {
    // Stopping: the UCP worker's destruction frees the descriptor.
    worker_->Post(std::move(release)).IgnoreError();
  }
}

absl::Status UcxWorker::SetDataMessageHandler(uint16_t id,
                                              DataMessageHandler handler) {
  absl::Status status;
  RETURN_IF_ERROR(Run([this, id, &handler, &status] {
    auto owned = std::make_unique<DataHandler>(DataHandler{this, std::move(handler)});
    status = SetAmHandler(id, &UcxWorker::OnDataMessage, owned.get());
    if (status.ok()) data_handlers_[id] = std::move(owned);
  }));
  return status;
}

absl::Status UcxWorker::SetAmHandler(uint16_t id, ucp_am_recv_callback_t cb,
                                     void* arg) {
  ucp_am_handler_param_t param = {};
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                     UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;
  param.cb = cb;
  param.arg = arg;
  ucs_status_t st = ucp_worker_set_am_recv_handler(worker_, &param);
  return st == UCS_OK ? absl::OkStatus()
                      : UcsToStatus(st, "ucp_worker_set_am_recv_handler");
}

namespace {

// Progress calls that found work between two looks at the queue, timers
// and ticks (Loop). Each call handles a few events; 64 keeps the queue's
// latency far below a millisecond's worth of messages.
constexpr int kProgressBurst = 64;

}  // namespace

TransferHandle UcxWorker::Receive(std::unique_ptr<IncomingData> data, char* to,
                                  absl::Time deadline,
                                  absl::AnyInvocable<void(size_t)> each_got) {
  if (to == nullptr || data == nullptr) {
    auto batch = std::make_shared<transport_internal::TransferBatch>(
        transport_internal::TransferBatch::Op::kReceive, 1, deadline);
    batch->RefuseRest(
        absl::InvalidArgumentError("nothing to receive, or nowhere"));
    return TransferHandle(batch);
  }
  const size_t size = data->size();
  return Receive(std::move(data), {absl::Span<char>(to, size)}, deadline,
                 std::move(each_got));
}

TransferHandle UcxWorker::Receive(std::unique_ptr<IncomingData> data,
                                  std::vector<absl::Span<char>> pieces,
                                  absl::Time deadline,
                                  absl::AnyInvocable<void(size_t)> each_got) {
  using transport_internal::TransferBatch;
  auto batch = std::make_shared<TransferBatch>(TransferBatch::Op::kReceive,
                                               pieces.size(), deadline);
  if (each_got) batch->SetEachGot(std::move(each_got));
  TransferHandle handle(batch);
  size_t total = 0;
  for (const absl::Span<char>& p : pieces) total += p.size();
  if (data == nullptr || pieces.empty() || total != data->size()) {
    batch->RefuseRest(absl::InvalidArgumentError(
        absl::StrCat("pieces of ", total, " bytes for data of ",
                     data == nullptr ? 0 : data->size())));
    return handle;  // `data` is released unread
  }
  auto start = [this, batch, data = std::move(data),
                pieces = std::move(pieces)]() mutable {
    StartReceive(std::move(batch), std::move(data), std::move(pieces));
  };
  if (OnProgressThread()) {
    Defer(std::move(start));  // perhaps inside a UCX callback now
  } else if (!Post(std::move(start)).ok()) {
    batch->RefuseRest(absl::UnavailableError("UCX worker is stopping"));
  }
  return handle;
}

void UcxWorker::StartReceive(
    std::shared_ptr<transport_internal::TransferBatch> batch,
    std::unique_ptr<IncomingData> data, std::vector<absl::Span<char>> pieces) {
  const size_t last = batch->size();  // the receive's index in the batch
  if (batch->deadline() <= absl::Now()) {
    // Its deadline passed before it could start (this thread was busy or
    // stalled, or the caller was late): its caller may have given up on
    // it and handed the memory on, so no byte goes there, as for a batch
    // of UcxEndpoint's (Post). The data is released unread as `data` goes
    // (IncomingData's destructor, deferred out of any UCX callback): the
    // sender's send ends.
    batch->RefuseRest(absl::DeadlineExceededError(
        "received data's deadline passed before the receive started (the "
        "progress thread was stalled or busy)"));
    return;
  }
  if (data->eager_sent_) {  // its bytes are here (released as `data` goes)
    const char* bytes = data->eager_bytes();
    size_t off = 0;
    for (const absl::Span<char>& p : pieces) {
      if (p.data() != nullptr) std::memcpy(p.data(), bytes + off, p.size());
      off += p.size();
    }
    batch->Posted(last, nullptr);
    batch->Seal(nullptr);
    return;
  }
  ucp_request_param_t param = batch->Param(last);
  void* desc = std::exchange(data->desc_, nullptr);
  // What the receive uses until it ends: its iov array, and the scratch
  // buffer it writes dropped pieces into (held here too, so that a
  // receive abandoned past its deadline never writes into freed memory).
  struct Keep {
    std::vector<ucp_dt_iov_t> iov;
    std::shared_ptr<char[]> discard;
  };
  std::shared_ptr<Keep> keep;
  if (pieces.size() == 1 && pieces[0].data() != nullptr) {
    batch->Posted(last, ucp_am_recv_data_nbx(worker_, desc, pieces[0].data(),
                                             data->size_, &param));
  } else {
    keep = std::make_shared<Keep>();
    size_t entries = 0;
    for (const absl::Span<char>& p : pieces) {
      entries += p.data() != nullptr
                     ? 1
                     : (p.size() + kDiscardScratch - 1) / kDiscardScratch;
    }
    keep->iov.reserve(entries);
    for (const absl::Span<char>& p : pieces) {
      if (p.data() != nullptr) {
        keep->iov.push_back({p.data(), p.size()});
        continue;
      }
      // A dropped piece goes into the one scratch buffer, kDiscardScratch
      // bytes at a time: its iov entries overlap, which UCX allows (it
      // copies each fragment where its entry says), and the bytes are
      // garbage anyway. So the memory dropping costs stays bounded,
      // whatever the size of the pieces dropped.
      if (discard_ == nullptr) {
        discard_.reset(new char[kDiscardScratch]);
        discard_size_ = kDiscardScratch;
      }
      keep->discard = discard_;
      for (size_t off = 0; off < p.size(); off += kDiscardScratch) {
        keep->iov.push_back(
            {discard_.get(), std::min(kDiscardScratch, p.size() - off)});
      }
    }
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
    batch->Posted(last, ucp_am_recv_data_nbx(worker_, desc, keep->iov.data(),
                                             keep->iov.size(), &param));
  }
  batch->Seal(keep);
  if (batch->finished()) return;
  std::weak_ptr<transport_internal::TransferBatch> weak = batch;
  receives_.push_back({batch->deadline(), weak});
  WakeAt(batch->deadline());
  // Receives that ended leave the list at the next tick; a fast stream of
  // them between ticks is compacted now and then, so the list stays near
  // the number in flight.
  if (receives_.size() >= 2 * receives_kept_ + 64) TickReceives(absl::InfinitePast());
  AtDestroy(weak, [] {}, [weak] {
    if (std::shared_ptr<transport_internal::TransferBatch> b = weak.lock()) {
      b->WorkerDestroyed();
    }
  });
}

void UcxWorker::TickReceives(absl::Time now) {
  size_t kept = 0;
  for (PendingReceive& r : receives_) {
    std::shared_ptr<transport_internal::TransferBatch> b = r.batch.lock();
    if (b == nullptr || b->finished()) continue;
    if (r.deadline <= now) {
      // UCX 1.13 cannot cancel a rendezvous receive: the request ends when
      // the bytes come or the sender's connection fails (or the worker
      // goes: AtDestroy).
      b->Abort(absl::DeadlineExceededError(
          "rendezvous data did not arrive before its deadline"));
      b->Abandon();
      continue;
    }
    next_tick_ = std::min(next_tick_, r.deadline);
    receives_[kept++] = std::move(r);
  }
  receives_.resize(kept);
  receives_kept_ = kept;
}

void UcxWorker::MessageSender::Reply(uint16_t id, std::string header,
                                     std::string payload) const {
  if (ep_ == nullptr) return;
  if (!worker_->unsent_replies_->Admits(
          worker_->options_.max_unsent_reply_bytes,
          transport_internal::MessageWeight(header.size(), payload.size()))) {
    return;  // dropped: senders are not taking their answers
  }
  transport_internal::PostMessage(ep_, id, std::move(header), std::move(payload),
                                  worker_->unsent_replies_);
}

absl::Status UcxWorker::SetMessageHandler(uint16_t id, MessageHandler handler) {
  absl::Status status;
  RETURN_IF_ERROR(Run([this, id, &handler, &status] {
    auto owned =
        std::make_unique<WholeHandler>(WholeHandler{this, std::move(handler)});
    status = SetAmHandler(id, &UcxWorker::OnWholeMessage, owned.get());
    // The previous handler of `id` is no longer called.
    if (status.ok()) message_handlers_[id] = std::move(owned);
  }));
  return status;
}

bool UcxWorker::OnProgressThread() const {
  return std::this_thread::get_id() == thread_id_;
}

absl::Status UcxWorker::Enqueue(absl::AnyInvocable<void() &&> task,
                                bool bounded) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("UCX worker is stopping");
    if (bounded && queue_.size() >= options_.queue_capacity) {
      return absl::ResourceExhaustedError(
          "UCX worker queue is full (queue_capacity tasks waiting)");
    }
    queue_.push_back(std::move(task));
    // Signalled under mu_: the worker is destroyed under mu_ too, after
    // stopping_ is set. ucp_worker_signal is thread-safe by UCX's contract,
    // whatever the worker's thread mode. A task queued by the progress
    // thread itself (a reply sent from a completion callback) needs no
    // signal: the loop looks at the queue before it sleeps (an eventfd
    // write, its read and another round of progress saved per task).
    if (!wake_pending_ && !OnProgressThread()) {
      wake_pending_ = true;
      ucp_worker_signal(worker_);
    }
  }
  return absl::OkStatus();
}

absl::Status UcxWorker::Submit(absl::AnyInvocable<void() &&> task) {
  return Enqueue(std::move(task), /*bounded=*/true);
}

absl::Status UcxWorker::Post(absl::AnyInvocable<void() &&> task) {
  return Enqueue(std::move(task), /*bounded=*/false);
}

absl::Status UcxWorker::Run(absl::AnyInvocable<void() &&> task) {
  if (OnProgressThread()) {
    std::move(task)();
    return absl::OkStatus();
  }
  absl::Notification done;
  absl::Status status = Enqueue(
      [&task, &done] {
        std::move(task)();
        done.Notify();
      },
      /*bounded=*/false);
  if (!status.ok()) {
    // Residents rely on this: once Run fails, OnStop has run.
    finished_.WaitForNotification();
    return status;
  }
  done.WaitForNotification();
  return absl::OkStatus();
}

void UcxWorker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      ucp_worker_signal(worker_);
    }
  }
  absl::MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
  bool fenced;
  {
    absl::MutexLock worker_lock(&mu_);
    fenced = worker_ != nullptr;
  }
  if (fenced) DestroyWorker();
}

void UcxWorker::DestroyWorker() {
  std::vector<DestroyHook> hooks = std::move(destroy_hooks_);
  destroy_hooks_.clear();
  for (DestroyHook& h : hooks) {
    if (!h.owner.expired()) std::move(h.before)();
  }
  {
    absl::MutexLock lock(&mu_);
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  for (DestroyHook& h : hooks) {
    if (!h.owner.expired()) std::move(h.after)();
  }
}

void UcxWorker::AtDestroy(std::weak_ptr<const void> owner,
                          absl::AnyInvocable<void() &&> before,
                          absl::AnyInvocable<void() &&> after) {
  if (worker_ == nullptr) return;
  destroy_hooks_.erase(
      std::remove_if(destroy_hooks_.begin(), destroy_hooks_.end(),
                     [](const DestroyHook& h) { return h.owner.expired(); }),
      destroy_hooks_.end());
  destroy_hooks_.push_back({std::move(owner), std::move(before), std::move(after)});
}

void UcxWorker::Fence(absl::AnyInvocable<void() &&> then) {
  if (OnProgressThread()) {
    FenceHere();
    Defer(std::move(then));  // after the current progress call, if any
    return;
  }
  // Unavailable: stopping already; Run then returns once the thread is done.
  Run([this] { FenceHere(); }).IgnoreError();
  std::move(then)();
}

void UcxWorker::FenceHere() {
  fenced_ = true;
  absl::MutexLock lock(&mu_);
  stopping_ = true;  // Loop ends once the queue is empty
}

void UcxWorker::AddResident(Resident* resident) {
  residents_.push_back(resident);
}

void UcxWorker::RemoveResident(Resident* resident) {
  residents_.erase(std::remove(residents_.begin(), residents_.end(), resident),
                   residents_.end());
}

void UcxWorker::WakeAt(absl::Time when) {
  next_tick_ = std::min(next_tick_, when);
  next_sender_tick_ = std::min(next_sender_tick_, when);
}

void UcxWorker::Defer(absl::AnyInvocable<void() &&> task) {
  deferred_.push_back(std::move(task));
}

void UcxWorker::RunAt(absl::Time when, absl::AnyInvocable<void() &&> task) {
  timers_.emplace_back(when, std::move(task));
  WakeAt(when);
}

void UcxWorker::CloseEndpoint(ucp_ep_h ep, bool force,
                              std::shared_ptr<const void> keep) {
  if (!force) {
    // Flushed first, with the endpoint still open: a close would otherwise
    // leave UCX waiting on a peer that may never read again (and abort at
    // Stop), and a forced close of an endpoint with sends such a peer has
    // not taken yet crashed UCX 1.13's TCP transport when the peer
    // continued (transport/README, caveat 8).
    auto close = std::make_unique<FlushingClose>();
    close->worker = this;
    close->ep = ep;
    close->keep = std::move(keep);
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = [](void* /*request*/, ucs_status_t status, void* user_data) {
      auto* c = static_cast<FlushingClose*>(user_data);
      c->status = status;
      c->worker->Defer([c] { c->worker->EndFlushingClose(c); });
    };
    param.user_data = close.get();
    void* request = ucp_ep_flush_nbx(ep, &param);
    if (UCS_PTR_IS_PTR(request)) {
      close->request = request;
      flushing_closes_.push_back(std::move(close));
      endpoints_closing_.store(flushing_closes_.size());
      return;
    }
    // Flushed already, or failed: closed now, `keep` with it.
    force = UCS_PTR_STATUS(request) != UCS_OK;
  }
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* request = ucp_ep_close_nbx(ep, &param);
  // Errors mean the endpoint is gone already; nothing to wait for.
  if (UCS_PTR_IS_PTR(request)) close_requests_.push_back(request);
}

void UcxWorker::EndFlushingClose(FlushingClose* close) {
  auto it = std::find_if(flushing_closes_.begin(), flushing_closes_.end(),
                         [close](const auto& c) { return c.get() == close; });
  if (it == flushing_closes_.end()) return;  // cannot happen: ends once
  std::unique_ptr<FlushingClose> c = std::move(*it);
  flushing_closes_.erase(it);
  endpoints_closing_.store(flushing_closes_.size());
  ucp_request_free(c->request);
  if (!c->forced) CloseEndpoint(c->ep, /*force=*/c->status != UCS_OK);
}

void UcxWorker::ReapCloses() {
  auto done = [](void* request) {
    if (ucp_request_check_status(request) == UCS_INPROGRESS) return false;
    ucp_request_free(request);
    return true;
  };
  close_requests_.erase(
      std::remove_if(close_requests_.begin(), close_requests_.end(), done),
      close_requests_.end());
}

bool UcxWorker::RunQueued() {
  std::deque<absl::AnyInvocable<void() &&>> tasks;
  {
    absl::MutexLock lock(&mu_);
    if (queue_.empty()) return !stopping_;
    tasks.swap(queue_);
  }
  for (auto& task : tasks) std::move(task)();
  return true;
}

void UcxWorker::RunDeferred() {
  while (!deferred_.empty()) {
    std::vector<absl::AnyInvocable<void() &&>> tasks;
    tasks.swap(deferred_);
    for (auto& task : tasks) std::move(task)();
  }
}

void UcxWorker::TickResidents() {
  const absl::Time now = absl::Now();
  if (now < next_tick_) return;
  next_tick_ = absl::InfiniteFuture();
  std::vector<absl::AnyInvocable<void() &&>> due;
  for (auto it = timers_.begin(); it != timers_.end();) {
    if (it->first <= now) {
      due.push_back(std::move(it->second));
      it = timers_.erase(it);
    } else {
      next_tick_ = std::min(next_tick_, it->first);
      ++it;
    }
  }
  for (auto& task : due) std::move(task)();
  TickReceives(now);
  next_sender_tick_ = absl::InfiniteFuture();
  ForEachResident([this, now](Resident* r) {
    const absl::Time next = r->OnTick(now);
    next_tick_ = std::min(next_tick_, next);
    if (r->TickBeforeProgress()) {
      next_sender_tick_ = std::min(next_sender_tick_, next);
    }
  });
}

template <typename Fn>
void UcxWorker::ForEachResident(Fn fn) {
  // A resident may remove others (or itself) from inside a call: call only
  // those still registered.
  const std::vector<Resident*> residents = residents_;
  for (Resident* r : residents) {
    if (std::find(residents_.begin(), residents_.end(), r) != residents_.end()) {
      fn(r);
    }
  }
}

void UcxWorker::TickSenders() {
  const absl::Time now = absl::Now();
  if (now < next_sender_tick_) return;
  next_sender_tick_ = absl::InfiniteFuture();
  // next_tick_ stays: TickResidents follows, and calls these again.
  ForEachResident([this, now](Resident* r) {
    if (r->TickBeforeProgress()) {
      next_sender_tick_ = std::min(next_sender_tick_, r->OnTick(now));
    }
  });
}

void UcxWorker::Loop() {
  while (RunQueued()) {
    if (fenced_) continue;  // only the queued tasks, then Shutdown
    // Senders' deadlines before progress, and between its calls: after a
    // stall of this thread (SIGSTOP, swapping, a long task) a batch past
    // its deadline ends, its endpoint closed, before progress sends more of
    // it -- its peer may have given up on it and reused the memory.
    TickSenders();
    // At most kProgressBurst progress calls that found work, then the
    // queue, timers and ticks again: a peer sending faster than its
    // messages are handled must not hold back queued tasks (a Run waiting
    // on them, replies handed over by Post) and deadlines until its backlog
    // is gone.
    int found = 0;
    while (!fenced_ && found < kProgressBurst &&
           ucp_worker_progress(worker_) != 0) {
      ++found;
      RunDeferred();
      TickSenders();
    }
    const bool more = found == kProgressBurst;
    RunDeferred();
    ReapCloses();
    TickResidents();
    if (more || !deferred_.empty() || fenced_) continue;
    SleepUntilEvent();
  }
}

void UcxWorker::SleepUntilEvent() {
  // Arming drains the event fd; events that arrived since the last progress
  // make it fail with BUSY, and the loop progresses again.
  if (ucp_worker_arm(worker_) != UCS_OK) return;
  {
    absl::MutexLock lock(&mu_);
    if (!queue_.empty() || stopping_) return;
    // From here on a Submit signals again; a signal sent before this point
    // that arm did not consume only makes poll return early.
    wake_pending_ = false;
  }
  absl::Duration wait = options_.idle_tick;
  if (next_tick_ != absl::InfiniteFuture()) {
    wait = std::min(wait, next_tick_ - absl::Now());
  }
  // Round up: waking a little late for a deadline is fine, spinning is not.
  const int timeout_ms = static_cast<int>(std::max<int64_t>(
      0, absl::ToInt64Milliseconds(wait + absl::Microseconds(999))));
  pollfd fd = {event_fd_, POLLIN, 0};
  while (poll(&fd, 1, timeout_ms) < 0 && errno == EINTR) {
  }
}

void UcxWorker::Shutdown() {
  RunDeferred();
  ForEachResident([](Resident* r) { r->OnStop(); });
  residents_.clear();
  RunDeferred();
  // Timers stand for promises (batches to end); keep them now.
  while (!timers_.empty()) {
    auto timers = std::move(timers_);
    timers_.clear();
    for (auto& [when, task] : timers) std::move(task)();
  }
  RunDeferred();  // what the timers' callbacks handed over
  // Endpoints still flushing before an orderly close go now, by force:
  // their flushes end (cancelled) in the progress calls below.
  for (const auto& c : flushing_closes_) {
    if (c->forced) continue;
    c->forced = true;
    CloseEndpoint(c->ep, /*force=*/true);
  }
  // Closes end in progress calls, which a fenced worker makes no more.
  const absl::Time give_up = absl::Now() + options_.close_timeout;
  while (!fenced_ && (!close_requests_.empty() || !flushing_closes_.empty()) &&
         absl::Now() < give_up) {
    ucp_worker_progress(worker_);
    RunDeferred();
    ReapCloses();
  }
  // Requests still open are released with the worker. A flush whose
  // callback may still come keeps its record (a few bytes, at Stop only).
  for (void* request : close_requests_) ucp_request_free(request);
  close_requests_.clear();
  for (auto& c : flushing_closes_) static_cast<void>(c.release());
  flushing_closes_.clear();
  endpoints_closing_.store(0);
  // A fenced worker's UCP worker (its connections) goes in Stop, later:
  // see Fence.
  if (fenced_) return;
  // No signal can be in flight: signals are sent under mu_ while
  // !stopping_.
  DestroyWorker();
}

}  // namespace kvdepot
