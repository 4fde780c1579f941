#include "server/logging.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tests/status_matchers.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class LoggingTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::FreshTestDir("logging_test_"); }
  std::string dir_;
};

TEST_F(LoggingTest, JsonLinesEscapeTheMessage) {
  auto log = MakeLogger("t", {"info", "json", dir_ + "/k.log"});
  ASSERT_OK(log);
  log->logger->info("quote \" backslash \\ newline \n tab \t bell \a");
  log->logger->debug("below the level");
  log->logger->flush();
  const std::string text = Slurp(dir_ + "/k.log");
  EXPECT_NE(text.find(R"("level":"info","logger":"t","msg":"quote \" backslash \\ newline \n tab \t bell \u0007"})"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("below the level"), std::string::npos);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1);  // one line per message
}

TEST_F(LoggingTest, ReopenFollowsLogrotate) {
  const std::string path = dir_ + "/k.log";
  auto log = MakeLogger("t", {"info", "text", path});
  ASSERT_OK(log);
  log->logger->info("before rotation");
  std::filesystem::rename(path, path + ".1");
  log->logger->info("after the move, before the reopen");
  ASSERT_OK(log->reopen());
  log->logger->info("after the reopen");
  log->logger->flush();
  const std::string old_file = Slurp(path + ".1");
  const std::string new_file = Slurp(path);
  EXPECT_NE(old_file.find("before rotation"), std::string::npos);
  EXPECT_NE(old_file.find("after the move, before the reopen"), std::string::npos);
  EXPECT_EQ(old_file.find("after the reopen"), std::string::npos);
  EXPECT_NE(new_file.find("after the reopen"), std::string::npos) << new_file;
}

// A reopen that cannot open the path (its directory moved away too) keeps
// the old file: nothing logged after it is lost, and the caller is told.
TEST_F(LoggingTest, AFailedReopenKeepsWritingToTheOldFile) {
  const std::string logs = dir_ + "/logs";
  std::filesystem::create_directories(logs);
  auto log = MakeLogger("t", {"info", "text", logs + "/k.log"});
  ASSERT_OK(log);
  log->logger->info("before rotation");
  std::filesystem::rename(logs, dir_ + "/logs.1");
  EXPECT_THAT(log->reopen(), testing::StatusIs(absl::StatusCode::kPermissionDenied));
  log->logger->info("after the failed reopen");
  log->logger->flush();
  const std::string old_file = Slurp(dir_ + "/logs.1/k.log");
  EXPECT_NE(old_file.find("before rotation"), std::string::npos);
  EXPECT_NE(old_file.find("after the failed reopen"), std::string::npos) << old_file;
  // Once the path can be opened again, the next reopen moves there.
  std::filesystem::create_directories(logs);
  ASSERT_OK(log->reopen());
  log->logger->info("in the new file");
  log->logger->flush();
  EXPECT_NE(Slurp(logs + "/k.log").find("in the new file"), std::string::npos);
}

// The NVMe tier's "nearly full" message carries a free byte count that
// moves every second: logged once when the condition starts, again when it
// changes otherwise or ends, and as a reminder every `remind` while it
// lasts -- not once a second.
TEST(ConditionLogTest, NumbersThatMoveAreNoNewCondition) {
  ConditionLog log(absl::Minutes(10));
  absl::Time now = absl::FromUnixSeconds(1000);
  EXPECT_FALSE(log.ShouldLog("", now));  // nothing to say
  EXPECT_TRUE(log.ShouldLog("nearly full (6213632 bytes free)", now));
  for (int i = 1; i < 60; ++i) {
    now += absl::Seconds(1);
    EXPECT_FALSE(log.ShouldLog(
        absl::StrCat("nearly full (", 6213632 - i * 4096, " bytes free)"), now))
        << i;
  }
  now += absl::Minutes(10);
  EXPECT_TRUE(log.ShouldLog("nearly full (1 bytes free)", now));  // reminder
  now += absl::Seconds(1);
  EXPECT_TRUE(log.ShouldLog("IO error: No space left on device", now));
  now += absl::Seconds(1);
  EXPECT_TRUE(log.ShouldLog("", now));  // ended
  now += absl::Minutes(20);
  EXPECT_FALSE(log.ShouldLog("", now));  // no reminders of nothing
}

// A site a client can set off at will logs at most `burst` lines per
// window; the next line logged says how many were left out, and sites
// count apart.
TEST(LogLimiterTest, BoundsEachSiteAndCountsWhatItLeftOut) {
  LogLimiter limiter(3, absl::Seconds(10));
  absl::Time now = absl::FromUnixSeconds(1000);
  uint64_t left_out = 99;
  int logged = 0;
  for (int i = 0; i < 1000; ++i) {
    if (limiter.Allow("Write failed", &left_out, now)) {
      ++logged;
      EXPECT_EQ(left_out, 0u) << i;
    }
    now += absl::Milliseconds(1);
  }
  EXPECT_EQ(logged, 3);
  // Another site is not held back by the first's flood.
  EXPECT_TRUE(limiter.Allow("session opened", &left_out, now));
  EXPECT_EQ(left_out, 0u);
  // The next window: its first line carries the count.
  now += absl::Seconds(10);
  ASSERT_TRUE(limiter.Allow("Write failed", &left_out, now));
  EXPECT_EQ(left_out, 997u);
  EXPECT_EQ(LeftOutNote(left_out), " (997 more like it left out)");
  EXPECT_EQ(LeftOutNote(0), "");
  ASSERT_TRUE(limiter.Allow("Write failed", &left_out, now));
  EXPECT_EQ(left_out, 0u);
}

// A flood that stops is told all the same: a periodic caller takes what
// was left out once the site's window ended, once.
TEST(LogLimiterTest, WhatAQuietSiteLeftOutIsTakenOnce) {
  LogLimiter limiter(2, absl::Seconds(10));
  absl::Time now = absl::FromUnixSeconds(1000);
  uint64_t left_out = 0;
  for (int i = 0; i < 7; ++i) limiter.Allow("no UCX endpoint", &left_out, now);
  EXPECT_TRUE(limiter.TakeLeftOut(now).empty());  // its window goes on
  now += absl::Seconds(10);
  const auto taken = limiter.TakeLeftOut(now);
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].first, "no UCX endpoint");
  EXPECT_EQ(taken[0].second, 5u);
  EXPECT_TRUE(limiter.TakeLeftOut(now).empty());
  ASSERT_TRUE(limiter.Allow("no UCX endpoint", &left_out, now));
  EXPECT_EQ(left_out, 0u);  // told already
}

TEST_F(LoggingTest, BadOptionsAreRefused) {
  EXPECT_THAT(MakeLogger("t", {"loud", "text", ""}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MakeLogger("t", {"info", "xml", ""}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MakeLogger("t", {"info", "text", dir_ + "/no/such/dir/k.log"}),
              testing::StatusIs(absl::StatusCode::kPermissionDenied));
}

}  // namespace
}  // namespace kvdepot
