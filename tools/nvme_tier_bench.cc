// nvme-tier-bench: measures the NVMe tier module (storage/nvme_tier.h)
// directly, in one process, without the daemon.
//
//   nvme-tier-bench --path DIR --op fill|randread|multiread
//                   [--block-size 256KiB] [--blocks N] [--threads T]
//                   [--duration S] [--batch B] [--capacity SIZE]
//                   [--passes P] [--drop-caches] [--json]
//
// The ops:
//   fill       puts --blocks distinct blocks (keys "b/0".."b/N-1" of
//              namespace "bench") into the tier at --path, --threads threads
//              taking the next index from a shared counter, then Flush()es.
//              Block i is the --block-size bytes at offset 8*i of one random
//              pool, so every block has different bytes at no cost per put.
//              Throughput is over the puts AND the flush (what it takes for
//              the blocks to be on disk): demotion-like write throughput.
//   randread   opens the tier at --path (an earlier fill) and reads its blocks
//              with NvmeTier::Read, --threads threads, each into its own
//              buffer; the tier verifies every block's XXH3-64.
//   multiread  the same with NvmeTier::MultiRead, --batch blocks per call.
// Reads visit the stored blocks in one random permutation, like fio's random
// map: within a pass no block is read twice, so a block read in this run is
// never served from the page cache because of an earlier read of this run.
// A run ends after --duration seconds or --passes passes (default 1),
// whichever comes first; later passes reshuffle and may hit the page cache.
// --drop-caches (root) syncs and writes 3 to /proc/sys/vm/drop_caches after
// the tier is open and just before the timed window, so the window starts
// from a cold page cache.
//
// Latencies are per call (a put, a read, a MultiRead of --batch blocks),
// nearest-rank p50/p99/p999. Ops are blocks; GB/s is block size x ops/s / 1e9.
// The bytes the block device holding --path read and wrote during the timed
// window (/sys/dev/block/MAJ:MIN/stat) are reported too: they show how much
// of a read really came from the disk (and the write amplification of a
// fill); they count every process's I/O to that device.
//
// Output: one human-readable line on stdout; with --json, one JSON object on
// stdout and the line on stderr. Exit codes: 0 when every op succeeded, 1
// when any failed or the tier cannot be opened, 2 for a usage error.
#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "storage/checksum.h"
#include "storage/nvme_tier.h"
#include "storage/process_tuning.h"
#include "storage/sizes.h"
#include "tools/bench_tally.h"

namespace kvdepot {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr char kNamespace[] = "bench";
constexpr char kKeyPrefix[] = "b/";
// Error messages printed per thread before going quiet.
constexpr int kMaxReportedErrors = 3;
// Most blocks a fill may write (the random pool is block size + 8 x blocks).
constexpr uint64_t kMaxBlocks = uint64_t{16} << 20;
// Most blocks per MultiRead call.
constexpr int kMaxBatch = 1024;

enum class Op { kFill, kRandRead, kMultiRead };

struct BenchConfig {
  std::string path;
  std::string op_name;
  Op op = Op::kFill;
  uint64_t block_size = 0;
  uint64_t blocks = 0;    // fill: blocks to write; reads: 0 = all stored
  uint64_t capacity = 0;  // 0: automatic (see main)
  int threads = 1;
  int batch = 1;          // multiread
  double duration_s = 0;  // reads
  int passes = 1;         // reads
  bool drop_caches = false;
  bool json = false;
  bool direct_reads = false;
  bool direct_writes = false;
  uint64_t write_buffer_size = 0;  // 0: the tier's default
};

// A size (kvdepot::ParseSize syntax: 262144, 256KiB, 8GiB, 1.5MiB, 64KB...)
// of 1 byte..`max`.
absl::StatusOr<uint64_t> ParseSizeUpTo(absl::string_view text, double max) {
  absl::StatusOr<uint64_t> n = ParseSize(text);
  if (!n.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad size \"", text, "\" (examples: 65536, 256KiB, 2MiB, 8GiB)"));
  }
  if (*n < 1 || static_cast<double>(*n) > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("size \"", text, "\" is out of range"));
  }
  return n;
}

std::string BlockKey(uint64_t i) { return absl::StrCat(kKeyPrefix, i); }


// --- The block device under --path ------------------------------------------

