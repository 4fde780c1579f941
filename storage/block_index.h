// BlockIndex: the DRAM tier's index from (namespace, key) to block metadata,
// sharded 64 ways (an absl::flat_hash_set and an absl::Mutex per shard, as
// leveldb's ShardedLRUCache). Each shard also keeps its eviction order.
//
// Eviction order is prefix-aware. Every committed block names its parent (the
// previous block of its chain); a block counts its cached children. Only
// blocks with no cached child and no pin are evictable, kept per shard in a
// recency list: a block enters at the most-recent end when it is stored or
// unpinned; a lookup only marks it referenced (CLOCK-style second chance: a
// referenced block reaching the least-recent end is moved back to the
// most-recent end instead of being evicted), which keeps lookups from
// touching their neighbours' memory. A parent whose last cached child leaves
// enters at the least-recent end, unreferenced (its chain has just aged out,
// so the prefix is at least as old as anything still listed). Leaves
// therefore go before their parents and, within that rule, approximately
// least recently used first. Across shards, PopOldestEvictable compares the
// shards' least-recent ends by the sequence number of their last use, so a
// shard holding only fresh blocks is not drained before older ones.
//
// Per-namespace order. Each shard also threads its evictable entries of each
// namespace on a list of their own (BlockEntry::ns_prev/ns_next; the
// shard's lists in a vector indexed by namespace id, which TieredStore keeps
// small and dense: at most max_namespaces x 16 bytes per shard). It holds the same entries in the same order as the shard's list does
// (every push, removal and second chance updates both), so a namespace's
// least-recent evictable entry in a shard is that list's tail: a quota's
// eviction (PopOldestEvictableOf) looks at one entry per shard, however many
// entries of other namespaces are older. The list is guarded by its shard's
// mutex, like the shard's list; it takes no lock of its own. TieredStore
// gives a forgotten namespace's id to another only once no entry of it is
// left: its lists are then empty and no orphan record (below) names it.
//
// Key bytes live in the DRAM arena (a small allocation per block), so the
// metadata of a block is one 88-byte heap entry plus its hash-table slot.
//
// Hash collisions. Lookups compare full keys, so two keys of a namespace
// with one 64-bit hash ("twins") are distinct blocks. A child keeps only its
// parent's hash, though, and finds its parent again by it (to release the
// link, or to name the parent when demoted): so only one entry per
// (namespace, hash) may be a parent. Insert links a child to its parent
// found by full key, and only if that parent was the first of its hash
// when it was inserted (a later twin is marked kHashTwin, is never linked
// to, and is skipped by that search). A collision thus costs at most the
// prefix ordering of a twin's children, never a link to the wrong block.
//
// A parent removed while it has cached children (an explicit Remove or
// RemoveNamespace: eviction never takes one) leaves its children linked to
// its key: the shard records them ("orphans", by namespace and hash, with
// the parent's key). When that key is inserted again, the new entry adopts
// them (it counts them as its cached children: they name its key as their
// parent), so leaves still go before it; until then their releases only
// count down the record. Another key of that hash inserted meanwhile is a
// twin. So a child's link always counts on the one entry (or record) of its
// parent's key, never on a later incarnation that does not know it.
//
// Cycles. An entry that adopts children may be named by its caller as the
// child of one of its own descendants (a client's bogus chain). Linked, the
// blocks of that cycle would each wait for the other to leave: never
// evictable, yet counted in unpinned_bytes. So such an Insert walks the
// links up from the parent first (holding the shards it passes until it
// links, so concurrent inserts cannot close a cycle between them) and, if
// they reach the entry, leaves it unlinked: a root, evicted after its
// adopted children as usual. Only adoption can close a cycle: an entry
// with no children has no descendants.
//
// Thread-safe. A BlockEntry is owned by the index while it is inserted; the
// caller owns it again after a Remove/Pop. A pinned entry is never removed,
// so BlockEntry pointers held by pins stay valid until Unpin.
#ifndef KVDEPOT_STORAGE_BLOCK_INDEX_H_
#define KVDEPOT_STORAGE_BLOCK_INDEX_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {

