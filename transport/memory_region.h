// MemoryRegion: a buffer registered with a UcxContext (ucp_mem_map), with
// the packed remote key a peer needs for one-sided access. Made by
// UcxContext::Register.
//
// Thread-safe (immutable). Must not outlive its context.
#ifndef KVDEPOT_TRANSPORT_MEMORY_REGION_H_
#define KVDEPOT_TRANSPORT_MEMORY_REGION_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace kvdepot {

class MemoryRegion {
 public:
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  // Unregisters. REQUIRES: no transfer that uses the region is in flight
  // (wait for their handles first).
  ~MemoryRegion();

  char* base() const { return base_; }
  size_t size() const { return size_; }
  uint64_t address() const { return reinterpret_cast<uintptr_t>(base_); }

  // The remote key (ucp_rkey_pack) a peer passes to UcxEndpoint to reach
  // this region; opaque bytes, valid while the region lives. Give it only to
  // authenticated peers: with it they can read and write the whole region.
  const std::string& packed_rkey() const { return packed_rkey_; }

  // True when [p, p + bytes) lies inside the region.
  bool Contains(const void* p, size_t bytes) const;

  // The UCP handle, for transfers. Thread-safe.
  ucp_mem_h handle() const { return memh_; }

 private:
  friend class UcxContext;
  MemoryRegion(ucp_context_h context, ucp_mem_h memh, char* base, size_t size,
               std::string packed_rkey)
      : context_(context),
        memh_(memh),
        base_(base),
        size_(size),
        packed_rkey_(std::move(packed_rkey)) {}

  const ucp_context_h context_;
  const ucp_mem_h memh_;
  char* const base_;
  const size_t size_;
  const std::string packed_rkey_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_TRANSPORT_MEMORY_REGION_H_