// Sectors (512 bytes) read and written by one block device, from
// /sys/dev/block/MAJ:MIN/stat (fields 3 and 7).
struct DiskCounters {
  uint64_t read_bytes = 0;
  uint64_t write_bytes = 0;
};

class BlockDevice {
 public:
  // The device of `path`, or of its nearest existing parent. Unknown (every
  // Sample is nullopt) when the file system is not on a block device with a
  // stat file (overlayfs, tmpfs, ...).
  explicit BlockDevice(std::string path) {
    struct stat st {};
    while (!path.empty() && ::stat(path.c_str(), &st) != 0) {
      const size_t slash = path.find_last_of('/');
      if (slash == std::string::npos || slash == 0) {
        path = slash == 0 ? "/" : "";
      } else {
        path.resize(slash);
      }
    }
    if (path.empty() && ::stat(".", &st) != 0) return;
    const std::string dev =
        absl::StrCat(major(st.st_dev), ":", minor(st.st_dev));
    stat_file_ = absl::StrCat("/sys/dev/block/", dev, "/stat");
    if (!Sample().has_value()) {
      stat_file_.clear();
      return;
    }
    // The device's name, from its uevent (DEVNAME=vda).
    std::ifstream uevent(absl::StrCat("/sys/dev/block/", dev, "/uevent"));
    std::string line;
    name_ = dev;
    while (std::getline(uevent, line)) {
      if (absl::StartsWith(line, "DEVNAME=")) name_ = line.substr(8);
    }
  }

  bool known() const { return !stat_file_.empty(); }
  const std::string& name() const { return name_; }

  std::optional<DiskCounters> Sample() const {
    if (stat_file_.empty()) return std::nullopt;
    std::ifstream in(stat_file_);
    uint64_t f[7] = {};
    for (uint64_t& v : f) {
      if (!(in >> v)) return std::nullopt;
    }
    return DiskCounters{f[2] * 512, f[6] * 512};
  }

 private:
  std::string stat_file_;
  std::string name_;
};

// Syncs and drops the page cache, dentries and inodes (root only).
absl::Status DropCaches() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        "cannot open /proc/sys/vm/drop_caches (needs root, and a writable "
        "/proc/sys)");
  }
  const bool ok = ::write(fd, "3\n", 2) == 2;
  ::close(fd);
  if (!ok) {
    return absl::PermissionDeniedError(
        "writing /proc/sys/vm/drop_caches failed");
  }
  return absl::OkStatus();
}

// --- The runs -----------------------------------------------------------------

// What one thread measured. Ops are blocks; latencies are per call.
struct ThreadResult : CallTally {
  uint64_t already_present = 0;  // fill: puts that wrote nothing
};

void ReportError(ThreadResult& r, int thread, absl::string_view what,
                 const absl::Status& st) {
  if (r.errors < kMaxReportedErrors) {
    std::fprintf(stderr, "nvme-tier-bench: thread %d: %s: %s\n", thread,
                 std::string(what).c_str(), st.ToString().c_str());
  }
}

double Micros(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Runs `body(thread, result)` on config.threads threads started together;
// returns the seconds from the common start to the last thread's end.
template <typename Body>
double RunThreads(int threads, std::vector<ThreadResult>& results,
                  Body body) {
  results.assign(threads, ThreadResult{});
  std::vector<SteadyClock::time_point> ends(threads);
  std::vector<std::thread> pool;
  absl::BlockingCounter ready(threads);
  absl::Notification go;
  SteadyClock::time_point start;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.DecrementCount();
      go.WaitForNotification();  // publishes `start`
      body(t, results[t]);
      ends[t] = SteadyClock::now();
    });
  }
  ready.Wait();
  start = SteadyClock::now();
  go.Notify();
  for (std::thread& th : pool) th.join();
  const SteadyClock::time_point end = *std::max_element(ends.begin(), ends.end());
  return std::chrono::duration<double>(end - start).count();
}

// What a run reports besides the per-call figures.
struct RunExtras {
  double seconds = 0;        // the timed window
  double put_seconds = 0;    // fill: the puts alone
  double flush_seconds = 0;  // fill: the Flush() after them
  uint64_t passes_started = 0;  // reads
  uint64_t stored_blocks = 0;   // reads: blocks of --block-size in the tier
  uint64_t already_present = 0;
};

