// libkvdepot against a real kvdepotd that stops answering (SIGSTOP) on
// loopback UCX: what the client reports, when, and what it leaves the
// daemon to do afterwards.
//
//   - ops over buffers the daemon copies itself (AllocateBuffer, shared
//     memory) that end without its answer stay unready until their copy
//     deadline has passed: a caller that reuses the buffers then finds
//     neither a get's bytes landing late nor its new bytes stored by a put;
//   - callers that meet a stalled daemon at the same time each return
//     within about one rpc_timeout, not one after the other;
//   - a Client destroyed with gRPC calls in flight ends them first (its
//     ops are ready when the destructor returns), within a bounded time.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "storage/internal/sync_point.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"
#include "tests/ucx_daemon.h"
#include "transport/ucx_test_util.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;

constexpr size_t kBlock = 256 << 10;

// A daemon over UCX transport `transport` ("tcp" or "shm"), the client and
// the daemon both set up through the environment; the daemon is let run
// again (SIGCONT) and stopped at the end, whatever the test did to it.
class ClientFaultsTest : public ::testing::Test {
 protected:
  void StartDaemon(const std::string& transport) {
    transport_ = transport;
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = testing::StartUcxDaemon(transport);
    ASSERT_OK(d.status());
    daemon_ = *std::move(d);
  }

  void TearDown() override {
    if (daemon_ != nullptr) {
      kill(daemon_->pid(), SIGCONT);
      EXPECT_EQ(daemon_->Stop(SIGTERM).value_or(-1), 0) << daemon_->Log();
    }
    testing::UnsetUcxEnvironment(transport_);
  }

  std::unique_ptr<Client> NewClient(absl::Duration rpc_timeout,
                                    absl::Duration transfer_timeout,
                                    bool ucx_requests = true) {
    ClientOptions options;
    options.server = daemon_->address();
    options.lease = absl::Seconds(60);
    options.ucx.clear();  // from the environment
    options.rpc_timeout = rpc_timeout;
    options.transfer_timeout = transfer_timeout;
    options.ucx_requests = ucx_requests;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_OK(c.status());
    return c.ok() ? *std::move(c) : nullptr;
  }

  // The sum of a counter's series whose labels include `label`.
  double Counter(const std::string& name, const std::string& label) {
    double sum = 0;
    for (absl::string_view line :
         absl::StrSplit(testing::ScrapeMetrics(*daemon_), '\n')) {
      if (!absl::StartsWith(line, absl::StrCat(name, "{")) ||
          !absl::StrContains(line, label)) {
        continue;
      }
      double v = 0;
      const size_t space = line.rfind(' ');
      if (space != absl::string_view::npos &&
          absl::SimpleAtod(line.substr(space + 1), &v)) {
        sum += v;
      }
    }
    return sum;
  }
  // Requests of `op` the daemon has answered, whatever their code.
  double Answered(const std::string& op) {
    return Counter("kvdepot_requests_total", absl::StrCat("op=\"", op, "\""));
  }

  std::string transport_ = "tcp";
  std::unique_ptr<DaemonProcess> daemon_;
};

