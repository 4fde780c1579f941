// The DRAM-tier TieredStore. Layout of the state:
//  * constant after construction: options_, clock_, arena_, index_;
//  * ns_mu_: the namespace table (name -> id, per-namespace counters);
//  * mu_: sessions, pins and reservations. Lock order: mu_, then index shard
//    locks, then the arena's lock; the index and arena never call back.
//    ns_mu_ is a leaf: nothing is locked under it (it may be taken under
//    mu_).
// A namespace is forgotten (its table entry freed, its id free for another)
// only when nothing refers to its id or its NamespaceInfo: see
// ReclaimNamespaces.
// Block bytes and keys live in the arena; a committed block is one BlockEntry
// in the index. A reservation owns its slots' arena space until it commits
// (ownership moves to the index) or ends (space freed).
#include "storage/tiered_store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/hash/hash.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "storage/block_index.h"
#include "storage/block_key.h"
#include "storage/checksum.h"
#include "storage/nvme_tier.h"
#include "storage/status_macros.h"
#include "storage/work_pool.h"

namespace kvdepot {

absl::StatusOr<LookupResult> TieredStore::Lookup(
    SessionId session, absl::string_view ns,
    absl::Span<const absl::string_view> keys, bool prefix, bool pin) {
  absl::StatusOr<LookupResult> out;
  absl::Notification done;
  LookupAsync(session, ns, keys, prefix, pin,
              [&](absl::StatusOr<LookupResult> r) {
                out = std::move(r);
                done.Notify();
              });
  done.WaitForNotification();
  return out;
}

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kDram:
      return "dram";
    case Tier::kNvme:
      return "nvme";
    case Tier::kNone:
      break;
  }
  return "none";
}

namespace {

// Bytes after each key in its arena allocation: when the block entered DRAM.
constexpr size_t kStampBytes = sizeof(int64_t);
// The longest a put waits for the evictor to demote room (AllocateEvicting)
// before it drops blocks itself.
constexpr absl::Duration kMaxWaitForRoom = absl::Seconds(5);
// The longest an Evict waits for blocks being demoted to reach the NVMe tier
// (so it can remove them from both) before it reports them as pinned.
constexpr absl::Duration kMaxWaitForDemotion = absl::Seconds(5);
// How soon ReclaimNamespaces may pass over the NVMe tier's index again.
constexpr absl::Duration kNamespaceScanInterval = absl::Seconds(1);

// The keys of a batch of `n` (key_at(i)) named earlier in it, in order, as
// (index, index of the key's first mention).
template <typename KeyAt>
std::vector<std::pair<size_t, size_t>> RepeatedKeys(size_t n, KeyAt key_at) {
  std::vector<std::pair<size_t, size_t>> repeats;
  if (n < 2) return repeats;
  absl::flat_hash_map<absl::string_view, size_t> first;
  first.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto [it, added] = first.emplace(key_at(i), i);
    if (!added) repeats.emplace_back(i, it->second);
  }
  return repeats;
}

struct NamespaceInfo {
  uint32_t id = 0;
  std::string name;
  std::atomic<uint64_t> blocks{0};
  std::atomic<uint64_t> bytes{0};  // of its DRAM blocks
  std::atomic<uint64_t> lookups{0};
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> quota{0};  // DRAM bytes; 0: none
  // What counts against the quota: the bytes of its DRAM blocks and of its
  // open reservations and promotions in flight. A block is charged (by
  // ChargeQuota, with or without a quota) before its DRAM space is
  // allocated, so concurrent puts cannot pass the quota together (a put
  // into a namespace that does not exist yet charges once its space is
  // allocated and the namespace created; the charge still checks the quota
  // an operator may have set meanwhile); it keeps its charge once
  // published, until it leaves DRAM (FreeEntry), and gives it back when it
  // is not published (aborted, failed, lost a race). Blocks are charged
  // their real sizes, not the arena space the block floor makes small ones
  // take (TieredStoreImpl::block_floor_): a quota is a namespace's share of
  // the bytes clients see (SetQuota, NamespaceStats::bytes); the floor
  // bounds the DRAM tier's block count as a whole, whatever the quotas.
  std::atomic<uint64_t> charged{0};
  // An operator's (SetQuota created it, or set its quota): never reclaimed
  // until Undeclare.
  std::atomic<bool> declared{false};
  // NamespaceRefs held: operations using this entry. Raised under ns_mu_.
  std::atomic<uint64_t> uses{0};
  // Under ns_mu_: a stamp (TieredStoreImpl::ns_stamp_) renewed when the
  // entry is created and whenever a NamespaceRef is taken, so that
  // ReclaimNamespaces can tell that nothing took it between its two looks.
  uint64_t stamp = 0;
};

// An operation's hold on a namespace: while one lives, the namespace is not
// reclaimed, so its NamespaceInfo and its id stay valid. Taken under ns_mu_
// (TieredStoreImpl::TakeRef); released from any thread. Movable.
class NamespaceRef {
 public:
  NamespaceRef() = default;
  NamespaceRef(NamespaceRef&& other) noexcept
      : info_(std::exchange(other.info_, nullptr)) {}
  NamespaceRef& operator=(NamespaceRef&& other) noexcept {
    if (this != &other) {
      Reset();
      info_ = std::exchange(other.info_, nullptr);
    }
    return *this;
  }
  NamespaceRef(const NamespaceRef&) = delete;
  NamespaceRef& operator=(const NamespaceRef&) = delete;
  ~NamespaceRef() { Reset(); }

  NamespaceInfo* get() const { return info_; }
  NamespaceInfo* operator->() const { return info_; }
  NamespaceInfo& operator*() const { return *info_; }
  explicit operator bool() const { return info_ != nullptr; }
  // Lets the namespace go (the last use of it through this ref).
  void Reset() {
    if (info_ != nullptr) std::exchange(info_, nullptr)->uses.fetch_sub(1);
  }

 private:
  friend class TieredStoreImpl;
  // REQUIRES: ns_mu_ is held and `info` is in the table.
  explicit NamespaceRef(NamespaceInfo* info) : info_(info) {
    info_->uses.fetch_add(1);
  }

  NamespaceInfo* info_ = nullptr;
};

struct Session {
  absl::Time deadline;
  absl::Duration lease;
  std::string client_name;
  std::string peer;  // OpenSession's (empty: not counted per peer)
  absl::flat_hash_set<PinId> pins;
  uint64_t pinned_blocks = 0;  // block references held by `pins`
  // Block references that pinned lookups accepted and not yet answered may
  // add (each its number of keys): counted against the pin limit from
  // PlanLookup to FinishLookup, so lookups waiting for their promotions
  // cannot pass it together.
  uint64_t planned_pins = 0;
  absl::flat_hash_set<ReservationId> reservations;
};

struct Pin {
  SessionId session;
  std::vector<BlockEntry*> entries;
  // Handed over (HandOverPin): the session whose pinned_blocks still count
  // its entries until it is released (0 otherwise).
  SessionId charged = 0;
};

struct Slot {
  std::string key;
  std::string parent;
  uint64_t size = 0;
  bool exists = false;
  int repeat_of = -1;  // PutSlot::repeat_of
  uint64_t data_offset = 0;
  uint64_t key_offset = 0;
  // A SlotHandle of this slot lives: its one writer (AcquireSlot refuses
  // a second).
  bool writing = false;
  // Set by SlotHandle::Checksum / CopyIn: the bytes were found to hash to
  // this. Cleared by AcquireSlot: bytes a later handle may have rewritten
  // are hashed again at commit.
  bool verified = false;
  uint64_t verified_checksum = 0;
};

struct ReservationState {
  SessionId session;
  uint32_t ns_id;
  std::vector<Slot> slots;
  uint64_t bytes = 0;   // arena space held
  int busy = 0;         // live SlotHandles (slots with `writing` set)
  bool doomed = false;  // ended while busy: free when the last handle goes
  // Charged to the namespace's quota (NamespaceInfo::charged): the sizes of
  // the slots not yet published.
  uint64_t charged = 0;
};

// What the puts waiting for a forced evictor round want room for, together
// (TieredStoreImpl::WaitForEvictor).
struct RoomWanted {
  uint64_t space = 0;  // arena space their batches still need, in sum
  size_t largest = 0;  // the largest one allocation among them
};

class TieredStoreImpl;

class SlotHandleImpl final : public SlotHandle {
 public:
  SlotHandleImpl(TieredStoreImpl* store, ReservationId id, uint32_t slot,
                 absl::Span<char> bytes)
      : store_(store), id_(id), slot_(slot), bytes_(bytes) {}
  ~SlotHandleImpl() override;
  absl::Span<char> bytes() const override { return bytes_; }
  std::string key() const override;
  std::string ns() const override;
  uint64_t Checksum() override;
  uint64_t CopyIn(const char* src) override;
  std::optional<uint64_t> CopyInUntil(const char* src, absl::Time deadline) override;

 private:
  TieredStoreImpl* const store_;  // outlives the handle
  const ReservationId id_;
  const uint32_t slot_;
  const absl::Span<char> bytes_;
};

class TieredStoreImpl final : public TieredStore {
 public:
  TieredStoreImpl(const StoreOptions& options, Clock* clock,
                  std::unique_ptr<DramArena> arena,
                  std::unique_ptr<NvmeTier> nvme)
      : options_(options),
        clock_(clock),
        arena_(std::move(arena)),
        block_floor_(DramBlockFloor(options_)),
        index_(arena_->base(), kStampBytes, /*first_seq=*/0, block_floor_),
        nvme_(std::move(nvme)) {
    if (options_.background_eviction) {
      evictor_ = std::thread([this] { EvictorLoop(); });
    }
    if (nvme_ != nullptr) {
      promoter_ = std::make_unique<WorkPool>(options_.promotion_threads,
                                             "kvd-promote");
    }
    if (nvme_ != nullptr) {
      // The namespaces of blocks kept on NVMe exist: clients may put into
      // them (with create_namespaces off), and operators see them
      // (ListNamespaces, GetQuota) before any block of theirs is read
      // back. One pass over the NVMe tier's in-memory index.
      absl::flat_hash_set<std::string> on_nvme;
      nvme_->ForEachBlock([&](const NvmeBlockView& b) {
        if (!on_nvme.contains(b.ns)) on_nvme.emplace(b.ns);
      });
      for (const std::string& ns : on_nvme) {
        NamespaceIdFor(ns, NamespaceUse::kStored).IgnoreError();  // past max_namespaces
      }
    }
  }

  ~TieredStoreImpl() override {
    promoter_.reset();  // finishes the promotions in flight first
    if (evictor_.joinable()) {
      {
        absl::MutexLock lock(&evict_mu_);
        stop_ = true;
      }
      evictor_.join();
    }
    // Pins hold no memory of their own; reservations hold arena space that
    // the arena's unmapping returns. Nothing else to release.
  }

  // ---- sessions ----------------------------------------------------------

  using TieredStore::OpenSession;
  absl::StatusOr<SessionGrant> OpenSession(absl::Duration lease,
                                           absl::string_view client_name,
                                           absl::string_view peer) override {
    if (lease <= absl::ZeroDuration()) lease = options_.default_lease;
    lease = std::clamp(lease, options_.min_lease, options_.max_lease);
    absl::MutexLock lock(&mu_);
    if (sessions_.size() >= options_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many sessions (", options_.max_sessions, ")"));
    }
    uint32_t* from_peer = nullptr;
    if (!peer.empty()) {
      from_peer = &peer_sessions_[std::string(peer)];
      if (*from_peer >= options_.max_sessions_per_peer) {
        return absl::ResourceExhaustedError(absl::StrCat(
            *from_peer, " sessions are open from ", peer,
            ", the most one peer may have (max_sessions_per_peer): close "
            "some, or let their leases end"));
      }
      ++*from_peer;
    }
    SessionId id;
    do {
      id = absl::Uniform<uint64_t>(rng_);
    } while (id == kInternalSession || sessions_.contains(id));
    Session& s = sessions_[id];
    s.lease = lease;
    s.deadline = clock_->Now() + lease;
    s.client_name = std::string(client_name);
    s.peer = std::string(peer);
    return SessionGrant{id, lease};
  }

