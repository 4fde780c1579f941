// DataPlane: kvdepotd's side of the UCX data plane. It owns the UCX context,
// the progress workers, the DRAM arena's registration and one UCX endpoint
// per session whose client sent a worker address in OpenSession.
//
// Transfers are daemon-driven: the client registers buffers and names keys
// and places in them; the service resolves the keys to pinned blocks or
// reserved slots and calls Push (arena -> client, ucp_put_nbx) or Pull
// (client -> arena, ucp_get_nbx). The client never learns an arena address,
// so nothing it sends can reach a block it did not look up or a slot it did
// not reserve; its own addresses are checked against the buffers it
// registered in this session. (UCX 1.13 over TCP and shared memory does not
// check remote addresses at all, so a client holding the arena's rkey could
// read and write the whole daemon: see transport/README.md.)
//
// A session's endpoint has UCX peer error handling, except for a client on
// this host, running as kvdepotd's user, when shared memory is enabled
// (UCX 1.13's shared-memory transports cannot detect a dead peer; a client
// of another user is served over TCP); that one is watched by a
// PeerMonitor over TCP. Either way a dead client is reported through
// `on_lost` at once, not at lease expiry. Such a co-located client's
// endpoint lives on a worker of its own, destroyed after the session ends
// (max_colocated_workers): what UCX still holds for a client that stopped
// taking it goes with it.
//
// Thread-safe.
#ifndef KVDEPOT_SERVER_DATA_PLANE_H_
#define KVDEPOT_SERVER_DATA_PLANE_H_

#include <spdlog/logger.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/logging.h"
#include "storage/tiered_store.h"
#include "storage/work_pool.h"
#include "transport/memory_region.h"
#include "transport/peer_monitor.h"
#include "transport/request_message.h"
#include "transport/transfer_handle.h"
#include "transport/ucx_address_sandbox.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_worker.h"