struct BlockEntry {
  static constexpr uint8_t kInLru = 1;   // in its shard's evictable list
  static constexpr uint8_t kLinked = 2;  // counted in its parent's children
  static constexpr uint8_t kReferenced = 4;  // looked up since last considered
  static constexpr uint8_t kDemoting = 8;  // being written to the NVMe tier
  // Another key of its namespace had its hash when it was inserted (a
  // 64-bit collision): it is never linked to as a parent (see BlockIndex).
  static constexpr uint8_t kHashTwin = 16;
  // Its bytes no longer match its checksum (MarkCorrupt): lookups and
  // PinIfPresent pass it by, as absent, until it is removed.
  static constexpr uint8_t kCorrupt = 32;

  BlockEntry* lru_prev = nullptr;  // its shard's evictable list
  BlockEntry* lru_next = nullptr;
  BlockEntry* ns_prev = nullptr;  // its namespace's list in that shard
  BlockEntry* ns_next = nullptr;
  uint64_t hash = 0;         // BlockIndex::Hash(ns_id, key)
  uint64_t parent_hash = 0;  // hash of the parent key; 0 for a chain's root
  uint64_t checksum = 0;     // XXH3-64 of the block's bytes
  uint32_t data_unit = 0;    // arena offset of the bytes / 64
  uint32_t key_unit = 0;     // arena offset of the key bytes / 64
  uint32_t size = 0;         // block bytes
  uint32_t ns_id = 0;
  uint32_t pins = 0;
  uint32_t children = 0;  // cached blocks naming this one as parent
  uint16_t key_len = 0;
  uint8_t flags = 0;
  // Lookups that found it (saturating), for the NVMe admission policy.
  uint8_t reads = 0;
  // When it was last stored or looked up, in BlockIndex::NextSeq() units
  // (compared wrap-aware: never more than 2^31 behind the counter, see
  // NextSeq). With `reads`, fills what would be padding (64 bits would take
  // the entry past its budget).
  uint32_t seq = 0;

  uint64_t data_offset() const { return uint64_t{data_unit} * 64; }
  uint64_t key_offset() const { return uint64_t{key_unit} * 64; }
};

class BlockIndex {
 public:
  static constexpr int kShardBits = 6;
  static constexpr int kShards = 1 << kShardBits;

  struct KeyRef {
    uint32_t ns_id;
    absl::string_view key;
    uint64_t hash;  // Hash(ns_id, key)
  };
  // What a lookup returns: a copy of the fields a reader needs.
  struct Hit {
    BlockEntry* entry;  // valid while pinned
    uint64_t data_offset;
    uint32_t size;
    uint64_t checksum;
  };
  // kDemoting: the entry is being written to the NVMe tier (BeginDemotion);
  // it leaves DRAM when that ends, so try again then.
  enum class RemoveOutcome { kRemoved, kPinned, kDemoting, kMissing };
  // An entry being demoted, with what the demotion needs that may change
  // under the shard's lock.
  struct Demotion {
    BlockEntry* entry = nullptr;  // pinned until EndDemotion
    uint8_t reads = 0;            // BlockEntry::reads when it began
    // The parent's key when the entry is linked to a cached parent, else
    // empty (the index keeps only the parent's hash).
    std::string parent_key;
  };

  // `arena_base` is where key_unit offsets point; it must outlive the index.
  // `key_trailer_bytes`: what the caller keeps after each key in the key's
  // arena allocation (see Peek), for the arena space an entry holds
  // (unpinned_bytes). `first_seq`: where NextSeq's counter starts (tests
  // start it near a wrap; 0 otherwise). `min_data_bytes`: the least the
  // caller allocates for a block's bytes (a block smaller than that takes
  // that much of the arena: TieredStore's block floor), for the same.
  explicit BlockIndex(const char* arena_base, size_t key_trailer_bytes = 0,
                      uint32_t first_seq = 0, size_t min_data_bytes = 0);
  ~BlockIndex();
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  // Never 0 (0 means "no parent").
  static uint64_t Hash(uint32_t ns_id, absl::string_view key);
  static KeyRef MakeKey(uint32_t ns_id, absl::string_view key) {
    return KeyRef{ns_id, key, Hash(ns_id, key)};
  }

