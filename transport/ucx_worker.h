// UcxWorker: one UCP worker and the one thread that owns it. The worker is
// created, progressed and destroyed on that thread only
// (UCS_THREAD_MODE_SINGLE); other threads hand it work through a bounded
// queue and wake it with ucp_worker_signal. Between events the thread sleeps
// on the worker's event fd, so an idle worker costs no CPU.
//
// Things that live on the worker (endpoints, the peer monitor) register as a
// Resident: they get timer ticks for their deadlines and are told to release
// their UCX objects when the worker stops.
//
// Thread-safe, except the methods marked "progress thread only".
#ifndef KVDEPOT_TRANSPORT_UCX_WORKER_H_
#define KVDEPOT_TRANSPORT_UCX_WORKER_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/transfer_handle.h"
#include "transport/ucx_context.h"

namespace kvdepot {

namespace transport_internal {
struct UnsentMessages;
}  // namespace transport_internal

struct UcxWorkerOptions {
  // The progress thread's name (Linux keeps 15 characters).
  std::string name = "ucx-progress";
  // Tasks waiting for the progress thread; Submit fails beyond this.
  size_t queue_capacity = 4096;
  // The longest the thread sleeps without an event. UCX's keepalive and
  // endpoint checks run only inside progress, so this bounds how late they
  // can be; Resident deadlines wake the thread on time regardless.
  absl::Duration idle_tick = absl::Milliseconds(20);
  // How long Stop waits for endpoint close requests to finish before it
  // destroys the worker anyway.
  absl::Duration close_timeout = absl::Seconds(1);
  // Bytes of MessageSender::Reply's messages UCX may hold unsent, for all
  // senders together (each counted as UcxEndpointOptions::
  // max_unsent_message_bytes counts): past it a reply is dropped (its
  // sender's deadline tells it), so that senders that do not read their
  // answers cannot make this worker hold them without bound. These
  // replies go over endpoints this worker may not own, which it cannot
  // close. 0: no bound.
  size_t max_unsent_reply_bytes = size_t{4} << 20;
};

class UcxWorker {
 public:
  // Something that owns UCX objects on this worker.
  class Resident {
   public:
    virtual ~Resident() = default;
    // Progress thread. Called when the time returned by the previous call
    // (or passed to WakeAt) has come; returns when it wants the next call
    // (absl::InfiniteFuture() for never).
    virtual absl::Time OnTick(absl::Time now) = 0;
    // Whether OnTick also runs before each progress call once its time has
    // come: for a resident whose deadlines bound what it sends (nothing
    // more of a batch past its deadline goes out after a stall of this
    // process). Those that wait for answers keep the default, ticked only
    // after progress, so that an answer that arrived in time is taken.
    virtual bool TickBeforeProgress() const { return false; }
    // Progress thread, once, when the worker stops: fail whatever is in
    // flight and close every endpoint (CloseEndpoint). No further calls
    // follow.
    virtual void OnStop() = 0;
  };

  // Starts the progress thread and creates the worker on it. Returns UCX's
  // error when the worker cannot be created.
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(
      UcxContext& context, const UcxWorkerOptions& options = {});

  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  // Stop().
  ~UcxWorker();

  // This worker's address (ucp_worker_get_address): opaque bytes a peer
  // passes to ucp_ep_create. Stays valid after Stop.
  const std::string& address() const { return address_; }

  // Queues `task` to run on the progress thread, in submission order.
  // ResourceExhausted when queue_capacity tasks are already waiting;
  // Unavailable once Stop has begun (the task is dropped, never run).
  absl::Status Submit(absl::AnyInvocable<void() &&> task);

  // Queues `task` like Submit, but not bounded by queue_capacity (for
  // messages and control work whose number the caller bounds itself).
  // Unavailable once Stop has begun (the task is dropped, never run). On
  // the progress thread it still queues: the task runs after those queued
  // before it.
  absl::Status Post(absl::AnyInvocable<void() &&> task);

