#include "storage/dram_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <random>
#include <vector>

#include "tests/status_matchers.h"
#include "tests/test_dir.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;

constexpr size_t kPage = DramArena::kPageSize;

std::unique_ptr<DramArena> MakeArena(size_t capacity) {
  auto arena = DramArena::Create(capacity, HugePageMode::kOff);
  EXPECT_OK(arena);
  return std::move(arena).value();
}

// CouldFitAvoiding: whether a run of pages for `bytes` could be had once
// every allocation but the held ones were freed (a slab page with a held
// slot is held whole).
TEST(DramArenaTest, CouldFitAvoidingLooksForARunFreeOfHeldPages) {
  std::unique_ptr<DramArena> arena = MakeArena(16 * kPage);
  DramArena& a = *arena;
  absl::StatusOr<uint64_t> small = a.Allocate(64);  // a slab page
  ASSERT_TRUE(small.ok());
  std::vector<uint64_t> runs;
  while (true) {
    absl::StatusOr<uint64_t> run = a.Allocate(kPage);
    if (!run.ok()) break;
    runs.push_back(*run);
  }
  ASSERT_EQ(runs.size(), 15u);               // full
  EXPECT_TRUE(a.CouldFitAvoiding(100, {}));  // small: any page will do
  EXPECT_TRUE(a.CouldFitAvoiding(16 * kPage, {}));
  const uint64_t middle = runs[7];
  const std::vector<uint64_t> held = {*small, middle};
  const size_t below = middle / kPage - 1;       // pages after the slab page
  const size_t above = 16 - middle / kPage - 1;  // pages after `middle`
  const size_t longest = std::max(below, above);
  EXPECT_TRUE(a.CouldFitAvoiding(longest * kPage, held));
  EXPECT_FALSE(a.CouldFitAvoiding((longest + 1) * kPage, held));
  EXPECT_FALSE(a.CouldFitAvoiding(17 * kPage, {}));  // more than the arena
  // A free piece that fits now: yes, whatever is held.
  a.Free(runs[0]);
  a.Free(runs[1]);
  EXPECT_TRUE(a.CouldFitAvoiding(2 * kPage, runs));
}

TEST(DramArenaTest, RejectsCapacityBelowOnePage) {
  EXPECT_THAT(DramArena::Create(1000, HugePageMode::kOff),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DramArenaTest, AutoModeFallsBackWhenNoHugepages) {
  auto arena = DramArena::Create(4 * kPage, HugePageMode::kAuto);
  ASSERT_OK(arena);
  EXPECT_GE((*arena)->capacity(), 4 * kPage);
  EXPECT_FALSE((*arena)->page_kind().empty());
  // Every byte is usable (a hugepage mapping without reserved pages would
  // raise SIGBUS here).
  std::fill_n((*arena)->base(), (*arena)->capacity(), 'x');
}

TEST(DramArenaTest, SizeClassesBoundSmallWaste) {
  EXPECT_EQ(DramArena::AllocationSize(1), 64u);
  EXPECT_EQ(DramArena::AllocationSize(64), 64u);
  EXPECT_EQ(DramArena::AllocationSize(65), 128u);
  EXPECT_EQ(DramArena::AllocationSize(129), 192u);
  EXPECT_EQ(DramArena::AllocationSize(32768), 32768u);
  EXPECT_EQ(DramArena::AllocationSize(32769), kPage);
  EXPECT_EQ(DramArena::AllocationSize(2 << 20), size_t{2} << 20);
  for (size_t n = 1; n <= 32768; n += 97) {
    size_t a = DramArena::AllocationSize(n);
    EXPECT_GE(a, n);
    if (n > 128) {
      EXPECT_LE(a, n * 3 / 2 + 1) << n;
    }
  }
}

TEST(DramArenaTest, EverySizeGivesAlignedOffsets) {
  // Several allocations of every small size, so each size class hands out
  // more than its first slot.
  auto arena = MakeArena(1024 * kPage);
  for (size_t n = 1; n <= DramArena::kMaxSmallAlloc; n += 31) {
    std::vector<uint64_t> offs;
    for (int i = 0; i < 3; ++i) {
      auto off = arena->Allocate(n);
      ASSERT_OK(off);
      ASSERT_EQ(*off % DramArena::kMinAlloc, 0u) << "size " << n;
      offs.push_back(*off);
    }
    for (uint64_t off : offs) arena->Free(off);
  }
  EXPECT_EQ(arena->allocated_bytes(), 0u);
}

TEST(DramArenaTest, AllocationsDoNotOverlapAndAreAligned) {
  auto arena = MakeArena(64 * kPage);
  std::mt19937 rng(7);
  std::map<uint64_t, size_t> live;  // offset -> AllocationSize
  std::uniform_int_distribution<size_t> size(1, 200 * 1024);
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      arena->Free(it->first);
      live.erase(it);
      continue;
    }
    size_t n = size(rng);
    auto off = arena->Allocate(n);
    if (!off.ok()) {
      EXPECT_THAT(off, StatusIs(absl::StatusCode::kResourceExhausted));
      continue;
    }
    EXPECT_EQ(*off % DramArena::kMinAlloc, 0u);
    EXPECT_LE(*off + n, arena->capacity());
    live[*off] = DramArena::AllocationSize(n);
    // Memory is usable: write the whole allocation.
    std::fill_n(arena->base() + *off, n, static_cast<char>(i));
  }
  uint64_t end = 0;
  size_t total = 0;
  std::map<uint64_t, size_t> slab_tails;  // page -> the end no slot fits in
  for (const auto& [off, len] : live) {
    EXPECT_GE(off, end) << "overlap at " << off;
    end = off + len;
    total += len;
    if (len < kPage) slab_tails[off / kPage] = kPage % len;
  }
  for (const auto& [page, tail] : slab_tails) total += tail;
  EXPECT_EQ(arena->allocated_bytes(), total);
  EXPECT_EQ(arena->live_allocations(), live.size());
  for (const auto& [off, len] : live) arena->Free(off);
  EXPECT_EQ(arena->allocated_bytes(), 0u);
}

