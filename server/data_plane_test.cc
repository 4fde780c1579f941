// DataPlane in this process, against a client worker of this process, over
// real UCX (shared memory and TCP on loopback). The sync points of
// data_plane.cc put a client's death at a fixed place in OpenSession.
#include "server/data_plane.h"

#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "storage/internal/sync_point.h"
#include "transport/ucx_context.h"
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

    DataPlaneOptions options;
    options.ucx = ucx_test::TransportConfig("shm");
    options.workers = 1;
    options.request_workers = 1;
    options.connect_timeout = absl::Seconds(1);
    absl::StatusOr<std::unique_ptr<DataPlane>> plane = DataPlane::Create(
        options, DramRegion{arena_, kArenaBytes},
        [this](SessionId session, const absl::Status&) {
          absl::MutexLock lock(&mu_);
          lost_.push_back(session);
        },
        std::make_shared<spdlog::logger>("test",
                                         std::make_shared<spdlog::sinks::null_sink_mt>()));
    ASSERT_TRUE(plane.ok()) << plane.status();
    plane_ = *std::move(plane);
  }

  void TearDown() override {
    plane_.reset();
    client_worker_.reset();
    if (arena_ != nullptr) munmap(arena_, kArenaBytes);
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

}  // namespace
}  // namespace kvdepot
