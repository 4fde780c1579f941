#include "tools/bench_tally.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvdepot {
namespace {

CallTally Tally(uint64_t ops, std::vector<double> latencies_us) {
  CallTally t;
  t.ops = ops;
  t.calls = latencies_us.size();
  t.latencies_us = std::move(latencies_us);
  return t;
}

TEST(SummarizeTest, AddsUpThreadsAndGivesTheirOpRange) {
  std::vector<CallTally> tallies;
  tallies.push_back(Tally(7, {10, 20}));
  tallies.push_back(Tally(3, {30}));
  tallies.push_back(Tally(12, {40, 50, 60}));
  tallies[1].errors = 2;
  const TallySummary s = Summarize(tallies);
  EXPECT_EQ(s.ops, 22u);
  EXPECT_EQ(s.calls, 6u);
  EXPECT_EQ(s.errors, 2u);
  EXPECT_EQ(s.min_thread_ops, 3u);
  EXPECT_EQ(s.max_thread_ops, 12u);
  // Nearest rank over all six calls.
  EXPECT_EQ(s.p50_us, 30);
  EXPECT_EQ(s.p99_us, 60);
  EXPECT_TRUE(tallies[0].latencies_us.empty());  // moved out
}

TEST(SummarizeTest, AThreadThatDidNothingIsTheMinimum) {
  std::vector<CallTally> tallies;
  tallies.push_back(Tally(5, {1}));
  tallies.push_back(Tally(0, {}));
  const TallySummary s = Summarize(tallies);
  EXPECT_EQ(s.min_thread_ops, 0u);
  EXPECT_EQ(s.max_thread_ops, 5u);
}

TEST(SummarizeTest, NoThreadsGiveZeros) {
  std::vector<CallTally> tallies;
  const TallySummary s = Summarize(tallies);
  EXPECT_EQ(s.ops, 0u);
  EXPECT_EQ(s.min_thread_ops, 0u);
  EXPECT_EQ(s.max_thread_ops, 0u);
  EXPECT_EQ(s.p99_us, 0);
}

}  // namespace
}  // namespace kvdepot