// A slab page of 24 KiB slots holds two; its last 16 KiB hold nothing. An
// arena full of such blocks said it was three quarters used, and the
// store's watermarks (and the dashboard) took the rest for free room.
TEST(DramArenaTest, AFullArenaOfSlabsCountsAsFull) {
  auto arena = MakeArena(64 * kPage);
  std::vector<uint64_t> offs;
  while (true) {
    absl::StatusOr<uint64_t> off = arena->Allocate(20000);
    if (!off.ok()) break;
    offs.push_back(*off);
  }
  EXPECT_EQ(offs.size(), 128u);
  EXPECT_EQ(arena->allocated_bytes(), arena->capacity());
  EXPECT_EQ(arena->slab_tail_bytes(), 64u * (kPage - 2 * 24576));
  // A page goes back whole once its last slot is freed.
  arena->Free(offs[0]);
  EXPECT_EQ(arena->allocated_bytes(), arena->capacity() - 24576);
  arena->Free(offs[1]);
  EXPECT_EQ(arena->allocated_bytes(), arena->capacity() - kPage);
  EXPECT_EQ(arena->slab_tail_bytes(), 63u * (kPage - 2 * 24576));
  for (size_t i = 2; i < offs.size(); ++i) arena->Free(offs[i]);
  EXPECT_EQ(arena->allocated_bytes(), 0u);
  EXPECT_EQ(arena->slab_tail_bytes(), 0u);
}

TEST(DramArenaTest, FreedRunsCoalesceIntoOneLargeRun) {
  auto arena = MakeArena(16 * kPage);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 16; ++i) {
    auto off = arena->Allocate(kPage);
    ASSERT_OK(off);
    offs.push_back(*off);
  }
  EXPECT_THAT(arena->Allocate(1), StatusIs(absl::StatusCode::kResourceExhausted));
  // Free in an interleaved order; the whole arena must be one run again.
  for (int i = 0; i < 16; i += 2) arena->Free(offs[i]);
  for (int i = 1; i < 16; i += 2) arena->Free(offs[i]);
  auto all = arena->Allocate(16 * kPage);
  ASSERT_OK(all);
  EXPECT_EQ(*all, 0u);
}

