// KvDepotService: the gRPC adapter of kvdepot.v1.KvDepot. Each method
// validates what only the wire can get wrong, calls the TieredStore, converts
// the absl::Status (absl codes are the gRPC codes) and finishes; Finished()
// times, counts and logs every RPC in one place. Block bytes on this path are copied
// between protobuf chunks of at most 1 MiB and the store's DRAM arena.
//
// Thread-safe (gRPC calls methods from its thread pool).
#ifndef KVDEPOT_SERVER_KVDEPOT_SERVICE_H_
#define KVDEPOT_SERVER_KVDEPOT_SERVICE_H_

#include <spdlog/logger.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/byte_streams.h"
#include "server/data_plane.h"
#include "server/metrics.h"
#include "server/quota_file.h"
#include "storage/clock.h"
#include "storage/tiered_store.h"

namespace kvdepot {

// OpenSession's limits (INVALID_ARGUMENT beyond them).
inline constexpr size_t kMaxClientNameBytes = 256;
inline constexpr size_t kMaxHostIdBytes = 256;

// Converts an absl::Status to a grpc::Status with the same code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The argument of test sync point "KvDepotService::AttachAndFinish:Attach",
// reached before an OpenSession's UCX wire-up: a test may set an error (the
// wire-up fails with it, not tried) or read the time by which the wire-up
// must end.
struct AttachPoint {
  absl::Status status;
  absl::Time connect_by;
};

// Built on gRPC's callback API: unary handlers run inline on gRPC's threads
// (every store operation is a short in-memory step), and the byte streams are
// reactors that move one chunk per event with no thread hand-offs. Read is
// registered raw: its messages are assembled from slices that point into the
// DRAM tier, so block bytes are never copied in user space on the way out.
class KvDepotService final
    : public v1::KvDepot::WithRawCallbackMethod_Read<v1::KvDepot::CallbackService> {
 public:
  // `store`, `metrics` and `clock` must outlive the service.
  KvDepotService(TieredStore& store, ServerMetrics& metrics, Clock& clock,
                 std::shared_ptr<spdlog::logger> logger);

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const v1::OpenSessionRequest* req,
                                        v1::OpenSessionResponse* resp) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* ctx,
                                      const v1::KeepAliveRequest* req,
                                      v1::KeepAliveResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* ctx,
                                   const v1::LookupRequest* req,
                                   v1::LookupResponse* resp) override;
  grpc::ServerUnaryReactor* Unpin(grpc::CallbackServerContext* ctx,
                                  const v1::UnpinRequest* req,
                                  v1::UnpinResponse* resp) override;
  grpc::ServerUnaryReactor* BeginPut(grpc::CallbackServerContext* ctx,
                                     const v1::BeginPutRequest* req,
                                     v1::BeginPutResponse* resp) override;
  grpc::ServerUnaryReactor* CommitPut(grpc::CallbackServerContext* ctx,
                                      const v1::CommitPutRequest* req,
                                      v1::CommitPutResponse* resp) override;
  grpc::ServerUnaryReactor* AbortPut(grpc::CallbackServerContext* ctx,
                                     const v1::AbortPutRequest* req,
                                     v1::AbortPutResponse* resp) override;
  grpc::ServerReadReactor<v1::WriteRequest>* Write(
      grpc::CallbackServerContext* ctx, v1::WriteResponse* resp) override;
  grpc::ServerUnaryReactor* ReportCorrupt(
      grpc::CallbackServerContext* ctx, const v1::ReportCorruptRequest* req,
      v1::ReportCorruptResponse* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Read(
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* ctx,
                                  const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx,
                                  const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override;
  grpc::ServerUnaryReactor* ListNamespaces(
      grpc::CallbackServerContext* ctx, const v1::ListNamespacesRequest* req,
      v1::ListNamespacesResponse* resp) override;
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx,
                                   const v1::VerifyRequest* req,
                                   v1::VerifyResponse* resp) override;
  grpc::ServerUnaryReactor* Compact(grpc::CallbackServerContext* ctx,
                                    const v1::CompactRequest* req,
                                    v1::CompactResponse* resp) override;
  grpc::ServerUnaryReactor* SetDraining(grpc::CallbackServerContext* ctx,
                                        const v1::SetDrainingRequest* req,
                                        v1::SetDrainingResponse* resp) override;
  grpc::ServerUnaryReactor* Inspect(grpc::CallbackServerContext* ctx,
                                    const v1::InspectRequest* req,
                                    v1::InspectResponse* resp) override;
  grpc::ServerUnaryReactor* SetQuota(grpc::CallbackServerContext* ctx,
                                     const v1::SetQuotaRequest* req,
                                     v1::SetQuotaResponse* resp) override;
  grpc::ServerUnaryReactor* GetQuota(grpc::CallbackServerContext* ctx,
                                     const v1::GetQuotaRequest* req,
                                     v1::GetQuotaResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterBuffer(
      grpc::CallbackServerContext* ctx, const v1::RegisterBufferRequest* req,
      v1::RegisterBufferResponse* resp) override;
  grpc::ServerUnaryReactor* PushBlocks(grpc::CallbackServerContext* ctx,
                                       const v1::PushBlocksRequest* req,
                                       v1::PushBlocksResponse* resp) override;
  grpc::ServerUnaryReactor* PullBlocks(grpc::CallbackServerContext* ctx,
                                       const v1::PullBlocksRequest* req,
                                       v1::PullBlocksResponse* resp) override;

  // Where SetQuota records quotas (the daemon's data dir); without one,
  // quotas apply until the daemon stops. `file` must outlive the service.
  void set_quota_file(QuotaFile* file) { quota_file_ = file; }
  // Whether the admin calls (SetDraining, SetQuota, Verify, Compact) are
  // taken from any peer (admin_peers: any), or, by default, only from a
  // process on this host owned by root or by kvdepotd's own user
  // (PERMISSION_DENIED otherwise). Lookups, puts, gets, Evict and the read
  // only calls (Stats, ListNamespaces, Inspect, Health) are every
  // client's. Call before the server starts.
  void set_admin_from_any_peer(bool any) { admin_from_any_peer_ = any; }
  // The UCX data plane; without one, sessions get no endpoint and the
  // data-plane RPCs fail with FAILED_PRECONDITION. `data_plane` must outlive
  // the service's calls, and the service must outlive the data plane's
  // requests (DataPlane::requests_in_flight). `transfer_timeout` bounds each
  // PushBlocks / PullBlocks transfer (a request may ask for less). Also
  // serves PushBlocks / PullBlocks requests that come over UCX
  // (DataPlane::ServeRequests) as it serves them over gRPC.
  void set_data_plane(DataPlane* data_plane, absl::Duration transfer_timeout);
  // Ends a session whose client the data plane lost (releases its pins and
  // reservations at once).
  void SessionLost(SessionId session, const absl::Status& why);

  // Records one finished RPC (metrics, and a log line for failures that are
  // the daemon's fault). Used by the unary helper and the stream reactors.
  void Finished(const char* op, const absl::Status& status, absl::Time start);

  // A Read or Write stream in progress. Streams hold DRAM (a reservation or
  // a pin) outside any session lease, so the daemon cancels those that make
  // no progress for a while; see CancelIdleStreams.
  class Stream {
   public:
    virtual ~Stream() = default;
    // When the stream last moved a message.
    absl::Time last_progress() const {
      return absl::FromUnixNanos(last_progress_ns_.load(std::memory_order_relaxed));
    }
    void Progressed(absl::Time now) {
      last_progress_ns_.store(absl::ToUnixNanos(now), std::memory_order_relaxed);
    }
    // Cancels the stream for having made no progress for `idle`: it ends
    // (and is counted and logged) DEADLINE_EXCEEDED, not as a client's
    // cancellation (the client sees CANCELLED either way).
    void CancelIdle(absl::Duration idle) {
      idle_cancelled_ns_.store(absl::ToInt64Nanoseconds(idle),
                               std::memory_order_relaxed);
      Cancel();
    }
    // The status a stream that ended cancelled reports: `cancelled`, or
    // DeadlineExceeded when CancelIdle cancelled it.
    absl::Status CancelledStatus(absl::Status cancelled) const {
      const int64_t idle = idle_cancelled_ns_.load(std::memory_order_relaxed);
      if (idle == 0) return cancelled;
      return absl::DeadlineExceededError(
          absl::StrCat("stream cancelled by kvdepotd: no progress for ",
                       absl::FormatDuration(absl::Nanoseconds(idle)),
                       " (stream_idle_timeout)"));
    }

   protected:
    virtual void Cancel() = 0;

   private:
    std::atomic<int64_t> last_progress_ns_{0};
    std::atomic<int64_t> idle_cancelled_ns_{0};
  };
  void Register(Stream* stream);
  void Unregister(Stream* stream);
  // Cancels every stream idle for longer than `idle` (the reactor then
  // releases what it holds). Returns how many. Called periodically.
  int CancelIdleStreams(absl::Duration idle);
  // Read and Write streams in progress.
  size_t active_streams();
  // Unary calls in progress (started and not finished), over gRPC or UCX.
  size_t active_calls() const { return active_calls_.load(); }
  // The daemon is shutting down (SIGTERM): puts stay refused,
  // SetDraining(false) is answered UNAVAILABLE instead of undoing that, and
  // new sessions and Read streams are refused UNAVAILABLE ("kvdepotd is
  // stopping"): the drain waits for the streams in progress, and a stream
  // begun during it would keep it waiting until drain_timeout and then be
  // cut short. What finishes work begun before (Write into a reserved slot,
  // CommitPut, AbortPut, Unpin, KeepAlive, CloseSession) goes on.
  void BeginShutdown() { shutting_down_.store(true); }
  bool shutting_down() const { return shutting_down_.load(); }

  TieredStore& store() { return store_; }
  // Where puts that wait for room wait (not on gRPC's threads).
  // Runs `put` (one that would wait for room: BeginPut's would_wait) on
  // put_pool_, where it may wait (the store waits up to 5 s). With OK, or,
  // when it queued there kMaxQueuedForRoom or longer behind other waiting
  // puts, with ResourceExhausted: then it tries once more without waiting
  // and, if it still would, ends with that status. So a put is answered
  // within about twice the store's wait however many wait.
  void SubmitWaitingPut(absl::AnyInvocable<void(absl::Status) &&> put);
  // After a put reserved `id` (0: nothing) in `session`: whether the
  // client of its gRPC call (`ctx`; none for a UCX request) has given up,
  // and then aborts the reservation: no one would learn its id, and the
  // session's keep-alives would hold the space until the session ends.
  bool AbortIfClientGaveUp(grpc::CallbackServerContext* ctx, SessionId session,
                           ReservationId id);
  // The answer to a put whose client gave up.
  static absl::Status PutCancelled() {
    return absl::CancelledError("the client cancelled the put");
  }
  static constexpr absl::Duration kMaxQueuedForRoom = absl::Seconds(5);
  ServerMetrics& metrics() { return metrics_; }
  Clock& clock() { return clock_; }

  // Logs what DropCorruptDram found of a block a reader (`who`) found
  // corrupt (once per bad DRAM copy: when first found, as the store counts
  // it), and returns the reply's verdict.
  v1::CorruptVerdict CorruptDramVerdict(CorruptDramCheck check,
                                        absl::string_view ns,
                                        absl::string_view key,
                                        absl::string_view who);

 private:
  // OK when the caller of admin call `op` may make it (see
  // set_admin_from_any_peer), else PermissionDenied saying who it was.
  absl::Status CheckAdmin(grpc::CallbackServerContext* ctx,
                          const char* op) const;
  // Runs a Verify or Compact of the NVMe tier (`fn`) on maintenance_pool_,
  // then finishes the call `op` with its status; one at a time: Aborted at
  // once when one runs already.
  grpc::ServerUnaryReactor* NvmeMaintenance(
      grpc::CallbackServerContext* ctx, const char* op,
      absl::AnyInvocable<absl::Status() &&> fn);
  // For calls that finish later (on another thread): records the call as
  // Finished(op) from now, and finishes `reactor` with the status.
  std::function<void(const absl::Status&)> Finisher(
      const char* op, grpc::ServerUnaryReactor* reactor);
  // The work of PushBlocks / PullBlocks, over gRPC or UCX: `finish` is
  // called once, on any thread, when `resp` is complete; `req` and `resp`
  // must live until then and are not touched after it.
  using Finish = std::function<void(const absl::Status&)>;
  // `over_ucx`: the answer goes back over the session's UCX endpoint
  // (DataPlane::Reply), after the blocks (DataPlane::PutEnd::kFenced).
  void StartPushBlocks(const v1::PushBlocksRequest* req,
                       v1::PushBlocksResponse* resp, Finish finish,
                       bool over_ucx = false);
  // BeginPut; `must_not_block` (on a gRPC thread): a put that would wait
  // for room goes on put_pool_ and waits there. Not OK `refuse_with` (with
  // must_not_block, on put_pool_: it queued there too long, see
  // SubmitWaitingPut): a put that would wait ends with it instead.
  void StartBeginPut(grpc::CallbackServerContext* ctx,
                     const v1::BeginPutRequest* req, v1::BeginPutResponse* resp,
                     Finish finish, bool must_not_block,
                     absl::Status refuse_with = absl::OkStatus());
  // `must_not_block` (every UCX request: on a progress thread, or on one of
  // the few request threads all co-located clients share): a put that
  // would wait for room (BeginPut's would_wait) goes on put_pool_ and waits
  // there.
  // `data`, when it holds some, is the blocks' bytes sent with a UCX
  // request (DataPlane::Request::data): received into the slots instead of
  // read from the client's buffers -- unless the bytes of blocks stored
  // already (dropped) outweigh the new blocks' and 1 MiB: then the data is
  // released unread and the new blocks are read from their sources.
  using IncomingData = std::unique_ptr<UcxWorker::IncomingData>;
  // `refuse_with`: as StartBeginPut's. `ctx`: the gRPC call's, when it is
  // one: a put that waited for room after its client gave up is refused
  // (CANCELLED), its reservation aborted.
  void StartPullBlocks(const v1::PullBlocksRequest* req,
                       v1::PullBlocksResponse* resp, Finish finish,
                       bool must_not_block = false,
                       std::shared_ptr<IncomingData> data = nullptr,
                       absl::Status refuse_with = absl::OkStatus(),
                       grpc::CallbackServerContext* ctx = nullptr);
  // What an abandoned batch holds, for the log and kvdepot_ucx_held_bytes.
  struct HeldFor {
    std::string what;  // "reads into 3 slots"
    std::string kept;  // "their memory stays allocated"
    std::string ops;   // "reads"
    uint64_t bytes = 0;
  };
  // `op`'s batch `h` was abandoned (UCX still holds requests of it: a
  // co-located client that stopped answering, or a remote one whose
  // endpoint closes in order after a deadline): runs `release` (which frees
  // the DRAM those requests read or write: a pull's slots, a push's pin)
  // only once UCX has ended them, whatever becomes of the request and the
  // session, so that a late answer lands in no other block and no other
  // block's bytes reach that client.
  void HoldUntilReleased(const char* op, SessionId session,
                         const TransferHandle& h, const HeldFor& held,
                         absl::AnyInvocable<void() &&> release);
  // A request that came over UCX; answered with DataPlane::Reply.
  void ServeUcxRequest(DataPlane::Request request);
  // OK when `session` is a public session with a UCX endpoint; NotFound
  // when the session is not open; FailedPrecondition when the data plane
  // is off or the session has no endpoint.
  absl::Status RequireEndpoint(SessionId session);
  // `st`, or NotFound when `session` has ended meanwhile (the failure came
  // of that: its endpoint went with it), so that its client learns that
  // its session is gone, as from a request that named it afterwards.
  absl::Status UnlessSessionEnded(SessionId session, absl::Status st);

  // Runs `fn` inline and finishes the call with its status.
  template <typename Fn>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx,
                                  const char* op, Fn&& fn);

  TieredStore& store_;
  ServerMetrics& metrics_;
  Clock& clock_;
  const std::shared_ptr<spdlog::logger> log_;
  // The log lines clients can set off at will.
  LogLimiter log_limit_;

 public:
  // Logs how many lines each limited site left out and has not told yet
  // (LogLimiter::TakeLeftOut); for the daemon's maintenance loop.
  void LogLeftOut();

 private:
  bool admin_from_any_peer_ = false;  // set_admin_from_any_peer
  const absl::Time started_;

  QuotaFile* quota_file_ = nullptr;
  DataPlane* data_plane_ = nullptr;
  absl::Duration transfer_timeout_ = absl::Seconds(10);
  // Steps that may block, off gRPC's and UCX's threads: puts waiting for
  // room (SubmitWaitingPut: up to kPutPoolThreads wait at once, mostly
  // asleep), an abandoned UCX batch's commit.
  static constexpr int kPutPoolThreads = 8;
  WorkPool put_pool_{kPutPoolThreads, "kvd-put"};
  // OpenSession's UCX wire-up (up to two connects, of connect_timeout each
  // at most, and together within half of the client's deadline,
  // to a client that may not answer), off gRPC's threads: with it there, a
  // few stalled clients left every other call (a KeepAlive holding a lease)
  // unanswered for seconds. Past kMaxAttachesWaiting wire-ups waiting for
  // a thread, a session is opened without UCX: Unavailable, which makes
  // libkvdepot use its gRPC byte path.
  static constexpr int kAttachPoolThreads = 4;
  static constexpr int kMaxAttachesWaiting = 64;
  WorkPool attach_pool_{kAttachPoolThreads, "kvd-attach"};
  // Attach one session's UCX endpoint (OpenSession's last step, on
  // attach_pool_) and finish the call.
  void AttachAndFinish(grpc::CallbackServerContext* ctx,
                       const v1::OpenSessionRequest* req,
                       v1::OpenSessionResponse* resp, SessionId id,
                       absl::Duration lease,
                       std::function<void(const absl::Status&)> finish);
  // Held by the ReportCorrupt being checked (one at a time; TryLock).
  absl::Mutex report_mu_;
  // Reported blocks the daemon's copy did not confirm, not logged yet, and
  // when that was last logged.
  uint64_t unconfirmed_reports_ ABSL_GUARDED_BY(report_mu_) = 0;
  absl::Time last_unconfirmed_log_ ABSL_GUARDED_BY(report_mu_) =
      absl::InfinitePast();
  // The most blocks one ReportCorrupt may name (libkvdepot sends at most
  // 64: a get that finds more is exceptional, and their next readers report
  // the rest).
  static constexpr int kMaxReportBlocks = 64;

  std::atomic<size_t> active_calls_{0};
  std::atomic<bool> shutting_down_{false};
  // A Verify or Compact is running (one at a time: each reads or rewrites
  // the whole NVMe tier, for minutes on a large one).
  std::atomic<bool> nvme_maintenance_{false};
  // Where it runs: not on gRPC's threads, which every other call needs.
  WorkPool maintenance_pool_{1, "kvd-nvme-maint"};

  absl::Mutex streams_mu_;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(streams_mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_KVDEPOT_SERVICE_H_