  // A recency stamp for Find and Insert (never 0). Callers take one per
  // batch, not per key, so the shared counter is not a point of contention.
  //
  // Stamps are 32 bits, compared wrap-aware ((a - b) as int32), which is
  // right only while they are less than 2^31 apart; the counter passes that
  // in hours under load. So every kSeqSweepEvery ticks the caller that
  // reaches a multiple of it ages every entry older than kMaxSeqAge to just
  // that age (SweepSeqs: one pass over the index, under each shard's lock in
  // turn). No stamp is then ever more than kMaxSeqAge + kSeqSweepEvery
  // (< 2^31) behind the counter, and blocks older than kMaxSeqAge compare
  // as equally old (their order within a shard's list stays).
  static constexpr uint32_t kSeqSweepEvery = uint32_t{1} << 30;
  static constexpr uint32_t kMaxSeqAge = uint32_t{1} << 29;
  uint32_t NextSeq() {
    const uint32_t seq = seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    if ((seq & (kSeqSweepEvery - 1)) != 0) return seq;
    SweepSeqs(seq);
    return seq != 0 ? seq : NextSeq();  // 0 means "no stamp" to Find
  }

  // The most pins an entry holds (its 32-bit count never wraps: a pin past
  // it is refused, as below).
  static constexpr uint32_t kMaxPins = UINT32_MAX;

  // Finds `key` (an entry marked corrupt counts as absent). With `pin`, the
  // entry's pin count is raised atomically with
  // the find (it leaves the evictable list); otherwise it is marked
  // referenced. Either way its last use becomes `seq`. With `pin`, an entry
  // holding kMaxPins already is not pinned, and not found (nullopt).
  std::optional<Hit> Find(const KeyRef& key, bool pin, uint32_t seq = 0);
  // Pins `key`'s entry if present, without counting a lookup: its reads,
  // referenced mark and last use stay as they are (a put-if-absent's check,
  // holding the block so that making room for the put cannot evict it).
  // Like any pin it leaves the evictable lists; Unpin lists it again at the
  // most-recent end. Returns the entry (released with Unpin), or nullptr
  // (also when it holds kMaxPins already).
  // An entry marked corrupt counts as absent unless `even_corrupt`.
  BlockEntry* PinIfPresent(const KeyRef& key, bool even_corrupt = false);
  // Marks `entry` corrupt (BlockEntry::kCorrupt): from now on Find and
  // PinIfPresent pass it by, so that its pins drain and it can be removed.
  // True if this call marked it, false if it was marked already.
  // REQUIRES: `entry` is pinned by the caller.
  bool MarkCorrupt(BlockEntry* entry);
  // REQUIRES: `entry` is pinned by the caller.
  bool IsCorrupt(BlockEntry* entry);
  // A copy of an entry's fields without touching its recency (admin
  // inspection), and the `trailer.size()` arena bytes that follow its key
  // (the caller's own per-block data). nullopt if absent.
  std::optional<BlockEntry> Peek(const KeyRef& key, absl::Span<char> trailer = {});
  // Every namespace, where a namespace id may be given.
  static constexpr uint32_t kAllNamespaces = UINT32_MAX;
  // Removes the evictable entry of namespace `ns_id` whose last use is
  // oldest among the least-recent ends of its per-shard lists (a namespace
  // quota's eviction): one entry per shard is looked at, whatever other
  // namespaces hold. nullptr if the namespace has no evictable entry.
  std::unique_ptr<BlockEntry> PopOldestEvictableOf(uint32_t ns_id);
  // Adds one pin to an entry already pinned by the caller; false (nothing
  // added) when it holds kMaxPins already.
  bool AddPin(BlockEntry* entry);
  // REQUIRES: `entry` is pinned by the caller.
  void Unpin(BlockEntry* entry);