  // Runs `task` on the progress thread and waits for it; inline when called
  // on the progress thread. Not bounded by queue_capacity (for control
  // operations, not the data path). Unavailable once Stop has begun; it
  // then returns only after the thread has finished (every Resident's
  // OnStop has run).
  absl::Status Run(absl::AnyInvocable<void() &&> task);

  // The sender of a message being handled: Reply answers it over the
  // connection the message came on (for a peer this worker has no endpoint
  // to). Valid only during the handler's call.
  class MessageSender {
   public:
    MessageSender(UcxWorker* worker, ucp_ep_h ep) : worker_(worker), ep_(ep) {}
    // Sends message `id` back, as UcxEndpoint::SendMessage does; dropped
    // when the sender cannot be answered (it sent without a reply
    // endpoint), or when max_unsent_reply_bytes are waiting already.
    void Reply(uint16_t id, std::string header, std::string payload) const;
    // The endpoint UCX gave for answering the sender (the message's reply
    // endpoint: this worker's endpoint to the sending worker, one of its
    // own when it made one to it); null when the sender gave none. Only to
    // compare: valid during the handler's call.
    ucp_ep_h endpoint() const { return ep_; }

   private:
    UcxWorker* worker_;
    ucp_ep_h ep_;
  };
  // Calls `handler(header, payload, sender)` on the progress thread for
  // every active message `id` that arrives on this worker (UcxEndpoint::
  // SendMessage on the peer's side), whole, with bytes valid only during
  // the call; it must not block. Replaces an earlier handler of `id`.
  // Messages a peer sends as rendezvous (larger than UCX sends eagerly,
  // which SendMessage never asks for) are dropped.
  using MessageHandler = absl::AnyInvocable<void(
      absl::string_view header, absl::string_view payload,
      const MessageSender& sender)>;
  absl::Status SetMessageHandler(uint16_t id, MessageHandler handler);

  // The data of a message a peer sent as rendezvous (UcxEndpoint::
  // SendMessageWithData): it stays with the sender until Receive takes it.
  // Destroying it unreceived releases it (ucp_am_data_release, outside any
  // UCX callback): the sender's send ends, its bytes unread. Any thread;
  // the worker must outlive it.
  class IncomingData {
   public:
    IncomingData(const IncomingData&) = delete;
    IncomingData& operator=(const IncomingData&) = delete;
    ~IncomingData();
    size_t size() const { return size_; }
    // Whether UCX brought the bytes with the message (the sender sent them
    // eagerly, not as rendezvous): they are held here, whole, until this
    // goes -- UCX 1.13 puts no bound on an eager message's size. Held in
    // UCX's own receive buffer where UCX lets it be kept
    // (UCP_AM_RECV_ATTR_FLAG_DATA), copied otherwise.
    bool eager() const { return eager_sent_; }
    // The worker it came on (where Receive takes it).
    UcxWorker& worker() const { return *worker_; }

