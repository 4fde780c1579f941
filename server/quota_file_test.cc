#include "server/quota_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "storage/fake_clock.h"
#include "tests/status_matchers.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Code = absl::StatusCode;

class QuotaFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshTestDir("quota_file_test_");
    path_ = dir_ + "/quotas";
    store_ = MakeStore(/*max_namespaces=*/16);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<TieredStore> MakeStore(uint32_t max_namespaces) {
    StoreOptions o;
    o.dram_capacity = 16 << 20;
    o.hugepages = HugePageMode::kOff;
    o.background_eviction = false;
    o.max_namespaces = max_namespaces;
    auto s = NewTieredStore(o, &clock_);
    EXPECT_OK(s);
    return s.ok() ? std::move(s).value() : nullptr;
  }
  void Write(const std::string& text) { std::ofstream(path_) << text; }

  FakeClock clock_;
  std::string dir_, path_;
  std::unique_ptr<TieredStore> store_;
};

// What Set writes, Load reads back into another store (a restart).
TEST_F(QuotaFileTest, QuotasSurviveARestart) {
  QuotaFile file(path_);
  ASSERT_OK(file.Load(*store_));  // no file yet: no quotas
  ASSERT_OK(file.Set(*store_, "a", 1 << 20));
  ASSERT_OK(file.Set(*store_, "b/c", 0));
  auto again = MakeStore(16);
  ASSERT_OK(QuotaFile(path_).Load(*again));
  EXPECT_EQ(again->Quota("a"), uint64_t{1} << 20);
  bool declared = false;  // a quota of 0 declares the namespace
  for (const NamespaceStats& ns : again->ListNamespaces())
    declared |= ns.name == "b/c";
  EXPECT_TRUE(declared);
  EXPECT_EQ(
      std::filesystem::status(path_).permissions(),
      std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

// A Set whose file cannot be written (disk full, a read-only directory)
// takes back all it did in the store: the quota, and the declaration of a
// namespace it declared, which would otherwise take puts with
// create_namespaces off and vanish at the next start.
TEST_F(QuotaFileTest, ASetThatCannotWriteTheFileLeavesTheStoreAsItWas) {
  QuotaFile file(path_);
  ASSERT_OK(file.Load(*store_));
  ASSERT_OK(file.Set(*store_, "kept", 1 << 20));
  // The file's temporary name taken by a directory: every write fails
  // (also as root, whom permissions do not stop).
  std::filesystem::create_directory(path_ + ".tmp");
  EXPECT_THAT(file.Set(*store_, "new", 2 << 20), StatusIs(Code::kUnavailable));
  EXPECT_THAT(file.Set(*store_, "kept", 3 << 20), StatusIs(Code::kUnavailable));
  EXPECT_EQ(store_->Quota("new"), 0u);
  EXPECT_EQ(store_->Quota("kept"), uint64_t{1} << 20);
  std::vector<std::string> names;
  for (const NamespaceStats& ns : store_->ListNamespaces())
    names.push_back(ns.name);
  EXPECT_THAT(names, ::testing::ElementsAre("kept"));
}

// A hand edit's blank lines, comments and stray spaces are read as meant.
TEST_F(QuotaFileTest, BlankLinesCommentsAndSpacesAreAllowed) {
  Write("# operator's quotas\n\n  a 1024  \nb\t2048\r\n");
  ASSERT_OK(QuotaFile(path_).Load(*store_));
  EXPECT_EQ(store_->Quota("a"), 1024u);
  EXPECT_EQ(store_->Quota("b"), 2048u);
}

// Anything else stops the start with the file and line named: a line that
// is not "NAMESPACE BYTES", a namespace given twice (which one was meant?),
// a directory where the file should be, more namespaces than the store may
// hold.
TEST_F(QuotaFileTest, AMalformedFileIsRefusedNamingWhere) {
  Write("a 1024\nb\n");
  EXPECT_THAT(QuotaFile(path_).Load(*store_), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(QuotaFile(path_).Load(*store_).message()),
              HasSubstr(path_ + ":2: expected"));
  Write("a 1024\na 2048\n");
  const absl::Status twice = QuotaFile(path_).Load(*store_);
  EXPECT_THAT(twice, StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(twice.message()),
              HasSubstr(":2: namespace a has a quota"));
  std::filesystem::remove(path_);
  std::filesystem::create_directories(path_);
  const absl::Status dir = QuotaFile(path_).Load(*store_);
  EXPECT_THAT(dir, StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(dir.message()), HasSubstr("not a regular file"));
  std::filesystem::remove_all(path_);
  Write("a 1\nb 1\nc 1\n");
  auto small = MakeStore(2);
  // More namespaces than the configuration allows: a configuration error
  // (kvdepotd exits 2, which its systemd unit does not restart).
  const absl::Status full = QuotaFile(path_).Load(*small);
  EXPECT_THAT(full, StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(std::string(full.message()),
              AllOf(HasSubstr(path_ + ": namespace c"),
                    HasSubstr("raise max_namespaces")));
}

}  // namespace
}  // namespace kvdepot
