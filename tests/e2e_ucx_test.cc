// The UCX data plane end to end: a real kvdepotd and real libkvdepot
// clients (in this process and in ucx_client_peer processes) on loopback,
// over UCX's TCP transport and over shared memory (plus TCP for liveness).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/ucx_requests.h"
#include "storage/checksum.h"
#include "storage/internal/sync_point.h"
#include "storage/status_macros.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"
#include "tests/ucx_daemon.h"
#include "transport/memory_region.h"
#include "transport/net_devices.h"
#include "transport/request_message.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_test_util.h"
#include "transport/ucx_worker.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;
using testing::StatusIs;

constexpr size_t kBlock = 256 << 10;

// A child process whose stdout the test reads.
struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (out != nullptr) fclose(out);
  }
  // The next line of its stdout ("" at EOF).
  std::string ReadLine() {
    char buf[256];
    if (fgets(buf, sizeof buf, out) == nullptr) return "";
    std::string s(buf);
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  int Wait() {
    // Read what it still writes (UCX logs to stdout) so it cannot block on
    // a full pipe.
    char buf[4096];
    while (out != nullptr && fread(buf, 1, sizeof buf, out) > 0) {
    }
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

std::unique_ptr<Child> Spawn(const std::vector<std::string>& args) {
  int fds[2];
  if (pipe(fds) != 0) return nullptr;
  auto child = std::make_unique<Child>();
  child->pid = fork();
  if (child->pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    std::string bin = KVDEPOT_UCX_CLIENT_PEER;
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (std::string& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  child->out = fdopen(fds[0], "r");
  return child;
}

// A hand-made UCX client: its own context and worker, a session whose
// endpoint goes to that worker, and a UcxRequests on it (not yet connected
// to the request address the daemon offers).
struct HandMadeClient {
  std::unique_ptr<UcxContext> context;
  std::unique_ptr<UcxWorker> worker;
  uint64_t session = 0;
  std::string request_address;
  std::unique_ptr<UcxRequests> requests;  // destroyed before the worker

  void Open(Client& client, const std::string& name) {
    UcxContextOptions options;
    options.name = name;
    absl::StatusOr<std::unique_ptr<UcxContext>> c = UcxContext::Create(options);
    ASSERT_OK(c.status());
    context = *std::move(c);
    absl::StatusOr<std::unique_ptr<UcxWorker>> w = UcxWorker::Create(*context);
    ASSERT_OK(w.status());
    worker = *std::move(w);
    grpc::ClientContext ctx;
    v1::OpenSessionRequest open;
    open.set_ucx_worker_address(worker->address());
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(client.stub().OpenSession(&ctx, open, &opened).ok());
    ASSERT_TRUE(opened.ucx_connected());
    ASSERT_FALSE(opened.ucx_request_address().empty());
    session = opened.session_id();
    request_address = opened.ucx_request_address();
    absl::StatusOr<std::unique_ptr<UcxRequests>> r = UcxRequests::Create(*worker);
    ASSERT_OK(r.status());
    requests = *std::move(r);
  }
};

// Runs every test over "tcp" and "shm": the daemon and the clients get the
// same UCX settings through the environment.
class UcxE2eTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
        testing::StartUcxDaemon(GetParam());
    ASSERT_OK(d.status());
    daemon_ = *std::move(d);
    client_ = NewClient();
  }

  void TearDown() override {
    testing::UnsetUcxEnvironment(GetParam());
  }

  // A client of daemon_, or of the daemon at `server`.
  std::unique_ptr<Client> NewClient(bool ucx_requests = true,
                                    const std::string& server = "",
                                    bool data_requests = false) {
    ClientOptions options;
    options.server = server.empty() ? daemon_->address() : server;
    options.ucx_requests = ucx_requests;
    options.ucx_data_requests = data_requests;
    options.lease = absl::Seconds(60);
    options.ucx.clear();  // from the environment
    options.transfer_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_OK(c.status());
    return c.ok() ? *std::move(c) : nullptr;
  }

  // A client of daemon_ that gives a transfer 200 ms and waits 2 s for the
  // daemon's answer: a daemon stopped for longer fails its calls.
  absl::StatusOr<std::unique_ptr<Client>> ImpatientClient() {
    ClientOptions options;
    options.server = daemon_->address();
    options.lease = absl::Seconds(60);
    options.ucx.clear();  // from the environment
    options.transfer_timeout = absl::Milliseconds(200);
    options.rpc_timeout = absl::Seconds(2);  // the client's wait
    return Client::Connect(options);
  }

  v1::StatsResponse Stats() {
    absl::StatusOr<v1::StatsResponse> s = client_->Stats();
    EXPECT_OK(s.status());
    return s.ok() ? *s : v1::StatsResponse();
  }

  // A ucx_client_peer "stall" process with a registered buffer of `size`
  // bytes (all 's') in namespace `ns`, stopped (SIGSTOP): its UCX worker
  // answers nothing until SIGCONT. client_ has a session first (so that
  // the daemon's count of sessions includes it). Null (a test failure
  // added) when either did not come up.
  std::unique_ptr<Child> StoppedPeer(const std::string& ns, size_t size,
                                     uint64_t* session, uint64_t* address) {
    if (absl::Status st = client_->EnsureSession().status(); !st.ok()) {
      ADD_FAILURE() << "client_: " << st;
      return nullptr;
    }
    std::unique_ptr<Child> peer =
        Spawn({"stall", daemon_->address(), ns, std::to_string(size)});
    const std::string ready = peer->ReadLine();
    if (std::sscanf(ready.c_str(), "READY %lu %lu", session, address) != 2) {
      ADD_FAILURE() << "the peer said: " << ready;
      return nullptr;
    }
    kill(peer->pid, SIGSTOP);
    return peer;
  }

  // Has the daemon put `n` blocks of `size` bytes ("<ns>0", "<ns>1"...)
  // from a StoppedPeer's buffer, `timeout_ms` allowed: a PullBlocks the test
  // sends for the peer's session. Returns how many blocks failed (-1, with
  // a test failure added, when the call itself failed).
  int PutFromStoppedPeer(uint64_t session, uint64_t address,
                         const std::string& ns, int n, size_t size,
                         uint32_t timeout_ms = 500) {
    const std::string stalled(size, 's');  // what the peer's buffer holds
    grpc::ClientContext ctx;
    v1::PullBlocksRequest req;
    req.set_session_id(session);
    req.set_namespace_(ns);
    for (int i = 0; i < n; ++i) {
      v1::PullSpec* b = req.add_blocks();
      b->set_key(absl::StrCat(ns, i));
      b->set_checksum(BlockChecksum(stalled));
      b->mutable_source()->set_buffer_id(0);
      b->mutable_source()->set_address(address + i * size);
      b->mutable_source()->set_size(size);
    }
    req.set_timeout_ms(timeout_ms);
    v1::PullBlocksResponse resp;
    grpc::Status st = client_->stub().PullBlocks(&ctx, req, &resp);
    if (!st.ok() || resp.blocks_size() != n) {
      ADD_FAILURE() << "PullBlocks: " << st.error_message() << ", "
                    << resp.blocks_size() << " blocks";
      return -1;
    }
    int failed = 0;
    for (const v1::BlockTransfer& b : resp.blocks()) failed += b.code() != 0;
    return failed;
  }

  // Polls Stats until `done` holds or 10 s pass (the lease is 60 s).
  bool StatsBecome(const std::function<bool(const v1::StatsResponse&)>& done) {
    return testing::PollUntil([&] { return done(Stats()); });
  }

  // Three ucx_client_peer `mode` processes (roundtrip or roundtrip-send)
  // at once, 16 blocks each into namespace `ns`: every byte checked by
  // each, and nothing left pinned or reserved.
  void RunConcurrentRoundTrips(const std::string& mode, const std::string& ns) {
    std::vector<std::unique_ptr<Child>> peers;
    for (int seed = 1; seed <= 3; ++seed) {
      peers.push_back(Spawn({mode, daemon_->address(), ns, std::to_string(seed),
                             "16", std::to_string(kBlock)}));
      ASSERT_NE(peers.back(), nullptr);
    }
    for (auto& p : peers) EXPECT_EQ(p->Wait(), 0) << daemon_->Log();
    v1::StatsResponse st = Stats();
    EXPECT_EQ(st.dram().blocks(), 48u);
    EXPECT_EQ(st.pins(), 0u);
    EXPECT_EQ(st.reservations(), 0u);
  }

  // Stores `blocks` blocks of `size` bytes ("<ns>0"...; pattern seed i + 1)
  // through client_, then starts a ucx_client_peer "late-get" of them
  // (`timeout_ms` allowed) and waits until it has stopped itself with
  // block 0 landed. Null (a test failure added) when any step failed.
  std::unique_ptr<Child> StoppedLateGet(const std::string& ns, int blocks,
                                        size_t size, int timeout_ms = 500) {
    std::vector<char> src(size);
    for (int i = 0; i < blocks; ++i) {
      ucx_test::FillPattern(src.data(), size, i + 1);
      const std::string key = absl::StrCat(ns, i);
      BlockToPut block{key, "", absl::string_view(src.data(), size)};
      if (absl::Status st = client_->Put(ns, {&block, 1}).status(); !st.ok()) {
        ADD_FAILURE() << "put " << key << ": " << st;
        return nullptr;
      }
    }
    std::unique_ptr<Child> peer =
        Spawn({"late-get", daemon_->address(), ns, std::to_string(blocks),
               std::to_string(size), std::to_string(timeout_ms)});
    const std::string said = peer != nullptr ? peer->ReadLine() : "";
    int status = 0;
    if (said != "STOPPING" || waitpid(peer->pid, &status, WUNTRACED) != peer->pid ||
        !WIFSTOPPED(status)) {
      ADD_FAILURE() << "the late-get peer did not stop (it said: " << said << ")";
      return nullptr;
    }
    return peer;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_P(UcxE2eTest, ConcurrentClientProcessesMoveEveryByteIntact) {
  RunConcurrentRoundTrips("roundtrip", "peers");
}

// The same with the puts' bytes sent with their requests (data requests).
TEST_P(UcxE2eTest, ConcurrentClientProcessesSendingTheirPutsBytesMoveEveryByteIntact) {
  RunConcurrentRoundTrips("roundtrip-send", "senders");
  EXPECT_GT(testing::MetricValue(testing::ScrapeMetrics(*daemon_),
                                 "kvdepot_ucx_requests_total{op=\"PullBlocksWithData\"}"),
            0);
}

TEST_P(UcxE2eTest, GetIntoAndPutFromInThisProcess) {
  std::vector<char> src(4 * kBlock), dst(4 * kBlock, 0);
  for (size_t i = 0; i < 4; ++i) ucx_test::FillPattern(&src[i * kBlock], kBlock, i);
  ASSERT_OK(client_->RegisterBuffer(src.data(), src.size()));
  ASSERT_OK(client_->RegisterBuffer(dst.data(), dst.size()));
  std::vector<std::string> keys = {"k0", "k1", "k2", "k3"};
  std::vector<BlockToPut> puts;
  for (size_t i = 0; i < 3; ++i) {  // k3 stays a miss
    puts.push_back({keys[i], i ? absl::string_view(keys[i - 1]) : "",
                    absl::string_view(&src[i * kBlock], kBlock)});
  }
  TransferOp put = client_->PutFromAsync("ns", puts);
  put.Wait();
  EXPECT_STREQ(put.transport(), "ucx");
  for (const absl::Status& s : put.statuses()) EXPECT_OK(s);
  // Putting again is idempotent and still reported as stored.
  TransferOp again = client_->PutFromAsync("ns", puts);
  again.Wait();
  for (const absl::Status& s : again.statuses()) EXPECT_OK(s);

  std::vector<absl::string_view> views(keys.begin(), keys.end());
  std::vector<absl::Span<char>> spans;
  for (size_t i = 0; i < 4; ++i) spans.emplace_back(&dst[i * kBlock], kBlock);
  TransferOp get = client_->GetIntoAsync("ns", views, spans);
  ASSERT_TRUE(get.WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_STREQ(get.transport(), "ucx");
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_OK(get.statuses()[i]);
    EXPECT_EQ(ucx_test::FirstPatternMismatch(&dst[i * kBlock], kBlock, i), -1);
  }
  EXPECT_THAT(get.statuses()[3], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(get.ok_prefix(), 3u);
  // A miss is never zero-filled or written at all.
  EXPECT_EQ(std::count(dst.begin() + 3 * kBlock, dst.end(), 0),
            static_cast<long>(kBlock));
  v1::StatsResponse st = Stats();
  EXPECT_EQ(st.pins(), 0u);
  EXPECT_EQ(st.reservations(), 0u);
  // Ordinary memory the client registered is not mapped into the daemon:
  // UCX moved every byte, and the client checked the blocks it got.
  const std::string metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_ucx_in_place_bytes_total{direction=\"out\"}"),
            0);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_bytes_total{direction=\"out\",transport=\"ucx\"}"),
            3 * kBlock);

  // A get that no caller waits on (polled) is checked all the same, off
  // the caller's thread.
  std::fill(dst.begin(), dst.end(), 0);
  TransferOp polled = client_->GetIntoAsync("ns", views, spans);
  ASSERT_TRUE(testing::PollUntil([&] { return polled.IsReady(); },
                                 absl::Seconds(30), absl::Milliseconds(1)));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_OK(polled.statuses()[i]);
    EXPECT_EQ(ucx_test::FirstPatternMismatch(&dst[i * kBlock], kBlock, i), -1);
  }
  EXPECT_THAT(polled.statuses()[3], StatusIs(absl::StatusCode::kNotFound));
}

// A request that reaches the daemon after the client gave up on it (here
// the daemon is stopped until then; a long queue does the same) copies
// nothing into or out of the client's AllocateBuffer memory: the client
// has handed that memory back to its caller, who may have written it
// again. Such a put would otherwise store the caller's new bytes under the
// old key, with their own (daemon-computed) checksum.
TEST_P(UcxE2eTest, NoInPlaceCopyStartsAfterTheClientGaveUp) {
  if (GetParam() != "shm") {
    GTEST_SKIP() << "the daemon copies in place only into a co-located "
                    "client's shared memory";
  }
  absl::StatusOr<std::unique_ptr<Client>> c = ImpatientClient();
  ASSERT_OK(c.status());
  absl::StatusOr<absl::Span<char>> buf = (*c)->AllocateBuffer(3 * kBlock);
  ASSERT_OK(buf.status());
  ucx_test::FillPattern(buf->data(), kBlock, 5);
  BlockToPut stored{"stored", "", absl::string_view(buf->data(), kBlock)};
  TransferOp put = (*c)->PutFromAsync("gaveup", {&stored, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);
  absl::string_view key = "stored";
  absl::Span<char> dst = buf->subspan(kBlock, kBlock);
  TransferOp get = (*c)->GetIntoAsync("gaveup", {&key, 1}, {&dst, 1});
  get.Wait();
  ASSERT_OK(get.statuses()[0]);
  // Requests answered OK (per-block failures included), by method.
  auto answered = [&](const char* op) {
    return testing::MetricValue(
        testing::ScrapeMetrics(*daemon_),
        absl::StrCat("kvdepot_requests_total{code=\"OK\",op=\"", op, "\"}"));
  };

  // A get: the caller writes its buffer once the get has failed.
  const double pushes = answered("PushBlocks");
  std::memset(dst.data(), 'y', kBlock);
  ASSERT_TRUE(ucx_test::StopProcess(daemon_->pid()));
  TransferOp late_get = (*c)->GetIntoAsync("gaveup", {&key, 1}, {&dst, 1});
  late_get.Wait();
  kill(daemon_->pid(), SIGCONT);
  EXPECT_FALSE(late_get.statuses()[0].ok());
  EXPECT_TRUE(testing::PollUntil([&] { return answered("PushBlocks") == pushes + 1; }))
      << "the late get was never answered";
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 'y'), static_cast<ptrdiff_t>(kBlock))
      << "the daemon copied into the buffer after the client gave up";

  // A put: the caller writes other bytes into its source once it failed.
  const double pulls = answered("PullBlocks");
  char* source = buf->data() + 2 * kBlock;
  ucx_test::FillPattern(source, kBlock, 9);
  BlockToPut late{"late", "", absl::string_view(source, kBlock)};
  ASSERT_TRUE(ucx_test::StopProcess(daemon_->pid()));
  TransferOp late_put = (*c)->PutFromAsync("gaveup", {&late, 1});
  late_put.Wait();
  std::memset(source, 'z', kBlock);
  kill(daemon_->pid(), SIGCONT);
  EXPECT_FALSE(late_put.statuses()[0].ok());
  EXPECT_TRUE(testing::PollUntil([&] { return answered("PullBlocks") == pulls + 1; }))
      << "the late put was never answered";
  absl::string_view late_key = "late";
  absl::StatusOr<LookupReply> found =
      (*c)->Lookup("gaveup", {&late_key, 1}, false, false);
  ASSERT_OK(found.status());
  EXPECT_FALSE(found->entries[0].found)
      << "the daemon stored what the caller wrote after the put failed";
}

// An op that took its session's link just before another get failed on
// that link (the client fenced the link's worker and dropped the session)
// is not sent through the fenced worker, where the daemon's transfer would
// wait for its deadline (the daemon still serves that session): it ends
// at once, Unavailable (a miss), and the next op goes over a new session.
TEST_P(UcxE2eTest, AnOpThatTookALinkFencedMeanwhileEndsAtOnce) {
  ClientOptions options;
  options.server = daemon_->address();
  options.lease = absl::Seconds(60);
  options.ucx.clear();  // from the environment
  options.transfer_timeout = absl::Seconds(10);
  options.rpc_timeout = absl::Seconds(8);  // the daemon's transfers: 4 s
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  ASSERT_OK(c.status());
  // Registered, not UCX-allocated: a failed get may land late, so the
  // client fences the worker.
  std::vector<char> buf(3 * kBlock);
  ASSERT_OK((*c)->RegisterBuffer(buf.data(), buf.size()));
  ucx_test::FillPattern(buf.data(), kBlock, 4);
  BlockToPut block{"held", "", absl::string_view(buf.data(), kBlock)};
  TransferOp put = (*c)->PutFromAsync("fenced", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);
  ASSERT_OK((*c)->data_plane_status());

  absl::Notification held, release;
  std::atomic<int> prepared{0};
  internal::SyncPointCallback hold("Client::GetIntoAsync:Prepared", [&](void*) {
    if (prepared.fetch_add(1) != 0) return;
    held.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
  });
  const absl::string_view key = "held";
  absl::Span<char> first(buf.data() + kBlock, kBlock);
  std::optional<TransferOp> taken;
  std::thread first_get([&] {
    taken.emplace((*c)->GetIntoAsync("fenced", {&key, 1}, {&first, 1}));
    taken->Wait();
  });
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Another get fails on the same link (the daemon stalls past the
  // client's wait): the client fences the link and drops the session.
  absl::string_view absent = "absent";
  absl::Span<char> second(buf.data() + 2 * kBlock, kBlock);
  ASSERT_TRUE(ucx_test::StopProcess(daemon_->pid()));
  TransferOp failed = (*c)->GetIntoAsync("fenced", {&absent, 1}, {&second, 1});
  failed.Wait();
  kill(daemon_->pid(), SIGCONT);
  ASSERT_FALSE(failed.statuses()[0].ok());
  const absl::Time released = absl::Now();
  release.Notify();
  first_get.join();
  const absl::Duration took = absl::Now() - released;
  ASSERT_TRUE(taken.has_value());
  EXPECT_THAT(taken->statuses()[0], StatusIs(absl::StatusCode::kUnavailable));
  // Not the daemon's transfer deadline (4 s) later.
  EXPECT_LT(took, absl::Seconds(2));
  // The next get opens a session on a new link.
  TransferOp next = (*c)->GetIntoAsync("fenced", {&key, 1}, {&first, 1});
  next.Wait();
  EXPECT_OK(next.statuses()[0]);
  EXPECT_EQ(std::memcmp(first.data(), buf.data(), kBlock), 0);
}

TEST_P(UcxE2eTest, APinIsReleasedInItsOwnSessionAfterTheClientMovedOn) {
  // A get that fails on its way makes the client fence its worker and
  // leave that session for a new one, while the daemon keeps the old
  // session, and the pins taken in it, until it ends. Unpin must still
  // release such a pin: it names the pin's session, not the current one.
  absl::StatusOr<std::unique_ptr<Client>> c = ImpatientClient();
  ASSERT_OK(c.status());
  // Registered, not UCX-allocated: the daemon's UCX writes into it, so a
  // failed get may land late and the client moves to a new session.
  std::vector<char> buf(2 * kBlock);
  ASSERT_OK((*c)->RegisterBuffer(buf.data(), buf.size()));
  ucx_test::FillPattern(buf.data(), kBlock, 3);
  BlockToPut block{"kept", "", absl::string_view(buf.data(), kBlock)};
  TransferOp put = (*c)->PutFromAsync("movedon", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);
  absl::string_view key = "kept";
  absl::StatusOr<LookupReply> pinned = (*c)->Lookup("movedon", {&key, 1}, false, true);
  ASSERT_OK(pinned.status());
  ASSERT_NE(pinned->pin_id, 0u);

  // The daemon stalls past the client's wait for a get (of a block it does
  // not have: no transfer, so nothing ends the daemon's session).
  absl::string_view absent = "absent";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  ASSERT_TRUE(ucx_test::StopProcess(daemon_->pid()));
  TransferOp get = (*c)->GetIntoAsync("movedon", {&absent, 1}, {&dst, 1});
  get.Wait();
  kill(daemon_->pid(), SIGCONT);
  ASSERT_FALSE(get.statuses()[0].ok());

  absl::StatusOr<v1::EvictResponse> kept = (*c)->Evict("movedon", {&key, 1}, false);
  ASSERT_OK(kept.status());
  ASSERT_EQ(kept->pinned_blocks(), 1u) << "the old session's pin is gone already";
  EXPECT_OK((*c)->Unpin(pinned->pin_id));
  absl::StatusOr<v1::EvictResponse> evicted = (*c)->Evict("movedon", {&key, 1}, false);
  ASSERT_OK(evicted.status());
  EXPECT_EQ(evicted->evicted_blocks(), 1u) << "the block is still pinned";
  // The client works on, in a new session.
  ASSERT_OK((*c)->Lookup("movedon", {&key, 1}, false, true).status());
}

// Flips one bit of the block `key` of `ns` in `d`'s DRAM arena, through
// /proc/PID/mem (memory corruption, as a bad DIMM would make it), while the
// block is pinned (its slot cannot be reused meanwhile). The arena's
// address is in d's log at debug level. Sets *refused when this process
// may not write another's memory (Yama ptrace_scope, a sandbox).
void CorruptInDram(const DaemonProcess& d, Client& client,
                   const std::string& ns, const std::string& key,
                   bool* refused) {
  *refused = false;
  const std::string log = d.Log();
  const std::string mark = "DRAM tier mapped at ";
  const size_t at = log.find(mark);
  ASSERT_NE(at, std::string::npos) << "start the daemon with --log-level debug";
  const uint64_t base =
      std::stoull(log.substr(at + mark.size(), 20), nullptr, 16);
  absl::StatusOr<uint64_t> session = client.EnsureSession();
  ASSERT_OK(session.status());
  grpc::ClientContext ctx;
  v1::LookupRequest req;
  req.set_session_id(*session);
  req.set_namespace_(ns);
  req.add_keys(key);
  req.set_pin(true);
  v1::LookupResponse resp;
  ASSERT_TRUE(client.stub().Lookup(&ctx, req, &resp).ok());
  ASSERT_TRUE(resp.entries(0).found());
  ASSERT_EQ(resp.entries(0).tier(), v1::TIER_DRAM);
  absl::Cleanup unpin = [&] { EXPECT_OK(client.Unpin(resp.pin_id())); };
  const uint64_t address = base + resp.entries(0).offset() + 1000;
  const int fd = open(absl::StrCat("/proc/", d.pid(), "/mem").c_str(), O_RDWR);
  if (fd < 0 && (errno == EACCES || errno == EPERM)) {
    *refused = true;
    return;
  }
  ASSERT_GE(fd, 0) << std::strerror(errno);
  absl::Cleanup close_fd = [fd] { close(fd); };
  char byte = 0;
  if (pread(fd, &byte, 1, static_cast<off_t>(address)) != 1 &&
      (errno == EIO || errno == EPERM || errno == EACCES)) {
    *refused = true;
    return;
  }
  byte ^= 0x10;
  ASSERT_EQ(pwrite(fd, &byte, 1, static_cast<off_t>(address)), 1)
      << std::strerror(errno);
}

// A block whose bytes went bad in the daemon's DRAM is never served. Over
// shared memory the daemon copies it into the client's buffer itself and
// finds it out: it refuses the copy with DATA_LOSS, counts it
// (kvdepot_integrity_errors_total{tier="dram"} stayed 0 before) and drops
// its DRAM copy. Over TCP, and on the gRPC byte path, the client finds it
// out and reports it (ReportCorrupt): the daemon hashes its copy again,
// counts it and drops it the same way (before, it stayed until evicted or
// demoted, failing every reader). A corrupt block that is demoted is
// dropped, not written to NVMe, and counted, not as a demotion failure.
TEST_P(UcxE2eTest, ABlockCorruptedInDramIsNeverServed) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = testing::StartUcxDaemon(
      GetParam(), {"--dram-capacity", "24MiB", "--log-level", "debug"});
  ASSERT_OK(d.status());
  std::unique_ptr<Client> c = NewClient(true, (*d)->address());
  ASSERT_NE(c, nullptr);
  absl::StatusOr<absl::Span<char>> buf = c->AllocateBuffer(4 * kBlock);
  ASSERT_OK(buf.status());
  ucx_test::FillPattern(buf->data(), kBlock, 1);
  ucx_test::FillPattern(buf->data() + kBlock, kBlock, 2);
  std::vector<BlockToPut> blocks = {
      {"bad", "", absl::string_view(buf->data(), kBlock)},
      {"good", "", absl::string_view(buf->data() + kBlock, kBlock)}};
  TransferOp put = c->PutFromAsync("rot", blocks);
  put.Wait();
  ASSERT_OK(put.statuses()[0]);
  ASSERT_OK(put.statuses()[1]);
  bool refused = false;
  CorruptInDram(**d, *c, "rot", "bad", &refused);
  if (refused) GTEST_SKIP() << "this process may not write kvdepotd's memory";

  std::vector<absl::string_view> keys = {"bad", "good"};
  std::vector<absl::Span<char>> dst = {buf->subspan(2 * kBlock, kBlock),
                                       buf->subspan(3 * kBlock, kBlock)};
  const std::string dram_errors =
      "kvdepot_integrity_errors_total{tier=\"dram\"}";
  TransferOp get = c->GetIntoAsync("rot", keys, dst);
  get.Wait();
  EXPECT_EQ(get.statuses()[0].code(), absl::StatusCode::kDataLoss)
      << get.statuses()[0];
  ASSERT_OK(get.statuses()[1]);
  EXPECT_EQ(ucx_test::FirstPatternMismatch(dst[1].data(), kBlock, 2), -1);
  absl::string_view bad = "bad";
  // Counted and dropped, so the next put stores it again (before, it
  // stayed: a DATA_LOSS for every get and "stored" for every put until it
  // was evicted). Over TCP the client's report comes after the get.
  EXPECT_TRUE(testing::PollUntil([&] {
    return testing::MetricValue(testing::ScrapeMetrics(**d), dram_errors) == 1;
  })) << testing::ScrapeMetrics(**d);
  EXPECT_TRUE(testing::PollUntil([&] {
    absl::StatusOr<LookupReply> r = c->Lookup("rot", {&bad, 1}, false, false);
    return r.ok() && !r->entries[0].found;
  })) << "the corrupt block was kept";
  ucx_test::FillPattern(buf->data(), kBlock, 1);
  TransferOp again = c->PutFromAsync("rot", {&blocks[0], 1});
  again.Wait();
  ASSERT_OK(again.statuses()[0]);
  EXPECT_FALSE(again.already_stored(0));
  TransferOp reget = c->GetIntoAsync("rot", {&bad, 1}, {&dst[0], 1});
  reget.Wait();
  ASSERT_OK(reget.statuses()[0]);
  EXPECT_EQ(ucx_test::FirstPatternMismatch(dst[0].data(), kBlock, 1), -1);
  // The store's counters reach /metrics about once a second.
  const std::string corrupt_evictions =
      "kvdepot_evictions_total{reason=\"corrupt\",tier=\"dram\"}";
  EXPECT_TRUE(testing::PollUntil([&] {
    return testing::MetricValue(testing::ScrapeMetrics(**d),
                                corrupt_evictions) == 1;
  })) << testing::ScrapeMetrics(**d);

  // The gRPC byte path: both of its reads find the block bad, report it,
  // and the daemon drops it.
  ClientOptions grpc_options;
  grpc_options.server = (*d)->address();
  grpc_options.transport = ClientOptions::Transport::kGrpc;
  absl::StatusOr<std::unique_ptr<Client>> g = Client::Connect(grpc_options);
  ASSERT_OK(g.status());
  for (int round = 0; round < 2; ++round) {
    ASSERT_OK((*g)->Put("rot", {&blocks[0], 1}));
    CorruptInDram(**d, *c, "rot", "bad", &refused);
    ASSERT_FALSE(refused);
    if (round == 0) {
      EXPECT_EQ((*g)->Get("rot", {&bad, 1}).status().code(),
                absl::StatusCode::kDataLoss);
    } else {
      absl::StatusOr<std::vector<bool>> got =
          (*g)->GetInto("rot", {&bad, 1}, {&dst[0], 1});
      EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss)
          << got.status();
    }
    EXPECT_TRUE(testing::PollUntil([&] {
      return testing::MetricValue(testing::ScrapeMetrics(**d),
                                  corrupt_evictions) == 2 + round;
    })) << "round "
        << round << ": " << testing::ScrapeMetrics(**d);
    absl::StatusOr<LookupReply> r = c->Lookup("rot", {&bad, 1}, false, false);
    ASSERT_OK(r.status());
    EXPECT_FALSE(r->entries[0].found) << "round " << round;
  }
  EXPECT_EQ(testing::MetricValue(testing::ScrapeMetrics(**d), dram_errors), 3);

  // The engines' way: a pinned lookup, the get, then the unpin. The block
  // its reader pins is kept (verdict KEPT; counted once, however often it
  // is reported), then dropped within about a second of the unpin.
  // (Tried again while the client's own report is being checked: the
  // daemon checks one at a time.)
  auto report = [&](absl::string_view key, uint64_t sum) {
    v1::ReportCorruptRequest req;
    req.set_namespace_("rot");
    v1::CorruptBlock* b = req.add_blocks();
    b->set_key(std::string(key));
    b->set_checksum(sum);
    v1::ReportCorruptResponse resp;
    grpc::Status st;
    EXPECT_TRUE(testing::PollUntil([&] {
      grpc::ClientContext ctx;
      st = c->stub().ReportCorrupt(&ctx, req, &resp);
      return st.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED;
    }));
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.verdicts_size() == 1 ? resp.verdicts(0)
                                     : v1::CORRUPT_VERDICT_UNSPECIFIED;
  };
  ASSERT_OK((*g)->Put("rot", {&blocks[0], 1}));
  CorruptInDram(**d, *c, "rot", "bad", &refused);
  absl::StatusOr<LookupReply> pinned = c->Lookup("rot", {&bad, 1}, false, true);
  ASSERT_OK(pinned.status());
  ASSERT_TRUE(pinned->entries[0].found);
  const uint64_t bad_sum = pinned->entries[0].checksum;
  TransferOp held = c->GetIntoAsync("rot", {&bad, 1}, {&dst[0], 1});
  held.Wait();
  EXPECT_EQ(held.statuses()[0].code(), absl::StatusCode::kDataLoss)
      << held.statuses()[0];
  EXPECT_EQ(report(bad, bad_sum), v1::CORRUPT_KEPT);
  EXPECT_EQ(report(bad, bad_sum), v1::CORRUPT_KEPT);
  EXPECT_EQ(report(bad, bad_sum + 1), v1::CORRUPT_NOT_CONFIRMED);
  absl::string_view good = "good";
  EXPECT_EQ(report(good, BlockChecksum(blocks[1].bytes)),
            v1::CORRUPT_NOT_CONFIRMED);
  // Hidden from lookups at once, but in DRAM while pinned.
  absl::StatusOr<LookupReply> still = c->Lookup("rot", {&bad, 1}, false, false);
  ASSERT_OK(still.status());
  EXPECT_FALSE(still->entries[0].found) << "a lookup found it after the report";
  absl::StatusOr<v1::StatsResponse> stats = c->Stats();
  ASSERT_OK(stats.status());
  const uint64_t blocks_pinned = stats->dram().blocks();
  absl::SleepFor(absl::Milliseconds(1500));  // a retry or more, while pinned
  stats = c->Stats();
  ASSERT_OK(stats.status());
  EXPECT_EQ(stats->dram().blocks(), blocks_pinned) << "dropped while pinned";
  ASSERT_OK(c->Unpin(pinned->pin_id));
  EXPECT_TRUE(testing::PollUntil([&] {
    absl::StatusOr<v1::StatsResponse> st = c->Stats();
    return st.ok() && st->dram().blocks() + 1 == blocks_pinned;
  })) << "the corrupt block was kept after its unpin";
  // Unpinned when reported: dropped at once.
  ASSERT_OK((*g)->Put("rot", {&blocks[0], 1}));
  CorruptInDram(**d, *c, "rot", "bad", &refused);
  EXPECT_EQ(report(bad, bad_sum), v1::CORRUPT_DROPPED);
  still = c->Lookup("rot", {&bad, 1}, false, false);
  ASSERT_OK(still.status());
  EXPECT_FALSE(still->entries[0].found);
  EXPECT_TRUE(testing::PollUntil([&] {
    return testing::MetricValue(testing::ScrapeMetrics(**d),
                                corrupt_evictions) == 5;
  })) << testing::ScrapeMetrics(**d);
  EXPECT_EQ(testing::MetricValue(testing::ScrapeMetrics(**d), dram_errors), 5);
  stats = c->Stats();
  ASSERT_OK(stats.status());
  EXPECT_EQ(stats->dram().integrity_errors(), 5u);  // kvdepotctl stats shows it
  EXPECT_EQ(stats->integrity_errors(), 5u);

  // Demoted with a bad bit: dropped, not written to NVMe, and counted.
  const double before =
      testing::MetricValue(testing::ScrapeMetrics(**d), dram_errors);
  ucx_test::FillPattern(buf->data(), kBlock, 3);
  BlockToPut doomed{"doomed", "", absl::string_view(buf->data(), kBlock)};
  TransferOp put_doomed = c->PutFromAsync("rot", {&doomed, 1});
  put_doomed.Wait();
  ASSERT_OK(put_doomed.statuses()[0]);
  CorruptInDram(**d, *c, "rot", "doomed", &refused);
  for (int i = 0; i < 200; ++i) {  // 50 MiB through a 24 MiB tier
    ucx_test::FillPattern(buf->data(), kBlock, 100 + i);
    const std::string key = absl::StrCat("fill", i);
    BlockToPut b{key, "", absl::string_view(buf->data(), kBlock)};
    TransferOp f = c->PutFromAsync("rot", {&b, 1});
    f.Wait();
    ASSERT_OK(f.statuses()[0]);
  }
  EXPECT_TRUE(testing::PollUntil([&] {
    return testing::MetricValue(testing::ScrapeMetrics(**d), dram_errors) ==
           before + 1;
  })) << testing::ScrapeMetrics(**d);
  absl::string_view doomed_key = "doomed";
  absl::StatusOr<LookupReply> r =
      c->Lookup("rot", {&doomed_key, 1}, false, false);
  ASSERT_OK(r.status());
  EXPECT_FALSE(r->entries[0].found) << "the corrupt block reached NVMe";
  stats = c->Stats();
  ASSERT_OK(stats.status());
  EXPECT_EQ(stats->dram().integrity_errors(),
            static_cast<uint64_t>(before) + 1);
  EXPECT_EQ(stats->nvme().integrity_errors(), 0u);
  TransferOp regot = c->GetIntoAsync("rot", {&good, 1}, {&dst[1], 1});
  regot.Wait();
  ASSERT_OK(regot.statuses()[0]);  // demoted and read back, intact
  EXPECT_EQ(ucx_test::FirstPatternMismatch(dst[1].data(), kBlock, 2), -1);
  EXPECT_EQ(testing::MetricValue(testing::ScrapeMetrics(**d),
                                 "kvdepot_demotion_failures_total"),
            0);
}