// Bug: an op whose every block the daemon copies itself (a co-located
// client's AllocateBuffer memory) was reported finished as soon as it ended
// without the daemon's answer (here: cancelled when another get's failure
// fenced the client's worker). The daemon, still before the copy deadline
// the request named, then copied anyway: a get's bytes into a buffer the
// caller had taken back, a put's source after the caller had written new
// bytes into it, stored under the old key with a checksum of its own.
TEST_F(ClientFaultsTest, InPlaceOpsEndedWithoutAnAnswerKeepTheirBuffersUntilTheCopyDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon("shm"));
  // The daemon may copy until 5 s after a request was made; the client
  // waits 10 s for an answer.
  std::unique_ptr<Client> client = NewClient(absl::Seconds(10), absl::Seconds(5));
  ASSERT_NE(client, nullptr);
  absl::StatusOr<absl::Span<char>> shared = client->AllocateBuffer(3 * kBlock);
  ASSERT_OK(shared.status());
  // Ordinary memory: UCX moves its blocks (not copied in place).
  std::vector<char> plain(2 * kBlock);
  ASSERT_OK(client->RegisterBuffer(plain.data(), plain.size()));

  ucx_test::FillPattern(shared->data(), kBlock, 5);
  BlockToPut stored{"stored", "", absl::string_view(shared->data(), kBlock)};
  TransferOp put_stored = client->PutFromAsync("late", {&stored, 1});
  put_stored.Wait();
  ASSERT_OK(put_stored.statuses()[0]);
  ASSERT_STREQ(put_stored.transport(), "ucx");
  if (Counter("kvdepot_ucx_in_place_bytes_total", "direction=\"in\"") <= 0) {
    GTEST_SKIP() << "the daemon does not copy AllocateBuffer memory in place here";
  }
  ucx_test::FillPattern(plain.data(), kBlock, 6);
  BlockToPut other{"plain", "", absl::string_view(plain.data(), kBlock)};
  TransferOp put_plain = client->PutFromAsync("late", {&other, 1});
  put_plain.Wait();
  ASSERT_OK(put_plain.statuses()[0]);
  const double pushes = Answered("PushBlocks");
  const double pulls = Answered("PullBlocks");

  ASSERT_TRUE(ucx_test::StopProcess(daemon_->pid()));
  const absl::Time t0 = absl::Now();
  // A get into ordinary memory: unanswered, it ends at t0 + 10 s, and the
  // client fences its worker, which ends every request pending on it.
  absl::string_view plain_key = "plain";
  absl::Span<char> plain_dst(plain.data() + kBlock, kBlock);
  TransferOp get_plain = client->GetIntoAsync("late", {&plain_key, 1}, {&plain_dst, 1});
  // In-place ops made at t0 + 7 s, each allowing the daemon copies until
  // t0 + 12 s: ended (cancelled) at t0 + 10 s by that fence.
  absl::SleepFor(t0 + absl::Seconds(7) - absl::Now());
  const absl::Time sent = absl::Now();
  char* source = shared->data() + 2 * kBlock;
  ucx_test::FillPattern(source, kBlock, 9);
  BlockToPut late{"late", "", absl::string_view(source, kBlock)};
  TransferOp put = client->PutFromAsync("late", {&late, 1});
  absl::string_view stored_key = "stored";
  absl::Span<char> dst = shared->subspan(kBlock, kBlock);
  std::memset(dst.data(), 'q', kBlock);
  TransferOp get = client->GetIntoAsync("late", {&stored_key, 1}, {&dst, 1});
  ASSERT_STREQ(put.transport(), "ucx");
  ASSERT_STREQ(get.transport(), "ucx");

  get_plain.Wait();
  EXPECT_FALSE(get_plain.statuses()[0].ok());
  // Not ready before their copy deadline, although they have ended.
  EXPECT_FALSE(put.WaitUntil(sent + absl::Milliseconds(4500)))
      << "the put was reported before the daemon's last moment to copy it";
  EXPECT_FALSE(get.WaitUntil(sent + absl::Milliseconds(4500)))
      << "the get was reported before the daemon's last moment to copy it";
  put.Wait();
  get.Wait();
  EXPECT_FALSE(put.statuses()[0].ok());
  EXPECT_FALSE(get.statuses()[0].ok());

  // The caller owns its buffers again: it writes other bytes into both.
  std::memset(source, 'z', kBlock);
  std::memset(dst.data(), 'y', kBlock);
  kill(daemon_->pid(), SIGCONT);
  // The daemon takes the requests it was sent (the plain get's ends at its
  // transfer deadline).
  EXPECT_TRUE(testing::PollUntil(
      [&] { return Answered("PushBlocks") >= pushes + 2 && Answered("PullBlocks") >= pulls + 1; },
      absl::Seconds(20)))
      << "the late requests were never answered";
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 'y'), static_cast<ptrdiff_t>(kBlock))
      << "the daemon copied into the get's buffer after the op was reported";
  absl::string_view late_key = "late";
  absl::StatusOr<std::vector<Block>> got = client->Get("late", {&late_key, 1});
  if (got.ok()) {
    ASSERT_EQ((*got)[0].bytes.size(), kBlock);
    EXPECT_EQ(ucx_test::FirstPatternMismatch((*got)[0].bytes.data(), kBlock, 9), -1)
        << "the daemon stored what the caller wrote after the put was reported";
  } else {
    EXPECT_TRUE(absl::IsNotFound(got.status())) << got.status();
  }
}

