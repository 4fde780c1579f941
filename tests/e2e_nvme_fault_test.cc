// Faults against a real kvdepotd with its NVMe tier: a byte flipped on disk
// under a stopped daemon, and kill -9 in the middle of heavy puts. In every
// case a block is served with exactly its bytes or not at all.
#include <signal.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

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

const std::vector<std::string> kArgs = {"--dram-capacity", "8MiB", "--nvme-capacity",
                                        "256MiB"};

TEST(NvmeFaultTest, ByteFlippedInABlobFileIsAMissNeverWrongBytes) {
  auto d = DaemonProcess::Start(kArgs);
  ASSERT_OK(d);
  const std::string data_dir = (*d)->data_dir();
  constexpr int kN = 16;
  std::vector<std::string> keys;
  {
    auto client = Connect((*d)->address());
    for (int i = 0; i < kN; ++i) {
      keys.push_back("flip-" + std::to_string(i));
      std::string bytes = BytesOf(i, 200000);
      BlockToPut b{keys.back(), "", bytes};
      ASSERT_OK(client->Put("ns", {&b, 1}));
    }
  }
  auto rc = (*d)->Stop(SIGTERM);  // persists DRAM to NVMe
  ASSERT_OK(rc);
  ASSERT_EQ(*rc, 0);

  // Flip one byte in the middle of the largest blob file.
  std::string blob;
  uintmax_t blob_size = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(data_dir + "/nvme")) {
    if (f.path().extension() == ".blob" && f.file_size() > blob_size) {
      blob = f.path().string();
      blob_size = f.file_size();
    }
  }
  ASSERT_FALSE(blob.empty()) << "no blob file under " << data_dir;
  {
    std::fstream io(blob, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(blob_size / 2));
    char c = 0;
    io.read(&c, 1);
    io.seekp(static_cast<std::streamoff>(blob_size / 2));
    c = static_cast<char>(c ^ 0x5a);
    io.write(&c, 1);
  }

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
  EXPECT_OK(client->Health());
  // A scrub afterwards finds nothing more to drop, and compaction works.
  auto verify = testing::RunCtl((*again)->address(), "--json verify");
  EXPECT_EQ(verify.exit_code, 0) << verify.err;
  EXPECT_NE(verify.out.find("\"corrupt_dropped\": 0"), std::string::npos) << verify.out;
  EXPECT_EQ(testing::RunCtl((*again)->address(), "compact").exit_code, 0);
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

}  // namespace
}  // namespace kvdepot
