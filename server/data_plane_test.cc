// DataPlane in this process, against a client worker of this process, over
// real UCX (shared memory and TCP on loopback). The sync points of
// data_plane.cc put a client's death at a fixed place in OpenSession.
#include "server/data_plane.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "storage/internal/sync_point.h"
#include "transport/memory_region.h"
#include "transport/request_message.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_test_util.h"
#include "transport/ucx_worker.h"

namespace kvdepot {
namespace {

constexpr size_t kArenaBytes = 8 << 20;

class DataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    void* arena = mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(arena, MAP_FAILED);
    arena_ = static_cast<char*>(arena);
    UcxContextOptions client_options;
    client_options.config = ucx_test::TransportConfig("shm");
    absl::StatusOr<std::unique_ptr<UcxContext>> context =
        UcxContext::Create(client_options);
    if (!context.ok()) GTEST_SKIP() << "no UCX context here: " << context.status();
    client_context_ = *std::move(context);
    absl::StatusOr<std::unique_ptr<UcxWorker>> worker = UcxWorker::Create(*client_context_);
    ASSERT_TRUE(worker.ok()) << worker.status();
    client_worker_ = *std::move(worker);

    StartPlane(PlaneOptions());
  }

  void TearDown() override {
    plane_.reset();
    request_clients_.clear();
    client_worker_.reset();
    if (arena_ != nullptr) munmap(arena_, kArenaBytes);
  }

  static DataPlaneOptions PlaneOptions() {
    DataPlaneOptions options;
    options.ucx = ucx_test::TransportConfig("shm");
    options.workers = 1;
    options.request_workers = 1;
    options.connect_timeout = absl::Seconds(1);
    return options;
  }

  // Replaces plane_ by a data plane with `options`, logging to `sink`
  // (nowhere when null).
  void StartPlane(const DataPlaneOptions& options, spdlog::sink_ptr sink = nullptr) {
    plane_.reset();
    if (sink == nullptr) sink = std::make_shared<spdlog::sinks::null_sink_mt>();
    absl::StatusOr<std::unique_ptr<DataPlane>> plane = DataPlane::Create(
        options, DramRegion{arena_, kArenaBytes},
        [this](SessionId session, const absl::Status&) {
          absl::MutexLock lock(&mu_);
          lost_.push_back(session);
        },
        std::make_shared<spdlog::logger>("test", std::move(sink)));
    ASSERT_TRUE(plane.ok()) << plane.status();
    plane_ = *std::move(plane);
  }

  // Serves plane_'s requests with a handler that answers none of them
  // (a client whose transfers stall): they stay in held_ until Answer.
  void HoldRequests() {
    plane_->ServeRequests([this](DataPlane::Request request) {
      absl::MutexLock lock(&mu_);
      held_.emplace_back(request.session, request.id);
    });
  }

