#include "server/data_plane.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "storage/internal/sync_point.h"
#include "storage/status_macros.h"

namespace kvdepot {

struct DataPlane::Link {
  // Gives back a co-located client's worker slot once its worker is gone.
  struct Slot {
    std::atomic<int>* count = nullptr;
    void Release() {
      if (count != nullptr) count->fetch_sub(1);
      count = nullptr;
    }
    ~Slot() { Release(); }
  };
  // In this order: the endpoint goes before the worker it lives on, the
  // worker before its slot.
  Slot slot;
  // A co-located client's worker of its own (max_colocated_workers);
  // null: the endpoint lives on one of the shared workers_.
  std::unique_ptr<UcxWorker> own_worker;
  std::unique_ptr<UcxEndpoint> endpoint;
  // A client on this host, allowed shared memory; watched by monitor_.
  bool colocated = false;
  std::optional<uint32_t> uid;  // of a co-located client's connection
  // The request worker the client's worker sends requests to.
  size_t request_worker = 0;
  std::string client_address;  // the client worker's
  absl::Mutex mu;
  uint32_t buffers ABSL_GUARDED_BY(mu) = 0;
};

namespace {

// DataPlaneOptions::max_links' default.
size_t LinksTheFileLimitLeaves() {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY) {
    return size_t{1} << 20;
  }
  const uint64_t files = limit.rlim_cur;
  return static_cast<size_t>(
      std::max<uint64_t>(16, files > 1024 ? (files - 1024) / 4 : 0));
}

}  // namespace

DataPlane::DataPlane(const DataPlaneOptions& options, LostCallback on_lost,
                     std::shared_ptr<spdlog::logger> logger)
    : options_(options),
      max_links_(options.max_links != 0 ? options.max_links
                                        : LinksTheFileLimitLeaves()),
      log_(std::move(logger)),
      on_lost_(std::move(on_lost)) {}

void DataPlane::LogLeftOut() {
  for (const auto& [site, n] : log_limit_.TakeLeftOut()) {
    log_->warn("{}: {} more line(s) like the last one logged were left out",
               site, n);
  }
}

absl::StatusOr<std::unique_ptr<DataPlane>> DataPlane::Create(
    const DataPlaneOptions& options, DramRegion arena, LostCallback on_lost,
    std::shared_ptr<spdlog::logger> logger) {
  if (options.workers < 1) {
    return absl::InvalidArgumentError("data plane: workers must be >= 1");
  }
  std::unique_ptr<DataPlane> d(
      new DataPlane(options, std::move(on_lost), std::move(logger)));
  d->shared_memory_ = UcxTlsAllows(options.ucx, kSharedMemoryTransports);
  UcxContextOptions context_options;
  context_options.config = options.ucx;
  context_options.name = "kvdepotd";
  ASSIGN_OR_RETURN(d->context_, UcxContext::Create(context_options));
  if (!options.address_sandbox.empty()) {
    d->sandbox_ = std::make_unique<UcxAddressSandbox>(
        UcxAddressSandboxArgs(options.address_sandbox, options.ucx));
    // Now, so that the first session does not wait for it, and so that
    // one that cannot start is said at startup. Without one, clients are
    // served over gRPC (Check says Unavailable, naming UCX).
    if (absl::Status started = d->sandbox_->Start(); !started.ok()) {
      d->SandboxFailed(started);
    }
  }
  ASSIGN_OR_RETURN(d->arena_, d->context_->Register(arena.base, arena.size));
  for (int i = 0; i < options.workers; ++i) {
    UcxWorkerOptions worker_options;
    worker_options.name = absl::StrCat("kvd-ucx-", i);
    ASSIGN_OR_RETURN(std::unique_ptr<UcxWorker> w,
                     UcxWorker::Create(*d->context_, worker_options));
    d->workers_.push_back(std::move(w));
  }
  // Requests come to a worker of their own, whose only endpoints are those
  // it pairs clients' request endpoints with (RequestAddress). (UCX pairs
  // the endpoints two workers have to each other, and refuses a pair whose
  // error handling differs: a co-located client's session endpoint has
  // none, its request endpoint must have it.)
  for (int i = 0; i < std::max(1, options.request_workers); ++i) {
    UcxWorkerOptions request_worker_options;
    request_worker_options.name = absl::StrCat("kvd-ucx-req-", i);
    ASSIGN_OR_RETURN(std::unique_ptr<UcxWorker> w,
                     UcxWorker::Create(*d->context_, request_worker_options));
    d->request_workers_.push_back(std::move(w));
  }
  DataPlane* self = d.get();
  d->monitor_ = std::make_unique<PeerMonitor>(
      *d->workers_[0], [self](uint64_t id, const absl::Status& why) {
        self->Lost(id, why);
      });
  d->lost_pool_ = std::make_unique<WorkPool>(1, "kvd-ucx-lost");
  d->retire_pool_ = std::make_unique<WorkPool>(1, "kvd-ucx-retire");
  d->request_pool_ = std::make_unique<WorkPool>(
      std::max(1, options.request_threads), "kvd-request");
  return d;
}