TEST_P(UcxE2eTest, BuffersAllocatedByUcxWork) {
  // UCX-allocated memory: shared memory where UCX can, so the daemon copies
  // straight into it on this host.
  absl::StatusOr<absl::Span<char>> buf = client_->AllocateBuffer(2 * kBlock);
  ASSERT_OK(buf.status());
  // Part of it registered again is not registered a second time: that
  // registration would outlive the buffer's FreeBuffer.
  EXPECT_TRUE(client_->IsRegistered(buf->data() + kBlock, kBlock));
  ASSERT_OK(client_->RegisterBuffer(buf->data() + kBlock, kBlock));
  ucx_test::FillPattern(buf->data(), kBlock, 77);
  BlockToPut block{"alloc", "", absl::string_view(buf->data(), kBlock)};
  TransferOp put = client_->PutFromAsync("alloc", {&block, 1});
  put.Wait();
  EXPECT_STREQ(put.transport(), "ucx");
  ASSERT_OK(put.statuses()[0]);
  EXPECT_FALSE(put.already_stored(0));
  absl::string_view key = "alloc";
  // Over shared memory the client sent no checksum (the daemon copied the
  // block and hashed it as it landed): the one stored is the bytes' all
  // the same.
  absl::StatusOr<LookupReply> found = client_->Lookup("alloc", {&key, 1}, false, false);
  ASSERT_OK(found.status());
  ASSERT_TRUE(found->entries[0].found);
  EXPECT_EQ(found->entries[0].checksum,
            BlockChecksum(absl::string_view(buf->data(), kBlock)));
  absl::Span<char> dst = buf->subspan(kBlock, kBlock);
  TransferOp get = client_->GetIntoAsync("alloc", {&key, 1}, {&dst, 1});
  get.Wait();
  ASSERT_OK(get.statuses()[0]);
  EXPECT_EQ(ucx_test::FirstPatternMismatch(dst.data(), kBlock, 77), -1);
  TransferOp again = client_->PutFromAsync("alloc", {&block, 1});
  again.Wait();
  ASSERT_OK(again.statuses()[0]);
  EXPECT_TRUE(again.already_stored(0));
  // Over shared memory the daemon maps this buffer and copied both blocks
  // itself, checking them as they landed; over TCP UCX moved them.
  const std::string metrics = testing::ScrapeMetrics(*daemon_);
  const double in_place = GetParam() == "shm" ? kBlock : 0;
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_ucx_in_place_bytes_total{direction=\"in\"}"),
            in_place);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_ucx_in_place_bytes_total{direction=\"out\"}"),
            in_place);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_bytes_total{direction=\"out\",transport=\"ucx\"}"),
            kBlock);
  ASSERT_OK(client_->FreeBuffer(*buf));
  EXPECT_FALSE(client_->IsRegistered(buf->data() + kBlock, kBlock))
      << "a registration outlived the memory";
}

