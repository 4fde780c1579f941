#include "storage/dram_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {
namespace {

constexpr size_t kPage = DramArena::kPageSize;
constexpr size_t kSlotsPerPageMax = kPage / DramArena::kMinAlloc;  // 1024

// Size classes for small allocations: 64 B .. 32 KiB in steps of 1x and 1.5x
// powers of two (above 128 B), so the waste of a block over 128 B stays under
// a third. Every class is a multiple of 64 B, so every offset is too (the
// index stores offsets in 64-byte units).
constexpr std::array<uint32_t, 18> kClasses = {
    64,   128,  192,  256,  384,   512,   768,   1024,  1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768};
static_assert([] {
  for (uint32_t c : kClasses) {
    if (c % DramArena::kMinAlloc != 0) return false;
  }
  return true;
}(), "size classes must be multiples of kMinAlloc");

int ClassFor(size_t bytes) {
  auto it = std::lower_bound(kClasses.begin(), kClasses.end(), bytes);
  return it == kClasses.end() ? -1 : static_cast<int>(it - kClasses.begin());
}

size_t PagesFor(size_t bytes) { return (bytes + kPage - 1) / kPage; }

// Invariants (all under mu_):
//  * Every page is in exactly one state: kFree (inside a free run), kRunHead /
//    kRunBody (part of a large allocation), or kSlab (one size class).
//  * A free run of n pages starting at p has pages_[p].run = n and
//    pages_[p + n - 1].run = n (boundary tags), and {n, p} is in free_runs_.
//  * A slab page with free slots is in partial_[class]; a fully used one is
//    not; a fully free one is returned to the free runs at once.
class ArenaImpl final : public DramArena {
 public:
  ArenaImpl(char* base, size_t capacity, std::string kind)
      : base_(base), capacity_(capacity), kind_(std::move(kind)),
        pages_(capacity / kPage) {
    absl::MutexLock lock(&mu_);
    AddFreeRun(0, pages_.size());
  }
  ~ArenaImpl() override { munmap(base_, capacity_); }

