#include "storage/sizes.h"

#include <gtest/gtest.h>

#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;

MATCHER_P(IsSize, bytes, ::testing::PrintToString(bytes) + " bytes") {
  if (!arg.ok()) {
    *result_listener << arg.status();
    return false;
  }
  *result_listener << *arg << " bytes";
  return *arg == static_cast<uint64_t>(bytes);
}

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

TEST(ParseSizeTest, ByteCountsAreExactUpToTheLargestUint64) {
  EXPECT_THAT(ParseSize("10000000000000000000"), IsSize(uint64_t{10000000000000000000u}));
  EXPECT_THAT(ParseSize("18446744073709551615"), IsSize(~uint64_t{0}));
  EXPECT_THAT(ParseSize("9007199254740993"), IsSize(uint64_t{9007199254740993u}));  // 2^53 + 1
  EXPECT_THAT(ParseSize("16777215TiB"), IsSize(uint64_t{16777215} << 40));
  EXPECT_THAT(ParseSize("0"), IsSize(0u));
  EXPECT_THAT(ParseSize("0.0GiB"), IsSize(0u));
}

TEST(ParseSizeTest, RejectsSizesPastTheLargestUint64) {
  for (const char* big : {"18446744073709551616", "99999999999999999999999", "16777216TiB",
                          "18446744073709551616.0", "20000000000000000000.5",
                          "16777216.5TiB", "18446744073709551616B"}) {
    EXPECT_THAT(ParseSize(big), StatusIs(absl::StatusCode::kInvalidArgument)) << big;
  }
}

TEST(ParseSizeTest, FractionsRoundToTheNearestByteButNeverToZero) {
  EXPECT_THAT(ParseSize("0.4KiB"), IsSize(410u));  // 409.6
  EXPECT_THAT(ParseSize("0.5"), IsSize(1u));
  EXPECT_THAT(ParseSize("1.4"), IsSize(1u));
  // "quota set 0.4" must not become 0, which means "no limit".
  for (const char* tiny : {"0.4", "0.4B", "0.00001KiB", "0.0000000001GiB"}) {
    EXPECT_THAT(ParseSize(tiny), StatusIs(absl::StatusCode::kInvalidArgument)) << tiny;
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