void DataPlane::SandboxFailed(const absl::Status& why) {
  if (sandbox_failing_.exchange(true)) return;  // said already
  log_->error("{}: UCX sessions fall back to the gRPC byte path (OpenSession "
              "answers UNAVAILABLE for them) until a sandbox works; one is "
              "started again at each OpenSession with a UCX worker address",
              why.ToString());
}

void DataPlane::Close() {
  absl::flat_hash_map<SessionId, std::shared_ptr<Link>> links;
  absl::flat_hash_map<std::string, RequestLink> request_links;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    links.swap(links_);
    request_links.swap(request_links_);
  }
  request_links.clear();  // their destructors force-close them
  for (auto& [session, link] : links) {
    // Force-closes the endpoint now, even while transfers still hold the
    // link: they end Cancelled.
    Unlink(session, std::move(link), /*force=*/true);
  }
}

void DataPlane::Unlink(SessionId session, std::shared_ptr<Link> link,
                       bool force) {
  if (link->colocated) monitor_->Unwatch(session).IgnoreError();
  link->endpoint->Close(force);
  Retire(std::move(link));
}

DataPlane::~DataPlane() {
  Close();
  // Create may have failed before the request workers were made.
  for (auto& w : request_workers_) w->Stop();  // no new requests
  request_pool_.reset();  // runs what was handed over: it ends at once
  monitor_.reset();
  for (auto& w : workers_) w->Stop();
  retire_pool_.reset();  // stops the co-located clients' workers
  lost_pool_.reset();  // runs what was already handed over
}

void DataPlane::Retire(std::shared_ptr<Link> link) {
  if (link == nullptr || link->own_worker == nullptr) return;
  // The task holds the link, so the worker object outlives its Stop; the
  // link (endpoint, then worker) goes with the last holder, a transfer's
  // release on lost_pool_ or this task.
  retire_pool_->Submit([link = std::move(link)] { link->own_worker->Stop(); });
}

bool DataPlane::TakeColocatedSlot() {
  int n = colocated_workers_.load();
  while (n < options_.max_colocated_workers) {
    if (colocated_workers_.compare_exchange_weak(n, n + 1)) return true;
  }
  return false;
}

void DataPlane::Lost(SessionId session, const absl::Status& why) {
  internal::TestSyncPoint("DataPlane::Lost", &session);
  absl::MutexLock lock(&mu_);
  if (closing_) return;
  if (!links_.contains(session)) {
    // Still attaching: reported once it is linked. Else detached already.
    if (auto it = attaching_.find(session); it != attaching_.end() && it->second.ok()) {
      it->second = why.ok() ? absl::UnavailableError("UCX peer lost") : why;
    }
    return;
  }
  lost_pool_->Submit([this, session, why] { on_lost_(session, why); });
}

