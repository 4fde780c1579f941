// Failures that are hard to bring about from outside, injected into a
// kvdepotd running in this process (test sync points), against a real
// libkvdepot client over loopback.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "server/config.h"
#include "server/daemon.h"
#include "server/kvdepot_service.h"
#include "storage/internal/sync_point.h"
#include "tests/embedded_daemon.h"
#include "tests/status_matchers.h"
#include "transport/ucx_address_sandbox.h"

namespace kvdepot {
namespace {

class DaemonInjectedFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonConfig config =
        testing::EmbeddedDaemonConfig("daemon_injected_faults_");
    config.ucx["TLS"] = "tcp";
    config.ucx_max_buffers_per_session = max_buffers_per_session_;
    auto daemon = testing::StartEmbeddedDaemon(config);
    ASSERT_OK(daemon);
    daemon_ = *std::move(daemon);
  }

  absl::StatusOr<std::unique_ptr<Client>> ConnectOverUcx(
      absl::Duration rpc_timeout = absl::Seconds(30),
      absl::Duration ucx_retry_interval = absl::Seconds(30)) {
    ClientOptions options;
    options.ucx_retry_interval = ucx_retry_interval;
    options.server = daemon_->grpc_address();
    options.transport = ClientOptions::Transport::kUcx;
    options.ucx["TLS"] = "tcp";
    options.rpc_timeout = rpc_timeout;
    return Client::Connect(options);
  }

  int max_buffers_per_session_ = 256;
  std::unique_ptr<Daemon> daemon_;
};

class OneBufferPerSessionTest : public DaemonInjectedFaultsTest {
 protected:
  void SetUp() override {
    max_buffers_per_session_ = 1;
    DaemonInjectedFaultsTest::SetUp();
  }
};

// UCX's errors map to several codes (Internal among them: an error UCX does
// not class, say); whichever the wire-up failed with, the client's session
// goes over gRPC and its blocks move intact.
TEST_F(DaemonInjectedFaultsTest, AnyFailedUcxWireUpLeavesTheClientOnGrpc) {
  const absl::Status failures[] = {
      absl::InternalError("ucp_ep_create: Shared memory error"),
      absl::ResourceExhaustedError("ucp_ep_create: Out of memory"),
      absl::InvalidArgumentError("ucp_ep_create: Invalid address"),
  };
  for (const absl::Status& failure : failures) {
    SCOPED_TRACE(failure.ToString());
    std::atomic<int> injected{0};
    internal::SyncPointCallback fail(
        "KvDepotService::AttachAndFinish:Attach", [&](void* arg) {
          static_cast<AttachPoint*>(arg)->status = failure;
          injected.fetch_add(1);
        });
    auto client = ConnectOverUcx();
    ASSERT_OK(client);
    auto session = (*client)->EnsureSession();
    ASSERT_OK(session);
    const std::string key =
        "key-" + std::to_string(static_cast<int>(failure.code()));
    const std::string bytes(
        64 << 10, static_cast<char>('a' + static_cast<int>(failure.code())));
    BlockToPut b{key, "", bytes};
    ASSERT_OK((*client)->Put("ns", {&b, 1}));
    EXPECT_GE(injected.load(), 1) << "the wire-up never ran";
    const absl::Status why = (*client)->data_plane_status();
    EXPECT_FALSE(why.ok());
    EXPECT_TRUE(absl::StrContains(why.message(), failure.message())) << why;
    const std::vector<absl::string_view> keys = {key};
    auto got = (*client)->Get("ns", keys);
    ASSERT_OK(got);
    ASSERT_EQ(got->size(), 1u);
    EXPECT_EQ((*got)[0].bytes, bytes);
    // The refused session left nothing behind: one session, this client's
    // (the one before it closed with its client).
    auto stats = (*client)->Stats();
    ASSERT_OK(stats);
    EXPECT_EQ(stats->sessions(), 1u);
  }
}