  // Whether the handler got request `id` of `session` (waiting for it, with
  // a bound against a hang).
  bool Held(SessionId session, uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto held = [&] {
      mu_.AssertHeld();
      return std::find(held_.begin(), held_.end(), std::make_pair(session, id)) !=
             held_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&held), absl::Seconds(10));
  }
  size_t held() {
    absl::MutexLock lock(&mu_);
    return held_.size();
  }

  // Replies OK to held request `id` of `session`.
  void Answer(SessionId session, uint64_t id) {
    {
      absl::MutexLock lock(&mu_);
      auto it = std::find(held_.begin(), held_.end(), std::make_pair(session, id));
      ASSERT_NE(it, held_.end()) << "request " << id << " of session " << session;
      held_.erase(it);
    }
    plane_->Reply(session, id, absl::OkStatus(), "answered");
  }
  void AnswerAll() {
    std::vector<std::pair<SessionId, uint64_t>> held;
    {
      absl::MutexLock lock(&mu_);
      held.swap(held_);
    }
    for (const auto& [session, id] : held) {
      plane_->Reply(session, id, absl::OkStatus(), "answered");
    }
  }

  // A client worker that never progresses again (a stalled client): its
  // connections are accepted by the kernel, never answered.
  std::unique_ptr<UcxWorker> StalledClientWorker() {
    absl::StatusOr<std::unique_ptr<UcxWorker>> worker =
        UcxWorker::Create(*client_context_);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return nullptr;
    absl::Notification fenced;
    (*worker)->Fence([&fenced] { fenced.Notify(); });
    fenced.WaitForNotification();
    return *std::move(worker);
  }

  // A client worker of its own, attached as `session` (a client on another
  // host: its requests reach the handler on the request worker's thread),
  // that sends requests as libkvdepot's UcxRequests does, with ids of the
  // test's choosing, and keeps the codes of their replies.
  class RequestClient {
   public:
    // The code of request `id`'s reply, waiting for it (with a bound
    // against a hang); nullopt when none came.
    std::optional<absl::StatusCode> Reply(uint64_t id) {
      absl::MutexLock lock(&mu_);
      auto replied = [&] {
        mu_.AssertHeld();
        return replies_.contains(id);
      };
      if (!mu_.AwaitWithTimeout(absl::Condition(&replied), absl::Seconds(10))) {
        return std::nullopt;
      }
      return replies_[id];
    }
    // The session the reply to request `id` named (after Reply(id)).
    uint64_t ReplySession(uint64_t id) {
      absl::MutexLock lock(&mu_);
      return reply_sessions_[id];
    }
    // Sends request `id` with a body of `bytes` bytes.
    void Send(uint64_t id, size_t bytes) { SendNaming(session_, id, bytes); }
    // The same, naming `session` (perhaps not this client's).
    void SendNaming(SessionId session, uint64_t id, size_t bytes) {
      const RequestHeader header{RequestMethod::kPullBlocks, id, session};
      ASSERT_TRUE(endpoint_
                      ->SendMessage(kRequestMessageId, EncodeRequestHeader(header),
                                    std::string(bytes, 'r'))
                      .ok());
    }
    // Sends PullBlocks request `id` naming `session`, with `data_` as its
    // rendezvous data (libkvdepot's data requests).
    void SendDataNaming(SessionId session, uint64_t id) {
      const RequestHeader header{RequestMethod::kPullBlocks, id, session};
      ASSERT_TRUE(endpoint_
                      ->SendMessageWithData(kDataRequestMessageId,
                                            EncodeDataRequestHeader(header, "body"),
                                            absl::MakeConstSpan(data_),
                                            [](const absl::Status&) {})
                      .ok());
    }

    // Sends PullBlocks request `id` with a body of `bytes` bytes and
    // `data_bytes` of data, eagerly (libkvdepot sends data as rendezvous).
    void SendEagerData(uint64_t id, size_t bytes, size_t data_bytes) {
      const RequestHeader header{RequestMethod::kPullBlocks, id, session_};
      ASSERT_TRUE(endpoint_
                      ->SendMessage(kDataRequestMessageId,
                                    EncodeDataRequestHeader(header, std::string(bytes, 'r')),
                                    std::string(data_bytes, 'd'))
                      .ok());
    }
    // Stops progressing the client's worker for good (connected, unread).
    void Fence() {
      absl::Notification fenced;
      worker_->Fence([&fenced] { fenced.Notify(); });
      fenced.WaitForNotification();
    }

   private:
    friend class DataPlaneTest;
    SessionId session_ = 0;
    // Before worker_: the worker's progress thread stores replies in them
    // until the worker is destroyed (a reply may still come in teardown).
    absl::Mutex mu_;
    absl::flat_hash_map<uint64_t, absl::StatusCode> replies_ ABSL_GUARDED_BY(mu_);
    absl::flat_hash_map<uint64_t, uint64_t> reply_sessions_ ABSL_GUARDED_BY(mu_);
    std::string data_ = std::string(64 << 10, 'd');  // SendDataNaming's
    std::unique_ptr<UcxWorker> worker_;
    std::unique_ptr<UcxEndpoint> endpoint_;  // to the request worker
  };
  // Null (with a failure) when it could not be attached and connected.
  // Not `attach`: a worker without a session of its own, which connects to
  // the request worker of `session` (wiring up the connection itself).
  RequestClient* AttachRequestClient(SessionId session, bool attach = true) {
    auto client = std::make_unique<RequestClient>();
    client->session_ = session;
    absl::StatusOr<std::unique_ptr<UcxWorker>> worker =
        UcxWorker::Create(*client_context_);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return nullptr;
    client->worker_ = *std::move(worker);
    RequestClient* c = client.get();
    absl::Status st = c->worker_->SetMessageHandler(
        kReplyMessageId, [c](absl::string_view header, absl::string_view,
                             const UcxWorker::MessageSender&) {
          std::optional<ReplyHeader> h = DecodeReplyHeader(header);
          if (!h) return;
          absl::MutexLock lock(&c->mu_);
          c->replies_[h->request_id] = h->code;
          c->reply_sessions_[h->request_id] = h->session_id;
        });
    EXPECT_TRUE(st.ok()) << st;
    if (attach) {
      st = plane_->Attach(session, c->worker_->address(), "", std::nullopt);
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok()) return nullptr;
    }
    UcxEndpointOptions options;
    options.peer_error_handling = true;  // as UcxRequests: pairs with the link
    absl::StatusOr<std::unique_ptr<UcxEndpoint>> endpoint = UcxEndpoint::Connect(
        *c->worker_, plane_->RequestAddress(session), std::move(options));
    EXPECT_TRUE(endpoint.ok()) << endpoint.status();
    if (!endpoint.ok()) return nullptr;
    c->endpoint_ = *std::move(endpoint);
    request_clients_.push_back(std::move(client));
    return c;
  }

  // Whether on_lost was called for `session` within `wait`.
  bool ReportedLost(SessionId session, absl::Duration wait) {
    absl::MutexLock lock(&mu_);
    auto reported = [&] {
      mu_.AssertHeld();
      return std::find(lost_.begin(), lost_.end(), session) != lost_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&reported), wait);
  }

  char* arena_ = nullptr;
  std::unique_ptr<UcxContext> client_context_;
  std::unique_ptr<UcxWorker> client_worker_;
  std::unique_ptr<DataPlane> plane_;
  absl::Mutex mu_;
  std::vector<SessionId> lost_ ABSL_GUARDED_BY(mu_);
  // Requests handed to HoldRequests' handler, not yet answered.
  std::vector<std::pair<SessionId, uint64_t>> held_ ABSL_GUARDED_BY(mu_);
  // Destroyed after plane_ (it has endpoints to their workers).
  std::vector<std::unique_ptr<RequestClient>> request_clients_;
};

