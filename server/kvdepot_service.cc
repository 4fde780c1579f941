#include "server/kvdepot_service.h"

#include <grpcpp/support/byte_buffer.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "server/peer_credentials.h"
#include "server/version.h"
#include "storage/block_key.h"
#include "storage/checksum.h"
#include "storage/internal/sync_point.h"
#include "storage/status_macros.h"
#include "transport/ucx_address_sandbox.h"

namespace kvdepot {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

namespace {

// How the message of an OpenSession that got no UCX endpoint begins, whatever
// its code: libkvdepot then opens its session without one
// (OpenSessionRequest.ucx_worker_address).
constexpr absl::string_view kNoUcxEndpoint = "no UCX endpoint for the client: ";

// The least time worth a UCX wire-up (one loopback wire-up takes about a
// millisecond; a remote one, a few round trips).
constexpr absl::Duration kMinWireUp = absl::Milliseconds(50);

// New sessions and Read streams once SIGTERM has come (BeginShutdown).
absl::Status StoppingError() {
  return absl::UnavailableError(
      "kvdepotd is stopping: it opens no new sessions or reads");
}

// What a PullBlocks request with data may drop (the bytes of blocks stored
// already) beyond its new blocks' bytes, before its data is left unread
// and the new blocks are read from their sources instead (StartPullBlocks).
constexpr uint64_t kMaxDroppedBytes = uint64_t{1} << 20;

v1::Tier ToProto(Tier t) {
  switch (t) {
    case Tier::kDram:
      return v1::TIER_DRAM;
    case Tier::kNvme:
      return v1::TIER_NVME;
    case Tier::kNone:
      break;
  }
  return v1::TIER_UNSPECIFIED;
}

std::vector<absl::string_view> Views(
    const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<absl::string_view>(keys.begin(), keys.end());
}

// Public RPCs never act as the in-process session.
absl::Status RequireSession(uint64_t session_id) {
  if (session_id == kInternalSession) {
    return absl::NotFoundError("session_id is required (call OpenSession)");
  }
  return absl::OkStatus();
}

void FillNamespace(const NamespaceStats& ns, v1::NamespaceStats* out) {
  out->set_name(ns.name);
  out->set_blocks(ns.blocks);
  out->set_bytes(ns.bytes);
  out->set_lookups(ns.lookups);
  out->set_hits(ns.hits);
}

// The host in gRPC's name of a call's peer ("ipv4:10.0.0.7:41234" ->
// "ipv4:10.0.0.7", "ipv6:[::1]:41234" -> "ipv6:[::1]"): sessions are
// counted per host (max_sessions_per_peer), whatever ports its clients use.
std::string PeerHost(absl::string_view peer) {
  const size_t scheme = peer.find(':');
  const size_t port = peer.rfind(':');
  if (scheme == absl::string_view::npos || port == scheme) {
    return std::string(peer);
  }
  return std::string(peer.substr(0, port));
}

}  // namespace

KvDepotService::KvDepotService(TieredStore& store, ServerMetrics& metrics,
                               Clock& clock,
                               std::shared_ptr<spdlog::logger> logger)
    : store_(store), metrics_(metrics), clock_(clock), log_(std::move(logger)),
      started_(clock.Now()) {}

void KvDepotService::Finished(const char* op, const absl::Status& st,
                              absl::Time start) {
  metrics_.RecordRequest(op, st.code(), clock_.Now() - start);
  switch (st.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kCancelled:
      break;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
      log_->debug("{} rejected: {}", op, st.ToString());
      break;
    default:
      // A client can set these off at will (a stream left idle, a deadline
      // too short for a wire-up): limited per op.
      if (uint64_t left_out; log_limit_.Allow(op, &left_out)) {
        log_->warn("{} failed: {}{}", op, st.ToString(), LeftOutNote(left_out));
      }
  }
}

void KvDepotService::LogLeftOut() {
  for (const auto& [site, n] : log_limit_.TakeLeftOut()) {
    log_->warn("{}: {} more line(s) like the last one logged were left out",
               site, n);
  }
}

void KvDepotService::Register(Stream* stream) {
  stream->Progressed(clock_.Now());
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
}

void KvDepotService::Unregister(Stream* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

size_t KvDepotService::active_streams() {
  absl::MutexLock lock(&streams_mu_);
  return streams_.size();
}

int KvDepotService::CancelIdleStreams(absl::Duration idle) {
  absl::Time cutoff = clock_.Now() - idle;
  int n = 0;
  // Under streams_mu_: a stream unregisters (in OnDone, before it is
  // deleted) under the same lock, so every pointer here is alive.
  absl::MutexLock lock(&streams_mu_);
  for (Stream* s : streams_) {
    if (s->last_progress() < cutoff) {
      s->CancelIdle(idle);
      ++n;
    }
  }
  if (n > 0) log_->info("cancelled {} stream(s) idle for more than {}", n,
                        absl::FormatDuration(idle));
  return n;
}

template <typename Fn>
grpc::ServerUnaryReactor* KvDepotService::Unary(grpc::CallbackServerContext* ctx,
                                                const char* op, Fn&& fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Finisher(op, reactor)(fn());
  return reactor;
}

std::function<void(const absl::Status&)> KvDepotService::Finisher(
    const char* op, grpc::ServerUnaryReactor* reactor) {
  active_calls_.fetch_add(1);
  return [this, op, reactor, start = clock_.Now()](const absl::Status& st) {
    Finished(op, st, start);
    reactor->Finish(ToGrpcStatus(st));
    active_calls_.fetch_sub(1);
  };
}

namespace {

// OpenSession's strings are kept for the session's life and logged: short,
// and no control characters in the name (a newline would forge log lines).
absl::Status ValidateOpenSession(const v1::OpenSessionRequest& req) {
  if (req.client_name().size() > kMaxClientNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "client_name of ", req.client_name().size(), " bytes (at most ",
        kMaxClientNameBytes, ")"));
  }
  for (unsigned char c : req.client_name()) {
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          "client_name holds a control character");
    }
  }
  if (req.host_id().size() > kMaxHostIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_id of ", req.host_id().size(), " bytes (at most ", kMaxHostIdBytes, ")"));
  }
  if (req.ucx_worker_address().size() > kMaxUcxWorkerAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx_worker_address of ", req.ucx_worker_address().size(),
        " bytes (at most ", kMaxUcxWorkerAddressBytes, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* KvDepotService::OpenSession(
    grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* req,
    v1::OpenSessionResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::function<void(const absl::Status&)> finish =
      Finisher("OpenSession", reactor);
  absl::StatusOr<SessionGrant> grant = [&]() -> absl::StatusOr<SessionGrant> {
    RETURN_IF_ERROR(ValidateOpenSession(*req));
    if (shutting_down()) return StoppingError();
    return store_.OpenSession(absl::Milliseconds(req->lease_ms()),
                              req->client_name(), PeerHost(ctx->peer()));
  }();
  if (!grant.ok()) {
    finish(grant.status());
    return reactor;
  }
  const SessionGrant g = *grant;
  resp->set_session_id(g.id);
  resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(g.lease)));
  const StoreOptions& o = store_.options();
  // The largest block an empty DRAM tier can take: its pages, and a page
  // for its key's slab (advertising the whole tier promised blocks that
  // every put refused).
  constexpr uint64_t kPage = DramArena::kPageSize;
  const uint64_t pages = store_.dram_region().size / kPage;
  resp->set_max_block_bytes(std::min<uint64_t>(
      o.max_block_bytes, pages > 1 ? (pages - 1) * kPage : 0));
  resp->set_max_batch_keys(o.max_batch_keys);
  resp->set_max_chunk_bytes(kMaxChunkBytes);
  if (req->ucx_worker_address().empty() || data_plane_ == nullptr) {
    if (uint64_t left_out; log_limit_.Allow("session opened", &left_out)) {
      log_->info("session {} opened by '{}' from {} (lease {}){}", g.id,
                 req->client_name(), ctx->peer(), absl::FormatDuration(g.lease),
                 LeftOutNote(left_out));
    }
    finish(absl::OkStatus());
    return reactor;
  }
  if (attach_pool_.queued() >= kMaxAttachesWaiting) {
    store_.CloseSession(g.id).IgnoreError();
    finish(absl::UnavailableError(
        absl::StrCat(kNoUcxEndpoint, kMaxAttachesWaiting,
                     " UCX wire-ups are waiting already")));
    return reactor;
  }
  attach_pool_.Submit([this, ctx, req, resp, g, finish = std::move(finish)] {
    AttachAndFinish(ctx, req, resp, g.id, g.lease, finish);
  });
  return reactor;
}