TEST(DramArenaTest, EmptySlabPagesReturnToThePageHeap) {
  auto arena = MakeArena(2 * kPage);
  std::vector<uint64_t> smalls;
  for (size_t i = 0; i < kPage / 64; ++i) {
    auto off = arena->Allocate(64);
    ASSERT_OK(off);
    smalls.push_back(*off);
  }
  // One page is full of 64-byte slots; a run of 2 pages cannot fit.
  EXPECT_THAT(arena->Allocate(2 * kPage),
              StatusIs(absl::StatusCode::kResourceExhausted));
  for (uint64_t off : smalls) arena->Free(off);
  EXPECT_OK(arena->Allocate(2 * kPage));
}

// Fits tells whether Allocate would succeed, by size class and by the
// longest free run, not by the free space in sum.
TEST(DramArenaTest, FitsFollowsTheFreePiecesNotTheFreeSum) {
  auto arena = MakeArena(4 * kPage);
  EXPECT_TRUE(arena->Fits(4 * kPage));
  EXPECT_FALSE(arena->Fits(4 * kPage + 1));
  EXPECT_FALSE(arena->Fits(0));
  std::vector<uint64_t> pages;
  for (int i = 0; i < 4; ++i) pages.push_back(*arena->Allocate(kPage));
  EXPECT_FALSE(arena->Fits(64));
  arena->Free(pages[0]);
  arena->Free(pages[2]);
  // Two free pages, apart: one page fits, two do not.
  EXPECT_TRUE(arena->Fits(kPage));
  EXPECT_FALSE(arena->Fits(2 * kPage));
  EXPECT_THAT(arena->Allocate(2 * kPage),
              StatusIs(absl::StatusCode::kResourceExhausted));
  // A slab page with free slots fits its class without a free page.
  ASSERT_OK(arena->Allocate(kPage));
  auto small = arena->Allocate(100);
  ASSERT_OK(small);
  EXPECT_FALSE(arena->Fits(kPage));
  EXPECT_TRUE(arena->Fits(128));
  EXPECT_FALSE(arena->Fits(64));  // another class: needs a page
  arena->Free(pages[1]);
  EXPECT_TRUE(arena->Fits(kPage));
  EXPECT_TRUE(arena->Fits(64));
}

// The arena's hugepages are 2 MiB ones, named in the mapping's flags: with
// MAP_HUGETLB alone a node whose default hugepage size is 1 GiB would serve
// it from its 1 GiB pool, not the 2 MiB pool a pod's hugepages-2Mi requests.
TEST(HugetlbTest, TheMappingAsksFor2MiBPages) {
  const int flags = HugetlbMapFlags();
  EXPECT_NE(flags & MAP_HUGETLB, 0);
  EXPECT_EQ((flags >> MAP_HUGE_SHIFT) & MAP_HUGE_MASK, 21);  // log2(2 MiB)
  EXPECT_EQ(size_t{1} << ((flags >> MAP_HUGE_SHIFT) & MAP_HUGE_MASK),
            kHugetlbPageSize);
  // No MAP_NORESERVE: the pages are reserved when mapped.
  EXPECT_EQ(flags & MAP_NORESERVE, 0);
}

// The free-hugepage figure comes from the 2 MiB pool's sysfs directory, not
// /proc/meminfo's (which counts pages of the default size): free pages less
// those other mappings have reserved, times 2 MiB.
TEST(HugetlbTest, FreeBytesComeFromThe2MiBPoolsSysfsDir) {
  EXPECT_STREQ(kHugetlbSysfsDir, "/sys/kernel/mm/hugepages/hugepages-2048kB");
  const std::string dir = testing::FreshTestDir("hugepages-");
  const auto write = [&](const char* name, const char* text) {
    std::ofstream(dir + "/" + name) << text;
  };
  write("nr_hugepages", "16\n");
  write("free_hugepages", "10\n");
  write("resv_hugepages", "3\n");
  EXPECT_EQ(FreeHugetlbBytes(dir), 7 * kHugetlbPageSize);
  // More reserved than free (a racing read) is none free.
  write("resv_hugepages", "12\n");
  EXPECT_EQ(FreeHugetlbBytes(dir), 0u);
  // No such pool (a kernel without 2 MiB pages): none.
  EXPECT_EQ(FreeHugetlbBytes(dir + "/absent"), 0u);
}

}  // namespace
}  // namespace kvdepot
