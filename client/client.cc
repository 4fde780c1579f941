#include "client/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/ucx_requests.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "storage/block_key.h"
#include "storage/checksum.h"
#include "storage/internal/sync_point.h"
#include "storage/status_macros.h"
#include "storage/work_pool.h"
#include "transport/memory_region.h"
#include "transport/net_devices.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvdepot {

namespace {
constexpr size_t kChunk = 1 << 20;
}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

// A UCX worker (its progress thread serves the daemon's one-sided reads and
// writes of registered buffers over TCP and shared memory) and the request
// path on it. A session's endpoint in the daemon goes to one link's worker.
// When a get fails in a way that may leave the daemon's writes for it in
// flight, the link's worker is fenced (never progressed again) before the
// failure is told, and the next session gets a new link.
struct Client::Link {
  std::unique_ptr<UcxWorker> worker;
  // Null when it could not start, or ClientOptions::ucx_requests is off.
  // Destroyed before the worker: requests still pending end Cancelled.
  std::unique_ptr<UcxRequests> requests;
  uint64_t session = 0;  // opened on this link (guarded by Ucx::link_mu)
  absl::Time retired_at;  // when it was fenced (guarded by Ucx::link_mu)
  // The daemon takes puts with their bytes (OpenSessionResponse.
  // ucx_data_requests) on requests' connection.
  std::atomic<bool> data_requests{false};
};

namespace {
// How the daemon's message begins when it could make no UCX endpoint to our
// worker and so opened no session (OpenSessionRequest.ucx_worker_address).
constexpr absl::string_view kNoUcxEndpoint = "no UCX endpoint for the client: ";

// An op whose session's link was fenced after the op took it.
absl::Status FencedMeanwhile() {
  return absl::UnavailableError(
      "kvdepot: the session's UCX link was fenced meanwhile (another "
      "transfer failed on it): not sent");
}

// How long a fenced link's worker keeps its connections open (unserved)
// before it is destroyed, and how many such links a client keeps at most
// (beyond that the oldest go first). UCX 1.13 over TCP has crashed a
// daemon when a client destroyed a worker just after the daemon dropped
// its endpoint to it (UcxWorker::Fence); seconds later it did not. Since
// the daemon closes such endpoints in order (transport/README, caveat 8)
// that no longer reproduces (0 of 35 runs with this grace at 0), so the
// destructor and the cap, which do not wait, are no known risk; the grace
// stays as a margin.
constexpr absl::Duration kRetiredLinkGrace = absl::Seconds(30);
// Pins whose session Client::Unpin remembers (see pin_sessions_).
constexpr size_t kMaxRememberedPins = 1 << 16;
// Pins Client::ReleaseOwnPin owes the daemon (see owed_unpins_).
constexpr size_t kMaxOwedUnpins = 1 << 12;
// The least time between two sessions dropped for having registered as
// many buffers as the daemon allows (Client::RegisterInSession).
constexpr absl::Duration kBufferRotationGap = absl::Minutes(1);
// The longest wait before a client refused UCX asks again
// (ClientOptions::ucx_retry_interval doubles up to it).
constexpr absl::Duration kMaxUcxRetryWait = absl::Minutes(10);

// The first wait after a refusal, and the wait again once UCX was granted.
absl::Duration FirstUcxRetryWait(const ClientOptions& options) {
  return std::clamp(options.ucx_retry_interval, absl::Milliseconds(1),
                    kMaxUcxRetryWait);
}

// Whether a gRPC call that ended with `st` may have ended without the
// daemon's answer: the daemon may have run it, or may still run it (a
// PushBlocks / PullBlocks; a pinning Lookup, whose pin id is then lost).
// Also whether a block's transfer that ended so may still be on its way
// (MayLandLate).
bool MaybeUnanswered(const absl::Status& st) {
  switch (st.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

// An unpin that needs no retry: released, or gone with its session (or a
// pin the daemon never knew). Anything else (the daemon unreachable) may be
// retried.
bool UnpinSettled(const absl::Status& st) {
  return st.ok() || absl::IsNotFound(st) || absl::IsInvalidArgument(st);
}
constexpr size_t kMaxRetiredLinks = 16;
}  // namespace

// The client's UCX side: a context, the current link and the registered
// buffers.
struct Client::Ucx {
  std::unique_ptr<UcxContext> context;
  // Threads that verify what replies over UCX bring when no caller waits
  // for them (a checksum pass must not hold up a progress thread, which
  // serves the daemon's transfers).
  std::unique_ptr<WorkPool> verify_pool;
  absl::Mutex link_mu;
  // Null after a fence until the next session opens.
  std::shared_ptr<Link> link ABSL_GUARDED_BY(link_mu);
  // Fenced links, destroyed on a caller's thread (never on their own
  // progress thread): when a session opens once they are kRetiredLinkGrace
  // old (or past kMaxRetiredLinks), or with the client.
  std::vector<std::shared_ptr<Link>> retired ABSL_GUARDED_BY(link_mu);
  // A slot whose region is null is free (its buffer was freed), and taken
  // by the next buffer; callers hold slot indices only for buffers their op
  // uses, which are not freed meanwhile (FreeBuffer's REQUIRES).
  struct Buffer {
    std::unique_ptr<MemoryRegion> region;
    bool allocated = false;  // made by AllocateBuffer (FreeBuffer may free it)
    // FreeBuffer was called but the region is kept until the client goes:
    // an op over it ended in a way that lets a transfer still reach it
    // (late_access). No op may use it (PrepareUcx skips it).
    bool freed = false;
    // An op over it ended without the daemon's answer, or with a block
    // that may still be on its way, while this client's worker moved its
    // bytes (not copied in place): the daemon may still read it through
    // the worker (a put fences nothing; a get fences it, and counts all the
    // same). Set by the op's callback before the op is ready (LateBuffers).
    bool late_access = false;
    uint64_t session = 0;  // the session the daemon knows it in
    uint32_t daemon_id = 0;
    bool in_place = false;  // the daemon copies it itself (copied_in_place)
    // The session a caller registers it with now (RegisterBuffer RPC in
    // flight, outside mu), or 0.
    uint64_t registering = 0;
    // The last registration that failed: its session, error and end.
    uint64_t failed_session = 0;
    absl::Status failure;
    absl::Time failed_at;
  };
  absl::Mutex mu;
  std::vector<Buffer> buffers ABSL_GUARDED_BY(mu);

  // A free slot (emptied), else a new one.
  Buffer& NewSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (Buffer& b : buffers) {
      if (b.region == nullptr && b.registering == 0) return b = Buffer{};
    }
    return buffers.emplace_back();
  }
};

struct TransferOp::State {
  explicit State(size_t n, const char* via)
      : statuses(n), existed(n, false), transport(via) {}
  mutable absl::Mutex mu;
  bool ready ABSL_GUARDED_BY(mu) = false;
  std::vector<absl::Status> statuses;  // written before ready
  std::vector<bool> existed;           // puts: stored before
  const char* transport;
  // The call in flight (UCX path).
  grpc::ClientContext ctx;
  v1::PushBlocksRequest push_req;
  v1::PushBlocksResponse push_resp;
  v1::PullBlocksRequest pull_req;
  v1::PullBlocksResponse pull_resp;
  // Gets: told of the blocks of push_req that arrive not matching their
  // checksums (by FinishGet, which then releases it).
  std::shared_ptr<internal::CorruptReports> reports;

  // The last step before ready (checking a get's blocks against their
  // checksums), left for a caller blocked in Wait: it runs it on its own
  // thread, rather than waking a pool thread that then wakes the caller.
  int waiters ABSL_GUARDED_BY(mu) = 0;
  absl::AnyInvocable<void() &&> last_step ABSL_GUARDED_BY(mu);

  void Publish() {
    absl::MutexLock lock(&mu);
    ready = true;
  }
  bool ReadyOrStepLeft() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return ready || last_step != nullptr;
  }
};

// Runs tasks at their time, on a thread of its own (started by the first
// At): the publication of ops that must wait for their copy deadline. The
// Client and the callbacks that schedule on it share it, so that it is
// there for a callback that runs as the Client goes. Thread-safe.
struct Client::Timers {
  ~Timers() { Stop(); }
  // Runs `task` at `when`; at once, on this thread, from Stop on.
  void At(absl::Time when, absl::AnyInvocable<void() &&> task) {
    {
      absl::MutexLock lock(&mu);
      if (!stopped) {
        tasks.emplace(when, std::move(task));
        ++changes;
        if (!thread.joinable()) thread = std::thread([this] { Loop(); });
        return;
      }
    }
    std::move(task)();
  }
  // Ends the thread and runs every task still waiting, whatever its time.
  void Stop() {
    std::multimap<absl::Time, absl::AnyInvocable<void() &&>> left;
    {
      absl::MutexLock lock(&mu);
      stopped = true;
      left.swap(tasks);
      ++changes;
    }
    // No At starts a thread once stopped is set.
    if (thread.joinable()) thread.join();
    for (auto& [when, task] : left) std::move(task)();
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu);
    while (!stopped) {
      const uint64_t seen = changes;
      auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return changes != seen;
      };
      if (tasks.empty()) {
        mu.Await(absl::Condition(&changed));
        continue;
      }
      const absl::Time next = tasks.begin()->first;
      if (absl::Now() < next) {
        mu.AwaitWithDeadline(absl::Condition(&changed), next);
        continue;
      }
      absl::AnyInvocable<void() &&> task = std::move(tasks.begin()->second);
      tasks.erase(tasks.begin());
      mu.Unlock();
      std::move(task)();
      mu.Lock();
    }
  }

  absl::Mutex mu;
  std::multimap<absl::Time, absl::AnyInvocable<void() &&>> tasks ABSL_GUARDED_BY(mu);
  uint64_t changes ABSL_GUARDED_BY(mu) = 0;  // tasks added, or stopped
  bool stopped ABSL_GUARDED_BY(mu) = false;
  std::thread thread;  // set under mu, before stopped
};

// The gRPC calls of GetIntoAsync / PutFromAsync in flight. Their callbacks
// use the Client (DropSession, ReplaceLink): each ends with End, and the
// Client's destructor cancels those left and waits for them
// (CancelAndWait). Shared with the callbacks, so that End never touches a
// destroyed object. Thread-safe.
struct Client::Calls {
  // Adds the call of `ctx` before it starts; false once the Client is
  // going (then it must not start).
  bool Begin(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu);
    if (closing) return false;
    in_flight.insert(ctx);
    return true;
  }
  // The call's callback is done with the Client.
  void End(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu);
    in_flight.erase(ctx);
  }
  // Starts no more; cancels those in flight (a call not started yet is
  // cancelled as it starts) and waits until each has ended. TryCancel runs
  // under mu (a context in in_flight is alive until its End): gRPC never
  // runs a client call's callback inline (CallbackWithStatusTag), so it
  // cannot reach End on this thread.
  void CancelAndWait() {
    absl::MutexLock lock(&mu);
    closing = true;
    for (grpc::ClientContext* ctx : in_flight) ctx->TryCancel();
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return in_flight.empty(); };
    mu.Await(absl::Condition(&none));
  }

 private:
  absl::Mutex mu;
  absl::flat_hash_set<grpc::ClientContext*> in_flight ABSL_GUARDED_BY(mu);
  bool closing ABSL_GUARDED_BY(mu) = false;
};

namespace internal {

// Reports of blocks a get received not matching their checksums, sent to
// the daemon (ReportCorrupt) so that it drops a DRAM copy that went bad
// instead of failing every reader until the block is evicted. Fire and
// forget: at most kMaxInFlight calls at once, kMaxBlocks blocks each; a
// report more is dropped (the block's next reader reports it again). Shared
// with the gets that find such blocks, which may end after the Client:
// Close (its destructor) starts no more calls, waits a little for those in
// flight, then cancels them and waits for their end. Thread-safe.
class CorruptReports : public std::enable_shared_from_this<CorruptReports> {
 public:
  static constexpr int kMaxInFlight = 4;
  static constexpr size_t kMaxBlocks = 64;