absl::Status DataPlane::Attach(SessionId session, std::string_view address,
                               std::string_view client_host_id,
                               std::optional<uint32_t> client_uid,
                               std::optional<TcpSegmentSizes> client_tcp,
                               absl::Time connect_by) {
  if (address.empty()) {
    return absl::InvalidArgumentError("empty UCX worker address");
  }
  if (const auto& ours = context_->tcp_segments();
      client_tcp.has_value() && ours.has_value() &&
      !TcpSegmentsFit(*ours, *client_tcp)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the client's UCX TCP segments (TX_SEG_SIZE ", client_tcp->tx,
        ", RX_SEG_SIZE ", client_tcp->rx, ") do not fit kvdepotd's (",
        ours->tx, ", ", ours->rx, "): each side's UCX_TCP_TX_SEG_SIZE must "
        "be at most the other's UCX_TCP_RX_SEG_SIZE (UCX aborts the receiver "
        "of a larger segment); set them alike on both sides"));
  }
  if (const size_t closing = endpoints_closing();
      closing >= options_.max_endpoints_closing) {
    return absl::UnavailableError(absl::StrCat(
        closing,
        " UCX endpoints wait for clients that stopped answering "
        "(each keeps a socket open; max_endpoints_closing): no new one until "
        "some of them close"));
  }
  UcxWorker* worker;
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return absl::UnavailableError("data plane stopping");
    if (links_.contains(session)) {
      return absl::AlreadyExistsError(
          absl::StrCat("session ", session, " already has a UCX endpoint"));
    }
    // Wire-ups in progress count too: their links join links_ only once
    // connected.
    if (links_.size() + wiring_up_ >= max_links_) {
      return absl::UnavailableError(absl::StrCat(
          links_.size() + wiring_up_,
          " sessions have a UCX endpoint or are being wired up, the most "
          "kvdepotd's open file limit leaves room for (max_links; raise "
          "RLIMIT_NOFILE, LimitNOFILE in systemd): this one uses gRPC"));
    }
    ++wiring_up_;
    worker = workers_[next_worker_++ % workers_.size()].get();
  }
  absl::Cleanup attach_ended = [this] {
    absl::MutexLock lock(&mu_);
    --wiring_up_;
  };
  bool colocated = shared_memory_ && !client_host_id.empty() &&
                   client_host_id == LocalHostId();
  if (colocated && !client_uid) {
    // Its buffers could not be tied to its user: no shared memory for it.
    if (uint64_t left_out; log_limit_.Allow("not a local socket", &left_out)) {
      log_->warn(
          "session {}: client says it is on this host, but its "
          "connection is not a local socket whose owner is known; "
          "serving it over TCP{}",
          session, LeftOutNote(left_out));
    }
    colocated = false;
  } else if (colocated && *client_uid != geteuid()) {
    // UCX's shared-memory segments are its user's alone (mode 0600):
    // kvdepotd could not attach them (shmat: Permission denied) -- the
    // endpoint, or its check in the sandbox, would fail -- nor the client
    // kvdepotd's. Served as a remote client: TCP, with peer error
    // handling (which no shared-memory transport of UCX 1.13 but cma has,
    // and cma is not used for this client's memory: its keys lose their
    // shared-memory parts, RegisterBuffer).
    if (uint64_t left_out; log_limit_.Allow("another uid", &left_out)) {
      log_->info(
          "session {}: client uid {} differs from kvdepotd's {}: "
          "shared memory off for it, served over TCP{}",
          session, *client_uid, geteuid(), LeftOutNote(left_out));
    }
    colocated = false;
  }
  auto link = std::make_shared<Link>();
  if (colocated) {
    // A worker of its own (see max_colocated_workers), or TCP.
    std::string no_worker;
    if (!TakeColocatedSlot()) {
      no_worker = options_.max_colocated_workers == 0
                      ? "co-located clients get no UCX worker of their own "
                        "(ucx_colocated_workers: 0)"
                      : absl::StrCat(options_.max_colocated_workers,
                                     " co-located clients have a UCX worker of "
                                     "their own already (ucx_colocated_workers)");
    } else {
      link->slot.count = &colocated_workers_;
      UcxWorkerOptions worker_options;
      worker_options.name = absl::StrCat("kvd-sess-", session % 100000);
      absl::StatusOr<std::unique_ptr<UcxWorker>> own =
          UcxWorker::Create(*context_, worker_options);
      if (own.ok()) {
        link->own_worker = *std::move(own);
        worker = link->own_worker.get();
      } else {
        link->slot.Release();
        no_worker = absl::StrCat("no UCX worker for a co-located client (",
                                 own.status().ToString(), ")");
      }
    }
    if (!no_worker.empty()) {
      if (uint64_t left_out; log_limit_.Allow("no own worker", &left_out)) {
        log_->warn("session {}: {}; serving it over TCP{}", session, no_worker,
                   LeftOutNote(left_out));
      }
      colocated = false;
    }
  }
  if (sandbox_ != nullptr) {
    // The endpoints made to it below: the session's (without peer error
    // handling for a co-located client), the monitor's and the request
    // link (with). By connect_by, as the wire-up: a slow or restarting
    // sandbox, or other sessions' checks before this one, must not keep
    // the client from falling back to gRPC in time (DeadlineExceeded,
    // naming UCX, when the sandbox has not answered by then).
    absl::Status checked =
        sandbox_->Check(address, /*peer_error_handling=*/true, connect_by);
    if (checked.ok() && colocated) {
      checked =
          sandbox_->Check(address, /*peer_error_handling=*/false, connect_by);
    }
    if (checked.ok()) {
      if (sandbox_failing_.exchange(false)) {
        log_->info("the UCX address sandbox works again: UCX sessions are back");
      }
    } else if (absl::IsUnavailable(checked) && sandbox_->pid() < 0) {
      // No sandbox runs after this check: it could not start, was stuck,
      // or went (not the address's doing).
      SandboxFailed(checked);
    }
    if (!checked.ok()) {
      Retire(std::move(link));  // its own worker stops off this thread
      return checked;
    }
  }
  UcxEndpointOptions endpoint_options;
  endpoint_options.connect_timeout = ConnectTimeout(connect_by);
  endpoint_options.abandon_after = options_.abandon_after;
  endpoint_options.peer_error_handling = !colocated;
  // A client past a transfer's deadline may only be stalled: its endpoint
  // on a shared worker closes in order (a forced close could crash this
  // process in UCX when the client continues; UcxEndpointOptions). A
  // co-located client's goes with its own worker instead.
  endpoint_options.deadline_close =
      colocated ? DeadlineClose::kForce : DeadlineClose::kOrderly;
  endpoint_options.max_unsent_message_bytes = options_.max_unsent_reply_bytes;
  endpoint_options.on_error = [this, session](const absl::Status& why) {
    Lost(session, why);
  };
  {
    absl::MutexLock lock(&mu_);
    attaching_[session] = absl::OkStatus();
  }
  absl::Cleanup not_attaching = [this, session] {
    absl::MutexLock lock(&mu_);
    attaching_.erase(session);
  };
  absl::StatusOr<std::unique_ptr<UcxEndpoint>> endpoint =
      UcxEndpoint::Connect(*worker, address, std::move(endpoint_options));
  if (!endpoint.ok()) {
    Retire(std::move(link));  // its own worker stops off this thread
    return endpoint.status();
  }
  link->endpoint = *std::move(endpoint);
  if (colocated) {
    if (absl::Status watched = monitor_->Watch(session, address); !watched.ok()) {
      Unlink(session, std::move(link), /*force=*/true);
      return watched;
    }
    link->colocated = true;
    link->uid = client_uid;
    internal::TestSyncPoint("DataPlane::Attach:Watched", &session);
  }
  link->request_worker = EnsureRequestLink(session, address, connect_by);
  link->client_address = std::string(address);
  UcxEndpoint* endpoint_here = link->endpoint.get();
  {
    absl::MutexLock lock(&mu_);
    if (!closing_) {
      links_.emplace(session, std::move(link));
      link = nullptr;
      // An error before the link was in links_ found nothing to report
      // (Lost): report it now, or the session would wait for its lease.
      absl::Status st = endpoint_here->status();
      if (auto it = attaching_.find(session); st.ok() && it != attaching_.end()) {
        st = it->second;  // what the monitor saw meanwhile
      }
      if (!st.ok()) {
        lost_pool_->Submit([this, session, st] { on_lost_(session, st); });
      }
    }
  }
  if (link != nullptr) {  // closing: Unwatch waits on a progress thread, off mu_
    Unlink(session, std::move(link), /*force=*/true);
    return absl::UnavailableError("data plane stopping");
  }
  log_->debug("session {}: UCX endpoint connected ({})", session,
              colocated ? "co-located, shared memory allowed" : "peer error handling");
  return absl::OkStatus();
}

