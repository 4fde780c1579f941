// Faults against a real kvdepotd with its NVMe tier: a byte flipped on disk
// under a stopped daemon, and kill -9 in the middle of heavy puts. In every
// case a block is served with exactly its bytes or not at all.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;

std::unique_ptr<Client> Connect(const std::string& addr) {
  ClientOptions o;
  o.server = addr;
  o.rpc_timeout = absl::Seconds(20);
  return std::move(Client::Connect(o)).value();
}

std::string BytesOf(int i, size_t size) {
  std::mt19937 rng(static_cast<uint32_t>(i) * 7919u + 1);
  std::string b(size, '\0');
  for (auto& c : b) c = static_cast<char>(rng());
  return b;
}

// Blocks <prefix>i for i in [begin, end), of 256 KiB (BytesOf(i)), are all
// served with their own bytes.
void ExpectServed(Client& client, const std::string& prefix, int begin,
                  int end) {
  for (int i = begin; i < end; ++i) {
    std::string key = prefix + std::to_string(i);
    absl::string_view k = key;
    auto got = client.Get("ns", {&k, 1});
    ASSERT_OK(got) << key;
    EXPECT_EQ((*got)[0].bytes, BytesOf(i, 256 << 10)) << key;
  }
}

const std::vector<std::string> kArgs = {"--dram-capacity", "8MiB", "--nvme-capacity",
                                        "256MiB"};

// Puts `n` blocks of 200,000 bytes (BytesOf(i)) as flip-<i>, stops the
// daemon (which persists them to NVMe), then flips one byte in the middle
// of the largest blob file. Returns the data dir.
std::string StoreAndFlipAByte(int n, std::vector<std::string>* keys) {
  auto d = DaemonProcess::Start(kArgs);
  EXPECT_OK(d);
  if (!d.ok()) return "";
  const std::string data_dir = (*d)->data_dir();
  {
    auto client = Connect((*d)->address());
    for (int i = 0; i < n; ++i) {
      keys->push_back("flip-" + std::to_string(i));
      std::string bytes = BytesOf(i, 200000);
      BlockToPut b{keys->back(), "", bytes};
      EXPECT_OK(client->Put("ns", {&b, 1}));
    }
  }
  auto rc = (*d)->Stop(SIGTERM);  // persists DRAM to NVMe
  EXPECT_OK(rc);
  EXPECT_EQ(rc.value_or(-1), 0);

  std::string blob;
  uintmax_t blob_size = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(data_dir + "/nvme")) {
    if (f.path().extension() == ".blob" && f.file_size() > blob_size) {
      blob = f.path().string();
      blob_size = f.file_size();
    }
  }
  EXPECT_FALSE(blob.empty()) << "no blob file under " << data_dir;
  std::fstream io(blob, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(blob_size / 2));
  char c = 0;
  io.read(&c, 1);
  io.seekp(static_cast<std::streamoff>(blob_size / 2));
  c = static_cast<char>(c ^ 0x5a);
  io.write(&c, 1);
  EXPECT_TRUE(io.good()) << blob;
  return data_dir;
}

TEST(NvmeFaultTest, ByteFlippedInABlobFileIsAMissNeverWrongBytes) {
  constexpr int kN = 16;
  std::vector<std::string> keys;
  const std::string data_dir = StoreAndFlipAByte(kN, &keys);
  ASSERT_FALSE(data_dir.empty());

  auto again = DaemonProcess::Start(kArgs, data_dir);
  ASSERT_OK(again);
  auto client = Connect((*again)->address());
  int served = 0, missing = 0;
  for (int i = 0; i < kN; ++i) {
    absl::string_view k = keys[i];
    auto got = client->Get("ns", {&k, 1});
    if (got.ok()) {
      EXPECT_EQ((*got)[0].bytes, BytesOf(i, 200000)) << "wrong bytes for block " << i;
      ++served;
    } else {
      EXPECT_THAT(got, ::kvdepot::testing::StatusIs(absl::StatusCode::kNotFound)) << i;
      ++missing;
    }
  }
  std::printf("flipped byte: %d blocks served, %d missing\n", served, missing);
  EXPECT_GE(missing, 1);
  EXPECT_GE(served, kN / 2);  // the neighbours are still served
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_GE(st->integrity_errors(), 1u);
  EXPECT_EQ(st->nvme().integrity_errors(), st->integrity_errors());
  EXPECT_EQ(st->dram().integrity_errors(), 0u);
  EXPECT_OK(client->Health());
  // A scrub afterwards finds nothing more to drop, and compaction works.
  auto verify = testing::RunCtl((*again)->address(), "--json verify");
  EXPECT_EQ(verify.exit_code, 0) << verify.err;
  EXPECT_NE(verify.out.find("\"corrupt_dropped\": 0"), std::string::npos) << verify.out;
  EXPECT_EQ(testing::RunCtl((*again)->address(), "compact").exit_code, 0);
}

