#include "storage/clock.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>

#include "absl/time/clock.h"
#include "absl/time/time.h"

// The wall clock can be stepped (NTP, a resumed VM), which a test cannot do
// to the machine's. This binary stands in for libc's clock_gettime (the
// executable's definition comes first for every library it loads): it adds
// g_wall_step_seconds to CLOCK_REALTIME, and leaves the other clocks alone.
namespace {
std::atomic<int64_t> g_wall_step_seconds{0};
}  // namespace

extern "C" int clock_gettime(clockid_t id, struct timespec* ts) {
  const long r = syscall(SYS_clock_gettime, id, ts);
  if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
    ts->tv_sec += g_wall_step_seconds.load();
  }
  return static_cast<int>(r);
}

namespace kvdepot {
namespace {

class StepWallClock {
 public:
  explicit StepWallClock(absl::Duration step) {
    g_wall_step_seconds += absl::ToInt64Seconds(step);
  }
  ~StepWallClock() { g_wall_step_seconds = 0; }
};

TEST(SystemClockTest, StartsAtTheWallClockAndAdvancesWithIt) {
  const absl::Time before = absl::Now();
  const absl::Time now = SystemClock()->Now();
  EXPECT_LT(absl::AbsDuration(now - before), absl::Seconds(5));
  absl::SleepFor(absl::Milliseconds(20));
  const absl::Time later = SystemClock()->Now();
  EXPECT_GE(later - now, absl::Milliseconds(20));
  EXPECT_LT(later - now, absl::Seconds(5));
}

// A lease measured on the wall clock ended at once when NTP stepped it
// forward, and lasted on when it stepped back.
TEST(SystemClockTest, IgnoresStepsOfTheWallClock) {
  Clock* clock = SystemClock();
  const absl::Time start = clock->Now();
  {
    StepWallClock forward(absl::Hours(1));
    ASSERT_GT(absl::Now() - start, absl::Minutes(59));  // the step took
    EXPECT_LT(clock->Now() - start, absl::Minutes(1));
  }
  {
    StepWallClock back(-absl::Hours(1));
    ASSERT_LT(absl::Now() - start, -absl::Minutes(59));
    const absl::Time now = clock->Now();
    EXPECT_GE(now, start);
    EXPECT_LT(now - start, absl::Minutes(1));
  }
}

TEST(SystemClockTest, NeverGoesBack) {
  Clock* clock = SystemClock();
  absl::Time last = clock->Now();
  for (int i = 0; i < 100000; ++i) {
    const absl::Time now = clock->Now();
    ASSERT_GE(now, last);
    last = now;
  }
}

}  // namespace
}  // namespace kvdepot