void DataPlane::Detach(SessionId session, bool peer_gone) {
  std::shared_ptr<Link> link;
  {
    absl::MutexLock lock(&mu_);
    auto it = links_.find(session);
    if (it == links_.end()) return;
    link = std::move(it->second);
    links_.erase(it);
  }
  // An orderly close for a client that may be alive (its session ended
  // normally or expired: a reset would make its UCX log errors); a forced
  // one for a client that is gone, whose flush would never end (the
  // worker's stop would wait close_timeout for it).
  Unlink(session, std::move(link), /*force=*/peer_gone);
}

void DataPlane::DetachIf(absl::FunctionRef<bool(SessionId)> ended) {
  std::vector<SessionId> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, link] : links_) sessions.push_back(id);
  }
  for (SessionId id : sessions) {
    if (ended(id)) Detach(id);
  }
}

bool DataPlane::attached(SessionId session) const {
  return Find(session) != nullptr;
}

size_t DataPlane::sessions() const {
  absl::MutexLock lock(&mu_);
  return links_.size();
}

std::shared_ptr<DataPlane::Link> DataPlane::Find(SessionId session) const {
  absl::MutexLock lock(&mu_);
  auto it = links_.find(session);
  return it == links_.end() ? nullptr : it->second;
}

absl::StatusOr<DataPlane::Buffer> DataPlane::RegisterBuffer(
    SessionId session, std::string_view packed_rkey, uint64_t address,
    uint64_t size) {
  std::shared_ptr<Link> link = Find(session);
  if (link == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session, " has no UCX endpoint (open it with a worker address)"));
  }
  if (size == 0) return absl::InvalidArgumentError("buffer size 0");
  absl::MutexLock lock(&link->mu);
  if (link->buffers >= options_.max_buffers_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " has registered ", link->buffers,
        " buffers (the most allowed)"));
  }
  RemoteRegion region;
  region.packed_rkey = std::string(packed_rkey);
  region.base = address;
  region.size = size;
  // A co-located client may only name its own user's shared memory; any
  // other client none on this host.
  if (link->colocated) {
    region.owner_uid = link->uid;
  } else {
    region.shared_memory = false;
  }
  Buffer buffer;
  ASSIGN_OR_RETURN(buffer.id, link->endpoint->AddRemoteRegion(region));
  ++link->buffers;
  buffer.copied_here = link->colocated && link->endpoint->mapped(buffer.id);
  return buffer;
}