// kvdepotctl verify exits 4 when it dropped damaged blocks (a scheduled
// scrub alerts on it), and 0 once nothing is left to drop.
TEST(NvmeFaultTest, AScrubThatDropsACorruptBlockExitsFour) {
  std::vector<std::string> keys;
  const std::string data_dir = StoreAndFlipAByte(16, &keys);
  ASSERT_FALSE(data_dir.empty());
  auto d = DaemonProcess::Start(kArgs, data_dir);
  ASSERT_OK(d);
  auto verify = testing::RunCtl((*d)->address(), "--json verify");
  EXPECT_EQ(verify.exit_code, 4) << verify.out << verify.err;
  EXPECT_EQ(verify.out.find("\"corrupt_dropped\": 0"), std::string::npos)
      << verify.out;
  verify = testing::RunCtl((*d)->address(), "verify");
  EXPECT_EQ(verify.exit_code, 0) << verify.out << verify.err;
  EXPECT_NE(verify.out.find("dropped 0 corrupt, 0 missing"), std::string::npos)
      << verify.out;
}

TEST(NvmeFaultTest, KillNineDuringHeavyPutsLeavesNoPartialOrCorruptBlock) {
  auto d = DaemonProcess::Start(kArgs);
  ASSERT_OK(d);
  const std::string data_dir = (*d)->data_dir();
  constexpr int kWriters = 4, kPerWriter = 200;
  constexpr size_t kSize = 64 << 10;
  std::atomic<bool> stop{false};
  std::atomic<int> stored{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      auto client = Connect((*d)->address());
      for (int i = w; i < kWriters * kPerWriter && !stop; i += kWriters) {
        std::string key = "kill-" + std::to_string(i);
        std::string bytes = BytesOf(i, kSize);
        BlockToPut b{key, "", bytes};
        if (client->Put("ns", {&b, 1}).ok()) ++stored;
      }
    });
  }
  // Kill once most puts went through: the small DRAM tier has been demoting
  // to NVMe all along, so RocksDB is mid-flush or mid-write.
  for (int i = 0; i < 2000 && stored < kWriters * kPerWriter * 3 / 4; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ::kill((*d)->pid(), SIGKILL);
  stop = true;
  for (auto& t : writers) t.join();
  ASSERT_OK((*d)->Stop(SIGKILL));

  auto again = DaemonProcess::Start(kArgs, data_dir);
  ASSERT_OK(again);
  auto client = Connect((*again)->address());
  int found = 0;
  for (int i = 0; i < kWriters * kPerWriter; ++i) {
    std::string key = "kill-" + std::to_string(i);
    absl::string_view k = key;
    auto look = client->Lookup("ns", {&k, 1}, false, false);
    ASSERT_OK(look);
    if (!look->entries[0].found) continue;
    auto got = client->Get("ns", {&k, 1});
    ASSERT_OK(got) << key;  // reported present: must be served, whole
    EXPECT_EQ((*got)[0].bytes, BytesOf(i, kSize)) << key;
    ++found;
  }
  // Demotions flushed before the kill survive (without a WAL the last
  // memtable's worth may not).
  std::printf("kill -9 after %d acknowledged puts: %d blocks served after restart\n",
              stored.load(), found);
  EXPECT_GT(found, 0);
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->integrity_errors(), 0u);
}