  // Publishes `entry` unless the key is already present (put-if-absent).
  // REQUIRES: entry->hash, ns_id, key_unit, key_len (and seq) are set and the
  // key bytes are in the arena. `parent` is the parent key (empty for a
  // root). With `pinned` the entry is published holding one pin (the
  // caller's, released with Unpin). Returns the entry back when the key
  // already exists. The entry is left unlinked from `parent` where linking
  // it would close a cycle (see the file comment).
  std::unique_ptr<BlockEntry> Insert(std::unique_ptr<BlockEntry> entry,
                                     absl::string_view parent,
                                     bool pinned = false);

  // Removes an unpinned entry (explicit eviction). On kRemoved, *out holds it
  // and its parent link is already released.
  RemoveOutcome Remove(const KeyRef& key, std::unique_ptr<BlockEntry>* out);
  // Removes `entry`, pinned by the caller, when that pin is its only one and
  // it is not being demoted: the pin goes with it (kRemoved; *out holds it,
  // its parent link released). Otherwise kPinned or kDemoting, and the
  // caller still holds its pin. Unlike Remove by key, it can never take
  // another entry stored under the same key meanwhile.
  // REQUIRES: `entry` is pinned by the caller.
  RemoveOutcome RemovePinned(BlockEntry* entry,
                             std::unique_ptr<BlockEntry>* out);
  // Removes every unpinned entry of namespace `ns_id` that is not being
  // demoted; counts pinned ones and ones being demoted.
  std::vector<std::unique_ptr<BlockEntry>> RemoveNamespace(uint32_t ns_id,
                                                          uint64_t* pinned,
                                                          uint64_t* demoting);
  // Removes the least recently used evictable entry of `shard`, if any.
  std::unique_ptr<BlockEntry> PopEvictable(int shard);
  // Removes the evictable entry whose last use is oldest among the shards'
  // least-recent ends (every shard is looked at). nullptr if none.
  std::unique_ptr<BlockEntry> PopOldestEvictable();

  // Demotion: the entry PopOldestEvictable would remove is written to the
  // NVMe tier first, and stays findable in DRAM meanwhile (a lookup never
  // misses a block between the tiers, and a Remove cannot be undone by a
  // write that lands after it). BeginDemotion pins that entry and marks it
  // demoting; nullopt if none is evictable. EndDemotion drops that pin and
  // removes the entry, returning it to the caller, unless a lookup pinned it
  // or a child of it was stored meanwhile: then it stays (nullptr). With
  // `ns_id`, the entry PopOldestEvictableOf(ns_id) would remove (a
  // namespace quota's demotion).
  std::optional<Demotion> BeginDemotion(uint32_t ns_id = kAllNamespaces);
  std::unique_ptr<BlockEntry> EndDemotion(BlockEntry* entry);

  uint64_t blocks() const;
  // Number of entries in the evictable lists (for tests and stats).
  uint64_t evictable() const;
  // Arena bytes (block and key allocations, as DramArena::AllocationSize
  // counts them) of the entries no caller holds pinned: what evicting could
  // ever free, at most. It includes entries that are not evictable now but
  // will be without the caller's help: entries being demoted (their
  // demotion's pin is not counted as a caller's) and parents of cached
  // children; also parents whose children are pinned, which only the pins'
  // release makes evictable, so it is an upper bound. Exact when no entry
  // changes meanwhile; read without locking the shards.
  uint64_t unpinned_bytes() const;
  // Appends the arena offsets (block and key) of every entry a caller holds
  // pinned (HeldByCaller): what no eviction frees. Locks each shard in
  // turn; O(entries).
  void AppendHeldOffsets(std::vector<uint64_t>* out) const;

