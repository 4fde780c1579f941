#include "server/data_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/status_matchers.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kGiB = uint64_t{1} << 30;

class DataDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshTestDir("data_dir_test_", /*create=*/false);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

// The directory is created and held: a second daemon on it is refused,
// naming the holder; once the first lets go it opens.
TEST_F(DataDirTest, OneDaemonPerDirectory) {
  auto first = DataDir::Open(dir_ + "/sub");
  ASSERT_OK(first);
  EXPECT_TRUE(std::filesystem::is_directory(dir_ + "/sub"));
  auto second = DataDir::Open(dir_ + "/sub");
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kFailedPrecondition));
  first->reset();
  EXPECT_OK(DataDir::Open(dir_ + "/sub"));
}

// Blocks come from users' prompts: a directory kvdepotd makes is its own,
// and one open to other users is named in a warning.
TEST_F(DataDirTest, ADirectoryItMakesIsPrivateAndAnOpenOneIsWarnedAbout) {
  auto made = DataDir::Open(dir_ + "/a/b");
  ASSERT_OK(made);
  EXPECT_EQ(std::filesystem::status(dir_ + "/a/b").permissions(),
            std::filesystem::perms::owner_all);
  EXPECT_EQ(
      std::filesystem::status(dir_ + "/a/b/LOCK").permissions(),
      std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_TRUE((*made)->warnings().empty());
  made->reset();

  std::filesystem::create_directories(dir_ + "/open");
  std::filesystem::permissions(dir_ + "/open", std::filesystem::perms(0755));
  auto open = DataDir::Open(dir_ + "/open/");
  ASSERT_OK(open);
  ASSERT_EQ((*open)->warnings().size(), 1u);
  EXPECT_THAT((*open)->warnings()[0],
              HasSubstr("open to other users (mode 0755)"));
  // A trailing slash, parents missing: made all the same.
  auto slash = DataDir::Open(dir_ + "/x/y/");
  ASSERT_OK(slash);
  EXPECT_EQ(std::filesystem::status(dir_ + "/x/y").permissions(),
            std::filesystem::perms::owner_all);
  // A file where the directory should be: refused, saying so.
  std::ofstream(dir_ + "/file") << "x";
  auto file = DataDir::Open(dir_ + "/file");
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(std::string(file.status().message()),
              HasSubstr("Not a directory"));
  // The daemon does not change a directory it did not make.
  EXPECT_EQ(std::filesystem::status(dir_ + "/open").permissions(),
            std::filesystem::perms(0755));
}

// The size of the filesystem the directory is on, as statvfs tells it.
TEST_F(DataDirTest, KnowsItsFilesystemSize) {
  auto d = DataDir::Open(dir_);
  ASSERT_OK(d);
  const std::filesystem::space_info space = std::filesystem::space(dir_);
  EXPECT_EQ((*d)->FilesystemBytes(), space.capacity);
  EXPECT_GT((*d)->FilesystemBytes(), 0u);
}

// kvdepotd warns at start when the NVMe tier's capacity leaves the
// filesystem no room for its garbage (a full disk stops its writes).
TEST(NvmeHeadroomWarningTest, OverThreeQuartersOfTheFilesystemWarns) {
  EXPECT_EQ(NvmeHeadroomWarning(0, 10 * kGiB), "");          // no tier
  EXPECT_EQ(NvmeHeadroomWarning(8 * kGiB, 0), "");           // unknown size
  EXPECT_EQ(NvmeHeadroomWarning(6 * kGiB, 8 * kGiB), "");    // exactly 3/4
  EXPECT_EQ(NvmeHeadroomWarning(8 * kGiB, 100 * kGiB), "");
  const std::string w = NvmeHeadroomWarning(7 * kGiB, 8 * kGiB);
  EXPECT_THAT(w, HasSubstr("nvme_capacity (7.0 GiB)"));
  EXPECT_THAT(w, HasSubstr("filesystem (8.0 GiB)"));
  EXPECT_NE(NvmeHeadroomWarning(20 * kGiB, 8 * kGiB), "");   // past its size
}

// A DRAM tier that its memory cgroup cannot hold is refused at start (the
// kernel would kill the daemon as it prefaults it), unless explicit
// hugepages, which that cgroup does not count, will hold it.
TEST(CheckDramFitsMemoryLimitTest, ATierPastTheCgroupLimitIsRefused) {
  using Mode = HugePageMode;
  EXPECT_TRUE(CheckDramFitsMemoryLimit(64 * kGiB, Mode::kAuto, std::nullopt, 0).ok());
  EXPECT_TRUE(CheckDramFitsMemoryLimit(1 * kGiB, Mode::kAuto, 3 * kGiB, 0).ok());
  EXPECT_TRUE(
      CheckDramFitsMemoryLimit(3 * kGiB - kDramLimitReserve, Mode::kOff, 3 * kGiB, 0).ok());
  const absl::Status st = CheckDramFitsMemoryLimit(4 * kGiB, Mode::kAuto, 3 * kGiB, 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(st.message()), HasSubstr("dram_capacity (4.00 GiB)"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("allow 3.00 GiB"));
  // Short of the reserve for the rest of the process.
  EXPECT_FALSE(CheckDramFitsMemoryLimit(3 * kGiB, Mode::kOff, 3 * kGiB, 0).ok());
  // Explicit hugepages: on, or auto with enough of them free.
  EXPECT_TRUE(CheckDramFitsMemoryLimit(4 * kGiB, Mode::kOn, 3 * kGiB, 0).ok());
  EXPECT_TRUE(CheckDramFitsMemoryLimit(4 * kGiB, Mode::kAuto, 3 * kGiB, 4 * kGiB).ok());
  EXPECT_FALSE(CheckDramFitsMemoryLimit(4 * kGiB, Mode::kAuto, 3 * kGiB, 2 * kGiB).ok());
  EXPECT_FALSE(CheckDramFitsMemoryLimit(4 * kGiB, Mode::kOff, 3 * kGiB, 4 * kGiB).ok());
}

// Without a cgroup limit, the host's MemAvailable bounds the tier the same
// way (prefaulting more brings the OOM killer); hugepages are not counted.
TEST(CheckDramFitsMemoryLimitTest, ATierPastTheHostsAvailableMemoryIsRefused) {
  using Mode = HugePageMode;
  EXPECT_TRUE(
      CheckDramFitsMemoryLimit(1 * kGiB, Mode::kAuto, std::nullopt, 0, 2 * kGiB)
          .ok());
  const absl::Status st =
      CheckDramFitsMemoryLimit(2 * kGiB, Mode::kOff, std::nullopt, 0, 2 * kGiB);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(st.message()), HasSubstr("MemAvailable 2.00 GiB"));
  // The tighter of the two speaks.
  EXPECT_THAT(std::string(CheckDramFitsMemoryLimit(2 * kGiB, Mode::kOff,
                                                   1 * kGiB, 0, 8 * kGiB)
                              .message()),
              HasSubstr("cgroups"));
  EXPECT_FALSE(
      CheckDramFitsMemoryLimit(2 * kGiB, Mode::kOff, 8 * kGiB, 0, 1 * kGiB)
          .ok());
  EXPECT_TRUE(
      CheckDramFitsMemoryLimit(4 * kGiB, Mode::kOn, std::nullopt, 0, 1 * kGiB)
          .ok());
  EXPECT_TRUE(CheckDramFitsMemoryLimit(4 * kGiB, Mode::kAuto, std::nullopt,
                                       4 * kGiB, kGiB)
                  .ok());
}

}  // namespace
}  // namespace kvdepot