  absl::StatusOr<absl::Duration> KeepAlive(SessionId session) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Session * s, LiveSession(session));
    s->deadline = clock_->Now() + s->lease;
    return s->lease;
  }

  absl::StatusOr<SessionRelease> CloseSession(SessionId session) override {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(LiveSession(session).status());
    return EndSession(session);
  }

  int ExpireSessions() override {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    return EndSessionsWhere([now](const Session& s) { return s.deadline <= now; });
  }

  int EndAllSessions() override {
    absl::MutexLock lock(&mu_);
    return EndSessionsWhere([](const Session&) { return true; });
  }

  bool HasSession(SessionId session) override {
    absl::MutexLock lock(&mu_);
    return LiveSession(session).ok();
  }

  absl::Status CheckReservation(SessionId session, ReservationId id) override {
    absl::MutexLock lock(&mu_);
    return FindReservation(session, id).status();
  }

  // ---- lookup and pins ---------------------------------------------------

  void LookupAsync(SessionId session, absl::string_view ns,
                   absl::Span<const absl::string_view> keys, bool prefix,
                   bool pin, LookupDone done) override {
    LookupAsyncCounting(session, ns, keys, prefix, pin, /*count=*/true,
                        std::move(done));
  }

  void RepeatLookupAsync(SessionId session, absl::string_view ns,
                         absl::Span<const absl::string_view> keys, bool pin,
                         LookupDone done) override {
    LookupAsyncCounting(session, ns, keys, /*prefix=*/false, pin,
                        /*count=*/false, std::move(done));
  }

  // `count`: whether the lookup counts in the lookup and hit statistics.
  void LookupAsyncCounting(SessionId session, absl::string_view ns,
                           absl::Span<const absl::string_view> keys,
                           bool prefix, bool pin, bool count, LookupDone done) {
    absl::StatusOr<LookupPlan> plan =
        PlanLookup(session, ns, keys, prefix, pin, count);
    if (!plan.ok()) return std::move(done)(plan.status());
    if (plan->promote.empty()) return std::move(done)(FinishLookup(*plan));
    promoter_->Submit(
        [this, plan = *std::move(plan), done = std::move(done)]() mutable {
          PromoteBatch(plan);
          std::move(done)(FinishLookup(plan));
        });
  }

  absl::StatusOr<uint32_t> Unpin(SessionId session, PinId pin) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(auto it, TakePinFromSession(session, pin));
    return ReleasePin(it);
  }

  absl::Status HandOverPin(SessionId session, PinId pin) override {
    absl::MutexLock lock(&mu_);
    // It leaves the session's pins (the session's end does not release it)
    // but still counts against max_pinned_blocks_per_session until it is
    // released: a client whose transfers are abandoned (HoldUntilReleased)
    // must not pin more than it may by letting them stall.
    ASSIGN_OR_RETURN(auto it, TakePinFromSession(session, pin, /*uncharge=*/false));
    if (session != kInternalSession) it->second.charged = session;
    it->second.session = kInternalSession;
    return absl::OkStatus();
  }

  // `session`'s `pin`, no longer among the session's pins (Unpin's errors);
  // with `uncharge`, no longer counted in its pinned_blocks either.
  absl::StatusOr<absl::flat_hash_map<PinId, Pin>::iterator> TakePinFromSession(
      SessionId session, PinId pin, bool uncharge = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // An expired session is gone, whether or not ExpireSessions ended it.
    RETURN_IF_ERROR(SessionOrInternal(session));
    auto it = pins_.find(pin);
    if (it == pins_.end() || it->second.session != session) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown pin ", pin, " for session ", session));
    }
    if (session != kInternalSession) {
      auto s = sessions_.find(session);
      if (s != sessions_.end()) {
        s->second.pins.erase(pin);
        if (uncharge) s->second.pinned_blocks -= it->second.entries.size();
      }
    }
    return it;
  }

  // ---- two-phase put -----------------------------------------------------

  absl::StatusOr<Reservation> BeginPut(SessionId session, absl::string_view ns,
                                       absl::Span<const PutSpec> blocks,
                                       bool* would_wait = nullptr) override {
    if (would_wait != nullptr) *would_wait = false;
    RETURN_IF_ERROR(ValidateNamespace(ns));
    RETURN_IF_ERROR(CheckBatch(blocks.size()));
    if (blocks.empty()) return absl::InvalidArgumentError("no blocks to put");
    uint64_t max_block = std::min<uint64_t>(options_.max_block_bytes,
                                            arena_->capacity());
    for (const PutSpec& b : blocks) {
      RETURN_IF_ERROR(ValidateKey(b.key));
      if (!b.parent.empty()) RETURN_IF_ERROR(ValidateKey(b.parent, "parent key"));
      if (b.size == 0) return absl::InvalidArgumentError("block size is 0");
      if (b.size > options_.max_block_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block of ", b.size, " bytes exceeds the limit of ",
            options_.max_block_bytes, " bytes"));
      }
      if (b.size > max_block) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "block of ", b.size, " bytes exceeds the DRAM tier's capacity of ",
            arena_->capacity(), " bytes"));
      }
    }
    // A key named twice is put once, by its first slot: the later ones are
    // answered as stored already (no slot, no quota charge, no DRAM
    // reserved twice), so all must name the same block: same size.
    std::vector<int> repeat_of(blocks.size(), -1);
    for (const auto& [i, first] :
         RepeatedKeys(blocks.size(), [&](size_t k) { return blocks[k].key; })) {
      if (blocks[i].size != blocks[first].size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block ", i, " names a key given earlier in the batch with ",
            blocks[first].size, " bytes, and ", blocks[i].size, " bytes"));
      }
      repeat_of[i] = static_cast<int>(first);
    }
    // The session first: a client whose session is gone must learn that
    // (NotFound: open a new one), not that the store drains, which it would
    // retry with the dead session.
    if (session != kInternalSession) {
      absl::MutexLock lock(&mu_);
      RETURN_IF_ERROR(LiveSession(session).status());
    }
    if (draining_.load()) {
      return absl::FailedPreconditionError("draining: no new puts accepted");
    }
    // An unknown namespace is created only once the put has reserved space
    // (below): a put that fails leaves none behind. Held until the
    // reservation is registered (then it keeps the namespace).
    NamespaceRef info = FindNamespace(ns);
    if (!info && !options_.create_namespaces) {
      // FailedPrecondition, unless an operator declared it meanwhile.
      ASSIGN_OR_RETURN(info, NamespaceIdFor(ns, NamespaceUse::kClientPut));
    }
    if (!info) {
      // One that could not be created fails here, before anything is
      // evicted for it (a creation racing this put may still take the last
      // one; then this put fails after making room).
      RETURN_IF_ERROR(RoomForANamespace());
    }

    ReservationState state{session, 0, {}, 0, 0, false};
    state.slots.resize(blocks.size());
    Reservation out;
    out.slots.resize(blocks.size());
    // Put-if-absent first: the blocks stored already are held (pinned, not
    // counted as lookups) until the reservation is made, so that making room
    // for the others cannot evict them; only the others are charged and
    // allocated.
    std::vector<BlockEntry*> held;
    absl::Cleanup release_held = [&] {
      for (BlockEntry* e : held) index_.Unpin(e);
    };
    uint64_t total = 0;  // bytes of the blocks to store
    uint64_t space = 0;  // the arena space their slots take
    for (size_t i = 0; i < blocks.size(); ++i) {
      const PutSpec& b = blocks[i];
      Slot& slot = state.slots[i];
      slot.key = std::string(b.key);
      slot.parent = std::string(b.parent);
      slot.size = b.size;
      if (repeat_of[i] >= 0) {
        slot.exists = true;
        slot.repeat_of = repeat_of[i];
        out.slots[i].exists = true;
        out.slots[i].repeat_of = repeat_of[i];
        continue;
      }
      // Across the tiers: a block only on NVMe is stored too (its in-memory
      // index answers; no disk access).
      BlockEntry* e =
          info ? index_.PinIfPresent(BlockIndex::MakeKey(info->id, b.key),
                                     /*even_corrupt=*/true)
               : nullptr;
      // A copy found corrupt that still holds the key goes now unless a
      // reader pins it, so that this put stores the block again instead of
      // being told it is stored (RetryCorruptDrops would drop it within a
      // second: an engine's re-put after recomputing may come sooner).
      if (e != nullptr && index_.IsCorrupt(e) && DropMarked(e)) e = nullptr;
      if (e != nullptr) held.push_back(e);
      std::optional<uint64_t> stored_size;
      if (e != nullptr) {
        stored_size = e->size;
      } else if (nvme_ != nullptr) {
        if (absl::StatusOr<NvmeBlockMeta> meta = nvme_->Meta(ns, b.key); meta.ok()) {
          stored_size = meta->size;
        }
      }
      if (stored_size.has_value()) {
        // Keys are content addresses: a block stored under this key with
        // another size is another layout's (or a client's bug), and the
        // put cannot be an idempotent no-op of it.
        if (*stored_size != b.size) {
          return absl::InvalidArgumentError(absl::StrCat(
              "block ", i, " is stored with ", *stored_size,
              " bytes and the put names ", b.size,
              ": a key names one content (another layout needs another "
              "namespace)"));
        }
        slot.exists = true;
        out.slots[i].exists = true;
        continue;
      }
      total += b.size;
      space += SlotAllocationSize(slot);
    }
    if (total == 0) return out;  // every key exists: no reservation
    if (total > arena_->capacity()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "batch of ", total, " bytes exceeds the DRAM tier's capacity of ",
          arena_->capacity(), " bytes"));
    }
    if (space > arena_->capacity()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "batch of ", total, " bytes would take ", space,
          " bytes of the DRAM tier's ", arena_->capacity(),
          " (keys and size classes included; a block takes at least ",
          block_floor_, ", as the tier holds at most ", DramMaxBlocks(options_),
          " blocks: dram_max_blocks)"));
    }
    // A batch that no eviction can make room for now (the rest of DRAM is
    // pinned or reserved) evicts nothing, for the quota or for DRAM. With
    // an NVMe tier and its evictor it waits for room
    // (WaitUntilRoomIsPossible): pins and reservations end, and what they
    // held becomes evictable; with would_wait it declines at once. Without
    // them it fails.
    if (absl::Status room = CheckRoom(space); !room.ok()) {
      if (!WaitsForRoom() || space > arena_->capacity()) return room;
      if (would_wait != nullptr) {
        *would_wait = true;
        MaybeWakeEvictor();
        return absl::UnavailableError(
            "DRAM tier full of pinned and reserved blocks: waits for room");
      }
      // Waits for pins and reservations to end before the quota's charge
      // may drop blocks of the namespace for a put that then cannot fit.
      RETURN_IF_ERROR(WaitUntilRoomIsPossible(space));
    }
    if (info) RETURN_IF_ERROR(ChargeQuota(*info, total, would_wait));

    uint64_t need = space;  // still to allocate
    for (size_t i = 0; i < blocks.size(); ++i) {
      Slot& slot = state.slots[i];
      if (slot.exists) continue;
      absl::Status st = AllocateSlot(slot, would_wait, need);
      if (!st.ok()) {
        state.slots.resize(i);  // only slots before i hold space
        FreeSlots(state);
        if (info) info->charged.fetch_sub(total);
        return st;
      }
      need -= SlotAllocationSize(slot);
      state.bytes += SlotAllocationSize(slot);
      state.charged += slot.size;
      out.slots[i].offset = slot.data_offset;
      out.slots[i].size = slot.size;
    }
    if (!info) {
      // Space is reserved: now the namespace is created. It has no quota
      // unless an operator declared it meanwhile; then the charge may make
      // room as above (the slots are allocated already, the charge still
      // keeps the namespace within its quota).
      absl::StatusOr<NamespaceRef> created =
          NamespaceIdFor(ns, NamespaceUse::kClientPut);
      absl::Status st = created.status();
      if (created.ok()) {
        info = *std::move(created);
        st = ChargeQuota(*info, total, would_wait);
      }
      if (!st.ok()) {
        FreeSlots(state);
        return st;
      }
    }
    state.ns_id = info->id;

    absl::MutexLock lock(&mu_);
    Session* s = nullptr;
    if (session != kInternalSession) {
      absl::StatusOr<Session*> live = LiveSession(session);
      if (!live.ok()) {  // ended or expired meanwhile
        FreeSlots(state);
        info->charged.fetch_sub(state.charged);
        return live.status();
      }
      s = *live;
    }
    ReservationId id = NewId();
    reserved_bytes_ += state.bytes;
    reservations_.emplace(id, std::move(state));
    if (s) s->reservations.insert(id);
    out.id = id;
    return out;
  }

  absl::StatusOr<std::unique_ptr<SlotHandle>> AcquireSlot(
      SessionId session, ReservationId id, uint32_t slot) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(ReservationState * r, FindReservation(session, id));
    if (slot >= r->slots.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "slot ", slot, " out of range: reservation ", id, " has ",
          r->slots.size()));
    }
    Slot& s = r->slots[slot];
    if (s.exists) {
      return absl::InvalidArgumentError(absl::StrCat(
          "slot ", slot, " of reservation ", id, " is EXISTS: nothing to write"));
    }
    // One writer per slot: a second could change the bytes while the
    // first hashes them, or after it has.
    if (s.writing) {
      return absl::AbortedError(absl::StrCat(
          "slot ", slot, " of reservation ", id,
          " is being written by another writer"));
    }
    // Whatever was hashed before is void: this writer may change the bytes.
    s.writing = true;
    s.verified = false;
    s.verified_checksum = 0;
    ++r->busy;
    return std::unique_ptr<SlotHandle>(new SlotHandleImpl(
        this, id, slot, absl::Span<char>(arena_->base() + s.data_offset, s.size)));
  }

  // SlotHandle::Checksum / CopyIn: the slot's final bytes hashed (outside
  // the lock) to `checksum`.
  // SlotHandle::key / ns.
  std::string SlotKey(ReservationId id, uint32_t slot) {
    absl::MutexLock lock(&mu_);
    auto it = reservations_.find(id);
    return it == reservations_.end() ? "" : it->second.slots[slot].key;  // busy pins it
  }
  std::string SlotNamespace(ReservationId id) {
    uint32_t ns_id;
    {
      absl::MutexLock lock(&mu_);
      auto it = reservations_.find(id);
      if (it == reservations_.end()) return "";  // cannot happen: busy pins it
      ns_id = it->second.ns_id;
    }
    // The reservation stays (busy) while its handle lives, and keeps the
    // namespace (ReclaimNamespaces).
    return NamespaceById(ns_id)->name;
  }

  // `checksum`: the slot's final bytes hash to it; nullopt: whatever was
  // hashed before is void (the bytes are about to change).
  void MarkVerified(ReservationId id, uint32_t slot,
                    std::optional<uint64_t> checksum) {
    absl::MutexLock lock(&mu_);
    auto it = reservations_.find(id);
    if (it == reservations_.end()) return;  // cannot happen: busy pins it
    Slot& s = it->second.slots[slot];
    s.verified = checksum.has_value();
    s.verified_checksum = checksum.value_or(0);
  }

  void ReleaseSlot(ReservationId id, uint32_t slot) {
    absl::MutexLock lock(&mu_);
    auto it = reservations_.find(id);
    if (it == reservations_.end()) return;  // cannot happen: busy pins it
    ReservationState& r = it->second;
    r.slots[slot].writing = false;
    if (--r.busy == 0 && r.doomed) {
      FreeSlots(r);
      reservations_.erase(it);
    }
  }

  absl::StatusOr<std::vector<CommitOutcome>> CommitPut(
      SessionId session, ReservationId id,
      absl::Span<const uint64_t> checksums) override {
    ReservationState r;
    NamespaceRef info;
    {
      absl::MutexLock lock(&mu_);
      ASSIGN_OR_RETURN(ReservationState * found, FindReservation(session, id));
      if (checksums.size() != found->slots.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "commit has ", checksums.size(), " checksums for ",
            found->slots.size(), " blocks"));
      }
      // A conflict, not a refusal of the put: once the writes in progress
      // finish (their handles go), the same commit succeeds.
      if (found->busy > 0) {
        return absl::AbortedError(absl::StrCat(
            "reservation ", id, " still has a slot being written"));
      }
      // Held from here on: once the reservation is gone, nothing else may
      // keep the namespace (its slots' charges end as they are published).
      info = NamespaceByIdRef(found->ns_id);
      r = std::move(*found);
      reservations_.erase(id);
      reserved_bytes_ -= r.bytes;
      if (session != kInternalSession) {
        auto s = sessions_.find(session);
        if (s != sessions_.end()) s->second.reservations.erase(id);
      }
    }
    std::vector<CommitOutcome> outcomes(r.slots.size());
    const uint32_t seq = index_.NextSeq();
    for (size_t i = 0; i < r.slots.size(); ++i) {
      Slot& slot = r.slots[i];
      if (slot.exists) {
        // A repeat of an earlier slot (computed already) shares its bytes:
        // stored by it, or refused with it.
        outcomes[i] =
            slot.repeat_of >= 0 &&
                    outcomes[slot.repeat_of] == CommitOutcome::kChecksumMismatch
                ? CommitOutcome::kChecksumMismatch
                : CommitOutcome::kAlreadyExists;
        continue;
      }
      const char* data = arena_->base() + slot.data_offset;
      // A slot hashed as its bytes landed is not hashed again (`verified`
      // holds only if no handle was acquired after that hash).
      const uint64_t actual =
          slot.verified ? slot.verified_checksum : BlockChecksum(data, slot.size);
      // A published block keeps its quota charge; the others give it back.
      if (actual != checksums[i]) {
        outcomes[i] = CommitOutcome::kChecksumMismatch;
        FreeSlot(slot);
        info->charged.fetch_sub(slot.size);
        continue;
      }
      // Stored by another writer since BeginPut: in DRAM (Publish refuses
      // then), or already demoted to NVMe (and gone from DRAM). Checked
      // just before publishing, so the window left is a twin's demotion
      // ending between the two calls.
      if ((nvme_ != nullptr && nvme_->Contains(info->name, slot.key)) ||
          !Publish(*info, slot, checksums[i], seq)) {
        outcomes[i] = CommitOutcome::kAlreadyExists;  // a racing writer won
        FreeSlot(slot);
        info->charged.fetch_sub(slot.size);
        continue;
      }
      outcomes[i] = CommitOutcome::kStored;
      puts_.fetch_add(1, std::memory_order_relaxed);
      put_bytes_.fetch_add(slot.size, std::memory_order_relaxed);
    }
    MaybeWakeEvictor();
    return outcomes;
  }

  absl::Status AbortPut(SessionId session, ReservationId id) override {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(FindReservation(session, id).status());
    if (session != kInternalSession) {
      auto s = sessions_.find(session);
      if (s != sessions_.end()) s->second.reservations.erase(id);
    }
    EndReservation(id);
    return absl::OkStatus();
  }

  // ---- eviction ----------------------------------------------------------

  CorruptDramCheck DropCorruptDram(absl::string_view ns, absl::string_view key,
                                   uint64_t checksum) override {
    if (!ValidateNamespace(ns).ok() || !ValidateKey(key).ok()) {
      return CorruptDramCheck::kNotCorrupt;
    }
    bool found_now = false;
    switch (TryDropCorrupt(ns, key, checksum, /*retry=*/false, &found_now)) {
      case CorruptDrop::kDropped:
        return found_now ? CorruptDramCheck::kDropped
                         : CorruptDramCheck::kDroppedAlready;
      case CorruptDrop::kNotCorrupt:
        return CorruptDramCheck::kNotCorrupt;
      case CorruptDrop::kBusy:
        break;
    }
    if (!found_now) return CorruptDramCheck::kKeptAlready;  // listed already
    ListCorrupt(ns, key, checksum);
    return CorruptDramCheck::kKept;
  }

  int RetryCorruptDrops() override {
    std::deque<CorruptKept> kept;
    {
      absl::MutexLock lock(&corrupt_mu_);
      kept.swap(corrupt_kept_);
    }
    int dropped = 0;
    std::deque<CorruptKept> busy;
    for (CorruptKept& k : kept) {
      switch (
          TryDropCorrupt(k.ns, k.key, k.checksum, /*retry=*/true, nullptr)) {
        case CorruptDrop::kDropped:
          ++dropped;
          break;
        case CorruptDrop::kNotCorrupt:  // gone (evicted, dropped by a report)
          break;
        case CorruptDrop::kBusy:
          busy.push_back(std::move(k));
          break;
      }
    }
    if (busy.empty()) return dropped;
    // Those listed meanwhile come after these; the oldest go past the limit.
    absl::MutexLock lock(&corrupt_mu_);
    for (CorruptKept& k : corrupt_kept_) busy.push_back(std::move(k));
    while (busy.size() > kMaxCorruptKept) busy.pop_front();
    corrupt_kept_.swap(busy);
    return dropped;
  }

  absl::StatusOr<EvictResult> Evict(absl::string_view ns,
                                    absl::Span<const absl::string_view> keys,
                                    bool all) override {
    RETURN_IF_ERROR(ValidateNamespace(ns));
    RETURN_IF_ERROR(CheckBatch(keys.size()));
    for (absl::string_view k : keys) RETURN_IF_ERROR(ValidateKey(k));
    if (!all && keys.empty()) {
      return absl::InvalidArgumentError("evict needs keys or all");
    }
    // A key named twice is one block: counted once (evicted, pinned or
    // missing), as EvictResult says.
    std::vector<absl::string_view> unique;
    if (const auto repeats =
            RepeatedKeys(keys.size(), [&](size_t k) { return keys[k]; });
        !repeats.empty()) {
      std::vector<bool> repeated(keys.size(), false);
      for (const auto& [i, first] : repeats) repeated[i] = true;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!repeated[i]) unique.push_back(keys[i]);
      }
      keys = unique;
    }
    ASSIGN_OR_RETURN(EvictResult result, EvictNow(ns, keys, all));
    // The evict's own deletes went through the WAL; the tier's evictions
    // for capacity just before did not, and the evict did not see those
    // blocks (no longer listed). Made durable too before the answer, so
    // that none comes back after a crash (outside the stripe: a flush may
    // take a while, promotions of the namespace need not wait for it).
    if (nvme_ != nullptr) {
      if (absl::Status st = nvme_->MakeWritesDurable(); !st.ok()) {
        return absl::Status(
            st.code(), absl::StrCat("evict: making the NVMe tier's deletes "
                                    "durable: ",
                                    st.message()));
      }
    }
    return result;
  }

  // Evict's work, its arguments checked.
  absl::StatusOr<EvictResult> EvictNow(absl::string_view ns,
                                       absl::Span<const absl::string_view> keys,
                                       bool all) {
    // No promotion of this namespace publishes a block while we run (see
    // evict_stripes_).
    absl::WriterMutexLock no_promotions(&EvictStripe(ns));
    EvictResult result;
    const NamespaceRef info = FindNamespace(ns);
    auto drop = [&](std::unique_ptr<BlockEntry> e) {
      admin_evictions_dram_.fetch_add(1, std::memory_order_relaxed);
      ++result.evicted_blocks;
      result.evicted_bytes += e->size;
      FreeEntry(std::move(e), /*count_eviction=*/false);
    };
    // A copy on NVMe goes too (blocks are never pinned there). Returns
    // whether there was one; `count` when the block was not already counted
    // for its DRAM copy. A delete the tier could not make durable (RocksDB
    // stopped: full disk, I/O error) would bring the block back after a
    // restart: the first such error is the answer, after the other keys.
    absl::Status nvme_error;
    auto drop_nvme = [&](absl::string_view k, bool count) {
      if (nvme_ == nullptr) return false;
      // Meta lists stored blocks only. One the tier is evicting itself (a
      // demotion's batch, without the WAL, in flight) is not, yet Delete
      // is made all the same: it waits for that batch, so that
      // MakeWritesDurable (Evict) covers it, or deletes the block if the
      // batch failed and brought it back (its bytes then go uncounted).
      absl::StatusOr<NvmeBlockMeta> meta = nvme_->Meta(ns, k);
      if (absl::Status st = nvme_->Delete(ns, k); !st.ok()) {
        if (absl::IsNotFound(st)) return false;  // the tier evicted it
        if (nvme_error.ok()) {
          nvme_error = absl::Status(
              st.code(), absl::StrCat("evict: deleting a block from NVMe: ",
                                      st.message()));
        }
        return true;  // it was there: not "missing"
      }
      admin_evictions_nvme_.fetch_add(1, std::memory_order_relaxed);
      if (count) {
        ++result.evicted_blocks;
        if (meta.ok()) result.evicted_bytes += meta->size;
      }
      return true;
    };
    // A block being demoted leaves DRAM once it is on NVMe: wait for that,
    // then remove it from NVMe, so the demotion cannot bring it back.
    const absl::Time wait_until = absl::Now() + kMaxWaitForDemotion;
    if (all) {
      uint64_t demoting = 0;
      // Blocks counted for their DRAM copy: their NVMe copy (a promoted
      // block has both) goes uncounted, as with `keys`.
      absl::flat_hash_set<std::string> counted;
      while (info) {
        const uint64_t ended = DemotionsEnded();
        auto removed =
            index_.RemoveNamespace(info->id, &result.pinned_blocks, &demoting);
        for (auto& e : removed) {
          if (nvme_ != nullptr) {
            counted.emplace(arena_->base() + e->key_offset(), e->key_len);
          }
          drop(std::move(e));
        }
        if (demoting == 0 || !WaitForDemotions(ended, wait_until)) break;
      }
      result.pinned_blocks += demoting;  // waited too long: they stay
      if (nvme_ != nullptr) {
        std::vector<std::string> on_nvme;
        nvme_->ForEachBlock([&](const NvmeBlockView& b) {
          if (b.ns == ns) on_nvme.emplace_back(b.key);
        });
        for (const std::string& k : on_nvme) {
          // A block that stays in DRAM (pinned, or still being demoted)
          // keeps its NVMe copy, as with `keys`: it is reported pinned.
          if (info && index_.Peek(BlockIndex::MakeKey(info->id, k))) continue;
          drop_nvme(k, /*count=*/!counted.contains(k));
        }
      }
      RETURN_IF_ERROR(nvme_error);
      return result;
    }
    std::vector<absl::string_view> todo(keys.begin(), keys.end());
    while (!todo.empty()) {
      const uint64_t ended = DemotionsEnded();
      std::vector<absl::string_view> demoting;
      for (absl::string_view k : todo) {
        std::unique_ptr<BlockEntry> e;
        BlockIndex::RemoveOutcome outcome =
            info ? index_.Remove(BlockIndex::MakeKey(info->id, k), &e)
                 : BlockIndex::RemoveOutcome::kMissing;
        switch (outcome) {
          case BlockIndex::RemoveOutcome::kRemoved:
            drop(std::move(e));
            drop_nvme(k, /*count=*/false);
            break;
          case BlockIndex::RemoveOutcome::kDemoting:
            demoting.push_back(k);
            break;
          case BlockIndex::RemoveOutcome::kPinned:
            result.pinned_keys.emplace_back(k);
            ++result.pinned_blocks;
            break;
          case BlockIndex::RemoveOutcome::kMissing:
            if (!drop_nvme(k, /*count=*/true)) ++result.missing_keys;
            break;
        }
      }
      todo = std::move(demoting);
      if (!todo.empty() && !WaitForDemotions(ended, wait_until)) break;
    }
    for (absl::string_view k : todo) {  // waited too long: they stay
      result.pinned_keys.emplace_back(k);
      ++result.pinned_blocks;
    }
    RETURN_IF_ERROR(nvme_error);
    return result;
  }

  uint64_t RunEviction() override { return EvictToLowWatermark(/*force=*/false); }

  // Evicts (demoting) down to the low watermark; unless `force`, only when
  // above the high one. A forced round then goes on while `wanted` does
  // not fit: the free space is less than wanted.space, or no free piece
  // fits wanted.largest (a block bigger than the room the low watermark
  // leaves, or a fragmented arena). It stops when nothing is evictable.
  uint64_t EvictToLowWatermark(bool force, RoomWanted wanted = {}) {
    uint64_t cap = arena_->capacity();
    uint64_t high = static_cast<uint64_t>(options_.high_watermark * cap);
    uint64_t low = static_cast<uint64_t>(options_.low_watermark * cap);
    if (!force && arena_->allocated_bytes() <= high) return 0;
    uint64_t n = 0;
    // Waiters are woken only by a block that left: one a reader pinned
    // while it was demoted stays, and a waiter woken for nothing would drop
    // blocks itself (AllocateEvicting).
    bool freed = false;
    while (arena_->allocated_bytes() > low &&
           EvictOne(/*demote=*/true, &freed)) {
      ++n;
      if (freed) NoteRoomMade();
    }
    if (!force) return n;
    const uint64_t space = std::min<uint64_t>(wanted.space, cap);
    auto short_of_room = [&] {
      const uint64_t used = std::min<uint64_t>(arena_->allocated_bytes(), cap);
      return cap - used < space ||
             (wanted.largest > 0 && !arena_->Fits(wanted.largest));
    };
    while (short_of_room() && EvictOne(/*demote=*/true, &freed)) {
      ++n;
      if (freed) NoteRoomMade();
    }
    return n;
  }

  // Wakes the allocations waiting for the evictor (WaitForEvictor): a
  // block left DRAM, and theirs may fit now, long before the round ends.
  void NoteRoomMade() {
    absl::MutexLock lock(&evict_mu_);
    ++room_made_;
  }

  void SetDraining(bool draining) override { draining_.store(draining); }

  absl::StatusOr<VerifyReport> VerifyNvme(
      std::function<bool()> cancelled = nullptr) override {
    if (nvme_ == nullptr) return absl::FailedPreconditionError("no NVMe tier");
    ASSIGN_OR_RETURN(NvmeVerifyReport r, nvme_->Verify(std::move(cancelled)));
    return VerifyReport{r.blocks_checked, r.bytes_checked, r.corrupt_dropped,
                        r.missing_dropped, r.orphans_dropped};
  }

  absl::Status CompactNvme(std::function<bool()> cancelled) override {
    if (nvme_ == nullptr) return absl::FailedPreconditionError("no NVMe tier");
    return nvme_->Compact(std::move(cancelled));
  }

  void StopNvmeMaintenance() override {
    if (nvme_ != nullptr) nvme_->StopMaintenance();
  }

  absl::StatusOr<uint64_t> PersistDram() override {
    if (nvme_ == nullptr) return absl::FailedPreconditionError("no NVMe tier");
    uint64_t before = demotions_.load();
    while (EvictOne(/*demote=*/true)) {
    }
    RETURN_IF_ERROR(nvme_->Flush());
    return demotions_.load() - before;
  }

  // ---- stats -------------------------------------------------------------

  StoreStats Stats() override {
    StoreStats st;
    st.dram.used_bytes = arena_->allocated_bytes();
    st.dram.capacity_bytes = arena_->capacity();
    st.dram.blocks = index_.blocks();
    st.dram.hits = dram_hits_.load();
    st.dram.evictions = evictions_.load();
    st.dram.admin_evictions = admin_evictions_dram_.load();
    st.nvme.admin_evictions = admin_evictions_nvme_.load();
    {
      absl::MutexLock lock(&mu_);
      st.sessions = sessions_.size();
      st.pins = pins_.size();
      st.pinned_blocks = pins_active_;
      for (const auto& [id, session] : sessions_) {
        st.session_reservations += session.reservations.size();
      }
      // Aborted reservations whose slot is still being written linger until
      // their SlotHandle goes; they are not open reservations any more.
      for (const auto& [id, r] : reservations_) st.reservations += r.doomed ? 0 : 1;
      st.reserved_bytes = reserved_bytes_;
    }
    st.lookup_keys = lookup_keys_.load();
    st.lookup_hits = lookup_hits_.load();
    st.puts = puts_.load();
    st.put_bytes = put_bytes_.load();
    // DRAM blocks are verified on commit; NVMe blocks on every read.
    if (nvme_ != nullptr) {
      NvmeTierStats ns = nvme_->Stats();
      st.nvme.used_bytes = ns.used_bytes;
      st.nvme.capacity_bytes = ns.capacity_bytes;
      st.nvme.blocks = ns.blocks;
      st.nvme.hits = nvme_hits_.load();
      st.nvme.evictions = ns.evictions;
      st.integrity_errors = ns.integrity_errors;
      st.nvme_write_bytes = ns.write_bytes;
      st.nvme_write_error = std::move(ns.write_error);
    }
    st.demotions = demotions_.load();
    st.demotion_failures = demotion_failures_.load();
    st.room_wait_timeouts = room_wait_timeouts_.load();
    st.dram_integrity_errors = dram_integrity_errors_.load();
    st.dram_corrupt_evictions = dram_corrupt_evictions_.load();
    st.demotions_skipped = demotions_skipped_.load();
    st.promotions = promotions_.load();
    st.promotions_shed = promotions_shed_.load();
    st.draining = draining_.load();
    st.namespaces = ListNamespaces();
    return st;
  }

  std::vector<NamespaceStats> ListNamespaces() override {
    absl::MutexLock lock(&ns_mu_);
    std::vector<NamespaceStats> out;
    out.reserve(namespaces_.size());
    for (const auto& info : namespaces_) {
      if (info == nullptr) continue;  // reclaimed
      out.push_back(NamespaceStats{info->name, info->blocks.load(),
                                   info->bytes.load(), info->lookups.load(),
                                   info->hits.load()});
    }
    return out;
  }

  DramRegion dram_region() const override {
    return DramRegion{arena_->base(), arena_->capacity()};
  }
  const StoreOptions& options() const override { return options_; }

 private:
  absl::Status CheckBatch(size_t n) const {
    if (n > options_.max_batch_keys) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch of ", n, " keys exceeds the limit of ",
          options_.max_batch_keys));
    }
    return absl::OkStatus();
  }

  static absl::Status SessionNotFound(SessionId session) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is unknown or expired"));
  }

  PinId NewId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ++next_id_; }

  absl::StatusOr<Session*> LiveSession(SessionId session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = sessions_.find(session);
    if (it == sessions_.end() || it->second.deadline <= clock_->Now()) {
      return SessionNotFound(session);
    }
    return &it->second;
  }

  absl::StatusOr<ReservationState*> FindReservation(SessionId session,
                                                    ReservationId id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // An expired session is gone, whether or not ExpireSessions ended it.
    RETURN_IF_ERROR(SessionOrInternal(session));
    auto it = reservations_.find(id);
    if (it == reservations_.end() || it->second.doomed ||
        it->second.session != session) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown reservation ", id, " for session ", session));
    }
    return &it->second;
  }

  // NotFound when `session` is neither open nor kInternalSession: a pin or
  // reservation it no longer has went with it (closed, expired, its client
  // lost), which its client must learn as a lost session.
  absl::Status SessionOrInternal(SessionId session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (session == kInternalSession) return absl::OkStatus();
    return LiveSession(session).status();
  }

  // Ends every session for which `end` holds; returns how many.
  int EndSessionsWhere(absl::FunctionRef<bool(const Session&)> end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<SessionId> ending;
    for (const auto& [id, s] : sessions_) {
      if (end(s)) ending.push_back(id);
    }
    for (SessionId id : ending) EndSession(id);
    return static_cast<int>(ending.size());
  }

  SessionRelease EndSession(SessionId session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = sessions_.find(session);
    SessionRelease rel;
    for (PinId p : it->second.pins) {
      auto pit = pins_.find(p);
      if (pit != pins_.end()) {
        ReleasePin(pit);
        ++rel.pins_released;
      }
    }
    for (ReservationId r : it->second.reservations) {
      if (EndReservation(r)) ++rel.reservations_aborted;
    }
    if (!it->second.peer.empty()) {
      auto p = peer_sessions_.find(it->second.peer);
      if (p != peer_sessions_.end() && --p->second == 0)
        peer_sessions_.erase(p);
    }
    sessions_.erase(it);
    return rel;
  }

  uint32_t ReleasePin(absl::flat_hash_map<PinId, Pin>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint32_t n = static_cast<uint32_t>(it->second.entries.size());
    for (BlockEntry* e : it->second.entries) index_.Unpin(e);
    pins_active_ -= n;
    if (it->second.charged != 0) {  // handed over: counted there until now
      auto s = sessions_.find(it->second.charged);
      if (s != sessions_.end()) s->second.pinned_blocks -= n;
    }
    pins_.erase(it);
    return n;
  }

  // Aborts a reservation: frees its slots now, or when its last SlotHandle
  // goes. Returns false if it did not exist.
  bool EndReservation(ReservationId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = reservations_.find(id);
    if (it == reservations_.end() || it->second.doomed) return false;
    reserved_bytes_ -= it->second.bytes;
    // Its blocks will not be published: the quota is free for others now,
    // even while a SlotHandle still holds a slot's memory.
    NamespaceById(it->second.ns_id)->charged.fetch_sub(it->second.charged);
    it->second.charged = 0;
    if (it->second.busy > 0) {
      it->second.doomed = true;
    } else {
      FreeSlots(it->second);
      reservations_.erase(it);
    }
    return true;
  }

  // ---- admin -------------------------------------------------------------

  absl::StatusOr<BlockDetails> Inspect(absl::string_view ns,
                                       absl::string_view key) override {
    RETURN_IF_ERROR(ValidateNamespace(ns));
    RETURN_IF_ERROR(ValidateKey(key));
    BlockDetails d;
    if (const NamespaceRef info = FindNamespace(ns)) {
      char stamp[kStampBytes];
      if (std::optional<BlockEntry> e =
              index_.Peek(BlockIndex::MakeKey(info->id, key), absl::MakeSpan(stamp))) {
        d.in_dram = true;
        d.size = e->size;
        d.checksum = e->checksum;
        d.pins = e->pins;
        d.cached_children = e->children;
        d.dram_reads = e->reads;
        int64_t ms = 0;
        std::memcpy(&ms, stamp, kStampBytes);
        d.age = std::max(absl::ZeroDuration(),
                         clock_->Now() - absl::FromUnixMillis(ms));
      }
    }
    if (nvme_ != nullptr) {
      if (absl::StatusOr<NvmeBlockMeta> meta = nvme_->Meta(ns, key); meta.ok()) {
        d.in_nvme = true;
        if (!d.in_dram) {
          d.size = meta->size;
          d.checksum = meta->checksum;
        }
        d.nvme_reads = meta->read_count;
        d.parent = std::move(meta->parent);
      }
    }
    if (!d.in_dram && !d.in_nvme) {
      return absl::NotFoundError(absl::StrCat("block ", KeyToHex(key),
                                              " is not in namespace ", ns));
    }
    return d;
  }

  absl::Status SetQuota(absl::string_view ns, uint64_t max_bytes) override {
    RETURN_IF_ERROR(ValidateNamespace(ns));
    ASSIGN_OR_RETURN(const NamespaceRef info,
                     NamespaceIdFor(ns, NamespaceUse::kDeclared));
    info->quota.store(max_bytes);
    return absl::OkStatus();
  }

  absl::Status Undeclare(absl::string_view ns) override {
    RETURN_IF_ERROR(ValidateNamespace(ns));
    std::vector<NamespaceCandidate> empty;
    {
      absl::MutexLock lock(&ns_mu_);
      auto it = ns_ids_.find(ns);
      if (it == ns_ids_.end()) return absl::OkStatus();
      NamespaceInfo& info = *namespaces_[it->second - 1];
      info.quota.store(0);
      info.declared.store(false);
      if (Unreferenced(info)) empty.push_back({info.id, info.stamp, info.name});
    }
    // An empty one goes now: a put into it is then refused again when
    // create_namespaces is off, as before it was declared.
    if (!empty.empty()) ForgetNamespaces(empty);
    return absl::OkStatus();
  }

  uint64_t Quota(absl::string_view ns) override {
    const NamespaceRef info = FindNamespace(ns);
    return info ? info->quota.load() : 0;
  }

  // Charges `bytes` of blocks about to enter DRAM (a put's or promotion's)
  // to the namespace (NamespaceInfo::charged), first evicting its least
  // recently used unpinned blocks until they fit in its quota, if it has
  // one. The check and the charge are one compare-and-swap: two callers
  // cannot both take the last room. ResourceExhausted when eviction cannot
  // make room (nothing is charged then; what was evicted stays evicted).
  // With `would_wait` (a caller that must not block) and an NVMe tier,
  // where room must be made (a demotion writes to NVMe): Unavailable,
  // *would_wait set, nothing evicted or charged.
  absl::Status ChargeQuota(NamespaceInfo& info, uint64_t bytes,
                           bool* would_wait = nullptr) {
    const uint64_t quota = info.quota.load();
    if (quota == 0) {
      info.charged.fetch_add(bytes);
      return absl::OkStatus();
    }
    if (bytes > quota) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "batch of ", bytes, " bytes exceeds namespace ", info.name,
          "'s quota of ", quota, " bytes"));
    }
    uint64_t charged = info.charged.load();
    while (true) {
      if (charged + bytes <= quota) {
        if (info.charged.compare_exchange_weak(charged, charged + bytes)) {
          return absl::OkStatus();
        }
        continue;  // `charged` reloaded: another put or eviction won
      }
      if (would_wait != nullptr && nvme_ != nullptr) {
        *would_wait = true;
        return absl::UnavailableError(
            absl::StrCat("namespace ", info.name,
                         " is at its quota: making room demotes "
                         "blocks to NVMe, which waits"));
      }
      // A block a lookup pinned while it was demoted stays: look again.
      if (!EvictOne(/*demote=*/true, /*freed=*/nullptr, info.id)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "namespace ", info.name, " holds ", charged, " of its quota of ",
            quota, " bytes in blocks that cannot be evicted (pinned, parents of "
            "cached blocks, or puts and promotions in flight); unpin or raise "
            "the quota"));
      }
      charged = info.charged.load();
    }
  }

  // ---- lookup phases -----------------------------------------------------

  // A lookup between its pass over DRAM and its answer. Blocks found in DRAM
  // are pinned already (when asked); blocks only on NVMe that a pinned lookup
  // must promote are listed in `promote`.
  struct LookupPlan {
    struct Promotion {
      size_t index;  // into entries
      std::string key;
    };
    SessionId session = kInternalSession;
    std::string ns;
    NamespaceRef info;  // empty while the namespace is unknown
    bool prefix = false, pin = false;
    bool count = true;  // in the lookup and hit statistics
    uint32_t seq = 0;
    std::vector<LookupEntry> entries;  // found ones filled in
    std::vector<BlockEntry*> pinned;   // per key: the pinned entry, if any
    std::vector<Promotion> promote;
    // A pinned lookup's keys named earlier in it: (index, index of its
    // first mention). Looked up (and pinned) once, answered as the first.
    std::vector<std::pair<size_t, size_t>> repeats;
    // Counted in planned_pins_ (and, for a session, in its
    // Session::planned_pins) until FinishLookup.
    uint64_t planned_pins = 0;
  };

  // Validates, then looks every key up in DRAM (pinning with `pin`) and, for
  // the others, in the NVMe tier's index (no disk access).
  absl::StatusOr<LookupPlan> PlanLookup(
      SessionId session, absl::string_view ns,
      absl::Span<const absl::string_view> keys, bool prefix, bool pin,
      bool count) {
    RETURN_IF_ERROR(ValidateNamespace(ns));
    RETURN_IF_ERROR(CheckBatch(keys.size()));
    for (absl::string_view k : keys) RETURN_IF_ERROR(ValidateKey(k));
    LookupPlan plan;
    // A pinned lookup pins a key named twice once (two pins of one block in
    // one pin would be one reference to the client, and let one lookup
    // raise a block's pin count by max_batch_keys).
    std::vector<bool> repeated;  // by index: in plan.repeats
    if (pin) {
      plan.repeats = RepeatedKeys(keys.size(), [&](size_t k) { return keys[k]; });
      if (!plan.repeats.empty()) repeated.resize(keys.size(), false);
      for (const auto& [i, first] : plan.repeats) repeated[i] = true;
    }
    if (pin) {
      const uint64_t n = keys.size() - plan.repeats.size();  // distinct keys
      absl::MutexLock lock(&mu_);
      Session* s = nullptr;
      if (session != kInternalSession) {
        ASSIGN_OR_RETURN(s, LiveSession(session));
        if (s->pins.size() >= options_.max_pins_per_session) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "session ", session, " holds ", s->pins.size(),
              " pins, the limit (max_pins_per_session); unpin some first"));
        }
        if (s->pinned_blocks + s->planned_pins + n >
            options_.max_pinned_blocks_per_session) {
          const std::string in_flight =
              s->planned_pins == 0
                  ? std::string()
                  : absl::StrCat(" and pinned lookups of ", s->planned_pins,
                                 " keys in flight");
          return absl::ResourceExhaustedError(absl::StrCat(
              "session ", session, " holds ", s->pinned_blocks, " pinned blocks",
              in_flight, "; pinning ", n, " more would pass the limit of ",
              options_.max_pinned_blocks_per_session, "; unpin some first"));
        }
      }
      // All sessions' pins together, and in-process callers': each pin and
      // each reference costs heap (and 2^32 of one block would wrap its
      // count).
      // In-process callers' pins (a gRPC Read stream holds one at a time,
      // bounded by the streams) are not refused by it: clients holding
      // max_pins would otherwise stop every Read.
      if (session != kInternalSession && pins_.size() >= options_.max_pins) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the store holds ", pins_.size(),
            " pins, the limit for all sessions (max_pins); unpin some first"));
      }
      if (pins_active_ + planned_pins_ + n > options_.max_pinned_blocks) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the store holds ", pins_active_, " pinned blocks and pinned lookups of ",
            planned_pins_, " keys in flight; pinning ", n,
            " more would pass the limit of ", options_.max_pinned_blocks,
            " for all sessions; unpin some first"));
      }
      // Given back by FinishLookup; nothing below fails before it runs.
      if (s != nullptr) s->planned_pins += n;
      planned_pins_ += n;
      plan.planned_pins = n;
    }
    plan.session = session;
    plan.prefix = prefix;
    plan.pin = pin;
    plan.count = count;
    plan.entries.resize(keys.size());
    plan.pinned.resize(keys.size(), nullptr);
    plan.info = FindNamespace(ns);
    if (count) lookup_keys_.fetch_add(keys.size(), std::memory_order_relaxed);
    if (!plan.info && nvme_ == nullptr) return plan;
    if (plan.info && count) {
      plan.info->lookups.fetch_add(keys.size(), std::memory_order_relaxed);
    }
    plan.seq = index_.NextSeq();
    for (size_t i = 0; i < keys.size(); ++i) {
      // Answered as its first mention, which a prefix lookup found (or is
      // promoting) if it got here.
      if (!repeated.empty() && repeated[i]) continue;
      std::optional<BlockIndex::Hit> hit;
      if (plan.info) {
        hit = index_.Find(BlockIndex::MakeKey(plan.info->id, keys[i]), pin, plan.seq);
      }
      if (hit) {
        plan.entries[i] = LookupEntry{true, Tier::kDram, hit->size, hit->checksum,
                                      hit->data_offset};
        if (pin) plan.pinned[i] = hit->entry;
        continue;
      }
      if (nvme_ != nullptr) {
        // Not in DRAM: the NVMe tier. A plain lookup reports it there; a
        // pinned one promotes it first, so the pin covers DRAM bytes.
        if (pin) {
          if (nvme_->Contains(ns, keys[i])) {
            // Until a promotion fills the entry in (replacing it whole),
            // a miss that says the block is on NVMe.
            plan.entries[i].on_nvme = true;
            if (QueuePromotion()) {
              plan.promote.push_back({i, std::string(keys[i])});
              continue;
            }
            promotions_shed_.fetch_add(1, std::memory_order_relaxed);
          }
        } else if (absl::StatusOr<NvmeBlockMeta> meta = nvme_->Meta(ns, keys[i]);
                   meta.ok()) {
          plan.entries[i] = LookupEntry{true, Tier::kNvme, meta->size,
                                        meta->checksum, 0};
          continue;
        }
      }
      if (prefix) break;  // the rest stay misses
    }
    if (plan.promote.empty()) return plan;
    plan.ns = std::string(ns);
    // While it waits, the lookup keeps planned only the pins it can take:
    // its DRAM hits and its promotions.
    uint64_t can_pin = plan.promote.size();
    for (BlockEntry* e : plan.pinned) can_pin += e != nullptr;
    if (plan.planned_pins > can_pin) {
      const uint64_t unneeded = plan.planned_pins - can_pin;
      absl::MutexLock lock(&mu_);
      planned_pins_ -= std::min(planned_pins_, unneeded);
      auto s = sessions_.find(session);
      if (session != kInternalSession && s != sessions_.end()) {
        s->second.planned_pins -= std::min(s->second.planned_pins, unneeded);
      }
      plan.planned_pins = can_pin;
    }
    return plan;
  }

  // Takes a place in the promotion queue (max_queued_promotions) for one
  // block; false when it is full. PromoteBatch gives the places back.
  bool QueuePromotion() {
    if (queued_promotions_.fetch_add(1, std::memory_order_relaxed) <
        options_.max_queued_promotions) {
      return true;
    }
    queued_promotions_.fetch_sub(1, std::memory_order_relaxed);
    return false;
  }

  // Reads plan.promote's blocks from NVMe into new DRAM slots with one
  // batched read and publishes them pinned. A promotion makes room in the
  // namespace's quota as a put does (ChargeQuota). Blocks that cannot be
  // promoted (gone, failing their checksum, no room in DRAM or in the
  // quota) stay misses. Runs on a promotion thread: it may wait for the disk
  // and for the evictor.
  void PromoteBatch(LookupPlan& plan) {
    absl::Cleanup dequeue = [&] {
      queued_promotions_.fetch_sub(plan.promote.size(), std::memory_order_relaxed);
    };
    if (!plan.info) {
      absl::StatusOr<NamespaceRef> ref = NamespaceIdFor(plan.ns, NamespaceUse::kStored);
      if (!ref.ok()) return;
      plan.info = *std::move(ref);
    }
    NamespaceInfo& info = *plan.info;
    absl::ReaderMutexLock no_evict(&EvictStripe(plan.ns));
    struct Pending {
      const LookupPlan::Promotion* promotion;
      Slot slot;
      // What MultiRead verified the bytes against (the block may have been
      // replaced on NVMe since Meta: what is published is what was read).
      uint64_t checksum = 0;
    };
    std::vector<Pending> pending;
    pending.reserve(plan.promote.size());
    for (const LookupPlan::Promotion& p : plan.promote) {
      absl::StatusOr<NvmeBlockMeta> meta = nvme_->Meta(plan.ns, p.key);
      if (!meta.ok()) continue;  // evicted meanwhile
      // Pinned blocks, and this batch's earlier promotions, hold the quota:
      // a smaller block may still fit.
      if (!ChargeQuota(info, meta->size).ok()) continue;
      Pending& q = pending.emplace_back();
      q.promotion = &p;
      q.slot.key = p.key;
      q.slot.parent = std::move(meta->parent);
      q.slot.size = meta->size;
      // DRAM full of pinned and reserved blocks: a miss at once. Waiting
      // for room, as AllocateSlot does, would have the evictor demote every
      // unpinned block first, for nothing where no eviction can make room
      // (BeginPut checks the same before it allocates).
      if (!CheckRoom(SlotAllocationSize(q.slot)).ok() ||
          !AllocateSlot(q.slot).ok()) {
        info.charged.fetch_sub(q.slot.size);
        pending.pop_back();
        break;
      }
    }
    std::vector<NvmeReadRequest> reads;
    reads.reserve(pending.size());
    for (Pending& q : pending) {
      // A block replaced by one of another size since Meta fails the read
      // (its destination's size is wrong) and is not promoted.
      reads.push_back({q.slot.key,
                       absl::Span<char>(arena_->base() + q.slot.data_offset,
                                        q.slot.size),
                       &q.checksum});
    }
    std::vector<absl::Status> results = nvme_->MultiRead(plan.ns, reads);
    for (size_t j = 0; j < pending.size(); ++j) {
      Pending& q = pending[j];
      const size_t i = q.promotion->index;
      if (!results[j].ok()) {  // counted by the tier when corrupt
        FreeSlot(q.slot);
        info.charged.fetch_sub(q.slot.size);
        continue;
      }
      if (BlockEntry* e = Publish(info, q.slot, q.checksum, plan.seq, /*pinned=*/true)) {
        // Read into DRAM, whether or not FinishLookup answers it (after a
        // prefix lookup's first miss it stays in DRAM, unpinned).
        promotions_.fetch_add(1, std::memory_order_relaxed);
        plan.pinned[i] = e;
        plan.entries[i] = LookupEntry{true, Tier::kDram, q.slot.size, q.checksum,
                                      q.slot.data_offset, /*promoted=*/true};
        continue;
      }
      // Promoted meanwhile by another lookup: use that copy.
      FreeSlot(q.slot);
      info.charged.fetch_sub(q.slot.size);
      if (std::optional<BlockIndex::Hit> hit = index_.Find(
              BlockIndex::MakeKey(info.id, q.slot.key), /*pin=*/true, plan.seq)) {
        plan.pinned[i] = hit->entry;
        plan.entries[i] = LookupEntry{true, Tier::kDram, hit->size, hit->checksum,
                                      hit->data_offset};
      }
    }
  }

  // Turns a plan into the answer: applies the prefix rule (with `prefix`,
  // nothing after the first miss is found or stays pinned), counts, and
  // registers the pin with the session.
  absl::StatusOr<LookupResult> FinishLookup(LookupPlan& plan) {
    LookupResult result;
    result.entries = std::move(plan.entries);
    // A repeated key's answer is its first mention's; the pin is that one's.
    for (const auto& [i, first] : plan.repeats) {
      result.entries[i] = result.entries[first];
    }
    std::vector<BlockEntry*> pinned;
    bool prefix_open = true;
    // Hits by the tier that held the block when it was looked up (a
    // promoted block's is NVMe): counted here, for the answers only, so
    // that they add up to lookup_hits.
    uint64_t hits = 0, dram_hits = 0, nvme_hits = 0;
    for (size_t i = 0; i < result.entries.size(); ++i) {
      LookupEntry& e = result.entries[i];
      if (!e.found || (plan.prefix && !prefix_open)) {
        if (plan.pinned[i] != nullptr) index_.Unpin(plan.pinned[i]);
        // A promotion that did not happen: said so (a miss all the same).
        const bool on_nvme =
            !e.found && (!plan.prefix || prefix_open) && e.on_nvme;
        e = LookupEntry{};
        e.on_nvme = on_nvme;
        prefix_open = false;
        continue;
      }
      ++hits;
      if (prefix_open) ++result.prefix_hits;
      if (e.promoted || e.tier == Tier::kNvme) {
        ++nvme_hits;
      } else {
        ++dram_hits;
      }
      if (plan.pinned[i] != nullptr) pinned.push_back(plan.pinned[i]);
    }
    result.namespace_known = static_cast<bool>(plan.info) || hits > 0;
    if (plan.count) {
      lookup_hits_.fetch_add(hits, std::memory_order_relaxed);
      dram_hits_.fetch_add(dram_hits, std::memory_order_relaxed);
      nvme_hits_.fetch_add(nvme_hits, std::memory_order_relaxed);
      if (plan.info) plan.info->hits.fetch_add(hits, std::memory_order_relaxed);
    }
    if (pinned.empty() && plan.planned_pins == 0) return result;
    absl::MutexLock lock(&mu_);
    // The planned pins become the real ones (at most as many).
    planned_pins_ -= std::min(planned_pins_, plan.planned_pins);
    const uint64_t planned = std::exchange(plan.planned_pins, 0);
    Session* s = nullptr;
    if (plan.session != kInternalSession) {
      auto it = sessions_.find(plan.session);
      if (it != sessions_.end()) {
        it->second.planned_pins -= std::min(it->second.planned_pins, planned);
      }
      absl::StatusOr<Session*> live = LiveSession(plan.session);
      if (!live.ok()) {
        if (pinned.empty()) return result;
        // The session ended (or expired) while we looked: give the pins
        // back.
        for (BlockEntry* e : pinned) index_.Unpin(e);
        return live.status();
      }
      s = *live;
    }
    if (pinned.empty()) return result;
    PinId id = NewId();
    pins_active_ += pinned.size();
    if (s) {
      s->pins.insert(id);
      s->pinned_blocks += pinned.size();
    }
    pins_.emplace(id, Pin{plan.session, std::move(pinned)});
    result.pin_id = id;
    return result;
  }

  // ---- arena space -------------------------------------------------------

  // Allocates the key and data space of a slot, evicting as needed.
  // On failure nothing stays allocated and `slot` is unchanged.
  // The key's allocation also holds when the block entered DRAM (Unix ms,
  // kStampBytes after the key; free for keys up to 56 bytes, which share the
  // 64-byte size class).
  // `would_wait`: see BeginPut. `need`: the arena space its batch has still
  // to allocate, this slot's included (0: only this slot's); see
  // AllocateEvicting.
  absl::Status AllocateSlot(Slot& slot, bool* would_wait = nullptr,
                            uint64_t need = 0) {
    need = std::max<uint64_t>(need, SlotAllocationSize(slot));
    const uint64_t data_bytes = DataAllocationBytes(slot);
    ASSIGN_OR_RETURN(uint64_t data,
                     AllocateEvicting(data_bytes, would_wait, need));
    absl::StatusOr<uint64_t> key =
        AllocateEvicting(KeyAllocationBytes(slot), would_wait,
                         need - DramArena::AllocationSize(data_bytes));
    if (!key.ok()) {
      arena_->Free(data);
      return key.status();
    }
    slot.data_offset = data;
    slot.key_offset = *key;
    char* k = arena_->base() + slot.key_offset;
    std::memcpy(k, slot.key.data(), slot.key.size());
    const int64_t stamp = absl::ToUnixMillis(clock_->Now());
    std::memcpy(k + slot.key.size(), &stamp, kStampBytes);
    return absl::OkStatus();
  }

  // With an NVMe tier and the background evictor, a put that finds DRAM
  // full waits for the evictor to demote room instead of dropping blocks
  // that NVMe would have kept; demotion never runs on the caller's thread.
  // The round it asks for demotes past the low watermark if need be, until
  // `bytes` fit in one free piece and `need` in the free space (see
  // EvictToLowWatermark): a block bigger than the low watermark's room, or
  // a fragmented arena, is no reason to drop blocks.
  // It tries again as soon as the evictor moved any block out (a round
  // down to the low watermark takes far longer than the one demotion its
  // block may need), and waits again while others took that room first
  // (many puts of one block each, as UCX data requests make, dropped blocks
  // after one round), for kMaxWaitForRoom at most (room_wait_timeouts_);
  // room freed otherwise meanwhile (an Evict) counts too. Without them, or when
  // a round freed nothing (nothing was evictable) or the time is up, it tries
  // once more and then evicts (drops) synchronously. With `would_wait`, the
  // wait is not made: Unavailable, *would_wait set. `need` is the arena space
  // the caller's batch has still to allocate, these `bytes` included: once the
  // free space and every block no one holds pinned could not hold it
  // (CheckRoom), it drops nothing more and fails (waiting, above, still goes
  // on: pins and reservations end). That bound ignores fragmentation: when the
  // free space is enough in sum but not in one piece that fits, dropping
  // stops once it has freed `need` without a fit and no run of pages free of
  // pinned and reserved blocks is long enough (CouldFitOnceEvicted), rather
  // than after dropping every evictable block. (The evictor's forced round,
  // which demotes, is not bounded so: demoted blocks are not lost.)
  absl::StatusOr<uint64_t> AllocateEvicting(uint64_t bytes,
                                            bool* would_wait = nullptr,
                                            uint64_t need = 0) {
    need = std::max(need, bytes);
    absl::Time wait_until = absl::InfinitePast();
    bool waiting = WaitsForRoom();
    // Where dropping blocks began (allocated bytes then), for the
    // fragmentation check below.
    std::optional<uint64_t> dropping_from;
    while (true) {
      absl::StatusOr<uint64_t> off = arena_->Allocate(bytes);
      if (off.ok()) {
        MaybeWakeEvictor();
        return off;
      }
      if (waiting) {
        if (would_wait != nullptr) {
          *would_wait = true;
          MaybeWakeEvictor();
          return absl::UnavailableError(
              "DRAM tier full: making room waits for the evictor");
        }
        if (wait_until == absl::InfinitePast()) {
          wait_until = absl::Now() + kMaxWaitForRoom;
        }
        const uint64_t evicted = evictions_.load(std::memory_order_relaxed);
        const size_t used = arena_->allocated_bytes();
        const bool woken = WaitForEvictor(wait_until, RoomWanted{need, bytes});
        if (woken && (evictions_.load(std::memory_order_relaxed) != evicted ||
                      arena_->allocated_bytes() < used)) {
          continue;  // room was freed: wait again if others took it
        }
        if (!woken && absl::Now() >= wait_until) {
          room_wait_timeouts_.fetch_add(1, std::memory_order_relaxed);
        }
        // Nothing was freed (or the wait is over): try once more, then make
        // room here.
        waiting = false;
        continue;
      }
      // Dropping blocks that cannot make room would only lose them.
      RETURN_IF_ERROR(CheckRoom(need));
      // Room in sum, but maybe not in one piece (blocks no one can evict
      // scattered through the arena): once dropping has freed as much as
      // is needed and the piece still does not fit, ask whether any
      // eviction can make one, rather than drop every block first.
      const uint64_t used = arena_->allocated_bytes();
      if (!dropping_from.has_value()) {
        dropping_from = used;
      } else if (*dropping_from > used && *dropping_from - used >= need) {
        if (!CouldFitOnceEvicted(bytes)) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "DRAM tier fragmented: no run of pages for ", bytes,
              " bytes can be freed (pinned or reserved blocks lie in every "
              "one); ",
              arena_->capacity() - std::min<uint64_t>(used, arena_->capacity()),
              " bytes are free in smaller pieces"));
        }
        dropping_from = used;  // asked again after as much more
      }
      if (!EvictOne()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "DRAM tier full: no room for ", bytes, " bytes and nothing "
            "evictable (", arena_->allocated_bytes(), " of ",
            arena_->capacity(), " bytes pinned, reserved or fragmented)"));
      }
    }
  }

  // Whether evicting every block no caller holds (pinned, or in an open
  // reservation) could leave a piece where `bytes` fit
  // (DramArena::CouldFitAvoiding). Allocations of a batch still being
  // reserved, and slots between commit and publication, are not known
  // here: it may say yes where the answer is no (and then evicting goes
  // on, as before this check). O(blocks).
  bool CouldFitOnceEvicted(uint64_t bytes) {
    std::vector<uint64_t> held;
    index_.AppendHeldOffsets(&held);
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, r] : reservations_) {
        for (const Slot& slot : r.slots) {
          if (slot.exists) continue;  // nothing allocated for it
          held.push_back(slot.data_offset);
          held.push_back(slot.key_offset);
        }
      }
    }
    return arena_->CouldFitAvoiding(bytes, held);
  }

  // Whether a put that finds DRAM full waits for the evictor to demote room
  // (see AllocateEvicting) rather than dropping blocks at once.
  bool WaitsForRoom() const { return nvme_ != nullptr && evictor_.joinable(); }

  // Polls CheckRoom(need) (1 ms, then up to 50 ms apart) until it passes,
  // for kMaxWaitForRoom at most: pins and reservations end, and what they
  // held becomes free or evictable. Its error when the time is up.
  absl::Status WaitUntilRoomIsPossible(uint64_t need) {
    const absl::Time until = absl::Now() + kMaxWaitForRoom;
    absl::Duration pause = absl::Milliseconds(1);
    while (true) {
      absl::Status room = CheckRoom(need);
      if (room.ok() || absl::Now() >= until) return room;
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(50));
    }
  }

  // ResourceExhausted when max_namespaces are in use (so a put into a new
  // namespace could not create it).
  // Reclaims empty namespaces first if need be (ReclaimNamespaces).
  absl::Status RoomForANamespace() {
    ReclaimNamespaces();  // returns at once while there is room
    absl::MutexLock lock(&ns_mu_);
    return RoomForANamespaceLocked();
  }
  absl::Status RoomForANamespaceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ns_mu_) {
    if (ns_ids_.size() < options_.max_namespaces) return absl::OkStatus();
    return absl::ResourceExhaustedError(
        absl::StrCat("too many namespaces (", options_.max_namespaces, ")"));
  }

  // ResourceExhausted when `need` bytes of arena space cannot be had however
  // much is evicted: the free space plus the space of the blocks no one
  // holds pinned (BlockIndex::unpinned_bytes) is less. What pins and open
  // reservations hold (and slots being published or promoted) never counts.
  // A necessary condition only: unpinned parents of pinned blocks count,
  // and fragmentation can still leave no piece big enough.
  absl::Status CheckRoom(uint64_t need) {
    const uint64_t cap = arena_->capacity();
    // Slab pages' unusable ends go with the blocks that keep the pages:
    // counted as neither used nor pinned here (an upper bound, as above).
    const uint64_t allocated = arena_->allocated_bytes();
    const uint64_t tails = arena_->slab_tail_bytes();  // read apart
    const uint64_t used =
        std::min<uint64_t>(allocated > tails ? allocated - tails : 0, cap);
    const uint64_t unpinned = index_.unpinned_bytes();
    if (need <= cap - used + unpinned) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        "DRAM tier full: ", need, " bytes needed but only ", cap - used,
        " of ", cap, " are free and ", unpinned,
        " are in unpinned blocks (the rest is pinned or reserved)"));
  }

  // The bytes AllocateSlot asks for the slot's key and stamp.
  static size_t KeyAllocationBytes(const Slot& slot) {
    return slot.key.size() + kStampBytes;
  }

  // The bytes AllocateSlot asks for the slot's data: its size, or the
  // block floor when larger (the slot's bytes, handed to writers, are still
  // its size).
  uint64_t DataAllocationBytes(const Slot& slot) const {
    return std::max<uint64_t>(slot.size, block_floor_);
  }

  // The arena space AllocateSlot takes for `slot` (as reserved_bytes_
  // counts it, and BlockIndex's footprint of its block).
  uint64_t SlotAllocationSize(const Slot& slot) const {
    return DramArena::AllocationSize(DataAllocationBytes(slot)) +
           DramArena::AllocationSize(KeyAllocationBytes(slot));
  }

  void FreeSlot(Slot& slot) {
    arena_->Free(slot.data_offset);
    arena_->Free(slot.key_offset);
  }

  void FreeSlots(ReservationState& r) {
    for (Slot& s : r.slots) {
      if (!s.exists) FreeSlot(s);
    }
  }

  // Frees a block removed from the index; `count_eviction` counts it as an
  // eviction (dram_corrupt_evictions_ for one marked corrupt, else evictions_).
  void FreeEntry(std::unique_ptr<BlockEntry> e, bool count_eviction) {
    // The block keeps its namespace (counted in `blocks`) until the last
    // use of `info` here: once no block is left, the namespace may be
    // reclaimed (ReclaimNamespaces).
    NamespaceInfo* info = NamespaceById(e->ns_id);
    arena_->Free(e->data_offset());
    arena_->Free(e->key_offset());
    if (count_eviction) {
      // One found corrupt (never served since) that leaves as any other.
      ((e->flags & BlockEntry::kCorrupt) ? dram_corrupt_evictions_ : evictions_)
          .fetch_add(1, std::memory_order_relaxed);
    }
    info->bytes.fetch_sub(e->size, std::memory_order_relaxed);
    info->charged.fetch_sub(e->size);
    info->blocks.fetch_sub(1);  // last
  }

  // Evicts the evictable block used longest ago (approximately: the oldest
  // of the shards' least-recent ends). Returns false when there is none.
  // With `demote` (the background evictor, PersistDram) the block is first
  // written to the NVMe tier, staying findable in DRAM until it is there
  // (it stays in DRAM if a lookup pinned it meanwhile); a put waiting for
  // room drops it instead. Sets *freed (if given) to whether the block left
  // DRAM: true unless it stayed, pinned. With `ns_id`, namespace ns_id's
  // block (a quota's eviction, on the caller's thread: the quota bounds the
  // namespace's DRAM, not what it keeps, so it demotes too).
  bool EvictOne(bool demote = false, bool* freed = nullptr,
                uint32_t ns_id = BlockIndex::kAllNamespaces) {
    if (freed != nullptr) *freed = false;
    if (!demote || nvme_ == nullptr) {
      std::unique_ptr<BlockEntry> e = index_.PopOldestEvictableOf(ns_id);
      if (!e) return false;
      FreeEntry(std::move(e), /*count_eviction=*/true);
      if (freed != nullptr) *freed = true;
      return true;
    }
    std::optional<BlockIndex::Demotion> d = index_.BeginDemotion(ns_id);
    if (!d) return false;
    Demote(*d);
    std::unique_ptr<BlockEntry> e = index_.EndDemotion(d->entry);
    if (e) {
      FreeEntry(std::move(e), /*count_eviction=*/true);
      if (freed != nullptr) *freed = true;
    }
    absl::MutexLock lock(&demote_mu_);
    ++demotions_ended_;
    return true;
  }

  // Writes a block leaving DRAM to the NVMe tier with its parent key (empty
  // when its parent was not cached in DRAM when it was linked), so that the
  // tier's eviction keeps prefixes and a promotion relinks the chain. The
  // entry's bytes and key stay put while it is pinned for the demotion.
  void Demote(const BlockIndex::Demotion& d) {
    // Found bad by a reader (counted then): not written, it just leaves.
    if (index_.IsCorrupt(d.entry)) return;
    if (d.reads < options_.nvme_admit_min_reads) {
      demotions_skipped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const BlockEntry& e = *d.entry;
    const char* base = arena_->base();
    NamespaceInfo* info = NamespaceById(e.ns_id);
    absl::StatusOr<NvmePutOutcome> r = nvme_->Put(
        info->name, absl::string_view(base + e.key_offset(), e.key_len),
        d.parent_key, absl::string_view(base + e.data_offset(), e.size),
        e.checksum);
    // The tier checks the bytes against the checksum before it writes. A
    // mismatch is bytes that changed in DRAM since the put (memory
    // corruption, or a bug): the block leaves DRAM all the same, unwritten.
    if (!r.ok() && r.status().code() == absl::StatusCode::kInvalidArgument &&
        BlockChecksum(base + e.data_offset(), e.size) != e.checksum) {
      // Marked, so that no lookup finds it if one pinned it meanwhile (then
      // it stays, listed for RetryCorruptDrops); counted unless a reader
      // marked it first.
      if (index_.MarkCorrupt(d.entry)) {
        dram_integrity_errors_.fetch_add(1, std::memory_order_relaxed);
        ListCorrupt(info->name,
                    absl::string_view(base + e.key_offset(), e.key_len),
                    e.checksum);
      }
      return;
    }
    // A block NVMe holds already (promoted, then leaving DRAM again) was
    // not written: no demotion.
    if (!r.ok()) {
      demotion_failures_.fetch_add(1, std::memory_order_relaxed);
    } else if (*r == NvmePutOutcome::kStored) {
      demotions_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  uint64_t DemotionsEnded() {
    absl::MutexLock lock(&demote_mu_);
    return demotions_ended_;
  }

  // Waits until a demotion ends after `seen` had (DemotionsEnded), or
  // `deadline`; true when one did.
  bool WaitForDemotions(uint64_t seen, absl::Time deadline) {
    absl::MutexLock lock(&demote_mu_);
    auto ended = [this, seen]() ABSL_SHARED_LOCKS_REQUIRED(demote_mu_) {
      return demotions_ended_ != seen;
    };
    return demote_mu_.AwaitWithDeadline(absl::Condition(&ended), deadline);
  }

  // Inserts a slot's block into the index (put-if-absent), with one pin held
  // by the caller when `pinned`; on success the index owns its space.
  // Returns the entry, or nullptr when the key was already there.
  // REQUIRES: the block is charged to `info` (ChargeQuota); it keeps the
  // charge when published.
  BlockEntry* Publish(NamespaceInfo& info, const Slot& slot, uint64_t checksum,
                      uint32_t seq, bool pinned = false) {
    auto entry = std::make_unique<BlockEntry>();
    entry->hash = BlockIndex::Hash(info.id, slot.key);
    entry->checksum = checksum;
    entry->data_unit = static_cast<uint32_t>(slot.data_offset / 64);
    entry->key_unit = static_cast<uint32_t>(slot.key_offset / 64);
    entry->size = static_cast<uint32_t>(slot.size);
    entry->ns_id = info.id;
    entry->key_len = static_cast<uint16_t>(slot.key.size());
    entry->seq = seq;
    BlockEntry* published = entry.get();
    // Counted before the insert: once inserted the block is evictable, and
    // its eviction (FreeEntry) must not subtract it first, wrapping the
    // counters around.
    info.blocks.fetch_add(1, std::memory_order_relaxed);
    info.bytes.fetch_add(slot.size, std::memory_order_relaxed);
    if (index_.Insert(std::move(entry), slot.parent, pinned) != nullptr) {
      info.blocks.fetch_sub(1, std::memory_order_relaxed);
      info.bytes.fetch_sub(slot.size, std::memory_order_relaxed);
      return nullptr;
    }
    return published;
  }

  void MaybeWakeEvictor() {
    if (!evictor_.joinable()) return;
    uint64_t high = static_cast<uint64_t>(options_.high_watermark *
                                          arena_->capacity());
    if (arena_->allocated_bytes() > high) {
      absl::MutexLock lock(&evict_mu_);
      evict_wanted_ = true;
    }
  }

  // Asks the evictor for a forced round that makes room for `wanted` too
  // (with that of the other puts asking for it), and waits until an evictor
  // round that starts after this call has ended, or `deadline`; true when
  // one did.
  bool WaitForEvictor(absl::Time deadline, RoomWanted wanted) {
    absl::MutexLock lock(&evict_mu_);
    const uint64_t target = rounds_started_ + 1;
    const uint64_t room_made = room_made_;
    pressure_ = true;
    room_wanted_.space += wanted.space;
    room_wanted_.largest = std::max(room_wanted_.largest, wanted.largest);
    // Round `target` is the first to start after pressure_ was set, so it
    // is the one that sees it. A block any round moves out of DRAM
    // meanwhile ends the wait too: the caller's block may fit now, and a
    // round down to the low watermark takes far longer than one demotion.
    auto done = [this, target,
                 room_made]() ABSL_SHARED_LOCKS_REQUIRED(evict_mu_) {
      return stop_ || rounds_done_ >= target || room_made_ != room_made;
    };
    return evict_mu_.AwaitWithDeadline(absl::Condition(&done), deadline) &&
           !stop_;
  }

  void EvictorLoop() {
    while (true) {
      bool force;
      RoomWanted wanted;
      {
        absl::MutexLock lock(&evict_mu_);
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(evict_mu_) {
          return stop_ || evict_wanted_ || pressure_;
        };
        evict_mu_.AwaitWithTimeout(absl::Condition(&ready),
                                   absl::Milliseconds(200));
        if (stop_) return;
        evict_wanted_ = false;
        force = std::exchange(pressure_, false);
        wanted = std::exchange(room_wanted_, RoomWanted{});
        ++rounds_started_;
      }
      EvictToLowWatermark(force, wanted);
      absl::MutexLock lock(&evict_mu_);
      ++rounds_done_;
    }
  }

  // ---- namespaces --------------------------------------------------------

  // Takes a hold on a namespace of the table (see NamespaceRef).
  NamespaceRef TakeRef(NamespaceInfo* info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ns_mu_) {
    info->stamp = ++ns_stamp_;
    return NamespaceRef(info);
  }

  // The namespace named `ns`, held; empty when there is none.
  NamespaceRef FindNamespace(absl::string_view ns) {
    absl::MutexLock lock(&ns_mu_);
    auto it = ns_ids_.find(ns);
    if (it == ns_ids_.end()) return NamespaceRef();
    return TakeRef(namespaces_[it->second - 1].get());
  }

  // REQUIRES: something keeps namespace `id` (a block of it in the index, a
  // reservation of it, a charge, or a NamespaceRef the caller holds).
  NamespaceInfo* NamespaceById(uint32_t id) {
    absl::MutexLock lock(&ns_mu_);
    return namespaces_[id - 1].get();
  }
  // NamespaceById, held. REQUIRES: as NamespaceById.
  NamespaceRef NamespaceByIdRef(uint32_t id) {
    absl::MutexLock lock(&ns_mu_);
    return TakeRef(namespaces_[id - 1].get());
  }

  // Who asks for a namespace: a client's put creates it only when
  // create_namespaces is on; a block of it found on (or read back from)
  // NVMe, or an operator (kDeclared: SetQuota), always does (it exists
  // then). An operator's namespace is never reclaimed (until Undeclare).
  enum class NamespaceUse { kClientPut, kStored, kDeclared };

  // The namespace named `ns`, held, created if `use` allows. When
  // max_namespaces exist, empty ones are reclaimed first (ReclaimNamespaces);
  // ResourceExhausted when none is.
  absl::StatusOr<NamespaceRef> NamespaceIdFor(absl::string_view ns,
                                              NamespaceUse use) {
    for (bool reclaimed = false;; reclaimed = true) {
      {
        absl::MutexLock lock(&ns_mu_);
        auto it = ns_ids_.find(ns);
        if (it != ns_ids_.end()) {
          NamespaceInfo* info = namespaces_[it->second - 1].get();
          if (use == NamespaceUse::kDeclared) info->declared.store(true);
          return TakeRef(info);
        }
        if (use == NamespaceUse::kClientPut && !options_.create_namespaces) {
          // FAILED_PRECONDITION, not NOT_FOUND: a whole request's NOT_FOUND
          // tells a client that its session is gone.
          return absl::FailedPreconditionError(absl::StrCat(
              "namespace ", ns, " does not exist and create_namespaces is off "
              "(an operator creates it by setting its quota)"));
        }
        if (absl::Status room = RoomForANamespaceLocked(); !room.ok()) {
          if (reclaimed) return room;
        } else {
          // Ids stay dense (at most max_namespaces: BlockIndex keeps a list
          // per id and shard): a reclaimed one is taken first.
          uint32_t id;
          if (!free_ns_ids_.empty()) {
            id = free_ns_ids_.back();
            free_ns_ids_.pop_back();
          } else {
            namespaces_.emplace_back();
            id = static_cast<uint32_t>(namespaces_.size());
          }
          auto info = std::make_unique<NamespaceInfo>();
          info->id = id;
          info->name = std::string(ns);
          info->declared.store(use == NamespaceUse::kDeclared);
          namespaces_[id - 1] = std::move(info);
          ns_ids_.emplace(std::string(ns), id);
          return TakeRef(namespaces_[id - 1].get());
        }
      }
      ReclaimNamespaces();
    }
  }

  // Whether the namespace is one ReclaimNamespaces may forget, as far as its
  // own counters tell: not an operator's, no NamespaceRef held, no block in
  // DRAM (blocks being demoted count), nothing charged (open reservations,
  // promotions in flight). Reservations ended while their slot is still
  // written (doomed) hold no charge: the caller looks at reservations_.
  static bool Unreferenced(const NamespaceInfo& info) {
    return !info.declared.load() && info.quota.load() == 0 &&
           info.uses.load() == 0 && info.blocks.load() == 0 &&
           info.charged.load() == 0;
  }

  // Once max_namespaces exist: forgets every namespace that nothing refers
  // to any more, so that new ones can be created (a client that writes a
  // block into a new namespace, then evicts it, over and over, would
  // otherwise fill the table for good). A namespace goes when it is
  // Unreferenced, no reservation names it (pins hold blocks; promotions and
  // Evicts a NamespaceRef; the BlockIndex's per-namespace lists and orphan
  // records are empty once its blocks are gone) and the NVMe tier has no
  // block of it (it would still exist: ListNamespaces, puts without
  // create_namespaces). Its id may then be given to a new namespace.
  //
  // Two looks: the first (ns_mu_) picks candidates and their stamps; then,
  // with no lock held, one pass over the NVMe tier's index finds those that
  // have blocks there; the second look (mu_, then ns_mu_) forgets the
  // others if their stamp is unchanged: nothing took them meanwhile, so no
  // block of theirs can have entered either tier since the first look (a
  // block enters DRAM through a NamespaceRef, and NVMe only from DRAM).
  // Passes over the NVMe tier's index run one at a time, and start at most
  // kNamespaceScanInterval after the last one ended, whatever it found
  // (each takes the tier's index lock for a while, a second for millions of
  // blocks): a pass forgets every empty namespace at once, so only a client
  // that makes namespaces one after another (a put into a new one, its
  // blocks evicted, again) needs passes more often, and it is refused a new
  // namespace (ResourceExhausted) until the interval is over. A caller that
  // finds a pass running waits for it and takes the room it made.
  void ReclaimNamespaces() ABSL_LOCKS_EXCLUDED(mu_, ns_mu_) {
    std::vector<NamespaceCandidate> candidates;
    {
      absl::MutexLock lock(&ns_mu_);
      if (RoomForANamespaceLocked().ok()) return;  // no wait while there is room
      auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(ns_mu_) {
        return !namespace_scan_running_;
      };
      ns_mu_.Await(absl::Condition(&idle));
      if (RoomForANamespaceLocked().ok()) return;  // another caller made room
      if (nvme_ != nullptr && clock_->Now() < next_namespace_scan_) return;
      for (const auto& info : namespaces_) {
        if (info == nullptr || !Unreferenced(*info)) continue;
        candidates.push_back({info->id, info->stamp, info->name});
      }
      if (candidates.empty()) return;
      namespace_scan_running_ = nvme_ != nullptr;
    }
    ForgetNamespaces(candidates);
    if (nvme_ != nullptr) {
      absl::MutexLock lock(&ns_mu_);
      namespace_scan_running_ = false;
      next_namespace_scan_ = clock_->Now() + kNamespaceScanInterval;
    }
  }

  // A namespace found Unreferenced, as it was then (its stamp).
  struct NamespaceCandidate {
    uint32_t id;
    uint64_t stamp;
    std::string name;
  };
  // Forgets those of `candidates` that nothing took since (same stamp),
  // still Unreferenced, that no reservation names and the NVMe tier has no
  // block of. Returns how many went.
  size_t ForgetNamespaces(const std::vector<NamespaceCandidate>& candidates)
      ABSL_LOCKS_EXCLUDED(mu_, ns_mu_) {
    absl::flat_hash_set<std::string> names;  // of the candidates
    if (nvme_ != nullptr) {
      for (const NamespaceCandidate& c : candidates) names.insert(c.name);
    }
    absl::flat_hash_set<std::string> on_nvme;
    if (nvme_ != nullptr) {
      nvme_->ForEachBlock([&](const NvmeBlockView& b) {
        if (names.contains(b.ns) && !on_nvme.contains(b.ns)) on_nvme.emplace(b.ns);
      });
    }
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<uint32_t> reserved;
    for (const auto& [id, r] : reservations_) reserved.insert(r.ns_id);
    absl::MutexLock ns_lock(&ns_mu_);
    size_t reclaimed = 0;
    for (const NamespaceCandidate& c : candidates) {
      std::unique_ptr<NamespaceInfo>& info = namespaces_[c.id - 1];
      if (info == nullptr || info->stamp != c.stamp || !Unreferenced(*info) ||
          reserved.contains(c.id) || on_nvme.contains(info->name)) {
        continue;
      }
      ns_ids_.erase(info->name);
      info.reset();
      free_ns_ids_.push_back(c.id);
      ++reclaimed;
    }
    return reclaimed;
  }

  // A bad DRAM copy DropCorruptDram kept (corrupt_kept_).
  struct CorruptKept {
    std::string ns;
    std::string key;
    uint64_t checksum;
  };
  enum class CorruptDrop {
    kDropped,     // bad: dropped
    kBusy,        // bad, marked corrupt: pinned by another, or being demoted
    kNotCorrupt,  // not in DRAM, another block, or good
  };
  // DropCorruptDram's step: pins the DRAM entry of `key` (marked corrupt or
  // not), hashes it unless it is marked corrupt already, marks it when it
  // is bad (*found_now: this call marked it), and removes that very entry
  // (RemovePinned) when the pin is its only one. A `retry` (of a kept one)
  // never hashes: an entry not marked is another one stored since (good).
  // Only the DRAM copy goes, so no promotion needs keeping out (as Evict
  // does): one that publishes the NVMe copy afterwards publishes a good one.
  CorruptDrop TryDropCorrupt(absl::string_view ns, absl::string_view key,
                             uint64_t checksum, bool retry, bool* found_now) {
    const NamespaceRef info = FindNamespace(ns);
    if (!info) return CorruptDrop::kNotCorrupt;
    // Pinned from here: its bytes stay put, and no other block can take
    // its key's place in the index.
    BlockEntry* e = index_.PinIfPresent(BlockIndex::MakeKey(info->id, key),
                                        /*even_corrupt=*/true);
    if (e == nullptr) return CorruptDrop::kNotCorrupt;
    auto unpinned = [&](CorruptDrop outcome) {
      index_.Unpin(e);
      return outcome;
    };
    if (e->checksum != checksum) return unpinned(CorruptDrop::kNotCorrupt);
    if (!index_.IsCorrupt(e)) {
      if (retry) return unpinned(CorruptDrop::kNotCorrupt);
      if (BlockChecksum(arena_->base() + e->data_offset(), e->size) ==
          checksum) {
        return unpinned(CorruptDrop::kNotCorrupt);
      }
      // Hidden from lookups from now on, so that readers' pins drain;
      // counted by the caller that marks it.
      *found_now = index_.MarkCorrupt(e);
      if (*found_now)
        dram_integrity_errors_.fetch_add(1, std::memory_order_relaxed);
    }
    if (!DropMarked(e)) return unpinned(CorruptDrop::kBusy);
    return CorruptDrop::kDropped;
  }

  // Removes `e`, marked corrupt and pinned by the caller, and frees it
  // (FreeEntry counts a marked entry as a corrupt eviction), when the
  // caller's pin is its only one and it is not being demoted; false (the
  // caller's pin stays) otherwise.
  bool DropMarked(BlockEntry* e) {
    std::unique_ptr<BlockEntry> removed;
    if (index_.RemovePinned(e, &removed) !=
        BlockIndex::RemoveOutcome::kRemoved) {
      return false;
    }
    FreeEntry(std::move(removed), /*count_eviction=*/true);
    return true;
  }

  // Lists a DRAM copy just marked corrupt for RetryCorruptDrops. Past
  // kMaxCorruptKept the oldest goes unlisted: hidden from lookups all the
  // same, it leaves DRAM when it is evicted (or demoted: not written), or
  // when a put of its key finds it unpinned.
  void ListCorrupt(absl::string_view ns, absl::string_view key,
                   uint64_t checksum) {
    absl::MutexLock lock(&corrupt_mu_);
    if (corrupt_kept_.size() >= kMaxCorruptKept) corrupt_kept_.pop_front();
    corrupt_kept_.push_back(
        CorruptKept{std::string(ns), std::string(key), checksum});
  }

  // Constant after construction.
  const StoreOptions options_;
  Clock* const clock_;
  const std::unique_ptr<DramArena> arena_;
  // The least arena space a block's bytes take (DramBlockFloor): the arena
  // fills, and eviction runs, at dram_max_blocks blocks however small.
  const uint64_t block_floor_;
  BlockIndex index_;
  const std::unique_ptr<NvmeTier> nvme_;  // nullptr: no NVMe tier

  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> demotions_{0}, demotion_failures_{0}, promotions_{0};
  std::atomic<uint64_t> room_wait_timeouts_{0};
  std::atomic<uint64_t> dram_integrity_errors_{0}, dram_corrupt_evictions_{0};
  // Bad DRAM copies kept because they were pinned or being demoted, oldest
  // first (at most kMaxCorruptKept).
  absl::Mutex corrupt_mu_;
  std::deque<CorruptKept> corrupt_kept_ ABSL_GUARDED_BY(corrupt_mu_);
  std::atomic<uint64_t> promotions_shed_{0};
  // Blocks of lookups waiting for PromoteBatch (max_queued_promotions).
  std::atomic<uint64_t> queued_promotions_{0};
  std::atomic<uint64_t> demotions_skipped_{0};
  std::atomic<uint64_t> nvme_hits_{0};
  // Runs pinned lookups that need promotions (NVMe tier only).
  std::unique_ptr<WorkPool> promoter_;
  std::atomic<uint64_t> lookup_keys_{0}, lookup_hits_{0}, dram_hits_{0};
  std::atomic<uint64_t> puts_{0}, put_bytes_{0}, evictions_{0};
  std::atomic<uint64_t> admin_evictions_dram_{0}, admin_evictions_nvme_{0};

  absl::Mutex ns_mu_;
  // Ids are 1-based indexes into namespaces_. An entry is freed (null, its
  // id in free_ns_ids_) only by ReclaimNamespaces, when nothing refers to
  // it: a NamespaceInfo pointer stays valid while a NamespaceRef, a block,
  // a reservation or a charge of its namespace does.
  absl::flat_hash_map<std::string, uint32_t> ns_ids_ ABSL_GUARDED_BY(ns_mu_);
  std::vector<std::unique_ptr<NamespaceInfo>> namespaces_
      ABSL_GUARDED_BY(ns_mu_);
  std::vector<uint32_t> free_ns_ids_ ABSL_GUARDED_BY(ns_mu_);
  uint64_t ns_stamp_ ABSL_GUARDED_BY(ns_mu_) = 0;  // NamespaceInfo::stamp
  // ReclaimNamespaces' pass over the NVMe tier: whether one runs, and when
  // the next may start.
  bool namespace_scan_running_ ABSL_GUARDED_BY(ns_mu_) = false;
  absl::Time next_namespace_scan_ ABSL_GUARDED_BY(ns_mu_) = absl::InfinitePast();

  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions open per peer (Session::peer), for max_sessions_per_peer.
  absl::flat_hash_map<std::string, uint32_t> peer_sessions_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PinId, Pin> pins_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ReservationId, ReservationState> reservations_
      ABSL_GUARDED_BY(mu_);
  // Pin and reservation ids. They start at random in each process, below
  // 2^52 (exact as a JSON number, with room to count up): a client that
  // outlived a restart and releases a pin of the old process must not
  // release another's pin of the same number in this one.
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) =
      absl::Uniform<uint64_t>(absl::BitGen(), 1, uint64_t{1} << 51);
  uint64_t pins_active_ ABSL_GUARDED_BY(mu_) = 0;
  // Block references pinned lookups in flight may add (LookupPlan's
  // planned_pins, all sessions and kInternalSession): with pins_active_,
  // bounded by max_pinned_blocks.
  uint64_t planned_pins_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);

  absl::Mutex evict_mu_;
  bool stop_ ABSL_GUARDED_BY(evict_mu_) = false;
  bool evict_wanted_ ABSL_GUARDED_BY(evict_mu_) = false;
  bool pressure_ ABSL_GUARDED_BY(evict_mu_) = false;  // a put waits for room
  // What the puts waiting since the last round started want room for.
  RoomWanted room_wanted_ ABSL_GUARDED_BY(evict_mu_);
  uint64_t rounds_started_ ABSL_GUARDED_BY(evict_mu_) = 0;
  uint64_t rounds_done_ ABSL_GUARDED_BY(evict_mu_) = 0;
  uint64_t room_made_ ABSL_GUARDED_BY(evict_mu_) = 0;  // see NoteRoomMade
  // Demotions ended (EvictOne), for an Evict waiting for one.
  absl::Mutex demote_mu_;
  uint64_t demotions_ended_ ABSL_GUARDED_BY(demote_mu_) = 0;
  // A promotion holds its namespace's stripe shared from reading the block's
  // NVMe metadata until it publishes the block in DRAM; an admin Evict
  // holds it exclusively. Without it an Evict landing between the two found
  // the block in neither tier's DRAM index, deleted its NVMe copy, and the
  // promotion then put it back in DRAM. Striped by namespace name (a
  // promotion may run before the namespace has an id).
  static constexpr size_t kEvictStripes = 16;
  absl::Mutex evict_stripes_[kEvictStripes];
  std::thread evictor_;

  absl::Mutex& EvictStripe(absl::string_view ns) {
    return evict_stripes_[absl::HashOf(ns) % kEvictStripes];
  }
};

