#include "storage/sizes.h"

#include <gtest/gtest.h>

#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;

TEST(ParseSizeTest, AcceptsBinaryAndDecimalUnits) {
  EXPECT_EQ(*ParseSize("1GiB"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseSize("512MiB"), uint64_t{512} << 20);
  EXPECT_EQ(*ParseSize("64KiB"), uint64_t{64} << 10);
  EXPECT_EQ(*ParseSize("1.5GiB"), uint64_t{3} << 29);
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("2G"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseSize("1GB"), 1000000000u);
  EXPECT_EQ(*ParseSize(" 8 mib "), uint64_t{8} << 20);
}

TEST(ParseSizeTest, RejectsGarbage) {
  for (const char* bad : {"", "GiB", "1XB", "-1GiB", "1e999GiB", "abc"}) {
    EXPECT_THAT(ParseSize(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST(FormatSizeTest, PicksTheLargestExactUnit) {
  EXPECT_EQ(FormatSize(262144), "256KiB");
  EXPECT_EQ(FormatSize(uint64_t{2} << 30), "2GiB");
  EXPECT_EQ(FormatSize(3 << 20), "3MiB");
  EXPECT_EQ(FormatSize(1000), "1000B");
  EXPECT_EQ(*ParseSize(FormatSize(uint64_t{5} << 40)), uint64_t{5} << 40);
}

}  // namespace
}  // namespace kvdepot
