// UcxWorker, UcxContext and MemoryRegion over real UCX (loopback TCP).
#include "transport/ucx_worker.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "storage/status_macros.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_test_util.h"

namespace kvdepot {
namespace {

class UcxWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UcxContextOptions options;
    options.config = ucx_test::TransportConfig("tcp");
    auto context = UcxContext::Create(options);
    if (!context.ok()) {
      GTEST_SKIP() << "UCX cannot create a context here (" << context.status()
                   << ")";
    }
    context_ = *std::move(context);
  }

  std::unique_ptr<UcxWorker> MakeWorker(UcxWorkerOptions options = {}) {
    auto worker = UcxWorker::Create(*context_, options);
    EXPECT_TRUE(worker.ok()) << worker.status();
    return worker.ok() ? *std::move(worker) : nullptr;
  }

  std::unique_ptr<UcxContext> context_;
};

TEST_F(UcxWorkerTest, RunsTasksInOrderOnItsOwnThread) {
  auto worker = MakeWorker();
  ASSERT_NE(worker, nullptr);
  EXPECT_FALSE(worker->address().empty());
  EXPECT_FALSE(worker->OnProgressThread());
  std::vector<int> order;  // touched by the progress thread only
  std::atomic<int> off_thread{0};
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(worker
                    ->Submit([&, i] {
                      if (!worker->OnProgressThread()) ++off_thread;
                      order.push_back(i);
                    })
                    .ok());
  }
  ASSERT_TRUE(worker->Run([] {}).ok());  // after all of the above
  EXPECT_EQ(off_thread.load(), 0);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  // Run on the progress thread runs inline instead of deadlocking.
  bool inner = false;
  ASSERT_TRUE(worker->Run([&] { worker->Run([&] { inner = true; }).IgnoreError(); }).ok());
  EXPECT_TRUE(inner);
}