  CorruptReports(const std::shared_ptr<grpc::Channel>& channel,
                 absl::Duration rpc_timeout)
      : stub_(v1::KvDepot::NewStub(channel)), timeout_(rpc_timeout) {}

  void Send(absl::string_view ns,
            std::vector<std::pair<std::string, uint64_t>> blocks) {
    if (blocks.empty()) return;
    if (blocks.size() > kMaxBlocks) blocks.resize(kMaxBlocks);
    struct Call {
      grpc::ClientContext ctx;
      v1::ReportCorruptRequest req;
      v1::ReportCorruptResponse resp;
    };
    auto call = std::make_shared<Call>();
    call->req.set_namespace_(std::string(ns));
    for (auto& [key, sum] : blocks) {
      v1::CorruptBlock* b = call->req.add_blocks();
      b->set_key(std::move(key));
      b->set_checksum(sum);
    }
    call->ctx.set_deadline(std::chrono::system_clock::now() +
                           absl::ToChronoMilliseconds(timeout_));
    {
      absl::MutexLock lock(&mu_);
      if (closing_ || in_flight_.size() >= kMaxInFlight) return;
      in_flight_.insert(&call->ctx);
    }
    // gRPC never runs a client call's callback inline, so it cannot take
    // mu_ on this thread.
    stub_->async()->ReportCorrupt(
        &call->ctx, &call->req, &call->resp,
        [self = shared_from_this(), call](const grpc::Status&) {
          absl::MutexLock lock(&self->mu_);
          self->in_flight_.erase(&call->ctx);
        });
  }

  // Starts no more calls; gives those in flight up to `grace` to be
  // answered, then cancels them, and returns once each has ended.
  void Close(absl::Duration grace) {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return in_flight_.empty();
    };
    if (mu_.AwaitWithTimeout(absl::Condition(&none), grace)) return;
    // A context in in_flight_ is alive until its callback erases it.
    for (grpc::ClientContext* ctx : in_flight_) ctx->TryCancel();
    mu_.Await(absl::Condition(&none));
  }

 private:
  const std::unique_ptr<v1::KvDepot::Stub> stub_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace internal

namespace {

// Runs `step` (which ends in state->Publish) on a caller waiting for the op,
// when there is one, else on `pool`.
void RunLastStep(WorkPool& pool, TransferOp::State& state,
                 absl::AnyInvocable<void() &&> step) {
  {
    absl::MutexLock lock(&state.mu);
    if (state.waiters > 0) {
      state.last_step = std::move(step);
      return;
    }
  }
  pool.Submit(std::move(step));
}

// A server's HOST:PORT (bare, or after dns:, dns://AUTHORITY/, ipv4: or
// ipv6:, the first address) must have a port gRPC can reach: gRPC reads
// "127.0.0.1:100431" as another port (its low 16 bits), so a mistyped port
// reached some other daemon. Other schemes (unix:, xds:///...) are gRPC's.
absl::Status CheckServerPort(absl::string_view server) {
  absl::string_view rest = server;
  if (absl::ConsumePrefix(&rest, "dns:")) {
    if (absl::ConsumePrefix(&rest, "//")) {  // dns://authority/host:port
      const size_t slash = rest.find('/');
      rest = slash == absl::string_view::npos ? "" : rest.substr(slash + 1);
    }
  } else if (absl::ConsumePrefix(&rest, "ipv4:") || absl::ConsumePrefix(&rest, "ipv6:")) {
    rest = rest.substr(0, rest.find(','));
  } else {
    // SCHEME: where the scheme is letters, digits, '+', '-', '.' from a
    // letter, and what follows is no port ("host:50551" is no scheme).
    const size_t colon = rest.find(':');
    if (colon != absl::string_view::npos && colon > 0 &&
        absl::ascii_isalpha(static_cast<unsigned char>(rest[0])) &&
        std::all_of(rest.begin(), rest.begin() + colon,
                    [](char c) {
                      return absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
                             c == '+' || c == '-' || c == '.';
                    }) &&
        (colon + 1 == rest.size() ||
         !absl::ascii_isdigit(static_cast<unsigned char>(rest[colon + 1])))) {
      absl::StatusOr<HostPort> split = SplitHostPort(rest);
      // A host whose "port" is not a number at all (unix:/run/k.sock,
      // xds:///svc) is a scheme; "host:http" is a bad port.
      if (!split.ok() || absl::StrContains(split->port, '/') ||
          absl::StartsWith(rest, "unix") || absl::StartsWith(rest, "vsock:")) {
        return absl::OkStatus();
      }
    }
  }
  absl::StatusOr<HostPort> split = SplitHostPort(rest);
  if (!split.ok()) return absl::OkStatus();  // no port, or a bare IPv6 address
  const std::optional<uint16_t> port = PortNumber(split->port);
  if (!port.has_value() || *port == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "server '", server, "': port '", split->port, "' is not 1..65535"));
  }
  return absl::OkStatus();
}

}  // namespace

TransferOp::TransferOp(std::shared_ptr<State> state) : state_(std::move(state)) {}

bool TransferOp::IsReady() const {
  absl::MutexLock lock(&state_->mu);
  return state_->ready;
}

void TransferOp::Wait() const { WaitUntil(absl::InfiniteFuture()); }

bool TransferOp::WaitUntil(absl::Time deadline) const {
  State& state = *state_;
  absl::AnyInvocable<void() &&> step;
  {
    absl::MutexLock lock(&state.mu);
    ++state.waiters;
    state.mu.AwaitWithDeadline(
        absl::Condition(&state, &State::ReadyOrStepLeft), deadline);
    --state.waiters;
    if (state.ready || state.last_step == nullptr) return state.ready;
    // Left to a waiter: this one takes it, past its deadline or not (the
    // step is short, and no one else is bound to run it).
    step = std::exchange(state.last_step, nullptr);
  }
  std::move(step)();
  return IsReady();
}

const std::vector<absl::Status>& TransferOp::statuses() const {
  return state_->statuses;
}

size_t TransferOp::ok_prefix() const {
  size_t n = 0;
  while (n < state_->statuses.size() && state_->statuses[n].ok()) ++n;
  return n;
}

bool TransferOp::already_stored(size_t i) const { return state_->existed[i]; }

const char* TransferOp::transport() const { return state_->transport; }

std::map<std::string, std::string> ClientUcxSettings(const ClientOptions& options) {
  std::map<std::string, std::string> settings = options.ucx;
  if (!UcxNetDevicesSetting(options.ucx).has_value()) {
    UcxDeviceChoice devices = UcxDevicesToReach(options.server);
    if (devices.confined()) settings["NET_DEVICES"] = *devices.net_devices;
  }
  return settings;
}

Client::Client(const ClientOptions& options)
    : options_(options),
      timers_(std::make_shared<Timers>()),
      calls_(std::make_shared<Calls>()),
      ucx_retry_wait_(FirstUcxRetryWait(options)) {
  if (options_.transport == ClientOptions::Transport::kUcx) {
    auto ucx = std::make_unique<Ucx>();
    UcxContextOptions context_options;
    context_options.config = ClientUcxSettings(options_);
    context_options.name = options_.client_name;
    absl::StatusOr<std::unique_ptr<UcxContext>> context =
        UcxContext::Create(context_options);
    if (context.ok()) ucx->context = *std::move(context);
    absl::StatusOr<std::shared_ptr<Link>> link =
        context.ok() ? NewLink(*ucx->context) : context.status();
    if (link.ok()) {
      // Whenever requests may go over UCX: a later link may have them
      // although this one has not.
      if (options_.ucx_requests) {
        ucx->verify_pool = std::make_unique<WorkPool>(2, "kvdepot-verify");
      }
      absl::MutexLock lock(&ucx->link_mu);
      ucx->link = *std::move(link);
      ucx_ = std::move(ucx);
    } else {
      absl::MutexLock lock(&mu_);
      ucx_status_ = link.status();
    }
  } else {
    absl::MutexLock lock(&mu_);
    ucx_status_ = absl::FailedPreconditionError("transport grpc was asked for");
  }
  grpc::ChannelArguments args;
  // As large as kvdepotd's messages may be: a batch of max_batch_keys
  // (at most 65536) blocks with 256-byte keys weighs up to 1 KiB per block
  // (kvdepotd sizes its own limit the same way, server/daemon.cc).
  args.SetMaxReceiveMessageSize(65 << 20);
  args.SetMaxSendMessageSize(65 << 20);
  // gRPC's transparent retries keep a copy of every outgoing message until
  // the reply starts; for block-sized messages that is a second copy per
  // put. Our calls are idempotent and callers degrade to a miss instead.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  // A restarted daemon is back within seconds, and until the channel
  // reconnects every call is a miss: retry the connection every 100 ms at
  // first, never less often than every 2 s (gRPC's default backoff grows
  // to minutes, and on a daemon down for 2 s it had already grown to ~15 s).
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the time a
  // connection attempt may take (until the daemon's first HTTP/2 frame), so
  // at 100 ms a daemon slower than that to answer (a loaded host, a
  // port-forward) failed every call at once (its default is 20 s; calls
  // keep their own deadlines).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  channel_ = grpc::CreateCustomChannel(options_.server,
                                       grpc::InsecureChannelCredentials(), args);
  stub_ = v1::KvDepot::NewStub(channel_);
  reports_ = std::make_shared<internal::CorruptReports>(channel_,
                                                        options_.rpc_timeout);
  watch_ = std::thread([this] { WatchLoop(); });
}

absl::Status Client::FromRpc(const grpc::Status& status) {
  NoteRpc(status);
  return FromGrpcStatus(status);
}

void Client::NoteRpc(const grpc::Status& status) {
  if (status.ok()) {
    if (!owes_unpins_.load(std::memory_order_relaxed)) return;
    absl::MutexLock lock(&watch_mu_);
    watch_answered_ = true;
    return;
  }
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
      status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
    return;
  }
  // A deadline over a connection that is up is a slow daemon, and
  // UNAVAILABLE over one its own answer: nothing to reconnect.
  if (channel_->GetState(false) == GRPC_CHANNEL_READY) return;
  absl::MutexLock lock(&watch_mu_);
  watch_disconnected_ = true;
  watch_failed_at_ = absl::Now();
}

