// PeerMonitor over real UCX on loopback: client processes that die or exit
// are reported within seconds, with the id the server attached.
#include "transport/peer_monitor.h"

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "transport/ucx_context.h"
#include "transport/ucx_test_util.h"
#include "transport/ucx_worker.h"

namespace kvdepot {
namespace {

// How long a dead client may take to be reported. The tests' keepalive is
// 200 ms and a killed process's TCP connections reset at once; this leaves
// room for a loaded machine.
constexpr absl::Duration kReportWithin = absl::Seconds(5);

class PeerMonitorTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    UcxContextOptions options;
    options.config = ucx_test::TransportConfig(GetParam());
    auto context = UcxContext::Create(options);
    if (!context.ok()) {
      GTEST_SKIP() << "UCX cannot create a context here (" << context.status()
                   << ")";
    }
    context_ = *std::move(context);
    auto worker = UcxWorker::Create(*context_);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = *std::move(worker);
    monitor_ = std::make_unique<PeerMonitor>(
        *worker_, [this](uint64_t id, const absl::Status& why) {
          absl::MutexLock lock(&mu_);
          failed_.push_back(id);
          last_why_ = why;
        });
  }

  void TearDown() override {
    monitor_.reset();
    worker_.reset();
  }

  // Starts a client process that connects to the server's worker, and
  // returns it with its worker address in `address`.
  std::unique_ptr<ucx_test::PeerProcess> StartClient(std::string* address) {
    auto peer = std::make_unique<ucx_test::PeerProcess>(
        KVDEPOT_UCX_TEST_PEER,
        std::vector<std::string>{
            "--transport", GetParam(), "--mode", "idle", "--server",
            absl::BytesToHexString(worker_->address())});
    const std::string line = peer->ReadLine();
    EXPECT_TRUE(absl::StartsWith(line, "ADDRESS ")) << "client said: " << line;
    *address = absl::HexStringToBytes(line.substr(line.find(' ') + 1));
    return peer;
  }

  // Waits until `id` is reported or `within` passes; returns whether it
  // was.
  bool WaitReported(uint64_t id, absl::Duration within) {
    absl::MutexLock lock(&mu_);
    auto reported = [this, id]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return std::find(failed_.begin(), failed_.end(), id) != failed_.end();
    };
    mu_.AwaitWithTimeout(absl::Condition(&reported), within);
    return reported();
  }

  // The server's half of a UCX connection is complete a little after the
  // client's (see README, "UCX 1.13 caveats"); a client is never killed
  // inside that window here.
  static void LetTheConnectionSettle() {
    absl::SleepFor(absl::Milliseconds(300));
  }

  std::unique_ptr<UcxContext> context_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<PeerMonitor> monitor_;
  absl::Mutex mu_;
  std::vector<uint64_t> failed_ ABSL_GUARDED_BY(mu_);
  absl::Status last_why_ ABSL_GUARDED_BY(mu_);
};

TEST_P(PeerMonitorTest, ReportsAKilledClientWithItsId) {
  std::string address;
  auto client = StartClient(&address);
  ASSERT_TRUE(monitor_->Watch(42, address).ok());
  EXPECT_EQ(monitor_->size(), 1u);
  LetTheConnectionSettle();

  const absl::Time killed = absl::Now();
  client->Kill();
  client->Wait();
  ASSERT_TRUE(WaitReported(42, kReportWithin))
      << "no report within " << kReportWithin;
  const absl::Duration took = absl::Now() - killed;
  std::printf("client death reported after %s\n",
              absl::FormatDuration(took).c_str());
  {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(failed_, std::vector<uint64_t>{42});
    EXPECT_EQ(last_why_.code(), absl::StatusCode::kUnavailable) << last_why_;
  }
  EXPECT_EQ(monitor_->size(), 0u);
  // Reported once; the id is no longer watched.
  EXPECT_EQ(monitor_->Unwatch(42).code(), absl::StatusCode::kNotFound);
}

TEST_P(PeerMonitorTest, ReportsAClientThatExits) {
  std::string address;
  auto client = StartClient(&address);
  ASSERT_TRUE(monitor_->Watch(7, address).ok());
  LetTheConnectionSettle();
  client->CloseStdin();  // the client closes its worker and exits
  const int status = client->Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(WaitReported(7, kReportWithin));
}

TEST_P(PeerMonitorTest, OnlyTheDeadClientIsReported) {
  std::string address_a, address_b;
  auto a = StartClient(&address_a);
  auto b = StartClient(&address_b);
  ASSERT_TRUE(monitor_->Watch(1, address_a).ok());
  ASSERT_TRUE(monitor_->Watch(2, address_b).ok());
  LetTheConnectionSettle();
  b->Kill();
  ASSERT_TRUE(WaitReported(2, kReportWithin));
  EXPECT_FALSE(WaitReported(1, absl::Seconds(1)));
  EXPECT_EQ(monitor_->size(), 1u);
  EXPECT_TRUE(monitor_->Unwatch(1).ok());
}

TEST_P(PeerMonitorTest, UnwatchedClientsAreNotReported) {
  std::string address;
  auto client = StartClient(&address);
  ASSERT_TRUE(monitor_->Watch(5, address).ok());
  LetTheConnectionSettle();
  ASSERT_TRUE(monitor_->Unwatch(5).ok());
  client->Kill();
  client->Wait();
  EXPECT_FALSE(WaitReported(5, absl::Seconds(1)));
  EXPECT_EQ(monitor_->Unwatch(5).code(), absl::StatusCode::kNotFound);
}

TEST_P(PeerMonitorTest, RejectsDuplicateIdsAndEmptyAddresses) {
  std::string address;
  auto client = StartClient(&address);
  ASSERT_TRUE(monitor_->Watch(9, address).ok());
  EXPECT_EQ(monitor_->Watch(9, address).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(monitor_->Watch(10, "").code(), absl::StatusCode::kInvalidArgument);
  LetTheConnectionSettle();
}

TEST_P(PeerMonitorTest, WatchingAfterTheWorkerStoppedIsUnavailable) {
  worker_->Stop();
  EXPECT_EQ(monitor_->Watch(3, "x").code(), absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Loopback, PeerMonitorTest,
                         ::testing::Values("tcp", "shm"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvdepot
