// Verify and Compact against a kvdepotd running in this process (so that a
// test sync point can hold a scan mid-way): they run on the daemon's
// maintenance thread, one at a time, while other calls are served, and a
// shutdown cuts a running one short instead of waiting for it.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/config.h"
#include "server/daemon.h"
#include "storage/internal/sync_point.h"
#include "tests/embedded_daemon.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

constexpr int kBlocks = 4;

class DaemonMaintenanceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonConfig config = testing::EmbeddedDaemonConfig("daemon_maintenance_");
    config.ucx_enabled = false;
    auto daemon = testing::StartEmbeddedDaemon(config);
    ASSERT_OK(daemon);
    daemon_ = *std::move(daemon);

    ClientOptions options;
    options.server = daemon_->grpc_address();
    options.transport = ClientOptions::Transport::kGrpc;
    options.rpc_timeout = absl::Seconds(30);
    auto client = Client::Connect(options);
    ASSERT_OK(client);
    client_ = *std::move(client);
    std::vector<std::string> keys;
    for (int i = 0; i < kBlocks; ++i) {
      keys.push_back("block-" + std::to_string(i));
      const std::string bytes(256 << 10, static_cast<char>('a' + i));
      BlockToPut b{keys.back(), i > 0 ? absl::string_view(keys[i - 1]) : "",
                   bytes};
      ASSERT_OK(client_->Put("ns", {&b, 1}));
    }
    // On NVMe, where a scan reads them.
    auto persisted = daemon_->store().PersistDram();
    ASSERT_OK(persisted);
    ASSERT_EQ(*persisted, uint64_t{kBlocks});
    stub_ = v1::KvDepot::NewStub(grpc::CreateChannel(
        daemon_->grpc_address(), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    // A test that failed before releasing its held scan still ends it.
    if (verify_.joinable()) ReleaseHeldVerify();
    hold_.reset();
    client_.reset();
    daemon_.reset();
  }

  // Calls `method` with a deadline of `seconds`.
  template <typename Req, typename Resp>
  grpc::Status Call(grpc::Status (v1::KvDepot::Stub::*method)(
                        grpc::ClientContext*, const Req&, Resp*),
                    Resp* resp, int seconds = 10) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(seconds));
    return (stub_.get()->*method)(&ctx, Req(), resp);
  }

  // Starts a Verify on another thread (its answer in verified_ and
  // verified_resp_ once verify_ is joined) whose scan is held at its first
  // block until release_; true once it is held there.
  bool StartHeldVerify() {
    hold_ = std::make_unique<internal::SyncPointCallback>(
        "NvmeTier::Verify:Scanned", [this](void*) {
          if (held_.fetch_add(1) != 0) return;
          char name[16] = {};
          pthread_getname_np(pthread_self(), name, sizeof name);
          scan_thread_ = name;
          scanning_.Notify();
          release_.WaitForNotificationWithTimeout(absl::Seconds(60));
        });
    verify_ = std::thread([this] {
      verified_ = Call(&v1::KvDepot::Stub::Verify, &verified_resp_, 60);
    });
    return scanning_.WaitForNotificationWithTimeout(absl::Seconds(30));
  }

  // Lets the held scan go on, and waits for the Verify's answer.
  void ReleaseHeldVerify() {
    if (!release_.HasBeenNotified()) release_.Notify();
    verify_.join();
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::KvDepot::Stub> stub_;
  std::unique_ptr<internal::SyncPointCallback> hold_;
  std::thread verify_;
  grpc::Status verified_;
  v1::VerifyResponse verified_resp_;
  std::atomic<int> held_{0};
  std::string scan_thread_;  // the held scan's thread's name
  absl::Notification scanning_;
  absl::Notification release_;
};

TEST_F(DaemonMaintenanceTest, AVerifyRunsAloneWhileOtherCallsAreServed) {
  ASSERT_TRUE(StartHeldVerify());
  // On the daemon's maintenance thread, not one of gRPC's (which other
  // calls need; the calls below would pass either way, gRPC having more).
  EXPECT_EQ(scan_thread_, "kvd-nvme-maint");

  // The scan is held: other calls are answered, the blocks served...
  EXPECT_OK(client_->Health());
  auto stats = client_->Stats();
  EXPECT_OK(stats);
  auto got = client_->Get("ns", std::vector<absl::string_view>{"block-0"});
  ASSERT_OK(got);
  EXPECT_EQ((*got)[0].bytes, std::string(256 << 10, 'a'));
  // ... and a second Verify, or a Compact, is refused at once.
  v1::VerifyResponse second;
  EXPECT_EQ(Call(&v1::KvDepot::Stub::Verify, &second).error_code(),
            grpc::StatusCode::ABORTED);
  v1::CompactResponse compact;
  EXPECT_EQ(Call(&v1::KvDepot::Stub::Compact, &compact).error_code(),
            grpc::StatusCode::ABORTED);

  ReleaseHeldVerify();
  EXPECT_TRUE(verified_.ok()) << verified_.error_message();
  EXPECT_EQ(verified_resp_.blocks_checked(), uint64_t{kBlocks});
  EXPECT_EQ(verified_resp_.corrupt_dropped(), 0u);
  // Its end frees the slot.
  EXPECT_TRUE(Call(&v1::KvDepot::Stub::Compact, &compact, 60).ok());
}

TEST_F(DaemonMaintenanceTest, AShutdownCutsARunningVerifyShort) {
  ASSERT_TRUE(StartHeldVerify());

  std::thread shutdown([&] { daemon_->Shutdown(); });
  // Draining (NOT_SERVING) comes just before the scan is told to stop.
  for (int i = 0; i < 300 && client_->Health().ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE(client_->Health().ok());
  absl::SleepFor(absl::Milliseconds(500));
  ReleaseHeldVerify();
  shutdown.join();
  EXPECT_EQ(verified_.error_code(), grpc::StatusCode::CANCELLED)
      << verified_.error_message();
  EXPECT_LT(verified_resp_.blocks_checked(), uint64_t{kBlocks});
}

}  // namespace
}  // namespace kvdepot