void Client::WatchLoop() {
  // How long after the last call that found no connection the channel is
  // still polled: the calls of a client in use renew it; an idle client
  // reconnects at its next call, as gRPC does.
  constexpr absl::Duration kWatch = absl::Seconds(30);
  // For the first kFast of an outage: polls of kPoll (the destructor waits
  // for one at most), and gRPC's backoff reset every kRetryEvery, so a
  // restarted daemon is reached a fraction of a second after it listens
  // (an attempt at a closed port costs a SYN and a RST; gRPC then tries
  // again after 100 ms). Past that the outage is no restart: gRPC's own
  // backoff (up to 2 s between attempts) and polls of kSlowPoll, for as
  // long as calls (keep-alives included, every third of a lease) fail.
  constexpr absl::Duration kFast = absl::Seconds(30);
  constexpr absl::Duration kPoll = absl::Milliseconds(50);
  constexpr absl::Duration kSlowPoll = absl::Milliseconds(250);
  constexpr absl::Duration kRetryEvery = absl::Milliseconds(250);
  // Early keep-alives (for owed pins) at most this often.
  constexpr absl::Duration kRenewEvery = absl::Seconds(1);
  absl::Time renewed_at = absl::InfinitePast();
  absl::Time down_since = absl::InfiniteFuture();  // polled, not READY since
  absl::Time polled_at = absl::InfinitePast();      // the last poll
  absl::MutexLock lock(&watch_mu_);
  while (true) {
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) {
      return watch_stop_ || watch_disconnected_ || watch_answered_;
    };
    watch_mu_.Await(absl::Condition(&woken));
    if (watch_stop_) return;
    bool renew = std::exchange(watch_answered_, false);
    if (std::exchange(watch_disconnected_, false)) {
      absl::Time retried_at = absl::Now();
      // Not watched meanwhile: it may have been up. A new outage.
      if (absl::Now() - polled_at > absl::Seconds(1)) down_since = absl::InfiniteFuture();
      while (!watch_stop_ && absl::Now() < watch_failed_at_ + kWatch) {
        watch_mu_.Unlock();
        const grpc_connectivity_state state = channel_->GetState(true);
        const bool ready = state == GRPC_CHANNEL_READY;
        const absl::Time now = absl::Now();
        if (ready) {
          down_since = absl::InfiniteFuture();
        } else {
          down_since = std::min(down_since, now);
          const bool fast = now - down_since < kFast;
          if (fast && now - retried_at >= kRetryEvery) {
            retried_at = now;
            grpc::experimental::ChannelResetConnectionBackoff(channel_.get());
          }
          channel_->WaitForStateChange(
              state, std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(fast ? kPoll : kSlowPoll));
        }
        polled_at = absl::Now();
        watch_mu_.Lock();
        if (ready) {
          renew = true;  // a restarted daemon: find out about the session now
          break;
        }
      }
      watch_disconnected_ = false;
    }
    if (renew && absl::Now() >= renewed_at + kRenewEvery) {
      renewed_at = absl::Now();
      watch_mu_.Unlock();
      {
        absl::MutexLock client_lock(&mu_);
        keepalive_now_ = true;
      }
      watch_mu_.Lock();
    }
  }
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const ClientOptions& options) {
  if (options.server.empty()) {
    return absl::InvalidArgumentError("server address is empty");
  }
  RETURN_IF_ERROR(CheckServerPort(options.server));
  if (options.rpc_timeout <= absl::ZeroDuration() ||
      options.rpc_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc_timeout must be positive and finite, not ",
        absl::FormatDuration(options.rpc_timeout)));
  }
  // OpenSessionRequest.lease_ms is a uint32 (a lease that wrapped around
  // would be the daemon's longest); under 1 ms would be 0, its default.
  if (options.lease != absl::ZeroDuration() &&
      (options.lease < absl::Milliseconds(1) ||
       options.lease > absl::Milliseconds(std::numeric_limits<uint32_t>::max()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease must be zero (the daemon's default) or from 1ms to ",
        absl::FormatDuration(absl::Milliseconds(std::numeric_limits<uint32_t>::max())),
        ", not ", absl::FormatDuration(options.lease)));
  }
  return std::unique_ptr<Client>(new Client(options));
}

Client::~Client() {
  {
    absl::MutexLock lock(&watch_mu_);
    watch_stop_ = true;
  }
  if (watch_.joinable()) watch_.join();
  uint64_t session;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (keepalive_ctx_ != nullptr) keepalive_ctx_->TryCancel();
    // Taken first: the callbacks of the calls ended below may drop it (a
    // get that fails in flight replaces the session), and it is closed all
    // the same.
    session = std::exchange(session_id_, 0);
    pin_sessions_.clear();
  }
  if (keepalive_.joinable()) keepalive_.join();
  if (session != 0) DisconnectRequests(session);  // pending: Unavailable
  // Before anything they use goes: their callbacks run on gRPC's threads.
  calls_->CancelAndWait();
  if (session != 0) {
    CloseSessionRpc(session, std::min(absl::Seconds(2), options_.rpc_timeout / 2))
        .IgnoreError();
  }
  if (ucx_ != nullptr) {
    // Before the rest of ucx_, which the callbacks of their pending
    // requests use (ReplaceLink). Stopped first: then no progress thread
    // holds one when they go.
    std::vector<std::shared_ptr<Link>> links;
    {
      absl::MutexLock lock(&ucx_->link_mu);
      links.swap(ucx_->retired);
      if (ucx_->link != nullptr) links.push_back(std::move(ucx_->link));
    }
    for (const std::shared_ptr<Link>& link : links) link->worker->Stop();
    links.clear();
    // Checks of replies still queued read the buffers they landed in: done
    // before those buffers (AllocateBuffer memory) go with ucx_.
    ucx_->verify_pool.reset();
  }
  // Ops still waiting for their copy deadline are reported last, once the
  // memory of their buffers (AllocateBuffer) has gone with ucx_: no caller
  // can write into it any more while the daemon may still copy.
  ucx_.reset();
  // After the checks of the verify pool: a report of a corrupt block a get
  // just found (a failed kvdepotctl get) is worth a short wait, as no other
  // reader may come. Ops the timers publish below report nothing.
  reports_->Close(std::min(absl::Seconds(1), options_.rpc_timeout));
  timers_->Stop();
}

absl::StatusOr<std::shared_ptr<Client::Link>> Client::NewLink(
    UcxContext& context) const {
  auto link = std::make_shared<Link>();
  ASSIGN_OR_RETURN(link->worker,
                   UcxWorker::Create(context, UcxWorkerOptions{"kvdepot-ucx"}));
  if (options_.ucx_requests) {
    absl::StatusOr<std::unique_ptr<UcxRequests>> requests =
        UcxRequests::Create(*link->worker);
    // Without it, requests go as gRPC calls: slower, not broken.
    if (requests.ok()) link->requests = *std::move(requests);
  }
  return link;
}

std::shared_ptr<Client::Link> Client::LinkOf(uint64_t session) {
  absl::MutexLock lock(&ucx_->link_mu);
  if (ucx_->link == nullptr || ucx_->link->session != session) return nullptr;
  return ucx_->link;
}

bool Client::Fenced(const Link& link) {
  absl::MutexLock lock(&ucx_->link_mu);
  return ucx_->link.get() != &link;
}

void Client::ReplaceLink(Link& link, uint64_t session,
                         absl::AnyInvocable<void() &&> then) {
  uint64_t opened = 0;
  {
    absl::MutexLock lock(&ucx_->link_mu);
    opened = link.session;
    if (ucx_->link.get() == &link) {
      link.retired_at = absl::Now();
      ucx_->retired.push_back(std::move(ucx_->link));
    }
  }
  // Their endpoints in the daemon go to this worker: the get's session,
  // and the one opened on the link since, if another.
  DropSession(session);
  if (opened != session) DropSession(opened);
  // DropSession finds no link for them any more (it was retired above):
  // this link's requests stop serving them here, so that a request sent
  // now is refused at once instead of waiting for its deadline.
  if (link.requests != nullptr) {
    link.requests->Disconnect(session);
    if (opened != session && opened != 0) link.requests->Disconnect(opened);
  }
  link.worker->Fence(std::move(then));
}

void Client::ReapLinks() {
  std::vector<std::shared_ptr<Link>> done;
  {
    absl::MutexLock lock(&ucx_->link_mu);
    const absl::Time now = absl::Now();
    // Oldest first; past the cap, the oldest go before their time.
    size_t excess = ucx_->retired.size() > kMaxRetiredLinks
                        ? ucx_->retired.size() - kMaxRetiredLinks
                        : 0;
    std::vector<std::shared_ptr<Link>> keep;
    for (std::shared_ptr<Link>& link : ucx_->retired) {
      const bool due = excess > 0 || now - link->retired_at >= kRetiredLinkGrace;
      // Nothing makes a new copy of a retired link (LinkOf gives the
      // current one), and a progress thread that may still use its own
      // link (by reference, in a request's callback) has not ended.
      if (due && link.use_count() == 1 && link->worker->finished()) {
        done.push_back(std::move(link));
        if (excess > 0) --excess;
      } else {
        keep.push_back(std::move(link));
      }
    }
    ucx_->retired.swap(keep);
  }
  done.clear();  // outside link_mu: their requests' callbacks may take it
}

void Client::PrepareContext(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(options_.rpc_timeout));
}

absl::Status Client::Health() {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  RETURN_IF_ERROR(FromRpc(stub->Check(&ctx, req, &resp)));
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(
        "kvdepotd at ", options_.server, " is not serving (",
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()),
        ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Client::EnsureSession() {
  const absl::Time give_up = absl::Now() + options_.rpc_timeout;
  uint64_t mine;
  {
    absl::MutexLock open_lock(&open_mu_);
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (session_id_ != 0) return session_id_;
      }
      if (!opening_) break;
      // Another caller is opening one: its outcome is this caller's too (a
      // daemon that does not answer it would not answer this one either).
      const uint64_t theirs = open_tries_;
      auto ended = [this, theirs]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(open_mu_) {
        return open_done_ >= theirs;
      };
      if (!open_mu_.AwaitWithDeadline(absl::Condition(&ended), give_up)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "no session with kvdepotd at ", options_.server, " within ",
            absl::FormatDuration(options_.rpc_timeout),
            " (another call is opening one)"));
      }
      if (!open_status_.ok()) return open_status_;
    }
    opening_ = true;
    mine = ++open_tries_;
  }
  absl::StatusOr<uint64_t> opened;
  for (int attempt = 0;; ++attempt) {
    opened = OpenSessionOnce(/*last_try=*/attempt > 0);
    if (!opened.ok() || *opened != 0) break;
  }
  absl::MutexLock open_lock(&open_mu_);
  opening_ = false;
  open_done_ = mine;
  open_status_ = opened.status();
  return opened;
}

absl::StatusOr<uint64_t> Client::OpenSessionOnce(bool last_try) {
  {
    absl::MutexLock lock(&mu_);
    if (session_id_ != 0) return session_id_;
  }
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::OpenSessionRequest req;
  req.set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.lease)));
  req.set_client_name(options_.client_name);
  std::shared_ptr<Link> link;
  absl::Status link_status = absl::OkStatus();
  if (ucx_ != nullptr) {
    ReapLinks();
    {
      absl::MutexLock lock(&ucx_->link_mu);
      link = ucx_->link;
    }
    if (link == nullptr) {
      absl::StatusOr<std::shared_ptr<Link>> made = NewLink(*ucx_->context);
      if (made.ok()) {
        link = *std::move(made);
        absl::MutexLock lock(&ucx_->link_mu);
        ucx_->link = link;
      } else {
        link_status = made.status();  // this session goes without UCX
      }
    }
  }
  if (link != nullptr) {
    req.set_ucx_worker_address(link->worker->address());
    req.set_host_id(LocalHostId());
    if (const auto& tcp = ucx_->context->tcp_segments(); tcp.has_value()) {
      req.set_ucx_tcp_tx_seg_size(tcp->tx);
      req.set_ucx_tcp_rx_seg_size(tcp->rx);
    }
  }
  v1::OpenSessionResponse resp;
  grpc::Status st = stub_->OpenSession(&ctx, req, &resp);
  absl::Status ucx_status = link_status;
  if (!st.ok() && !req.ucx_worker_address().empty() &&
      (absl::StrContains(st.error_message(), kNoUcxEndpoint) ||
       ((st.error_code() == grpc::StatusCode::UNAVAILABLE ||
         st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
         st.error_code() == grpc::StatusCode::FAILED_PRECONDITION) &&
        absl::StrContains(st.error_message(), "UCX")))) {
    // The daemon cannot reach our worker, or will not (our UCX settings do
    // not fit its): fall back to the gRPC byte path. Whatever the code of
    // an endpoint the daemon could not make (UCX's own errors map to
    // several, Internal among them), it opened no session for us.
    ucx_status = FromGrpcStatus(st);
    req.clear_ucx_worker_address();
    grpc::ClientContext retry;
    PrepareContext(&retry);
    st = stub_->OpenSession(&retry, req, &resp);
  }
  RETURN_IF_ERROR(FromRpc(st));
  if (ucx_status.ok() && ucx_ != nullptr && !resp.ucx_connected()) {
    ucx_status = absl::FailedPreconditionError(
        "the daemon has no UCX data plane");
  }
  bool retired = false;
  if (link != nullptr) {
    // Under one hold of link_mu with the check: a ReplaceLink after it
    // drops this session too (link->session).
    absl::MutexLock lock(&ucx_->link_mu);
    retired = ucx_->link != link;
    if (!retired && ucx_status.ok()) link->session = resp.session_id();
  }
  if (retired && !last_try) {
    // Retired meanwhile (a get failed: ReplaceLink fenced its worker). The
    // session's endpoint goes to a worker that nothing progresses, or the
    // daemon could not connect to it and the session went without UCX:
    // close it, and open another on a new link.
    CloseSessionRpc(resp.session_id(), std::min(absl::Seconds(2), options_.rpc_timeout))
        .IgnoreError();
    return 0;
  }
  if (ucx_status.ok() && link != nullptr && !retired) {
    if (link->requests != nullptr && !resp.ucx_request_address().empty()) {
      link->data_requests.store(resp.ucx_data_requests());
      // Without it, requests go as gRPC calls: slower, not broken.
      link->requests
          ->Connect(resp.session_id(), resp.ucx_request_address(),
                    std::min(options_.rpc_timeout, absl::Seconds(5)))
          .IgnoreError();
    }
  }
  absl::MutexLock lock(&mu_);
  if (ucx_ != nullptr) {
    ucx_status_ = ucx_status;
    if (ucx_status.ok()) {
      ucx_retry_wait_ = FirstUcxRetryWait(options_);
      ucx_retry_at_ = absl::InfiniteFuture();
    } else if (!absl::IsInvalidArgument(ucx_status) &&
               !absl::IsFailedPrecondition(ucx_status) &&
               !absl::IsPermissionDenied(ucx_status) &&
               !absl::IsUnimplemented(ucx_status)) {
      // Refused for now (not for our settings or who we are): ask again
      // later. (Retrying only UNAVAILABLE and DEADLINE_EXCEEDED kept a
      // session whose worker could not be made for want of resources, or
      // that the daemon's UCX refused with another code, on gRPC for its
      // whole life.)
      ucx_retry_at_ = absl::Now() + ucx_retry_wait_;
      ucx_retry_wait_ = std::min(2 * ucx_retry_wait_, kMaxUcxRetryWait);
    }
  }
  session_id_ = resp.session_id();
  lease_ = absl::Milliseconds(resp.lease_ms());
  if (!keepalive_.joinable()) {
    keepalive_ = std::thread([this] { KeepAliveLoop(); });
  }
  return session_id_;
}