  absl::StatusOr<uint64_t> Allocate(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("zero-byte allocation");
    if (bytes > capacity_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "allocation of ", bytes, " bytes exceeds the arena's ", capacity_));
    }
    absl::MutexLock lock(&mu_);
    int cls = ClassFor(bytes);
    absl::StatusOr<uint64_t> result =
        cls >= 0 ? AllocateSmall(cls) : AllocateRun(PagesFor(bytes));
    if (result.ok()) {
      allocated_ += AllocationSize(bytes);
      ++live_;
    }
    return result;
  }

  void Free(uint64_t offset) override {
    absl::MutexLock lock(&mu_);
    size_t page = offset / kPage;
    Page& p = pages_[page];
    if (p.state == kSlab) {
      size_t slot_size = kClasses[p.cls];
      size_t slot = (offset % kPage) / slot_size;
      p.used->reset(slot);
      bool was_full = p.used_count == SlotsPerPage(p.cls);
      --p.used_count;
      allocated_ -= slot_size;
      if (p.used_count == 0) {
        partial_[p.cls].erase(page);
        allocated_ -= TailBytes(p.cls);
        tail_bytes_ -= TailBytes(p.cls);
        p.used.reset();
        p.state = kFree;
        AddFreeRun(page, 1);
      } else if (was_full) {
        partial_[p.cls].insert(page);
      }
    } else {
      // kRunHead: the run length is in p.run.
      size_t n = p.run;
      allocated_ -= n * kPage;
      AddFreeRun(page, n);
    }
    --live_;
  }

  bool Fits(size_t bytes) const override {
    if (bytes == 0 || bytes > capacity_) return false;
    absl::MutexLock lock(&mu_);
    const int cls = ClassFor(bytes);
    if (cls >= 0 && !partial_[cls].empty()) return true;
    return RunFitsLocked(cls >= 0 ? 1 : PagesFor(bytes));
  }

  bool CouldFitAvoiding(size_t bytes,
                        absl::Span<const uint64_t> held) const override {
    if (bytes == 0 || bytes > capacity_) return false;
    if (ClassFor(bytes) >= 0) return true;
    const size_t want = PagesFor(bytes);
    absl::MutexLock lock(&mu_);
    if (RunFitsLocked(want)) return true;
    std::vector<bool> blocked(pages_.size(), false);
    for (uint64_t offset : held) {
      const size_t page = offset / kPage;
      if (page >= pages_.size()) continue;
      const Page& p = pages_[page];
      if (p.state == kRunHead) {
        for (size_t i = 0; i < p.run && page + i < pages_.size(); ++i) {
          blocked[page + i] = true;
        }
      } else if (p.state != kFree) {
        blocked[page] = true;  // a slab page (or a run's body: its head's)
      }
    }
    size_t run = 0;
    for (size_t page = 0; page < pages_.size(); ++page) {
      run = blocked[page] ? 0 : run + 1;
      if (run >= want) return true;
    }
    return false;
  }

  char* base() const override { return base_; }
  size_t capacity() const override { return capacity_; }
  size_t allocated_bytes() const override {
    absl::MutexLock lock(&mu_);
    return allocated_;
  }
  size_t slab_tail_bytes() const override {
    absl::MutexLock lock(&mu_);
    return tail_bytes_;
  }
  size_t live_allocations() const override {
    absl::MutexLock lock(&mu_);
    return live_;
  }
  std::string page_kind() const override { return kind_; }

 private:
  enum State : uint8_t { kFree, kRunHead, kRunBody, kSlab };
  struct Page {
    State state = kFree;
    int8_t cls = -1;
    uint16_t used_count = 0;
    uint32_t run = 0;  // free run or allocated run length (at its head)
    std::unique_ptr<std::bitset<kSlotsPerPageMax>> used;
  };

  static size_t SlotsPerPage(int cls) { return kPage / kClasses[cls]; }
  // Whether a free run of `pages` pages (or more) exists.
  bool RunFitsLocked(size_t pages) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return free_runs_.lower_bound({pages, 0}) != free_runs_.end();
  }
  // The end of a slab page no slot of its class fits in (16 KiB of a page
  // of 24 KiB slots): counted as allocated while the page is a slab, or
  // the arena would look a quarter empty when it is full of such blocks
  // (and its watermarks would never start the evictor).
  static size_t TailBytes(int cls) {
    return kPage - SlotsPerPage(cls) * kClasses[cls];
  }

  absl::StatusOr<uint64_t> AllocateSmall(int cls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto& partial = partial_[cls];
    size_t page;
    if (partial.empty()) {
      absl::StatusOr<uint64_t> run = AllocateRun(1);
      if (!run.ok()) return run.status();
      page = *run / kPage;
      Page& p = pages_[page];
      p.state = kSlab;
      p.cls = static_cast<int8_t>(cls);
      p.used_count = 0;
      p.used = std::make_unique<std::bitset<kSlotsPerPageMax>>();
      partial.insert(page);
      allocated_ += TailBytes(cls);
      tail_bytes_ += TailBytes(cls);
    } else {
      page = *partial.begin();
    }
    Page& p = pages_[page];
    size_t slots = SlotsPerPage(cls);
    // A page in partial_ has a free slot below `slots` by invariant.
    size_t slot = (~*p.used)._Find_first();
    p.used->set(slot);
    if (++p.used_count == slots) partial.erase(page);
    return page * kPage + slot * kClasses[cls];
  }

  absl::StatusOr<uint64_t> AllocateRun(size_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = free_runs_.lower_bound({n, 0});
    if (it == free_runs_.end()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("DRAM arena has no free run of ", n, " pages"));
    }
    auto [len, start] = *it;
    free_runs_.erase(it);
    if (len > n) SetFreeRun(start + n, len - n);
    pages_[start].state = kRunHead;
    pages_[start].run = static_cast<uint32_t>(n);
    for (size_t i = 1; i < n; ++i) pages_[start + i].state = kRunBody;
    return start * kPage;
  }

  // Frees pages [start, start+n) and merges them with free neighbours.
  void AddFreeRun(size_t start, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = 0; i < n; ++i) pages_[start + i].state = kFree;
    if (start > 0 && pages_[start - 1].state == kFree) {
      size_t prev_len = pages_[start - 1].run;
      size_t prev_start = start - prev_len;
      free_runs_.erase({prev_len, prev_start});
      start = prev_start;
      n += prev_len;
    }
    size_t end = start + n;
    if (end < pages_.size() && pages_[end].state == kFree) {
      size_t next_len = pages_[end].run;
      free_runs_.erase({next_len, end});
      n += next_len;
    }
    SetFreeRun(start, n);
  }

  void SetFreeRun(size_t start, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pages_[start].state = kFree;
    pages_[start].run = static_cast<uint32_t>(n);
    pages_[start + n - 1].state = kFree;
    pages_[start + n - 1].run = static_cast<uint32_t>(n);
    free_runs_.insert({n, start});
  }

  char* const base_;
  const size_t capacity_;
  const std::string kind_;

  mutable absl::Mutex mu_;
  std::vector<Page> pages_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<size_t, size_t>> free_runs_ ABSL_GUARDED_BY(mu_);
  std::array<std::set<size_t>, kClasses.size()> partial_ ABSL_GUARDED_BY(mu_);
  size_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  size_t tail_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of allocated_
  size_t live_ ABSL_GUARDED_BY(mu_) = 0;
};