TEST_F(UcxWorkerTest, TasksPostedOnTheProgressThreadRunBeforeItSleeps) {
  // The progress thread queues tasks for itself without waking itself (a
  // reply sent from a completion callback): they must run before it next
  // sleeps, not at its next idle tick (here a minute away).
  UcxWorkerOptions options;
  options.idle_tick = absl::Minutes(1);
  auto worker = MakeWorker(options);
  ASSERT_NE(worker, nullptr);
  absl::Notification from_task, from_timer, from_deferred;
  // From a task: the rest of a chain of posts.
  std::function<void(int)> chain = [&](int left) {
    if (left == 0) return from_task.Notify();
    ASSERT_TRUE(worker->Post([&, left] { chain(left - 1); }).ok());
  };
  ASSERT_TRUE(worker->Submit([&] { chain(5); }).ok());
  EXPECT_TRUE(from_task.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // From a timer, which runs after progress, just before the thread sleeps.
  ASSERT_TRUE(worker
                  ->Submit([&] {
                    worker->RunAt(absl::Now() + absl::Milliseconds(10), [&] {
                      ASSERT_TRUE(worker->Post([&] { from_timer.Notify(); }).ok());
                    });
                  })
                  .ok());
  EXPECT_TRUE(from_timer.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // From a deferred task (what UCX callbacks hand over).
  ASSERT_TRUE(worker
                  ->Submit([&] {
                    worker->Defer([&] {
                      ASSERT_TRUE(worker->Post([&] { from_deferred.Notify(); }).ok());
                    });
                  })
                  .ok());
  EXPECT_TRUE(from_deferred.WaitForNotificationWithTimeout(absl::Seconds(20)));
}

// A peer sending faster than the handler takes its messages: tasks queued
// meanwhile (and timers, ticks) still run between progress calls, not only
// once the backlog is gone. Loop used to progress until UCX had nothing
// left, and a Run (endpoint wire-up, a session's start) waited that long.
// Over shared memory, where one progress call hands over a few messages.
// (Over TCP one call hands over all complete messages of a receive
// segment, TCP_RX_SEG_SIZE bytes: thousands of small ones.)
TEST_F(UcxWorkerTest, QueuedTasksRunWhileMessagesKeepArriving) {
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig("shm");
  auto shm_context = UcxContext::Create(options);
  ASSERT_TRUE(shm_context.ok()) << shm_context.status();
  auto server = UcxWorker::Create(**shm_context);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = UcxWorker::Create(**shm_context);
  ASSERT_TRUE(client.ok()) << client.status();
  constexpr int kMessages = 4000;
  std::atomic<int> handled{0};
  std::atomic<int> handled_before_task{-1};
  UcxWorker* s = server->get();
  ASSERT_TRUE(s->SetMessageHandler(3, [&](absl::string_view, absl::string_view,
                                          const UcxWorker::MessageSender&) {
                 if (handled.fetch_add(1) == 0) {
                   // Queued behind the rest of the backlog.
                   s->Post([&] {
                      handled_before_task.store(handled.load());
                    }).IgnoreError();
                 }
                 // Slower than the sender: a backlog builds up.
                 const absl::Time until = absl::Now() + absl::Microseconds(50);
                 while (absl::Now() < until) {
                 }
               }).ok());
  UcxEndpointOptions endpoint_options;
  endpoint_options.peer_error_handling = ucx_test::PeerErrorHandling("shm");
  auto endpoint =
      UcxEndpoint::Connect(**client, s->address(), std::move(endpoint_options));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  ASSERT_TRUE((*client)
                  ->Run([&] {
                    for (int i = 0; i < kMessages; ++i) {
                      (*endpoint)->SendMessage(3, "h", "x").IgnoreError();
                    }
                  })
                  .ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (handled.load() < kMessages && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(handled.load(), kMessages);
  ASSERT_TRUE(s->Run([] {}).ok());
  EXPECT_GE(handled_before_task.load(), 1);
  EXPECT_LT(handled_before_task.load(), kMessages / 2)
      << "the task waited for the whole backlog";
  endpoint->reset();
}

TEST_F(UcxWorkerTest, SubmitFailsWhenTheQueueIsFull) {
  UcxWorkerOptions options;
  options.queue_capacity = 8;
  auto worker = MakeWorker(options);
  ASSERT_NE(worker, nullptr);
  absl::Notification started, release;
  ASSERT_TRUE(worker
                  ->Submit([&] {
                    started.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();
  std::atomic<int> ran{0};
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(worker->Submit([&] { ++ran; }).ok()) << i;
  }
  EXPECT_EQ(worker->Submit([&] { ++ran; }).code(),
            absl::StatusCode::kResourceExhausted);
  release.Notify();
  ASSERT_TRUE(worker->Run([] {}).ok());
  EXPECT_EQ(ran.load(), 8);
}

TEST_F(UcxWorkerTest, StopRunsQueuedTasksThenRefusesNewOnes) {
  auto worker = MakeWorker();
  ASSERT_NE(worker, nullptr);
  absl::Notification release;
  std::atomic<int> ran{0};
  ASSERT_TRUE(worker->Submit([&] { release.WaitForNotification(); }).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(worker->Submit([&] { ++ran; }).ok());
  std::thread stopper([&] { worker->Stop(); });
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran.load(), 5);
  EXPECT_EQ(worker->Submit([] {}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(worker->Run([] {}).code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(worker->address().empty());
  worker->Stop();  // idempotent
}

// A thread made after the progress thread ended may be given its id (glibc
// hands a joined thread's descriptor to the next); it must not pass for the
// progress thread: Run would run its task there, on a stopped worker.
TEST_F(UcxWorkerTest, AThreadWithTheEndedProgressThreadsIdIsNotIt) {
  auto worker = MakeWorker();
  ASSERT_NE(worker, nullptr);
  std::thread::id progress_id;
  ASSERT_TRUE(
      worker->Run([&] { progress_id = std::this_thread::get_id(); }).ok());
  worker->Stop();
  bool reused = false;
  for (int i = 0; i < 64 && !reused; ++i) {
    std::thread t([&] {
      if (std::this_thread::get_id() != progress_id) return;
      reused = true;
      EXPECT_FALSE(worker->OnProgressThread());
      bool ran = false;
      EXPECT_EQ(worker->Run([&] { ran = true; }).code(),
                absl::StatusCode::kUnavailable);
      EXPECT_FALSE(ran);
    });
    t.join();
  }
  if (!reused) GTEST_SKIP() << "no new thread got the ended one's id";
}

// AtDestroy's hooks run when the worker is destroyed: `before` while the
// UCP worker still exists, `after` once it is gone; those of an owner that
// has gone, never. For a stopped worker and for a fenced one (whose UCP
// worker Stop destroys, on its own thread).
TEST_F(UcxWorkerTest, DestroyHooksRunAroundTheWorkersEndWhileTheirOwnerLives) {
  for (bool fence : {false, true}) {
    SCOPED_TRACE(fence ? "fenced" : "stopped");
    auto worker = MakeWorker();
    ASSERT_NE(worker, nullptr);
    std::vector<std::string> seen;  // the progress thread's, then Stop's
    auto live = std::make_shared<int>(1);
    auto gone = std::make_shared<int>(2);
    UcxWorker* w = worker.get();
    ASSERT_TRUE(worker
                    ->Run([&] {
                      w->AtDestroy(
                          live,
                          [&] {
                            seen.push_back(w->handle() != nullptr ? "before, worker there"
                                                                  : "before, no worker");
                          },
                          [&] {
                            seen.push_back(w->handle() == nullptr ? "after, worker gone"
                                                                  : "after, worker there");
                          });
                      w->AtDestroy(
                          gone, [&] { seen.push_back("gone's before"); },
                          [&] { seen.push_back("gone's after"); });
                    })
                    .ok());
    gone.reset();
    if (fence) {
      absl::Notification fenced;
      worker->Fence([&] { fenced.Notify(); });
      ASSERT_TRUE(fenced.HasBeenNotified());
      EXPECT_TRUE(seen.empty()) << "a fenced worker's UCP worker goes in Stop";
    }
    worker->Stop();
    EXPECT_EQ(seen, (std::vector<std::string>{"before, worker there",
                                              "after, worker gone"}));
  }
}

TEST_F(UcxWorkerTest, ContextRejectsBadSettings) {
  UcxContextOptions options;
  options.config = {{"TLS", "tcp"}, {"KEEPALIVE_INTERVAL", "not-a-time"}};
  EXPECT_EQ(UcxContext::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A transport setting given with its prefix reaches the transport: a TX
  // segment larger than the RX one is refused when the worker is made.
  options.config = {{"UCX_TLS", "tcp"},
                    {"NET_DEVICES", "lo"},
                    {"UCX_TCP_TX_SEG_SIZE", "512k"},
                    {"TCP_RX_SEG_SIZE", "64k"}};
  auto context = UcxContext::Create(options);
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_FALSE(UcxWorker::Create(**context).ok());
}

TEST_F(UcxWorkerTest, SettingsAreCheckedAgainstUcxsOwnTables) {
#if UCP_API_MAJOR == 1 && UCP_API_MINOR == 13 && \
    KVDEPOT_UCX_CONFIG_TABLES_WANTED
  // Debian 12's UCX: CMake's probe of the internal API must find it (unless
  // the build turned it off).
  ASSERT_TRUE(UcxSettingsCheckedAgainstTables());
#endif
  if (!UcxSettingsCheckedAgainstTables()) {
    GTEST_SKIP() << "this UCX's configuration tables are not asked "
                    "(CheckUcxSettingByUcp is tested instead)";
  }
  // UCP's, UCS's and a transport's, its prefix dropped or not.
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{
           {"TLS", "tcp"},
           {"UCX_RNDV_THRESH", "64k"},
           {"LOG_LEVEL", "warn"},
           {"TCP_TX_SEG_SIZE", "512k"},
           {"UCX_TCP_RX_SEG_SIZE", "1m"},
           {"TX_SEG_SIZE", "auto"},
           {"MM_FIFO_SIZE", "128"}}) {
    EXPECT_TRUE(CheckUcxSetting(key, value).ok()) << key << "=" << value;
  }
  // Refused, each saying why: a name no table has (UCX itself only warns
  // and goes on without it); a transport's name whose prefix, dropped,
  // leaves UCP's own setting, which UCX would change instead (UCX_SEG_SIZE,
  // its memory pool); another transport's name; UCM's settings (UCP passes
  // them nowhere); values the setting's table refuses.
  struct Refusal {
    const char* key;
    const char* value;
    const char* says;
  };
  for (const Refusal& r : std::vector<Refusal>{
           {"TCP_TX_SEG_SIZ", "512k", "no setting TX_SEG_SIZ"},
           {"NO_SUCH_SETTING", "1", "no setting NO_SUCH_SETTING"},
           {"POSIX_SEG_SIZE", "16k", "UCX's own setting SEG_SIZE"},
           {"POSIX_TX_SEG_SIZE", "64k", "in its POSIX_ transport"},
           {"MALLOC_HOOKS", "n", "no setting MALLOC_HOOKS"},
           {"TCP_TX_SEG_SIZE", "big", "TX_SEG_SIZE=big (tcp transport"},
           {"RNDV_THRESH", "abc", "RNDV_THRESH=abc (UCP context"}}) {
    absl::Status st = CheckUcxSetting(r.key, r.value);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << r.key;
    EXPECT_TRUE(absl::StrContains(st.message(), r.says))
        << r.key << ": " << st.message();
  }

  // Create refuses what the check refuses: UCX would have made the context
  // and warned, once per worker.
  UcxContextOptions options;
  options.config = {{"TLS", "tcp"}, {"TCP_SEG_SIZE_TX", "512k"}};
  absl::StatusOr<std::unique_ptr<UcxContext>> context =
      UcxContext::Create(options);
  EXPECT_EQ(context.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(context.status().message(), "SEG_SIZE_TX"))
      << context.status().message();
}

// The check builds without UCX's internal API fall back on: UCP's and UCS's
// own settings are checked, every other name is taken.
TEST_F(UcxWorkerTest, SettingsAreCheckedByUcpWhereTablesAreNot) {
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{
           {"TLS", "tcp"},
           {"UCX_RNDV_THRESH", "64k"},
           {"TCP_TX_SEG_SIZE", "512k"},
           {"NO_SUCH_SETTING", "1"}}) {
    EXPECT_TRUE(CheckUcxSettingByUcp(key, value).ok()) << key << "=" << value;
  }
  absl::Status st = CheckUcxSettingByUcp("RNDV_THRESH", "abc");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "RNDV_THRESH=abc"))
      << st.message();
  // A transport prefix that, dropped, leaves UCP's own setting (its memory
  // pool's SEG_SIZE), found by UCP's printed configuration.
  st = CheckUcxSettingByUcp("POSIX_SEG_SIZE", "16k");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "UCX's own setting SEG_SIZE"))
      << st.message();
}

TEST_F(UcxWorkerTest, ContextKnowsItsTcpSegmentSizes) {
  // As the options give them, with or without prefixes...
  UcxContextOptions options;
  options.config = {{"TLS", "tcp"},
                    {"UCX_TCP_TX_SEG_SIZE", "256k"},
                    {"TCP_RX_SEG_SIZE", "1m"}};
  auto context = UcxContext::Create(options);
  ASSERT_TRUE(context.ok()) << context.status();
  ASSERT_TRUE((*context)->tcp_segments().has_value());
  EXPECT_EQ((*context)->tcp_segments()->tx, 256u << 10);
  EXPECT_EQ((*context)->tcp_segments()->rx, 1u << 20);
  // ... or the environment, which the options override.
  const char* env = std::getenv("UCX_TCP_RX_SEG_SIZE");
  const std::optional<std::string> saved =
      env != nullptr ? std::optional<std::string>(env) : std::nullopt;
  setenv("UCX_TCP_RX_SEG_SIZE", "96k", 1);
  options.config = {{"TLS", "tcp"}, {"TX_SEG_SIZE", "32k"}};
  context = UcxContext::Create(options);
  if (saved) {
    setenv("UCX_TCP_RX_SEG_SIZE", saved->c_str(), 1);
  } else {
    unsetenv("UCX_TCP_RX_SEG_SIZE");
  }
  ASSERT_TRUE(context.ok()) << context.status();
  ASSERT_TRUE((*context)->tcp_segments().has_value());
  EXPECT_EQ((*context)->tcp_segments()->tx, 32u << 10);
  EXPECT_EQ((*context)->tcp_segments()->rx, 96u << 10);

  // None when UCX may not use TCP: the sizes do not matter then.
  options.config = {{"UCX_TLS", "self,sm"}};
  context = UcxContext::Create(options);
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_FALSE((*context)->tcp_segments().has_value());

  const TcpSegmentSizes big{512 << 10, 512 << 10}, small{8 << 10, 64 << 10};
  EXPECT_TRUE(TcpSegmentsFit(big, big));
  EXPECT_TRUE(TcpSegmentsFit(small, small));
  EXPECT_FALSE(TcpSegmentsFit(big, small));  // they cannot take our 512k
  EXPECT_FALSE(TcpSegmentsFit(small, big));  // we cannot take theirs
}

TEST(UcxTlsAllowsTest, ReadsTheTransportListAndItsExclusions) {
  constexpr absl::string_view kTcp[] = {"tcp"};
  using Config = std::map<std::string, std::string>;
  EXPECT_TRUE(UcxTlsAllows(Config{{"TLS", "tcp"}}, kTcp));
  EXPECT_TRUE(UcxTlsAllows(Config{{"UCX_TLS", " sm , tcp "}}, kTcp));
  EXPECT_TRUE(UcxTlsAllows(Config{{"TLS", "all"}}, kTcp));
  EXPECT_FALSE(UcxTlsAllows(Config{{"TLS", "rc_x,ud_x,sm"}}, kTcp));
  EXPECT_FALSE(UcxTlsAllows(Config{{"TLS", "^tcp"}}, kTcp));
  EXPECT_TRUE(UcxTlsAllows(Config{{"TLS", "^rc,ud"}}, kTcp));
  EXPECT_TRUE(UcxTlsAllows(Config{{"TLS", "rc,posix"}}, kSharedMemoryTransports));
  EXPECT_TRUE(UcxTlsAllows(Config{{"TLS", "^posix"}}, kSharedMemoryTransports));
  EXPECT_FALSE(UcxTlsAllows(Config{{"TLS", "tcp"}}, kSharedMemoryTransports));
  // Without a setting: the environment's, else UCX's "all".
  if (std::getenv("UCX_TLS") == nullptr) {
    EXPECT_TRUE(UcxTlsAllows(Config{}, kTcp));
    EXPECT_TRUE(UcxTlsAllows(Config{}, kSharedMemoryTransports));
  }
}

TEST_F(UcxWorkerTest, RegistersMemoryAndPacksAKey) {
  EXPECT_EQ(context_->Register(nullptr, 64).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<char> buffer(1 << 20);
  EXPECT_EQ(context_->Register(buffer.data(), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto region = context_->Register(buffer.data(), buffer.size());
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->base(), buffer.data());
  EXPECT_EQ((*region)->size(), buffer.size());
  EXPECT_FALSE((*region)->packed_rkey().empty());
  EXPECT_TRUE((*region)->Contains(buffer.data(), buffer.size()));
  EXPECT_TRUE((*region)->Contains(buffer.data() + 100, 0));
  EXPECT_FALSE((*region)->Contains(buffer.data() + 1, buffer.size()));
  EXPECT_FALSE((*region)->Contains(buffer.data() - 1, 1));
  EXPECT_FALSE((*region)->Contains(buffer.data(), SIZE_MAX));
}

std::vector<char> RandomBytes(size_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<char> bytes(size);
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

// Two workers, each on its own context, over `transport` ("tcp" or
// "shm"), and an endpoint from the client's to the server's, as a client
// and kvdepotd have. Destroyed in reverse order: the endpoint first.
struct WorkerPair {
  std::unique_ptr<UcxContext> server_context;
  std::unique_ptr<UcxContext> client_context;
  std::unique_ptr<UcxWorker> server;
  std::unique_ptr<UcxWorker> client;
  std::unique_ptr<UcxEndpoint> endpoint;
};

absl::StatusOr<WorkerPair> ConnectWorkers(const char* transport) {
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig(transport);
  WorkerPair pair;
  ASSIGN_OR_RETURN(pair.server_context, UcxContext::Create(options));
  ASSIGN_OR_RETURN(pair.client_context, UcxContext::Create(options));
  ASSIGN_OR_RETURN(pair.server, UcxWorker::Create(*pair.server_context));
  ASSIGN_OR_RETURN(pair.client, UcxWorker::Create(*pair.client_context));
  UcxEndpointOptions endpoint_options;
  endpoint_options.peer_error_handling = ucx_test::PeerErrorHandling(transport);
  ASSIGN_OR_RETURN(pair.endpoint,
                   UcxEndpoint::Connect(*pair.client, pair.server->address(),
                                        std::move(endpoint_options)));
  return pair;
}

// Pieces of received data that are dropped (a put's block the daemon has
// already) go into one scratch buffer of kDiscardScratch bytes, however
// large they are: a worker that dropped a piece of several MiB keeps no
// more than that. The pieces kept get their bytes, in order; a receive
// that drops everything ends OK too.
TEST_F(UcxWorkerTest, DroppedPiecesOfReceivedDataTakeABoundedScratchBuffer) {
  constexpr size_t kScratch = UcxWorker::kDiscardScratch;
  for (const char* transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    absl::StatusOr<WorkerPair> pair = ConnectWorkers(transport);
    ASSERT_TRUE(pair.ok()) << pair.status();
    UcxContext* const server_context = pair->server_context.get();
    UcxWorker* const server = pair->server.get();
    UcxWorker* const client = pair->client.get();
    std::unique_ptr<UcxEndpoint>& endpoint = pair->endpoint;

    absl::Mutex mu;
    std::vector<std::unique_ptr<UcxWorker::IncomingData>> got;
    ASSERT_TRUE(server
                    ->SetDataMessageHandler(
                        9,
                        [&](absl::string_view,
                            std::unique_ptr<UcxWorker::IncomingData> data,
                            const UcxWorker::MessageSender&) {
                          absl::MutexLock lock(&mu);
                          got.push_back(std::move(data));
                        })
                    .ok());
    // Kept, dropped (5 scratch buffers and a bit), kept, dropped, kept.
    const std::vector<size_t> sizes = {100 * 1024 + 5, 5 * kScratch + 7,
                                       300 * 1024, 1000, 8};
    const std::vector<bool> kept = {true, false, true, false, true};
    std::vector<std::vector<char>> parts;
    std::vector<absl::Span<const char>> send;
    for (size_t i = 0; i < sizes.size(); ++i) {
      parts.push_back(RandomBytes(sizes[i], 70 + i));
      send.push_back(absl::MakeConstSpan(parts.back()));
    }
    // Second message: 3 scratch buffers' worth, all dropped.
    const std::vector<char> all_dropped = RandomBytes(3 * kScratch, 80);
    int sent_done = 0, sent_ok = 0;
    auto on_sent = [&](const absl::Status& st) {
      absl::MutexLock lock(&mu);
      ++sent_done;
      if (st.ok()) ++sent_ok;
    };
    ASSERT_TRUE(endpoint->SendMessageWithData(9, "pieces", send, on_sent).ok());
    ASSERT_TRUE(endpoint
                    ->SendMessageWithData(
                        9, "all", absl::MakeConstSpan(all_dropped), on_sent)
                    .ok());
    {
      absl::MutexLock lock(&mu);
      ASSERT_TRUE(mu.AwaitWithTimeout(
          absl::Condition(+[](decltype(got)* g) { return g->size() == 2; }, &got),
          absl::Seconds(20)))
          << got.size() << " of 2 messages arrived";
    }

    // The kept pieces go into one registered sink, one after the other.
    size_t kept_bytes = 0;
    for (size_t i = 0; i < sizes.size(); ++i) kept_bytes += kept[i] ? sizes[i] : 0;
    std::vector<char> sink(kept_bytes, '\0');
    auto region = server_context->Register(sink.data(), sink.size());
    ASSERT_TRUE(region.ok()) << region.status();
    std::vector<absl::Span<char>> pieces;
    size_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (kept[i]) {
        pieces.push_back(absl::Span<char>(sink.data() + at, sizes[i]));
        at += sizes[i];
      } else {
        pieces.push_back(absl::Span<char>(nullptr, sizes[i]));
      }
    }
    const absl::Time soon = absl::Now() + absl::Seconds(20);
    TransferHandle h = server->Receive(std::move(got[0]), pieces, soon);
    TransferHandle dropped =
        server->Receive(std::move(got[1]),
                        {absl::Span<char>(nullptr, all_dropped.size())}, soon);
    ASSERT_TRUE(h.WaitUntil(soon));
    ASSERT_TRUE(h.overall_status().ok()) << h.overall_status();
    ASSERT_TRUE(dropped.WaitUntil(soon));
    ASSERT_TRUE(dropped.overall_status().ok()) << dropped.overall_status();
    at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (!kept[i]) continue;
      EXPECT_EQ(std::memcmp(sink.data() + at, parts[i].data(), sizes[i]), 0)
          << "piece " << i;
      at += sizes[i];
    }
    size_t capacity = 0;
    ASSERT_TRUE(
        server->Run([&] { capacity = server->discard_capacity(); }).ok());
    EXPECT_GT(capacity, 0u) << "the drops went through the scratch buffer";
    EXPECT_LE(capacity, kScratch) << "dropping grew the worker's memory";

    {
      absl::MutexLock lock(&mu);
      ASSERT_TRUE(mu.AwaitWithTimeout(
          absl::Condition(+[](int* n) { return *n == 2; }, &sent_done),
          absl::Seconds(20)));
      EXPECT_EQ(sent_ok, 2);
    }
    endpoint.reset();
    client->Stop();
    server->Stop();
  }
}

// A receive whose deadline passed before the progress thread came to
// start it (the thread was busy) is not started: it ends
// DeadlineExceeded, not abandoned, with no byte written where it was to
// go (its caller may have handed that memory on), and the data is
// released unread, so that the sender's send ends. Eager data (its bytes
// here already) and rendezvous data alike. The thread is held by a task
// until the deadline has passed, so the order is fixed.
TEST_F(UcxWorkerTest, AReceiveWhoseDeadlinePassedBeforeItStartedIsNotStarted) {
  for (const char* transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    absl::StatusOr<WorkerPair> pair = ConnectWorkers(transport);
    ASSERT_TRUE(pair.ok()) << pair.status();
    UcxContext* const server_context = pair->server_context.get();
    UcxWorker* const server = pair->server.get();
    UcxWorker* const client = pair->client.get();
    std::unique_ptr<UcxEndpoint>& endpoint = pair->endpoint;

    absl::Mutex mu;
    std::vector<std::unique_ptr<UcxWorker::IncomingData>> got;
    ASSERT_TRUE(server
                    ->SetDataMessageHandler(
                        9,
                        [&](absl::string_view,
                            std::unique_ptr<UcxWorker::IncomingData> data,
                            const UcxWorker::MessageSender&) {
                          absl::MutexLock lock(&mu);
                          got.push_back(std::move(data));
                        })
                    .ok());
    const std::vector<char> eager = RandomBytes(3000, 90);
    const std::vector<char> rendezvous = RandomBytes(size_t{1} << 20, 91);
    int sent_done = 0;
    absl::Status sent_status = absl::UnknownError("not sent");
    ASSERT_TRUE(
        endpoint
            ->SendMessage(9, "eager", std::string(eager.begin(), eager.end()))
            .ok());
    ASSERT_TRUE(endpoint
                    ->SendMessageWithData(9, "rndv",
                                          absl::MakeConstSpan(rendezvous),
                                          [&](const absl::Status& st) {
                                            absl::MutexLock lock(&mu);
                                            ++sent_done;
                                            sent_status = st;
                                          })
                    .ok());
    {
      absl::MutexLock lock(&mu);
      ASSERT_TRUE(mu.AwaitWithTimeout(
          absl::Condition(
              +[](decltype(got)* g) { return g->size() == 2; }, &got),
          absl::Seconds(20)))
          << got.size() << " of 2 messages arrived";
    }
    ASSERT_TRUE(got[0]->eager());
    ASSERT_FALSE(got[1]->eager());

    std::vector<char> sink(eager.size() + rendezvous.size(), '\0');
    auto region = server_context->Register(sink.data(), sink.size());
    ASSERT_TRUE(region.ok()) << region.status();
    // The progress thread busy (a task) until both deadlines have passed.
    absl::Notification busy, release;
    ASSERT_TRUE(server
                    ->Post([&busy, &release] {
                      busy.Notify();
                      release.WaitForNotification();
                    })
                    .ok());
    busy.WaitForNotification();
    const absl::Time deadline = absl::Now() + absl::Milliseconds(20);
    TransferHandle late_eager =
        server->Receive(std::move(got[0]), sink.data(), deadline);
    TransferHandle late_rendezvous = server->Receive(
        std::move(got[1]), sink.data() + eager.size(), deadline);
    while (absl::Now() <= deadline) absl::SleepFor(absl::Milliseconds(5));
    release.Notify();

    const absl::Time bound = absl::Now() + absl::Seconds(20);
    for (const TransferHandle* h : {&late_eager, &late_rendezvous}) {
      ASSERT_TRUE(h->WaitUntil(bound));
      EXPECT_TRUE(absl::IsDeadlineExceeded(h->overall_status()))
          << h->overall_status();
      EXPECT_FALSE(h->abandoned()) << "it was started, past its deadline";
    }
    // Nothing landed, now or later: the sender's send ends (the data was
    // released unread), and the worker is still there.
    {
      absl::MutexLock lock(&mu);
      ASSERT_TRUE(
          mu.AwaitWithTimeout(absl::Condition(
                                  +[](int* n) { return *n == 1; }, &sent_done),
                              absl::Seconds(20)))
          << "the sender's send did not end";
      EXPECT_TRUE(sent_status.ok()) << sent_status;  // as for data dropped
    }
    ASSERT_TRUE(server->Run([] {}).ok());
    EXPECT_EQ(std::count(sink.begin(), sink.end(), '\0'),
              static_cast<std::ptrdiff_t>(sink.size()))
        << "bytes of a receive past its deadline were written";
    endpoint.reset();
    client->Stop();
    server->Stop();
  }
}

// How many pages of [base, base + size) are resident (mincore).
size_t ResidentPages(char* base, size_t size) {
  const size_t page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> vec((size + page - 1) / page);
  if (mincore(base, size, vec.data()) != 0) {
    ADD_FAILURE() << "mincore: " << std::strerror(errno);
    return 0;
  }
  return std::count_if(vec.begin(), vec.end(), [](unsigned char v) { return v & 1; });
}

TEST(UcxContextAllocateTest, EveryPageExistsBeforeTheFirstTransfer) {
  // UCX's fresh memory has no pages; a transfer into it would fault on
  // every one, on the progress thread that serves the worker's transfers.
  for (const char* transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    UcxContextOptions options;
    options.config = ucx_test::TransportConfig(transport);
    absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
    ASSERT_TRUE(context.ok()) << context.status();
    constexpr size_t kSize = 24 << 20;
    absl::StatusOr<std::unique_ptr<MemoryRegion>> region = (*context)->Allocate(kSize);
    ASSERT_TRUE(region.ok()) << region.status();
    ASSERT_GE((*region)->size(), kSize);
    const size_t page = sysconf(_SC_PAGESIZE);
    EXPECT_EQ(ResidentPages((*region)->base(), kSize), kSize / page);
  }
}

// Names of UCX's shared-memory files in `dir` (a process killed with one
// mapped leaves it behind, holding that memory).
std::vector<std::string> UcxSharedMemoryFiles(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("ucx_shm_posix_", 0) == 0) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(UcxContextAllocateTest, MoreThanTheHostHasIsRefusedBeforeAnyMemoryIsTaken) {
  // Made resident page by page, it would bring the OOM killer instead.
  UcxContextOptions options;
  options.config = ucx_test::TransportConfig("shm");
  options.config["ALLOC_PRIO"] = "md:posix";
  absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
  ASSERT_TRUE(context.ok()) << context.status();
  const std::vector<std::string> before = UcxSharedMemoryFiles("/dev/shm");
  const size_t total = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  for (size_t size : {2 * total, size_t{1} << 62}) {
    absl::StatusOr<std::unique_ptr<MemoryRegion>> region = (*context)->Allocate(size);
    ASSERT_EQ(region.status().code(), absl::StatusCode::kResourceExhausted)
        << size << ": " << region.status();
    EXPECT_NE(region.status().message().find("MemAvailable"), std::string::npos)
        << region.status();
  }
  EXPECT_EQ(UcxSharedMemoryFiles("/dev/shm"), before);
  // What fits is still allocated.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> small = (*context)->Allocate(1 << 20);
  EXPECT_TRUE(small.ok()) << small.status();
}

// A container's memory limit is its cgroup's, which /proc/meminfo does not
// show: Allocate takes what the process's cgroups still allow into account.
TEST(UcxContextAllocateTest, TheCgroupsLimitIsFoundInV1AndV2) {
  char dir_template[] = "/tmp/kvdepot-cgroup-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr) << std::strerror(errno);
  const std::string root = dir_template;
  auto write = [&](const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << text;
  };
  // v2 only: the pod's limit less its usage.
  write(root + "/v2/cgroup", "0::/kubepods/pod1\n");
  write(root + "/sys/kubepods/pod1/memory.max", "1073741824\n");
  write(root + "/sys/kubepods/pod1/memory.current", "73741824\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/v2/cgroup", root + "/sys"),
            std::optional<uint64_t>(1000000000));
  // No limit ("max"), or no cgroup file system: nothing to say.
  write(root + "/open/cgroup", "0::/free\n");
  write(root + "/sys/free/memory.max", "max\n");
  write(root + "/sys/free/memory.current", "5\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/open/cgroup", root + "/sys"),
            std::nullopt);
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/none", root + "/sys"),
            std::nullopt);
  // Hybrid (v1 memory controller and a v2 line): the v1 limit; over it, 0.
  write(root + "/v1/cgroup", "4:memory:/docker/c1\n1:cpu:/\n0::/\n");
  write(root + "/sys/memory/docker/c1/memory.limit_in_bytes", "4096\n");
  write(root + "/sys/memory/docker/c1/memory.usage_in_bytes", "8192\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/v1/cgroup", root + "/sys"),
            std::optional<uint64_t>(0));
  // A container sharing the host's cgroup namespace (Docker on v1): its
  // file names the host's path, and its own cgroup is mounted at the root.
  write(root + "/shared/cgroup", "4:memory:/docker/c2\n");
  write(root + "/sys2/memory/memory.limit_in_bytes", "3221225472\n");
  write(root + "/sys2/memory/memory.usage_in_bytes", "1073741824\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/shared/cgroup", root + "/sys2"),
            std::optional<uint64_t>(uint64_t{2} << 30));
  // Inactive page cache (reclaimable) does not count as used.
  write(root + "/sys2/memory/memory.stat",
        "cache 900000000\ntotal_inactive_file 536870912\ntotal_rss 1\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/shared/cgroup", root + "/sys2"),
            std::optional<uint64_t>((uint64_t{5} << 29)));
  write(root + "/sys/kubepods/pod1/memory.stat", "anon 1\ninactive_file 3741824\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/v2/cgroup", root + "/sys"),
            std::optional<uint64_t>(1003741824));
  // A limit above the process's cgroup binds it too (a slice's MemoryMax,
  // a pod's limit over its containers'): the least room on the way up.
  write(root + "/nested/cgroup", "0::/slice/unit/leaf\n");
  write(root + "/sys3/slice/memory.max", "314572800\n");  // 300 MiB
  write(root + "/sys3/slice/memory.current", "104857600\n");
  write(root + "/sys3/slice/unit/memory.max", "max\n");
  write(root + "/sys3/slice/unit/memory.current", "104857600\n");
  write(root + "/sys3/slice/unit/leaf/memory.max", "1073741824\n");
  write(root + "/sys3/slice/unit/leaf/memory.current", "4096\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/nested/cgroup",
                                                 root + "/sys3"),
            std::optional<uint64_t>(uint64_t{200} << 20));
  // The root cgroup itself ("0::/"), with no limit file: nothing to say.
  write(root + "/top/cgroup", "0::/\n");
  EXPECT_EQ(transport_internal::CgroupMemoryLeft(root + "/top/cgroup",
                                                 root + "/sys3"),
            std::nullopt);
  std::filesystem::remove_all(root);
}