   private:
    friend class UcxWorker;
    IncomingData(UcxWorker* worker, void* desc, size_t size, bool eager,
                 std::string copy)
        : worker_(worker),
          desc_(desc),
          size_(size),
          eager_sent_(eager),
          copy_(std::move(copy)) {}
    // The bytes UCX brought with the message (eager() only).
    const char* eager_bytes() const {
      return desc_ != nullptr ? static_cast<const char*>(desc_) : copy_.data();
    }
    UcxWorker* worker_;
    // UCX's descriptor until released: a rendezvous one until received, or
    // the eager bytes UCX let us keep.
    void* desc_;
    size_t size_;
    bool eager_sent_;
    std::string copy_;  // eager bytes UCX did not let us keep, copied
  };
  // Calls `handler(header, data, sender)` on the progress thread for every
  // message `id` that arrives on this worker with rendezvous data (or, if
  // UCX sent it eagerly after all, its bytes); it must not block, and keeps
  // `data` for Receive or drops it. Replaces an earlier handler of `id`
  // (either kind).
  using DataMessageHandler = absl::AnyInvocable<void(
      absl::string_view header, std::unique_ptr<IncomingData> data,
      const MessageSender& sender)>;
  absl::Status SetDataMessageHandler(uint16_t id, DataMessageHandler handler);
  // Receives `data` into [to, to + data->size()) (ucp_am_recv_data_nbx: UCX
  // moves it with zero copy where the transport can), as a batch of one
  // transfer: OK once the bytes are in; DeadlineExceeded when `deadline`
  // passes first (the batch is then abandoned: UCX may still write into
  // `to` until its request ends, TransferHandle::OnReleased), or had
  // passed when the progress thread came to start it (nothing is written
  // then, not abandoned, the data released unread); Unavailable
  // when the sender's connection failed or the worker is stopping. Once the
  // bytes are in, `each_got(0)` runs on the progress thread before the
  // handle is ready. Any thread; the request is posted outside UCX
  // callbacks. `to` should lie in memory mapped on this worker's context.
  TransferHandle Receive(std::unique_ptr<IncomingData> data, char* to,
                         absl::Time deadline,
                         absl::AnyInvocable<void(size_t)> each_got = nullptr);
  // The same into `pieces`, one after the other (transfer i of the batch is
  // piece i; each_got(i) for each). A piece whose data() is null takes its
  // size in bytes and drops them (into one scratch buffer of
  // kDiscardScratch bytes that the worker keeps for every receive, one iov
  // entry per kDiscardScratch bytes dropped). The pieces' sizes must add up to
  // data->size() (else every transfer ends InvalidArgument, the data
  // released unread). More than one piece: an IOV receive, which UCX 1.13
  // serves with its active-message rendezvous (what it uses over TCP in
  // any case), not RMA zero copy.
  TransferHandle Receive(std::unique_ptr<IncomingData> data,
                         std::vector<absl::Span<char>> pieces, absl::Time deadline,
                         absl::AnyInvocable<void(size_t)> each_got = nullptr);
  // The scratch buffer for dropped bytes: what dropping costs in memory,
  // once, however large the pieces dropped (a block the daemon has already
  // among a put's bytes may be 256 MiB).
  static constexpr size_t kDiscardScratch = size_t{1} << 20;

  // Stops accepting tasks, runs those already queued, calls every Resident's
  // OnStop, waits up to close_timeout for endpoint closes, destroys the
  // worker and joins the thread (a fenced worker: joins, then destroys
  // it). Idempotent. REQUIRES: not called on the progress thread.
  void Stop();

  // Stops progressing UCX for good. Once `then` runs, no
  // ucp_worker_progress call runs on this worker any more: no message a
  // peer sends is taken, and no write UCX emulates with messages (a peer's
  // put into memory registered here over TCP or shared memory; see
  // transport/README, caveat 2) reaches this process. On the progress
  // thread the progress call it is made in, if any, still runs to its end,
  // and `then` runs after it; elsewhere `then` runs on the calling thread
  // before Fence returns. The worker then stops as Stop does (tasks
  // already queued run, every Resident's OnStop, Submit/Post/Run refused)
  // except that it waits for no endpoint close, and leaves the UCP worker
  // to Stop (or the destructor) to destroy: its connections stay open,
  // unserved, until then. (UCX 1.13 over TCP: a kvdepotd whose client
  // destroyed its worker at once after the daemon had dropped its
  // endpoint to it crashed in UCX in 2 of 8 runs; none in 8 when the
  // worker went seconds later.) For a client whose peer may still write
  // into its buffers after it has told its caller a transfer failed.
  void Fence(absl::AnyInvocable<void() &&> then);

  bool OnProgressThread() const;
  // Whether the progress thread has ended: after Stop, or a Fence once the
  // queued tasks and every Resident's OnStop have run.
  bool finished() const { return finished_.HasBeenNotified(); }