// fill: --blocks puts on --threads threads, then Flush().
absl::Status Fill(NvmeTier& tier, const BenchConfig& config,
                  std::vector<ThreadResult>& results, RunExtras& extras) {
  // Block i is pool[8i, 8i + block_size).
  const uint64_t pool_size = config.block_size + 8 * config.blocks;
  std::string pool(pool_size, '\0');
  {
    std::random_device entropy;
    std::mt19937_64 rng((static_cast<uint64_t>(entropy()) << 32) ^ entropy());
    for (uint64_t off = 0; off < pool_size; off += 8) {
      const uint64_t word = rng();
      std::memcpy(&pool[off], &word, std::min<uint64_t>(8, pool_size - off));
    }
  }
  // The caller knows its blocks' checksums (the engine keeps each with its
  // block): computed before the clock starts.
  std::vector<uint64_t> checksums(config.blocks);
  for (uint64_t i = 0; i < config.blocks; ++i) {
    checksums[i] = BlockChecksum(pool.data() + 8 * i, config.block_size);
  }
  std::atomic<uint64_t> next{0};
  const SteadyClock::time_point start = SteadyClock::now();
  RunThreads(config.threads, results, [&](int thread, ThreadResult& r) {
    r.latencies_us.reserve(config.blocks / config.threads + 1);
    for (;;) {
      const uint64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= config.blocks) break;
      const std::string key = BlockKey(i);
      const absl::string_view bytes(pool.data() + 8 * i, config.block_size);
      const uint64_t checksum = checksums[i];
      const SteadyClock::time_point t0 = SteadyClock::now();
      absl::StatusOr<NvmePutOutcome> put =
          tier.Put(kNamespace, key, /*parent=*/"", bytes, checksum);
      const SteadyClock::time_point t1 = SteadyClock::now();
      if (!put.ok()) {
        ReportError(r, thread, absl::StrCat("put ", key), put.status());
        ++r.errors;
        continue;
      }
      ++r.calls;
      if (*put == NvmePutOutcome::kAlreadyPresent) {
        // Nothing written: not an op of the fill (its bytes would inflate
        // GB/s), and an error of the run (see the report).
        ++r.already_present;
        continue;
      }
      ++r.ops;
      r.latencies_us.push_back(Micros(t0, t1));
    }
  });
  const SteadyClock::time_point puts_done = SteadyClock::now();
  absl::Status flushed = tier.Flush();
  const SteadyClock::time_point end = SteadyClock::now();
  extras.put_seconds = std::chrono::duration<double>(puts_done - start).count();
  extras.flush_seconds = std::chrono::duration<double>(end - puts_done).count();
  extras.seconds = std::chrono::duration<double>(end - start).count();
  for (const ThreadResult& r : results) extras.already_present += r.already_present;
  return flushed;
}

// The stored blocks of --block-size in namespace "bench", by index.
std::vector<uint64_t> StoredBlocks(NvmeTier& tier, uint64_t block_size,
                                   uint64_t* wrong_size) {
  std::vector<uint64_t> indexes;
  *wrong_size = 0;
  tier.ForEachBlock([&](const NvmeBlockView& b) {
    if (b.ns != kNamespace || !absl::StartsWith(b.key, kKeyPrefix)) return;
    uint64_t i = 0;
    if (!absl::SimpleAtoi(b.key.substr(sizeof(kKeyPrefix) - 1), &i)) return;
    if (b.size != block_size) {
      ++*wrong_size;
      return;
    }
    indexes.push_back(i);
  });
  std::sort(indexes.begin(), indexes.end());
  return indexes;
}