namespace kvdepot {

struct DataPlaneOptions {
  // UCX settings (see UcxContextOptions::config), e.g. {"TLS", "tcp"}.
  std::map<std::string, std::string> ucx;
  // Progress threads; sessions are spread over them.
  int workers = 2;
  // How long OpenSession waits for a client's worker to answer.
  absl::Duration connect_timeout = absl::Seconds(5);
  // After a session's endpoint failed (a transfer passed its deadline, the
  // client went), transfers UCX still holds on it end this long after
  // anyway, abandoned (UcxEndpointOptions::abandon_after): what they
  // read or write stays held until UCX lets them go.
  absl::Duration abandon_after = absl::Seconds(1);
  // Buffers one session may register.
  uint32_t max_buffers_per_session = 256;
  // Requests over UCX (ServeRequests) received and not yet answered;
  // beyond this a request is answered ResourceExhausted at once.
  size_t max_requests_in_flight = 4096;
  // The same for one session (the session a request names): a client that
  // stops taking its transfers keeps its requests in flight until their
  // deadlines, and must not hold every slot of max_requests_in_flight
  // while other sessions are refused. 1024, a quarter of them: a client
  // keeps one request in flight per batch it waits on, far fewer.
  size_t max_requests_per_session = 1024;
  // Bytes of request bodies (the serialized requests, each at most
  // kMaxRequestPayload, kept until the reply; the parsed request held
  // meanwhile weighs about as much again) received and not yet answered,
  // of all sessions; past it a request is answered ResourceExhausted at
  // once. Without it max_requests_in_flight bodies of 4 MiB would hold
  // 16 GiB. 256 MiB: a PullBlocks request of 1024 keys (max_batch_keys)
  // weighs about 97 KiB with 32-byte keys (vLLM), 550 KiB with 256-byte
  // ones, so some 2700 full batches of the former fit.
  size_t max_request_bytes_in_flight = size_t{256} << 20;
  // The same for one session: a quarter (16 requests of
  // kMaxRequestPayload, some 670 full batches of 32-byte keys), so that one
  // stalled client cannot take all of max_request_bytes_in_flight either.
  size_t max_request_bytes_per_session = size_t{64} << 20;
  // Bytes of replies (Reply) UCX holds for one session's client, not yet
  // sent because the client does not take them (UcxEndpointOptions::
  // max_unsent_message_bytes): past it the session's endpoint fails and the
  // session is lost (on_lost), as for a client that is gone. A client that
  // sent requests and never progresses its worker would otherwise make
  // every reply wait in UCX here (a few KB to 20 KB each), without bound:
  // Reply gives the request's slot back before UCX has sent its reply.
  // 16 MiB: a client that reads its replies keeps far less waiting.
  size_t max_unsent_reply_bytes = size_t{16} << 20;
  // Threads that run requests over UCX.
  int request_threads = 2;
  // UCX workers (progress threads) that receive requests, and the bytes
  // of puts sent with them; each client worker sends to one of them,
  // chosen by its address.
  int request_workers = 2;
  // A co-located client (shared memory) gets a UCX worker and progress
  // thread of its own, destroyed after its session ends: UCX 1.13 drops
  // sends queued over shared memory for a client that no longer takes them
  // (stopped, or killed) only with the worker, and a progress thread with
  // such sends pending spins a core on them for good. At most this many
  // at once; further co-located clients are served over TCP, like remote
  // ones, on the shared workers (0: all of them).
  int max_colocated_workers = 64;
  // Client workers the request worker keeps an endpoint to (see
  // RequestAddress); further clients get no request address and use gRPC
  // calls.
  size_t max_request_links = 4096;
  // Endpoints closing in order (UcxWorker::endpoints_closing) past which
  // Attach makes no new endpoint (Unavailable: the client uses gRPC). Such
  // an endpoint waits for a client that stopped answering to take what was
  // sent to it -- a session of a stalled client, or a wire-up to a worker
  // that never answered -- and keeps its socket open meanwhile; a client
  // opening sessions with such a worker again and again would otherwise
  // take every file descriptor, the gRPC port's accepts with them.
  size_t max_endpoints_closing = 1024;
  // Sessions with a UCX endpoint at once; past it Attach makes none
  // (Unavailable: the client uses gRPC). Each takes file descriptors (its
  // endpoint's socket over TCP, its monitor's), and once accept() fails
  // for want of them, Debian 12's gRPC may never accept on the port again
  // (README): 0 means what the open file limit leaves, a quarter of
  // RLIMIT_NOFILE less 1024 for everything else (at least 16).
  size_t max_links = 0;
  // The executable of the UCX address sandbox (kvdepotd itself; see
  // transport/ucx_address_sandbox.h): Attach has it try a client's worker
  // address, with these UCX settings, before any endpoint here is made to
  // it. Empty: addresses go to UCX unchecked (tests that make their own).
  std::string address_sandbox;
  // Called with the code of each request answered at once, unserved (see
  // ServeRequests: a limit above, an ended session, kvdepotd stopping, a
  // malformed request), on the thread that received it; it must not block.
  // kvdepotd counts them in kvdepot_ucx_requests_refused_total{code}.
  std::function<void(absl::StatusCode)> on_refused;
};

// One block's bytes in the arena and the place in the client's buffer
// `buffer` (a RegisterBuffer id) they move to or from.
struct BlockMove {
  absl::Span<char> arena;
  uint32_t buffer = 0;
  uint64_t address = 0;
};

class DataPlane {
 public:
  // Called with a session whose client is gone (its endpoint failed, its
  // watch fired, or a transfer passed its deadline), on a thread of the
  // data plane's own, never on a progress thread or under a lock.
  using LostCallback =
      absl::AnyInvocable<void(SessionId session, const absl::Status& why)>;

  // Creates the context and workers and registers `arena`. Errors: the UCX
  // settings are bad (InvalidArgument), UCX finds no transport
  // (Unavailable), registration fails.
  static absl::StatusOr<std::unique_ptr<DataPlane>> Create(
      const DataPlaneOptions& options, DramRegion arena, LostCallback on_lost,
      std::shared_ptr<spdlog::logger> logger);
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;
  // Close(), then stops the workers and unregisters the arena.
  ~DataPlane();

  // Closes every endpoint (transfers in flight end Cancelled) and refuses
  // new sessions (Unavailable); no on_lost comes after it returns. For
  // shutdown: lets calls waiting on transfers finish.
  void Close();