absl::Status Client::CloseSession() {
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = std::exchange(session_id_, 0);
    // The daemon releases the session's pins with it.
    absl::erase_if(pin_sessions_,
                   [&](const auto& entry) { return entry.second == id; });
  }
  if (id == 0) return absl::OkStatus();
  DisconnectRequests(id);
  return CloseSessionRpc(id, std::min(absl::Seconds(2), options_.rpc_timeout));
}

absl::Status Client::CloseSessionRpc(uint64_t id, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(timeout));
  v1::CloseSessionRequest req;
  req.set_session_id(id);
  v1::CloseSessionResponse resp;
  return FromRpc(stub_->CloseSession(&ctx, req, &resp));
}

void Client::KeepAliveLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    absl::Duration period = std::max(lease_ / 3, absl::Milliseconds(100));
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || keepalive_now_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&woken), period);
    keepalive_now_ = false;
    if (stop_ || session_id_ == 0) continue;
    uint64_t id = session_id_;
    grpc::ClientContext ctx;
    // Never longer than a keep-alive period (a late renewal is useless) nor
    // than an ordinary RPC; the destructor cancels it.
    ctx.set_deadline(std::chrono::system_clock::now() +
                     absl::ToChronoMilliseconds(std::min(
                         std::max(period, absl::Seconds(1)), options_.rpc_timeout)));
    keepalive_ctx_ = &ctx;
    mu_.Unlock();
    v1::KeepAliveRequest req;
    req.set_session_id(id);
    v1::KeepAliveResponse resp;
    grpc::Status st = stub_->KeepAlive(&ctx, req, &resp);
    if (!st.ok()) NoteRpc(st);
    mu_.Lock();
    keepalive_ctx_ = nullptr;
    // The daemon forgot the session (restart or expiry): drop it, with its
    // UCX requests (DropSession: their replies will not come, and a
    // request ending late must not take the next session's link down with
    // it); the next call that needs one opens a new one.
    if (st.error_code() == grpc::StatusCode::NOT_FOUND && session_id_ == id) {
      mu_.Unlock();
      DropSession(id);
      mu_.Lock();
    }
    if (st.ok()) RetryOwedUnpins(absl::Now() + period / 2);
  }
}

void Client::RetryOwedUnpins(absl::Time deadline) {
  std::vector<std::pair<uint64_t, uint64_t>> owed;
  owed.swap(owed_unpins_);
  owes_unpins_.store(false, std::memory_order_relaxed);
  // The keep-alive thread must not miss a lease for these: each call gets a
  // second, and the round ends at the first that fails (the daemon is
  // unreachable again) or at `deadline` (a daemon that answers slowly);
  // the rest wait for the next round.
  size_t done = 0;
  for (; done < owed.size() && !stop_ && absl::Now() < deadline; ++done) {
    const auto [pin, session] = owed[done];
    mu_.Unlock();
    const absl::Status st = UnpinRpc(session, pin, absl::Seconds(1));
    mu_.Lock();
    // Released, or gone with its session: done. Otherwise next time.
    if (!UnpinSettled(st)) break;
    pin_sessions_.erase(pin);
  }
  for (size_t i = done; i < owed.size(); ++i) {
    if (owed_unpins_.size() < kMaxOwedUnpins) owed_unpins_.push_back(owed[i]);
  }
  owes_unpins_.store(!owed_unpins_.empty(), std::memory_order_relaxed);
}

absl::StatusOr<LookupReply> Client::Lookup(absl::string_view ns,
                                           absl::Span<const absl::string_view> keys,
                                           bool prefix, bool pin) {
  v1::LookupRequest req;
  req.set_namespace_(std::string(ns));
  for (absl::string_view k : keys) req.add_keys(std::string(k));
  req.set_prefix(prefix);
  req.set_pin(pin);
  v1::LookupResponse resp;
  // With pin, a daemon that forgot our session (restart, expiry) answers
  // NOT_FOUND: open a new session and try once more.
  for (int attempt = 0;; ++attempt) {
    uint64_t sid = 0;
    if (pin) {
      // Counted in pinning_lookups_ while in flight, in the session that is
      // current when counted (MaybeRetryUcx abandons none meanwhile).
      for (;;) {
        ASSIGN_OR_RETURN(sid, EnsureSession());
        absl::MutexLock lock(&mu_);
        if (session_id_ == sid) {
          ++pinning_lookups_;
          break;
        }
      }
      req.set_session_id(sid);
    }
    absl::Cleanup uncount = [this, pin] {
      if (!pin) return;
      absl::MutexLock lock(&mu_);
      --pinning_lookups_;
    };
    grpc::ClientContext ctx;
    PrepareContext(&ctx);
    resp.Clear();
    grpc::Status st = stub_->Lookup(&ctx, req, &resp);
    // Tests stand in for an answer lost on its way (the daemon ran the
    // call) by setting an error.
    internal::TestSyncPoint("Client::LookupAnswered", &st);
    if (pin && attempt == 0 && st.error_code() == grpc::StatusCode::NOT_FOUND) {
      DropSession(sid);
      continue;
    }
    // A pinning lookup that ended without its answer (deadline, lost
    // connection) may have pinned the blocks all the same, under a pin id
    // this client never learns and so never unpins: left in a session kept
    // alive, such pins would hold their blocks for good and, piling up,
    // reach the session's pin limit. So the session is abandoned: no
    // longer kept alive, its lease ends its pins; the next call opens
    // another (calls in flight in it still finish).
    if (pin && MaybeUnanswered(FromGrpcStatus(st))) AbandonSession(sid);
    RETURN_IF_ERROR(FromRpc(st));
    if (resp.pin_id() != 0) RememberPin(resp.pin_id(), sid);
    break;
  }
  LookupReply out;
  out.prefix_hits = resp.prefix_hits();
  out.pin_id = resp.pin_id();
  out.entries.reserve(resp.entries_size());
  for (const v1::LookupEntry& e : resp.entries()) {
    out.entries.push_back(BlockInfo{e.found(), e.tier(), e.size(), e.checksum()});
  }
  return out;
}

void Client::RememberPin(uint64_t pin_id, uint64_t session) {
  absl::MutexLock lock(&mu_);
  // Full: forget the pins of other sessions, once per current session (a
  // map full of this session's pins is not scanned again at every call).
  if (pin_sessions_.size() >= kMaxRememberedPins && pins_pruned_for_ != session_id_) {
    pins_pruned_for_ = session_id_;
    absl::erase_if(pin_sessions_, [&](const auto& entry) {
      return entry.second != session_id_;
    });
  }
  if (pin_sessions_.size() < kMaxRememberedPins) pin_sessions_[pin_id] = session;
}

uint64_t Client::PinSessionLocked(uint64_t pin_id) {
  auto it = pin_sessions_.find(pin_id);
  return it != pin_sessions_.end() ? it->second : session_id_;
}

absl::Status Client::Unpin(uint64_t pin_id) {
  uint64_t session;
  {
    absl::MutexLock lock(&mu_);
    session = PinSessionLocked(pin_id);
  }
  absl::Status st = UnpinRpc(session, pin_id, options_.rpc_timeout);
  // Settled: forget it. Kept for a retry after any other error.
  if (UnpinSettled(st)) {
    absl::MutexLock lock(&mu_);
    pin_sessions_.erase(pin_id);
  }
  return st;
}

absl::Status Client::UnpinRpc(uint64_t session, uint64_t pin_id,
                              absl::Duration timeout) {
  // Tests stand in for a daemon that cannot be reached by setting an error.
  absl::Status unreachable;
  internal::TestSyncPoint("Client::UnpinRpc", &unreachable);
  if (!unreachable.ok()) return unreachable;
  v1::UnpinRequest req;
  req.set_session_id(session);
  req.set_pin_id(pin_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(timeout));
  v1::UnpinResponse resp;
  return FromRpc(stub_->Unpin(&ctx, req, &resp));
}

void Client::ReleaseOwnPin(uint64_t pin_id) {
  if (UnpinSettled(Unpin(pin_id))) return;
  OweUnpin(pin_id);
}

void Client::OweUnpin(uint64_t pin_id) {
  absl::MutexLock lock(&mu_);
  if (owed_unpins_.size() < kMaxOwedUnpins) {
    owed_unpins_.push_back({pin_id, PinSessionLocked(pin_id)});
    owes_unpins_.store(true, std::memory_order_relaxed);
  }
}

