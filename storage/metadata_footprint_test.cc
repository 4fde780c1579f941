// Measures the engine's metadata per block with one million blocks: the heap
// the index and its entries take, divided by the block count. The design
// budget is 128 bytes per block (keys live in the DRAM arena beside the
// block, not in the metadata).
#include <malloc.h>

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "storage/checksum.h"
#include "storage/tiered_store.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

constexpr int kBlocks = 1'000'000;

size_t HeapInUse() {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
}

TEST(MetadataFootprintTest, AtMost128BytesPerBlockWithOneMillionBlocks) {
  StoreOptions o;
  o.dram_capacity = uint64_t{kBlocks} * 128 + (64 << 20);
  // A million 64-byte blocks: a block bound whose floor is the arena's
  // smallest allocation, so that it raises none (the default, one block per
  // 4 KiB, would hold 50k of them).
  o.dram_max_blocks = o.dram_capacity / DramArena::kMinAlloc;
  o.hugepages = HugePageMode::kOff;
  o.background_eviction = false;
  auto store = NewTieredStore(o, SystemClock());
  ASSERT_OK(store);
  auto session = (*store)->OpenSession(absl::ZeroDuration(), "footprint");
  ASSERT_OK(session);
  // Warm the namespace table and scratch vectors before measuring.
  std::string bytes(64, 'm');
  const uint64_t sum = BlockChecksum(bytes);
  std::vector<std::string> keys(1024, std::string(32, '\0'));
  std::vector<PutSpec> specs(1024);
  std::vector<uint64_t> sums(1024, sum);
  malloc_trim(0);
  const size_t before = HeapInUse();
  for (int i = 0; i < kBlocks; i += 1024) {
    int n = std::min(1024, kBlocks - i);
    for (int j = 0; j < n; ++j) {
      uint32_t id = static_cast<uint32_t>(i + j);
      std::memcpy(keys[j].data(), &id, sizeof(id));  // 32-byte vLLM-like keys
      specs[j] = PutSpec{keys[j], j ? absl::string_view(keys[j - 1]) : "", 64};
    }
    auto r = (*store)->BeginPut(session->id, "footprint", {specs.data(), size_t(n)});
    ASSERT_OK(r);
    for (int j = 0; j < n; ++j) {
      std::memcpy((*store)->dram_region().base + r->slots[j].offset, bytes.data(), 64);
    }
    auto c = (*store)->CommitPut(session->id, r->id, {sums.data(), size_t(n)});
    ASSERT_OK(c);
  }
  malloc_trim(0);
  const size_t after = HeapInUse();
  ASSERT_EQ((*store)->Stats().dram.blocks, static_cast<uint64_t>(kBlocks));
  double per_block = static_cast<double>(after - before) / kBlocks;
  std::printf("metadata: %.1f bytes per block (%d blocks, %.1f MiB heap)\n",
              per_block, kBlocks, (after - before) / 1048576.0);
  RecordProperty("bytes_per_block", std::to_string(per_block));
  EXPECT_LE(per_block, 128.0);
}

}  // namespace
}  // namespace kvdepot
