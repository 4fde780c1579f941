#include "storage/work_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/synchronization/notification.h"

namespace kvdepot {
namespace {

TEST(WorkPoolTest, RunsEveryTaskOffTheCallersThread) {
  std::atomic<int> ran{0};
  std::atomic<int> on_caller{0};
  const std::thread::id caller = std::this_thread::get_id();
  {
    WorkPool pool(3, "test-pool");
    for (int i = 0; i < 1000; ++i) {
      pool.Submit([&] {
        if (std::this_thread::get_id() == caller) ++on_caller;
        ++ran;
      });
    }
  }  // the destructor runs what is still queued
  EXPECT_EQ(ran.load(), 1000);
  EXPECT_EQ(on_caller.load(), 0);
}

TEST(WorkPoolTest, OneThreadRunsTasksInOrder) {
  std::vector<int> order;
  {
    WorkPool pool(1, "ordered");
    absl::Notification started, gate;
    pool.Submit([&] {
      started.Notify();
      gate.WaitForNotification();
    });
    started.WaitForNotification();
    for (int i = 0; i < 5; ++i) pool.Submit([&order, i] { order.push_back(i); });
    EXPECT_EQ(pool.queued(), 5u);  // all held behind the gate
    gate.Notify();
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(WorkPoolTest, TasksRunInParallel) {
  // Two tasks that each wait for the other can only finish on two threads.
  WorkPool pool(2, "parallel");
  absl::Notification a, b, done_a, done_b;
  pool.Submit([&] { a.Notify(); b.WaitForNotification(); done_a.Notify(); });
  pool.Submit([&] { b.Notify(); a.WaitForNotification(); done_b.Notify(); });
  EXPECT_TRUE(done_a.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(done_b.WaitForNotificationWithTimeout(absl::Seconds(30)));
}

TEST(ForEachHelpedTest, RunsEveryIndexOnceAndReturnsAfterTheLast) {
  WorkPool pool(2, "helpers");
  for (size_t n : {0u, 1u, 2u, 7u, 64u}) {
    std::vector<std::atomic<int>> runs(n);
    std::atomic<int> finished{0};
    ForEachHelped(pool, n, 2, [&](size_t i) {
      absl::SleepFor(absl::Microseconds(200));
      ++runs[i];
      ++finished;
    });
    EXPECT_EQ(finished.load(), static_cast<int>(n));  // all done on return
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(runs[i].load(), 1) << i;
  }
}

TEST(ForEachHelpedTest, FreeHelpersTakeIndicesOnTheirThreads) {
  WorkPool pool(2, "helpers");
  const std::thread::id caller = std::this_thread::get_id();
  // Index 0 waits until some other index ran on a helper: only a helper
  // taking indices lets the call return.
  absl::Notification helped;
  std::atomic<int> on_helpers{0};
  ForEachHelped(pool, 8, 2, [&](size_t i) {
    if (std::this_thread::get_id() != caller) {
      if (on_helpers++ == 0) helped.Notify();
    } else if (i == 0) {
      EXPECT_TRUE(helped.WaitForNotificationWithTimeout(absl::Seconds(30)));
    }
  });
  EXPECT_GE(on_helpers.load(), 1);
}

TEST(ForEachHelpedTest, ABusyPoolLeavesEveryIndexToTheCaller) {
  WorkPool pool(1, "busy");
  absl::Notification started, gate;
  pool.Submit([&] {
    started.Notify();
    gate.WaitForNotification();
  });
  started.WaitForNotification();
  const std::thread::id caller = std::this_thread::get_id();
  int on_caller = 0;
  ForEachHelped(pool, 16, 4, [&](size_t) {
    if (std::this_thread::get_id() == caller) ++on_caller;
  });
  EXPECT_EQ(on_caller, 16);  // returned without the blocked pool
  gate.Notify();
  // The helper tasks still queued run later and take nothing: fn is gone.
}

}  // namespace
}  // namespace kvdepot