  // --- Progress thread only. ---
  ucp_worker_h handle() const { return worker_; }
  // Bytes held for dropped pieces of received data: 0 before the first
  // drop, then kDiscardScratch.
  size_t discard_capacity() const { return discard_size_; }
  void AddResident(Resident* resident);
  // No further calls reach `resident` after this returns.
  void RemoveResident(Resident* resident);
  // Ticks every Resident no later than `when`.
  void WakeAt(absl::Time when);
  // Runs `task` after the current progress call returns (for work that
  // must not run inside a UCX callback). Unbounded.
  void Defer(absl::AnyInvocable<void() &&> task);
  // Runs `task` once `when` has come, or when the worker stops, whichever
  // is first.
  void RunAt(absl::Time when, absl::AnyInvocable<void() &&> task);
  // Closes `ep` (ucp_ep_close_nbx); the worker tracks the close and Stop
  // waits for it. Forcibly: at once. Otherwise in order: once what UCX
  // still holds for the peer has gone out (a flush; then a close that has
  // nothing left to send), or by force once that flush fails (the peer is
  // gone). Stop force-closes an endpoint whose flush has not ended (UCX 1.13
  // aborts the process when a worker is destroyed with an endpoint closing
  // in order that still has requests queued, e.g. for a stopped peer).
  // `keep` lives until the endpoint is closed (what the argument of its
  // error callback points to: UCX may call it until then).
  void CloseEndpoint(ucp_ep_h ep, bool force,
                     std::shared_ptr<const void> keep = nullptr);
  // Endpoints CloseEndpoint is closing in order whose flush has not ended:
  // each keeps its connection (a socket over TCP) until the peer takes
  // what was sent to it or goes. Any thread.
  size_t endpoints_closing() const { return endpoints_closing_.load(); }
  // For what must be done when the UCP worker is destroyed (in Stop, or at
  // the end of the progress thread; on the thread that destroys it), while
  // `owner` lives: `before` once no progress call runs any more and the
  // UCP worker still exists (remote keys, which need it, to destroy);
  // `after` once it is gone, and with it the requests UCX never ended,
  // whose callbacks never come (what they held may be freed). Entries
  // whose owner has gone are dropped as new ones come, so a long-lived
  // worker keeps no more than its live owners' hooks. Never run when the
  // worker is not destroyed (added after that: dropped). Progress thread.
  void AtDestroy(std::weak_ptr<const void> owner,
                 absl::AnyInvocable<void() &&> before,
                 absl::AnyInvocable<void() &&> after);

 private:
  UcxWorker(UcxContext& context, UcxWorkerOptions options);

  void ThreadMain(absl::Notification* started, absl::Status* start_status);
  absl::Status Init();
  void Loop();
  // Runs queued tasks; returns false when stopping and the queue is empty.
  bool RunQueued();
  // Runs due timers and every resident's OnTick (once next_tick_ has come)
  // and sets next_tick_ anew.
  void TickResidents();
  // Once next_sender_tick_ has come: OnTick of the residents that
  // TickBeforeProgress (next_tick_ is left for TickResidents).
  void TickSenders();
  // fn(r) for each resident still registered when its turn comes.
  template <typename Fn>
  void ForEachResident(Fn fn);
  void RunDeferred();
  void ReapCloses();
  void Shutdown();
  // Runs AtDestroy's `before` hooks, destroys the UCP worker (under mu_),
  // then runs their `after` hooks, without mu_ (they may call Submit,
  // which refuses them). On the progress thread, or Stop's after the
  // thread ended.
  void DestroyWorker() ABSL_LOCKS_EXCLUDED(mu_);
  // Progress thread: makes `cb(arg, ...)` the handler of active message
  // `id` (whole messages).
  absl::Status SetAmHandler(uint16_t id, ucp_am_recv_callback_t cb, void* arg);
  static ucs_status_t OnWholeMessage(void* arg, const void* header,
                                     size_t header_length, void* data,
                                     size_t length,
                                     const ucp_am_recv_param_t* param);
  static ucs_status_t OnDataMessage(void* arg, const void* header,
                                    size_t header_length, void* data,
                                    size_t length,
                                    const ucp_am_recv_param_t* param);
  // Ends the receives past their deadline at `now` (abandoned: UCX still
  // holds them) and drops those that ended from receives_.
  void TickReceives(absl::Time now);
  // Receive's part on the progress thread, outside UCX callbacks.
  void StartReceive(std::shared_ptr<transport_internal::TransferBatch> batch,
                    std::unique_ptr<IncomingData> data,
                    std::vector<absl::Span<char>> pieces);
  // Fence's part on the progress thread.
  void FenceHere();
  void SleepUntilEvent();
  absl::Status Enqueue(absl::AnyInvocable<void() &&> task, bool bounded);