TEST(NvmeFaultTest, ZipfWorkingSetFourTimesDramHitsBothTiersAndLosesNothing) {
  // 32 MiB of 256 KiB blocks against an 8 MiB DRAM tier.
  auto d = DaemonProcess::Start(kArgs);
  ASSERT_OK(d);
  auto client = Connect((*d)->address());
  constexpr int kN = 128;
  constexpr size_t kSize = 256 << 10;
  for (int i = 0; i < kN; ++i) {
    std::string key = "zipf-" + std::to_string(i);
    std::string bytes = BytesOf(i, kSize);
    BlockToPut b{key, "", bytes};
    ASSERT_OK(client->Put("ns", {&b, 1}));
  }
  // Zipf(1.1)-distributed reads over the working set.
  std::vector<double> cdf(kN);
  double sum = 0;
  for (int i = 0; i < kN; ++i) cdf[i] = (sum += 1.0 / std::pow(i + 1, 1.1));
  std::mt19937 rng(42);
  std::uniform_real_distribution<double> u(0, sum);
  for (int r = 0; r < 400; ++r) {
    int i = static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
    std::string key = "zipf-" + std::to_string(i);
    absl::string_view k = key;
    auto got = client->Get("ns", {&k, 1});
    ASSERT_OK(got) << key;  // NVMe holds everything DRAM let go
    ASSERT_EQ((*got)[0].bytes, BytesOf(i, kSize)) << key;
  }
  auto st = client->Stats();
  ASSERT_OK(st);
  EXPECT_GT(st->dram().hits(), 0u);     // hot blocks stay in DRAM
  EXPECT_GT(st->promotions(), 0u);      // colder ones come back from NVMe
  EXPECT_GT(st->demotions(), 0u);
  EXPECT_EQ(st->demotion_failures(), 0u);
  EXPECT_LE(st->dram().used_bytes(), st->dram().capacity_bytes());
  EXPECT_LE(st->nvme().used_bytes(), st->nvme().capacity_bytes());
  EXPECT_EQ(st->integrity_errors(), 0u);
  // No block was lost: every key is found in one tier or the other.
  for (int i = 0; i < kN; ++i) {
    std::string key = "zipf-" + std::to_string(i);
    absl::string_view k = key;
    auto look = client->Lookup("ns", {&k, 1}, false, false);
    ASSERT_OK(look);
    EXPECT_TRUE(look->entries[0].found) << key;
  }
  // A pinned lookup of the coldest blocks (only on NVMe now) promotes them
  // in one batch before it answers: every one is reported in DRAM.
  const uint64_t promotions_before = st->promotions();
  std::vector<std::string> cold;
  for (int i = kN - 16; i < kN; ++i) cold.push_back("zipf-" + std::to_string(i));
  std::vector<absl::string_view> cold_keys(cold.begin(), cold.end());
  auto pinned = client->Lookup("ns", cold_keys, /*prefix=*/false, /*pin=*/true);
  ASSERT_OK(pinned);
  for (size_t i = 0; i < cold.size(); ++i) {
    EXPECT_TRUE(pinned->entries[i].found) << cold[i];
    EXPECT_EQ(pinned->entries[i].tier, v1::TIER_DRAM) << cold[i];
  }
  ASSERT_OK(client->Unpin(pinned->pin_id));
  auto after = client->Stats();
  ASSERT_OK(after);
  EXPECT_GT(after->promotions(), promotions_before);
  EXPECT_EQ(after->pins(), 0u);
}

TEST(NvmeFaultTest, FullDiskSkipsDemotionAndKeepsServingDram) {
  // A 24 MiB filesystem for the data dir (tmpfs; needs root, as in CI).
  std::string mnt = testing::MakeTempDir("smallfs");
  if (testing::RunCommand(absl::StrCat("mount -t tmpfs -o size=24m tmpfs ", mnt)).exit_code != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (not root?)";
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { testing::RunCommand("umount -l " + dir); }
  } unmount{mnt};
  int acked = 0;
  {
    auto d = DaemonProcess::Start({"--dram-capacity", "8MiB", "--nvme-capacity", "1GiB"},
                                  mnt + "/data");
    ASSERT_OK(d);
    auto client = Connect((*d)->address());
    // 96 MiB of puts: the disk fills with demoted blocks long before.
    for (int i = 0; i < 384; ++i) {
      std::string key = "full-" + std::to_string(i);
      std::string bytes = BytesOf(i, 256 << 10);
      BlockToPut b{key, "", bytes};
      ASSERT_OK(client->Put("ns", {&b, 1})) << key;  // DRAM keeps taking puts
      ++acked;
    }
    auto st = client->Stats();
    ASSERT_OK(st);
    EXPECT_GT(st->demotion_failures(), 0u);
    EXPECT_OK(client->Health());
    // The log says why (the daemon looks once a second).
    EXPECT_TRUE(testing::PollUntil([&] {
      return absl::StrContains((*d)->Log(), "NVMe tier takes no writes");
    })) << (*d)->Log();
    // The newest blocks are in DRAM and served.
    ExpectServed(*client, "full-", 370, 384);
    EXPECT_TRUE((*d)->Running());
    auto rc = (*d)->Stop(SIGTERM);  // persisting on a full disk must not crash
    ASSERT_OK(rc);
    EXPECT_EQ(*rc, 0) << (*d)->Log();
  }
  EXPECT_EQ(acked, 384);
}