constexpr size_t kHugePage = kHugetlbPageSize;

// glibc's <sys/mman.h> defines MAP_HUGE_SHIFT but not the per-size flags
// (those are in <linux/mman.h>); the value is the kernel ABI.
#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif
#ifdef MAP_HUGE_2MB
constexpr int kMapHuge2MB = MAP_HUGE_2MB;
#else
constexpr int kMapHuge2MB = 21 << MAP_HUGE_SHIFT;  // log2(2 MiB) = 21
#endif
static_assert(kHugePage == size_t{1} << 21, "kMapHuge2MB names 2 MiB pages");

// One unsigned number, the whole content of a sysfs file; nullopt when it
// cannot be read.
std::optional<uint64_t> ReadSysfsNumber(const std::string& path) {
  std::ifstream in(path);
  uint64_t value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

// Faults in [base, base+size) before the arena is used, in parallel (the
// kernel's page zeroing is the cost: about a second per GiB per core on
// small VMs). MADV_POPULATE_WRITE (Linux 5.14) where available, else one
// write per 4 KiB page; either runs after MADV_HUGEPAGE so THP can back it.
void Prefault(char* base, size_t size) {
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
  const size_t chunk = (size / threads + kHugePage - 1) / kHugePage * kHugePage;
  std::vector<std::thread> workers;
  for (size_t start = 0; start < size; start += chunk) {
    size_t len = std::min(chunk, size - start);
    workers.emplace_back([base, start, len] {
#ifdef MADV_POPULATE_WRITE
      if (madvise(base + start, len, MADV_POPULATE_WRITE) == 0) return;
#endif
      volatile char* p = base + start;
      for (size_t off = 0; off < len; off += 4096) p[off] = 0;
    });
  }
  for (std::thread& t : workers) t.join();
}

}  // namespace

int HugetlbMapFlags() {
  return MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | kMapHuge2MB;
}

uint64_t FreeHugetlbBytes(const std::string& sysfs_dir) {
  const uint64_t free_pages =
      ReadSysfsNumber(sysfs_dir + "/free_hugepages").value_or(0);
  const uint64_t reserved_pages =
      ReadSysfsNumber(sysfs_dir + "/resv_hugepages").value_or(0);
  const uint64_t free =
      free_pages > reserved_pages ? free_pages - reserved_pages : 0;
  return free * kHugePage;
}

size_t DramArena::AllocationSize(size_t bytes) {
  // The common cases without the class search (the index asks on every pin
  // and unpin): a key (the smallest class) and a block of pages.
  if (bytes <= kClasses.front()) return kClasses.front();
  if (bytes > kClasses.back()) return PagesFor(bytes) * kPage;
  return kClasses[ClassFor(bytes)];
}

absl::StatusOr<std::unique_ptr<DramArena>> DramArena::Create(
    size_t capacity, HugePageMode mode, bool prefault) {
  if (capacity < kPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("DRAM capacity ", capacity, " is below one page (",
                     kPageSize, " bytes)"));
  }
  if (capacity > kMaxCapacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("DRAM capacity ", capacity, " exceeds the limit of ",
                     kMaxCapacity, " bytes"));
  }
  size_t rounded = PagesFor(capacity) * kPage;
  void* mem = MAP_FAILED;
  std::string kind;
  if (mode != HugePageMode::kOff) {
    size_t huge = (rounded + kHugePage - 1) / kHugePage * kHugePage;
    // No MAP_NORESERVE here: the kernel must reserve the hugepages now, so a
    // shortage fails this call instead of raising SIGBUS on first touch.
    mem = mmap(nullptr, huge, PROT_READ | PROT_WRITE, HugetlbMapFlags(), -1, 0);
    if (mem != MAP_FAILED) {
      rounded = huge;
      kind = "hugetlb";
    } else if (mode == HugePageMode::kOn) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot map ", huge, " bytes of 2 MiB hugepages: ",
          std::strerror(errno), " (see ", kHugetlbSysfsDir, "/nr_hugepages)"));
    }
  }
  if (mem == MAP_FAILED) {
    mem = mmap(nullptr, rounded, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot map ", rounded, " bytes for the DRAM tier: ",
          std::strerror(errno)));
    }
    kind = "plain";
    if (mode == HugePageMode::kAuto && madvise(mem, rounded, MADV_HUGEPAGE) == 0) {
      kind = "thp";
    }
  }
  if (prefault) Prefault(static_cast<char*>(mem), rounded);
  return std::unique_ptr<DramArena>(
      new ArenaImpl(static_cast<char*>(mem), rounded, kind));
}

}  // namespace kvdepot
