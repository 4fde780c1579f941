// What the benchmark tools count per thread, and how they summarize it:
// totals plus nearest-rank latency percentiles over every call of every
// thread. Header-only; shared by kvdepot-bench and nvme-tier-bench.
#ifndef KVDEPOT_TOOLS_BENCH_TALLY_H_
#define KVDEPOT_TOOLS_BENCH_TALLY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvdepot {

struct CallTally {
  std::vector<double> latencies_us;  // successful calls only
  uint64_t ops = 0;                  // blocks (or calls) in successful calls
  uint64_t calls = 0;                // successful calls
  uint64_t errors = 0;               // ops in failed calls
};

// Nearest-rank percentile of sorted values; 0 when there are none.
inline double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(p * static_cast<double>(sorted.size()));
  const size_t index = static_cast<size_t>(std::max(1.0, rank)) - 1;
  return sorted[std::min(index, sorted.size() - 1)];
}

struct TallySummary {
  uint64_t ops = 0, calls = 0, errors = 0;
  double p50_us = 0, p99_us = 0, p999_us = 0;
  // Fairness: the fewest and most ops one thread completed.
  uint64_t min_thread_ops = 0, max_thread_ops = 0;
};

// Adds up `tallies` (anything derived from CallTally); their latency vectors
// are moved out.
template <typename T>
TallySummary Summarize(std::vector<T>& tallies) {
  TallySummary s;
  std::vector<double> latencies;
  bool first = true;
  for (CallTally& t : tallies) {
    s.min_thread_ops = first ? t.ops : std::min(s.min_thread_ops, t.ops);
    s.max_thread_ops = std::max(s.max_thread_ops, t.ops);
    first = false;
    s.ops += t.ops;
    s.calls += t.calls;
    s.errors += t.errors;
    latencies.insert(latencies.end(), t.latencies_us.begin(), t.latencies_us.end());
    t.latencies_us = {};
  }
  std::sort(latencies.begin(), latencies.end());
  s.p50_us = Percentile(latencies, 0.50);
  s.p99_us = Percentile(latencies, 0.99);
  s.p999_us = Percentile(latencies, 0.999);
  return s;
}

}  // namespace kvdepot

#endif  // KVDEPOT_TOOLS_BENCH_TALLY_H_