// randread / multiread over `indexes` (already chosen), each pass a fresh
// random permutation, until the deadline or the last pass ends.
void Read(NvmeTier& tier, const BenchConfig& config,
          const std::vector<uint64_t>& indexes,
          std::vector<ThreadResult>& results,
          RunExtras& extras) {
  const uint64_t n = indexes.size();
  const uint64_t total = n * static_cast<uint64_t>(config.passes);
  const uint64_t per_call =
      config.op == Op::kMultiRead ? static_cast<uint64_t>(config.batch) : 1;
  // keys[j] is the key of the j-th block to read; pass p reads keys in the
  // order order[p] (permutations drawn and keys formatted before the clock
  // starts: only the tier call is timed).
  std::vector<std::string> keys(n);
  for (uint64_t j = 0; j < n; ++j) keys[j] = BlockKey(indexes[j]);
  std::vector<std::vector<uint32_t>> order(config.passes);
  std::mt19937_64 rng(0x6e766d6562656e63ULL);
  for (int p = 0; p < config.passes; ++p) {
    order[p].resize(n);
    for (uint64_t j = 0; j < n; ++j) order[p][j] = static_cast<uint32_t>(j);
    std::shuffle(order[p].begin(), order[p].end(), rng);
  }

  // Every thread's buffers, allocated and touched before the clock starts.
  std::vector<std::unique_ptr<char[]>> buffers(config.threads);
  for (auto& b : buffers) {
    b = std::make_unique<char[]>(per_call * config.block_size);
    std::memset(b.get(), 0, per_call * config.block_size);
  }

  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  SteadyClock::time_point deadline;
  const SteadyClock::time_point start = SteadyClock::now();
  deadline = start + std::chrono::duration_cast<SteadyClock::duration>(
                         std::chrono::duration<double>(config.duration_s));
  extras.seconds = RunThreads(config.threads, results, [&](int thread,
                                                          ThreadResult& r) {
    r.latencies_us.reserve(1 << 16);
    char* buf = buffers[thread].get();
    std::vector<NvmeReadRequest> requests(per_call);
    std::vector<absl::string_view> call_keys(per_call);
    while (!stop.load(std::memory_order_relaxed)) {
      if (SteadyClock::now() >= deadline) {
        stop.store(true, std::memory_order_relaxed);
        break;
      }
      const uint64_t first = next.fetch_add(per_call, std::memory_order_relaxed);
      if (first >= total) break;
      const uint64_t count = std::min<uint64_t>(per_call, total - first);
      for (uint64_t k = 0; k < count; ++k) {
        const uint64_t slot = first + k;
        const std::string& key = keys[order[slot / n][slot % n]];
        call_keys[k] = key;
        requests[k] = NvmeReadRequest{
            key, absl::Span<char>(buf + k * config.block_size,
                                  config.block_size)};
      }
      absl::Status st;
      SteadyClock::time_point t0;
      if (config.op == Op::kRandRead) {
        t0 = SteadyClock::now();
        st = tier.Read(kNamespace, call_keys[0], requests[0].dest);
      } else {
        t0 = SteadyClock::now();
        std::vector<absl::Status> statuses = tier.MultiRead(
            kNamespace, absl::MakeConstSpan(requests.data(), count));
        for (uint64_t k = 0; k < count && st.ok(); ++k) {
          if (!statuses[k].ok()) {
            st = absl::Status(statuses[k].code(),
                              absl::StrCat(call_keys[k], ": ",
                                           statuses[k].message()));
          }
        }
      }
      const SteadyClock::time_point t1 = SteadyClock::now();
      if (st.ok()) {
        r.ops += count;
        ++r.calls;
        r.latencies_us.push_back(Micros(t0, t1));
      } else {
        ReportError(r, thread, "read", st);
        r.errors += count;
      }
    }
  });
  const uint64_t taken = std::min(next.load(), total);
  extras.passes_started = n == 0 ? 0 : (taken + n - 1) / n;
}

std::string StatsJson(const NvmeTierStats& s) {
  return absl::StrFormat(
      "{\"used_bytes\":%u,\"capacity_bytes\":%u,\"blocks\":%u,"
      "\"disk_bytes\":%u,\"puts\":%u,\"write_bytes\":%u,\"write_errors\":%u,"
      "\"reads\":%u,\"read_bytes\":%u,\"integrity_errors\":%u,"
      "\"orphans_dropped\":%u,\"evictions\":%u,\"evicted_bytes\":%u,"
      "\"writable\":%s}",
      s.used_bytes, s.capacity_bytes, s.blocks, s.disk_bytes, s.puts,
      s.write_bytes, s.write_errors, s.reads, s.read_bytes, s.integrity_errors,
      s.orphans_dropped, s.evictions, s.evicted_bytes,
      s.writable ? "true" : "false");
}