// Bug: with the daemon stalled, concurrent calls queued behind one lock
// (the session's opening, a buffer's registration) and then retried on the
// gRPC byte path, each adding its own rpc_timeout: 4 callers with 1 s
// returned after 2, 3, 4, 5 s (3, 5, 7, 8 s with no session yet).
void RunConcurrentCallersAgainstAStalledDaemon(Client& client, pid_t daemon,
                                               bool open_session_first) {
  constexpr int kCallers = 4;
  const absl::Duration rpc_timeout = client.options().rpc_timeout;
  std::vector<std::vector<char>> bufs(kCallers, std::vector<char>(kBlock));
  for (auto& b : bufs) ASSERT_OK(client.RegisterBuffer(b.data(), b.size()));
  if (open_session_first) {
    ASSERT_OK(client.EnsureSession().status());
  } else {
    ASSERT_OK(client.Health());
  }
  ASSERT_TRUE(ucx_test::StopProcess(daemon));
  std::vector<absl::Duration> took(kCallers);
  std::vector<absl::Status> status(kCallers);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i) {
    callers.emplace_back([&, i] {
      const absl::Time start = absl::Now();
      absl::string_view key = "k";
      absl::Span<char> dst(bufs[i].data(), kBlock);
      TransferOp op = client.GetIntoAsync("convoy", {&key, 1}, {&dst, 1});
      op.Wait();
      took[i] = absl::Now() - start;
      status[i] = op.statuses()[0];
    });
  }
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < kCallers; ++i) {
    EXPECT_FALSE(status[i].ok()) << "caller " << i;
    // Generous: each caller's own wait is one rpc_timeout.
    EXPECT_LT(took[i], 3 * rpc_timeout)
        << "caller " << i << " waited behind the others: " << status[i];
  }
  kill(daemon, SIGCONT);
}

TEST_F(ClientFaultsTest, CallersMeetingAStalledDaemonDoNotQueueBehindEachOther) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon("tcp"));
  std::unique_ptr<Client> client = NewClient(absl::Seconds(1), absl::Seconds(10));
  ASSERT_NE(client, nullptr);
  RunConcurrentCallersAgainstAStalledDaemon(*client, daemon_->pid(),
                                            /*open_session_first=*/false);
}

TEST_F(ClientFaultsTest, CallersRegisteringBuffersWithAStalledDaemonDoNotQueue) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon("tcp"));
  std::unique_ptr<Client> client = NewClient(absl::Seconds(1), absl::Seconds(10));
  ASSERT_NE(client, nullptr);
  RunConcurrentCallersAgainstAStalledDaemon(*client, daemon_->pid(),
                                            /*open_session_first=*/true);
}