TEST(UcxContextAllocateTest, MeminfoValuesAreBytesForSizesAndCountsOtherwise) {
  char path[] = "/tmp/kvdepot-meminfo-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  close(fd);
  std::ofstream(path) << "MemTotal:       24000000 kB\n"
                         "MemAvailable:   1000 kB\n"
                         "HugePages_Total:      8\n"
                         "HugePages_Free:       6\n"
                         "HugePages_Rsvd:       2\n"
                         "Hugepagesize:       2048 kB\n";
  EXPECT_EQ(transport_internal::MeminfoValue("MemAvailable", path),
            std::optional<uint64_t>(1024000));
  EXPECT_EQ(transport_internal::MeminfoValue("HugePages_Free", path),
            std::optional<uint64_t>(6));
  EXPECT_EQ(transport_internal::MeminfoValue("Hugepagesize", path),
            std::optional<uint64_t>(2 << 20));
  // A name is matched whole, not as the start of another.
  EXPECT_EQ(transport_internal::MeminfoValue("HugePages", path), std::nullopt);
  EXPECT_EQ(transport_internal::MeminfoValue("MemAvailable", "/nonexistent"), std::nullopt);
  unlink(path);
}

TEST(UcxContextAllocateTest, ASharedMemoryFileSystemTooSmallIsAnErrorNotASignal) {
  // A container's /dev/shm is 64 MiB by default: a page past it would
  // raise SIGBUS when touched. Here a 4 MiB tmpfs stands for it. UCX 1.13
  // finds the room missing itself (it writes the file out); with a UCX that
  // does not, the prefault's error says it (madvise's EFAULT).
  char dir_template[] = "/tmp/kvdepot-small-shm-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr) << std::strerror(errno);
  const std::string dir = dir_template;
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=4m") != 0) {
    const int error = errno;
    rmdir(dir.c_str());
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(error)
                 << "; needs root)";
  }
  {
    UcxContextOptions options;
    options.config = ucx_test::TransportConfig("shm");
    options.config["ALLOC_PRIO"] = "md:posix";
    options.config["POSIX_DIR"] = dir;
    options.config["POSIX_USE_PROC_LINK"] = "n";
    absl::StatusOr<std::unique_ptr<UcxContext>> context = UcxContext::Create(options);
    ASSERT_TRUE(context.ok()) << context.status();
    absl::StatusOr<std::unique_ptr<MemoryRegion>> big = (*context)->Allocate(16 << 20);
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
    EXPECT_EQ(UcxSharedMemoryFiles(dir), std::vector<std::string>{})
        << "the failed allocation's file stays";
    absl::StatusOr<std::unique_ptr<MemoryRegion>> small = (*context)->Allocate(1 << 20);
    ASSERT_TRUE(small.ok()) << small.status();
    std::memset((*small)->base(), 0x5a, 1 << 20);
  }
  EXPECT_EQ(umount(dir.c_str()), 0) << std::strerror(errno);
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace kvdepot