  UcxContext& context_;  // must outlive this worker
  const UcxWorkerOptions options_;

  // Set on the progress thread before Create returns; constant after.
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string address_;
  // The progress thread's id while it runs; none once it ended (a thread
  // made later may be given the same id, and must not pass for it).
  std::atomic<std::thread::id> thread_id_;

  // Progress thread only.
  struct WholeHandler {
    UcxWorker* worker;
    MessageHandler handler;
  };
  std::map<uint16_t, std::unique_ptr<WholeHandler>> message_handlers_;
  // MessageSender::Reply's messages not yet sent.
  std::shared_ptr<transport_internal::UnsentMessages> unsent_replies_;
  struct DataHandler {
    UcxWorker* worker;
    DataMessageHandler handler;
  };
  std::map<uint16_t, std::unique_ptr<DataHandler>> data_handlers_;
  std::vector<Resident*> residents_;
  std::vector<absl::AnyInvocable<void() &&>> deferred_;
  std::vector<void*> close_requests_;
  // Endpoints closing in order, while their flush runs (CloseEndpoint).
  struct FlushingClose {
    UcxWorker* worker;
    ucp_ep_h ep;
    std::shared_ptr<const void> keep;
    void* request = nullptr;  // the flush
    ucs_status_t status = UCS_INPROGRESS;  // the flush's, once it ended
    bool forced = false;  // force-closed by Stop before the flush ended
  };
  std::vector<std::unique_ptr<FlushingClose>> flushing_closes_;
  std::atomic<size_t> endpoints_closing_{0};  // flushing_closes_.size()
  // Progress thread, outside UCX callbacks: `close`'s flush ended.
  void EndFlushingClose(FlushingClose* close);
  // AtDestroy's hooks; after the thread has ended, Stop's.
  struct DestroyHook {
    std::weak_ptr<const void> owner;
    absl::AnyInvocable<void() &&> before;
    absl::AnyInvocable<void() &&> after;
  };
  std::vector<DestroyHook> destroy_hooks_;
  std::vector<std::pair<absl::Time, absl::AnyInvocable<void() &&>>> timers_;
  // Receives in flight (or ended since the last tick), for their deadlines.
  struct PendingReceive {
    absl::Time deadline;
    std::weak_ptr<transport_internal::TransferBatch> batch;
  };
  std::vector<PendingReceive> receives_;
  size_t receives_kept_ = 0;  // receives_.size() after the last tick
  // Where dropped pieces of received data go (garbage; shared by every
  // receive): kDiscardScratch bytes, allocated at the first drop, that
  // every such piece reuses kDiscardScratch bytes at a time.
  std::shared_ptr<char[]> discard_;
  size_t discard_size_ = 0;
  absl::Time next_tick_ = absl::InfiniteFuture();
  // Fence: ucp_worker_progress is never called again.
  bool fenced_ = false;
  // The earliest time a TickBeforeProgress resident asked for (<= its part
  // of next_tick_).
  absl::Time next_sender_tick_ = absl::InfiniteFuture();

  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // A ucp_worker_signal is on its way and not yet consumed.
  bool wake_pending_ ABSL_GUARDED_BY(mu_) = false;

  absl::Notification finished_;  // the thread has released the worker
  absl::Mutex join_mu_;
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_UCX_WORKER_H_
