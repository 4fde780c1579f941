// DramArena: the DRAM tier's memory. One region mapped once at start
// (hugepages when the system offers them), carved into 64 KiB pages. Small
// allocations (up to 32 KiB) come from size-class slabs, one page each; larger
// ones take a run of contiguous pages (best fit, coalesced on free). Blocks
// never live in per-block heap allocations, and all bookkeeping is kept
// outside the region, so nothing a data-plane client writes into the region
// can corrupt the allocator.
//
// Thread-safe.
#ifndef KVDEPOT_STORAGE_DRAM_ARENA_H_
#define KVDEPOT_STORAGE_DRAM_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvdepot {

enum class HugePageMode {
  kAuto,  // explicit 2 MiB hugepages (MAP_HUGETLB) if enough are free, else THP
  kOn,    // explicit 2 MiB hugepages or fail
  kOff,   // plain pages
};

// The explicit hugepages the arena maps are 2 MiB ones, whatever the host's
// default hugepage size (a node booted with default_hugepagesz=1G still
// serves the arena from its 2 MiB pool, the pool a pod's hugepages-2Mi
// resource draws on).
inline constexpr size_t kHugetlbPageSize = size_t{2} << 20;
// The sysfs directory of that pool (nr_hugepages, free_hugepages,
// resv_hugepages).
inline constexpr char kHugetlbSysfsDir[] =
    "/sys/kernel/mm/hugepages/hugepages-2048kB";

// The mmap flags of the arena's explicit-hugepage mapping: MAP_HUGETLB with
// the page size named (MAP_HUGE_2MB), not the host's default.
int HugetlbMapFlags();

// Bytes of kHugetlbPageSize hugepages free and not reserved by other
// mappings, from `sysfs_dir`'s free_hugepages and resv_hugepages; 0 when
// they cannot be read (no such pool).
uint64_t FreeHugetlbBytes(const std::string& sysfs_dir = kHugetlbSysfsDir);

class DramArena {
 public:
  static constexpr size_t kPageSize = 64 * 1024;
  static constexpr size_t kMinAlloc = 64;
  static constexpr size_t kMaxSmallAlloc = 32 * 1024;
  // Offsets are stored in 64-byte units in 32 bits elsewhere.
  static constexpr uint64_t kMaxCapacity = (uint64_t{1} << 32) * kMinAlloc;

  // Maps `capacity` bytes (rounded up to whole pages). InvalidArgument for a
  // capacity below one page or above kMaxCapacity; ResourceExhausted when the
  // mapping fails.
  // With `prefault`, every page is touched now, so the kernel's page zeroing
  // happens at start rather than inside the first puts (and the memory is
  // really there: a shortage shows at start, not as a later OOM kill).
  static absl::StatusOr<std::unique_ptr<DramArena>> Create(
      size_t capacity, HugePageMode mode, bool prefault = false);

  DramArena(const DramArena&) = delete;
  DramArena& operator=(const DramArena&) = delete;
  virtual ~DramArena() = default;

  // Allocates `bytes` (> 0) and returns the allocation's offset from base(),
  // a multiple of kMinAlloc. ResourceExhausted when no free space fits.
  virtual absl::StatusOr<uint64_t> Allocate(size_t bytes) = 0;
  // REQUIRES: `offset` came from Allocate and was not freed since.
  virtual void Free(uint64_t offset) = 0;
  // Whether Allocate(bytes) would succeed now: a free piece fits it (a slot
  // of its size class, or a run of free pages long enough). Other threads
  // may allocate or free meanwhile.
  virtual bool Fits(size_t bytes) const = 0;
  // Whether Allocate(bytes) could succeed once every allocation but those
  // at `held` (offsets Allocate returned, not freed since) were freed: a
  // run of pages long enough that none of them holds a page of a held
  // allocation (a slab page with a held slot is held whole). True for
  // small allocations (any page will do) and when a free piece fits now.
  // For a caller about to free (evict) allocations to make room: false
  // says no eviction can, for fragmentation. Order: the size of the arena
  // plus `held`.
  virtual bool CouldFitAvoiding(size_t bytes,
                                absl::Span<const uint64_t> held) const = 0;

  // The space Allocate(bytes) takes (its size class or page run).
  static size_t AllocationSize(size_t bytes);

  virtual char* base() const = 0;
  virtual size_t capacity() const = 0;
  // Sum of AllocationSize over live allocations, plus the end of each slab
  // page that no slot of its size class fits in (unusable while the page
  // holds small allocations): capacity() minus this is what can still be
  // allocated, fragmentation aside.
  virtual size_t allocated_bytes() const = 0;
  // The part of allocated_bytes() that is slab pages' unusable ends: it
  // returns with the pages' last slots, so what freeing blocks could make
  // free counts it.
  virtual size_t slab_tail_bytes() const = 0;
  virtual size_t live_allocations() const = 0;
  // How the region was mapped: "hugetlb", "thp" or "plain".
  virtual std::string page_kind() const = 0;

 protected:
  DramArena() = default;
};

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_DRAM_ARENA_H_
