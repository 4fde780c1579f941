#include "transport/memory_region.h"

namespace kvdepot {

MemoryRegion::~MemoryRegion() { ucp_mem_unmap(context_, memh_); }

bool MemoryRegion::Contains(const void* p, size_t bytes) const {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t base = reinterpret_cast<uintptr_t>(base_);
  // Written so that no sum can overflow.
  return start >= base && bytes <= size_ && start - base <= size_ - bytes;
}

}  // namespace kvdepot