  // Connects an endpoint for `session` to the client worker at `address`
  // and waits for the wire-up. AlreadyExists when the session has one;
  // InvalidArgument for an empty address; Unavailable or DeadlineExceeded
  // when the client's worker does not answer.
  // `client_uid` is the uid owning the client's connection when it is on
  // this host (LocalPeerUid): a co-located client with shared memory must
  // have one, equal to kvdepotd's effective uid (UCX's segments are their
  // user's alone), and the segments its buffers name must belong to it;
  // without one, or with another, the client is served as a remote one
  // (TCP, no shared memory; logged at info for another uid).
  // `client_tcp`, when the client said them, are its UCX TCP segment
  // sizes: FailedPrecondition (naming both sides' sizes, and "UCX") when
  // they do not fit this daemon's (TcpSegmentsFit), before anything is
  // connected -- UCX 1.13 would abort whichever side received a segment
  // larger than its own RX size.
  // `connect_by`: the address sandbox's check and the endpoint's wire-up
  // give up by then (Unavailable or DeadlineExceeded), the wire-up at the
  // latest after connect_timeout, so that the client learns in time to use
  // gRPC instead.
  absl::Status Attach(SessionId session, std::string_view address,
                      std::string_view client_host_id,
                      std::optional<uint32_t> client_uid,
                      std::optional<TcpSegmentSizes> client_tcp = std::nullopt,
                      absl::Time connect_by = absl::InfiniteFuture());
  // Forgets the session's endpoint and buffers (a closed session). Transfers
  // in flight end Cancelled. No on_lost for it after this returns.
  // `peer_gone` (on_lost's sessions): the endpoint is reset rather than
  // closed in order, which a client that is gone never completes.
  void Detach(SessionId session, bool peer_gone = false);
  // Detaches every session for which `ended` returns true (expired leases).
  void DetachIf(absl::FunctionRef<bool(SessionId)> ended);
  bool attached(SessionId session) const;
  size_t sessions() const;

  // Unpacks a client buffer's rkey for the session's endpoint. Returns the
  // buffer id, and whether moves to and from it are copies this process
  // makes itself (see `copy_here` below). FailedPrecondition when the
  // session has no endpoint; ResourceExhausted past max_buffers_per_session;
  // InvalidArgument for an empty key, a zero size or an overflowing range.
  struct Buffer {
    uint32_t id = 0;
    bool copied_here = false;
  };
  absl::StatusOr<Buffer> RegisterBuffer(SessionId session,
                                        std::string_view packed_rkey,
                                        uint64_t address, uint64_t size);
  // Whether moves to and from the session's buffer `buffer` are copies
  // this process makes itself (a co-located client's UCX shared memory,
  // mapped here), while the session's endpoint works.
  bool CopiedHere(SessionId session, uint32_t buffer) const;

  // Starts the moves of one batch: Push writes arena bytes into the client's
  // buffers, Pull reads the client's buffers into arena bytes. Per move the
  // handle reports OK or why not (InvalidArgument for a place outside the
  // session's buffers, an unknown buffer id, or arena bytes outside the
  // arena: refused before UCX). FailedPrecondition when the session has no
  // endpoint. REQUIRES: the arena bytes stay allocated until the handle is
  // ready. Pull's `each_got(i)`, when given, runs on a progress thread as
  // move i's bytes arrive through UCX (UcxEndpoint::Get), never after the
  // handle is ready; it must not block.
  //
  // With `copy_here`, a move whose client buffer this process maps (a
  // co-located client's UCX shared-memory segment) is not handed to UCX:
  // `copy_here(i, client)` does it on the calling thread before Push/Pull
  // return, with `client` move i's place in the client's buffer as mapped
  // here, and its status is the move's (UcxEndpoint::MappedCopy). The
  // caller can then check the bytes as they land, in cache.
  //
  // Push's `end`: kFenced for a batch the client learns of by a Reply (sent
  // after the handle is ready: it reaches the client after the bytes), which
  // spares the flush's round trip; kFlushed when it learns of it otherwise
  // (a gRPC answer).
  using CopyHere = UcxEndpoint::MappedCopy;
  using PutEnd = UcxEndpoint::PutEnd;
  absl::StatusOr<TransferHandle> Push(SessionId session,
                                      absl::Span<const BlockMove> moves,
                                      absl::Time deadline,
                                      CopyHere copy_here = nullptr,
                                      PutEnd end = PutEnd::kFlushed);
  absl::StatusOr<TransferHandle> Pull(
      SessionId session, absl::Span<const BlockMove> moves, absl::Time deadline,
      absl::AnyInvocable<void(size_t)> each_got = nullptr,
      CopyHere copy_here = nullptr);