TEST_P(UcxE2eTest, AKilledClientsPinsAndReservationsAreReleasedAtOnce) {
  std::vector<char> src(kBlock, 'p');
  ASSERT_OK(client_->RegisterBuffer(src.data(), src.size()));
  TransferOp put = client_->PutFromAsync(
      "hold", {BlockToPut{"pinned", "", absl::string_view(src.data(), kBlock)}});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);

  std::unique_ptr<Child> pinner =
      Spawn({"hold-pin", daemon_->address(), "hold", "pinned"});
  ASSERT_EQ(pinner->ReadLine(), "HOLDING");
  std::unique_ptr<Child> reserver =
      Spawn({"hold-reservation", daemon_->address(), "hold", "1048576"});
  ASSERT_EQ(reserver->ReadLine(), "HOLDING");
  v1::StatsResponse held = Stats();
  EXPECT_EQ(held.pins(), 1u);
  EXPECT_EQ(held.reservations(), 1u);
  EXPECT_GE(held.reserved_bytes(), 1048576u);

  kill(pinner->pid, SIGKILL);
  kill(reserver->pid, SIGKILL);
  // Their leases are 60 s; the daemon notices the dead workers at once.
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) {
    return s.pins() == 0 && s.reservations() == 0 && s.reserved_bytes() == 0;
  })) << daemon_->Log();
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "UCX peer is gone"));
  // The daemon is fine and the block still there.
  std::vector<char> back(kBlock);
  ASSERT_OK(client_->RegisterBuffer(back.data(), back.size()));
  absl::string_view key = "pinned";
  absl::Span<char> span(back.data(), kBlock);
  TransferOp get = client_->GetIntoAsync("hold", {&key, 1}, {&span, 1});
  get.Wait();
  EXPECT_OK(get.statuses()[0]);
  EXPECT_EQ(back, src);
}

TEST_P(UcxE2eTest, AStalledClientsTransferEndsAtItsDeadlineAndItsSession) {
  // 64 MiB of blocks, far more than socket buffers or shared-memory queues
  // hold, pushed into a client that is stopped (SIGSTOP): its UCX worker
  // cannot take them, so the transfer must end by its deadline.
  constexpr int kBlocks = 32;
  constexpr size_t kBig = 2 << 20;
  std::vector<char> src(kBig, 'b');
  ASSERT_OK(client_->RegisterBuffer(src.data(), src.size()));
  std::vector<std::string> keys;
  for (int i = 0; i < kBlocks; ++i) {
    keys.push_back(absl::StrCat("big", i));
    BlockToPut b{keys.back(), "", absl::string_view(src.data(), kBig)};
    TransferOp put = client_->PutFromAsync("stall", {&b, 1});
    put.Wait();
    ASSERT_OK(put.statuses()[0]);
  }
  uint64_t session = 0, address = 0;
  std::unique_ptr<Child> peer =
      StoppedPeer("stall", kBlocks * kBig, &session, &address);
  ASSERT_NE(peer, nullptr);

  grpc::ClientContext ctx;
  v1::PushBlocksRequest req;
  req.set_session_id(session);
  req.set_namespace_("stall");
  for (int i = 0; i < kBlocks; ++i) {
    req.add_keys(keys[i]);
    v1::BufferRange* r = req.add_destinations();
    r->set_buffer_id(0);
    r->set_address(address + i * kBig);
    r->set_size(kBig);
  }
  req.set_timeout_ms(500);
  v1::PushBlocksResponse resp;
  // The call returns (it does not wait for the 60 s lease).
  ASSERT_TRUE(client_->stub().PushBlocks(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.blocks_size(), kBlocks);
  int failed = 0;
  for (const v1::BlockTransfer& b : resp.blocks()) failed += b.code() != 0;
  EXPECT_GT(failed, 0);  // the stalled client did not take every block
  // The daemon ended the stalled client's session.
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) {
    return s.sessions() == 1;  // only client_'s is left
  })) << daemon_->Log();
  // UCX kept writes of the transfer: over shared memory UCX 1.13 has no
  // peer error handling; over TCP the endpoint closed in order (a forced
  // close crashed the daemon in UCX in about 1 run of 12 once the client
  // continued). The daemon held the blocks they read from (pinned by itself
  // since before the transfer, so past the session's end) until UCX ended
  // them: here, once the client continued and took them.
  EXPECT_TRUE(testing::PollUntil([&] {
    return absl::StrContains(daemon_->Log(), "they stay pinned until UCX");
  })) << daemon_->Log();
  kill(peer->pid, SIGCONT);
  EXPECT_TRUE(testing::PollUntil([&] {
    return absl::StrContains(daemon_->Log(), "abandoned writes ended");
  })) << daemon_->Log();
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) { return s.pins() == 0; }));
  ASSERT_TRUE(daemon_->Running()) << daemon_->Log();
  const std::string scraped = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(scraped, "kvdepot_ucx_held_bytes"), 0.0)
      << "scraped " << scraped.size() << " bytes:\n" << scraped;
}

TEST_P(UcxE2eTest, AStalledClientsLateAnswersLandInNoOtherBlock) {
  // The daemon reads a put's blocks from a client that is stopped
  // (SIGSTOP): the transfer ends at its deadline and the session with it.
  // UCX keeps the daemon's read requests after that, and the daemon holds
  // the slots they would write into until UCX ends them. Over shared memory
  // (UCX 1.13 has no peer error handling there) that is when the session's
  // own worker is destroyed, 1 s after the session ended: blocks stored
  // after that take those slots. Over TCP the endpoint closed in order, and
  // the reads end once the client continues and answers. Either way nothing
  // of the client's late answers may land in another block.
  constexpr int kLate = 32;
  constexpr size_t kBig = 2 << 20;
  uint64_t session = 0, address = 0;
  std::unique_ptr<Child> peer =
      StoppedPeer("late", kLate * kBig, &session, &address);
  ASSERT_NE(peer, nullptr);

  EXPECT_GT(PutFromStoppedPeer(session, address, "late", kLate, kBig), 0)
      << "the stalled client gave every block";
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) {
    return s.sessions() == 1 && s.reservations() == 0;
  })) << daemon_->Log();
  EXPECT_TRUE(testing::PollUntil([&] {
    return absl::StrContains(daemon_->Log(), "memory stays allocated");
  })) << daemon_->Log();
  auto reads_ended = [&] {
    return testing::PollUntil([&] {
      return absl::StrContains(daemon_->Log(), "abandoned reads ended");
    });
  };
  if (GetParam() == "shm") {
    EXPECT_TRUE(reads_ended()) << daemon_->Log();
  }

  // Blocks stored now: 160 MiB of the 256 MiB DRAM, in the late slots too.
  constexpr int kStored = 80;
  std::vector<char> src(kStored * kBig);
  for (size_t i = 0; i < src.size(); i += 4096) {
    std::snprintf(src.data() + i, 4096, "block %zu offset %zu", i / kBig, i);
  }
  ASSERT_OK(client_->RegisterBuffer(src.data(), src.size()));
  std::vector<std::string> keys;
  std::vector<BlockToPut> blocks;
  for (int i = 0; i < kStored; ++i) keys.push_back(absl::StrCat("stored", i));
  for (int i = 0; i < kStored; ++i) {
    blocks.push_back(BlockToPut{keys[i], "",
                                absl::string_view(src.data() + i * kBig, kBig)});
  }
  TransferOp put = client_->PutFromAsync("late", blocks);
  put.Wait();
  for (int i = 0; i < kStored; ++i) ASSERT_OK(put.statuses()[i]) << i;

  // The client continues and answers; time for its answers to arrive.
  kill(peer->pid, SIGCONT);
  absl::SleepFor(absl::Seconds(2));
  // Answering a daemon worker that is gone (or an endpoint closing) did not
  // harm the client either, nor the daemon.
  EXPECT_EQ(waitpid(peer->pid, nullptr, WNOHANG), 0) << "the client died";
  ASSERT_TRUE(daemon_->Running()) << daemon_->Log();
  EXPECT_TRUE(reads_ended()) << daemon_->Log();
  const std::string scraped = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(scraped, "kvdepot_ucx_held_bytes"), 0.0)
      << "scraped " << scraped.size() << " bytes:\n" << scraped;

  std::vector<char> back(src.size(), 0);
  ASSERT_OK(client_->RegisterBuffer(back.data(), back.size()));
  std::vector<absl::string_view> views(keys.begin(), keys.end());
  std::vector<absl::Span<char>> dst;
  for (int i = 0; i < kStored; ++i) dst.emplace_back(back.data() + i * kBig, kBig);
  TransferOp get = client_->GetIntoAsync("late", views, dst);
  get.Wait();
  int lost = 0;
  for (int i = 0; i < kStored; ++i) {
    if (!get.statuses()[i].ok() ||
        std::memcmp(back.data() + i * kBig, src.data() + i * kBig, kBig) != 0) {
      ++lost;
      ADD_FAILURE() << "block " << i << ": " << get.statuses()[i];
    }
  }
  EXPECT_EQ(lost, 0) << daemon_->Log();
}

