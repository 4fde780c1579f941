// Memory bound of a real kvdepotd: with its 1 GiB DRAM tier full (and
// evicting, which demotes to its NVMe tier), the whole process stays under
// 1.1 GiB resident.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

uint64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      uint64_t kb = 0;
      std::string num = line.substr(6);
      num.erase(num.find("kB"));
      EXPECT_TRUE(absl::SimpleAtoi(num, &kb)) << line;
      return kb * 1024;
    }
  }
  ADD_FAILURE() << "no VmRSS for " << pid;
  return 0;
}

TEST(MemoryTest, FullOneGibDramTierStaysUnderOnePointOneGibRss) {
  auto d = testing::DaemonProcess::Start({"--dram-capacity", "1GiB"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  auto client = std::move(Client::Connect(o)).value();
  // 1.25 GiB of 256 KiB blocks in batches of 16: the tier fills and evicts.
  const std::string bytes(256 << 10, 'r');
  std::vector<std::string> keys(16);
  for (int i = 0; i < 5120; i += 16) {
    std::vector<BlockToPut> batch;
    for (int j = 0; j < 16; ++j) {
      keys[j] = absl::StrCat("rss-", i + j);
      batch.push_back(BlockToPut{keys[j], "", bytes});
    }
    ASSERT_OK(client->Put("e2e/memory", batch));
  }
  auto st = client->Stats();
  ASSERT_OK(st);
  const uint64_t cap = st->dram().capacity_bytes();
  EXPECT_EQ(cap, uint64_t{1} << 30);
  EXPECT_GT(st->dram().used_bytes(), cap * 8 / 10);
  EXPECT_GT(st->dram().evictions(), 0u);
  uint64_t rss = RssBytes((*d)->pid());
  std::printf("kvdepotd RSS with a full 1 GiB DRAM tier: %.3f GiB (%.1f MiB over the tier)\n",
              rss / 1073741824.0, (rss - static_cast<double>(st->dram().used_bytes())) / 1048576.0);
  // 1.1 GiB: the DRAM tier plus gRPC buffers, RocksDB memtables of the NVMe
  // tier that demotions fill, and the indexes.
  EXPECT_LT(rss, static_cast<uint64_t>(1.1 * (uint64_t{1} << 30)));
}

}  // namespace
}  // namespace kvdepot
