#include "storage/work_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

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

}  // namespace
}  // namespace kvdepot