 private:
  // A probe that matches by namespace and hash alone (parent links): it
  // finds the one entry of that hash not marked kHashTwin.
  struct HashProbe {
    uint32_t ns_id;
    uint64_t hash;
  };
  struct EntryHash {
    using is_transparent = void;
    size_t operator()(const BlockEntry* e) const { return e->hash; }
    size_t operator()(const KeyRef& k) const { return k.hash; }
    size_t operator()(const HashProbe& p) const { return p.hash; }
  };
  struct EntryEq {
    using is_transparent = void;
    const char* base;
    bool operator()(const BlockEntry* a, const BlockEntry* b) const {
      return a == b;
    }
    bool operator()(const BlockEntry* a, const KeyRef& k) const;
    bool operator()(const KeyRef& k, const BlockEntry* a) const {
      return (*this)(a, k);
    }
    bool operator()(const BlockEntry* a, const HashProbe& p) const {
      return a->hash == p.hash && a->ns_id == p.ns_id &&
             !(a->flags & BlockEntry::kHashTwin);
    }
    bool operator()(const HashProbe& p, const BlockEntry* a) const {
      return (*this)(a, p);
    }
  };
  using Set = absl::flat_hash_set<BlockEntry*, EntryHash, EntryEq>;

  // One namespace's evictable entries in a shard, threaded through
  // BlockEntry::ns_prev/ns_next: head = most recent, tail = least recent.
  struct NsList {
    BlockEntry* head = nullptr;
    BlockEntry* tail = nullptr;
  };
  // Linked children of a parent removed while they were cached (see the
  // file comment), until its key is inserted again or they all leave.
  struct Orphans {
    std::string parent_key;
    uint32_t children = 0;
  };
  using NsHash = std::pair<uint32_t, uint64_t>;  // (ns_id, hash)

  struct Shard {
    explicit Shard(const char* base) : set(0, EntryHash(), EntryEq{base}) {}
    mutable absl::Mutex mu;
    Set set ABSL_GUARDED_BY(mu);
    // Evictable list: head = most recent, tail = least recent.
    BlockEntry* head ABSL_GUARDED_BY(mu) = nullptr;
    BlockEntry* tail ABSL_GUARDED_BY(mu) = nullptr;
    uint64_t lru_size ABSL_GUARDED_BY(mu) = 0;
    // The same entries per namespace, in the same order, indexed by
    // namespace id (ids are small and dense: TieredStore numbers them from
    // 1 up to max_namespaces), grown as ids come; an empty list is {}.
    std::vector<NsList> ns_lru ABSL_GUARDED_BY(mu);
    // By the removed parent's (namespace, hash); usually empty.
    absl::flat_hash_map<NsHash, Orphans> orphans ABSL_GUARDED_BY(mu);
    // Footprint of its entries, and of those HeldByCaller: written under
    // `mu` (plain loads and stores, no read-modify-write: a pin costs no
    // shared atomic), read without it by unpinned_bytes.
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> held_bytes{0};
  };

  static int ShardIndex(uint64_t hash) {
    return static_cast<int>(hash >> (64 - kShardBits));
  }
  Shard& ShardFor(uint64_t hash) { return *shards_[ShardIndex(hash)]; }

  // The shards an Insert holds, by index, unlocked when it goes. Lock
  // blocks (callers lock in index order); TryLock does not, so a walk may
  // take shards in any order without deadlock.
  class HeldShards {
   public:
    explicit HeldShards(BlockIndex& index) : index_(index) {}
    HeldShards(const HeldShards&) = delete;
    HeldShards& operator=(const HeldShards&) = delete;
    ~HeldShards() { UnlockAll(); }
    void Lock(int i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      index_.shards_[i]->mu.Lock();
      mask_ |= uint64_t{1} << i;
    }
    // True when shard `i` is held now (already, or taken here).
    bool TryLock(int i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (mask_ & (uint64_t{1} << i)) return true;
      if (!index_.shards_[i]->mu.TryLock()) return false;
      mask_ |= uint64_t{1} << i;
      return true;
    }
    void UnlockAll() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      for (int i = 0; i < kShards; ++i) {
        if (mask_ & (uint64_t{1} << i)) index_.shards_[i]->mu.Unlock();
      }
      mask_ = 0;
    }