void KvDepotService::AttachAndFinish(
    grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* req,
    v1::OpenSessionResponse* resp, SessionId id, absl::Duration lease,
    std::function<void(const absl::Status&)> finish) {
  if (ctx->IsCancelled()) {  // gave up while the wire-up waited its turn
    store_.CloseSession(id).IgnoreError();
    return finish(absl::CancelledError("the client cancelled OpenSession"));
  }
  std::optional<TcpSegmentSizes> client_tcp;
  if (req->ucx_tcp_tx_seg_size() != 0 && req->ucx_tcp_rx_seg_size() != 0) {
    client_tcp =
        TcpSegmentSizes{req->ucx_tcp_tx_seg_size(), req->ucx_tcp_rx_seg_size()};
  }
  // The wire-up takes at most half of what is left of the client's
  // deadline: should it fail, the client has the other half to open its
  // session without UCX (a worker that does not answer takes the whole
  // connect timeout, and wire-ups queued behind others start late).
  const absl::Duration left = absl::FromChrono(ctx->deadline()) - absl::Now();
  AttachPoint point{absl::OkStatus(), absl::Now() + left / 2};
  internal::TestSyncPoint("KvDepotService::AttachAndFinish:Attach", &point);
  absl::Status attached = point.status;
  if (attached.ok() && left / 2 < kMinWireUp) {
    attached = absl::DeadlineExceededError(absl::StrCat(
        "the client's deadline leaves ", absl::FormatDuration(left),
        ": no time for a UCX wire-up"));
  }
  if (attached.ok()) {
    // The owner of the client's socket matters only to a client on this
    // host (shared memory), and finding it reads the host's whole TCP table
    // and every descriptor of kvdepotd: not for the others.
    std::optional<uint32_t> client_uid;
    if (!req->host_id().empty() && req->host_id() == LocalHostId()) {
      client_uid = LocalPeerUid(ctx->peer());
    }
    attached =
        data_plane_->Attach(id, req->ucx_worker_address(), req->host_id(),
                            client_uid, client_tcp, point.connect_by);
  }
  if (!attached.ok()) {
    // The client falls back to its gRPC byte path (kNoUcxEndpoint).
    store_.CloseSession(id).IgnoreError();
    if (uint64_t left_out; log_limit_.Allow("no UCX endpoint", &left_out)) {
      log_->warn("session of '{}' from {}: no UCX endpoint: {}{}",
                 req->client_name(), ctx->peer(), attached.ToString(),
                 LeftOutNote(left_out));
    }
    return finish(absl::Status(
        attached.code(), absl::StrCat(kNoUcxEndpoint, attached.message())));
  }
  resp->set_ucx_connected(true);
  resp->set_ucx_request_address(data_plane_->RequestAddress(id));
  resp->set_ucx_data_requests(data_plane_->TakesDataRequests(id));
  if (ctx->IsCancelled()) {
    // The client gave up while the endpoint was wired up (up to two
    // connects): no one would learn the session's id, and it would hold
    // its endpoint (a co-located client's own worker, one of a few) until
    // its lease ends.
    data_plane_->Detach(id);
    store_.CloseSession(id).IgnoreError();
    return finish(absl::CancelledError("the client cancelled OpenSession"));
  }
  if (uint64_t left_out; log_limit_.Allow("session opened", &left_out)) {
    log_->info("session {} opened by '{}' from {} (lease {}, UCX endpoint){}",
               id, req->client_name(), ctx->peer(), absl::FormatDuration(lease),
               LeftOutNote(left_out));
  }
  finish(absl::OkStatus());
}