TEST_F(DataPlaneTest, AColocatedClientLostWhileItsSessionAttachesIsReported) {
  // The client's worker goes once its session endpoint is made and watched,
  // before the session is linked: the monitor reports that loss then (it
  // reports once). It must reach on_lost, not wait for the lease.
  const std::string address = client_worker_->address();
  absl::Notification monitor_reported;
  internal::SyncPointCallback lost("DataPlane::Lost", [&](void* arg) {
    if (*static_cast<SessionId*>(arg) == 7) monitor_reported.Notify();
  });
  internal::SyncPointCallback watched("DataPlane::Attach:Watched", [&](void*) {
    client_worker_.reset();  // its connections close
    // A bound against a hang only: the monitor sees the reset in
    // milliseconds (over TCP).
    EXPECT_TRUE(monitor_reported.WaitForNotificationWithTimeout(absl::Seconds(10)))
        << "the monitor did not see the client go";
  });
  // The attach may end either way (its request link cannot be made).
  plane_->Attach(7, address, LocalHostId(), getuid(), std::nullopt).IgnoreError();
  EXPECT_TRUE(monitor_reported.HasBeenNotified());
  EXPECT_TRUE(ReportedLost(7, absl::Seconds(10)))
      << "the loss reported while the session attached was dropped";
}