bool DataPlane::CopiedHere(SessionId session, uint32_t buffer) const {
  std::shared_ptr<Link> link = Find(session);
  return link != nullptr && link->colocated && link->endpoint->mapped(buffer);
}

absl::StatusOr<TransferHandle> DataPlane::Push(SessionId session,
                                               absl::Span<const BlockMove> moves,
                                               absl::Time deadline,
                                               CopyHere copy_here, PutEnd end) {
  return Move(/*push=*/true, session, moves, deadline, nullptr,
              std::move(copy_here), end);
}

absl::StatusOr<TransferHandle> DataPlane::Pull(
    SessionId session, absl::Span<const BlockMove> moves, absl::Time deadline,
    absl::AnyInvocable<void(size_t)> each_got, CopyHere copy_here) {
  return Move(/*push=*/false, session, moves, deadline, std::move(each_got),
              std::move(copy_here));
}

absl::StatusOr<TransferHandle> DataPlane::Move(
    bool push, SessionId session, absl::Span<const BlockMove> moves,
    absl::Time deadline, absl::AnyInvocable<void(size_t)> each_got,
    CopyHere copy_here, PutEnd end) {
  std::shared_ptr<Link> link = Find(session);
  if (link == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session, " has no UCX endpoint"));
  }
  std::vector<Transfer> transfers;
  transfers.reserve(moves.size());
  for (const BlockMove& m : moves) {
    Transfer t;
    t.region = m.buffer;
    t.remote_addr = m.address;
    t.local = m.arena.data();
    t.size = m.arena.size();
    t.local_region = arena_.get();  // refuses bytes outside the arena
    transfers.push_back(t);
  }
  // Only a co-located client's memory is mapped here: a key from another
  // host that names a segment of this one must not reach it.
  if (!link->colocated) copy_here = nullptr;
  TransferHandle handle =
      push ? link->endpoint->Put(transfers, deadline, std::move(copy_here), end)
           : link->endpoint->Get(transfers, deadline, std::move(each_got),
                                 std::move(copy_here));
  // The link (and its endpoint) lives until the transfers have ended (a
  // batch done by copies here is ready already: it goes on return).
  if (!handle.IsReady()) {
    handle.OnReady([this, session, link = std::move(link)]() mutable {
      LetGo(session, std::move(link));
    });
  }
  return handle;
}

void DataPlane::LetGo(SessionId session, std::shared_ptr<Link> link) {
  {
    absl::MutexLock lock(&mu_);
    auto it = links_.find(session);
    if (it != links_.end() && it->second == link) {
      link.reset();  // the session still holds it: not the last holder
      return;
    }
  }
  // Perhaps the last holder: the endpoint must not go inside the UCX
  // callback that ended the transfers, so it goes on the pool's thread.
  lost_pool_->Submit([link = std::move(link)] {});
}

// ---- Requests over UCX ------------------------------------------------------

void DataPlane::ServeRequests(RequestHandler handler) {
  request_handler_ = std::move(handler);
  absl::Status st;
  for (auto& w : request_workers_) {
    if (st.ok()) st = ServeRequestsOn(*w);
  }
  if (!st.ok()) {
    log_->warn("UCX requests not served (clients use gRPC calls): {}",
               st.ToString());
    return;
  }
  serving_requests_ = true;
}