  // ---- Requests over UCX (transport/request_message.h) -----------------
  // A client whose session has an endpoint may send PushBlocks / PullBlocks
  // requests as active messages to the data plane's request worker
  // (RequestAddress; over its request link) instead of calling gRPC: the
  // same protobuf bytes, a fraction of the cost per call. The request
  // names its session as a gRPC call does (same trust: the id is what a
  // client proves itself by), and must come over the request link of that
  // session's client worker: a session's requests come from its own
  // worker only.
  struct Request {
    SessionId session = 0;
    RequestMethod method = RequestMethod::kPushBlocks;
    uint64_t id = 0;   // the client's; Reply echoes it
    std::string body;  // the serialized request
    // A PullBlocks request sent with its blocks' bytes
    // (kDataRequestMessageId): they are still with the client until
    // Receive places them; dropping this releases them unread. Null for
    // other requests. Must go before Reply (the request worker outlives
    // no request in flight).
    std::unique_ptr<UcxWorker::IncomingData> data;
  };
  using RequestHandler = absl::AnyInvocable<void(Request request)>;
  // Serves requests: each one whose session has an endpoint is handed to
  // `handler`, which must answer it with Reply, exactly once, and must not
  // block (it hands on what would). A request from a client that is not
  // co-located goes to it on the request worker's progress thread, without
  // waking another thread; one from a co-located client (whose blocks the
  // handler copies itself) on one of the few request threads all of them
  // share. Answered at once, without the handler: a session
  // without an endpoint (NotFound: it ended), a request that did not come
  // over the request link of the session's client worker
  // (PermissionDenied: another worker's, or a connection the client wired
  // up itself), a payload over
  // kMaxRequestPayload (InvalidArgument), a request id its session has in
  // flight already (InvalidArgument: ids are the client's, and tell its
  // requests apart), more than max_requests_in_flight or
  // max_requests_per_session unanswered, or bodies over
  // max_request_bytes_in_flight or max_request_bytes_per_session
  // (ResourceExhausted), data sent eagerly instead of as rendezvous over
  // kMaxEagerRequestData (InvalidArgument; below it, it counts with the
  // body against the byte caps: it is held here whole). Messages that are
  // not requests are dropped. Call once, before sessions attach.
  void ServeRequests(RequestHandler handler);
  static constexpr size_t kMaxEagerRequestData = size_t{64} << 10;
  // Receives a request's `data` into `pieces` (arena slots; null pieces
  // drop their bytes): see UcxWorker::Receive. `each_got(i)` runs once the
  // bytes are in. InvalidArgument for a piece outside the arena (pieces
  // that do not add up to the data: every transfer ends InvalidArgument).
  absl::StatusOr<TransferHandle> Receive(
      std::unique_ptr<UcxWorker::IncomingData> data,
      std::vector<absl::Span<char>> pieces, absl::Time deadline,
      absl::AnyInvocable<void(size_t)> each_got);
  // Answers request `id` of `session`'s client over the session's endpoint
  // (after every transfer that was ready before), and gives back what the
  // request held of the caps above, even when the session has ended.
  // Dropped when the session has no working endpoint (the client's
  // deadline, or its endpoint's failure, tells it). REQUIRES: `id` is a
  // request of `session` handed to the handler and not yet answered (a
  // second answer is logged and dropped).
  void Reply(SessionId session, uint64_t id, const absl::Status& status,
             std::string body);
  // Where `session`'s client sends requests (a worker address); empty when
  // the session has no endpoint or its client worker no request link (its
  // client then calls gRPC).
  //
  // The request worker has an endpoint of its own to each client worker
  // that has a session (Attach makes it, with peer error handling, and
  // keeps it until that worker is gone), and the client's request
  // endpoint pairs with it: UCX matches the endpoints two workers create
  // to each other, so the client's connect wires nothing up. That keeps
  // kvdepotd from ever answering a client's wire-up: doing so connects
  // back to the client, and a client that dies before that connection is
  // made aborts UCX 1.13 in kvdepotd (transport/README, caveat 4). The
  // pairing holds while each side makes one such endpoint per client
  // worker: libkvdepot keeps its request connection across sessions.
  std::string RequestAddress(SessionId session) const;
  // Whether `session`'s client may send puts with their bytes
  // (kDataRequestMessageId): its worker has a request link, so the bytes
  // come over an endpoint kvdepotd owns and closes (see Admit).
  bool TakesDataRequests(SessionId session) const;
  // Client workers the request worker has an endpoint to.
  size_t request_links() const;
  // Endpoints of the shared and request workers closing in order, each
  // waiting for its client (see max_endpoints_closing).
  size_t endpoints_closing() const;
  // Requests received and not yet answered.
  size_t requests_in_flight() const;
  // Answers new requests Unavailable from now on (shutdown: the requests
  // in flight may finish, see requests_in_flight, before Close cuts their
  // transfers short).
  void StopRequests() { requests_stopped_.store(true); }