   private:
    BlockIndex& index_;
    uint64_t mask_ = 0;  // bit i: shards_[i] is locked by this
  };
  static_assert(kShards <= 64, "HeldShards keeps one bit per shard");

  // What WalkUp found.
  enum class ChainWalk { kClear, kCycle, kBusy };
  // Links followed at most by a cycle check (a longer chain counts as a
  // cycle: the entry is left unlinked), and Insert's tries when a shard of
  // the walk is busy (after them, likewise).
  static constexpr int kMaxChainWalk = 1 << 16;
  static constexpr int kMaxInsertAttempts = 64;
  // Whether linking `entry` (which adopted orphans, so blocks link to its
  // key) to `parent` would close a cycle: the links from `parent` up reach
  // `entry`'s hash (kCycle, also past kMaxChainWalk links). Locks the
  // shards it passes with held.TryLock, and they stay held (the caller
  // links under them); kBusy when one is held by another thread.
  // REQUIRES: `held` holds the shards of `entry` and `parent`; `entry` is
  // not in the index yet.
  ChainWalk WalkUp(const BlockEntry& entry, const BlockEntry& parent,
                   HeldShards& held);
  // Finds the entry of this hash that may be a parent (not kHashTwin), for
  // parent links (a child does not keep its parent's key).
  BlockEntry* FindByHash(Shard& s, uint32_t ns_id, uint64_t hash)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  static void LruPushFront(Shard& s, BlockEntry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  static void LruPushBack(Shard& s, BlockEntry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  static void LruRemove(Shard& s, BlockEntry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // `ns_id`'s list in `s`, made (empty) if the shard has none yet.
  static NsList& NsListOf(Shard& s, uint32_t ns_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    if (ns_id >= s.ns_lru.size()) s.ns_lru.resize(size_t{ns_id} + 1);
    return s.ns_lru[ns_id];
  }
  static bool Evictable(const BlockEntry* e) {
    return e->pins == 0 && e->children == 0;
  }
  // Takes `e` out of the set and the lists (recording its cached children
  // as orphans). REQUIRES: e is in s.set and no caller holds it pinned.
  void Detach(Shard& s, BlockEntry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Gives referenced entries at the tail of `s`'s list of `ns_id` their
  // second chance (to the most-recent end of both lists); returns the tail
  // afterwards (nullptr if the list is empty). kAllNamespaces: the shard's
  // own list.
  static BlockEntry* SettleTail(Shard& s, uint32_t ns_id = kAllNamespaces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Removes the settled tail of shard `shard`'s list of `ns_id`.
  std::unique_ptr<BlockEntry> PopTail(int shard, uint32_t ns_id);
  // Removes the entry whose last use is oldest among the settled tails of
  // every shard's list of `ns_id`; nullptr when those lists are empty.
  std::unique_ptr<BlockEntry> PopOldest(uint32_t ns_id);
  // The arena bytes `e` holds (see unpinned_bytes).
  uint64_t Footprint(const BlockEntry& e) const;
  // Pinned by a caller: a pin besides the one its demotion holds.
  static bool HeldByCaller(const BlockEntry& e) {
    return e.pins > ((e.flags & BlockEntry::kDemoting) ? 1u : 0u);
  }
  // Updates s.held_bytes after `e`'s pins or flags changed; `was_held` is
  // HeldByCaller(e) before.
  void CountHold(Shard& s, const BlockEntry& e, bool was_held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Adds `delta` (two's complement) to a counter only `s.mu`'s holder writes.
  static void Add(std::atomic<uint64_t>& counter, uint64_t delta) {
    counter.store(counter.load(std::memory_order_relaxed) + delta,
                  std::memory_order_relaxed);
  }
  // The shard whose least-recent evictable entry (of `ns_id`) was used
  // longest ago, or -1 when no shard has one.
  int OldestShard(uint32_t ns_id = kAllNamespaces);
  // Drops one child count from the parent of a removed entry, if linked.
  void ReleaseParent(const BlockEntry& removed);
  // Ages every entry last used more than kMaxSeqAge before `now` to that
  // age (see NextSeq).
  void SweepSeqs(uint32_t now);

  const char* const base_;
  const size_t key_trailer_bytes_;
  const size_t min_data_bytes_;
  std::array<std::unique_ptr<Shard>, kShards> shards_;
  std::atomic<uint32_t> seq_{0};
};

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_BLOCK_INDEX_H_
