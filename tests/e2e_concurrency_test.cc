// 8 concurrent writers and 8 concurrent readers over 10,000 blocks against a
// real kvdepotd, with every byte of every block checked.
#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;

constexpr int kBlocks = 10000;
constexpr int kWriters = 8;
constexpr int kReaders = 8;
constexpr char kNs[] = "e2e/concurrency";

// 32-byte keys (the size of a vLLM block hash), chained per writer.
std::string KeyOf(int i) {
  std::string k(32, '\0');
  for (int b = 0; b < 4; ++b) k[b] = static_cast<char>(i >> (8 * b));
  k[31] = 'k';
  return k;
}

// Deterministic contents: size 1..24 KiB and bytes derived from the index,
// so a block served under the wrong key or with a torn copy is caught.
std::string BytesOf(int i) {
  std::mt19937 rng(static_cast<uint32_t>(i) * 2654435761u);
  std::string b(1 + rng() % (24 << 10), '\0');
  for (auto& c : b) c = static_cast<char>(rng());
  return b;
}

std::unique_ptr<Client> Connect(const std::string& addr) {
  ClientOptions o;
  o.server = addr;
  return std::move(Client::Connect(o)).value();
}

TEST(ConcurrencyTest, EightWritersAndReadersOverTenThousandBlocks) {
  auto daemon = DaemonProcess::Start({"--dram-capacity", "512MiB"});
  ASSERT_OK(daemon);
  const std::string addr = (*daemon)->address();

  // Writer w owns the indices i with i % kWriters == w, chained by writer;
  // done[i] is set once block i is committed, so readers only ask for those.
  std::atomic<int> written{0};
  std::vector<std::atomic<bool>> done(kBlocks);
  std::atomic<int> errors{0}, reads_checked{0};
  std::atomic<bool> writers_finished{false};

  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      auto client = Connect(addr);
      std::vector<std::string> keys, bytes, parents;
      for (int i = w; i < kBlocks; i += kWriters * 4) {
        keys.clear();
        bytes.clear();
        parents.clear();
        for (int j = i; j < std::min(kBlocks, i + kWriters * 4); j += kWriters) {
          keys.push_back(KeyOf(j));
          bytes.push_back(BytesOf(j));
          parents.push_back(j >= kWriters ? KeyOf(j - kWriters) : "");
        }
        std::vector<BlockToPut> batch;
        for (size_t b = 0; b < keys.size(); ++b) {
          batch.push_back(BlockToPut{keys[b], parents[b], bytes[b]});
        }
        auto r = client->Put(kNs, batch);
        if (!r.ok()) {
          ADD_FAILURE() << r.status();
          ++errors;
          return;
        }
        for (size_t b = 0; b < keys.size(); ++b) {
          int idx = i + static_cast<int>(b) * kWriters;
          if ((*r)[b] != PutResult::kStored) ++errors;
          done[idx] = true;
          ++written;
        }
      }
    });
  }
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] {
      auto client = Connect(addr);
      std::mt19937 rng(r);
      while (!writers_finished) {
        int i = static_cast<int>(rng() % kBlocks);
        if (!done[i]) continue;
        std::string key = KeyOf(i);
        absl::string_view k = key;
        auto got = client->Get(kNs, {&k, 1});
        if (!got.ok() || (*got)[0].bytes != BytesOf(i)) {
          ADD_FAILURE() << "block " << i << ": "
                        << (got.ok() ? "wrong bytes" : got.status().ToString());
          ++errors;
          return;
        }
        ++reads_checked;
      }
    });
  }
  for (int w = 0; w < kWriters; ++w) threads[w].join();
  writers_finished = true;
  for (size_t t = kWriters; t < threads.size(); ++t) threads[t].join();
  ASSERT_EQ(errors.load(), 0);
  EXPECT_EQ(written.load(), kBlocks);
  EXPECT_GT(reads_checked.load(), 0);

  // Every block, read back in batches, with every byte compared.
  auto client = Connect(addr);
  for (int i = 0; i < kBlocks; i += 100) {
    std::vector<std::string> keys;
    for (int j = i; j < i + 100; ++j) keys.push_back(KeyOf(j));
    std::vector<absl::string_view> views(keys.begin(), keys.end());
    auto got = client->Get(kNs, views);
    ASSERT_OK(got);
    for (int j = 0; j < 100; ++j) {
      ASSERT_EQ((*got)[j].bytes, BytesOf(i + j)) << "block " << i + j;
    }
  }
  // Prefix lookup over one writer's chain: all hits.
  std::vector<std::string> chain;
  for (int i = 0; i < kBlocks; i += kWriters) chain.push_back(KeyOf(i));
  chain.resize(1024);
  std::vector<absl::string_view> views(chain.begin(), chain.end());
  auto lookup = client->Lookup(kNs, views, /*prefix=*/true, /*pin=*/false);
  ASSERT_OK(lookup);
  EXPECT_EQ(lookup->prefix_hits, 1024u);

  auto stats = client->Stats();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->dram().blocks(), static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(stats->reservations(), 0u);
  EXPECT_EQ(stats->dram().evictions(), 0u);
  auto rc = (*daemon)->Stop(SIGTERM);
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