// The filesystem filled by something else while kvdepotd runs (logs, a
// copy): RocksDB's own LOG writer aborted the process on its first failed
// line (Debian's librocksdb asserts), while serving, at SIGTERM and at
// every restart. Now the daemon keeps serving, stops cleanly, and a
// restart on the still-full disk fails with the reason (exit 1), or, once
// there is room, serves what was persisted.
TEST(NvmeFaultTest, AFilesystemFilledByAnotherFileStopsNothingButNvmeWrites) {
  std::string mnt = testing::MakeTempDir("fullfs");
  if (testing::RunCommand(
          absl::StrCat("mount -t tmpfs -o size=40m tmpfs ", mnt))
          .exit_code != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (not root?)";
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { testing::RunCommand("umount -l " + dir); }
  } unmount{mnt};
  const std::vector<std::string> args = {"--dram-capacity", "16MiB",
                                         "--nvme-capacity", "24MiB"};
  const std::string data_dir = mnt + "/data";
  auto put = [](Client& client, const std::string& prefix, int n) {
    int stored = 0;
    for (int i = 0; i < n; ++i) {
      std::string key = prefix + std::to_string(i);
      std::string bytes = BytesOf(i, 256 << 10);
      BlockToPut b{key, "", bytes};
      stored += client.Put("ns", {&b, 1}).ok();
    }
    return stored;
  };
  {
    // 10 MiB on NVMe (persisted at SIGTERM) before the disk fills.
    auto d = DaemonProcess::Start(args, data_dir);
    ASSERT_OK(d);
    EXPECT_EQ(put(*Connect((*d)->address()), "before-", 40), 40);
    auto rc = (*d)->Stop(SIGTERM);
    ASSERT_OK(rc);
    ASSERT_EQ(*rc, 0) << (*d)->Log();
  }
  {
    auto d = DaemonProcess::Start(args, data_dir);
    ASSERT_OK(d);
    auto client = Connect((*d)->address());
    // Fill what is left of the filesystem.
    EXPECT_NE(testing::RunCommand(absl::StrCat("dd if=/dev/zero of=", mnt,
                                               "/filler bs=64k 2>/dev/null"))
                  .exit_code,
              0);
    put(*client, "after-", 200);  // demotions fail; DRAM takes them
    // The NVMe tier's timed flush, and its log lines, come meanwhile.
    absl::SleepFor(absl::Seconds(2));
    EXPECT_TRUE((*d)->Running()) << (*d)->Log();
    EXPECT_OK(client->Health());
    // The newest blocks are served from DRAM, byte for byte.
    ExpectServed(*client, "after-", 190, 200);
    // The gauge behind KvdepotNvmeNotWritable says so.
    EXPECT_TRUE(testing::PollUntil([&] {
      return testing::MetricValue(testing::ScrapeMetrics(**d),
                                  "kvdepot_nvme_writable") == 0;
    })) << testing::ScrapeMetrics(**d);
    auto rc = (*d)->Stop(SIGTERM);
    ASSERT_OK(rc);
    EXPECT_EQ(*rc, 0) << (*d)->Log();
  }
  {
    // Still full: RocksDB cannot open (it writes a MANIFEST at every
    // open), which stopped the whole daemon (a crash loop under systemd).
    // It starts, serving from DRAM alone, and says why; the tier's blocks
    // stay for a start with room. (Full to the last page: a MANIFEST fits
    // in the few KiB a 64 KiB filler leaves.)
    EXPECT_NE(testing::RunCommand(absl::StrCat("dd if=/dev/zero of=", mnt,
                                               "/filler2 bs=4k 2>/dev/null"))
                  .exit_code,
              0);
    auto d = DaemonProcess::Start(args, data_dir);
    ASSERT_OK(d) << "a full disk stops the NVMe tier only";
    auto client = Connect((*d)->address());
    EXPECT_OK(client->Health());
    EXPECT_EQ(put(*client, "dram-only-", 4), 4);
    ExpectServed(*client, "dram-only-", 0, 4);
    EXPECT_THAT((*d)->Log(), ::testing::HasSubstr("NVMe tier not opened"));
    const std::string metrics = testing::ScrapeMetrics(**d);
    EXPECT_EQ(testing::MetricValue(metrics, "kvdepot_nvme_writable"), 0)
        << metrics;
    EXPECT_GT(testing::MetricValue(
                  metrics, "kvdepot_tier_capacity_bytes{tier=\"nvme\"}"),
              0)
        << metrics;  // so that KvdepotNvmeNotWritable fires
    auto rc = (*d)->Stop(SIGTERM);
    ASSERT_OK(rc);
    EXPECT_EQ(*rc, 0) << (*d)->Log();
  }
  // Room again: what was on NVMe before the disk filled is all served.
  std::filesystem::remove(mnt + "/filler");
  std::filesystem::remove(mnt + "/filler2");
  auto d = DaemonProcess::Start(args, data_dir);
  ASSERT_OK(d) << "restart with room";
  EXPECT_EQ(testing::MetricValue(testing::ScrapeMetrics(**d),
                                 "kvdepot_nvme_writable"),
            1);
  auto client = Connect((*d)->address());
  int served = 0;
  for (int i = 0; i < 40; ++i) {
    std::string key = "before-" + std::to_string(i);
    absl::string_view k = key;
    auto got = client->Get("ns", {&k, 1});
    if (!got.ok()) continue;
    EXPECT_EQ((*got)[0].bytes, BytesOf(i, 256 << 10)) << key;
    ++served;
  }
  EXPECT_EQ(served, 40);
}

}  // namespace
}  // namespace kvdepot