// Bug: a co-located client's put (a PullBlocks request, run on one of the
// daemon's two request threads) that had to wait for room in DRAM waited
// there, up to 5 s: two such puts stopped every co-located client's
// requests, gets included. They now wait on the put pool.
TEST_F(ClientFaultsTest, ColocatedPutsWaitingForRoomDoNotStallOtherRequests) {
  transport_ = "shm";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = testing::StartUcxDaemon(
      "shm", {"--dram-capacity", "8MiB", "--nvme-capacity", "64MiB"});
  ASSERT_OK(d.status());
  daemon_ = *std::move(d);
  std::unique_ptr<Client> reader = NewClient(absl::Seconds(4), absl::Seconds(4));
  ASSERT_NE(reader, nullptr);
  absl::StatusOr<absl::Span<char>> into = reader->AllocateBuffer(kBlock);
  ASSERT_OK(into.status());
  // Nearly all of DRAM reserved, never committed.
  v1::BeginPutResponse held;
  {
    absl::StatusOr<uint64_t> session = reader->EnsureSession();
    ASSERT_OK(session.status());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::BeginPutRequest req;
    req.set_session_id(*session);
    req.set_namespace_("room");
    v1::PutSpec* spec = req.add_blocks();
    spec->set_key("held");
    spec->set_size(7 << 20);
    grpc::Status st = reader->stub().BeginPut(&ctx, req, &held);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  // More co-located puts that must wait for room than the daemon has
  // request threads.
  constexpr int kWaiters = 4;
  std::vector<std::unique_ptr<Client>> putters;
  std::vector<TransferOp> puts;
  std::vector<std::string> keys;
  for (int i = 0; i < kWaiters; ++i) keys.push_back(absl::StrCat("w", i));
  for (int i = 0; i < kWaiters; ++i) {
    putters.push_back(NewClient(absl::Seconds(10), absl::Seconds(10)));
    ASSERT_NE(putters.back(), nullptr);
    absl::StatusOr<absl::Span<char>> src = putters.back()->AllocateBuffer(2 << 20);
    ASSERT_OK(src.status());
    ucx_test::FillPattern(src->data(), src->size(), i);
    BlockToPut block{keys[i], "", absl::string_view(src->data(), src->size())};
    puts.push_back(putters.back()->PutFromAsync("room", {&block, 1}));
  }
  // The puts reach the daemon and wait there (up to 5 s) for room; before
  // the fix, two of them took both request threads for that long.
  absl::SleepFor(absl::Milliseconds(500));
  // A co-located get meanwhile is answered (a miss) within its 4 s, while
  // every put still waits.
  absl::string_view absent = "absent";
  TransferOp get = reader->GetIntoAsync("room", {&absent, 1}, {&*into, 1});
  get.Wait();
  EXPECT_STREQ(get.transport(), "ucx");
  EXPECT_TRUE(absl::IsNotFound(get.statuses()[0])) << get.statuses()[0];
  for (TransferOp& put : puts) EXPECT_FALSE(put.IsReady()) << "no put waited for room";
  // No room came: they fail as puts that find DRAM full do.
  for (TransferOp& put : puts) {
    put.Wait();
    EXPECT_FALSE(put.statuses()[0].ok());
  }
}

// Bug: an empty GetIntoAsync opened a session and sent an empty PushBlocks
// (an empty PutFromAsync asked nothing): against a daemon that stopped
// answering, getting nothing took an RPC's wait.
TEST_F(ClientFaultsTest, EmptyBatchesAskTheDaemonNothing) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon("tcp"));
  std::unique_ptr<Client> client = NewClient(absl::Seconds(3), absl::Seconds(10));
  ASSERT_NE(client, nullptr);
  TransferOp get = client->GetIntoAsync("empty", {}, {});
  TransferOp put = client->PutFromAsync("empty", {});
  for (TransferOp* op : {&get, &put}) {
    EXPECT_TRUE(op->IsReady());
    EXPECT_TRUE(op->statuses().empty());
  }
  EXPECT_EQ(Answered("OpenSession"), 0);
  EXPECT_EQ(Answered("PushBlocks"), 0);
  // The client asks the daemon when there is something to ask.
  std::vector<char> buf(kBlock);
  absl::string_view key = "absent";
  absl::Span<char> dst(buf.data(), buf.size());
  TransferOp miss = client->GetIntoAsync("empty", {&key, 1}, {&dst, 1});
  miss.Wait();
  EXPECT_TRUE(absl::IsNotFound(miss.statuses()[0])) << miss.statuses()[0];
  EXPECT_EQ(Answered("OpenSession"), 1);
}