namespace {

// `finished`: the stream's status (Finish).
absl::StatusOr<std::vector<PutResult>> FinishPut(const absl::Status& finished,
                                                 const v1::WriteResponse& resp,
                                                 size_t blocks) {
  RETURN_IF_ERROR(finished);
  if (static_cast<size_t>(resp.results_size()) != blocks) {
    return absl::InternalError(absl::StrCat("daemon answered ", resp.results_size(),
                                            " results for ", blocks, " blocks"));
  }
  std::vector<PutResult> out;
  out.reserve(blocks);
  for (int r : resp.results()) {
    out.push_back(r == v1::WRITE_ALREADY_EXISTS ? PutResult::kAlreadyExists
                                                : PutResult::kStored);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<PutResult>> Client::Put(
    absl::string_view ns, absl::Span<const BlockToPut> blocks) {
  if (ucx_ == nullptr || blocks.empty()) return PutGrpc(ns, blocks);
  // Over UCX when the bytes are in registered memory (PutFromAsync falls
  // back to PutGrpc otherwise).
  TransferOp op = PutFromAsync(ns, blocks);
  op.Wait();
  std::vector<PutResult> out;
  out.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    RETURN_IF_ERROR(op.statuses()[i]);
    out.push_back(op.already_stored(i) ? PutResult::kAlreadyExists
                                       : PutResult::kStored);
  }
  return out;
}

absl::StatusOr<std::vector<PutResult>> Client::PutGrpc(
    absl::string_view ns, absl::Span<const BlockToPut> blocks) {
  RETURN_IF_ERROR(ValidateNamespace(ns));
  // Everything checked before the stream opens: the daemon stores each
  // block as it completes, so a bad one further on must not leave the ones
  // before it stored but reported failed (the UCX path refuses the whole
  // batch the same way).
  for (const BlockToPut& b : blocks) {
    RETURN_IF_ERROR(ValidateKey(b.key));
    if (!b.parent.empty()) RETURN_IF_ERROR(ValidateKey(b.parent, "parent key"));
    if (b.bytes.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", KeyToHex(b.key), " is empty (size 0)"));
    }
  }
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::WriteResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::WriteRequest>> writer =
      stub_->Write(&ctx, &resp);
  v1::WriteRequest msg;
  bool open = true;
  // The header rides with the first chunk; the last message is coalesced
  // with the half-close.
  for (size_t i = 0; open && i < blocks.size(); ++i) {
    const BlockToPut& b = blocks[i];
    size_t off = 0;
    do {
      msg.Clear();
      if (off == 0) {
        v1::WriteHeader* h = msg.mutable_header();
        h->set_namespace_(std::string(ns));
        h->set_key(std::string(b.key));
        h->set_parent_key(std::string(b.parent));
        h->set_size(b.bytes.size());
        h->set_checksum(BlockChecksum(b.bytes));
      }
      absl::string_view chunk = b.bytes.substr(off, kChunk);
      msg.set_data(chunk.data(), chunk.size());
      off += chunk.size();
      bool last = i + 1 == blocks.size() && off >= b.bytes.size();
      grpc::WriteOptions options;
      if (last) options.set_last_message();
      open = writer->Write(msg, options);
      if (last && open) return FinishPut(FromRpc(writer->Finish()), resp, blocks.size());
    } while (open && off < b.bytes.size());
  }
  if (open) writer->WritesDone();
  return FinishPut(FromRpc(writer->Finish()), resp, blocks.size());
}

void Client::ReportCorrupt(
    absl::string_view ns,
    std::vector<std::pair<std::string, uint64_t>> blocks) const {
  reports_->Send(ns, std::move(blocks));
}

absl::StatusOr<std::vector<Block>> Client::Get(
    absl::string_view ns, absl::Span<const absl::string_view> keys) {
  v1::ReadRequest req;
  req.set_namespace_(std::string(ns));
  for (absl::string_view k : keys) req.add_keys(std::string(k));
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  std::unique_ptr<grpc::ClientReader<v1::ReadResponse>> reader =
      stub_->Read(&ctx, req);
  std::vector<Block> out;
  out.reserve(keys.size());
  uint64_t want = 0;
  v1::ReadResponse msg;
  auto finish_block = [&]() -> absl::Status {
    Block& b = out.back();
    if (b.bytes.size() != want) {
      return absl::DataLossError(absl::StrCat("block ", KeyToHex(b.key), " has ",
                                              b.bytes.size(), " of ", want, " bytes"));
    }
    if (BlockChecksum(b.bytes) != b.checksum) {
      ReportCorrupt(ns, {{b.key, b.checksum}});
      return absl::DataLossError(
          absl::StrCat("block ", KeyToHex(b.key), " fails its checksum"));
    }
    return absl::OkStatus();
  };
  while (reader->Read(&msg)) {
    if (msg.has_header()) {
      if (!out.empty()) {
        absl::Status st = finish_block();
        if (!st.ok()) {
          ctx.TryCancel();
          (void)reader->Finish();
          return st;
        }
      }
      Block& b = out.emplace_back();
      b.key = msg.header().key();
      b.checksum = msg.header().checksum();
      want = msg.header().size();
      if (want > (uint64_t{1} << 32)) {
        ctx.TryCancel();
        (void)reader->Finish();
        return absl::DataLossError(absl::StrCat(
            "daemon declared a block of ", want, " bytes for ", KeyToHex(b.key)));
      }
      if (msg.data().size() == want) {
        b.bytes.swap(*msg.mutable_data());  // the common one-chunk block
        continue;
      }
      b.bytes.reserve(want);
    }
    if (!out.empty()) out.back().bytes.append(msg.data());
  }
  RETURN_IF_ERROR(FromRpc(reader->Finish()));
  if (!out.empty()) RETURN_IF_ERROR(finish_block());
  if (out.size() != keys.size()) {
    return absl::DataLossError(absl::StrCat("stream carried ", out.size(),
                                            " of ", keys.size(), " blocks"));
  }
  return out;
}

absl::StatusOr<std::vector<bool>> Client::GetInto(
    absl::string_view ns, absl::Span<const absl::string_view> keys,
    absl::Span<const absl::Span<char>> dst) {
  if (ucx_ == nullptr || keys.empty() || keys.size() != dst.size()) {
    return GetIntoGrpc(ns, keys, dst);
  }
  // Over UCX when dst is in registered memory (GetIntoAsync falls back to
  // GetIntoGrpc otherwise).
  TransferOp op = GetIntoAsyncImpl(ns, keys, dst, /*prefix=*/false,
                                   /*all_or_nothing=*/true);
  op.Wait();
  std::vector<bool> filled(keys.size(), false);
  for (size_t i = 0; i < keys.size(); ++i) {
    const absl::Status& s = op.statuses()[i];
    if (s.ok()) {
      filled[i] = true;
    } else if (!absl::IsNotFound(s)) {
      return s;
    }
  }
  return filled;
}

absl::StatusOr<std::vector<bool>> Client::GetIntoGrpc(
    absl::string_view ns, absl::Span<const absl::string_view> keys,
    absl::Span<const absl::Span<char>> dst, bool prefix) {
  ASSIGN_OR_RETURN(std::vector<absl::Status> statuses,
                   GetIntoGrpcPerKey(ns, keys, dst, prefix, /*all_or_nothing=*/true));
  std::vector<bool> filled(keys.size(), false);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (statuses[i].ok()) {
      filled[i] = true;
    } else if (!absl::IsNotFound(statuses[i])) {
      return statuses[i];
    }
  }
  return filled;
}

absl::StatusOr<std::vector<absl::Status>> Client::GetIntoGrpcPerKey(
    absl::string_view ns, absl::Span<const absl::string_view> keys,
    absl::Span<const absl::Span<char>> dst, bool prefix, bool all_or_nothing) {
  if (keys.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GetInto: ", keys.size(), " keys but ", dst.size(), " buffers"));
  }
  std::vector<absl::Status> statuses(keys.size());
  if (keys.empty()) return statuses;
  RETURN_IF_ERROR(ValidateNamespace(ns));
  for (absl::string_view k : keys) RETURN_IF_ERROR(ValidateKey(k));
  // Pin, so that nothing found here is evicted before the Read reaches it.
  // A prefix lookup finds nothing after the first miss: nothing is read there.
  ASSIGN_OR_RETURN(LookupReply found, Lookup(ns, keys, prefix, /*pin=*/true));
  absl::Status st;
  std::vector<std::pair<std::string, uint64_t>> corrupt;  // {key, checksum}
  if (found.entries.size() != keys.size()) {
    st = absl::InternalError(absl::StrCat("daemon answered ", found.entries.size(),
                                          " lookup entries for ", keys.size(), " keys"));
  } else {
    for (size_t i = 0; i < keys.size(); ++i) {
      const BlockInfo& e = found.entries[i];
      if (!e.found) {
        statuses[i] = absl::NotFoundError("not stored");
      } else if (e.size != dst[i].size()) {
        statuses[i] = absl::InvalidArgumentError(absl::StrCat(
            "buffer ", i, " has ", dst[i].size(), " bytes but block ",
            KeyToHex(keys[i]), " has ", e.size));
        // All or nothing: the call fails before any buffer is written.
        if (all_or_nothing) st = statuses[i];
      }
    }
    if (st.ok()) ReadInto(ns, keys, dst, found, statuses, corrupt);
  }
  if (found.pin_id != 0) {
    // A daemon that did not answer the read would not answer the unpin
    // either: the call would wait another rpc_timeout. The unpin is owed
    // (retried once the daemon answers) instead.
    const bool answering = std::none_of(
        statuses.begin(), statuses.end(),
        [&](const absl::Status& s) { return DaemonNotAnswering(s); });
    if (answering) {
      ReleaseOwnPin(found.pin_id);
    } else {
      OweUnpin(found.pin_id);
    }
  }
  // Once unpinned: the daemon keeps a corrupt block a reader pins.
  ReportCorrupt(ns, std::move(corrupt));
  RETURN_IF_ERROR(st);
  return statuses;
}

void Client::ReadInto(absl::string_view ns,
                      absl::Span<const absl::string_view> keys,
                      absl::Span<const absl::Span<char>> dst,
                      const LookupReply& found,
                      std::vector<absl::Status>& statuses,
                      std::vector<std::pair<std::string, uint64_t>>& corrupt) {
  // The blocks to read: found, with a buffer of their size.
  std::vector<size_t> want;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (found.entries[i].found && statuses[i].ok()) want.push_back(i);
  }
  if (want.empty()) return;
  v1::ReadRequest req;
  req.set_namespace_(std::string(ns));
  for (size_t i : want) req.add_keys(std::string(keys[i]));
  req.set_looked_up(true);  // `found` came of a Lookup: counted there
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  std::unique_ptr<grpc::ClientReader<v1::ReadResponse>> reader =
      stub_->Read(&ctx, req);
  // The block being received: want[cur], `off` bytes so far, its checksum.
  // Blocks before want[cur] are verified (their status stays OK).
  size_t cur = 0;
  bool started = false;
  uint64_t off = 0;
  uint64_t checksum = 0;
  auto finish_block = [&]() -> absl::Status {
    absl::Span<char> b = dst[want[cur]];
    if (off != b.size()) {
      return absl::DataLossError(absl::StrCat("block ", KeyToHex(keys[want[cur]]),
                                              " has ", off, " of ", b.size(), " bytes"));
    }
    if (BlockChecksum(b.data(), b.size()) != checksum) {
      corrupt.emplace_back(keys[want[cur]], checksum);
      return absl::DataLossError(absl::StrCat(
          "block ", KeyToHex(keys[want[cur]]), " fails its checksum"));
    }
    return absl::OkStatus();
  };
  // The stream stopped at want[cur] (its status `st`): the blocks after it
  // were not read (Aborted for those when the stream itself was fine, so
  // that one corrupt block does not count as several).
  auto fail_from = [&](size_t from, const absl::Status& st) {
    for (size_t j = from; j < want.size(); ++j) {
      if (j == from) {
        statuses[want[j]] = st;
        continue;
      }
      const absl::StatusCode code =
          absl::IsDataLoss(st) ? absl::StatusCode::kAborted : st.code();
      statuses[want[j]] = absl::Status(
          code, absl::StrCat("not read: the stream stopped before it: ", st.message()));
    }
  };
  auto fail = [&](absl::Status st) {
    ctx.TryCancel();
    (void)reader->Finish();
    fail_from(cur, st);
  };
  v1::ReadResponse msg;
  while (reader->Read(&msg)) {
    if (msg.has_header()) {
      if (started) {
        absl::Status done = finish_block();
        if (!done.ok()) return fail(done);
        ++cur;
      }
      started = true;
      if (cur >= want.size()) {  // every block asked for is verified
        ctx.TryCancel();
        (void)reader->Finish();
        return;
      }
      size_t i = want[cur];
      if (msg.header().key() != keys[i] || msg.header().size() != dst[i].size()) {
        return fail(absl::DataLossError(absl::StrCat(
            "daemon sent block ", KeyToHex(msg.header().key()), " of ",
            msg.header().size(), " bytes where ", KeyToHex(keys[i]), " of ",
            dst[i].size(), " bytes was expected")));
      }
      off = 0;
      checksum = msg.header().checksum();
    } else if (!started) {
      return fail(absl::DataLossError("daemon sent data before a header"));
    }
    absl::Span<char> b = dst[want[cur]];
    if (msg.data().size() > b.size() - off) {
      return fail(absl::DataLossError(absl::StrCat(
          "block ", KeyToHex(keys[want[cur]]), " overflows its ", b.size(), " bytes")));
    }
    std::memcpy(b.data() + off, msg.data().data(), msg.data().size());
    off += msg.data().size();
  }
  const absl::Status end = FromRpc(reader->Finish());
  if (!started) {
    fail_from(0, end.ok() ? absl::DataLossError("stream carried no blocks") : end);
    return;
  }
  // The block in progress when the stream ended is complete only if it
  // passes its checks; the stream's own error counts for what follows.
  if (absl::Status done = finish_block(); !done.ok()) {
    fail_from(cur, end.ok() ? done : end);
    return;
  }
  if (!end.ok()) {
    fail_from(cur + 1, end);
  } else if (cur + 1 != want.size()) {
    fail_from(cur + 1, absl::DataLossError(absl::StrCat(
                           "stream carried ", cur + 1, " of ", want.size(), " blocks")));
  }
}