TEST_P(UcxE2eTest, AGetThatFailedWritesNothingIntoTheClientsBufferAfterwards) {
  // A libkvdepot client (a ucx_client_peer process) gets 64 MiB into
  // memory it registered itself and stops (SIGSTOP) once the first block
  // has landed, until well past the transfer's deadline. The get then
  // fails; from the moment the client reports that, nothing more may be
  // written into its buffer (the caller owns it again), although the
  // daemon's UCX may still hold writes of the transfer for it (over shared
  // memory it cannot take them back). The client's next get works.
  std::unique_ptr<Child> peer = StoppedLateGet("lateget", 32, 2 << 20);
  ASSERT_NE(peer, nullptr);
  // Past the daemon's deadline (500 ms) and its giving up on UCX (1 s
  // later): the daemon has answered that the blocks failed.
  absl::SleepFor(absl::Milliseconds(2500));
  kill(peer->pid, SIGCONT);
  const std::string result = peer->ReadLine();
  int failed = -1, recovered = -1;
  size_t changed = 0;
  ASSERT_EQ(std::sscanf(result.c_str(), "RESULT %d %zu %d", &failed, &changed,
                        &recovered),
            3)
      << "the peer said: " << result;
  EXPECT_GT(failed, 0) << "the whole get arrived in time: nothing was tested";
  EXPECT_EQ(changed, 0u) << "bytes written into the buffer after the get failed";
  EXPECT_EQ(recovered, 1) << "the next get did not bring every block";
  EXPECT_EQ(peer->Wait(), 0);
  // The daemon saw the client's first worker go; it is unharmed.
  EXPECT_OK(client_->Health());
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

TEST_P(UcxE2eTest, ClientsKilledAfterTheDaemonGaveUpOnTheirGetLeaveItServing) {
  // As above, but the client is killed instead of continued, once the
  // daemon has given up on the get and dropped its endpoint to it (an
  // engine that hung, then was killed). A client that *destroys its
  // worker* at that moment can crash UCX 1.13 in kvdepotd (transport/
  // README, caveat 2; libkvdepot waits 30 s); a killed one did not, in 24
  // tries here: this keeps it so.
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<Child> peer =
        StoppedLateGet(absl::StrCat("killed", i, "-"), 32, 2 << 20);
    ASSERT_NE(peer, nullptr);
    absl::SleepFor(absl::Milliseconds(2500));
    kill(peer->pid, SIGKILL);
    peer->Wait();
    ASSERT_OK(client_->Health()) << "after client " << i << "\n" << daemon_->Log();
  }
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

// CPU seconds process `pid` has used (user + system), from /proc.
double CpuSeconds(pid_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[1024] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  // Fields after the command name (which may hold spaces): state is the
  // 3rd field, utime and stime the 14th and 15th.
  const char* rest = std::strrchr(buf, ')');
  unsigned long utime = 0, stime = 0;
  if (n == 0 || rest == nullptr ||
      std::sscanf(rest + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",
                  &utime, &stime) != 2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

// Threads of process `pid` whose name starts with `prefix`.
int ThreadsNamed(pid_t pid, absl::string_view prefix) {
  int n = 0;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  for (const auto& task : std::filesystem::directory_iterator(dir)) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (std::getline(comm, name) && absl::StartsWith(name, prefix)) ++n;
  }
  return n;
}

// The daemon's gauge `name` (the UCX ones are updated once a second), once
// it is `want` or after 5 s.
double GaugeOnceItIs(const DaemonProcess& daemon, const std::string& name,
                     double want) {
  double v = -1;
  testing::PollUntil(
      [&] {
        v = testing::MetricValue(testing::ScrapeMetrics(daemon), name);
        return v == want;
      },
      absl::Seconds(5), absl::Milliseconds(100));
  return v;
}

double ColocatedWorkersGauge(const DaemonProcess& daemon, double want) {
  return GaugeOnceItIs(daemon, "kvdepot_ucx_colocated_workers", want);
}

// Clients that stop (SIGSTOP) right after sending a put with its bytes
// (ucx_client_peer stall-put): the daemon asked for the bytes, which never
// come. The receive ends at the put's deadline; its slot stays held while
// UCX may still write into it, and is free again once the client is gone.
// A client still stopped when the daemon stops does not crash it (UCX 1.13
// aborts when a worker goes with a rendezvous receive pending on an
// endpoint it did not close; the daemon closes its request links first).
TEST_P(UcxE2eTest, ClientsStoppedMidPutWithTheirBytesHoldNothingOnceGone) {
  if (GetParam() == "shm") {
    // UCX may then fetch the bytes itself (cma: it reads the stopped
    // process's memory), and the put succeeds.
    GTEST_SKIP() << "over shared memory the bytes need not wait for the sender";
  }
  ASSERT_OK(client_->EnsureSession().status());
  constexpr size_t kSize = 1 << 20;
  std::vector<std::unique_ptr<Child>> peers;
  for (const char* ns : {"sp-killed", "sp-left"}) {
    peers.push_back(Spawn({"stall-put", daemon_->address(), ns,
                           std::to_string(kSize), "300"}));
    std::string line;
    for (int i = 0; i < 50 && line != "SENT"; ++i) {
      line = peers.back()->ReadLine();
      if (line.empty()) break;  // EOF: it ended
    }
    ASSERT_EQ(line, "SENT") << ns;
  }
  // Past the deadline the puts ended: nothing reserved. A put whose bytes
  // never came failed, and its slot stays held while UCX may still write
  // into it. (Rarely the bytes were out before the client stopped: that
  // put succeeded, and holds nothing.)
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) {
    return s.reservations() == 0;
  })) << daemon_->Log();
  std::vector<bool> stored;
  for (const char* key : {"sp-killed0", "sp-left0"}) {
    absl::string_view k = key;
    absl::StatusOr<LookupReply> r =
        client_->Lookup(absl::string_view(key).substr(0, std::strlen(key) - 1),
                        {&k, 1}, false, false);
    ASSERT_OK(r.status());
    stored.push_back(r->entries[0].found);
  }
  const double held = kSize * ((stored[0] ? 0 : 1) + (stored[1] ? 0 : 1));
  EXPECT_EQ(GaugeOnceItIs(*daemon_, "kvdepot_ucx_held_bytes", held), held);
  // One client is killed: its request link fails, and UCX ends its receive.
  kill(peers[0]->pid, SIGKILL);
  const double left = stored[1] ? 0 : kSize;
  EXPECT_EQ(GaugeOnceItIs(*daemon_, "kvdepot_ucx_held_bytes", left), left)
      << daemon_->Log();
  // The other is still stopped when the daemon stops: a clean exit.
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

TEST_P(UcxE2eTest, AKilledClientLeavesNothingForTheDaemonToSpinOn) {
  // A client (ucx_client_peer late-get, 5 s allowed) stops in the middle
  // of a 64 MiB get, so the daemon's UCX holds writes for it that it does
  // not take; then it is killed. The daemon ends its session at once, and
  // then goes idle: what UCX still held for the dead client goes with it,
  // rather than keeping a progress thread busy retrying sends nobody will
  // take (over shared memory it spun a core, for good, before).
  // Co-located clients over shared memory have a worker of their own in
  // the daemon (client_ is one, too).
  ASSERT_OK(client_->EnsureSession().status());
  const int own_workers = ThreadsNamed(daemon_->pid(), "kvd-sess-");
  EXPECT_EQ(own_workers, GetParam() == "shm" ? 1 : 0);
  std::unique_ptr<Child> peer = StoppedLateGet("spin", 32, 2 << 20, 5000);
  ASSERT_NE(peer, nullptr);
  const int with_peer = own_workers + (GetParam() == "shm" ? 1 : 0);
  EXPECT_EQ(ThreadsNamed(daemon_->pid(), "kvd-sess-"), with_peer);
  EXPECT_EQ(ColocatedWorkersGauge(*daemon_, with_peer), with_peer);
  kill(peer->pid, SIGKILL);
  EXPECT_NE(peer->Wait(), 0);
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) {
    return s.sessions() == 1;  // client_'s
  })) << daemon_->Log();
  // The dead client's worker goes (after UCX's close of its endpoint has
  // had its time, 1 s).
  testing::PollUntil([&] {
    return ThreadsNamed(daemon_->pid(), "kvd-sess-") <= own_workers;
  });
  EXPECT_EQ(ThreadsNamed(daemon_->pid(), "kvd-sess-"), own_workers);
  EXPECT_EQ(ColocatedWorkersGauge(*daemon_, own_workers), own_workers);
  // The dead client's remote keys went before its worker (UCX warns of
  // those that outlive it).
  EXPECT_FALSE(absl::StrContains(daemon_->Log(), "mpool ucp_rkeys"))
      << daemon_->Log();
  absl::SleepFor(absl::Milliseconds(500));  // what the loss set off
  const double before = CpuSeconds(daemon_->pid());
  absl::SleepFor(absl::Seconds(3));
  const double used = CpuSeconds(daemon_->pid()) - before;
  ASSERT_GE(before, 0);
  // Idle, it uses a few hundredths; a spinning thread takes a core (here,
  // with other tests running, at least half of one).
  EXPECT_LT(used, 0.5) << "kvdepotd used " << used
                       << " CPU seconds in 3 s with no client busy\n"
                       << daemon_->Log();
  EXPECT_OK(client_->Health());
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

TEST_P(UcxE2eTest, ADaemonMovingBytesForAStoppedClientStopsCleanly) {
  // SIGTERM while the daemon puts from a stopped client (SIGSTOP), the
  // put allowed 120 s and the drain 1 s: the daemon drains, cuts the put
  // short (it ends failed), and exits 0 well before the put's deadline,
  // whatever UCX still holds for that client (over shared memory, reads on
  // the session's own worker, which goes with it). (gRPC's Shutdown waits
  // for every call; the put's call ended only at its transfer's deadline
  // when the data plane was closed after it.)
  const std::string dir = testing::MakeTempDir("slowput");
  std::ofstream(dir + "/kvdepot.yaml") << "drain_timeout: 1s\n"
                                          "ucx_transfer_timeout: 120s\n";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
      {"--config", dir + "/kvdepot.yaml", "--dram-capacity", "256MiB"});
  ASSERT_OK(d.status());
  daemon_ = *std::move(d);
  client_ = NewClient();
  ASSERT_NE(client_, nullptr);
  constexpr int kBlocks = 8;
  constexpr size_t kBig = 2 << 20;
  uint64_t session = 0, address = 0;
  std::unique_ptr<Child> peer =
      StoppedPeer("held", kBlocks * kBig, &session, &address);
  ASSERT_NE(peer, nullptr);
  grpc::Status answer;
  v1::PullBlocksResponse resp;
  std::thread put([&] {
    grpc::ClientContext ctx;
    v1::PullBlocksRequest req;
    req.set_session_id(session);
    req.set_namespace_("held");
    const std::string stalled(kBig, 's');  // what the peer's buffer holds
    for (int i = 0; i < kBlocks; ++i) {
      v1::PullSpec* b = req.add_blocks();
      b->set_key(absl::StrCat("held", i));
      b->set_checksum(BlockChecksum(stalled));
      b->mutable_source()->set_buffer_id(0);
      b->mutable_source()->set_address(address + i * kBig);
      b->mutable_source()->set_size(kBig);
    }
    req.set_timeout_ms(120000);
    answer = client_->stub().PullBlocks(&ctx, req, &resp);
  });
  // The put is under way: its slots are reserved.
  EXPECT_TRUE(StatsBecome([](const v1::StatsResponse& s) {
    return s.reservations() > 0;
  })) << daemon_->Log();
  absl::StatusOr<int> code = daemon_->Stop(SIGTERM, absl::Seconds(30));
  put.join();
  ASSERT_OK(code.status()) << daemon_->Log();
  EXPECT_EQ(*code, 0) << daemon_->Log();
  // Cut short: blocks that failed, or the call cancelled by the shutdown.
  if (answer.ok()) {
    int failed = 0;
    for (const v1::BlockTransfer& b : resp.blocks()) failed += b.code() != 0;
    EXPECT_GT(failed, 0) << "the stopped client gave every block";
  } else {
    EXPECT_EQ(answer.error_code(), grpc::StatusCode::CANCELLED) << answer.error_message();
  }
}

TEST_P(UcxE2eTest, RestartedDaemonGivesMissesThenTheClientReconnects) {
  std::vector<char> buf(2 * kBlock, 'r');
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  BlockToPut block{"r0", "", absl::string_view(buf.data(), kBlock)};
  absl::string_view key = "r0";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  TransferOp put = client_->PutFromAsync("restart", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);

  const std::string address = daemon_->address();
  const std::string dir = daemon_->data_dir();
  ASSERT_OK(daemon_->Stop(SIGKILL).status());
  daemon_.reset();
  TransferOp miss = client_->GetIntoAsync("restart", {&key, 1}, {&dst, 1});
  ASSERT_TRUE(miss.WaitUntil(absl::Now() + absl::Seconds(40)));  // never hangs
  EXPECT_FALSE(miss.statuses()[0].ok());

  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--dram-capacity", "256MiB"}, dir, address);
  ASSERT_OK(d.status());
  daemon_ = *std::move(d);
  // The first call may find its session gone (a miss, and the session is
  // dropped); a later one opens a new session with a new endpoint.
  // (gRPC's channel may also wait out its reconnect backoff first.)
  bool reconnected = false;
  absl::Status last;
  for (absl::Time end = absl::Now() + absl::Seconds(30);
       !reconnected && absl::Now() < end;) {
    TransferOp p = client_->PutFromAsync("restart", {&block, 1});
    p.Wait();
    last = p.statuses()[0];
    if (!last.ok()) {
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    std::fill(dst.begin(), dst.end(), 0);
    TransferOp g = client_->GetIntoAsync("restart", {&key, 1}, {&dst, 1});
    g.Wait();
    reconnected = g.statuses()[0].ok() && std::string(g.transport()) == "ucx";
  }
  EXPECT_TRUE(reconnected) << last << "\n" << daemon_->Log();
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 'r'), static_cast<long>(kBlock));
}

// A warm restart under a client that holds a session: the daemon answers
// its next get "unknown session" (NOT_FOUND for the whole request), which
// is no statement about the key. The block stays stored, so the get must
// not say "not stored" (a per-block NOT_FOUND, which GetInto and the
// connectors take for a miss of that key): it says the session went.
TEST_P(UcxE2eTest, AGetAfterAWarmRestartIsNoFalseNotStored) {
  // Requests as gRPC calls: a UCX request link to the daemon that went
  // would tell the client its session went too.
  client_ = NewClient(/*ucx_requests=*/false);
  ASSERT_NE(client_, nullptr);
  std::vector<char> buf(2 * kBlock, 'w');
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  BlockToPut block{"w0", "", absl::string_view(buf.data(), kBlock)};
  absl::string_view key = "w0";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  TransferOp put = client_->PutFromAsync("warm", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);

  const std::string address = daemon_->address();
  const std::string dir = daemon_->data_dir();
  ASSERT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0);  // kept on NVMe
  daemon_.reset();
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--dram-capacity", "256MiB"}, dir, address);
  ASSERT_OK(d.status());
  daemon_ = *std::move(d);
  // The channel reconnected (a call without a session), the session not.
  absl::Status health;
  for (absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(100))) {
    if ((health = client_->Health()).ok()) break;
  }
  ASSERT_OK(health);
  std::fill(dst.begin(), dst.end(), 0);
  TransferOp first = client_->GetIntoAsync("warm", {&key, 1}, {&dst, 1});
  first.Wait();
  const absl::Status st = first.statuses()[0];
  EXPECT_FALSE(absl::IsNotFound(st)) << st;
  EXPECT_FALSE(absl::IsUnavailable(st)) << st;  // the daemon answered
  // And the next get opens a session and reads it.
  bool read = st.ok();
  for (absl::Time end = absl::Now() + absl::Seconds(30);
       !read && absl::Now() < end; absl::SleepFor(absl::Milliseconds(100))) {
    TransferOp g = client_->GetIntoAsync("warm", {&key, 1}, {&dst, 1});
    g.Wait();
    read = g.statuses()[0].ok();
  }
  EXPECT_TRUE(read);
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 'w'), static_cast<long>(kBlock));
}