grpc::ServerUnaryReactor* KvDepotService::KeepAlive(
    grpc::CallbackServerContext* ctx, const v1::KeepAliveRequest* req,
    v1::KeepAliveResponse* resp) {
  return Unary(ctx, "KeepAlive", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(absl::Duration lease, store_.KeepAlive(req->session_id()));
    resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(lease)));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::CloseSession(
    grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* req,
    v1::CloseSessionResponse* resp) {
  return Unary(ctx, "CloseSession", [&]() -> absl::Status {
    if (data_plane_ != nullptr) data_plane_->Detach(req->session_id());
    ASSIGN_OR_RETURN(SessionRelease rel, store_.CloseSession(req->session_id()));
    resp->set_pins_released(rel.pins_released);
    resp->set_reservations_aborted(rel.reservations_aborted);
    if (uint64_t left_out; log_limit_.Allow("session closed", &left_out)) {
      log_->info("session {} closed ({} pins released, {} puts aborted){}",
                 req->session_id(), rel.pins_released, rel.reservations_aborted,
                 LeftOutNote(left_out));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::Lookup(grpc::CallbackServerContext* ctx,
                                                 const v1::LookupRequest* req,
                                                 v1::LookupResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto finish = Finisher("Lookup", reactor);
  if (req->pin()) {
    if (absl::Status st = RequireSession(req->session_id()); !st.ok()) {
      finish(st);
      return reactor;
    }
  }
  std::vector<absl::string_view> keys = Views(req->keys());
  // A pinned lookup that promotes blocks from NVMe answers from the store's
  // promotion threads; `req` and `resp` live until the reactor is done.
  store_.LookupAsync(
      req->session_id(), req->namespace_(), keys, req->prefix(), req->pin(),
      [this, ctx, req, resp, finish](absl::StatusOr<LookupResult> r) {
        if (!r.ok()) return finish(r.status());
        if (r->pin_id != 0 && ctx->IsCancelled()) {
          // The client gave up (deadline or cancel) and will never learn the
          // pin id: release it rather than hold the blocks until the session
          // ends.
          store_.Unpin(req->session_id(), r->pin_id).IgnoreError();
          return finish(absl::CancelledError("client cancelled the lookup"));
        }
        for (const LookupEntry& e : r->entries) {
          v1::LookupEntry* out = resp->add_entries();
          out->set_found(e.found);
          if (!e.found) continue;
          out->set_tier(ToProto(e.tier));
          out->set_size(e.size);
          out->set_checksum(e.checksum);
          if (req->pin()) out->set_offset(e.offset);
        }
        resp->set_prefix_hits(r->prefix_hits);
        resp->set_pin_id(r->pin_id);
        metrics_.RecordLookup(req->namespace_(), req->prefix(), *r);
        finish(absl::OkStatus());
      });
  return reactor;
}

grpc::ServerUnaryReactor* KvDepotService::Unpin(grpc::CallbackServerContext* ctx,
                                                const v1::UnpinRequest* req,
                                                v1::UnpinResponse* resp) {
  return Unary(ctx, "Unpin", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    ASSIGN_OR_RETURN(uint32_t n, store_.Unpin(req->session_id(), req->pin_id()));
    resp->set_blocks_released(n);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::BeginPut(
    grpc::CallbackServerContext* ctx, const v1::BeginPutRequest* req,
    v1::BeginPutResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  StartBeginPut(ctx, req, resp, Finisher("BeginPut", reactor), true);
  return reactor;
}

void KvDepotService::StartBeginPut(grpc::CallbackServerContext* ctx,
                                   const v1::BeginPutRequest* req,
                                   v1::BeginPutResponse* resp, Finish finish,
                                   bool must_not_block, absl::Status refuse_with) {
  if (absl::Status st = RequireSession(req->session_id()); !st.ok()) {
    return finish(st);
  }
  std::vector<PutSpec> specs;
  specs.reserve(req->blocks_size());
  for (const v1::PutSpec& b : req->blocks()) {
    specs.push_back(PutSpec{b.key(), b.parent_key(), b.size()});
  }
  bool would_wait = false;
  absl::StatusOr<Reservation> r = store_.BeginPut(
      req->session_id(), req->namespace_(), specs, must_not_block ? &would_wait : nullptr);
  if (would_wait) {
    if (!refuse_with.ok()) return finish(refuse_with);
    // DRAM is full of pinned and reserved blocks: the put waits for room
    // (up to 5 s) on put_pool_, not on gRPC's threads, which every other
    // call (a KeepAlive holding a lease) needs.
    return SubmitWaitingPut([this, ctx, req, resp,
                             finish = std::move(finish)](absl::Status queued) {
      if (ctx->IsCancelled())
        return finish(PutCancelled());  // gave up meanwhile
      // Queued too long: one more try, without waiting.
      StartBeginPut(ctx, req, resp, finish, /*must_not_block=*/!queued.ok(), queued);
    });
  }
  if (!r.ok()) {
    // Gave up while the put waited for room: told (and counted) so.
    return finish(ctx->IsCancelled() ? PutCancelled() : r.status());
  }
  // The client gave up while the put waited for room, or before this
  // handler ran.
  if (AbortIfClientGaveUp(ctx, req->session_id(), r->id)) {
    return finish(PutCancelled());
  }
  resp->set_reservation_id(r->id);
  for (const PutSlot& slot : r->slots) {
    v1::PutSlot* out = resp->add_slots();
    out->set_state(slot.exists ? v1::PUT_SLOT_EXISTS : v1::PUT_SLOT_RESERVED);
    out->set_offset(slot.offset);
  }
  finish(absl::OkStatus());
}

bool KvDepotService::AbortIfClientGaveUp(grpc::CallbackServerContext* ctx,
                                         SessionId session, ReservationId id) {
  if (id == 0 || ctx == nullptr || !ctx->IsCancelled()) return false;
  store_.AbortPut(session, id).IgnoreError();
  return true;
}

void KvDepotService::SubmitWaitingPut(absl::AnyInvocable<void(absl::Status) &&> put) {
  const absl::Time queued_at = absl::Now();
  put_pool_.Submit([queued_at, put = std::move(put)]() mutable {
    const absl::Duration queued = absl::Now() - queued_at;
    if (queued >= kMaxQueuedForRoom) {
      return std::move(put)(absl::ResourceExhaustedError(absl::StrCat(
          "DRAM tier full of pinned and reserved blocks: no room within ",
          absl::FormatDuration(absl::Trunc(queued, absl::Milliseconds(1))),
          " (other puts waiting for room first)")));
    }
    std::move(put)(absl::OkStatus());
  });
}

grpc::ServerUnaryReactor* KvDepotService::CommitPut(
    grpc::CallbackServerContext* ctx, const v1::CommitPutRequest* req,
    v1::CommitPutResponse* resp) {
  return Unary(ctx, "CommitPut", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    std::vector<uint64_t> sums(req->checksums().begin(), req->checksums().end());
    ASSIGN_OR_RETURN(std::vector<CommitOutcome> out,
                     store_.CommitPut(req->session_id(), req->reservation_id(), sums));
    for (CommitOutcome o : out) {
      switch (o) {
        case CommitOutcome::kStored:
          resp->add_results(v1::COMMIT_STORED);
          break;
        case CommitOutcome::kAlreadyExists:
          resp->add_results(v1::COMMIT_ALREADY_EXISTS);
          break;
        case CommitOutcome::kChecksumMismatch:
          resp->add_results(v1::COMMIT_CHECKSUM_MISMATCH);
          break;
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::AbortPut(
    grpc::CallbackServerContext* ctx, const v1::AbortPutRequest* req,
    v1::AbortPutResponse*) {
  return Unary(ctx, "AbortPut", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    return store_.AbortPut(req->session_id(), req->reservation_id());
  });
}

namespace {

// Reads a Write stream one message per event into a WriteStream. Deletes
// itself when gRPC is done with the call (releasing any unfinished block).
class WriteReactor final : public grpc::ServerReadReactor<v1::WriteRequest>,
                           public KvDepotService::Stream {
 public:
  WriteReactor(KvDepotService& service, grpc::CallbackServerContext* ctx,
               v1::WriteResponse* resp)
      : service_(service), ctx_(ctx), stream_(service.store(), resp),
        start_(service.clock().Now()) {
    service_.Register(this);
    StartRead(&msg_);
  }

  void Cancel() override { ctx_->TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close, or the client went away
      Finish(ctx_->IsCancelled() ? CancelledStatus(absl::CancelledError(
                                       "client cancelled the write"))
                                 : stream_.End());
      return;
    }
    Apply(/*must_not_block=*/true);
  }

  void OnDone() override {
    service_.Unregister(this);
    service_.Finished("Write", status_, start_);
    delete this;
  }

 private:
  // Applies msg_, then reads the next message. A block that must wait for
  // room (DRAM full of pinned and reserved blocks) waits on the service's
  // put pool, not on gRPC's threads, which every other call needs; the
  // next read starts from there.
  // `refuse_with` (a put that queued too long on the pool): a block that
  // would still wait ends the stream with it instead.
  void Apply(bool must_not_block, absl::Status refuse_with = absl::OkStatus()) {
    if ((!must_not_block || !refuse_with.ok()) && ctx_->IsCancelled()) {
      Finish(
          CancelledStatus(absl::CancelledError("client cancelled the write")));
      return;
    }
    uint64_t before = stream_.bytes_in();
    bool would_wait = false;
    absl::Status st = stream_.Consume(msg_, must_not_block ? &would_wait : nullptr);
    if (would_wait) {
      if (!refuse_with.ok()) return Finish(refuse_with);
      service_.SubmitWaitingPut([this](absl::Status queued) {
        // Queued too long: one more try, without waiting.
        Apply(/*must_not_block=*/!queued.ok(), queued);
      });
      return;
    }
    service_.metrics().AddBytesIn(stream_.bytes_in() - before);
    // Progress is a block started or finished, or a share of one received
    // (WriteStream::TakeProgress), not any message: a trickle of single
    // bytes would otherwise hold a block's reservation for ever.
    if (stream_.TakeProgress()) Progressed(service_.clock().Now());
    if (!st.ok()) {
      // A client that gave up while the block waited for room is told (and
      // counted) so, whatever the wait's end said (the store's 5 s ran out).
      if (!absl::IsCancelled(st) && ctx_->IsCancelled()) {
        st =
            CancelledStatus(absl::CancelledError("client cancelled the write"));
      }
      Finish(st);
      return;
    }
    StartRead(&msg_);
  }

  void Finish(const absl::Status& st) {
    // Release an unfinished block before the client can see the status, so
    // whatever it does next finds the space free.
    if (!st.ok()) stream_.Abort();
    status_ = st;
    grpc::ServerReadReactor<v1::WriteRequest>::Finish(ToGrpcStatus(st));
  }

  KvDepotService& service_;
  grpc::CallbackServerContext* const ctx_;
  WriteStream stream_;
  v1::WriteRequest msg_;
  absl::Status status_;
  const absl::Time start_;
};

// Streams a Read one chunk per event from a ReadStream; the last chunk is
// sent together with the final status. Each message is two slices: the small
// serialized prefix, and the block's bytes in DRAM, whose slice holds a
// reference on the block's pin until gRPC has sent it. Deletes itself when
// done.
class ReadReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                          public KvDepotService::Stream {
 public:
  ReadReactor(KvDepotService& service, grpc::CallbackServerContext* ctx,
              const grpc::ByteBuffer* raw_request)
      : service_(service), ctx_(ctx), stream_(service.store(), req_),
        start_(service.clock().Now()) {
    service_.Register(this);
    if (service_.shutting_down()) {
      Finish(StoppingError());
      return;
    }
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (raw_request->Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    if (!req_.ParseFromString(bytes)) {
      Finish(absl::InvalidArgumentError("malformed ReadRequest"));
      return;
    }
    absl::Status st = stream_.Validate();
    if (!st.ok()) {
      Finish(st);
      return;
    }
    WriteNext();
  }

  void Cancel() override { ctx_->TryCancel(); }

  void OnWriteDone(bool ok) override {
    Progressed(service_.clock().Now());
    if (!ok) {
      Finish(CancelledStatus(absl::CancelledError("client went away")));
      return;
    }
    WriteNext();
  }

  void OnDone() override {
    service_.Unregister(this);
    service_.metrics().AddBytesOut(stream_.bytes_out());
    if (!stream_.lookups().entries.empty() && !req_.looked_up()) {
      service_.metrics().RecordLookup(req_.namespace_(), /*prefix=*/false,
                                      stream_.lookups());
    }
    service_.Finished("Read", status_, start_);
    delete this;
  }

 private:
  void WriteNext() {
    if (stream_.NeedsPin()) {
      // A block only on NVMe is promoted on the store's threads; the write
      // continues from there.
      stream_.PinNext([this](absl::Status st) {
        if (!st.ok()) {
          Finish(st);
          return;
        }
        WriteChunk();
      });
      return;
    }
    WriteChunk();
  }

  void WriteChunk() {
    bool last = false;
    ReadChunk chunk;
    absl::Status st = stream_.Next(&chunk, &last);
    if (!st.ok()) {
      Finish(st);
      return;
    }
    grpc::Slice parts[2] = {
        grpc::Slice(chunk.prefix),
        grpc::Slice(const_cast<char*>(chunk.data), chunk.size,
                    &SharedPin::UnrefCallback, chunk.pin)};
    msg_ = grpc::ByteBuffer(parts, 2);
    if (last) {
      StartWriteAndFinish(&msg_, grpc::WriteOptions(), grpc::Status::OK);
    } else {
      StartWrite(&msg_);
    }
  }

  void Finish(const absl::Status& st) {
    stream_.ReleasePin();
    status_ = st;
    grpc::ServerWriteReactor<grpc::ByteBuffer>::Finish(ToGrpcStatus(st));
  }

  KvDepotService& service_;
  grpc::CallbackServerContext* const ctx_;
  v1::ReadRequest req_;  // before stream_, which refers to it
  ReadStream stream_;
  grpc::ByteBuffer msg_;
  absl::Status status_;
  const absl::Time start_;
};

}  // namespace

grpc::ServerReadReactor<v1::WriteRequest>* KvDepotService::Write(
    grpc::CallbackServerContext* ctx, v1::WriteResponse* resp) {
  return new WriteReactor(*this, ctx, resp);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvDepotService::Read(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req) {
  return new ReadReactor(*this, ctx, req);
}

grpc::ServerUnaryReactor* KvDepotService::ReportCorrupt(
    grpc::CallbackServerContext* ctx, const v1::ReportCorruptRequest* req,
    v1::ReportCorruptResponse* resp) {
  return Unary(ctx, "ReportCorrupt", [&]() -> absl::Status {
    const std::string& ns = req->namespace_();
    RETURN_IF_ERROR(ValidateNamespace(ns));
    if (req->blocks_size() > kMaxReportBlocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("report of ", req->blocks_size(),
                       " blocks exceeds the limit of ", kMaxReportBlocks));
    }
    for (const v1::CorruptBlock& b : req->blocks()) {
      RETURN_IF_ERROR(ValidateKey(b.key()));
    }
    // Each block's DRAM copy is hashed again, as costly as serving it: one
    // report at a time, so that reports (which need no session) cannot take
    // more of the daemon than one reader. Reports are best effort: a busy
    // refusal loses nothing a later reader will not report again.
    if (!report_mu_.TryLock()) {
      return absl::ResourceExhaustedError(
          "another corruption report is being checked; try later");
    }
    absl::Cleanup unlock = [this] { report_mu_.Unlock(); };
    absl::flat_hash_map<std::pair<std::string, uint64_t>, v1::CorruptVerdict>
        seen;
    int unconfirmed = 0;
    for (const v1::CorruptBlock& b : req->blocks()) {
      if (ctx->IsCancelled()) {
        return absl::CancelledError("the client cancelled the report");
      }
      auto [it, fresh] = seen.try_emplace(std::make_pair(b.key(), b.checksum()),
                                          v1::CORRUPT_NOT_CONFIRMED);
      if (fresh) {
        const CorruptDramCheck check =
            store_.DropCorruptDram(ns, b.key(), b.checksum());
        it->second = CorruptDramVerdict(check, ns, b.key(), ctx->peer());
        if (check == CorruptDramCheck::kNotCorrupt) ++unconfirmed;
      }
      resp->add_verdicts(it->second);
    }
    // Any peer may send such reports: at most one line per 10 s (with the
    // count since the last), naming the peer whose report it is.
    unconfirmed_reports_ += unconfirmed;
    if (unconfirmed > 0 &&
        absl::Now() - last_unconfirmed_log_ >= absl::Seconds(10)) {
      log_->warn(
          "{} block(s) reported corrupt since the last such line (the "
          "last by {}, of {}) are intact (or gone) in DRAM: damaged on "
          "the way to the client, or the client's own fault?",
          unconfirmed_reports_, ctx->peer(), ns);
      unconfirmed_reports_ = 0;
      last_unconfirmed_log_ = absl::Now();
    }
    return absl::OkStatus();
  });
}

v1::CorruptVerdict KvDepotService::CorruptDramVerdict(CorruptDramCheck check,
                                                      absl::string_view ns,
                                                      absl::string_view key,
                                                      absl::string_view who) {
  switch (check) {
    case CorruptDramCheck::kDropped:
    case CorruptDramCheck::kKept: {
      const bool kept = check == CorruptDramCheck::kKept;
      log_->error(
          "block {} of {} in DRAM does not match its checksum (memory "
          "corruption?), found by {}: dropped{}",
          KeyToHex(key), std::string(ns), std::string(who),
          kept ? " once no reader pins it" : "");
      return kept ? v1::CORRUPT_KEPT : v1::CORRUPT_DROPPED;
    }
    case CorruptDramCheck::kDroppedAlready:  // logged when first found
      return v1::CORRUPT_DROPPED;
    case CorruptDramCheck::kKeptAlready:
      return v1::CORRUPT_KEPT;
    case CorruptDramCheck::kNotCorrupt:
      break;
  }
  return v1::CORRUPT_NOT_CONFIRMED;
}

grpc::ServerUnaryReactor* KvDepotService::Evict(grpc::CallbackServerContext* ctx,
                                                const v1::EvictRequest* req,
                                                v1::EvictResponse* resp) {
  return Unary(ctx, "Evict", [&]() -> absl::Status {
    std::vector<absl::string_view> keys = Views(req->keys());
    ASSIGN_OR_RETURN(EvictResult r, store_.Evict(req->namespace_(), keys, req->all()));
    resp->set_evicted_blocks(r.evicted_blocks);
    resp->set_evicted_bytes(r.evicted_bytes);
    for (const std::string& k : r.pinned_keys) resp->add_pinned_keys(k);
    resp->set_pinned_blocks(r.pinned_blocks);
    resp->set_missing_keys(r.missing_keys);
    if (uint64_t left_out; log_limit_.Allow("evict", &left_out)) {
      log_->info("evict {}: {} blocks ({} bytes) removed, {} pinned kept{}",
                 req->namespace_(), r.evicted_blocks, r.evicted_bytes,
                 r.pinned_blocks, LeftOutNote(left_out));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::Stats(grpc::CallbackServerContext* ctx,
                                                const v1::StatsRequest*,
                                                v1::StatsResponse* resp) {
  return Unary(ctx, "Stats", [&]() -> absl::Status {
    StoreStats st = store_.Stats();
    auto fill = [](const TierStats& t, v1::TierStats* out) {
      out->set_used_bytes(t.used_bytes);
      out->set_capacity_bytes(t.capacity_bytes);
      out->set_blocks(t.blocks);
      out->set_hits(t.hits);
      out->set_evictions(t.evictions);
    };
    fill(st.dram, resp->mutable_dram());
    fill(st.nvme, resp->mutable_nvme());
    resp->mutable_dram()->set_integrity_errors(st.dram_integrity_errors);
    resp->mutable_nvme()->set_integrity_errors(st.integrity_errors);
    resp->set_demotions(st.demotions);
    resp->set_demotion_failures(st.demotion_failures);
    resp->set_promotions(st.promotions);
    resp->set_promotions_shed(st.promotions_shed);
    resp->set_demotions_skipped(st.demotions_skipped);
    resp->set_draining(st.draining);
    resp->set_sessions(st.sessions);
    resp->set_pins(st.pins);
    resp->set_reservations(st.reservations);
    resp->set_reserved_bytes(st.reserved_bytes);
    resp->set_lookup_keys(st.lookup_keys);
    resp->set_lookup_hits(st.lookup_hits);
    resp->set_puts(st.puts);
    resp->set_put_bytes(st.put_bytes);
    resp->set_integrity_errors(st.integrity_errors + st.dram_integrity_errors);
    for (const NamespaceStats& ns : st.namespaces) {
      FillNamespace(ns, resp->add_namespaces());
    }
    // The wall clock may step back (NTP): never a negative uptime, which
    // would wrap to ~1.8e19 ms.
    resp->set_uptime_ms(static_cast<uint64_t>(std::max<int64_t>(
        0, absl::ToInt64Milliseconds(clock_.Now() - started_))));
    resp->set_version(kVersion);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::ListNamespaces(
    grpc::CallbackServerContext* ctx, const v1::ListNamespacesRequest*,
    v1::ListNamespacesResponse* resp) {
  return Unary(ctx, "ListNamespaces", [&]() -> absl::Status {
    for (const NamespaceStats& ns : store_.ListNamespaces()) {
      FillNamespace(ns, resp->add_namespaces());
    }
    return absl::OkStatus();
  });
}

// Verify and Compact are long (they read or rewrite the whole NVMe tier) and
// rare; they run on maintenance_pool_, one at a time (Aborted while the other
// runs). Shutdown cuts them short (TieredStore::StopNvmeMaintenance).
absl::Status KvDepotService::CheckAdmin(grpc::CallbackServerContext* ctx,
                                        const char* op) const {
  if (admin_from_any_peer_) return absl::OkStatus();
  const std::optional<uint32_t> uid = LocalPeerUid(ctx->peer());
  const uid_t own = geteuid();
  if (uid.has_value() && (*uid == 0 || *uid == own)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      op,
      " is an admin call, taken only from root or kvdepotd's own user (uid ",
      own, ") on this host (admin_peers: local); this one came from ",
      uid.has_value() ? absl::StrCat("uid ", *uid, " (", ctx->peer(), ")")
                      : absl::StrCat(ctx->peer(),
                                     ", not a local process whose owner is "
                                     "known")));
}

grpc::ServerUnaryReactor* KvDepotService::NvmeMaintenance(
    grpc::CallbackServerContext* ctx, const char* op,
    absl::AnyInvocable<absl::Status() &&> fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::function<void(const absl::Status&)> finish = Finisher(op, reactor);
  if (absl::Status admin = CheckAdmin(ctx, op); !admin.ok()) {
    finish(admin);
    return reactor;
  }
  if (nvme_maintenance_.exchange(true)) {
    finish(
        absl::AbortedError("a verify or compact of the NVMe tier is running "
                           "already; retry when it ends"));
    return reactor;
  }
  maintenance_pool_.Submit(
      [this, fn = std::move(fn), finish = std::move(finish)]() mutable {
        absl::Status st = std::move(fn)();
        // Free before the answer: a caller that retries on it gets in.
        nvme_maintenance_.store(false);
        finish(st);
      });
  return reactor;
}

grpc::ServerUnaryReactor* KvDepotService::Verify(grpc::CallbackServerContext* ctx,
                                                 const v1::VerifyRequest*,
                                                 v1::VerifyResponse* resp) {
  return NvmeMaintenance(ctx, "Verify", [this, ctx, resp]() -> absl::Status {
    // A client that gives up (Ctrl-C, its deadline) ends the scan, which
    // would otherwise hold the one-at-a-time slot until it is done.
    ASSIGN_OR_RETURN(TieredStore::VerifyReport r,
                     store_.VerifyNvme([ctx] { return ctx->IsCancelled(); }));
    resp->set_blocks_checked(r.blocks_checked);
    resp->set_bytes_checked(r.bytes_checked);
    resp->set_corrupt_dropped(r.corrupt_dropped);
    resp->set_missing_dropped(r.missing_dropped);
    resp->set_orphans_dropped(r.orphans_dropped);
    log_->info("verify: {} blocks checked, {} corrupt, {} missing, {} orphans dropped",
               r.blocks_checked, r.corrupt_dropped, r.missing_dropped, r.orphans_dropped);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::Compact(grpc::CallbackServerContext* ctx,
                                                  const v1::CompactRequest*,
                                                  v1::CompactResponse*) {
  return NvmeMaintenance(ctx, "Compact", [this, ctx]() -> absl::Status {
    // A caller that gives up (Ctrl-C, its deadline) ends the compaction
    // between files, which would otherwise hold the one-at-a-time slot (a
    // cron's verify meanwhile refused) until it is done.
    RETURN_IF_ERROR(store_.CompactNvme([ctx] { return ctx->IsCancelled(); }));
    log_->info("compacted the NVMe tier");
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::SetDraining(
    grpc::CallbackServerContext* ctx, const v1::SetDrainingRequest* req,
    v1::SetDrainingResponse* resp) {
  return Unary(ctx, "SetDraining", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckAdmin(ctx, "SetDraining"));
    if (!req->draining() && shutting_down_.load()) {
      return absl::UnavailableError("kvdepotd is stopping: it takes no puts again");
    }
    store_.SetDraining(req->draining());
    if (!req->draining() && shutting_down_.load()) {
      // SIGTERM's drain began between the check above and this call
      // (BeginShutdown, then the store's SetDraining(true)): undo ours.
      store_.SetDraining(true);
      return absl::UnavailableError("kvdepotd is stopping: it takes no puts again");
    }
    StoreStats st = store_.Stats();
    resp->set_draining(st.draining);
    // Clients' two-phase puts: a Write stream's own reservation is no put
    // an operator waits for.
    resp->set_reservations(st.session_reservations);
    log_->info("{} by {}: {} put(s) reserved still open",
               req->draining() ? "draining (no new puts)" : "accepting puts again",
               ctx->peer(), st.session_reservations);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::Inspect(grpc::CallbackServerContext* ctx,
                                                  const v1::InspectRequest* req,
                                                  v1::InspectResponse* resp) {
  return Unary(ctx, "Inspect", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(BlockDetails d, store_.Inspect(req->namespace_(), req->key()));
    resp->set_in_dram(d.in_dram);
    resp->set_in_nvme(d.in_nvme);
    resp->set_size(d.size);
    resp->set_checksum(d.checksum);
    resp->set_pins(d.pins);
    resp->set_cached_children(d.cached_children);
    resp->set_age_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(d.age)));
    resp->set_dram_reads(d.dram_reads);
    resp->set_nvme_reads(d.nvme_reads);
    resp->set_parent(d.parent);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::SetQuota(grpc::CallbackServerContext* ctx,
                                                   const v1::SetQuotaRequest* req,
                                                   v1::SetQuotaResponse*) {
  return Unary(ctx, "SetQuota", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckAdmin(ctx, "SetQuota"));
    if (req->undeclare()) {
      if (req->max_bytes() != 0) {
        return absl::InvalidArgumentError("undeclare takes no max_bytes (a quota)");
      }
      RETURN_IF_ERROR(quota_file_ != nullptr
                          ? quota_file_->Remove(store_, req->namespace_())
                          : store_.Undeclare(req->namespace_()));
      log_->info("quota and declaration of namespace {} removed by {}",
                 req->namespace_(), ctx->peer());
      return absl::OkStatus();
    }
    if (quota_file_ != nullptr) {
      RETURN_IF_ERROR(quota_file_->Set(store_, req->namespace_(), req->max_bytes()));
    } else {
      RETURN_IF_ERROR(store_.SetQuota(req->namespace_(), req->max_bytes()));
    }
    log_->info("quota of namespace {} set to {} bytes by {}", req->namespace_(),
               req->max_bytes(), ctx->peer());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::GetQuota(grpc::CallbackServerContext* ctx,
                                                   const v1::GetQuotaRequest* req,
                                                   v1::GetQuotaResponse* resp) {
  return Unary(ctx, "GetQuota", [&]() -> absl::Status {
    RETURN_IF_ERROR(ValidateNamespace(req->namespace_()));
    for (const NamespaceStats& ns : store_.ListNamespaces()) {
      if (ns.name != req->namespace_()) continue;
      resp->set_max_bytes(store_.Quota(req->namespace_()));
      resp->set_used_bytes(ns.bytes);
      return absl::OkStatus();
    }
    // Neither stored into nor declared (SetQuota): "no quota" would hide
    // that, with create_namespaces off, puts into it are refused.
    // FailedPrecondition, as for a put into a namespace that does not exist
    // (NOT_FOUND of a whole call means the session is gone).
    return absl::FailedPreconditionError(absl::StrCat(
        "namespace ", req->namespace_(), " does not exist (nothing stored, no quota set)"));
  });
}

// ---- UCX data plane ---------------------------------------------------------

namespace {

void SetTransfer(const absl::Status& st, v1::BlockTransfer* out) {
  out->set_code(static_cast<int32_t>(st.code()));
  if (!st.ok()) out->set_message(std::string(st.message()));
}

// The transfer deadline: the request's timeout when it asks for one, capped
// by the daemon's.
absl::Time TransferDeadline(uint32_t timeout_ms, absl::Duration cap,
                            absl::Time now) {
  absl::Duration d = cap;
  if (timeout_ms > 0) d = std::min(d, absl::Milliseconds(timeout_ms));
  return now + d;
}

// The last time a copy this daemon makes itself into or out of a co-located
// client's memory may start: the transfer deadline, or the client's own
// (deadline_unix_us, on this host's clock) when that comes first.
absl::Time CopyDeadline(absl::Time transfer_deadline, int64_t deadline_unix_us) {
  if (deadline_unix_us <= 0) return transfer_deadline;
  return std::min(transfer_deadline, absl::FromUnixMicros(deadline_unix_us));
}

absl::Status CopyTooLate() {
  return absl::DeadlineExceededError(
      "the client's deadline for this copy passed before it started (the "
      "request came late)");
}

}  // namespace

void KvDepotService::SessionLost(SessionId session, const absl::Status& why) {
  absl::StatusOr<SessionRelease> rel = store_.CloseSession(session);
  if (data_plane_ != nullptr) data_plane_->Detach(session, /*peer_gone=*/true);
  if (!rel.ok()) return;  // closed meanwhile
  if (uint64_t left_out; log_limit_.Allow("peer gone", &left_out)) {
    log_->info(
        "session {} ended: its UCX peer is gone ({}); {} pins released, {} "
        "puts aborted{}",
        session, why.ToString(), rel->pins_released, rel->reservations_aborted,
        LeftOutNote(left_out));
  }
}

absl::Status KvDepotService::UnlessSessionEnded(SessionId session,
                                                absl::Status st) {
  if (st.ok() || store_.HasSession(session)) return st;
  return absl::NotFoundError(absl::StrCat("session ", session,
                                          " ended during the request (", st.message(), ")"));
}

absl::Status KvDepotService::RequireEndpoint(SessionId session) {
  RETURN_IF_ERROR(RequireSession(session));
  if (data_plane_ == nullptr) {
    return absl::FailedPreconditionError("the UCX data plane is off");
  }
  if (!data_plane_->attached(session)) {
    // An unknown session (the daemon restarted, it expired or was closed) is
    // NOT_FOUND, as everywhere: the client then opens a new one.
    if (!store_.HasSession(session)) {
      return absl::NotFoundError(absl::StrCat("unknown session ", session));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session, " has no UCX endpoint"));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvDepotService::RegisterBuffer(
    grpc::CallbackServerContext* ctx, const v1::RegisterBufferRequest* req,
    v1::RegisterBufferResponse* resp) {
  return Unary(ctx, "RegisterBuffer", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireSession(req->session_id()));
    if (data_plane_ == nullptr) {
      return absl::FailedPreconditionError("the UCX data plane is off");
    }
    if (!store_.HasSession(req->session_id())) {
      return absl::NotFoundError(
          absl::StrCat("unknown session ", req->session_id()));
    }
    ASSIGN_OR_RETURN(DataPlane::Buffer buffer,
                     data_plane_->RegisterBuffer(req->session_id(),
                                                 req->packed_rkey(),
                                                 req->address(), req->size()));
    resp->set_buffer_id(buffer.id);
    resp->set_copied_in_place(buffer.copied_here);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvDepotService::PushBlocks(
    grpc::CallbackServerContext* ctx, const v1::PushBlocksRequest* req,
    v1::PushBlocksResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  StartPushBlocks(req, resp, Finisher("PushBlocks", reactor));
  return reactor;
}

void KvDepotService::StartPushBlocks(const v1::PushBlocksRequest* req,
                                     v1::PushBlocksResponse* resp,
                                     Finish finish, bool over_ucx) {
  // arg: the request's v1::PushBlocksRequest (const).
  internal::TestSyncPoint("KvDepotService::StartPushBlocks",
                          const_cast<v1::PushBlocksRequest*>(req));
  absl::Status check = RequireEndpoint(req->session_id());
  if (check.ok() && req->destinations_size() != req->keys_size()) {
    check = absl::InvalidArgumentError(
        absl::StrCat(req->keys_size(), " keys but ", req->destinations_size(),
                     " destinations"));
  }
  if (!check.ok()) return finish(check);
  const absl::Time deadline =
      TransferDeadline(req->timeout_ms(), transfer_timeout_, absl::Now());
  const absl::Time copy_deadline = CopyDeadline(deadline, req->deadline_unix_us());
  std::vector<absl::string_view> keys = Views(req->keys());
  store_.LookupAsync(
      req->session_id(), req->namespace_(), keys, req->prefix(), /*pin=*/true,
      [this, req, resp, finish, deadline, copy_deadline,
       over_ucx](absl::StatusOr<LookupResult> r) {
        if (!r.ok()) return finish(r.status());
        metrics_.RecordLookup(req->namespace_(), req->prefix(), *r);
        resp->set_prefix_hits(r->prefix_hits);
        const DramRegion arena = store_.dram_region();
        std::vector<BlockMove> moves;
        std::vector<int> key_of_move;
        for (int i = 0; i < req->keys_size(); ++i) {
          const LookupEntry& e = r->entries[i];
          v1::BlockTransfer* out = resp->add_blocks();
          if (!e.found) {
            SetTransfer(absl::NotFoundError("not stored"), out);
            continue;
          }
          out->set_tier(ToProto(e.tier));
          out->set_size(e.size);
          out->set_checksum(e.checksum);
          const v1::BufferRange& dst = req->destinations(i);
          if (dst.size() != e.size) {
            SetTransfer(absl::InvalidArgumentError(absl::StrCat(
                            "block is ", e.size, " bytes, destination ",
                            dst.size())),
                        out);
            continue;
          }
          moves.push_back(BlockMove{
              absl::Span<char>(arena.base + e.offset, e.size), dst.buffer_id(),
              dst.address()});
          key_of_move.push_back(i);
        }
        const SessionId session = req->session_id();
        const PinId pin = r->pin_id;
        if (moves.empty()) {
          if (pin != 0) store_.Unpin(session, pin).IgnoreError();
          return finish(absl::OkStatus());
        }
        // UCX may hold writes to the client past the transfer and the
        // session (an abandoned batch: a co-located client's, or one whose
        // endpoint closed in order after a deadline while it stalled): the
        // pin is the daemon's from here on, so that the session's end does
        // not free blocks UCX may still read (HoldUntilReleased).
        if (pin != 0) {
          if (absl::Status st = store_.HandOverPin(session, pin); !st.ok()) {
            return finish(UnlessSessionEnded(session, st));
          }
        }
        auto unpin = [this, pin] {
          store_.Unpin(kInternalSession, pin).IgnoreError();
        };
        // A co-located client's shared memory is mapped here: the block is
        // copied on this thread and checked as it lands, so the client need
        // not read it all again to hash it.
        std::vector<bool> in_place(moves.size(), false);
        std::vector<bool> corrupt(moves.size(), false);  // the daemon's copy
        auto copy_here = [&](size_t m, char* client) {
          if (absl::Now() >= copy_deadline) return CopyTooLate();
          in_place[m] = true;
          const BlockMove& mv = moves[m];
          const uint64_t want = resp->blocks(key_of_move[m]).checksum();
          // Checked again every MiB: a client stalled past its deadline
          // has given up, and a large block must not keep landing in its
          // buffer for long after that.
          const std::optional<uint64_t> sum = CopyWithChecksumUntil(
              client, mv.arena.data(), mv.arena.size(), copy_deadline);
          if (!sum.has_value()) {
            return absl::DeadlineExceededError(
                "the client's deadline for this copy passed during it");
          }
          if (*sum == want) return absl::OkStatus();
          // Which copy is wrong: the daemon's (memory corruption or a bug)
          // or the client's (its buffer changed under the copy)?
          if (BlockChecksum(mv.arena.data(), mv.arena.size()) != want) {
            corrupt[m] = true;  // counted and dropped once unpinned
          } else if (uint64_t left_out;
                     log_limit_.Allow("buffer changed", &left_out)) {
            log_->warn(
                "PushBlocks: session {}'s buffer changed while block {} "
                "was copied into it{}",
                req->session_id(), KeyToHex(req->keys(key_of_move[m])),
                LeftOutNote(left_out));
          }
          return absl::DataLossError(
              "block bytes do not match the checksum as copied");
        };
        absl::StatusOr<TransferHandle> h = data_plane_->Push(
            session, moves, deadline, copy_here,
            over_ucx ? DataPlane::PutEnd::kFenced : DataPlane::PutEnd::kFlushed);
        if (!h.ok()) {
          unpin();
          return finish(UnlessSessionEnded(session, h.status()));
        }
        // Runs on the progress thread (or here, when every move was
        // copied here): short steps only.
        h->OnReady([this, req, resp, finish, unpin, h = *h,
                    key_of_move = std::move(key_of_move),
                    in_place = std::move(in_place),
                    corrupt = std::move(corrupt)] {
          if (h.abandoned()) {
            uint64_t bytes = 0;
            for (int k : key_of_move) bytes += resp->blocks(k).size();
            HoldUntilReleased("PushBlocks", req->session_id(), h,
                              {"writes from its blocks", "they stay pinned",
                               "writes", bytes},
                              unpin);
          } else {
            unpin();
          }
          // A block whose DRAM copy is bad goes (its NVMe copy, if any,
          // stays), so that the next get reads that or misses and the next
          // put stores it again, instead of a DATA_LOSS each time until it
          // is evicted; while pinned (HoldUntilReleased's pin too), once
          // unpinned. Off this thread: the store hashes it again first.
          std::vector<std::pair<std::string, uint64_t>> bad;
          for (size_t m = 0; m < corrupt.size(); ++m) {
            if (!corrupt[m]) continue;
            const int k = key_of_move[m];
            bad.emplace_back(req->keys(k), resp->blocks(k).checksum());
          }
          if (!bad.empty()) {
            put_pool_.Submit(
                [this, ns = req->namespace_(), bad = std::move(bad)] {
                  for (const auto& [key, sum] : bad) {
                    CorruptDramVerdict(store_.DropCorruptDram(ns, key, sum), ns,
                                       key, "PushBlocks' copy");
                  }
                });
          }
          // A batch that failed because its session ended (closed, expired,
          // its peer lost) is still answered OK with per-block outcomes,
          // not NOT_FOUND: the transfers' codes (CANCELLED, DEADLINE_EXCEEDED)
          // tell the client that UCX may still write into its buffers, so it
          // fences its worker before it hands them back; the next call on
          // the session then finds it gone.
          uint64_t bytes = 0, bytes_in_place = 0;
          for (size_t m = 0; m < key_of_move.size(); ++m) {
            v1::BlockTransfer* out = resp->mutable_blocks(key_of_move[m]);
            SetTransfer(h.status(m), out);
            if (h.status(m).ok()) {
              bytes += out->size();
              if (in_place[m]) bytes_in_place += out->size();
              out->set_checked_in_place(in_place[m]);
            }
          }
          metrics_.AddUcxBytesOut(bytes, bytes_in_place);
          finish(absl::OkStatus());
        });
      });
}

void KvDepotService::HoldUntilReleased(const char* op, SessionId session,
                                       const TransferHandle& h,
                                       const HeldFor& held,
                                       absl::AnyInvocable<void() &&> release) {
  // A client that stalls its transfers sets these off at will: limited,
  // the line of their end logged only with the line of their start.
  uint64_t left_out = 0;
  const bool logged = log_limit_.Allow("transfer abandoned", &left_out);
  if (logged) {
    log_->warn(
        "{}: session {}'s transfer was abandoned with UCX {} ({} bytes) "
        "still open; {} until UCX ends those {}{}",
        op, session, held.what, held.bytes, held.kept, held.ops,
        LeftOutNote(left_out));
  }
  metrics_.AddUcxHeldBytes(static_cast<int64_t>(held.bytes));
  // metrics_ (and what `release` uses: store_, slots) outlive the data
  // plane, whose workers (or the thread that stops a session's own worker)
  // run this.
  h.OnReleased([log = log_, metrics = &metrics_, op, session, held, logged,
                release = std::move(release)]() mutable {
    std::move(release)();
    metrics->AddUcxHeldBytes(-static_cast<int64_t>(held.bytes));
    if (!logged) return;
    log->info("{}: session {}'s abandoned {} ended (UCX ended them, or they "
              "went with the session's worker); {} bytes freed",
              op, session, held.ops, held.bytes);
  });
}

grpc::ServerUnaryReactor* KvDepotService::PullBlocks(
    grpc::CallbackServerContext* ctx, const v1::PullBlocksRequest* req,
    v1::PullBlocksResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // Never waits for room here: a put that must wait (DRAM full, the
  // evictor to make room) does it on put_pool_, as BeginPut and Write do,
  // not on a gRPC thread that other clients' calls (a KeepAlive holding a
  // lease) need.
  StartPullBlocks(req, resp, Finisher("PullBlocks", reactor),
                  /*must_not_block=*/true, nullptr, absl::OkStatus(), ctx);
  return reactor;
}

void KvDepotService::StartPullBlocks(const v1::PullBlocksRequest* req,
                                     v1::PullBlocksResponse* resp,
                                     Finish finish, bool must_not_block,
                                     std::shared_ptr<IncomingData> data,
                                     absl::Status refuse_with,
                                     grpc::CallbackServerContext* ctx) {
  const SessionId session = req->session_id();
  absl::Status check = RequireEndpoint(session);
  bool with_data = data != nullptr && *data != nullptr;
  if (check.ok() && with_data) {
    uint64_t total = 0;
    bool checksums = true;
    for (const v1::PullSpec& b : req->blocks()) {
      total += b.source().size();
      checksums = checksums && !b.daemon_checksum();
    }
    if (total != (*data)->size() || !checksums) {
      check = absl::InvalidArgumentError(absl::StrCat(
          "a PullBlocks request with data: its blocks' sizes must add up to the "
          "data's ", (*data)->size(), " bytes (they add up to ", total,
          "), each with its checksum"));
    }
  }
  std::vector<PutSpec> specs;
  specs.reserve(req->blocks_size());
  for (int i = 0; i < req->blocks_size(); ++i) {
    const v1::PullSpec& b = req->blocks(i);
    specs.push_back(PutSpec{b.key(), b.parent_key(), b.source().size()});
    if (check.ok() && b.daemon_checksum() &&
        !data_plane_->CopiedHere(session, b.source().buffer_id())) {
      check = absl::InvalidArgumentError(absl::StrCat(
          "block ", i, ": daemon_checksum needs a source in a buffer the "
          "daemon copies in place (RegisterBuffer's copied_in_place)"));
    }
  }
  bool would_wait = false;
  absl::StatusOr<Reservation> resv =
      check.ok() ? store_.BeginPut(session, req->namespace_(), specs,
                                   must_not_block ? &would_wait : nullptr)
                 : absl::StatusOr<Reservation>(check);
  if (would_wait) {
    if (!refuse_with.ok()) return finish(refuse_with);
    // DRAM is full and the evictor is to make room: wait for it elsewhere.
    return SubmitWaitingPut([this, req, resp, finish = std::move(finish), data,
                             ctx](absl::Status queued) {
      if (ctx != nullptr && ctx->IsCancelled()) return finish(PutCancelled());
      // Queued too long: one more try, without waiting.
      StartPullBlocks(req, resp, finish, /*must_not_block=*/!queued.ok(), data,
                      queued, ctx);
    });
  }
  if (!resv.ok()) {
    // Gave up while the put waited for room: told (and counted) so.
    return finish(ctx != nullptr && ctx->IsCancelled() ? PutCancelled()
                                                       : resv.status());
  }
  if (AbortIfClientGaveUp(ctx, session, resv->id))
    return finish(PutCancelled());
  // Every reserved slot's bytes come from its source.
  std::vector<BlockMove> moves;
  std::vector<std::unique_ptr<SlotHandle>> slots;
  std::vector<int> block_of_move;
  // A key named again in the batch whose first block moves: (this block,
  // the first), which end alike.
  std::vector<std::pair<int, int>> repeats;
  for (int i = 0; i < req->blocks_size(); ++i) {
    v1::BlockTransfer* out = resp->add_blocks();
    out->set_size(specs[i].size);
    out->set_checksum(req->blocks(i).checksum());
    if (const int first = resv->slots[i].repeat_of;
        first >= 0 && !resv->slots[first].exists) {
      repeats.emplace_back(i, first);
    }
    if (resv->slots[i].exists) {
      SetTransfer(absl::AlreadyExistsError("already stored"), out);
      continue;
    }
    absl::StatusOr<std::unique_ptr<SlotHandle>> slot =
        store_.AcquireSlot(session, resv->id, static_cast<uint32_t>(i));
    // Fails when the session ended under us, or (Aborted) when a Write
    // stream holds the slot.
    if (!slot.ok()) {
      store_.AbortPut(session, resv->id).IgnoreError();
      return finish(slot.status());
    }
    const v1::BufferRange& src = req->blocks(i).source();
    moves.push_back(BlockMove{(*slot)->bytes(), src.buffer_id(), src.address()});
    slots.push_back(*std::move(slot));
    block_of_move.push_back(i);
  }
  if (moves.empty()) {
    return finish(absl::OkStatus());
  }
  // Each block is hashed as soon as its bytes are in, while they are still
  // in cache, and CommitPut compares that with the checksum without hashing
  // again. A co-located client's shared memory is mapped here: those
  // blocks are copied into their slots on this thread and hashed as they
  // land; a block with daemon_checksum takes that hash as its checksum.
  std::vector<SlotHandle*> hash(slots.size());
  for (size_t k = 0; k < slots.size(); ++k) hash[k] = slots[k].get();
  std::vector<uint64_t> sums(req->blocks_size());
  for (int i = 0; i < req->blocks_size(); ++i) sums[i] = req->blocks(i).checksum();
  std::vector<bool> in_place(moves.size(), false);
  const absl::Time deadline =
      TransferDeadline(req->timeout_ms(), transfer_timeout_, absl::Now());
  const absl::Time copy_deadline = CopyDeadline(deadline, req->deadline_unix_us());
  auto copy_here = [&](size_t k, char* client) {
    if (absl::Now() >= copy_deadline) return CopyTooLate();
    in_place[k] = true;
    // Checked again every MiB: a client stalled past its deadline has
    // given up, and may be writing other bytes into its buffer by now.
    const std::optional<uint64_t> sum = hash[k]->CopyInUntil(client, copy_deadline);
    if (!sum.has_value()) {
      return absl::DeadlineExceededError(
          "the client's deadline for this copy passed during it");
    }
    const int b = block_of_move[k];
    if (req->blocks(b).daemon_checksum()) sums[b] = *sum;
    return absl::OkStatus();  // a mismatch is CommitPut's to report
  };
  // The bytes of blocks stored already are received and dropped. BeginPut
  // checked their sizes against the stored ones, but the client chose those
  // too (1 new block and 1023 stored ones of 256 MiB each would have this
  // process copy 256 GiB of filler, holding an iov entry per MiB
  // meanwhile), so they may outweigh the new blocks' bytes by at most
  // kMaxDroppedBytes. Past that the data is released
  // unread and the new blocks are read from their sources, as for a
  // request without data: libkvdepot names them in registered buffers,
  // and sends every block of a batch, stored or not (it cannot know).
  uint64_t new_bytes = 0;
  for (const BlockMove& m : moves) new_bytes += m.arena.size();
  const uint64_t dropped =
      with_data && (*data)->size() > new_bytes ? (*data)->size() - new_bytes : 0;
  if (with_data && dropped > std::max(new_bytes, kMaxDroppedBytes)) {
    log_->debug("session {}: PullBlocks with data: {} of its {} bytes are of "
                "blocks stored already; read from their sources instead",
                session, dropped, (*data)->size());
    data->reset();  // released unread: the client's send ends
    with_data = false;
  }
  absl::StatusOr<TransferHandle> h;
  if (with_data) {
    // The request's bytes, block after block: each into its slot, those of
    // blocks stored already dropped.
    std::vector<absl::Span<char>> pieces;
    std::vector<int> move_of_piece;
    size_t k = 0;
    for (int i = 0; i < req->blocks_size(); ++i) {
      if (k < block_of_move.size() && block_of_move[k] == i) {
        pieces.push_back(moves[k].arena);
        move_of_piece.push_back(static_cast<int>(k++));
      } else {
        pieces.emplace_back(nullptr, specs[i].size);
        move_of_piece.push_back(-1);
      }
    }
    h = data_plane_->Receive(std::move(*data), std::move(pieces), deadline,
                             [hash, move_of_piece](size_t i) {
                               if (move_of_piece[i] >= 0) hash[move_of_piece[i]]->Checksum();
                             });
  } else {
    h = data_plane_->Pull(session, moves, deadline,
                          [hash](size_t k) { hash[k]->Checksum(); }, copy_here);
  }
  if (!h.ok()) {
    slots.clear();
    store_.AbortPut(session, resv->id).IgnoreError();
    return finish(UnlessSessionEnded(session, h.status()));
  }
  const bool all_in_place =
      std::find(in_place.begin(), in_place.end(), false) == in_place.end();
  auto commit = [this, req, resp, finish, session, id = resv->id, h = *h,
                 slots = std::move(slots),
                 block_of_move = std::move(block_of_move),
                 repeats = std::move(repeats), in_place = std::move(in_place),
                 sums = std::move(sums)]() mutable {
    if (h.abandoned()) {
      HeldFor held{absl::StrCat("reads into ", slots.size(), " slots"),
                   "their memory stays allocated", "reads", 0};
      for (const auto& slot : slots) held.bytes += slot->bytes().size();
      HoldUntilReleased("PullBlocks", session, h, held,
                        [slots = std::move(slots)]() mutable { slots.clear(); });
    }
    slots.clear();  // the slots' bytes are in; CommitPut needs them released
    absl::Status failed = h.overall_status();
    for (size_t k = 0; failed.ok() && k < block_of_move.size(); ++k) {
      if (req->blocks(block_of_move[k]).daemon_checksum() && !in_place[k]) {
        // Checked before the transfer; the mapping went since.
        failed = absl::UnavailableError(
            "daemon_checksum block was not copied in place");
      }
    }
    if (!failed.ok()) {
      // Nothing of a batch with a failed transfer is published: its bytes
      // may be partial, and the client will see the failure and retry.
      store_.AbortPut(session, id).IgnoreError();
      for (int b : block_of_move) SetTransfer(failed, resp->mutable_blocks(b));
      for (const auto& repeat : repeats)
        SetTransfer(failed, resp->mutable_blocks(repeat.first));
      return finish(absl::OkStatus());
    }
    absl::StatusOr<std::vector<CommitOutcome>> out =
        store_.CommitPut(session, id, sums);
    if (!out.ok()) {
      // A reservation CommitPut left open (it should leave none here) would
      // hold its DRAM until the session ends.
      store_.AbortPut(session, id).IgnoreError();
      return finish(out.status());
    }
    uint64_t bytes = 0, bytes_in_place = 0;
    for (size_t k = 0; k < block_of_move.size(); ++k) {
      const int b = block_of_move[k];
      v1::BlockTransfer* t = resp->mutable_blocks(b);
      t->set_checksum(sums[b]);
      switch ((*out)[b]) {
        case CommitOutcome::kStored:
          SetTransfer(absl::OkStatus(), t);
          bytes += t->size();
          if (in_place[k]) bytes_in_place += t->size();
          break;
        case CommitOutcome::kAlreadyExists:
          SetTransfer(absl::AlreadyExistsError("stored meanwhile"), t);
          break;
        case CommitOutcome::kChecksumMismatch:
          SetTransfer(absl::DataLossError("bytes do not match the checksum"), t);
          break;
      }
    }
    for (const auto& [b, first] : repeats) {
      if ((*out)[b] == CommitOutcome::kChecksumMismatch) {
        SetTransfer(absl::DataLossError(absl::StrCat(
                        "bytes do not match the checksum (as block ", first,
                        ", which names the same key)")),
                    resp->mutable_blocks(b));
      }
    }
    metrics_.AddUcxBytesIn(bytes, bytes_in_place);
    finish(absl::OkStatus());
  };
  if (all_in_place && h->IsReady()) {
    // Copied and hashed here already: CommitPut hashes nothing, so it runs
    // on this thread too.
    commit();
    return;
  }
  // Every block whose bytes came in was hashed as they landed (each_got):
  // CommitPut only compares and publishes, a short step that runs on the
  // progress thread (as a get's unpin and answer do) rather than waking a
  // pool thread per batch. An abandoned batch's slots are handed on
  // (HoldUntilReleased) off it.
  h->OnReady([this, h = *h, commit = std::move(commit)]() mutable {
    if (!h.abandoned()) return commit();
    put_pool_.Submit(std::move(commit));
  });
}

void KvDepotService::set_data_plane(DataPlane* data_plane,
                                    absl::Duration transfer_timeout) {
  data_plane_ = data_plane;
  transfer_timeout_ = transfer_timeout;
  // Requests from remote clients come on the request worker's thread, where
  // nothing may block: a get is a lookup in memory (promotions from NVMe run
  // on the store's own threads) and transfers handed to the session's
  // worker; a put is a reservation (one that would wait for room goes to
  // put_pool_) and the same.
  data_plane_->ServeRequests(
      [this](DataPlane::Request request) { ServeUcxRequest(std::move(request)); });
}

namespace {

// Runs one UCX request of type Req through `start` (StartPushBlocks or
// StartPullBlocks) and answers it with `answer(status, serialized Resp)`.
// The messages live until it is answered.
template <typename Req, typename Resp, typename Answer, typename Start>
void RunUcxCall(const DataPlane::Request& request, const char* op,
                Answer answer, Start start) {
  struct Call {
    Req req;
    Resp resp;
  };
  auto call = std::make_shared<Call>();
  if (!call->req.ParseFromString(request.body)) {
    return answer(absl::InvalidArgumentError(absl::StrCat("malformed ", op, "Request")),
                  std::string());
  }
  // The session whose endpoint answers is the one the request acts for.
  if (call->req.session_id() != request.session) {
    return answer(absl::InvalidArgumentError(absl::StrCat(
                      op, "Request names session ", call->req.session_id(),
                      " but came for session ", request.session)),
                  std::string());
  }
  start(&call->req, &call->resp, [call, answer](const absl::Status& st) {
    answer(st, st.ok() ? call->resp.SerializeAsString() : std::string());
  });
}

}  // namespace

void KvDepotService::ServeUcxRequest(DataPlane::Request request) {
  const bool push = request.method == RequestMethod::kPushBlocks;
  const char* op = push ? "PushBlocks" : "PullBlocks";
  metrics_.RecordUcxRequest(request.data != nullptr ? "PullBlocksWithData" : op);
  auto answer = [this, op, start = clock_.Now(), session = request.session,
                 id = request.id](const absl::Status& st, std::string body) {
    Finished(op, st, start);
    data_plane_->Reply(session, id, st, std::move(body));
  };
  if (push) {
    RunUcxCall<v1::PushBlocksRequest, v1::PushBlocksResponse>(
        request, op, answer,
        [this](const v1::PushBlocksRequest* req, v1::PushBlocksResponse* resp,
               Finish finish) {
          StartPushBlocks(req, resp, std::move(finish), /*over_ucx=*/true);
        });
  } else {
    // Data that came with the request is received or released before the
    // answer: the request worker may go once no request is in flight.
    auto data = std::make_shared<std::unique_ptr<UcxWorker::IncomingData>>(
        std::move(request.data));
    RunUcxCall<v1::PullBlocksRequest, v1::PullBlocksResponse>(
        request, op,
        [answer, data](const absl::Status& st, std::string body) {
          data->reset();
          answer(st, std::move(body));
        },
        // Never waits for room where it runs: a progress thread, or one of
        // the few request threads (a co-located session's), which every
        // co-located client's requests share; a put that must wait goes
        // to the put pool.
        [this, data](const v1::PullBlocksRequest* req, v1::PullBlocksResponse* resp,
                     Finish finish) {
          StartPullBlocks(req, resp, std::move(finish), /*must_not_block=*/true, data);
        });
  }
}

}  // namespace kvdepot