  // Whether the UCX settings let co-located clients use shared memory.
  bool shared_memory() const { return shared_memory_; }
  // Co-located clients' own workers (max_colocated_workers) not yet
  // destroyed: those of attached sessions and of ended ones still being
  // stopped.
  int colocated_workers() const { return colocated_workers_.load(); }

 private:
  struct Link;
  DataPlane(const DataPlaneOptions& options, LostCallback on_lost,
            std::shared_ptr<spdlog::logger> logger);
  absl::StatusOr<TransferHandle> Move(
      bool push, SessionId session, absl::Span<const BlockMove> moves,
      absl::Time deadline, absl::AnyInvocable<void(size_t)> each_got,
      CopyHere copy_here, PutEnd end = PutEnd::kFlushed);
  std::shared_ptr<Link> Find(SessionId session) const;
  // Any thread (progress threads included): hands the loss to lost_pool_.
  void Lost(SessionId session, const absl::Status& why);
  // A co-located link's own worker, when it has one, for the link that
  // left links_: stopped on retire_pool_ (that ends whatever is still in
  // flight on it), then destroyed with the link.
  void Retire(std::shared_ptr<Link> link);
  // Drops a transfer's hold on `link`, on a progress thread: at once while
  // the session still holds it (no thread woken per batch), else on
  // lost_pool_, where the endpoint may go.
  void LetGo(SessionId session, std::shared_ptr<Link> link);
  // For a link out of links_ (or never in it): stops watching its client,
  // closes its endpoint (`force`: a reset, for a client that may be gone)
  // and retires it.
  void Unlink(SessionId session, std::shared_ptr<Link> link, bool force);
  // Logs, once until a check passes again, that the address sandbox
  // fails (`why`) and UCX sessions go to gRPC.
  void SandboxFailed(const absl::Status& why);
  // Counts one more co-located worker in colocated_workers_ unless there
  // are max_colocated_workers already.
  bool TakeColocatedSlot();
  // Makes a request worker's endpoint to the client worker at `address`
  // unless it has one (see RequestAddress). Waits for the wire-up; on
  // failure the client uses gRPC calls (logged).
  // Returns the request worker that serves that client worker (its
  // link's; a new one's in turn). The wire-up gives up by `connect_by`
  // (at the latest after connect_timeout).
  size_t EnsureRequestLink(SessionId session, std::string_view address,
                           absl::Time connect_by);
  // How long a wire-up may wait: until `connect_by`, at most
  // connect_timeout (at least a millisecond).
  absl::Duration ConnectTimeout(absl::Time connect_by) const;
  // Request worker's progress thread: whether the message `sender` sent
  // came over the request link to `link`'s client worker (its reply
  // endpoint is the link's endpoint).
  bool FromRequestLink(const Link& link,
                       const UcxWorker::MessageSender& sender) const;
  // Whether the request link to the client worker at `client_address` is
  // made.
  bool HasRequestLink(const std::string& client_address) const;
  // Sets the request handlers of one request worker.
  absl::Status ServeRequestsOn(UcxWorker& request_worker);
  // Drops request link `id` (its endpoint failed: the client's worker is
  // gone). Any thread.
  void DropRequestLink(const std::string& address, uint64_t id);
  // Progress thread: request `h` (its body, and `data` when it came with
  // some) admitted or answered at once.
  void Admit(const RequestHeader& h, absl::string_view body,
             std::unique_ptr<UcxWorker::IncomingData> data,
             const UcxWorker::MessageSender& sender);
  // Counts request `id` of `session`, with a body of `bytes`, as in flight,
  // or says why it may not be (see ServeRequests).
  absl::Status TakeRequestSlot(SessionId session, uint64_t id, size_t bytes);
  // Gives back what TakeRequestSlot counted for request `id` of `session`,
  // except requests_in_flight_ (the caller's last step). False when it
  // counted nothing (not admitted, or answered already).
  bool ReleaseRequestSlot(SessionId session, uint64_t id);
  // Progress thread: a message arrived for kRequestMessageId.
  void OnRequest(absl::string_view header, absl::string_view payload,
                 const UcxWorker::MessageSender& sender);