// One put and one get of a block in `buf` (2 blocks: source, destination)
// through `client`; every byte checked.
// Puts the block at the start of `buf` under `key`, gets it into the block
// after, checks the bytes, and that the get took `transport`.
void PutThenGet(Client& client, std::vector<char>& buf, absl::string_view key,
                const char* transport = "ucx") {
  BlockToPut block{key, "", absl::string_view(buf.data(), kBlock)};
  TransferOp put = client.PutFromAsync("req", {&block, 1});
  put.Wait();
  EXPECT_OK(put.statuses()[0]);
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  std::fill(dst.begin(), dst.end(), 0);
  TransferOp get = client.GetIntoAsync("req", {&key, 1}, {&dst, 1});
  get.Wait();
  EXPECT_OK(get.statuses()[0]);
  EXPECT_STREQ(get.transport(), transport);
  EXPECT_EQ(std::memcmp(buf.data(), dst.data(), kBlock), 0);
}

TEST_P(UcxE2eTest, RequestsTravelAsUcxMessagesUnlessTheClientAsksForGrpc) {
  const std::string push_ucx = "kvdepot_ucx_requests_total{op=\"PushBlocks\"}";
  const std::string pull_ucx = "kvdepot_ucx_requests_total{op=\"PullBlocks\"}";
  const std::string pull_data =
      "kvdepot_ucx_requests_total{op=\"PullBlocksWithData\"}";
  const std::string push_all = "kvdepot_requests_total{code=\"OK\",op=\"PushBlocks\"}";
  const std::string pull_all = "kvdepot_requests_total{code=\"OK\",op=\"PullBlocks\"}";
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 7);
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*client_, buf, "m0");  // the daemon reads the put's block
  std::string metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(metrics, push_ucx), 1) << metrics;
  EXPECT_EQ(testing::MetricValue(metrics, pull_ucx), 1);
  EXPECT_EQ(testing::MetricValue(metrics, pull_data), 0);
  EXPECT_EQ(testing::MetricValue(metrics, push_all), 1);
  EXPECT_EQ(testing::MetricValue(metrics, pull_all), 1);

  // With data requests the put's bytes go with it (remote clients only:
  // a co-located one's AllocateBuffer blocks are copied in place).
  std::unique_ptr<Client> sent = NewClient(true, "", /*data_requests=*/true);
  ASSERT_NE(sent, nullptr);
  ASSERT_OK(sent->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*sent, buf, "m2");
  metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(metrics, pull_data), 1);
  EXPECT_EQ(testing::MetricValue(metrics, pull_ucx), 1);  // as before
  EXPECT_EQ(testing::MetricValue(metrics, push_ucx), 2);
  sent.reset();

  std::unique_ptr<Client> grpc_requests = NewClient(/*ucx_requests=*/false);
  ASSERT_NE(grpc_requests, nullptr);
  ASSERT_OK(grpc_requests->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*grpc_requests, buf, "m1");
  metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(metrics, push_ucx), 2);  // as before
  EXPECT_EQ(testing::MetricValue(metrics, pull_ucx), 1);
  EXPECT_EQ(testing::MetricValue(metrics, pull_data), 1);
  EXPECT_EQ(testing::MetricValue(metrics, push_all), 3);  // a gRPC call
}

// A daemon (64 MiB of DRAM) whose config file sets ucx_colocated_workers;
// null (a test failure added) when it does not start.
std::unique_ptr<DaemonProcess> StartWithColocatedWorkers(int workers) {
  const std::string dir = testing::MakeTempDir("colocated");
  std::ofstream(dir + "/kvdepot.yaml") << "ucx_colocated_workers: " << workers << "\n";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
      {"--config", dir + "/kvdepot.yaml", "--dram-capacity", "64MiB"});
  if (!d.ok()) {
    ADD_FAILURE() << "kvdepotd: " << d.status();
    return nullptr;
  }
  return *std::move(d);
}

TEST_P(UcxE2eTest, CoLocatedClientsBeyondTheWorkerLimitAreServedOverTcp) {
  // A daemon that gives one co-located client a UCX worker of its own
  // (ucx_colocated_workers: 1): a second one is served over TCP on the
  // shared workers, every byte intact; once the first has gone, the next
  // one gets a worker again.
  if (GetParam() != "shm") GTEST_SKIP() << "no co-located workers over TCP";
  std::unique_ptr<DaemonProcess> d = StartWithColocatedWorkers(1);
  ASSERT_NE(d, nullptr);
  DaemonProcess& daemon = *d;
  auto own_workers = [&] { return ThreadsNamed(daemon.pid(), "kvd-sess-"); };

  std::unique_ptr<Client> first = NewClient(true, daemon.address());
  ASSERT_NE(first, nullptr);
  ASSERT_OK(first->EnsureSession().status());
  EXPECT_EQ(own_workers(), 1);
  std::unique_ptr<Client> second = NewClient(true, daemon.address());
  ASSERT_NE(second, nullptr);
  ASSERT_OK(second->EnsureSession().status());
  EXPECT_EQ(own_workers(), 1);
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "serving it over TCP"))
      << daemon.Log();
  EXPECT_EQ(ColocatedWorkersGauge(daemon, 1), 1);  // the one over TCP has none
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 11);
  ASSERT_OK(second->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*second, buf, "over-tcp");
  ASSERT_OK(first->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*first, buf, "own-worker");

  first.reset();  // closes its session; its worker goes
  testing::PollUntil([&] { return own_workers() == 0; });
  EXPECT_EQ(own_workers(), 0);
  EXPECT_EQ(ColocatedWorkersGauge(daemon, 0), 0);
  std::unique_ptr<Client> third = NewClient(true, daemon.address());
  ASSERT_NE(third, nullptr);
  ASSERT_OK(third->EnsureSession().status());
  EXPECT_EQ(own_workers(), 1);
  ASSERT_OK(third->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*third, buf, "own-worker-again");
  EXPECT_EQ(daemon.Stop(SIGTERM).value_or(-1), 0) << daemon.Log();
}

TEST_P(UcxE2eTest, NoOwnWorkersMeansCoLocatedClientsAreServedOverTcp) {
  // ucx_colocated_workers: 0 -- every co-located client shares the
  // daemon's workers, over TCP (no shared memory without a worker of its
  // own); its bytes arrive intact, and the daemon says why once per client.
  if (GetParam() != "shm") GTEST_SKIP() << "no co-located workers over TCP";
  std::unique_ptr<DaemonProcess> d = StartWithColocatedWorkers(0);
  ASSERT_NE(d, nullptr);
  DaemonProcess& daemon = *d;
  std::unique_ptr<Client> client = NewClient(true, daemon.address());
  ASSERT_NE(client, nullptr);
  ASSERT_OK(client->EnsureSession().status());
  EXPECT_OK(client->data_plane_status());
  EXPECT_EQ(ThreadsNamed(daemon.pid(), "kvd-sess-"), 0);
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "(ucx_colocated_workers: 0); "
                                              "serving it over TCP"))
      << daemon.Log();
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 12);
  ASSERT_OK(client->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*client, buf, "shared-workers");
  EXPECT_EQ(ColocatedWorkersGauge(daemon, 0), 0);
  client.reset();
  EXPECT_EQ(daemon.Stop(SIGTERM).value_or(-1), 0) << daemon.Log();
}

TEST_P(UcxE2eTest, AClientWhoseTcpSegmentsDoNotFitIsServedOverGrpc) {
  // A client whose UCX would send TCP segments larger than the daemon
  // takes (1m against 512k): UCX 1.13 would abort the daemon at its first
  // put. The daemon makes no UCX endpoint for it and says why; the client
  // uses the gRPC byte path, every byte intact, and the daemon stays up.
  ClientOptions options;
  options.server = daemon_->address();
  options.lease = absl::Seconds(60);
  options.ucx = {{"TCP_TX_SEG_SIZE", "1m"}, {"TCP_RX_SEG_SIZE", "1m"}};
  absl::StatusOr<std::unique_ptr<Client>> big = Client::Connect(options);
  ASSERT_OK(big.status());
  ASSERT_OK((*big)->EnsureSession().status());
  EXPECT_THAT((*big)->data_plane_status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(absl::StrContains((*big)->data_plane_status().message(),
                                "TCP_TX_SEG_SIZE"))
      << (*big)->data_plane_status();
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "do not fit kvdepotd's"))
      << daemon_->Log();
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 13);
  BlockToPut block{"big-segments", "", absl::string_view(buf.data(), kBlock)};
  absl::string_view key = "big-segments";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  TransferOp put = (*big)->PutFromAsync("seg", {&block, 1});
  put.Wait();
  EXPECT_OK(put.statuses()[0]);
  TransferOp get = (*big)->GetIntoAsync("seg", {&key, 1}, {&dst, 1});
  get.Wait();
  EXPECT_OK(get.statuses()[0]);
  EXPECT_STREQ(get.transport(), "grpc");
  EXPECT_EQ(std::memcmp(buf.data(), dst.data(), kBlock), 0);
  EXPECT_OK(client_->Health());
}

// A daemon whose config says `ucx: {TLS: tcp, NET_DEVICES: lo}` (its
// clients are served as remote ones, over TCP), with `dram` of DRAM, and a
// client of it over UCX/TCP with libkvdepot's other defaults.
struct TcpDaemonAndClient {
  std::unique_ptr<DaemonProcess> daemon;
  std::unique_ptr<Client> client;
};
absl::StatusOr<TcpDaemonAndClient> StartTcpDaemonAndClient(const std::string& dram) {
  const std::string dir = testing::MakeTempDir("tcpcfg");
  std::ofstream(dir + "/kvdepot.yaml") << "ucx:\n  TLS: tcp\n  NET_DEVICES: lo\n";
  TcpDaemonAndClient out;
  ASSIGN_OR_RETURN(out.daemon,
                   DaemonProcess::Start({"--config", dir + "/kvdepot.yaml",
                                         "--dram-capacity", dram}));
  ClientOptions options;
  options.server = out.daemon->address();
  options.ucx["TLS"] = "tcp";
  options.ucx["NET_DEVICES"] = "lo";
  ASSIGN_OR_RETURN(out.client, Client::Connect(options));
  return out;
}

TEST(UcxE2eConfigTest, ADaemonConfiguredForTcpServesDefaultClientsOverUcx) {
  // `ucx: {TLS: tcp}` in the config keeps the daemon's TCP segment sizes
  // (the settings go over the defaults), so a client with libkvdepot's
  // defaults is served over UCX. (Before, the mapping replaced the
  // defaults, and UCX aborted the daemon at the client's first put.)
  absl::StatusOr<TcpDaemonAndClient> t = StartTcpDaemonAndClient("64MiB");
  ASSERT_OK(t.status());
  std::unique_ptr<DaemonProcess>& d = t->daemon;
  std::unique_ptr<Client>& c = t->client;
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 17);
  ASSERT_OK(c->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*c, buf, "tcp-config");
  EXPECT_OK(c->data_plane_status());
  EXPECT_EQ(d->Stop(SIGTERM).value_or(-1), 0) << d->Log();
}

TEST(UcxE2eConfigTest, ADaemonWhoseUcxSettingsLeaveNoTransportServesOverGrpc) {
  // UCX finds nothing to use: kvdepotd runs without its data plane (it
  // crashed while giving up on it) and clients fall back to gRPC.
  const std::string dir = testing::MakeTempDir("notls");
  std::ofstream(dir + "/kvdepot.yaml") << "ucx:\n  TLS: no_such_transport\n";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--config", dir + "/kvdepot.yaml"});
  ASSERT_OK(d.status());
  EXPECT_THAT((*d)->Log(), ::testing::HasSubstr("UCX data plane off"));
  ClientOptions options;
  options.server = (*d)->address();
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  ASSERT_OK(c.status());
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 22);
  ASSERT_OK((*c)->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(**c, buf, "no-ucx", "grpc");
  EXPECT_EQ((*d)->Stop(SIGTERM).value_or(-1), 0) << (*d)->Log();
}

TEST(UcxE2eConfigTest, PutsOverUcxThatOverfillDramWaitForRoomAndLoseNothing) {
  // DRAM of 8 MiB, the NVMe tier on (the default): puts of 24 MiB over UCX,
  // 6 MiB per call, find DRAM full again and again. A put request served
  // on the daemon's request worker does not wait for the evictor there; it
  // waits for room elsewhere, and every block is stored and reads back
  // intact.
  // UCX over TCP only: the client is served as a remote one.
  absl::StatusOr<TcpDaemonAndClient> t = StartTcpDaemonAndClient("8MiB");
  ASSERT_OK(t.status());
  std::unique_ptr<DaemonProcess>& d = t->daemon;
  std::unique_ptr<Client>& c = t->client;
  constexpr int kBlocks = 96, kBatch = 24;
  std::vector<char> src(kBlocks * kBlock), dst(kBlock);
  for (int i = 0; i < kBlocks; ++i) ucx_test::FillPattern(&src[i * kBlock], kBlock, i);
  ASSERT_OK(c->RegisterBuffer(src.data(), src.size()));
  ASSERT_OK(c->RegisterBuffer(dst.data(), dst.size()));
  std::vector<std::string> keys;
  for (int i = 0; i < kBlocks; ++i) keys.push_back("fill" + std::to_string(i));
  for (int b = 0; b < kBlocks; b += kBatch) {
    std::vector<BlockToPut> puts;
    for (int i = b; i < b + kBatch; ++i) {
      puts.push_back({keys[i], "", absl::string_view(&src[i * kBlock], kBlock)});
    }
    TransferOp put = c->PutFromAsync("fill", puts);
    put.Wait();
    EXPECT_STREQ(put.transport(), "ucx");
    for (int i = 0; i < kBatch; ++i) EXPECT_OK(put.statuses()[i]) << b + i;
  }
  for (int i = 0; i < kBlocks; ++i) {
    absl::string_view key = keys[i];
    absl::Span<char> out(dst.data(), kBlock);
    TransferOp get = c->GetIntoAsync("fill", {&key, 1}, {&out, 1});
    get.Wait();
    ASSERT_OK(get.statuses()[0]) << i;
    EXPECT_EQ(ucx_test::FirstPatternMismatch(dst.data(), kBlock, i), -1) << i;
  }
  EXPECT_EQ(d->Stop(SIGTERM).value_or(-1), 0) << d->Log();
}

TEST_P(UcxE2eTest, ARequestForASessionTheDaemonClosedIsAMissThenTheClientRecovers) {
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 8);
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*client_, buf, "c0");
  // The session ends behind the client's back (as at lease expiry): the
  // daemon has no endpoint for it when the next request comes.
  absl::StatusOr<uint64_t> session = client_->EnsureSession();
  ASSERT_OK(session.status());
  grpc::ClientContext ctx;
  v1::CloseSessionRequest close;
  close.set_session_id(*session);
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(client_->stub().CloseSession(&ctx, close, &closed).ok());
  absl::string_view key = "c0";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  TransferOp miss = client_->GetIntoAsync("req", {&key, 1}, {&dst, 1});
  ASSERT_TRUE(miss.WaitUntil(absl::Now() + absl::Seconds(30)));
  // Not NOT_FOUND, which says the key is not stored, nor UNAVAILABLE,
  // which says the daemon is down: the session went (ABORTED).
  EXPECT_THAT(miss.statuses()[0], StatusIs(absl::StatusCode::kAborted));
  // The client dropped the session; the next call opens a new one.
  std::fill(dst.begin(), dst.end(), 0);
  TransferOp get = client_->GetIntoAsync("req", {&key, 1}, {&dst, 1});
  get.Wait();
  EXPECT_OK(get.statuses()[0]);
  EXPECT_EQ(std::memcmp(buf.data(), dst.data(), kBlock), 0);
  EXPECT_NE(*client_->EnsureSession(), *session);
  const std::string metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_ucx_requests_total{op=\"PushBlocks\"}"),
            2);  // the refused one never reached the service
}

