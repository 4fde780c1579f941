#include "storage/rocksdb_info_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

class RocksInfoLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshTestDir("rocksdb_info_log_test_");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  static std::string Slurp(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  std::string dir_;
};

TEST_F(RocksInfoLogTest, WritesRocksDbsLinesWithATimeAndRotates) {
  std::ofstream(dir_ + "/LOG") << "the last run's\n";
  {
    RocksInfoLog log(dir_ + "/LOG", 4096);
    rocksdb::Log(rocksdb::InfoLogLevel::WARN_LEVEL, &log, "flush %d of %s", 7,
                 "cf");
    rocksdb::Log(rocksdb::InfoLogLevel::DEBUG_LEVEL, &log, "below the level");
    const std::string long_message(3000, 'x');  // past the stack buffer
    rocksdb::Log(rocksdb::InfoLogLevel::INFO_LEVEL, &log, "%s",
                 long_message.c_str());
    EXPECT_EQ(log.dropped_lines(), 0u);
    EXPECT_GT(log.GetLogFileSize(), 3000u);
  }
  EXPECT_EQ(Slurp(dir_ + "/LOG.old.1"), "the last run's\n");
  const std::string text = Slurp(dir_ + "/LOG");
  EXPECT_THAT(text,
              ::testing::MatchesRegex("[0-9]{4}/[0-9]{2}/[0-9]{2}-[0-9:.]{15} "
                                      "[0-9a-f]+ \\[WARN\\] flush 7 of cf\n"
                                      ".* x{3000}\n"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("below the level")));

  // Past max_bytes the file starts again; the full one becomes LOG.old.1,
  // and the older ones move on, three kept.
  RocksInfoLog log(dir_ + "/LOG", 4096);
  EXPECT_EQ(Slurp(dir_ + "/LOG.old.2"), "the last run's\n");
  for (int i = 0; i < 300; ++i) {
    rocksdb::Log(&log, "line %03d of a long run", i);
  }
  EXPECT_LE(std::filesystem::file_size(dir_ + "/LOG"), 4096u);
  for (const char* old : {"/LOG.old.1", "/LOG.old.2", "/LOG.old.3"}) {
    EXPECT_LE(std::filesystem::file_size(dir_ + old), 4096u) << old;
    EXPECT_THAT(Slurp(dir_ + old), HasSubstr(" of a long run\n")) << old;
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/LOG.old.4"));
  EXPECT_THAT(Slurp(dir_ + "/LOG"), HasSubstr("line 299 of a long run\n"));
}

// A log that is a link (to a file elsewhere) is not moved aside but
// truncated when full: it stays within max_bytes too.
TEST_F(RocksInfoLogTest, ALinkedLogIsTruncatedNotMoved) {
  std::filesystem::create_symlink(dir_ + "/elsewhere", dir_ + "/LOG");
  RocksInfoLog log(dir_ + "/LOG", 4096);
  for (int i = 0; i < 300; ++i) {
    rocksdb::Log(&log, "line %03d of a long run", i);
  }
  EXPECT_TRUE(std::filesystem::is_symlink(dir_ + "/LOG"));
  EXPECT_LE(std::filesystem::file_size(dir_ + "/elsewhere"), 4096u);
  EXPECT_THAT(Slurp(dir_ + "/elsewhere"),
              HasSubstr("line 299 of a long run\n"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/LOG.old.1"));
}

// A full disk loses log lines, never the process: here writes past a
// file-size limit fail (EFBIG, as ENOSPC would), as does a directory that
// is gone.
TEST_F(RocksInfoLogTest, WritesThatFailAreDroppedNotFatal) {
  RocksInfoLog log(dir_ + "/LOG", 1 << 20);
  rocksdb::Log(&log, "before the limit");
  struct rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 100;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  for (int i = 0; i < 100; ++i) rocksdb::Log(&log, "line %d", i);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
  signal(SIGXFSZ, old_handler);
  EXPECT_GE(log.dropped_lines(), 99u);
  rocksdb::Log(&log, "room again");  // the next line after the trouble
  EXPECT_THAT(Slurp(dir_ + "/LOG"), HasSubstr("room again\n"));

  RocksInfoLog nowhere(dir_ + "/missing/LOG", 1 << 20);
  rocksdb::Log(&nowhere, "nowhere");
  EXPECT_EQ(nowhere.dropped_lines(), 1u);
}

// RocksDB takes it as its info log: what it logs while it opens arrives.
TEST_F(RocksInfoLogTest, RocksDbLogsThroughIt) {
  auto log = std::make_shared<RocksInfoLog>(dir_ + "/LOG", 1 << 20);
  rocksdb::Options options;
  options.create_if_missing = true;
  options.info_log = log;
  rocksdb::DB* db = nullptr;
  ASSERT_TRUE(rocksdb::DB::Open(options, dir_ + "/db", &db).ok());
  delete db;
  EXPECT_THAT(Slurp(dir_ + "/LOG"), HasSubstr("RocksDB version"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/db/LOG"));
}

}  // namespace
}  // namespace kvdepot