// Stops process `pid` (SIGSTOP) and waits, at most 2 s, until every thread
// of it is stopped: the signal reaches a process's threads one by one, and
// one still running may answer a call sent meanwhile.
void StopAll(pid_t pid) {
  kill(pid, SIGSTOP);
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  while (absl::Now() < give_up) {
    bool all_stopped = true;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(
             absl::StrCat("/proc/", pid, "/task"), ec)) {
      std::ifstream in(task.path() / "stat");
      std::string stat((std::istreambuf_iterator<char>(in)),
                       std::istreambuf_iterator<char>());
      const size_t paren = stat.rfind(')');
      if (paren == std::string::npos || paren + 2 >= stat.size() ||
          (stat[paren + 2] != 'T' && stat[paren + 2] != 't')) {
        all_stopped = false;
        break;
      }
    }
    if (all_stopped) return;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// Bug: a get over gRPC whose read the stalled daemon did not answer then
// unpinned its blocks with another call of a whole rpc_timeout, so the
// caller waited twice as long as a stalled daemon costs. The unpin is owed
// (the keep-alive thread makes it once the daemon answers), not made on the
// caller's thread.
TEST_F(ClientFaultsTest, AGetTheStalledDaemonDidNotAnswerOwesItsUnpin) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon("tcp"));
  ClientOptions options;
  options.server = daemon_->address();
  options.transport = ClientOptions::Transport::kGrpc;
  options.rpc_timeout = absl::Seconds(1);
  options.lease = absl::Seconds(3);  // keep-alives every second or so
  auto client = Client::Connect(options);
  ASSERT_OK(client.status());
  const std::string bytes(kBlock, 'u');
  BlockToPut b{"owed", "", bytes};
  ASSERT_OK((*client)->Put("ns", {&b, 1}));
  std::atomic<bool> stopped{false};
  internal::SyncPointCallback stop_after_lookup("Client::LookupAnswered",
                                                [&](void*) {
                                                  if (!stopped.exchange(true))
                                                    StopAll(daemon_->pid());
                                                });
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> unpins_by_caller{0};
  internal::SyncPointCallback count_unpins("Client::UnpinRpc", [&](void*) {
    if (std::this_thread::get_id() == caller) unpins_by_caller.fetch_add(1);
  });
  std::vector<char> buf(kBlock);
  const absl::string_view key = "owed";
  absl::Span<char> dst(buf.data(), buf.size());
  absl::StatusOr<std::vector<bool>> got =
      (*client)->GetInto("ns", {&key, 1}, {&dst, 1});
  ASSERT_TRUE(stopped.load());
  kill(daemon_->pid(), SIGCONT);
  EXPECT_FALSE(got.ok() && (*got)[0]) << "the stopped daemon answered";
  EXPECT_EQ(unpins_by_caller.load(), 0);
  // Owed, and made: the daemon's pins go back to none.
  double pins = -1;
  for (int i = 0; i < 100 && pins != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    auto stats = (*client)->Stats();
    if (stats.ok()) pins = static_cast<double>(stats->pins());
  }
  EXPECT_EQ(pins, 0);
}

// Bug: a gRPC call of GetIntoAsync (requests over gRPC) still in flight
// when the Client was destroyed called back into the freed Client when it
// ended; the op was not ready when the destructor returned.
TEST_F(ClientFaultsTest, AClientDestroyedWithCallsInFlightEndsThemFirst) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon("tcp"));
  const absl::Duration rpc_timeout = absl::Seconds(3);
  std::unique_ptr<Client> client =
      NewClient(rpc_timeout, absl::Seconds(10), /*ucx_requests=*/false);
  ASSERT_NE(client, nullptr);
  std::vector<char> buf(2 * kBlock);
  ASSERT_OK(client->RegisterBuffer(buf.data(), buf.size()));
  ucx_test::FillPattern(buf.data(), kBlock, 1);
  BlockToPut block{"k", "", absl::string_view(buf.data(), kBlock)};
  TransferOp put = client->PutFromAsync("dtor", {&block, 1});
  put.Wait();
  ASSERT_OK(put.statuses()[0]);
  ASSERT_STREQ(put.transport(), "ucx");

  ASSERT_TRUE(ucx_test::StopProcess(daemon_->pid()));
  absl::string_view key = "k";
  absl::Span<char> dst(buf.data() + kBlock, kBlock);
  TransferOp get = client->GetIntoAsync("dtor", {&key, 1}, {&dst, 1});
  ASSERT_STREQ(get.transport(), "ucx");
  EXPECT_FALSE(get.IsReady());
  const absl::Time start = absl::Now();
  client.reset();
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(get.IsReady()) << "the destructor left a call in flight";
  // Generous (a hang would be unbounded); about one rpc_timeout at most.
  EXPECT_LT(took, 2 * rpc_timeout);
  if (get.IsReady()) {
    EXPECT_FALSE(get.statuses()[0].ok());
  } else {
    // Past the call's own deadline: its callback runs now, after the
    // Client went (a use after free before the fix).
    EXPECT_TRUE(get.WaitUntil(absl::Now() + 2 * rpc_timeout));
  }
}

}  // namespace
}  // namespace kvdepot