SlotHandleImpl::~SlotHandleImpl() { store_->ReleaseSlot(id_, slot_); }

uint64_t SlotHandleImpl::Checksum() {
  const uint64_t sum = BlockChecksum(bytes_.data(), bytes_.size());
  store_->MarkVerified(id_, slot_, sum);
  return sum;
}

std::string SlotHandleImpl::key() const { return store_->SlotKey(id_, slot_); }

std::string SlotHandleImpl::ns() const { return store_->SlotNamespace(id_); }

uint64_t SlotHandleImpl::CopyIn(const char* src) {
  return *CopyInUntil(src, absl::InfiniteFuture());
}

std::optional<uint64_t> SlotHandleImpl::CopyInUntil(const char* src,
                                                    absl::Time deadline) {
  // A hash taken before (Checksum, an earlier copy) is void from here: a
  // copy that stops at its deadline leaves the bytes part old, part new.
  store_->MarkVerified(id_, slot_, std::nullopt);
  // Arena bytes are not read again soon: no reason to pull them into cache.
  const std::optional<uint64_t> sum =
      CopyToMemoryWithChecksumUntil(bytes_.data(), src, bytes_.size(), deadline);
  if (sum.has_value()) store_->MarkVerified(id_, slot_, *sum);
  return sum;
}

}  // namespace