int Run(const BenchConfig& config) {
  NvmeTierOptions options;
  options.path = config.path;
  options.capacity_bytes = config.capacity;
  // Every block the bench is asked for is stored, however small: a block
  // bound whose floor (64 bytes) raises no block's charge by much.
  options.max_blocks = config.capacity / 64;
  options.use_wal = false;
  options.direct_reads = config.direct_reads;
  options.direct_writes = config.direct_writes;
  if (config.write_buffer_size > 0) {
    options.write_buffer_size = config.write_buffer_size;
  }
  const BlockDevice device(config.path);

  const SteadyClock::time_point open_start = SteadyClock::now();
  absl::StatusOr<std::unique_ptr<NvmeTier>> opened =
      OpenNvmeTier(options, /*clock=*/nullptr);
  const double open_seconds =
      std::chrono::duration<double>(SteadyClock::now() - open_start).count();
  if (!opened.ok()) {
    std::fprintf(stderr, "nvme-tier-bench: cannot open the tier at %s: %s\n",
                 config.path.c_str(), opened.status().ToString().c_str());
    return 1;
  }
  NvmeTier& tier = **opened;

  // Reads: the blocks to read, chosen before the clock starts.
  std::vector<uint64_t> indexes;
  uint64_t wrong_size = 0;
  RunExtras extras;
  if (config.op != Op::kFill) {
    indexes = StoredBlocks(tier, config.block_size, &wrong_size);
    extras.stored_blocks = indexes.size();
    if (wrong_size > 0) {
      std::fprintf(stderr,
                   "nvme-tier-bench: %llu stored blocks are not %s: ignored\n",
                   static_cast<unsigned long long>(wrong_size),
                   FormatSize(config.block_size).c_str());
    }
    if (indexes.empty()) {
      std::fprintf(stderr,
                   "nvme-tier-bench: the tier at %s holds no %s blocks; run "
                   "--op fill first\n",
                   config.path.c_str(), FormatSize(config.block_size).c_str());
      return 1;
    }
    if (config.blocks > 0 && config.blocks < indexes.size()) {
      // The first --blocks of a random order: a random subset.
      std::mt19937_64 rng(0x7375627365740aULL);
      std::shuffle(indexes.begin(), indexes.end(), rng);
      indexes.resize(config.blocks);
    }
    if (config.op == Op::kMultiRead &&
        static_cast<uint64_t>(config.batch) > indexes.size()) {
      std::fprintf(stderr,
                   "nvme-tier-bench: --batch %d is more than the %llu blocks "
                   "to read\n",
                   config.batch,
                   static_cast<unsigned long long>(indexes.size()));
      return 2;
    }
  }

  bool dropped = false;
  if (config.drop_caches) {
    absl::Status st = DropCaches();
    if (!st.ok()) {
      std::fprintf(stderr, "nvme-tier-bench: --drop-caches: %s\n",
                   st.ToString().c_str());
      return 1;
    }
    dropped = true;
  }

  const std::optional<DiskCounters> disk_before = device.Sample();
  std::vector<ThreadResult> results;
  absl::Status run_status;
  if (config.op == Op::kFill) {
    run_status = Fill(tier, config, results, extras);
  } else {
    Read(tier, config, indexes, results, extras);
  }
  const std::optional<DiskCounters> disk_after = device.Sample();
  const NvmeTierStats stats = tier.Stats();

  const TallySummary tally = Summarize(results);
  const uint64_t ops = tally.ops;
  const uint64_t calls = tally.calls;
  uint64_t errors = tally.errors;
  if (!run_status.ok()) {
    std::fprintf(stderr, "nvme-tier-bench: flush failed: %s\n",
                 run_status.ToString().c_str());
    ++errors;
  }
  if (extras.already_present > 0) {
    // Counted as errors (the run exits 1): a fill that wrote only some of
    // its blocks did not measure what it says.
    std::fprintf(stderr,
                 "nvme-tier-bench: %llu blocks were already stored (fill an "
                 "empty --path): nothing was written for them, and they count "
                 "as errors\n",
                 static_cast<unsigned long long>(extras.already_present));
    errors += extras.already_present;
  }
  const double p50 = tally.p50_us;
  const double p99 = tally.p99_us;
  const double p999 = tally.p999_us;
  const double seconds = extras.seconds;
  const double ops_per_sec =
      seconds > 0 ? static_cast<double>(ops) / seconds : 0;
  const double gb_per_sec =
      ops_per_sec * static_cast<double>(config.block_size) / 1e9;
  const double logical_bytes =
      static_cast<double>(ops) * static_cast<double>(config.block_size);
  const bool have_disk = disk_before.has_value() && disk_after.has_value();
  const uint64_t disk_read =
      have_disk ? disk_after->read_bytes - disk_before->read_bytes : 0;
  const uint64_t disk_written =
      have_disk ? disk_after->write_bytes - disk_before->write_bytes : 0;
  // Bytes the device moved per block byte the op moved: ~1 for reads that
  // all came from the disk, below 1 when the page cache served some.
  const double disk_ratio =
      logical_bytes > 0
          ? static_cast<double>(config.op == Op::kFill ? disk_written
                                                       : disk_read) /
                logical_bytes
          : 0;

  std::string human = absl::StrFormat(
      "%s %s x%d threads", config.op_name, FormatSize(config.block_size),
      config.threads);
  if (config.op == Op::kMultiRead) {
    absl::StrAppendFormat(&human, " batch %d", config.batch);
  }
  absl::StrAppendFormat(&human,
                        ": %u blocks in %u calls in %.2f s, %.1f ops/s, "
                        "%.3f GB/s, per call p50 %.1f us, p99 %.1f us, "
                        "p999 %.1f us, %u errors",
                        ops, calls, seconds, ops_per_sec, gb_per_sec, p50, p99,
                        p999, errors);
  if (config.op == Op::kFill) {
    absl::StrAppendFormat(&human, " (puts %.2f s + flush %.2f s)",
                          extras.put_seconds, extras.flush_seconds);
  } else {
    absl::StrAppendFormat(&human, " (%u stored blocks, %u passes)",
                          extras.stored_blocks, extras.passes_started);
  }
  if (have_disk) {
    absl::StrAppendFormat(&human, "; %s read %.3f GB, wrote %.3f GB (x%.2f)",
                          device.name(), disk_read / 1e9, disk_written / 1e9,
                          disk_ratio);
  }
  absl::StrAppendFormat(&human, "; tier %u blocks, disk_bytes %.3f GB",
                        stats.blocks, stats.disk_bytes / 1e9);

  if (config.json) {
    std::fprintf(stderr, "%s\n", human.c_str());
    std::string json = absl::StrFormat(
        "{\"tool\":\"nvme-tier-bench\",\"op\":\"%s\",\"block_size\":%u,"
        "\"threads\":%d,\"batch\":%d,\"ops\":%u,\"ops_unit\":\"block\","
        "\"calls\":%u,\"seconds\":%.6f,\"ops_per_sec\":%.3f,"
        "\"gb_per_sec\":%.6f,\"mb_per_sec\":%.3f,\"latency_unit\":\"call\","
        "\"p50_us\":%.3f,\"p99_us\":%.3f,\"p999_us\":%.3f,\"errors\":%u,"
        "\"open_s\":%.6f,\"drop_caches\":%s",
        config.op_name, config.block_size, config.threads,
        config.op == Op::kMultiRead ? config.batch : 1, ops, calls, seconds,
        ops_per_sec, gb_per_sec, gb_per_sec * 1e3, p50, p99, p999, errors,
        open_seconds, dropped ? "true" : "false");
    if (config.op == Op::kFill) {
      absl::StrAppendFormat(&json,
                            ",\"put_s\":%.6f,\"flush_s\":%.6f,"
                            "\"already_present\":%u",
                            extras.put_seconds, extras.flush_seconds,
                            extras.already_present);
    } else {
      absl::StrAppendFormat(&json,
                            ",\"stored_blocks\":%u,\"passes\":%u,"
                            "\"max_passes\":%d,\"duration_s\":%.3f",
                            extras.stored_blocks, extras.passes_started,
                            config.passes, config.duration_s);
    }
    if (have_disk) {
      absl::StrAppendFormat(
          &json,
          ",\"device\":{\"name\":\"%s\",\"read_bytes\":%u,\"write_bytes\":%u,"
          "\"bytes_per_block_byte\":%.4f,\"note\":\"whole device, every "
          "process\"}",
          device.name(), disk_read, disk_written, disk_ratio);
    } else {
      absl::StrAppend(&json, ",\"device\":null");
    }
    absl::StrAppend(&json, ",\"stats\":", StatsJson(stats));
    std::printf("%s}\n", json.c_str());
  } else {
    std::printf("%s\n", human.c_str());
  }
  std::fflush(stdout);
  return errors > 0 ? 1 : 0;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  using kvdepot::BenchConfig;
  // As kvdepotd does (an engine would reuse its buffers the same way).
  kvdepot::TuneProcessForBlockIo();
  CLI::App app{
      "nvme-tier-bench: the NVMe tier module (storage/nvme_tier.h) measured "
      "in-process: fill, randread, multiread"};
  BenchConfig config;
  std::string block_size = "256KiB";
  std::string capacity = "auto";
  app.add_option("--path", config.path, "the tier's directory")->required();
  app.add_option("--op", config.op_name, "fill|randread|multiread")
      ->required()
      ->check(CLI::IsMember({"fill", "randread", "multiread"}));
  app.add_option("--block-size", block_size,
                 "block size: 65536, 64KiB, 256KiB, 2MiB... (default 256KiB)");
  app.add_option("--blocks", config.blocks,
                 "fill: blocks to write (default 1024); reads: read a random "
                 "subset of this many stored blocks (default: all)")
      ->check(CLI::Range(uint64_t{1}, kvdepot::kMaxBlocks));
  app.add_option("--capacity", capacity,
                 "the tier's capacity bound (default auto: fill, the blocks "
                 "plus 1/16 and 64MiB; reads, 1TiB so that opening evicts "
                 "nothing)");
  app.add_option("--threads", config.threads, "threads (default 1)")
      ->check(CLI::Range(1, 256));
  app.add_option("--batch", config.batch,
                 "multiread: blocks per MultiRead call (default 16)")
      ->check(CLI::Range(1, kvdepot::kMaxBatch));
  app.add_option("--duration", config.duration_s,
                 "reads: most seconds to run (default 10); fill writes all "
                 "--blocks")
      ->check(CLI::PositiveNumber);
  app.add_option("--passes", config.passes,
                 "reads: most passes over the blocks, each a new random "
                 "permutation (default 1; later passes may hit the page "
                 "cache)")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--drop-caches", config.drop_caches,
               "sync and drop the page cache just before the timed window "
               "(root)");
  app.add_flag("--json", config.json, "print one JSON object on stdout");
  app.add_flag("--direct-reads", config.direct_reads,
               "open the tier with NvmeTierOptions::direct_reads");
  app.add_flag("--direct-writes", config.direct_writes,
               "open the tier with NvmeTierOptions::direct_writes");
  std::string write_buffer;
  app.add_option("--write-buffer", write_buffer,
                 "memtable size (NvmeTierOptions::write_buffer_size)");
  bool batch_given = false;
  try {
    app.parse(argc, argv);
    batch_given = app.count("--batch") > 0;
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  absl::StatusOr<uint64_t> size =
      kvdepot::ParseSizeUpTo(block_size, 256.0 * 1048576.0);
  if (!size.ok()) {
    std::fprintf(stderr, "nvme-tier-bench: --block-size: %s (most 256MiB)\n",
                 std::string(size.status().message()).c_str());
    return 2;
  }
  config.block_size = *size;
  config.op = config.op_name == "fill"       ? kvdepot::Op::kFill
              : config.op_name == "randread" ? kvdepot::Op::kRandRead
                                             : kvdepot::Op::kMultiRead;
  if (config.op == kvdepot::Op::kFill && config.blocks == 0) {
    config.blocks = 1024;
  }
  if (config.op != kvdepot::Op::kMultiRead && batch_given &&
      config.batch != 1) {
    std::fprintf(stderr, "nvme-tier-bench: --batch is for --op multiread\n");
    return 2;
  }
  if (config.op == kvdepot::Op::kMultiRead && !batch_given) config.batch = 16;
  if (config.duration_s <= 0) config.duration_s = 10;
  // Parses a size flag into *out; false (after a message) when it is bad.
  auto size_flag = [](const char* flag, const std::string& text, double max,
                      uint64_t* out) {
    absl::StatusOr<uint64_t> n = kvdepot::ParseSizeUpTo(text, max);
    if (!n.ok()) {
      std::fprintf(stderr, "nvme-tier-bench: %s: %s\n", flag,
                   std::string(n.status().message()).c_str());
      return false;
    }
    *out = *n;
    return true;
  };
  if (capacity == "auto") {
    config.capacity =
        config.op == kvdepot::Op::kFill
            ? config.blocks * config.block_size / 16 * 17 + (uint64_t{64} << 20)
            : uint64_t{1} << 40;
  } else if (!size_flag("--capacity", capacity, 1e18, &config.capacity)) {
    return 2;
  }
  if (!write_buffer.empty() &&
      !size_flag("--write-buffer", write_buffer, 1e12, &config.write_buffer_size)) {
    return 2;
  }
  return kvdepot::Run(config);
}