// A wire-up that takes as long as it may (a client worker that does not
// answer, wire-ups queued ahead) ends in time for the client to open its
// session without UCX before its own deadline, rather than after it, which
// failed every call that needed a session.
TEST_F(DaemonInjectedFaultsTest,
       ASlowUcxWireUpEndsInTimeForTheClientToUseGrpc) {
  constexpr absl::Duration kRpcTimeout = absl::Seconds(2);
  std::atomic<int> injected{0};
  internal::SyncPointCallback slow(
      "KvDepotService::AttachAndFinish:Attach", [&](void* arg) {
        auto* point = static_cast<AttachPoint*>(arg);
        // The connect to a worker that never answers: its whole timeout.
        absl::SleepFor(
            std::min(point->connect_by - absl::Now(), absl::Seconds(5)));
        point->status =
            absl::DeadlineExceededError("UCX endpoint wire-up timed out");
        injected.fetch_add(1);
      });
  auto client = ConnectOverUcx(kRpcTimeout);
  ASSERT_OK(client);
  ASSERT_OK((*client)->EnsureSession());
  EXPECT_EQ(injected.load(), 1);
  EXPECT_THAT((*client)->data_plane_status(),
              testing::StatusIs(absl::StatusCode::kDeadlineExceeded));
  const std::string bytes(64 << 10, 's');
  BlockToPut b{"slow", "", bytes};
  ASSERT_OK((*client)->Put("ns", {&b, 1}));
  const absl::string_view key = "slow";
  auto got = (*client)->Get("ns", {&key, 1});
  ASSERT_OK(got);
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].bytes, bytes);
}

// A UCX endpoint refused for a reason that may pass (the daemon's
// wire-ups backed up: Unavailable; UCX out of resources) leaves the client
// on gRPC only until ucx_retry_interval has passed; then its next transfer
// opens a session that asks again, and gets UCX. A refusal for its
// settings is not asked again.
TEST_F(DaemonInjectedFaultsTest, AClientRefusedUcxForNowAsksAgainLater) {
  for (const absl::Status& refusal :
       {absl::UnavailableError("64 UCX wire-ups are waiting already"),
        absl::ResourceExhaustedError("UCX: out of resources"),
        absl::FailedPreconditionError(
            "the client's UCX TCP segments do not fit")}) {
    SCOPED_TRACE(refusal.ToString());
    std::atomic<int> attaches{0};
    internal::SyncPointCallback refuse_once(
        "KvDepotService::AttachAndFinish:Attach", [&](void* arg) {
          if (attaches.fetch_add(1) == 0)
            static_cast<AttachPoint*>(arg)->status = refusal;
        });
    auto client = ConnectOverUcx(absl::Seconds(30), absl::Milliseconds(200));
    ASSERT_OK(client);
    const std::string bytes(64 << 10, 'a');
    BlockToPut b{"again", "", bytes};
    ASSERT_OK((*client)->Put("ns", {&b, 1}));
    std::vector<char> dst(bytes.size());
    ASSERT_OK((*client)->RegisterBuffer(dst.data(), dst.size()));
    const absl::string_view key = "again";
    absl::Span<char> into(dst.data(), dst.size());
    auto get = [&] {
      std::fill(dst.begin(), dst.end(), 0);
      TransferOp op = (*client)->GetIntoAsync("ns", {&key, 1}, {&into, 1});
      op.Wait();
      EXPECT_OK(op.statuses()[0]);
      EXPECT_EQ(std::string(dst.data(), dst.size()), bytes);
      return std::string(op.transport());
    };
    EXPECT_EQ(get(), "grpc");
    EXPECT_EQ(get(), "grpc");  // within the interval
    absl::SleepFor(absl::Milliseconds(300));
    if (!absl::IsFailedPrecondition(refusal)) {
      EXPECT_EQ(get(), "ucx");
      EXPECT_OK((*client)->data_plane_status());
      EXPECT_EQ(attaches.load(), 2);
    } else {
      EXPECT_EQ(get(), "grpc");
      EXPECT_EQ(attaches.load(), 1);
    }
  }
}