absl::StatusOr<v1::EvictResponse> Client::Evict(
    absl::string_view ns, absl::Span<const absl::string_view> keys, bool all) {
  v1::EvictRequest req;
  req.set_namespace_(std::string(ns));
  for (absl::string_view k : keys) req.add_keys(std::string(k));
  req.set_all(all);
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::EvictResponse resp;
  RETURN_IF_ERROR(FromRpc(stub_->Evict(&ctx, req, &resp)));
  return resp;
}

absl::StatusOr<v1::StatsResponse> Client::Stats() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::StatsResponse resp;
  RETURN_IF_ERROR(FromRpc(stub_->Stats(&ctx, v1::StatsRequest(), &resp)));
  return resp;
}

absl::StatusOr<v1::ListNamespacesResponse> Client::ListNamespaces() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ListNamespacesResponse resp;
  RETURN_IF_ERROR(FromRpc(
      stub_->ListNamespaces(&ctx, v1::ListNamespacesRequest(), &resp)));
  return resp;
}

// ---- UCX data plane ---------------------------------------------------------

absl::Status Client::data_plane_status() {
  absl::MutexLock lock(&mu_);
  return ucx_status_;
}

absl::Status Client::RegisterBuffer(void* base, size_t size) {
  if (ucx_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no UCX in this client: ", data_plane_status().ToString()));
  }
  if (base != nullptr && size > 0 && IsRegistered(base, size)) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegion> region,
                   ucx_->context->Register(base, size));
  absl::MutexLock lock(&ucx_->mu);
  ucx_->NewSlot().region = std::move(region);
  return absl::OkStatus();
}

bool Client::IsRegistered(const void* base, size_t size) {
  if (ucx_ == nullptr) return false;
  absl::MutexLock lock(&ucx_->mu);
  return std::any_of(ucx_->buffers.begin(), ucx_->buffers.end(),
                     [&](const Ucx::Buffer& b) {
                       return b.region != nullptr && !b.freed &&
                              b.region->Contains(base, size);
                     });
}

absl::StatusOr<absl::Span<char>> Client::AllocateBuffer(size_t size) {
  if (ucx_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no UCX in this client: ", data_plane_status().ToString()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegion> region,
                   ucx_->context->Allocate(size));
  absl::Span<char> bytes(region->base(), region->size());
  absl::MutexLock lock(&ucx_->mu);
  Ucx::Buffer& slot = ucx_->NewSlot();
  slot.region = std::move(region);
  slot.allocated = true;
  return bytes;
}

absl::Status Client::FreeBuffer(absl::Span<char> buffer) {
  if (ucx_ == nullptr) {
    return absl::NotFoundError("no UCX in this client: nothing was allocated");
  }
  std::unique_ptr<MemoryRegion> region;
  {
    absl::MutexLock lock(&ucx_->mu);
    auto it = std::find_if(
        ucx_->buffers.begin(), ucx_->buffers.end(), [&](const Ucx::Buffer& b) {
          return b.region != nullptr && b.allocated && !b.freed &&
                 b.region->base() == buffer.data() && b.region->size() == buffer.size();
        });
    if (it == ucx_->buffers.end()) {
      return absl::NotFoundError(
          "not a buffer AllocateBuffer returned, or freed already");
    }
    it->freed = true;
    // A transfer may still reach it: kept (unused) until the client goes.
    if (it->late_access) return absl::OkStatus();
    region = std::move(it->region);  // the slot is free now
  }
  // Unregistered and unmapped outside ucx_->mu (ucp_mem_unmap: the context
  // is thread-safe, UCP_PARAM_FIELD_MT_WORKERS_SHARED). No op uses it
  // (REQUIRES), and none can reach it late (late_access is set before an
  // op that could is made ready), so no worker touches it any more.
  region.reset();
  return absl::OkStatus();
}

void Client::MarkLateAccess(absl::Span<const size_t> buffers) {
  if (buffers.empty()) return;
  absl::MutexLock lock(&ucx_->mu);
  for (size_t b : buffers) ucx_->buffers[b].late_access = true;
}

void Client::DropSession(uint64_t session) {
  {
    absl::MutexLock lock(&mu_);
    if (session_id_ == session) session_id_ = 0;
  }
  DisconnectRequests(session);
}

void Client::MaybeRetryUcx() {
  absl::MutexLock lock(&mu_);
  if (session_id_ == 0 || ucx_status_.ok() || absl::Now() < ucx_retry_at_)
    return;
  // Not while a pinning lookup is in flight in it (its pin is not in
  // pin_sessions_ yet): the next transfer looks again.
  if (pinning_lookups_ > 0) return;
  for (const auto& [pin, pinned_in] : pin_sessions_) {
    if (pinned_in == session_id_) {
      // Not while it holds the caller's pins.
      ucx_retry_at_ = absl::Now() + ucx_retry_wait_;
      return;
    }
  }
  ucx_retry_at_ = absl::InfiniteFuture();  // set again by the next OpenSession
  session_id_ = 0;  // abandoned (AbandonSession), under the same hold of mu_
}

void Client::AbandonSession(uint64_t session) {
  absl::MutexLock lock(&mu_);
  if (session_id_ == session) session_id_ = 0;
}

void Client::DisconnectRequests(uint64_t session) {
  if (ucx_ == nullptr) return;
  std::shared_ptr<Link> link = LinkOf(session);
  if (link != nullptr && link->requests != nullptr) {
    link->requests->Disconnect(session);
  }
}

namespace {

// Block i's outcome in a PushBlocks / PullBlocks reply that ended with `st`.
absl::Status BlockOutcome(
    const absl::Status& st,
    const google::protobuf::RepeatedPtrField<v1::BlockTransfer>& blocks,
    size_t i) {
  if (!st.ok()) return st;
  if (i >= static_cast<size_t>(blocks.size())) {
    return absl::InternalError("the daemon's reply is short of blocks");
  }
  const v1::BlockTransfer& t = blocks[static_cast<int>(i)];
  return absl::Status(static_cast<absl::StatusCode>(t.code()), t.message());
}

// The daemon no longer has the session (restart, expiry, closed when its
// endpoint failed): a new one is needed. A whole request's NOT_FOUND means
// only that (a missing block is a per-block NOT_FOUND; a namespace that
// may not be created is FAILED_PRECONDITION, as is a draining daemon's
// refusal of puts: opening sessions again would not help).
bool SessionGone(const absl::Status& st) { return absl::IsNotFound(st); }

// A whole request's status as each block's: a session the daemon no
// longer has (a restart, an expired lease) says nothing of the keys, and a
// per-block NOT_FOUND says "not stored" (GetInto's false, the connectors'
// miss). ABORTED: the daemon answered (not UNAVAILABLE, which the
// connectors' circuit breakers take for a daemon that is down), nothing
// was transferred, and the next call, on a new session, may succeed.
absl::Status AsBlockStatus(const absl::Status& st) {
  if (!SessionGone(st)) return st;
  return absl::AbortedError(absl::StrCat(
      "the daemon no longer has this client's session (", st.message(),
      "): nothing transferred; the next call opens a new one"));
}

// A reply that came over UCX: its status, and `resp` parsed from `body`.
absl::Status ParseReply(const absl::Status& st, absl::string_view body,
                        google::protobuf::Message& resp) {
  if (!st.ok()) return st;
  if (!resp.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::InternalError("malformed reply from kvdepotd");
  }
  return absl::OkStatus();
}

// Ends a GetIntoAsync op from the daemon's answer (`st`, and when OK
// state.push_resp): each block's status, its bytes in out[i] checked against
// its checksum unless the daemon checked them as it copied them in place.
void FinishGet(TransferOp::State& state, const absl::Status& st,
               absl::Span<const absl::Span<char>> out) {
  const auto& blocks = state.push_resp.blocks();
  std::vector<std::pair<std::string, uint64_t>> corrupt;
  for (size_t i = 0; i < out.size(); ++i) {
    absl::Status s = BlockOutcome(AsBlockStatus(st), blocks, i);
    if (s.ok()) {
      const v1::BlockTransfer& t = blocks[static_cast<int>(i)];
      if (t.size() != out[i].size()) {
        s = absl::DataLossError(absl::StrCat("block ", i, " has ", t.size(),
                                             " bytes, its buffer ",
                                             out[i].size()));
      } else if (!t.checked_in_place() &&
                 BlockChecksum(out[i].data(), out[i].size()) != t.checksum()) {
        s = absl::DataLossError(absl::StrCat(
            "block ", i, " does not match its checksum after transfer"));
        if (static_cast<int>(i) < state.push_req.keys_size()) {
          corrupt.emplace_back(state.push_req.keys(static_cast<int>(i)),
                               t.checksum());
        }
      }
    }
    state.statuses[i] = std::move(s);
  }
  if (!corrupt.empty() && state.reports != nullptr) {
    state.reports->Send(state.push_req.namespace_(), std::move(corrupt));
  }
  state.reports.reset();  // a TransferOp kept long keeps no channel alive
  state.Publish();
}

// A block the daemon says it checked as it copied it in place is taken
// unhashed only where this client registered its buffer as copied in place
// (`in_place`, per block): anything else (a daemon's bug, a reply for other
// buffers) is hashed here as any transfer is.
void TrustInPlaceChecksOnlyWhereCopiedInPlace(v1::PushBlocksResponse& resp,
                                             const std::vector<bool>& in_place) {
  for (int i = 0; i < resp.blocks_size(); ++i) {
    if (resp.blocks(i).checked_in_place() &&
        (static_cast<size_t>(i) >= in_place.size() || !in_place[i])) {
      resp.mutable_blocks(i)->set_checked_in_place(false);
    }
  }
}

// Whether FinishGet would hash a block (worth moving off a progress thread).
bool GetNeedsHashing(const absl::Status& st, const v1::PushBlocksResponse& resp) {
  if (!st.ok()) return false;
  for (const v1::BlockTransfer& t : resp.blocks()) {
    if (t.code() == 0 && !t.checked_in_place()) return true;
  }
  return false;
}

// Whether the daemon may still write blocks of a get that ended with `st`
// (when OK, with the outcomes in `resp`) into this client's buffers after
// this: a transfer that failed on its way, or a request whose answer did
// not come. The daemon's own copies (`in_place`) are done before it
// answers; UCX's are not: over shared memory UCX 1.13 cannot take back
// writes it has queued (transport/README, caveat 2), and over TCP they
// may still be in the socket.
bool MayLandLate(const absl::Status& st, const v1::PushBlocksResponse& resp,
                 const std::vector<bool>& in_place) {
  if (std::all_of(in_place.begin(), in_place.end(), [](bool b) { return b; })) {
    return false;
  }
  if (!st.ok()) return MaybeUnanswered(st);
  for (int i = 0; i < resp.blocks_size(); ++i) {
    if (static_cast<size_t>(i) < in_place.size() && !in_place[i] &&
        MaybeUnanswered(absl::Status(
            static_cast<absl::StatusCode>(resp.blocks(i).code()), ""))) {
      return true;
    }
  }
  return false;
}

// How long after its copy deadline an op with blocks in buffers the daemon
// copies itself (in place) is made ready when it ended without the
// daemon's answer: the daemon starts no such copy after that deadline and
// checks it before each MiB of one, so this covers a daemon thread
// descheduled within a MiB (client.h, AllocateBuffer).
constexpr absl::Duration kLateCopySlack = absl::Seconds(1);

bool AnyInPlace(const std::vector<bool>& in_place) {
  return std::find(in_place.begin(), in_place.end(), true) != in_place.end();
}

// The buffers (`buffers`: block i lies in buffers[i]) that a transfer of an
// op may still reach after the op ended with `st` (`answered`: the daemon's
// reply; when OK, with the per-block outcomes `blocks`): those of the blocks
// this client's worker moves (not `in_place`), when the op ended without
// the answer or with a status of a transfer that may still be on its way
// (MaybeUnanswered). The daemon may then still read a put's source through
// the worker, which no put fences; a get's blocks are fenced (MayLandLate),
// and are counted all the same.
std::vector<size_t> LateBuffers(
    bool answered, const absl::Status& st,
    const google::protobuf::RepeatedPtrField<v1::BlockTransfer>& blocks,
    const std::vector<bool>& in_place, const std::vector<size_t>& buffers) {
  std::vector<size_t> late;
  for (size_t i = 0; i < in_place.size() && i < buffers.size(); ++i) {
    if (in_place[i]) continue;
    if (!answered || MaybeUnanswered(BlockOutcome(st, blocks, i))) {
      late.push_back(buffers[i]);
    }
  }
  return late;
}

// Ends a PutFromAsync op from the daemon's answer (state.pull_resp when OK).
void FinishPut(TransferOp::State& state, const absl::Status& st) {
  for (size_t i = 0; i < state.statuses.size(); ++i) {
    absl::Status s =
        BlockOutcome(AsBlockStatus(st), state.pull_resp.blocks(), i);
    if (absl::IsAlreadyExists(s)) {  // stored before: not a failure
      s = absl::OkStatus();
      state.existed[i] = true;
    }
    state.statuses[i] = std::move(s);
  }
  state.Publish();
}

}  // namespace

bool Client::DaemonNotAnswering(const absl::Status& st) const {
  // Trying the daemon again over another path would only wait as long
  // again. A deadline passed: it did not answer (a stalled daemon keeps its
  // connections up). UNAVAILABLE over a channel that is up is the daemon's
  // own answer (its side of the UCX endpoint failed, it is stopping): the
  // gRPC byte path may still serve.
  if (absl::IsDeadlineExceeded(st)) return true;
  return absl::IsUnavailable(st) && channel_->GetState(false) != GRPC_CHANNEL_READY;
}

absl::StatusOr<Client::UcxTarget> Client::PrepareUcx(
    absl::Span<const absl::Span<const char>> ranges, bool* unreachable) {
  *unreachable = false;
  if (ucx_ == nullptr) return data_plane_status();
  // Find every range's buffer before anything goes to the daemon.
  std::vector<size_t> buffer_of(ranges.size());
  {
    absl::MutexLock lock(&ucx_->mu);
    for (size_t i = 0; i < ranges.size(); ++i) {
      size_t b = 0;
      while (b < ucx_->buffers.size() &&
             (ucx_->buffers[b].region == nullptr || ucx_->buffers[b].freed ||
              !ucx_->buffers[b].region->Contains(ranges[i].data(), ranges[i].size()))) {
        ++b;
      }
      if (b == ucx_->buffers.size() || ranges[i].empty()) {
        return absl::NotFoundError(absl::StrCat(
            "block ", i, " is not in a registered buffer (RegisterBuffer)"));
      }
      buffer_of[i] = b;
    }
  }
  UcxTarget target;
  MaybeRetryUcx();
  absl::StatusOr<uint64_t> session = EnsureSession();
  if (!session.ok()) {
    *unreachable = DaemonNotAnswering(session.status());
    return session.status();
  }
  target.session = *session;
  RETURN_IF_ERROR(data_plane_status());
  target.link = LinkOf(target.session);
  if (target.link == nullptr) {  // replaced since (a get failed meanwhile)
    DropSession(target.session);
    return absl::UnavailableError("the session's UCX worker was replaced");
  }
  std::vector<size_t> wanted = buffer_of;
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  absl::flat_hash_map<size_t, std::pair<uint32_t, bool>> ids;
  RETURN_IF_ERROR(RegisterInSession(target.session, wanted, &ids, unreachable));
  target.buffers = buffer_of;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto [daemon_id, in_place] = ids.at(buffer_of[i]);
    target.in_place.push_back(in_place);
    v1::BufferRange r;
    r.set_buffer_id(daemon_id);
    r.set_address(reinterpret_cast<uintptr_t>(ranges[i].data()));
    r.set_size(ranges[i].size());
    target.ranges.push_back(std::move(r));
  }
  return target;
}

absl::Status Client::RegisterInSession(
    uint64_t session, absl::Span<const size_t> wanted,
    absl::flat_hash_map<size_t, std::pair<uint32_t, bool>>* ids,
    bool* unreachable) {
  const absl::Time arrived = absl::Now();
  // The buffers this call registers, and those another call registers now.
  struct Registration {
    size_t buffer;
    // This call's registration is the one others of the session wait for
    // (the buffer's `registering`); false when another session's was in
    // flight already: its outcome is then this call's alone.
    bool published;
    v1::RegisterBufferRequest req;
    absl::Status status;
    v1::RegisterBufferResponse resp;
  };
  std::vector<Registration> mine;
  std::vector<size_t> theirs;
  {
    absl::MutexLock lock(&ucx_->mu);
    for (size_t b : wanted) {
      Ucx::Buffer& buf = ucx_->buffers[b];
      if (buf.session == session) {
        (*ids)[b] = {buf.daemon_id, buf.in_place};
      } else if (buf.registering == session) {
        theirs.push_back(b);
      } else {
        // First use in this session: hand the daemon the buffer's key.
        // Another session's registration in flight (an ended session's
        // last caller, or the next session's first) keeps the buffer: its
        // waiters wait for it, not for this one.
        const bool publish = buf.registering == 0;
        if (publish) buf.registering = session;
        Registration& r = mine.emplace_back();
        r.buffer = b;
        r.published = publish;
        r.req.set_session_id(session);
        r.req.set_packed_rkey(buf.region->packed_rkey());
        r.req.set_address(buf.region->address());
        r.req.set_size(buf.region->size());
      }
    }
  }
  // Outside ucx_->mu: other calls go on meanwhile. After a failure the
  // rest fail with it (a daemon that does not answer one would not answer
  // the next either).
  absl::Status failed;
  for (Registration& r : mine) {
    if (!failed.ok()) {
      r.status = failed;
      continue;
    }
    grpc::ClientContext ctx;
    PrepareContext(&ctx);
    r.status = FromRpc(stub_->RegisterBuffer(&ctx, r.req, &r.resp));
    failed = r.status;
  }
  {
    absl::MutexLock lock(&ucx_->mu);
    for (const Registration& r : mine) {
      Ucx::Buffer& buf = ucx_->buffers[r.buffer];
      if (r.status.ok()) (*ids)[r.buffer] = {r.resp.buffer_id(), r.resp.copied_in_place()};
      if (!r.published) continue;
      buf.registering = 0;
      if (r.status.ok()) {
        buf.session = session;
        buf.daemon_id = r.resp.buffer_id();
        buf.in_place = r.resp.copied_in_place();
      } else {
        buf.failed_session = session;
        buf.failure = r.status;
        buf.failed_at = absl::Now();
      }
    }
    // Waited for only now: this call never waits while others wait for it.
    for (size_t b : theirs) {
      if (!failed.ok()) break;
      auto settled = [this, b, session]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ucx_->mu) {
        return ucx_->buffers[b].registering != session;
      };
      if (!ucx_->mu.AwaitWithDeadline(absl::Condition(&settled),
                                      arrived + options_.rpc_timeout)) {
        failed = absl::DeadlineExceededError(absl::StrCat(
            "kvdepotd did not take a buffer's registration within ",
            absl::FormatDuration(options_.rpc_timeout)));
        break;
      }
      const Ucx::Buffer& buf = ucx_->buffers[b];
      if (buf.session == session) {
        (*ids)[b] = {buf.daemon_id, buf.in_place};
      } else if (buf.failed_session == session && buf.failed_at >= arrived) {
        failed = buf.failure;  // the registration waited for failed
      } else {
        // Its session was dropped meanwhile, and a caller of the next one
        // registered the buffer in that one before this call woke.
        failed = absl::NotFoundError(
            "the session ended while a buffer was being registered in it");
      }
    }
  }
  if (failed.ok()) return failed;
  *unreachable = DaemonNotAnswering(failed);
  // NOT_FOUND: the session is gone. UNAVAILABLE from a daemon that does
  // answer: its side of the session's UCX endpoint failed or is stopping;
  // the next call opens a new session rather than fail on this one.
  // RESOURCE_EXHAUSTED: the session has registered as many buffers as the
  // daemon allows (max_buffers_per_session). The daemon keeps a buffer
  // registered (and a co-located one mapped) for the session's life, freed
  // ones too, so a client that allocates and frees buffers (a staging pool
  // that grows) gets there, and every new buffer then took the gRPC path
  // for good. A new session starts with none: drop this one (its lease
  // ends it, with what it holds) -- at most once a minute, so that a client
  // using more buffers at once than that does not open session after
  // session. Its calls in flight, which the daemon still serves, finish
  // (AbandonSession): rotating is routine, not a failure.
  bool rotate = false;
  if (absl::IsResourceExhausted(failed)) {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (session_id_ == session &&
        now - buffers_rotated_at_ >= kBufferRotationGap) {
      buffers_rotated_at_ = now;
      rotate = true;
    }
  }
  if (rotate) {
    AbandonSession(session);
  } else if (SessionGone(failed) ||
             (absl::IsUnavailable(failed) && !*unreachable)) {
    DropSession(session);
  }
  return failed;
}

absl::Duration Client::DaemonTransferTimeout() const {
  // Well inside this client's own wait (an RPC's deadline, or
  // UcxRequestTimeout): a daemon copying into an AllocateBuffer buffer
  // itself starts no copy after it (counted from when the request was made:
  // CopyDeadline), and one in progress then ends before this client stops
  // waiting. An op that ends without the daemon's answer is made ready
  // only after that deadline (PublishAfter).
  const absl::Duration half = options_.rpc_timeout / 2;
  // Zero (or less): no limit of its own; the daemon's applies, within half.
  return options_.transfer_timeout <= absl::ZeroDuration()
             ? half
             : std::min(options_.transfer_timeout, half);
}

absl::Duration Client::UcxRequestTimeout() const {
  // The daemon bounds the transfers by DaemonTransferTimeout; a reply it
  // cannot send (its endpoint to this client failed, the session ended
  // meanwhile) is not worth waiting a whole rpc_timeout for.
  return std::min(options_.rpc_timeout, DaemonTransferTimeout() + absl::Seconds(5));
}

absl::Time Client::CopyDeadline() const {
  return absl::Now() + DaemonTransferTimeout();
}

uint32_t Client::TransferTimeoutMs() const {
  return static_cast<uint32_t>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(DaemonTransferTimeout())));
}

absl::Time Client::PublishAfter(bool answered, const std::vector<bool>& in_place,
                                absl::Time copy_deadline) {
  if (answered || !AnyInPlace(in_place)) return absl::InfinitePast();
  return copy_deadline + kLateCopySlack;
}

void Client::PublishAt(Timers& timers, absl::Time at,
                       absl::AnyInvocable<void() &&> publish) {
  if (at <= absl::Now()) return std::move(publish)();
  timers.At(at, std::move(publish));
}

TransferOp Client::FailedOp(size_t n, const absl::Status& status) {
  auto state = std::make_shared<TransferOp::State>(n, "none");
  for (absl::Status& s : state->statuses) s = status;
  state->Publish();
  return TransferOp(std::move(state));
}


TransferOp Client::GetIntoAsync(absl::string_view ns,
                                absl::Span<const absl::string_view> keys,
                                absl::Span<const absl::Span<char>> dst,
                                bool prefix) {
  return GetIntoAsyncImpl(ns, keys, dst, prefix, /*all_or_nothing=*/false);
}