uint64_t DramMaxBlocks(const StoreOptions& options) {
  return options.dram_max_blocks != 0
             ? options.dram_max_blocks
             : options.dram_capacity / kDramDefaultBlockBytes;
}

uint64_t NvmeMaxBlocks(const StoreOptions& options) {
  if (options.nvme_capacity == 0) return 0;
  return NvmeTierMaxBlocks(options.nvme_capacity, options.nvme_max_blocks);
}

uint64_t DramBlockFloor(const StoreOptions& options) {
  // The capacity the arena maps (whole pages), less what the blocks' keys
  // take (64 bytes each, in slab pages, and a page to spare), shared out:
  // so that that many blocks of the floor fit with their keys.
  const uint64_t page = DramArena::kPageSize;
  const uint64_t capacity = (options.dram_capacity + page - 1) / page * page;
  const uint64_t max_blocks = std::max<uint64_t>(DramMaxBlocks(options), 1);
  const uint64_t keys =
      (max_blocks * DramArena::kMinAlloc + page - 1) / page * page + page;
  const uint64_t share = capacity > keys ? (capacity - keys) / max_blocks : 0;
  if (share > DramArena::kMaxSmallAlloc) {
    // A run of pages: the pages left for blocks shared out, rounded up, so
    // that no more than max_blocks fit (fewer when they do not divide).
    const uint64_t pages = (capacity - keys) / page;
    return (pages + max_blocks - 1) / max_blocks * page;
  }
  // A size class: the one the share falls in, so that blocks of the
  // default's 4 KiB stay in their own class whatever the capacity's digits
  // (64MB, not 64MiB: a share of 4027 bytes); the tier then holds a few
  // percent fewer of the smallest blocks than the bound.
  return DramArena::AllocationSize(std::max<uint64_t>(share, 1));
}