// Asking again for UCX leaves the old session to its lease, but not while a
// pinning lookup is in flight in it: that lookup's pin, not yet known to
// the client when the next transfer asked again, would end with the lease
// while the caller holds it.
TEST_F(DaemonInjectedFaultsTest,
       AskingAgainForUcxKeepsASessionWithALookupInFlight) {
  std::atomic<int> attaches{0};
  internal::SyncPointCallback refuse_once(
      "KvDepotService::AttachAndFinish:Attach", [&](void* arg) {
        if (attaches.fetch_add(1) == 0) {
          static_cast<AttachPoint*>(arg)->status =
              absl::UnavailableError("backed up");
        }
      });
  ClientOptions options;
  options.server = daemon_->grpc_address();
  options.ucx["TLS"] = "tcp";
  options.ucx_retry_interval = absl::Milliseconds(100);
  options.lease = absl::Seconds(2);
  auto client = Client::Connect(options);
  ASSERT_OK(client);
  const std::string bytes(64 << 10, 'p');
  BlockToPut b{"pinned", "", bytes};
  ASSERT_OK((*client)->Put("ns", {&b, 1}));
  ASSERT_OK((*client)->EnsureSession());
  ASSERT_FALSE((*client)->data_plane_status().ok());
  std::vector<char> dst(bytes.size());
  ASSERT_OK((*client)->RegisterBuffer(dst.data(), dst.size()));
  absl::SleepFor(absl::Milliseconds(200));  // past the retry interval

  absl::Notification held, release;
  std::atomic<int> answers{0};
  internal::SyncPointCallback hold("Client::LookupAnswered", [&](void*) {
    if (answers.fetch_add(1) != 0) return;
    held.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(30));
  });
  const absl::string_view key = "pinned";
  absl::StatusOr<LookupReply> pinned;
  std::thread lookup([&] {
    pinned = (*client)->Lookup("ns", {&key, 1}, false, /*pin=*/true);
  });
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(absl::Seconds(20)));
  absl::Span<char> into(dst.data(), dst.size());
  TransferOp get = (*client)->GetIntoAsync("ns", {&key, 1}, {&into, 1});
  get.Wait();
  EXPECT_OK(get.statuses()[0]);
  release.Notify();
  lookup.join();
  ASSERT_OK(pinned);
  ASSERT_NE(pinned->pin_id, 0u);
  // Past the lease: the session was kept alive, and the pin with it.
  absl::SleepFor(absl::Seconds(3));
  auto stats = (*client)->Stats();
  ASSERT_OK(stats);
  EXPECT_EQ(stats->pins(), 1u);
  EXPECT_OK((*client)->Unpin(pinned->pin_id));
}

// A session holding as many buffers as the daemon allows is left for a new
// one (rotation, at most once a minute) while a get of it is in flight: the
// daemon still serves the old session, and the get ends with its bytes,
// not as a miss (its UCX requests were ended with the session, before).
TEST_F(OneBufferPerSessionTest, AGetInFlightFinishesWhenItsSessionIsRotated) {
  auto client = ConnectOverUcx();
  ASSERT_OK(client);
  ASSERT_OK((*client)->EnsureSession());
  ASSERT_OK((*client)->data_plane_status());
  const std::string bytes(64 << 10, 'r');
  BlockToPut b{"rotated", "", bytes};
  ASSERT_OK((*client)->Put("ns", {&b, 1}));
  std::vector<char> first(bytes.size()), second(bytes.size());
  ASSERT_OK((*client)->RegisterBuffer(first.data(), first.size()));
  ASSERT_OK((*client)->RegisterBuffer(second.data(), second.size()));

  absl::Notification held, release;
  std::atomic<int> pushes{0};
  internal::SyncPointCallback hold(
      "KvDepotService::StartPushBlocks", [&](void*) {
        if (pushes.fetch_add(1) != 0) return;
        held.Notify();
        release.WaitForNotificationWithTimeout(absl::Seconds(30));
      });
  const absl::string_view key = "rotated";
  absl::Span<char> into_first(first.data(), first.size());
  TransferOp in_flight =
      (*client)->GetIntoAsync("ns", {&key, 1}, {&into_first, 1});
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // The second buffer is one too many for the session: the client moves on
  // to a new one (this get takes whichever path it can).
  absl::Span<char> into_second(second.data(), second.size());
  TransferOp next = (*client)->GetIntoAsync("ns", {&key, 1}, {&into_second, 1});
  release.Notify();
  in_flight.Wait();
  next.Wait();
  ASSERT_OK(in_flight.statuses()[0]);
  EXPECT_STREQ(in_flight.transport(), "ucx");
  EXPECT_EQ(std::string(first.data(), first.size()), bytes);
  ASSERT_OK(next.statuses()[0]);
  EXPECT_EQ(std::string(second.data(), second.size()), bytes);
}

}  // namespace
}  // namespace kvdepot

// The daemon runs its UCX address sandbox as this very executable
// (/proc/self/exe), as kvdepotd's main does; without this, the sandbox would
// run the tests again.
int main(int argc, char** argv) {
  if (argc > 1 &&
      std::string_view(argv[1]) == kvdepot::kUcxAddressSandboxFlag) {
    return kvdepot::RunUcxAddressSandbox(
        std::vector<std::string>(argv + 2, argv + argc));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