// The tests below: a session of 60 s opened over `stub`.
uint64_t OpenLongSession(v1::KvDepot::Stub& stub) {
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_lease_ms(60000);
  v1::OpenSessionResponse resp;
  grpc::Status st = stub.OpenSession(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp.session_id();
}

// A BeginPut of one block of `size` bytes under `key` in `ns`, in
// `session`, within `timeout`.
grpc::Status BeginPutOne(v1::KvDepot::Stub& stub, uint64_t session,
                         const std::string& ns, const std::string& key,
                         uint64_t size, absl::Duration timeout,
                         v1::BeginPutResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::BeginPutRequest req;
  req.set_session_id(session);
  req.set_namespace_(ns);
  v1::PutSpec* spec = req.add_blocks();
  spec->set_key(key);
  spec->set_size(size);
  return stub.BeginPut(&ctx, req, resp);
}

// A Write stream that announces one block of `size` bytes under `key` in
// `ns`, sends none of them and ends, within `timeout`: its status.
grpc::Status WriteHeaderOnly(v1::KvDepot::Stub& stub, const std::string& ns,
                             const std::string& key, uint64_t size,
                             absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::WriteResponse resp;
  auto writer = stub.Write(&ctx, &resp);
  v1::WriteRequest msg;
  msg.mutable_header()->set_namespace_(ns);
  msg.mutable_header()->set_key(key);
  msg.mutable_header()->set_size(size);
  writer->Write(msg);
  writer->WritesDone();
  return writer->Finish();
}

// A Stats, and a KeepAlive of `session`, are answered within 3 s each
// (behind `what`, for the message).
void ExpectStatsAndKeepAliveAnswered(v1::KvDepot::Stub& stub, uint64_t session,
                                     const char* what) {
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
    v1::StatsResponse resp;
    grpc::Status st = stub.Stats(&ctx, v1::StatsRequest(), &resp);
    EXPECT_TRUE(st.ok()) << "Stats behind " << what << ": "
                         << st.error_message();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
  v1::KeepAliveRequest req;
  req.set_session_id(session);
  v1::KeepAliveResponse resp;
  grpc::Status st = stub.KeepAlive(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << "KeepAlive behind " << what << ": "
                       << st.error_message();
}

// With puts waiting for room: a Stats and a new session's KeepAlive are
// answered within 3 s each, and so is the AbortPut of `holder`'s
// reservation `held` (which lets the waiting puts in).
void ExpectAnsweredThenLetGo(v1::KvDepot::Stub& stub, uint64_t holder,
                             uint64_t held) {
  const uint64_t other = OpenLongSession(stub);
  ASSERT_NE(other, 0u);
  ExpectStatsAndKeepAliveAnswered(stub, other, "waiting puts");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
  v1::AbortPutRequest req;
  req.set_session_id(holder);
  req.set_reservation_id(held);
  v1::AbortPutResponse resp;
  grpc::Status st = stub.AbortPut(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << "AbortPut behind waiting puts: "
                       << st.error_message();
}

// Puts that must wait for room (DRAM full of a reservation nobody commits,
// an NVMe tier to make room into) wait on kvdepotd's put pool, not on
// gRPC's threads. Bug: each BeginPut (and Write header) waited up to 5 s on
// a gRPC thread; a few of them held every one, so a KeepAlive queued behind
// them past its deadline and an innocent client's session expired.
TEST(ConcurrencyTest, PutsWaitingForRoomDoNotStallOtherCalls) {
  auto daemon = DaemonProcess::Start(
      {"--dram-capacity", "8MiB", "--nvme-capacity", "64MiB"});
  ASSERT_OK(daemon);
  auto client = Connect((*daemon)->address());
  v1::KvDepot::Stub& stub = client->stub();
  auto begin_put = [&stub](uint64_t session, const std::string& key,
                           uint64_t size, absl::Duration timeout,
                           v1::BeginPutResponse* resp) {
    return BeginPutOne(stub, session, "e2e/room", key, size, timeout, resp);
  };
  // Nearly all of DRAM reserved, never committed.
  const uint64_t holder = OpenLongSession(stub);
  v1::BeginPutResponse held;
  grpc::Status hold = begin_put(holder, "held", 7 << 20, absl::Seconds(10), &held);
  ASSERT_TRUE(hold.ok()) << hold.error_message();

  // More waiting puts than gRPC has threads here, over gRPC's unary call
  // and over Write streams.
  const int waiters = 4 * static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < waiters; ++i) {
    threads.emplace_back([&, i] {
      ++started;
      if (i % 2 == 0) {
        v1::BeginPutResponse resp;
        begin_put(OpenLongSession(stub), absl::StrCat("w", i), 2 << 20,
                  absl::Seconds(4), &resp)
            .error_code();
      } else {
        WriteHeaderOnly(stub, "e2e/room", absl::StrCat("w", i), 2 << 20,
                        absl::Seconds(4))
            .error_code();
      }
    });
  }
  while (started.load() < waiters) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(500));  // the puts reach the daemon

  // Another client's calls are answered meanwhile: its lease is kept, and
  // a put that fits (after the holder lets go) is taken.
  ExpectAnsweredThenLetGo(stub, holder, held.reservation_id());
  for (std::thread& t : threads) t.join();
  EXPECT_OK(client->Health());
  EXPECT_TRUE((*daemon)->Running()) << (*daemon)->Log();
}

// A put that waits for room the client stops waiting for: the daemon's wait
// ends (5 s, no room came) after the client gave up, and the call is
// counted CANCELLED, what happened to it, not RESOURCE_EXHAUSTED, which
// would page an operator about a full DRAM tier the client never learned of.
TEST(ConcurrencyTest, APutTheClientGaveUpWaitingForRoomOnIsCountedCancelled) {
  auto daemon = DaemonProcess::Start({"--dram-capacity", "8MiB"});
  ASSERT_OK(daemon);
  auto client = Connect((*daemon)->address());
  v1::KvDepot::Stub& stub = client->stub();
  const uint64_t holder = OpenLongSession(stub);
  v1::BeginPutResponse held;  // never committed
  ASSERT_TRUE(BeginPutOne(stub, holder, "e2e/gaveup", "held", 7 << 20,
                          absl::Seconds(10), &held)
                  .ok());
  std::thread write([&] {
    EXPECT_EQ(
        WriteHeaderOnly(stub, "e2e/gaveup", "w", 2 << 20, absl::Seconds(1))
            .error_code(),
        grpc::StatusCode::DEADLINE_EXCEEDED);
  });
  v1::BeginPutResponse resp;
  EXPECT_EQ(BeginPutOne(stub, OpenLongSession(stub), "e2e/gaveup", "b", 2 << 20,
                        absl::Seconds(1), &resp)
                .error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  write.join();
  // The daemon's waits end about 5 s after they began.
  const std::string write_cancelled =
      "kvdepot_requests_total{code=\"CANCELLED\",op=\"Write\"} 1";
  const std::string begin_cancelled =
      "kvdepot_requests_total{code=\"CANCELLED\",op=\"BeginPut\"} 1";
  std::string text;
  for (int i = 0; i < 100; ++i) {
    text = testing::ScrapeMetrics(**daemon);
    if (absl::StrContains(text, write_cancelled) &&
        absl::StrContains(text, begin_cancelled)) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(absl::StrContains(text, write_cancelled)) << text;
  EXPECT_TRUE(absl::StrContains(text, begin_cancelled)) << text;
  EXPECT_FALSE(
      absl::StrContains(text, "code=\"RESOURCE_EXHAUSTED\",op=\"Write\""));
  EXPECT_FALSE(
      absl::StrContains(text, "code=\"RESOURCE_EXHAUSTED\",op=\"BeginPut\""));
}

// The same for PullBlocks as a gRPC call (libkvdepot's puts from registered
// memory when requests over UCX are off, or too large for them). Bug: it
// waited for room on a gRPC thread; another client's KeepAlive went
// unanswered for 20 s behind 16 such puts.
TEST(ConcurrencyTest, PullBlocksWaitingForRoomDoNotStallOtherCalls) {
  auto daemon = DaemonProcess::Start(
      {"--dram-capacity", "8MiB", "--nvme-capacity", "64MiB"});
  ASSERT_OK(daemon);
  auto client = Connect((*daemon)->address());
  v1::KvDepot::Stub& stub = client->stub();
  ClientOptions o;
  o.server = (*daemon)->address();
  o.ucx_requests = false;  // PullBlocks as gRPC calls
  o.rpc_timeout = absl::Seconds(30);
  auto putter = std::move(Client::Connect(o)).value();
  constexpr int kPuts = 16;
  constexpr size_t kSize = 2 << 20;
  auto memory = putter->AllocateBuffer((kPuts + 1) * kSize);
  ASSERT_OK(memory);
  ASSERT_OK(putter->data_plane_status());
  {
    // The buffer registered (its first use), so every put below is a
    // PullBlocks at once.
    BlockToPut b{"first", "",
                 absl::string_view(memory->data() + kPuts * kSize, 4096)};
    TransferOp op = putter->PutFromAsync("e2e/room", {&b, 1});
    op.Wait();
    ASSERT_OK(op.statuses()[0]);
    ASSERT_EQ(std::string(op.transport()), "ucx");
  }
  // Nearly all of DRAM reserved, never committed.
  const uint64_t holder = OpenLongSession(stub);
  v1::BeginPutResponse held;
  {
    grpc::ClientContext ctx;
    v1::BeginPutRequest req;
    req.set_session_id(holder);
    req.set_namespace_("e2e/room");
    v1::PutSpec* spec = req.add_blocks();
    spec->set_key("held");
    spec->set_size(7 << 20);
    grpc::Status st = stub.BeginPut(&ctx, req, &held);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  std::vector<std::string> keys;
  std::vector<TransferOp> ops;
  for (int i = 0; i < kPuts; ++i) {
    keys.push_back(absl::StrCat("p", i));
    absl::Span<char> bytes = memory->subspan(i * kSize, kSize);
    std::fill(bytes.begin(), bytes.end(), static_cast<char>('a' + i));
    BlockToPut b{keys.back(), "",
                 absl::string_view(bytes.data(), bytes.size())};
    ops.push_back(putter->PutFromAsync("e2e/room", {&b, 1}));
  }
  absl::SleepFor(absl::Milliseconds(300));  // the puts reach the daemon

  // Another client's calls are answered meanwhile.
  ExpectAnsweredThenLetGo(stub, holder, held.reservation_id());
  for (TransferOp& op : ops) op.Wait();
  EXPECT_OK(client->Health());
  EXPECT_TRUE((*daemon)->Running()) << (*daemon)->Log();
}

// A UCX worker that is never progressed: a client stopped (SIGSTOP) right
// after it sent its address, or one whose host drops the daemon's
// connections. Its address, for OpenSession.
class StalledUcxWorker {
 public:
  StalledUcxWorker() {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return;
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
    const ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return;
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(context_, &wp, &worker_) != UCS_OK) return;
    ucp_address_t* address = nullptr;
    size_t length = 0;
    if (ucp_worker_get_address(worker_, &address, &length) != UCS_OK) return;
    address_.assign(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(worker_, address);
  }
  ~StalledUcxWorker() {
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }
  const std::string& address() const { return address_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
};

// OpenSession wires up a UCX endpoint to the client's worker: up to two
// connects of connect_timeout (5 s) each when the worker never answers.
// Those waits were made on gRPC's threads (two on this machine), and every
// other client's call queued behind them: Stats took 5 s with two such
// clients, 48 s with 16, past a 30 s lease. They are made off those
// threads now; other calls are answered meanwhile.
TEST(ConcurrencyTest, OpenSessionsToStalledUcxClientsDoNotStallOtherCalls) {
  auto daemon = DaemonProcess::Start({"--dram-capacity", "32MiB"});
  ASSERT_OK(daemon);
  auto client = Connect((*daemon)->address());
  v1::KvDepot::Stub& stub = client->stub();
  StalledUcxWorker stalled;
  ASSERT_FALSE(stalled.address().empty()) << "no UCX worker here";
  const uint64_t other = OpenLongSession(stub);
  ASSERT_NE(other, 0u);
  constexpr int kStalled = 6;
  std::vector<std::thread> opens;
  std::atomic<int> answered{0};
  for (int i = 0; i < kStalled; ++i) {
    opens.emplace_back([&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
      v1::OpenSessionRequest req;
      req.set_client_name("stalled");
      req.set_host_id("another-host");  // over TCP, not shared memory
      req.set_ucx_worker_address(stalled.address());
      v1::OpenSessionResponse resp;
      grpc::Status st = stub.OpenSession(&ctx, req, &resp);
      EXPECT_FALSE(st.ok() && resp.ucx_connected()) << "the worker answered";
      ++answered;
    });
  }
  absl::SleepFor(absl::Milliseconds(500));  // the wire-ups are under way
  for (int round = 0; round < 3; ++round) {
    ExpectStatsAndKeepAliveAnswered(stub, other, "UCX wire-ups");
  }
  EXPECT_LT(answered.load(), kStalled) << "the wire-ups ended too soon to show";
  for (std::thread& t : opens) t.join();
  EXPECT_OK(client->Health());
  EXPECT_TRUE((*daemon)->Running()) << (*daemon)->Log();
}

}  // namespace
}  // namespace kvdepot