absl::Status DataPlane::ServeRequestsOn(UcxWorker& request_worker) {
  absl::Status st = request_worker.SetMessageHandler(
      kRequestMessageId,
      [this](absl::string_view header, absl::string_view payload,
             const UcxWorker::MessageSender& sender) {
        OnRequest(header, payload, sender);
      });
  if (st.ok()) {
    st = request_worker.SetDataMessageHandler(
        kDataRequestMessageId,
        [this](absl::string_view header,
               std::unique_ptr<UcxWorker::IncomingData> data,
               const UcxWorker::MessageSender& sender) {
          std::optional<DataRequestHeader> h = DecodeDataRequestHeader(header);
          if (!h) {
            log_->debug("dropped a UCX data message that is not a request "
                        "({} header bytes)", header.size());
            return;  // its data is released unread
          }
          Admit(h->header, h->body, std::move(data), sender);
        });
  }
  return st;
}


absl::StatusOr<TransferHandle> DataPlane::Receive(
    std::unique_ptr<UcxWorker::IncomingData> data,
    std::vector<absl::Span<char>> pieces, absl::Time deadline,
    absl::AnyInvocable<void(size_t)> each_got) {
  for (const absl::Span<char>& p : pieces) {
    if (p.data() != nullptr && !arena_->Contains(p.data(), p.size())) {
      return absl::InvalidArgumentError("a request's data must go into arena slots");
    }
  }
  if (data == nullptr) return absl::InvalidArgumentError("no data to receive");
  // Pieces that do not add up to the data: Receive refuses them.
  UcxWorker& worker = data->worker();  // the one it came on
  return worker.Receive(std::move(data), std::move(pieces), deadline,
                        std::move(each_got));
}

void DataPlane::OnRequest(absl::string_view header, absl::string_view payload,
                          const UcxWorker::MessageSender& sender) {
  std::optional<RequestHeader> h = DecodeRequestHeader(header);
  if (!h) {
    log_->debug("dropped a UCX message that is not a request ({} header bytes)",
                header.size());
    return;
  }
  Admit(*h, payload, nullptr, sender);
}

void DataPlane::Admit(const RequestHeader& h, absl::string_view payload,
                      std::unique_ptr<UcxWorker::IncomingData> data,
                      const UcxWorker::MessageSender& sender) {
  // Answered here, over the connection the request came on (data, if any,
  // released unread).
  auto refuse = [&](const absl::Status& why) {
    if (options_.on_refused) options_.on_refused(why.code());
    sender.Reply(kReplyMessageId,
                 EncodeReplyHeader(ReplyHeader{h.request_id, why.code(), h.session_id}),
                 std::string(why.message()));
  };
  if (data != nullptr && h.method != RequestMethod::kPullBlocks) {
    return refuse(absl::InvalidArgumentError("only PullBlocks requests come with data"));
  }
  if (requests_stopped_.load()) {
    return refuse(absl::UnavailableError("kvdepotd is stopping"));
  }
  if (payload.size() > kMaxRequestPayload) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "request of ", payload.size(), " bytes (at most ", kMaxRequestPayload, ")")));
  }
  std::shared_ptr<Link> link = Find(h.session_id);
  if (link == nullptr) {
    absl::MutexLock lock(&mu_);
    // Almost always a session that ended (closed, expired, or lost its
    // client): NOT_FOUND, as for an unknown session over gRPC, so that the
    // client opens a new one.
    return refuse(closing_ ? absl::UnavailableError("kvdepotd is stopping")
                           : absl::NotFoundError(absl::StrCat(
                                 "session ", h.session_id,
                                 " is not open here with a UCX endpoint")));
  }
  if (!FromRequestLink(*link, sender)) {
    // Another worker than the session's client's (or one that wired up a
    // connection of its own): its data would come over an endpoint
    // kvdepotd did not make and cannot close (UCX 1.13 aborts when a
    // worker goes with a rendezvous receive pending on such an endpoint,
    // transport/README caveat 7), and its reply would go to the session's
    // client, under ids that client may be waiting on. Refused (the data
    // released unread) over the connection it came on.
    return refuse(absl::PermissionDeniedError(absl::StrCat(
        "a request for session ", h.session_id,
        " must come over the request link of that session's UCX worker")));
  }
  // What the request holds here until its reply: its body, and the data
  // when it came eagerly (held whole; libkvdepot always sends it as
  // rendezvous, which stays with the client until received).
  size_t held_bytes = payload.size();
  if (data != nullptr && data->eager()) {
    if (data->size() > kMaxEagerRequestData) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
          "a request's data of ", data->size(), " bytes came eagerly (at most ",
          kMaxEagerRequestData, "): send it as rendezvous")));
    }
    held_bytes += data->size();
  }
  if (absl::Status taken = TakeRequestSlot(h.session_id, h.request_id, held_bytes);
      !taken.ok()) {
    return refuse(taken);
  }
  Request request{h.session_id, h.method, h.request_id, std::string(payload),
                  std::move(data)};
  if (!link->colocated) return request_handler_(std::move(request));
  request_pool_->Submit([this, request = std::move(request)]() mutable {
    request_handler_(std::move(request));
  });
}

