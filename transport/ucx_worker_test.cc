// UcxWorker, UcxContext and MemoryRegion over real UCX (loopback TCP).
#include "transport/ucx_worker.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "transport/ucx_context.h"
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
  setenv("UCX_TCP_RX_SEG_SIZE", "96k", 1);
  options.config = {{"TLS", "tcp"}, {"TX_SEG_SIZE", "32k"}};
  context = UcxContext::Create(options);
  unsetenv("UCX_TCP_RX_SEG_SIZE");
  ASSERT_TRUE(context.ok()) << context.status();
  ASSERT_TRUE((*context)->tcp_segments().has_value());
  EXPECT_EQ((*context)->tcp_segments()->tx, 32u << 10);
  EXPECT_EQ((*context)->tcp_segments()->rx, 96u << 10);

  const TcpSegmentSizes big{512 << 10, 512 << 10}, small{8 << 10, 64 << 10};
  EXPECT_TRUE(TcpSegmentsFit(big, big));
  EXPECT_TRUE(TcpSegmentsFit(small, small));
  EXPECT_FALSE(TcpSegmentsFit(big, small));  // they cannot take our 512k
  EXPECT_FALSE(TcpSegmentsFit(small, big));  // we cannot take theirs
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

}  // namespace
}  // namespace kvdepot