// A client on this host whose user is not kvdepotd's (the engine as root
// or vllm, kvdepotd as its own user: the usual deployment). Its UCX shared
// memory is not kvdepotd's to attach (shmat: Permission denied, and the
// session was refused as a "malformed UCX worker address"): it is served
// as a remote client, over TCP, its buffers not copied in place. Run as
// root, the data plane here runs as another user (this process's
// effective uid, while the client's worker and segments stay root's), so
// shared memory would really fail; otherwise the client claims a uid that
// is not this process's.
TEST_F(DataPlaneTest, AColocatedClientOfAnotherUserIsServedOverTcp) {
  ASSERT_TRUE(plane_->shared_memory());
  constexpr size_t kBlock = 64 << 10;
  // UCX memory of the client's (a shared-memory segment of its user), as
  // libkvdepot's AllocateBuffer, made before the plane's user changes.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> buffer =
      client_context_->Allocate(kBlock);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  uint32_t client_uid = geteuid() + 1;
  const uid_t ours = geteuid();
  absl::Cleanup restore_uid = [ours] {
    if (geteuid() != ours) {
      EXPECT_EQ(seteuid(ours), 0) << std::strerror(errno);
    }
  };
  if (ours == 0) {
    client_uid = 0;
    ASSERT_EQ(seteuid(65534), 0) << std::strerror(errno);
  }
  StartPlane(PlaneOptions());  // kvdepotd's UCX, as that user

  ASSERT_TRUE(
      plane_->Attach(1, client_worker_->address(), LocalHostId(), client_uid).ok());
  EXPECT_EQ(plane_->colocated_workers(), 0) << "served as a co-located client";
  absl::StatusOr<DataPlane::Buffer> registered = plane_->RegisterBuffer(
      1, (*buffer)->packed_rkey(), (*buffer)->address(), kBlock);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_FALSE(registered->copied_here);
  EXPECT_FALSE(plane_->CopiedHere(1, registered->id));
  // Bytes reach it (over TCP), though they could not over shared memory.
  for (size_t i = 0; i < kBlock; ++i) arena_[i] = static_cast<char>(i * 7 + 1);
  const BlockMove move{absl::MakeSpan(arena_, kBlock), registered->id,
                       (*buffer)->address()};
  absl::StatusOr<TransferHandle> pushed =
      plane_->Push(1, {&move, 1}, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  pushed->Wait();
  ASSERT_TRUE(pushed->overall_status().ok()) << pushed->overall_status();
  EXPECT_EQ(std::memcmp(reinterpret_cast<const char*>((*buffer)->address()), arena_,
                        kBlock),
            0);
  plane_->Detach(1);
  plane_.reset();  // as the user that made it
}

// An address sandbox that cannot start (here: no such executable; under
// systemd, say, one that UCX's output made fail) sends every UCX session
// to gRPC. That is said once, as an error, at startup, not only as a
// warning per refused session.
TEST_F(DataPlaneTest, ASandboxThatCannotStartIsAnErrorAtStartup) {
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  sink->set_pattern("%l %v");
  // The plane logs until it is destroyed (its threads, its destructor):
  // before `log` goes, however the test ends.
  absl::Cleanup stop_plane = [this] { plane_.reset(); };
  DataPlaneOptions options = PlaneOptions();
  options.address_sandbox = "/nonexistent/kvdepotd";
  StartPlane(options, sink);
  auto errors = [&] {
    const std::string text = log.str();
    size_t n = 0;
    for (size_t at = text.find("error "); at != std::string::npos;
         at = text.find("error ", at + 1)) {
      if (at == 0 || text[at - 1] == '\n') ++n;
    }
    return n;
  };
  EXPECT_EQ(errors(), 1u) << log.str();
  EXPECT_NE(log.str().find("/nonexistent/kvdepotd"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("gRPC"), std::string::npos) << log.str();
  for (SessionId session : {1, 2}) {
    absl::Status st =
        plane_->Attach(session, client_worker_->address(), "", std::nullopt);
    EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  }
  EXPECT_EQ(errors(), 1u) << "said more than once:\n" << log.str();
}

TEST_F(DataPlaneTest, ASessionPastItsRequestsInFlightLeavesRoomForOthers) {
  // Session 1's requests are never answered (its transfers stall): past
  // max_requests_per_session they are refused, and session 2's still go to
  // the handler though the daemon-wide cap is far off.
  DataPlaneOptions options = PlaneOptions();
  options.max_requests_per_session = 2;
  std::atomic<int> refused{0};
  options.on_refused = [&refused](absl::StatusCode code) {
    if (code == absl::StatusCode::kResourceExhausted) ++refused;
  };
  absl::Cleanup stop_plane = [this] { plane_.reset(); };  // before `refused` goes
  StartPlane(options);
  HoldRequests();
  RequestClient* stalled = AttachRequestClient(1);
  RequestClient* other = AttachRequestClient(2);
  ASSERT_NE(stalled, nullptr);
  ASSERT_NE(other, nullptr);
  stalled->Send(11, 100);
  stalled->Send(12, 100);
  stalled->Send(13, 100);  // a third, on the same connection: after them
  EXPECT_EQ(stalled->Reply(13), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.load(), 1) << "the refusal was not reported (on_refused)";
  EXPECT_TRUE(Held(1, 11));
  EXPECT_TRUE(Held(1, 12));
  EXPECT_EQ(plane_->requests_in_flight(), 2u);

  other->Send(11, 100);  // the same id, another session: its own
  EXPECT_TRUE(Held(2, 11)) << "session 2 was refused for session 1's requests";
  EXPECT_EQ(plane_->requests_in_flight(), 3u);

  // An answer gives session 1 its slot back.
  Answer(1, 11);
  EXPECT_EQ(stalled->Reply(11), absl::StatusCode::kOk);
  stalled->Send(14, 100);
  EXPECT_TRUE(Held(1, 14));
  EXPECT_EQ(held(), 3u);
  AnswerAll();
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
  EXPECT_EQ(refused.load(), 1) << "served requests were reported as refused";
}

TEST_F(DataPlaneTest, RequestBodiesInFlightAreBounded) {
  // The daemon-wide bound on the bytes of request bodies, and each
  // session's share of it.
  DataPlaneOptions options = PlaneOptions();
  options.max_request_bytes_in_flight = 3000;
  options.max_request_bytes_per_session = 2000;
  StartPlane(options);
  HoldRequests();
  RequestClient* first = AttachRequestClient(1);
  RequestClient* second = AttachRequestClient(2);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  first->Send(1, 1000);
  first->Send(2, 1000);
  first->Send(3, 1);  // past session 1's 2000
  EXPECT_EQ(first->Reply(3), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Held(1, 1));
  EXPECT_TRUE(Held(1, 2));

  second->Send(1, 1001);  // 3001 in all: past the daemon's 3000
  EXPECT_EQ(second->Reply(1), absl::StatusCode::kResourceExhausted);
  second->Send(2, 1000);  // 3000: fits
  EXPECT_TRUE(Held(2, 2));
  second->Send(3, 0);  // an empty body fits still
  EXPECT_TRUE(Held(2, 3));
  second->Send(4, 1);
  EXPECT_EQ(second->Reply(4), absl::StatusCode::kResourceExhausted);

  // Answered bodies are given back.
  Answer(1, 1);
  second->Send(5, 1000);  // 3000 again, 2000 of session 2's
  EXPECT_TRUE(Held(2, 5));
  AnswerAll();
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
  first->Send(6, 2000);
  second->Send(7, 1000);
  EXPECT_TRUE(Held(1, 6));
  EXPECT_TRUE(Held(2, 7));
  AnswerAll();
}

TEST_F(DataPlaneTest, ADuplicateRequestIdInFlightIsRefused) {
  // Ids are the client's: one its session has in flight already is refused,
  // and the first request's accounting is left as it was.
  DataPlaneOptions options = PlaneOptions();
  options.max_requests_per_session = 2;
  StartPlane(options);
  HoldRequests();
  RequestClient* client = AttachRequestClient(1);
  ASSERT_NE(client, nullptr);
  client->Send(5, 100);
  EXPECT_TRUE(Held(1, 5));
  client->Send(5, 100);
  EXPECT_EQ(client->Reply(5), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(held(), 1u);
  EXPECT_EQ(plane_->requests_in_flight(), 1u);
  client->Send(6, 100);  // the second slot is still free
  EXPECT_TRUE(Held(1, 6));
  AnswerAll();
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
  client->Send(5, 100);  // answered: the id may come again
  EXPECT_TRUE(Held(1, 5));
  AnswerAll();
}

TEST_F(DataPlaneTest, AReplyAfterItsSessionEndedGivesItsSlotBack) {
  DataPlaneOptions options = PlaneOptions();
  options.max_requests_per_session = 1;
  options.max_request_bytes_in_flight = 1000;
  StartPlane(options);
  HoldRequests();
  RequestClient* client = AttachRequestClient(1);
  ASSERT_NE(client, nullptr);
  client->Send(1, 1000);
  EXPECT_TRUE(Held(1, 1));
  // The client goes, then its session ends (as kvdepotd's PeerMonitor ends
  // it). Not the other way round here: UCX 1.13 aborts a client worker
  // whose endpoint the daemon closes while a wire-up message of it is
  // pending (caveat 4), which would take this test's process with it.
  request_clients_.clear();
  plane_->Detach(1, /*peer_gone=*/true);
  Answer(1, 1);  // over no endpoint: dropped, but released
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
  // A second answer, and one to a request never admitted, release nothing.
  plane_->Reply(1, 1, absl::OkStatus(), "");
  plane_->Reply(3, 9, absl::OkStatus(), "");
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
  // The bytes and the slot are free for the next session.
  RequestClient* next = AttachRequestClient(2);
  ASSERT_NE(next, nullptr);
  next->Send(1, 1000);
  EXPECT_TRUE(Held(2, 1));
  EXPECT_EQ(plane_->requests_in_flight(), 1u);
  AnswerAll();
  // Answered over its own endpoint. Waiting for it also lets the wire-up
  // the client owes the daemon go out before TearDown stops the daemon's
  // side: UCX 1.13 aborted this process there (caveat 4, the client's
  // side) in 1 of 13 runs with the CPU busy.
  EXPECT_EQ(next->Reply(1), absl::StatusCode::kOk);
}

TEST_F(DataPlaneTest, RepliesAClientNeverTakesEndItsSessionNotTheDaemonsMemory) {
  // Session 1's client sends requests, then never progresses its worker
  // again (fenced: connected, unread). Its replies would wait in UCX here
  // without bound; past max_unsent_reply_bytes its endpoint fails and the
  // session is reported lost, while session 2 is served as before.
  DataPlaneOptions options = PlaneOptions();
  options.max_unsent_reply_bytes = 1 << 20;
  options.max_requests_per_session = 4096;
  StartPlane(options);
  HoldRequests();
  RequestClient* stalled = AttachRequestClient(1);
  RequestClient* other = AttachRequestClient(2);
  ASSERT_NE(stalled, nullptr);
  ASSERT_NE(other, nullptr);
  constexpr uint64_t kRequests = 1000;
  for (uint64_t id = 1; id <= kRequests; ++id) stalled->Send(id, 10);
  ASSERT_TRUE(Held(1, kRequests));
  stalled->Fence();
  // 64 MB of replies: far more than the sockets between the two hold.
  for (uint64_t id = 1; id <= kRequests; ++id) {
    {
      absl::MutexLock lock(&mu_);
      held_.erase(std::find(held_.begin(), held_.end(), std::make_pair(SessionId{1}, id)));
    }
    plane_->Reply(1, id, absl::OkStatus(), std::string(64 << 10, 'x'));
  }
  EXPECT_TRUE(ReportedLost(1, absl::Seconds(10)))
      << "the replies of a client that never reads them were queued on";
  EXPECT_EQ(plane_->requests_in_flight(), 0u);

  other->Send(7, 100);
  ASSERT_TRUE(Held(2, 7));
  Answer(2, 7);
  EXPECT_EQ(other->Reply(7), absl::StatusCode::kOk);
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(std::count(lost_.begin(), lost_.end(), SessionId{2}), 0);
}

// An Attach given a time to finish by (what is left of the client's
// OpenSession deadline) gives up on a worker that does not answer then,
// not after connect_timeout, so that the client can still open its session
// over gRPC in time. Nor does it wait for the wire-up's flush to be
// abandoned (abandon_after): past its deadline a remote client's endpoint
// closes in order, which does not end that flush. (A co-located client's
// wire-up over shared memory needs nothing of the client: ucx_endpoint_test
// AConnectToAPeerThatDoesNotAnswerEndsByItsTimeout covers an endpoint
// without peer error handling.)
TEST_F(DataPlaneTest, AnAttachToAWorkerThatDoesNotAnswerEndsByItsTime) {
  DataPlaneOptions options = PlaneOptions();
  options.connect_timeout = absl::Seconds(20);
  options.abandon_after = absl::Seconds(5);
  StartPlane(options);
  std::unique_ptr<UcxWorker> stalled = StalledClientWorker();
  ASSERT_NE(stalled, nullptr);
  const absl::Time start = absl::Now();
  absl::Status st =
      plane_->Attach(1, stalled->address(), "", std::nullopt, std::nullopt,
                     start + absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_FALSE(st.ok());
  // Far from connect_timeout (20 s), and from the 300 ms plus
  // abandon_after (5 s) it took before; generous for a loaded machine.
  EXPECT_LT(took, absl::Milliseconds(2500)) << st;
}

// A wire-up to a client worker that never answers ends at connect_timeout,
// and its endpoint then closes in order: it waits, with its socket open,
// for that worker to take what was sent to it, until the worker goes. A
// client opening sessions with such a worker again and again would take a
// file descriptor each time; past max_endpoints_closing new sessions get
// no UCX endpoint (Unavailable: the client uses gRPC) until some close.
TEST_F(DataPlaneTest, EndpointsWaitingForStalledClientsAreBounded) {
  DataPlaneOptions options = PlaneOptions();
  options.connect_timeout = absl::Milliseconds(300);
  options.max_endpoints_closing = 1;
  StartPlane(options);
  std::unique_ptr<UcxWorker> stalled = StalledClientWorker();
  ASSERT_NE(stalled, nullptr);
  EXPECT_FALSE(plane_->Attach(1, stalled->address(), "", std::nullopt).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (plane_->endpoints_closing() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(plane_->endpoints_closing(), 1u);
  // An answering client meanwhile: no endpoint, said so.
  absl::Status refused =
      plane_->Attach(2, client_worker_->address(), "", std::nullopt);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "max_endpoints_closing"))
      << refused;
  // The stalled worker goes: its endpoint closes, and sessions get
  // endpoints again.
  stalled.reset();
  while (plane_->endpoints_closing() != 0 &&
         absl::Now() < give_up + absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(plane_->endpoints_closing(), 0u);
  EXPECT_TRUE(
      plane_->Attach(3, client_worker_->address(), "", std::nullopt).ok());
}

// Sessions with a UCX endpoint are bounded (max_links, by default from the
// open file limit): each takes descriptors, and a gRPC port whose accept()
// met EMFILE may never accept again. Past it a session has no endpoint
// (Unavailable: the client uses gRPC) until one detaches.
TEST_F(DataPlaneTest, SessionsWithAnEndpointAreBoundedByTheFileLimit) {
  DataPlaneOptions options = PlaneOptions();
  options.max_links = 2;
  StartPlane(options);
  ASSERT_TRUE(
      plane_->Attach(1, client_worker_->address(), "", std::nullopt).ok());
  ASSERT_TRUE(
      plane_->Attach(2, client_worker_->address(), "", std::nullopt).ok());
  absl::Status refused =
      plane_->Attach(3, client_worker_->address(), "", std::nullopt);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "open file limit"))
      << refused;
  plane_->Detach(1);
  EXPECT_TRUE(
      plane_->Attach(3, client_worker_->address(), "", std::nullopt).ok());
}

TEST_F(DataPlaneTest, RequestDataSentEagerlyIsBoundedAndCounted) {
  // Data UCX brings with the message is held here whole (UCX 1.13 does not
  // bound an eager message): past kMaxEagerRequestData it is refused, and
  // below it counts with the body against the request byte caps.
  DataPlaneOptions options = PlaneOptions();
  options.max_request_bytes_per_session = 2000;
  StartPlane(options);
  HoldRequests();
  RequestClient* client = AttachRequestClient(1);
  ASSERT_NE(client, nullptr);
  client->SendEagerData(1, 10, size_t{32} << 20);
  EXPECT_EQ(client->Reply(1), absl::StatusCode::kInvalidArgument)
      << "32 MiB of eager data were taken (and held) for a request";
  EXPECT_EQ(held(), 0u);
  client->SendEagerData(2, 10, 1000);
  EXPECT_TRUE(Held(1, 2));
  client->SendEagerData(3, 10, 1000);  // 2020 bytes held with the first
  EXPECT_EQ(client->Reply(3), absl::StatusCode::kResourceExhausted);
  AnswerAll();
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
}

TEST_F(DataPlaneTest, ARequestIsTakenOnlyOverItsSessionsRequestLink) {
  // A request names its session; it must also come over the request link
  // of that session's client worker. Another client's (naming a session
  // not its own) and a stray worker's (a connection it wired up itself)
  // are refused over the connection they came on, never handed on: their
  // replies would go to the session's client, under ids it may be waiting
  // on, and a data request's bytes would come over an endpoint kvdepotd
  // cannot close (UCX 1.13 aborts when the request worker goes with such
  // a receive pending).
  HoldRequests();
  RequestClient* owner = AttachRequestClient(1);
  RequestClient* other = AttachRequestClient(2);
  RequestClient* stray = AttachRequestClient(1, /*attach=*/false);
  ASSERT_NE(owner, nullptr);
  ASSERT_NE(other, nullptr);
  ASSERT_NE(stray, nullptr);
  other->SendNaming(1, 5, 100);
  EXPECT_EQ(other->Reply(5), absl::StatusCode::kPermissionDenied);
  other->SendDataNaming(1, 6);
  EXPECT_EQ(other->Reply(6), absl::StatusCode::kPermissionDenied);
  stray->SendNaming(1, 7, 100);
  EXPECT_EQ(stray->Reply(7), absl::StatusCode::kPermissionDenied);
  stray->SendDataNaming(1, 8);
  EXPECT_EQ(stray->Reply(8), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(held(), 0u);
  EXPECT_EQ(plane_->requests_in_flight(), 0u);
  // The session's own client, and the other with its own session, are
  // served; replies name the session their request named.
  owner->Send(9, 100);
  other->Send(9, 100);
  EXPECT_TRUE(Held(1, 9));
  EXPECT_TRUE(Held(2, 9));
  AnswerAll();
  EXPECT_EQ(owner->Reply(9), absl::StatusCode::kOk);
  EXPECT_EQ(owner->ReplySession(9), 1u);
  EXPECT_EQ(other->Reply(9), absl::StatusCode::kOk);
  EXPECT_EQ(other->ReplySession(9), 2u);
  EXPECT_EQ(other->ReplySession(6), 1u);  // the refusal named session 1
}

}  // namespace
}  // namespace kvdepot