absl::Status DataPlane::TakeRequestSlot(SessionId session, uint64_t id,
                                        size_t bytes) {
  absl::MutexLock lock(&requests_mu_);
  auto it = session_requests_.find(session);
  const size_t session_requests =
      it == session_requests_.end() ? 0 : it->second.bodies.size();
  const size_t session_bytes = it == session_requests_.end() ? 0 : it->second.bytes;
  if (it != session_requests_.end() && it->second.bodies.contains(id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX request id ", id, " is in flight already for session ", session));
  }
  if (requests_in_flight_.load() >= options_.max_requests_in_flight) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "more than ", options_.max_requests_in_flight, " UCX requests in flight"));
  }
  if (session_requests >= options_.max_requests_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " has ", session_requests,
        " UCX requests in flight (at most ", options_.max_requests_per_session,
        " per session)"));
  }
  // No overflow: the sums are bounded by the caps, `bytes` by
  // kMaxRequestPayload.
  if (session_bytes + bytes > options_.max_request_bytes_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " has ", session_bytes,
        " bytes of UCX requests in flight; this one's ", bytes,
        " would pass the ", options_.max_request_bytes_per_session,
        " allowed per session"));
  }
  if (request_bytes_ + bytes > options_.max_request_bytes_in_flight) {
    return absl::ResourceExhaustedError(absl::StrCat(
        request_bytes_, " bytes of UCX requests in flight; this one's ", bytes,
        " would pass the ", options_.max_request_bytes_in_flight, " allowed"));
  }
  SessionRequests& s = session_requests_[session];
  s.bodies.emplace(id, bytes);
  s.bytes += bytes;
  request_bytes_ += bytes;
  requests_in_flight_.fetch_add(1);
  return absl::OkStatus();
}

bool DataPlane::ReleaseRequestSlot(SessionId session, uint64_t id) {
  absl::MutexLock lock(&requests_mu_);
  auto it = session_requests_.find(session);
  if (it == session_requests_.end()) return false;
  auto body = it->second.bodies.find(id);
  if (body == it->second.bodies.end()) return false;
  it->second.bytes -= body->second;
  request_bytes_ -= body->second;
  it->second.bodies.erase(body);
  if (it->second.bodies.empty()) session_requests_.erase(it);
  return true;
}

void DataPlane::Reply(SessionId session, uint64_t id, const absl::Status& status,
                      std::string body) {
  // Released whether or not the session still has its endpoint: a session
  // that ended still had this request counted.
  if (!ReleaseRequestSlot(session, id)) {
    log_->error("session {}: a reply to UCX request {}, which is not in flight, "
                "dropped", session, id);
    return;
  }
  if (std::shared_ptr<Link> link = Find(session); link != nullptr) {
    std::string header = EncodeReplyHeader(ReplyHeader{id, status.code(), session});
    std::string payload =
        status.ok() ? std::move(body) : std::string(status.message());
    absl::Status sent = link->endpoint->SendMessage(
        kReplyMessageId, std::move(header), std::move(payload));
    if (!sent.ok()) {
      log_->debug("session {}: reply to UCX request {} dropped: {}", session, id,
                  sent.ToString());
    }
  }
  // Last: once no request is in flight, nothing here runs any more (the
  // daemon waits for that before the data plane goes).
  requests_in_flight_.fetch_sub(1);
}