TEST_P(UcxE2eTest, ClientsThatDieAsTheirFirstRequestGoesOutLeaveTheDaemonServing) {
  // A client's first request over UCX makes UCX resolve the client's
  // endpoint on the daemon's side. kvdepotd used to answer it by wiring up
  // a connection of its own back to the client, and a client that died
  // before that was done aborted kvdepotd inside UCX 1.13 (an assertion on
  // the request worker, "got REP message"): here within the first four of
  // these clients. Each is slow (2 ms between its UCX progress calls, as on a
  // busy host) and ends a different time (0-8 ms) after the first request
  // of its last session.
  // Half the clients die in their first session, half in their second:
  // the first checks the daemon's request links, the second that the
  // client keeps its request connection across sessions (a new one per
  // session would be wired up, daemon's answer and all, again).
  constexpr int kClients = 40;
  for (int i = 0; i < kClients; ++i) {
    const std::string sessions = i % 2 == 0 ? "1" : "2";
    std::unique_ptr<Child> peer = Spawn({"wire-and-die", daemon_->address(), sessions,
                                         std::to_string(i / 2 * 400)});
    ASSERT_NE(peer, nullptr);
    ASSERT_EQ(peer->Wait(), 0) << "client " << i << " (" << sessions
                               << " sessions); kvdepotd:\n" << daemon_->Log();
  }
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 21);
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*client_, buf, "after-dead-clients");
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

TEST_P(UcxE2eTest, AClientWorkerHasOneRequestLinkForAllItsSessionsUntilItGoes) {
  // The daemon's request worker keeps one endpoint per client worker (its
  // request link), which the client's one request connection pairs with,
  // whatever the number of sessions; it goes when the client does.
  const std::string links = "kvdepot_ucx_request_links";
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 23);
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  for (int s = 0; s < 3; ++s) {
    PutThenGet(*client_, buf, "link" + std::to_string(s));
    ASSERT_OK(client_->CloseSession());  // the next call opens another
  }
  std::unique_ptr<Client> second = NewClient();
  ASSERT_NE(second, nullptr);
  ASSERT_OK(second->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*second, buf, "link-second");
  EXPECT_EQ(GaugeOnceItIs(*daemon_, links, 2), 2);
  const std::string metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_ucx_requests_total{op=\"PushBlocks\"}"),
            4);  // every get went as a UCX request
  second.reset();
  client_.reset();
  EXPECT_EQ(GaugeOnceItIs(*daemon_, links, 0), 0);
}

TEST_P(UcxE2eTest, ADrainingDaemonRefusesPutsAndTheClientKeepsItsSession) {
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 9);
  ASSERT_OK(client_->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(*client_, buf, "d0");
  absl::StatusOr<uint64_t> session = client_->EnsureSession();
  ASSERT_OK(session.status());
  auto set_draining = [&](bool draining) {
    grpc::ClientContext ctx;
    v1::SetDrainingRequest req;
    req.set_draining(draining);
    v1::SetDrainingResponse resp;
    return client_->stub().SetDraining(&ctx, req, &resp).ok();
  };
  ASSERT_TRUE(set_draining(true));
  BlockToPut block{"d1", "", absl::string_view(buf.data(), kBlock)};
  TransferOp refused = client_->PutFromAsync("req", {&block, 1});
  refused.Wait();
  EXPECT_THAT(refused.statuses()[0], StatusIs(absl::StatusCode::kFailedPrecondition));
  // Not a lost session: the client keeps it (no new session per refusal).
  EXPECT_EQ(*client_->EnsureSession(), *session);
  ASSERT_TRUE(set_draining(false));
  TransferOp put = client_->PutFromAsync("req", {&block, 1});
  put.Wait();
  EXPECT_OK(put.statuses()[0]);
  EXPECT_EQ(*client_->EnsureSession(), *session);
}