  const DataPlaneOptions options_;
  const size_t max_links_;  // options_.max_links, or derived
  const std::shared_ptr<spdlog::logger> log_;
  // The log lines clients can set off at will.
  LogLimiter log_limit_;

 public:
  // As KvDepotService::LogLeftOut.
  void LogLeftOut();

 private:
  LostCallback on_lost_;
  bool shared_memory_ = false;

  // Destroyed in reverse order: links (endpoints) before the monitor,
  // the monitor before the workers, the workers before the arena region and
  // the context.
  std::unique_ptr<UcxContext> context_;
  std::unique_ptr<UcxAddressSandbox> sandbox_;  // null: none
  // The sandbox failed (logged as an error), and no check passed since.
  std::atomic<bool> sandbox_failing_{false};
  std::unique_ptr<MemoryRegion> arena_;
  std::vector<std::unique_ptr<UcxWorker>> workers_;
  // Receive requests (ServeRequests); their only endpoints are
  // request_links_.
  std::vector<std::unique_ptr<UcxWorker>> request_workers_;
  std::unique_ptr<PeerMonitor> monitor_;  // on workers_[0]

  mutable absl::Mutex mu_;
  // Attach calls past the max_links check and not yet ended.
  size_t wiring_up_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<SessionId, std::shared_ptr<Link>> links_
      ABSL_GUARDED_BY(mu_);
  // Sessions Attach is connecting (from before its endpoints exist until
  // the link is in links_), with the loss the monitor reported meanwhile
  // (OK: none): the monitor reports once, and a report for a session not
  // yet in links_ would otherwise be dropped, leaving it to its lease.
  absl::flat_hash_map<SessionId, absl::Status> attaching_ ABSL_GUARDED_BY(mu_);
  uint64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  // The request worker's endpoints to client workers, by the client
  // worker's address; `endpoint` is null while it is being made.
  struct RequestLink {
    uint64_t id = 0;
    size_t worker = 0;  // in request_workers_
    std::unique_ptr<UcxEndpoint> endpoint;
  };
  absl::flat_hash_map<std::string, RequestLink> request_links_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_request_link_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_request_worker_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // the destructor has begun

  // Set once, before sessions attach.
  RequestHandler request_handler_;
  bool serving_requests_ = false;
  // Requests admitted and not yet answered (TakeRequestSlot to Reply).
  // Taken on the request workers' progress threads: held only to look up
  // and update the counts.
  struct SessionRequests {
    absl::flat_hash_map<uint64_t, size_t> bodies;  // request id -> bytes
    size_t bytes = 0;                             // their sum
  };
  mutable absl::Mutex requests_mu_;
  // Only sessions with a request in flight: an entry goes with its last.
  absl::flat_hash_map<SessionId, SessionRequests> session_requests_
      ABSL_GUARDED_BY(requests_mu_);
  size_t request_bytes_ ABSL_GUARDED_BY(requests_mu_) = 0;
  // Raised under requests_mu_; lowered at the very end of Reply (after its
  // slot is released), so it is never below the requests counted in
  // session_requests_. Read without the lock (requests_in_flight()).
  std::atomic<size_t> requests_in_flight_{0};
  std::atomic<bool> requests_stopped_{false};
  // Runs request_handler_. Destroyed before lost_pool_ (it may hand work
  // there), after the links (a request in progress holds its link).
  std::unique_ptr<WorkPool> request_pool_;

  // Runs on_lost_ off the progress threads. The destructor empties it
  // last, so a pending callback runs while everything above still exists.
  std::unique_ptr<WorkPool> lost_pool_;
  // Co-located clients' own workers not yet destroyed (Link::Slot).
  std::atomic<int> colocated_workers_{0};
  // Stops retired links' own workers (Retire); each stop may wait for
  // UCX's orderly close of the endpoint (UcxWorkerOptions::close_timeout;
  // a client that is gone gets a forced one). The destructor empties it
  // before lost_pool_: the stops hand work there.
  std::unique_ptr<WorkPool> retire_pool_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DATA_PLANE_H_