TransferOp Client::GetIntoAsyncImpl(absl::string_view ns,
                                    absl::Span<const absl::string_view> keys,
                                    absl::Span<const absl::Span<char>> dst,
                                    bool prefix, bool all_or_nothing) {
  if (keys.size() != dst.size()) {
    return FailedOp(keys.size(), absl::InvalidArgumentError(absl::StrCat(
                                     "GetIntoAsync: ", keys.size(),
                                     " keys but ", dst.size(), " buffers")));
  }
  absl::Status valid = ValidateNamespace(ns);
  for (size_t i = 0; valid.ok() && i < keys.size(); ++i) valid = ValidateKey(keys[i]);
  if (!valid.ok()) return FailedOp(keys.size(), valid);
  // Nothing to get: no session to open (a wait on a daemon not answering).
  if (keys.empty()) return FailedOp(0, absl::OkStatus());
  std::vector<absl::Span<const char>> ranges(dst.begin(), dst.end());
  bool unreachable = false;
  absl::StatusOr<UcxTarget> target = PrepareUcx(ranges, &unreachable);
  // The daemon did not answer in time: a miss, not another wait on the
  // gRPC path.
  if (!target.ok() && unreachable) return FailedOp(keys.size(), target.status());
  if (!target.ok()) {
    // The gRPC byte path, done here.
    auto state = std::make_shared<TransferOp::State>(keys.size(), "grpc");
    absl::StatusOr<std::vector<absl::Status>> got =
        GetIntoGrpcPerKey(ns, keys, dst, prefix, all_or_nothing);
    bool open = true;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!got.ok()) {
        state->statuses[i] = AsBlockStatus(got.status());
      } else if (!open) {
        state->statuses[i] = absl::NotFoundError("not stored");
      } else {
        state->statuses[i] = (*got)[i];
        // With `prefix`, a miss ends the prefix (nothing after it was read).
        if (prefix && absl::IsNotFound(state->statuses[i])) open = false;
      }
    }
    state->Publish();
    return TransferOp(std::move(state));
  }
  auto state = std::make_shared<TransferOp::State>(keys.size(), "ucx");
  state->reports = reports_;
  v1::PushBlocksRequest& req = state->push_req;
  req.set_session_id(target->session);
  req.set_namespace_(std::string(ns));
  for (size_t i = 0; i < keys.size(); ++i) {
    req.add_keys(std::string(keys[i]));
    *req.add_destinations() = std::move(target->ranges[i]);
  }
  req.set_prefix(prefix);
  req.set_timeout_ms(TransferTimeoutMs());
  const absl::Time copy_deadline = CopyDeadline();
  req.set_deadline_unix_us(absl::ToUnixMicros(copy_deadline));
  std::vector<absl::Span<char>> out(dst.begin(), dst.end());
  const uint64_t session = target->session;
  TransferOp op(state);
  internal::TestSyncPoint("Client::GetIntoAsync:Prepared");
  // A failure that may leave the daemon's writes in flight is told only
  // once the worker they would come through is fenced, and, for blocks
  // the daemon copies itself, once it copies no more (PublishAfter): the
  // caller owns the buffers again when the op is ready.
  Link* link = target->link.get();
  // A request over kMaxRequestPayload (a batch of very many long keys)
  // would be refused over UCX: it goes as a gRPC call.
  if (link->requests != nullptr && link->requests->Serves(session) &&
      req.ByteSizeLong() <= kMaxRequestPayload) {
    // Over UCX: the reply comes on the progress thread; blocks to hash are
    // checked by a waiting caller, or on the verify pool. `link` outlives
    // its requests' callbacks.
    absl::Status sent = link->requests->Send(
        session, RequestMethod::kPushBlocks, req.SerializeAsString(),
        absl::Now() + UcxRequestTimeout(),
        [this, state, session, out, link, in_place = target->in_place,
         buffers = target->buffers, copy_deadline,
         timers = timers_](const absl::Status& reply, absl::string_view body) mutable {
          const bool answered = UcxRequests::Answered(reply);
          absl::Status st = ParseReply(UcxRequests::WithoutAnswerMark(reply), body,
                                       state->push_resp);
          TrustInPlaceChecksOnlyWhereCopiedInPlace(state->push_resp, in_place);
          if (SessionGone(st)) DropSession(session);
          // Before the op can be ready (and its buffers freed).
          MarkLateAccess(
              LateBuffers(answered, st, state->push_resp.blocks(), in_place, buffers));
          // (`out` copied: the verify pool's step below needs it too.)
          auto finish = [state, st, out, timers,
                         at = PublishAfter(answered, in_place, copy_deadline)]() mutable {
            PublishAt(*timers, at, [state, st, out = std::move(out)] {
              FinishGet(*state, st, out);
            });
          };
          if (MayLandLate(st, state->push_resp, in_place)) {
            return ReplaceLink(*link, session, std::move(finish));
          }
          if (!GetNeedsHashing(st, state->push_resp)) return std::move(finish)();
          RunLastStep(*ucx_->verify_pool, *state,
                      [state, st, out = std::move(out)] {
                        FinishGet(*state, st, out);
                      });
        });
    if (sent.ok()) return op;
    // Not sent (the connection went meanwhile): as a gRPC call.
  }
  if (Fenced(*link)) {
    // The link was fenced since this op took it (another transfer failed
    // on it, and its session was dropped): the daemon would push these
    // blocks through a worker no one progresses, and the op would wait
    // for the transfer's deadline. A miss now; the next op opens a
    // session on a new link.
    FinishGet(*state, FencedMeanwhile(), out);
    return op;
  }
  PrepareContext(&state->ctx);
  if (!calls_->Begin(&state->ctx)) {  // the client is going: nothing sent
    FinishGet(*state, absl::CancelledError("kvdepot client closed"), out);
    return op;
  }
  stub_->async()->PushBlocks(
      &state->ctx, &state->push_req, &state->push_resp,
      [this, state, session, out = std::move(out), link = std::move(target->link),
       in_place = std::move(target->in_place), buffers = std::move(target->buffers),
       copy_deadline, timers = timers_, calls = calls_](grpc::Status reply) mutable {
        const absl::Status st = FromRpc(reply);
        TrustInPlaceChecksOnlyWhereCopiedInPlace(state->push_resp, in_place);
        if (SessionGone(st)) DropSession(session);
        MarkLateAccess(LateBuffers(!MaybeUnanswered(st), st, state->push_resp.blocks(),
                                   in_place, buffers));
        auto finish = [state, st, out = std::move(out), timers,
                       at = PublishAfter(!MaybeUnanswered(st), in_place,
                                         copy_deadline)]() mutable {
          PublishAt(*timers, at, [state, st, out = std::move(out)] {
            FinishGet(*state, st, out);
          });
        };
        if (MayLandLate(st, state->push_resp, in_place)) {
          // Not on a progress thread: the fence is done when it returns.
          ReplaceLink(*link, session, std::move(finish));
        } else {
          std::move(finish)();
        }
        // Done with the Client: what it owns is not released from here.
        link.reset();
        calls->End(&state->ctx);
      });
  return op;
}

TransferOp Client::PutFromAsync(absl::string_view ns,
                                absl::Span<const BlockToPut> blocks) {
  absl::Status valid = ValidateNamespace(ns);
  for (size_t i = 0; valid.ok() && i < blocks.size(); ++i) {
    valid = ValidateKey(blocks[i].key);
  }
  if (!valid.ok()) return FailedOp(blocks.size(), valid);
  if (blocks.empty()) return FailedOp(0, absl::OkStatus());
  std::vector<absl::Span<const char>> ranges;
  ranges.reserve(blocks.size());
  for (const BlockToPut& b : blocks) ranges.emplace_back(b.bytes.data(), b.bytes.size());
  bool unreachable = false;
  absl::StatusOr<UcxTarget> target = PrepareUcx(ranges, &unreachable);
  // As for gets: a daemon that did not answer in time is not waited for
  // again over a Write stream.
  if (!target.ok() && unreachable) return FailedOp(blocks.size(), target.status());
  if (!target.ok()) {
    auto state = std::make_shared<TransferOp::State>(blocks.size(), "grpc");
    absl::StatusOr<std::vector<PutResult>> put = PutGrpc(ns, blocks);
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!put.ok()) {
        state->statuses[i] = put.status();
      } else {
        state->existed[i] = (*put)[i] == PutResult::kAlreadyExists;
      }
    }
    state->Publish();
    return TransferOp(std::move(state));
  }
  auto state = std::make_shared<TransferOp::State>(blocks.size(), "ucx");
  v1::PullBlocksRequest& req = state->pull_req;
  req.set_session_id(target->session);
  req.set_namespace_(std::string(ns));
  for (size_t i = 0; i < blocks.size(); ++i) {
    v1::PullSpec* spec = req.add_blocks();
    spec->set_key(std::string(blocks[i].key));
    spec->set_parent_key(std::string(blocks[i].parent));
    if (target->in_place[i] && !options_.always_checksum_puts) {
      spec->set_daemon_checksum(true);  // hashed by the daemon as it copies
    } else {
      spec->set_checksum(BlockChecksum(blocks[i].bytes));
    }
    *spec->mutable_source() = std::move(target->ranges[i]);
  }
  req.set_timeout_ms(TransferTimeoutMs());
  const absl::Time copy_deadline = CopyDeadline();
  req.set_deadline_unix_us(absl::ToUnixMicros(copy_deadline));
  const uint64_t session = target->session;
  TransferOp op(state);
  // No fence for a put that fails: the daemon only reads these buffers,
  // and keeps the slots of reads UCX may still answer (HoldUntilReleased).
  // But a daemon on this host copies blocks of AllocateBuffer memory
  // itself (and with daemon_checksum stores the hash of what it copied):
  // a put that ended without its answer is ready only once the daemon
  // copies no more of them (PublishAfter).
  UcxRequests* requests = target->link->requests.get();
  // As for gets: a request over kMaxRequestPayload goes as a gRPC call.
  if (requests != nullptr && requests->Serves(session) &&
      req.ByteSizeLong() <= kMaxRequestPayload) {
    auto done = [this, state, session, in_place = target->in_place,
                 buffers = target->buffers, copy_deadline,
                 timers = timers_](const absl::Status& reply, absl::string_view body) {
      const bool answered = UcxRequests::Answered(reply);
      const absl::Status st =
          ParseReply(UcxRequests::WithoutAnswerMark(reply), body, state->pull_resp);
      if (SessionGone(st)) DropSession(session);
      // Before the op can be ready (and its buffers freed).
      MarkLateAccess(
          LateBuffers(answered, st, state->pull_resp.blocks(), in_place, buffers));
      PublishAt(*timers, PublishAfter(answered, in_place, copy_deadline),
                [state, st] { FinishPut(*state, st); });
    };
    // The blocks' bytes with the request (ucx_data_requests), unless the
    // daemon copies them in place.
    const bool with_data =
        options_.ucx_data_requests && target->link->data_requests.load() &&
        !AnyInPlace(target->in_place);
    absl::Status sent;
    if (with_data) {
      std::vector<absl::Span<const char>> data;
      data.reserve(blocks.size());
      for (const BlockToPut& b : blocks) data.emplace_back(b.bytes.data(), b.bytes.size());
      sent = requests->SendWithData(session, RequestMethod::kPullBlocks,
                                    req.SerializeAsString(), std::move(data),
                                    absl::Now() + UcxRequestTimeout(), std::move(done));
    } else {
      sent = requests->Send(session, RequestMethod::kPullBlocks,
                            req.SerializeAsString(),
                            absl::Now() + UcxRequestTimeout(), std::move(done));
    }
    if (sent.ok()) return op;
  }
  if (Fenced(*target->link)) {
    // As for gets: the daemon's reads through the fenced worker would
    // wait for the transfer's deadline. Not stored; nothing was sent.
    FinishPut(*state, FencedMeanwhile());
    return op;
  }
  PrepareContext(&state->ctx);
  if (!calls_->Begin(&state->ctx)) {  // the client is going: nothing sent
    FinishPut(*state, absl::CancelledError("kvdepot client closed"));
    return op;
  }
  stub_->async()->PullBlocks(
      &state->ctx, &state->pull_req, &state->pull_resp,
      [this, state, session, in_place = std::move(target->in_place),
       buffers = std::move(target->buffers), copy_deadline, timers = timers_,
       calls = calls_](grpc::Status reply) {
        const absl::Status st = FromRpc(reply);
        if (SessionGone(st)) DropSession(session);
        MarkLateAccess(LateBuffers(!MaybeUnanswered(st), st, state->pull_resp.blocks(),
                                   in_place, buffers));
        PublishAt(*timers, PublishAfter(!MaybeUnanswered(st), in_place, copy_deadline),
                  [state, st] { FinishPut(*state, st); });
        calls->End(&state->ctx);
      });
  return op;
}

}  // namespace kvdepot