absl::StatusOr<std::unique_ptr<TieredStore>> NewTieredStore(
    const StoreOptions& options, Clock* clock) {
  if (options.nvme_admit_min_reads > 255) {
    return absl::InvalidArgumentError("nvme admission: at most 255 reads");
  }
  if (!(options.low_watermark > 0 && options.low_watermark <= options.high_watermark &&
        options.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError(
        "watermarks must satisfy 0 < low <= high <= 1");
  }
  if (options.max_batch_keys == 0) {
    return absl::InvalidArgumentError("max_batch_keys must be positive");
  }
  if (options.max_block_bytes == 0 ||
      options.max_block_bytes > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        "max_block_bytes must be between 1 byte and 4 GiB");
  }
  if (DramMaxBlocks(options) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dram_max_blocks: a DRAM capacity of ", options.dram_capacity,
        " bytes holds no block of the default bound (one per ",
        kDramDefaultBlockBytes, " bytes)"));
  }
  if (options.nvme_capacity > 0 && NvmeMaxBlocks(options) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nvme_max_blocks: an NVMe capacity of ", options.nvme_capacity,
        " bytes holds no block of the default bound (one per ",
        kNvmeDefaultBlockBytes, " bytes)"));
  }
  std::unique_ptr<NvmeTier> nvme;
  if (options.nvme_capacity > 0) {
    NvmeTierOptions o;
    o.path = options.nvme_path;
    o.capacity_bytes = options.nvme_capacity;
    o.max_blocks = options.nvme_max_blocks;
    o.max_block_bytes = std::min<uint64_t>(options.max_block_bytes, o.capacity_bytes);
    o.use_wal = options.nvme_use_wal;
    o.max_unflushed_age = options.nvme_max_unflushed_age;
    o.direct_reads = options.nvme_direct_reads;
    o.write_buffer_size = options.nvme_write_buffer_size;
    o.env = options.nvme_env;
    ASSIGN_OR_RETURN(nvme, OpenNvmeTier(o, clock));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<DramArena> arena,
                   DramArena::Create(options.dram_capacity, options.hugepages,
                                     options.prefault_dram));
  return std::unique_ptr<TieredStore>(
      new TieredStoreImpl(options, clock, std::move(arena), std::move(nvme)));
}

}  // namespace kvdepot