size_t DataPlane::EnsureRequestLink(SessionId session, std::string_view address,
                                    absl::Time connect_by) {
  if (!serving_requests_) return 0;
  const std::string key(address);
  uint64_t id;
  size_t request_worker;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = request_links_.find(key); it != request_links_.end()) {
      return it->second.worker;
    }
    // Client workers are spread over the request workers in turn.
    request_worker = next_request_worker_++ % request_workers_.size();
    if (closing_) return request_worker;
    if (request_links_.size() >= options_.max_request_links) {
      if (uint64_t left_out; log_limit_.Allow("request links", &left_out)) {
        log_->warn(
            "session {}: {} client workers have a request link "
            "already (max_request_links); this client uses gRPC "
            "calls{}",
            session, request_links_.size(), LeftOutNote(left_out));
      }
      return request_worker;
    }
    id = ++next_request_link_;
    // Taken: a second Attach does not make one.
    request_links_[key] = RequestLink{id, request_worker, nullptr};
  }
  UcxEndpointOptions options;
  options.connect_timeout = ConnectTimeout(connect_by);
  options.abandon_after = options_.abandon_after;
  options.peer_error_handling = true;
  options.on_error = [this, key, id](const absl::Status&) {
    DropRequestLink(key, id);
  };
  absl::StatusOr<std::unique_ptr<UcxEndpoint>> endpoint =
      UcxEndpoint::Connect(*request_workers_[request_worker], address,
                           std::move(options));
  if (!endpoint.ok()) {
    if (uint64_t left_out; log_limit_.Allow("no request link", &left_out)) {
      log_->warn(
          "session {}: no request link to the client's worker ({}); "
          "the client uses gRPC calls{}",
          session, endpoint.status().ToString(), LeftOutNote(left_out));
    }
    DropRequestLink(key, id);
    return request_worker;
  }
  // Failed meanwhile, or closing: `endpoint` keeps it, and its destructor
  // force-closes it after `lock` is released (declared later, gone first).
  absl::MutexLock lock(&mu_);
  auto it = request_links_.find(key);
  if (it != request_links_.end() && it->second.id == id) {
    it->second.endpoint = *std::move(endpoint);
  }
  return request_worker;
}

void DataPlane::DropRequestLink(const std::string& address, uint64_t id) {
  std::unique_ptr<UcxEndpoint> endpoint;
  {
    absl::MutexLock lock(&mu_);
    auto it = request_links_.find(address);
    if (it == request_links_.end() || it->second.id != id) return;
    endpoint = std::move(it->second.endpoint);
    request_links_.erase(it);
  }
  if (endpoint == nullptr) return;
  // Destroyed (force-closed) on the pool, not inside the endpoint's own
  // callback, where on_error comes from.
  lost_pool_->Submit([endpoint = std::move(endpoint)] {});
}

bool DataPlane::HasRequestLink(const std::string& client_address) const {
  absl::MutexLock lock(&mu_);
  auto it = request_links_.find(client_address);
  return it != request_links_.end() && it->second.endpoint != nullptr;
}

bool DataPlane::FromRequestLink(const Link& link,
                                const UcxWorker::MessageSender& sender) const {
  // The link's endpoint is used on its worker's progress thread only: a
  // request that came on another request worker is not over it.
  if (sender.endpoint() == nullptr ||
      !request_workers_[link.request_worker]->OnProgressThread()) {
    return false;
  }
  absl::MutexLock lock(&mu_);
  auto it = request_links_.find(link.client_address);
  return it != request_links_.end() && it->second.endpoint != nullptr &&
         it->second.endpoint->Owns(sender.endpoint());
}

bool DataPlane::TakesDataRequests(SessionId session) const {
  if (!serving_requests_) return false;
  std::shared_ptr<Link> link = Find(session);
  return link != nullptr && HasRequestLink(link->client_address);
}

absl::Duration DataPlane::ConnectTimeout(absl::Time connect_by) const {
  return std::clamp(connect_by - absl::Now(), absl::Milliseconds(1),
                    options_.connect_timeout);
}

size_t DataPlane::endpoints_closing() const {
  // The worker lists are made in Create and never change.
  size_t n = 0;
  for (const auto& w : workers_) n += w->endpoints_closing();
  for (const auto& w : request_workers_) n += w->endpoints_closing();
  return n;
}

size_t DataPlane::request_links() const {
  absl::MutexLock lock(&mu_);
  return request_links_.size();
}

std::string DataPlane::RequestAddress(SessionId session) const {
  if (!serving_requests_) return std::string();
  std::shared_ptr<Link> link = Find(session);
  // Requests come only over a request link (Admit): without one the
  // client uses gRPC calls.
  if (link == nullptr || !HasRequestLink(link->client_address)) return std::string();
  return request_workers_[link->request_worker]->address();
}

size_t DataPlane::requests_in_flight() const { return requests_in_flight_.load(); }

}  // namespace kvdepot