TEST_P(UcxE2eTest, APutIntoAnUndeclaredNamespaceIsRefusedAndTheClientKeepsItsSession) {
  // create_namespaces off: a put into a namespace no operator declared is
  // refused as a whole request. That is not a lost session (once it was
  // taken for one: the client dropped its session and fenced its worker).
  const std::string dir = testing::MakeTempDir("declared");
  std::ofstream(dir + "/kvdepot.yaml") << "create_namespaces: false\n";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(
      {"--config", dir + "/kvdepot.yaml", "--dram-capacity", "64MiB"});
  ASSERT_OK(d.status());
  for (bool ucx_requests : {true, false}) {
    SCOPED_TRACE(ucx_requests ? "requests over UCX" : "requests over gRPC");
    std::unique_ptr<Client> c = NewClient(ucx_requests, (*d)->address());
    ASSERT_NE(c, nullptr);
    std::vector<char> buf(2 * kBlock);
    ucx_test::FillPattern(buf.data(), kBlock, 10);
    ASSERT_OK(c->RegisterBuffer(buf.data(), buf.size()));
    absl::StatusOr<uint64_t> session = c->EnsureSession();
    ASSERT_OK(session.status());
    const std::string ns = ucx_requests ? "ucx-ns" : "grpc-ns";
    BlockToPut block{"u0", "", absl::string_view(buf.data(), kBlock)};
    TransferOp refused = c->PutFromAsync(ns, {&block, 1});
    refused.Wait();
    EXPECT_THAT(refused.statuses()[0], StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_STREQ(refused.transport(), "ucx");
    EXPECT_EQ(*c->EnsureSession(), *session);
    // Declared by the operator (a quota), the namespace takes the put, over
    // the same session and UCX.
    grpc::ClientContext ctx;
    v1::SetQuotaRequest quota;
    quota.set_namespace_(ns);
    quota.set_max_bytes(0);
    v1::SetQuotaResponse set;
    ASSERT_TRUE(c->stub().SetQuota(&ctx, quota, &set).ok());
    TransferOp put = c->PutFromAsync(ns, {&block, 1});
    put.Wait();
    EXPECT_OK(put.statuses()[0]);
    EXPECT_STREQ(put.transport(), "ucx");
    absl::string_view key = "u0";
    absl::Span<char> dst(buf.data() + kBlock, kBlock);
    TransferOp get = c->GetIntoAsync(ns, {&key, 1}, {&dst, 1});
    get.Wait();
    EXPECT_OK(get.statuses()[0]);
    EXPECT_EQ(std::memcmp(buf.data(), dst.data(), kBlock), 0);
    EXPECT_EQ(*c->EnsureSession(), *session);
    EXPECT_OK(c->data_plane_status());
  }
  EXPECT_EQ((*d)->Stop(SIGTERM).value_or(-1), 0) << (*d)->Log();
}

TEST_P(UcxE2eTest, MalformedRequestsAreAnsweredAndTheDaemonStaysUp) {
  HandMadeClient c;
  ASSERT_NO_FATAL_FAILURE(c.Open(*client_, "crafted"));
  const uint64_t session = c.session;
  // Sends `body` as a request for `for_session` and waits for the answer.
  auto ask = [&](uint64_t for_session, std::string body) {
    absl::Notification done;
    absl::Status answer;
    absl::Status sent = c.requests->Send(
        for_session, RequestMethod::kPushBlocks, std::move(body),
        absl::Now() + absl::Seconds(20),
        [&](const absl::Status& st, absl::string_view) {
          answer = st;
          done.Notify();
        });
    if (!sent.ok()) return sent;
    done.WaitForNotification();
    return answer;
  };
  ASSERT_OK(c.requests->Connect(session, c.request_address,
                                 absl::Seconds(5)));
  EXPECT_THAT(ask(session, "not a protobuf \xff\xff\xff"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  v1::PushBlocksRequest other;
  other.set_session_id(session + 1);  // not the session it comes for
  other.set_namespace_("req");
  EXPECT_THAT(ask(session, other.SerializeAsString()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ask(session, std::string(kMaxRequestPayload + 1, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument));
  v1::PushBlocksRequest empty;
  empty.set_session_id(session);
  empty.set_namespace_("req");
  EXPECT_OK(ask(session, empty.SerializeAsString()));  // nothing asked, nothing moved
  // A session the daemon does not know.
  ASSERT_OK(c.requests->Connect(session ^ 0x5555, c.request_address,
                                 absl::Seconds(5)));
  other.set_session_id(session ^ 0x5555);
  EXPECT_THAT(ask(session ^ 0x5555, other.SerializeAsString()),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_OK(client_->Health());
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

// Puts whose bytes come with their request (kDataRequestMessageId): the
// blocks' sizes must add up to the bytes, each with its checksum, or the
// request is refused; a block whose bytes do not match stores nothing; a
// block stored already has its bytes dropped while the others land.
TEST_P(UcxE2eTest, DataRequestsThatDoNotMatchTheirBytesStoreNothing) {
  HandMadeClient c;
  ASSERT_NO_FATAL_FAILURE(c.Open(*client_, "data-requests"));
  const uint64_t session = c.session;
  ASSERT_OK(c.requests->Connect(session, c.request_address, absl::Seconds(5)));
  std::vector<char> bytes(2 * kBlock);
  ucx_test::FillPattern(bytes.data(), kBlock, 31);
  ucx_test::FillPattern(bytes.data() + kBlock, kBlock, 32);
  const absl::Span<const char> first(bytes.data(), kBlock);
  const absl::Span<const char> second(bytes.data() + kBlock, kBlock);
  const uint64_t sum1 = BlockChecksum(absl::string_view(first.data(), kBlock));
  const uint64_t sum2 = BlockChecksum(absl::string_view(second.data(), kBlock));
  struct Spec {
    std::string key;
    uint64_t size;
    uint64_t checksum;
  };
  struct Answer {
    absl::Status status;
    v1::PullBlocksResponse resp;
  };
  // The request for `specs` sent as `method` with `data`; the answer.
  auto ask = [&](std::vector<Spec> specs, std::vector<absl::Span<const char>> data,
                 RequestMethod method = RequestMethod::kPullBlocks) {
    v1::PullBlocksRequest req;
    req.set_session_id(session);
    req.set_namespace_("dreq");
    for (const Spec& spec : specs) {
      v1::PullSpec* b = req.add_blocks();
      b->set_key(spec.key);
      b->set_checksum(spec.checksum);
      b->mutable_source()->set_size(spec.size);
    }
    absl::Notification done;
    Answer a;
    absl::Status sent = c.requests->SendWithData(
        session, method, req.SerializeAsString(), std::move(data),
        absl::Now() + absl::Seconds(20),
        [&](const absl::Status& st, absl::string_view body) {
          a.status = st;
          if (st.ok()) a.resp.ParseFromArray(body.data(), static_cast<int>(body.size()));
          done.Notify();
        });
    if (!sent.ok()) {
      a.status = sent;
      return a;
    }
    done.WaitForNotification();
    return a;
  };
  // Sizes that do not add up to the bytes, another method: refused.
  EXPECT_THAT(ask({{"d1", kBlock + 1, sum1}}, {first}).status,
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ask({{"d1", kBlock, sum1}}, {first.subspan(0, kBlock - 1)}).status,
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ask({{"d1", kBlock, sum1}, {"d2", kBlock, sum2}}, {first}).status,
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ask({{"d1", kBlock, sum1}}, {first}, RequestMethod::kPushBlocks).status,
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Bytes that do not match their checksum: DATA_LOSS, nothing stored.
  Answer bad = ask({{"d1", kBlock, sum1 ^ 1}}, {first});
  ASSERT_OK(bad.status);
  ASSERT_EQ(bad.resp.blocks_size(), 1);
  EXPECT_EQ(bad.resp.blocks(0).code(), static_cast<int>(absl::StatusCode::kDataLoss));
  // A key named twice is put once, by its first block: when that one is
  // refused, so is the second (not "stored already").
  Answer twice =
      ask({{"d1", kBlock, sum1 ^ 1}, {"d1", kBlock, sum1 ^ 1}}, {first, first});
  ASSERT_OK(twice.status);
  ASSERT_EQ(twice.resp.blocks_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(twice.resp.blocks(i).code(),
              static_cast<int>(absl::StatusCode::kDataLoss))
        << i << ": " << twice.resp.blocks(i).message();
  }
  // The real thing: stored, and reads back through another client.
  Answer good = ask({{"d0", kBlock, sum1}}, {first});
  ASSERT_OK(good.status);
  ASSERT_EQ(good.resp.blocks_size(), 1);
  EXPECT_EQ(good.resp.blocks(0).code(), 0) << good.resp.blocks(0).message();
  // d0 again (its bytes dropped) and d3 after it, from two pieces that the
  // daemon splits otherwise: d3 lands whole.
  Answer two = ask({{"d0", kBlock, sum1}, {"d3", kBlock, sum2}},
                   {first.subspan(0, 1000), absl::Span<const char>(
                                                bytes.data() + 1000, 2 * kBlock - 1000)});
  ASSERT_OK(two.status);
  ASSERT_EQ(two.resp.blocks_size(), 2);
  EXPECT_EQ(two.resp.blocks(0).code(),
            static_cast<int>(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(two.resp.blocks(1).code(), 0) << two.resp.blocks(1).message();
  std::vector<char> dst(kBlock, 0);
  ASSERT_OK(client_->RegisterBuffer(dst.data(), dst.size()));
  for (auto [key, seed] : {std::pair<const char*, int>{"d0", 31}, {"d3", 32}, {"d1", 0}}) {
    absl::string_view k = key;
    absl::Span<char> out(dst.data(), kBlock);
    TransferOp get = client_->GetIntoAsync("dreq", {&k, 1}, {&out, 1});
    get.Wait();
    if (seed != 0) {
      ASSERT_OK(get.statuses()[0]) << key;
      EXPECT_EQ(ucx_test::FirstPatternMismatch(dst.data(), kBlock, seed), -1) << key;
    } else {
      EXPECT_THAT(get.statuses()[0], StatusIs(absl::StatusCode::kNotFound));
    }
  }
  v1::StatsResponse st = Stats();
  EXPECT_EQ(st.reservations(), 0u);
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

// A put with data whose blocks stored already outweigh its new ones (here
// 5 stored blocks, 1.25 MiB, for 1 new block of 256 KiB): the daemon takes
// none of its bytes (no copy of the filler, no iov per MiB of it) and reads
// the new block from its source instead -- bytes other than those sent, so
// that the answer tells which it took. A stored block's size is checked
// against the one stored: a claim of 64 MiB for a block of 256 KiB is
// refused before any byte is taken. libkvdepot's own puts of mostly stored
// batches keep working.
TEST_P(UcxE2eTest, DataRequestsDroppingMoreThanTheyStoreReadTheirSources) {
  constexpr int kStored = 5;
  std::vector<char> stored(kStored * kBlock);
  std::vector<std::string> stored_keys;
  std::vector<BlockToPut> stored_puts;
  for (int i = 0; i < kStored; ++i) {
    ucx_test::FillPattern(&stored[i * kBlock], kBlock, 30 + i);
    stored_keys.push_back(absl::StrCat("s", i));
  }
  ASSERT_OK(client_->RegisterBuffer(stored.data(), stored.size()));
  for (int i = 0; i < kStored; ++i) {
    stored_puts.push_back({stored_keys[i], "", absl::string_view(&stored[i * kBlock], kBlock)});
  }
  TransferOp first = client_->PutFromAsync("drop", stored_puts);
  first.Wait();
  for (const absl::Status& st : first.statuses()) ASSERT_OK(st);

  HandMadeClient c;
  ASSERT_NO_FATAL_FAILURE(c.Open(*client_, "dropping"));
  ASSERT_OK(c.requests->Connect(c.session, c.request_address, absl::Seconds(5)));
  std::vector<char> src(kBlock), sent(kBlock);
  ucx_test::FillPattern(src.data(), kBlock, 43);
  ucx_test::FillPattern(sent.data(), kBlock, 42);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> region =
      c.context->Register(src.data(), src.size());
  ASSERT_OK(region.status());
  grpc::ClientContext ctx;
  v1::RegisterBufferRequest reg;
  reg.set_session_id(c.session);
  reg.set_packed_rkey((*region)->packed_rkey());
  reg.set_address((*region)->address());
  reg.set_size((*region)->size());
  v1::RegisterBufferResponse registered;
  ASSERT_TRUE(client_->stub().RegisterBuffer(&ctx, reg, &registered).ok());
  constexpr size_t kClaim = size_t{64} << 20;
  void* filler = mmap(nullptr, kClaim, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
  ASSERT_NE(filler, MAP_FAILED);
  absl::Cleanup unmap = [filler] { munmap(filler, kClaim); };

  // n1 (new) and the stored blocks, each stored block claiming `claim`
  // bytes; the request's data is `sent` for n1 and filler for the others.
  auto send = [&](size_t claim, int stored_count, absl::Status* status,
                  v1::PullBlocksResponse* resp) {
    v1::PullBlocksRequest req;
    req.set_session_id(c.session);
    req.set_namespace_("drop");
    v1::PullSpec* n1 = req.add_blocks();
    n1->set_key("n1");
    n1->set_checksum(BlockChecksum(absl::string_view(src.data(), kBlock)));
    n1->mutable_source()->set_buffer_id(registered.buffer_id());
    n1->mutable_source()->set_address((*region)->address());
    n1->mutable_source()->set_size(kBlock);
    std::vector<absl::Span<const char>> data = {
        absl::Span<const char>(sent.data(), kBlock)};
    for (int i = 0; i < stored_count; ++i) {
      v1::PullSpec* again = req.add_blocks();
      again->set_key(stored_keys[i]);
      again->set_checksum(1);
      again->mutable_source()->set_size(claim);
      data.emplace_back(static_cast<const char*>(filler), claim);
    }
    absl::Notification done;
    ASSERT_OK(c.requests->SendWithData(
        c.session, RequestMethod::kPullBlocks, req.SerializeAsString(), data,
        absl::Now() + absl::Seconds(20), [&](const absl::Status& st, absl::string_view body) {
          *status = st;
          if (st.ok()) resp->ParseFromArray(body.data(), static_cast<int>(body.size()));
          done.Notify();
        }));
    done.WaitForNotification();
  };
  absl::Status status;
  v1::PullBlocksResponse resp;
  ASSERT_NO_FATAL_FAILURE(send(kClaim, 1, &status, &resp));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(status.message().find("stored with"), std::string::npos) << status;

  ASSERT_NO_FATAL_FAILURE(send(kBlock, kStored, &status, &resp));
  ASSERT_OK(status);
  ASSERT_EQ(resp.blocks_size(), kStored + 1);
  EXPECT_EQ(resp.blocks(0).code(), 0)
      << "the new block was taken from the request's data, not its source: "
      << resp.blocks(0).message();
  for (int i = 1; i <= kStored; ++i) {
    EXPECT_EQ(resp.blocks(i).code(), static_cast<int>(absl::StatusCode::kAlreadyExists));
  }

  // libkvdepot, sending its puts' bytes: 8 blocks stored, then the same 8
  // and a new one (2 MiB dropped for 256 KiB new).
  std::unique_ptr<Client> sender = NewClient(true, "", /*data_requests=*/true);
  ASSERT_NE(sender, nullptr);
  std::vector<char> blocks(9 * kBlock), back(kBlock, 0);
  for (int i = 0; i < 9; ++i) ucx_test::FillPattern(&blocks[i * kBlock], kBlock, 50 + i);
  ASSERT_OK(sender->RegisterBuffer(blocks.data(), blocks.size()));
  ASSERT_OK(sender->RegisterBuffer(back.data(), back.size()));
  std::vector<std::string> keys;
  for (int i = 0; i < 9; ++i) keys.push_back(absl::StrCat("h", i));
  std::vector<BlockToPut> puts;
  for (int i = 0; i < 9; ++i) {
    puts.push_back({keys[i], i ? absl::string_view(keys[i - 1]) : "",
                    absl::string_view(&blocks[i * kBlock], kBlock)});
  }
  TransferOp eight = sender->PutFromAsync("drop", absl::MakeConstSpan(puts).subspan(0, 8));
  eight.Wait();
  for (const absl::Status& s : eight.statuses()) ASSERT_OK(s);
  TransferOp nine = sender->PutFromAsync("drop", puts);
  nine.Wait();
  for (const absl::Status& s : nine.statuses()) EXPECT_OK(s);
  for (const char* key : {"h8", "n1"}) {
    absl::string_view k = key;
    absl::Span<char> out(back.data(), kBlock);
    TransferOp get = sender->GetIntoAsync("drop", {&k, 1}, {&out, 1});
    get.Wait();
    ASSERT_OK(get.statuses()[0]) << key;
    EXPECT_EQ(ucx_test::FirstPatternMismatch(back.data(), kBlock, k == "h8" ? 58 : 43), -1)
        << key;
  }
  EXPECT_EQ(Stats().reservations(), 0u);
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

// A client worker that is not the session's (here one without a session
// of its own, connected to the request worker itself) sends a put with its
// bytes naming another client's session, then stalls. kvdepotd refuses it
// over that connection, its bytes unread: taken, their receive would stay
// pending on an endpoint kvdepotd did not make, and the request worker's
// destruction at SIGTERM would abort the daemon (transport/README caveat 7).
TEST_P(UcxE2eTest, ARequestFromAnotherWorkerThanTheSessionsIsRefused) {
  HandMadeClient owner;
  ASSERT_NO_FATAL_FAILURE(owner.Open(*client_, "owner"));
  ASSERT_OK(owner.requests->Connect(owner.session, owner.request_address,
                                     absl::Seconds(5)));
  HandMadeClient intruder;  // its worker, its requests; no session
  {
    UcxContextOptions options;
    options.name = "intruder";
    absl::StatusOr<std::unique_ptr<UcxContext>> ctx = UcxContext::Create(options);
    ASSERT_OK(ctx.status());
    intruder.context = *std::move(ctx);
    absl::StatusOr<std::unique_ptr<UcxWorker>> w = UcxWorker::Create(*intruder.context);
    ASSERT_OK(w.status());
    intruder.worker = *std::move(w);
    absl::StatusOr<std::unique_ptr<UcxRequests>> r = UcxRequests::Create(*intruder.worker);
    ASSERT_OK(r.status());
    intruder.requests = *std::move(r);
  }
  ASSERT_OK(intruder.requests->Connect(owner.session, owner.request_address,
                                        absl::Seconds(5)));
  std::vector<char> bytes(kBlock);
  ucx_test::FillPattern(bytes.data(), kBlock, 61);
  v1::PullBlocksRequest req;
  req.set_session_id(owner.session);
  req.set_namespace_("intrude");
  v1::PullSpec* b = req.add_blocks();
  b->set_key("x0");
  b->set_checksum(BlockChecksum(absl::string_view(bytes.data(), kBlock)));
  b->mutable_source()->set_size(kBlock);
  absl::Notification done;
  absl::Status status;
  ASSERT_OK(intruder.requests->SendWithData(
      owner.session, RequestMethod::kPullBlocks, req.SerializeAsString(),
      {absl::Span<const char>(bytes.data(), kBlock)}, absl::Now() + absl::Seconds(20),
      [&](const absl::Status& st, absl::string_view) {
        status = st;
        done.Notify();
      }));
  done.WaitForNotification();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kPermissionDenied));
  absl::Notification fenced;  // the intruder stalls for good
  intruder.worker->Fence([&fenced] { fenced.Notify(); });
  fenced.WaitForNotification();
  EXPECT_EQ(Stats().reservations(), 0u);
  EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
}

TEST_P(UcxE2eTest, AnAnswerThatCameInTimeIsTakenAfterTheClientStalled) {
  // The daemon's answer arrives while the client's progress thread is held
  // (as by SIGSTOP) past the request's deadline: once it runs again it
  // takes the answer; it does not end the request as timed out first.
  HandMadeClient c;
  ASSERT_NO_FATAL_FAILURE(c.Open(*client_, "stalling"));
  const uint64_t session = c.session;
  ASSERT_OK(c.requests->Connect(session, c.request_address, absl::Seconds(5)));
  v1::PushBlocksRequest empty;  // answered OK, nothing moved
  empty.set_session_id(session);
  empty.set_namespace_("stall");
  // Sends `empty`; the answer goes to *answer, then *done is notified.
  auto send = [&](absl::Time deadline, absl::Status* answer,
                  absl::Notification* done) {
    return c.requests->Send(session, RequestMethod::kPushBlocks,
                             empty.SerializeAsString(), deadline,
                             [answer, done](const absl::Status& st, absl::string_view) {
                               *answer = st;
                               done->Notify();
                             });
  };
  // One answer first: the daemon's endpoint back to this worker is then
  // wired up (its handshake would need this worker; see transport/README).
  absl::Status first;
  absl::Notification first_done;
  ASSERT_OK(send(absl::Now() + absl::Seconds(10), &first, &first_done));
  first_done.WaitForNotification();
  ASSERT_OK(first);

  kill(daemon_->pid(), SIGSTOP);  // the request waits in its queue
  absl::Status answer;
  absl::Notification answered, stuck, go;
  const absl::Time deadline = absl::Now() + absl::Milliseconds(500);
  ASSERT_OK(send(deadline, &answer, &answered));
  ASSERT_OK(c.worker->Run([] {}));  // the request has been sent
  ASSERT_OK(c.worker->Submit([&] {
    stuck.Notify();
    go.WaitForNotification();
  }));
  stuck.WaitForNotification();
  kill(daemon_->pid(), SIGCONT);  // it answers at once, into the held client
  absl::SleepFor(deadline + absl::Milliseconds(300) - absl::Now());
  go.Notify();
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_OK(answer);
}

TEST_P(UcxE2eTest, PlacesOutsideTheSessionsBuffersAreRejected) {
  std::vector<char> mine(2 * kBlock, 'm');
  ASSERT_OK(client_->RegisterBuffer(mine.data(), mine.size()));
  BlockToPut block{"secret", "", absl::string_view(mine.data(), kBlock)};
  TransferOp put = client_->PutFromAsync("iso", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);  // buffer 0 of this session
  absl::StatusOr<uint64_t> session = client_->EnsureSession();
  ASSERT_OK(session.status());
  const uint64_t base = reinterpret_cast<uintptr_t>(mine.data());

  auto push = [&](uint32_t buffer, uint64_t address, uint64_t size) {
    grpc::ClientContext ctx;
    v1::PushBlocksRequest req;
    req.set_session_id(*session);
    req.set_namespace_("iso");
    req.add_keys("secret");
    v1::BufferRange* r = req.add_destinations();
    r->set_buffer_id(buffer);
    r->set_address(address);
    r->set_size(size);
    v1::PushBlocksResponse resp;
    EXPECT_TRUE(client_->stub().PushBlocks(&ctx, req, &resp).ok());
    return resp.blocks_size() == 1 ? resp.blocks(0).code() : -1;
  };
  const int kInvalid = static_cast<int>(absl::StatusCode::kInvalidArgument);
  // A buffer this session never registered (another session's id space).
  EXPECT_EQ(push(7, base, kBlock), kInvalid);
  // Past the end of the registered buffer, and before its start.
  EXPECT_EQ(push(0, base + kBlock + 1, kBlock), kInvalid);
  EXPECT_EQ(push(0, base - 4096, kBlock), kInvalid);
  // A size that is not the block's.
  EXPECT_EQ(push(0, base + kBlock, kBlock / 2), kInvalid);
  EXPECT_EQ(std::count(mine.begin() + kBlock, mine.end(), 'm'),
            static_cast<long>(kBlock));  // nothing was written
  // The right place works.
  EXPECT_EQ(push(0, base + kBlock, kBlock), 0);

  // One PullBlocks of one block from buffer 0 of this session.
  auto pull = [&](const std::string& key, uint64_t address, bool daemon_checksum,
                  v1::PullBlocksResponse* resp) {
    grpc::ClientContext ctx;
    v1::PullBlocksRequest req;
    req.set_session_id(*session);
    req.set_namespace_("iso");
    v1::PullSpec* spec = req.add_blocks();
    spec->set_key(key);
    spec->set_daemon_checksum(daemon_checksum);
    spec->mutable_source()->set_buffer_id(0);
    spec->mutable_source()->set_address(address);
    spec->mutable_source()->set_size(kBlock);
    return client_->stub().PullBlocks(&ctx, req, resp);
  };
  auto stored = [&](absl::string_view key) {
    absl::StatusOr<LookupReply> r = client_->Lookup("iso", {&key, 1}, false, false);
    EXPECT_OK(r.status());
    return r.ok() && r->entries[0].found;
  };
  // A pull from outside stores nothing.
  {
    v1::PullBlocksResponse resp;
    ASSERT_TRUE(pull("forged", base + 2 * kBlock, false, &resp).ok());
    ASSERT_EQ(resp.blocks_size(), 1);
    EXPECT_EQ(resp.blocks(0).code(), kInvalid);
    EXPECT_FALSE(stored("forged"));
  }
  // Nor does a pull asking the daemon for its checksum from memory the
  // daemon does not copy itself (ordinary registered memory): there the
  // client's own checksum must guard the transfer.
  {
    v1::PullBlocksResponse resp;
    grpc::Status st = pull("unchecked", base, true, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "daemon_checksum"))
        << st.error_message();
    EXPECT_FALSE(stored("unchecked"));
  }
  // Another session without a UCX endpoint gets no data-plane calls.
  {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest open;
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(client_->stub().OpenSession(&ctx, open, &opened).ok());
    EXPECT_FALSE(opened.ucx_connected());
    grpc::ClientContext ctx2;
    v1::PushBlocksRequest req;
    req.set_session_id(opened.session_id());
    req.set_namespace_("iso");
    req.add_keys("secret");
    req.add_destinations()->set_size(kBlock);
    v1::PushBlocksResponse resp;
    EXPECT_EQ(client_->stub().PushBlocks(&ctx2, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  v1::StatsResponse st = Stats();
  EXPECT_EQ(st.pins(), 0u);
  EXPECT_EQ(st.reservations(), 0u);
  EXPECT_TRUE(daemon_->Running());
}

TEST_P(UcxE2eTest, MalformedWorkerAddressesAreRefusedAndTheDaemonStaysUp) {
  // OpenSession hands the client's worker address to UCX, which unpacks it
  // without a length: every truncation of a real one, and byte flips
  // across it. Without the sandbox (transport/ucx_address_sandbox.h) the
  // daemon died at a truncation to 47 bytes over TCP, 66 with shared memory.
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig(GetParam());
  absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
  ASSERT_OK(context.status());
  absl::StatusOr<std::unique_ptr<UcxWorker>> worker = UcxWorker::Create(**context);
  ASSERT_OK(worker.status());
  const std::string address = (*worker)->address();
  // OpenSession with `a` as the client's worker address, from this host.
  auto open = [&](const std::string& a) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::OpenSessionRequest req;
    req.set_ucx_worker_address(a);
    req.set_host_id(LocalHostId());
    v1::OpenSessionResponse resp;
    grpc::Status st = client_->stub().OpenSession(&ctx, req, &resp);
    if (st.ok()) {  // UCX took it: the session is closed again
      grpc::ClientContext close_ctx;
      v1::CloseSessionRequest close;
      close.set_session_id(resp.session_id());
      v1::CloseSessionResponse closed;
      client_->stub().CloseSession(&close_ctx, close, &closed);
    }
    return st;
  };
  int refused = 0;
  auto try_address = [&](const std::string& a, const std::string& what) {
    grpc::Status st = open(a);
    if (!st.ok()) {
      ++refused;
      // Refused as malformed, or (an address UCX takes, cut to one that
      // names fewer transports) not reachable: the client uses gRPC.
      EXPECT_THAT(st.error_code(),
                  ::testing::AnyOf(grpc::StatusCode::INVALID_ARGUMENT,
                                 grpc::StatusCode::UNAVAILABLE,
                                 grpc::StatusCode::DEADLINE_EXCEEDED))
          << what << ": " << st.error_message();
    }
    ASSERT_OK(client_->Health()) << "after " << what << "\n" << daemon_->Log();
  };
  for (size_t n = 1; n < address.size(); ++n) {
    try_address(address.substr(0, n), absl::StrCat("the first ", n, " bytes"));
    if (HasFatalFailure()) return;
  }
  for (size_t i = 0; i < address.size(); i += 7) {
    std::string flipped = address;
    flipped[i] = static_cast<char>(flipped[i] ^ 0xa5);
    try_address(flipped, absl::StrCat("byte ", i, " flipped"));
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(refused, 0);
  // The real address still works, and so do the daemon's clients.
  EXPECT_TRUE(open(address).ok());
  absl::string_view key = "k";
  EXPECT_OK(client_->Lookup("ns", {&key, 1}, false, true).status());
}

// Remote keys that UCX 1.13 would crash the daemon on (truncated, naming a
// segment that is gone) or that describe more memory than their segment
// are refused by RegisterBuffer; the daemon stays up and serves the session.
TEST_P(UcxE2eTest, CraftedOrStaleRemoteKeysAreRefusedAndTheDaemonStaysUp) {
  std::vector<char> mine(kBlock, 'm');
  ASSERT_OK(client_->RegisterBuffer(mine.data(), mine.size()));
  BlockToPut block{"kept", "", absl::string_view(mine.data(), kBlock)};
  TransferOp put = client_->PutFromAsync("keys", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);
  absl::StatusOr<uint64_t> session = client_->EnsureSession();
  ASSERT_OK(session.status());
  // Keys made like the client's (same UCX settings, same host).
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig(GetParam());
  absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
  ASSERT_OK(context.status());
  absl::StatusOr<std::unique_ptr<MemoryRegion>> live = (*context)->Allocate(kBlock);
  ASSERT_OK(live.status());
  absl::StatusOr<std::unique_ptr<MemoryRegion>> doomed = (*context)->Allocate(kBlock);
  ASSERT_OK(doomed.status());
  const std::string stale_key = (*doomed)->packed_rkey();
  const uint64_t stale_address = (*doomed)->address();
  doomed->reset();  // its segment is gone

  auto register_buffer = [&](const std::string& key, uint64_t address,
                             uint64_t size) {
    grpc::ClientContext ctx;
    v1::RegisterBufferRequest req;
    req.set_session_id(*session);
    req.set_packed_rkey(key);
    req.set_address(address);
    req.set_size(size);
    v1::RegisterBufferResponse resp;
    return client_->stub().RegisterBuffer(&ctx, req, &resp).error_code();
  };
  const std::string key = (*live)->packed_rkey();
  const uint64_t address = (*live)->address();
  EXPECT_EQ(register_buffer(key.substr(0, key.size() - 1), address, kBlock),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(register_buffer(key.substr(0, 5), address, kBlock),
            grpc::StatusCode::INVALID_ARGUMENT);
  if (GetParam() == "shm") {
    EXPECT_EQ(register_buffer(stale_key, stale_address, kBlock),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(register_buffer(key, address, 4 * kBlock),
              grpc::StatusCode::INVALID_ARGUMENT);
    // A live segment of another user (its key sent by this session): the
    // daemon would map it and copy blocks into and out of it.
    absl::StatusOr<std::unique_ptr<MemoryRegion>> foreign = (*context)->Allocate(kBlock);
    ASSERT_OK(foreign.status());
    const std::string foreign_key = (*foreign)->packed_rkey();
    const size_t sysv = ucx_test::SysvKeyOffset(foreign_key);
    if (sysv != 0) {
      int32_t shmid;
      std::memcpy(&shmid, foreign_key.data() + sysv, sizeof(shmid));
      shmid_ds ds{};
      ASSERT_EQ(shmctl(shmid, IPC_STAT, &ds), 0);
      const uid_t owner = ds.shm_perm.uid;
      ds.shm_perm.uid = owner + 4242;
      if (shmctl(shmid, IPC_SET, &ds) == 0) {
        EXPECT_EQ(register_buffer(foreign_key, (*foreign)->address(), kBlock),
                  grpc::StatusCode::INVALID_ARGUMENT);
        ds.shm_perm.uid = owner;
        EXPECT_EQ(shmctl(shmid, IPC_SET, &ds), 0);
        // Its own again: taken.
        EXPECT_EQ(register_buffer(foreign_key, (*foreign)->address(), kBlock),
                  grpc::StatusCode::OK);
      } else {
        ADD_FAILURE() << "cannot change the owner of segment " << shmid
                      << " (not root?): " << std::strerror(errno);
      }
    } else {
      ADD_FAILURE() << "UCX allocated no System V segment here";
    }
  }
  // The real key is taken, and the daemon still serves this session.
  EXPECT_EQ(register_buffer(key, address, kBlock), grpc::StatusCode::OK);
  ASSERT_TRUE(daemon_->Running());
  std::vector<char> back(kBlock, 0);
  ASSERT_OK(client_->RegisterBuffer(back.data(), back.size()));
  absl::string_view kept = "kept";
  absl::Span<char> dst(back.data(), back.size());
  TransferOp get = client_->GetIntoAsync("keys", {&kept, 1}, {&dst, 1});
  get.Wait();
  ASSERT_OK(get.statuses()[0]);
  EXPECT_EQ(back, mine);
  EXPECT_TRUE(daemon_->Running());
}

// UcxRequests without a daemon: its peer is a worker of this process,
// stopped (its connections reset) between UcxEndpoint::Connect and the
// install of the new connection, after that connection's on_error has run
// (finding the connection it replaces, and setting nothing). The
// connection is not served, and the next Connect to the same address
// connects anew (and fails: nothing is there) instead of keeping the
// broken one, which left every request failing, served over gRPC instead,
// for the worker's life.
TEST(UcxRequestsTest, AConnectionThatFailsBeforeItIsInstalledIsNotKept) {
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig("tcp");
  absl::StatusOr<std::unique_ptr<UcxContext>> peer_context = UcxContext::Create(options);
  ASSERT_OK(peer_context.status());
  absl::StatusOr<std::unique_ptr<UcxContext>> client_context =
      UcxContext::Create(options);
  ASSERT_OK(client_context.status());
  absl::StatusOr<std::unique_ptr<UcxWorker>> peer = UcxWorker::Create(**peer_context);
  ASSERT_OK(peer.status());
  absl::StatusOr<std::unique_ptr<UcxWorker>> client =
      UcxWorker::Create(**client_context);
  ASSERT_OK(client.status());
  absl::StatusOr<std::unique_ptr<UcxRequests>> requests = UcxRequests::Create(**client);
  ASSERT_OK(requests.status());
  const std::string address = (*peer)->address();

  internal::SyncPointCallback point(
      "UcxRequests::Connect:BeforeInstall", [&](void* arg) {
        auto* endpoint = static_cast<UcxEndpoint*>(arg);
        if (endpoint == nullptr) return;  // the second Connect's
        (*peer)->Stop();
        // Waits for the failure to reach the new endpoint (TCP's reset).
        const absl::Time give_up = absl::Now() + absl::Seconds(30);
        while (endpoint->status().ok() && absl::Now() < give_up) {
          absl::SleepFor(absl::Milliseconds(5));
        }
        ASSERT_FALSE(endpoint->status().ok())
            << "the peer's end did not reach the client's endpoint";
        // Its on_error runs on the progress thread, in the same call that
        // set the status: over once a task queued now has run.
        ASSERT_OK((*client)->Run([] {}));
      });
  constexpr uint64_t kSession = 7;
  EXPECT_THAT((*requests)->Connect(kSession, address, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_FALSE((*requests)->Serves(kSession));
  EXPECT_THAT((*requests)->Send(kSession, RequestMethod::kPushBlocks, "ask",
                                absl::Now() + absl::Seconds(30),
                                [](const absl::Status&, absl::string_view) {}),
              StatusIs(absl::StatusCode::kUnavailable));
  // Not the broken connection again: a new one, to a worker that is gone.
  EXPECT_FALSE((*requests)->Connect(kSession, address, absl::Seconds(2)).ok());
  EXPECT_FALSE((*requests)->Serves(kSession));
  requests->reset();
  (*client)->Stop();
}

TEST(UcxE2eGrpcTest, ClientAskingForGrpcUsesTheBytePath) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_OK(d.status());
  ClientOptions options;
  options.server = (*d)->address();
  options.transport = ClientOptions::Transport::kGrpc;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  ASSERT_OK(c.status());
  EXPECT_FALSE((*c)->data_plane_status().ok());
  std::vector<char> buf(2 * kBlock, 'g');
  EXPECT_THAT((*c)->RegisterBuffer(buf.data(), buf.size()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  BlockToPut block{"g0", "", absl::string_view(buf.data(), kBlock)};
  TransferOp put = (*c)->PutFromAsync("g", {&block, 1});
  ASSERT_TRUE(put.IsReady());  // done before it returned
  EXPECT_STREQ(put.transport(), "grpc");
  EXPECT_OK(put.statuses()[0]);
  absl::string_view key = "g0";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  std::fill(dst.begin(), dst.end(), 0);
  TransferOp get = (*c)->GetIntoAsync("g", {&key, 1}, {&dst, 1});
  EXPECT_STREQ(get.transport(), "grpc");
  EXPECT_OK(get.statuses()[0]);
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 'g'), static_cast<long>(kBlock));
}

// The local addresses ("127.0.0.1:41487", "[::1]:5000") of the TCP sockets
// process `pid` listens on, from the kernel's tables of its network
// namespace and the sockets among its open files.
std::vector<std::string> TcpListeners(pid_t pid) {
  std::vector<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", pid, "/fd"), ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(fd.path(), link_ec).string();
    if (absl::StartsWith(target, "socket:[")) {
      inodes.push_back(target.substr(8, target.size() - 9));
    }
  }
  std::vector<std::string> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in(absl::StrCat("/proc/", pid, "/net/", table));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      if (f.size() < 10 || f[3] != "0A") continue;  // 0A: LISTEN
      if (std::find(inodes.begin(), inodes.end(), f[9]) == inodes.end()) continue;
      const std::string& local = f[1];  // words in host order, then ":PORT"
      const size_t colon = local.find(':');
      unsigned char bytes[16];
      const size_t words = colon / 8;
      for (size_t w = 0; w < words; ++w) {
        uint32_t word = std::stoul(local.substr(w * 8, 8), nullptr, 16);
        std::memcpy(bytes + 4 * w, &word, 4);
      }
      char text[INET6_ADDRSTRLEN] = {};
      inet_ntop(words == 1 ? AF_INET : AF_INET6, bytes, text, sizeof(text));
      const unsigned long port = std::stoul(local.substr(colon + 1), nullptr, 16);
      out.push_back(words == 1 ? absl::StrCat(text, ":", port)
                               : absl::StrCat("[", text, "]:", port));
    }
  }
  return out;
}

bool IsLoopbackListener(const std::string& address) {
  return absl::StartsWith(address, "127.") || absl::StartsWith(address, "[::1]") ||
         absl::StartsWith(address, "[::ffff:127.");
}

// This host's addresses other than loopback (and IPv6 link-local).
std::vector<std::string> NonLoopbackAddresses() {
  std::vector<std::string> out;
  for (const NetInterfaceAddress& i : LocalInterfaceAddresses()) {
    if (!i.loopback && !absl::StartsWith(i.address, "fe80:")) {
      out.push_back(i.device + " " + i.address);
    }
  }
  return out;
}

// Runs a test body with UCX_NET_DEVICES unset (the daemon started from it
// inherits that), as a user who never heard of it has it.
class WithoutNetDevicesEnv {
 public:
  WithoutNetDevicesEnv() {
    if (const char* v = std::getenv("UCX_NET_DEVICES")) saved_ = v;
    unsetenv("UCX_NET_DEVICES");
  }
  ~WithoutNetDevicesEnv() {
    if (saved_) setenv("UCX_NET_DEVICES", saved_->c_str(), 1);
  }

 private:
  std::optional<std::string> saved_;
};

TEST(UcxE2eExposureTest, ADaemonOnLoopbackAndItsClientsListenOnLoopbackOnly) {
  // UCX listens on every device by default, and over TCP it lets any peer
  // read and write the listening process's memory (transport/README.md,
  // caveat 1). A daemon on loopback (the default) must not open such a
  // door on the host's other devices, nor must its clients.
  const std::vector<std::string> others = NonLoopbackAddresses();
  if (others.empty()) GTEST_SKIP() << "this host has loopback only: nothing to tell apart";
  WithoutNetDevicesEnv env;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_OK(d.status());
  EXPECT_TRUE(absl::StrContains((*d)->Log(), "UCX data plane on network devices lo"))
      << (*d)->Log();
  ClientOptions options;
  options.server = (*d)->address();  // 127.0.0.1:PORT
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  ASSERT_OK(c.status());
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 29);
  ASSERT_OK((*c)->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(**c, buf, "lo-only");  // the data plane works on lo alone
  ASSERT_OK((*c)->data_plane_status());

  const std::vector<std::string> daemon_listeners = TcpListeners((*d)->pid());
  // gRPC, and at least one UCX worker's listener (the rest are UCX's).
  EXPECT_GE(daemon_listeners.size(), 2u);
  for (const std::string& l : daemon_listeners) {
    EXPECT_TRUE(IsLoopbackListener(l))
        << "kvdepotd listens on " << l << "; this host also has "
        << absl::StrJoin(others, ", ");
  }
  const std::vector<std::string> client_listeners = TcpListeners(getpid());
  EXPECT_FALSE(client_listeners.empty());  // the client's UCX worker
  for (const std::string& l : client_listeners) {
    EXPECT_TRUE(IsLoopbackListener(l)) << "the client listens on " << l;
  }
  EXPECT_EQ((*d)->Stop(SIGTERM).value_or(-1), 0) << (*d)->Log();
}

TEST(UcxE2eExposureTest, ADaemonOnEveryAddressSaysThatItsDataPlaneIsOpenToo) {
  // Listening on 0.0.0.0 is asking to be reached from anywhere; the data
  // plane then keeps UCX's every device, and the log says what that means.
  const std::vector<std::string> others = NonLoopbackAddresses();
  if (others.empty()) GTEST_SKIP() << "this host has loopback only: nothing to tell apart";
  WithoutNetDevicesEnv env;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({}, "", "0.0.0.0:0");
  ASSERT_OK(d.status());
  EXPECT_TRUE(absl::StrContains((*d)->Log(), "UCX data plane on every network device"))
      << (*d)->Log();
  EXPECT_TRUE(absl::StrContains((*d)->Log(), "keep those networks trusted")) << (*d)->Log();
  const std::vector<std::string> listeners = TcpListeners((*d)->pid());
  EXPECT_TRUE(std::any_of(listeners.begin(), listeners.end(),
                          [](const std::string& l) {
                            return !IsLoopbackListener(l) &&
                                   !absl::StartsWith(l, "0.0.0.0:") &&
                                   !absl::StartsWith(l, "[::]:");
                          }))
      << "no UCX listener on " << absl::StrJoin(others, ", ") << ": "
      << absl::StrJoin(listeners, ", ");
  EXPECT_EQ((*d)->Stop(SIGTERM).value_or(-1), 0) << (*d)->Log();
}

TEST(UcxE2eExposureTest, ADaemonOnOneDevicesAddressListensOnThatDeviceAndLoopback) {
  // listen on an address of one device (not loopback): UCX there and on
  // lo (co-located clients), nowhere else; a client reaches it over UCX.
  std::optional<NetInterfaceAddress> chosen;
  const std::vector<NetInterfaceAddress> local = LocalInterfaceAddresses();
  for (const NetInterfaceAddress& i : local) {
    if (!i.loopback && i.address.find(':') == std::string::npos) {
      chosen = i;
      break;
    }
  }
  if (!chosen) GTEST_SKIP() << "no IPv4 address off loopback here";
  WithoutNetDevicesEnv env;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({}, "", chosen->address + ":0");
  ASSERT_OK(d.status());
  EXPECT_TRUE(absl::StrContains(
      (*d)->Log(), absl::StrCat("UCX data plane on network devices ", chosen->device)))
      << (*d)->Log();
  ClientOptions options;
  options.server = (*d)->address();
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  ASSERT_OK(c.status());
  std::vector<char> buf(2 * kBlock);
  ucx_test::FillPattern(buf.data(), kBlock, 31);
  ASSERT_OK((*c)->RegisterBuffer(buf.data(), buf.size()));
  PutThenGet(**c, buf, "one-device");
  ASSERT_OK((*c)->data_plane_status());
  // Every listener is on an address of the chosen device or of loopback.
  auto device_of = [&](const std::string& listener) -> std::string {
    if (IsLoopbackListener(listener)) return "loopback";
    for (const NetInterfaceAddress& i : local) {
      if (absl::StartsWith(listener, i.address + ":") ||
          absl::StartsWith(listener, "[" + i.address + "]:") ||
          absl::StartsWith(listener, "[::ffff:" + i.address + "]:")) {
        return i.device;
      }
    }
    return "unknown";
  };
  for (const pid_t pid : {(*d)->pid(), getpid()}) {
    for (const std::string& l : TcpListeners(pid)) {
      const std::string device = device_of(l);
      EXPECT_TRUE(device == "loopback" || device == chosen->device)
          << (pid == getpid() ? "the client" : "kvdepotd") << " listens on " << l
          << " (" << device << "), not only on " << chosen->device << " and loopback";
    }
  }
  EXPECT_EQ((*d)->Stop(SIGTERM).value_or(-1), 0) << (*d)->Log();
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxE2eTest,
                         ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace kvdepot
