#include "storage/block_index.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "storage/dram_arena.h"

namespace kvdepot {

// The metadata budget is 128 B per block (metadata_footprint_test): the
// entry's heap chunk (88 B asks glibc for a 96-byte chunk; 89..104 B would
// take 112) plus its hash-table slot (8 B and a control byte, at a load of
// 7/16..7/8: about 10..21 B).
static_assert(sizeof(BlockEntry) <= 88,
              "BlockEntry must stay small: metadata <= 128 B per block");

BlockIndex::BlockIndex(const char* arena_base, size_t key_trailer_bytes,
                       uint32_t first_seq, size_t min_data_bytes)
    : base_(arena_base),
      key_trailer_bytes_(key_trailer_bytes),
      min_data_bytes_(min_data_bytes),
      seq_(first_seq) {
  for (auto& s : shards_) s = std::make_unique<Shard>(arena_base);
}

BlockIndex::~BlockIndex() {
  for (auto& s : shards_) {
    absl::MutexLock lock(&s->mu);
    for (BlockEntry* e : s->set) delete e;
    s->set.clear();
  }
}

uint64_t BlockIndex::Hash(uint32_t ns_id, absl::string_view key) {
  uint64_t h = XXH3_64bits_withSeed(key.data(), key.size(), ns_id);
  return h == 0 ? 1 : h;
}

bool BlockIndex::EntryEq::operator()(const BlockEntry* a,
                                     const KeyRef& k) const {
  return a->hash == k.hash && a->ns_id == k.ns_id &&
         a->key_len == k.key.size() &&
         std::memcmp(base + a->key_offset(), k.key.data(), k.key.size()) == 0;
}

namespace {

// One intrusive doubly linked list through BlockEntry's `kPrev`/`kNext`
// members: head = most recent, tail = least recent.
template <BlockEntry* BlockEntry::*kPrev, BlockEntry* BlockEntry::*kNext>
struct Links {
  static void PushFront(BlockEntry*& head, BlockEntry*& tail, BlockEntry* e) {
    e->*kPrev = nullptr;
    e->*kNext = head;
    if (head) head->*kPrev = e;
    head = e;
    if (!tail) tail = e;
  }
  static void PushBack(BlockEntry*& head, BlockEntry*& tail, BlockEntry* e) {
    e->*kNext = nullptr;
    e->*kPrev = tail;
    if (tail) tail->*kNext = e;
    tail = e;
    if (!head) head = e;
  }
  static void Unlink(BlockEntry*& head, BlockEntry*& tail, BlockEntry* e) {
    if (e->*kPrev) (e->*kPrev)->*kNext = e->*kNext; else head = e->*kNext;
    if (e->*kNext) (e->*kNext)->*kPrev = e->*kPrev; else tail = e->*kPrev;
    e->*kPrev = e->*kNext = nullptr;
  }
};
using ShardLinks = Links<&BlockEntry::lru_prev, &BlockEntry::lru_next>;
using NsLinks = Links<&BlockEntry::ns_prev, &BlockEntry::ns_next>;

}  // namespace

// The namespace lists mirror the shard's list: every push and removal below
// does the same on both, so each namespace list is the subsequence of the
// shard's list that holds that namespace's entries.
void BlockIndex::LruPushFront(Shard& s, BlockEntry* e) {
  ShardLinks::PushFront(s.head, s.tail, e);
  NsList& l = NsListOf(s, e->ns_id);
  NsLinks::PushFront(l.head, l.tail, e);
  e->flags |= BlockEntry::kInLru;
  ++s.lru_size;
}

void BlockIndex::LruPushBack(Shard& s, BlockEntry* e) {
  e->flags &= ~BlockEntry::kReferenced;
  ShardLinks::PushBack(s.head, s.tail, e);
  NsList& l = NsListOf(s, e->ns_id);
  NsLinks::PushBack(l.head, l.tail, e);
  e->flags |= BlockEntry::kInLru;
  ++s.lru_size;
}

void BlockIndex::LruRemove(Shard& s, BlockEntry* e) {
  if (!(e->flags & BlockEntry::kInLru)) return;
  ShardLinks::Unlink(s.head, s.tail, e);
  NsList& l = s.ns_lru[e->ns_id];  // exists: e was pushed on it
  NsLinks::Unlink(l.head, l.tail, e);
  e->flags &= ~BlockEntry::kInLru;
  --s.lru_size;
}

void BlockIndex::Detach(Shard& s, BlockEntry* e) {
  LruRemove(s, e);
  s.set.erase(e);
  const uint64_t footprint = Footprint(*e);
  Add(s.bytes, -footprint);
  if (HeldByCaller(*e)) Add(s.held_bytes, -footprint);
  if (e->children > 0) {
    // Its children stay linked to its key (see the header). Only the one
    // non-twin entry of a hash has children, and a record of its hash would
    // have been adopted by it or made it a twin: there is none yet.
    Orphans& o = s.orphans[NsHash{e->ns_id, e->hash}];
    o.parent_key.assign(base_ + e->key_offset(), e->key_len);
    o.children += e->children;
  }
}

uint64_t BlockIndex::Footprint(const BlockEntry& e) const {
  return DramArena::AllocationSize(std::max<size_t>(e.size, min_data_bytes_)) +
         DramArena::AllocationSize(e.key_len + key_trailer_bytes_);
}

void BlockIndex::CountHold(Shard& s, const BlockEntry& e, bool was_held) {
  const bool held = HeldByCaller(e);
  if (held == was_held) return;
  const uint64_t footprint = Footprint(e);
  Add(s.held_bytes, held ? footprint : -footprint);
}

BlockEntry* BlockIndex::FindByHash(Shard& s, uint32_t ns_id, uint64_t hash) {
  auto it = s.set.find(HashProbe{ns_id, hash});
  return it == s.set.end() ? nullptr : *it;
}

std::optional<BlockIndex::Hit> BlockIndex::Find(const KeyRef& key, bool pin,
                                                uint32_t seq) {
  Shard& s = ShardFor(key.hash);
  absl::MutexLock lock(&s.mu);
  auto it = s.set.find(key);
  if (it == s.set.end()) return std::nullopt;
  BlockEntry* e = *it;
  if (e->flags & BlockEntry::kCorrupt) return std::nullopt;
  if (pin && e->pins >= kMaxPins) return std::nullopt;  // would wrap to 0
  if (seq != 0) e->seq = seq;
  if (e->reads < UINT8_MAX) ++e->reads;
  if (pin) {
    const bool was_held = HeldByCaller(*e);
    LruRemove(s, e);
    ++e->pins;
    CountHold(s, *e, was_held);
  } else {
    e->flags |= BlockEntry::kReferenced;
  }
  return Hit{e, e->data_offset(), e->size, e->checksum};
}

BlockEntry* BlockIndex::PinIfPresent(const KeyRef& key, bool even_corrupt) {
  Shard& s = ShardFor(key.hash);
  absl::MutexLock lock(&s.mu);
  auto it = s.set.find(key);
  if (it == s.set.end()) return nullptr;
  BlockEntry* e = *it;
  if ((e->flags & BlockEntry::kCorrupt) && !even_corrupt) return nullptr;
  if (e->pins >= kMaxPins) return nullptr;  // would wrap to 0
  const bool was_held = HeldByCaller(*e);
  LruRemove(s, e);
  ++e->pins;
  CountHold(s, *e, was_held);
  return e;
}

bool BlockIndex::AddPin(BlockEntry* e) {
  Shard& s = ShardFor(e->hash);
  absl::MutexLock lock(&s.mu);
  if (e->pins >= kMaxPins) return false;  // would wrap to 0
  const bool was_held = HeldByCaller(*e);
  LruRemove(s, e);
  ++e->pins;
  CountHold(s, *e, was_held);
  return true;
}

void BlockIndex::Unpin(BlockEntry* e) {
  Shard& s = ShardFor(e->hash);
  absl::MutexLock lock(&s.mu);
  if (e->pins == 0) return;
  const bool was_held = HeldByCaller(*e);
  if (--e->pins == 0 && e->children == 0) LruPushFront(s, e);
  CountHold(s, *e, was_held);
}

std::unique_ptr<BlockEntry> BlockIndex::Insert(std::unique_ptr<BlockEntry> entry,
                                               absl::string_view parent,
                                               bool pinned) {
  KeyRef key{entry->ns_id,
             absl::string_view(base_ + entry->key_offset(), entry->key_len),
             entry->hash};
  entry->parent_hash = parent.empty() ? 0 : Hash(entry->ns_id, parent);
  entry->flags = 0;
  entry->pins = pinned ? 1 : 0;
  entry->children = 0;
  const int si = ShardIndex(entry->hash);
  const int pi = entry->parent_hash != 0 ? ShardIndex(entry->parent_hash) : si;
  Shard& s = *shards_[si];
  Shard& ps = *shards_[pi];
  for (int attempt = 1;; ++attempt) {
    // Link to the parent while holding both shards, so a concurrent removal
    // of this entry cannot release a link that was never made. Two shards
    // are always locked in index order (the only place that blocks on a
    // second shard); a cycle check takes others only with TryLock.
    HeldShards held(*this);
    held.Lock(std::min(si, pi));
    if (pi != si) held.Lock(std::max(si, pi));
    enum { kRetry, kExists, kInserted } outcome = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (s.set.contains(key)) return kExists;
      // Another key with this hash is there already: this one is its twin
      // (see the header), so that FindByHash keeps finding that one.
      bool twin = false;
      auto orphans = s.orphans.end();
      if (s.set.contains(HashProbe{entry->ns_id, entry->hash})) {
        twin = true;
      } else if (auto o = s.orphans.find(NsHash{entry->ns_id, entry->hash});
                 o != s.orphans.end()) {
        // Children of an earlier entry of this hash are still linked to it:
        // the same key adopts them; another key is a twin while they last.
        if (o->second.parent_key == key.key) {
          orphans = o;
        } else {
          twin = true;
        }
      }
      // The parent by its full key; a twin is left unlinked, since the
      // link's later users find the parent by hash. (This entry is not in
      // the set yet: a key naming itself finds no parent.)
      BlockEntry* p = nullptr;
      if (entry->parent_hash != 0) {
        auto it = ps.set.find(KeyRef{entry->ns_id, parent, entry->parent_hash});
        if (it != ps.set.end() && !((*it)->flags & BlockEntry::kHashTwin)) p = *it;
      }
      // An entry that adopts children is an ancestor already: linking it
      // below one of its descendants would close a cycle whose blocks wait
      // on each other for ever. It is left unlinked (a root) then, and when
      // the walk cannot tell (too long, or its shards stay busy).
      if (p != nullptr && orphans != s.orphans.end()) {
        switch (WalkUp(*entry, *p, held)) {
          case ChainWalk::kClear:
            break;
          case ChainWalk::kBusy:
            if (attempt < kMaxInsertAttempts) return kRetry;
            p = nullptr;
            break;
          case ChainWalk::kCycle:
            p = nullptr;
            break;
        }
      }
      if (twin) entry->flags |= BlockEntry::kHashTwin;
      if (orphans != s.orphans.end()) {
        entry->children = orphans->second.children;
        s.orphans.erase(orphans);
      }
      if (!pinned && entry->children == 0) LruPushFront(s, entry.get());
      s.set.insert(entry.get());
      const uint64_t footprint = Footprint(*entry);
      Add(s.bytes, footprint);
      if (pinned) Add(s.held_bytes, footprint);
      if (p == nullptr) return kInserted;
      if (p->children++ == 0) LruRemove(ps, p);
      entry->flags |= BlockEntry::kLinked;
      return kInserted;
    }();
    if (outcome == kExists) return entry;
    if (outcome == kInserted) break;
    held.UnlockAll();
    std::this_thread::yield();  // kRetry: let the holder of a shard finish
  }
  entry.release();
  return nullptr;
}

BlockIndex::ChainWalk BlockIndex::WalkUp(const BlockEntry& entry,
                                         const BlockEntry& parent,
                                         HeldShards& held) {
  // Walks the parent's chain of links. Every link ends at the one non-twin
  // entry of its parent's hash, or at the orphan record of that hash; the
  // record of `entry`'s hash is the one it adopts (no non-twin entry of that
  // hash exists), so a link to that hash is a link to `entry`. The shards
  // passed stay locked until the insert ends: no insert can change the chain
  // meanwhile (a link is made only by an insert into the linking entry's
  // shard, and a removal only cuts a chain).
  const BlockEntry* a = &parent;
  for (int steps = 0; steps < kMaxChainWalk; ++steps) {
    if (!(a->flags & BlockEntry::kLinked)) return ChainWalk::kClear;
    if (a->parent_hash == entry.hash) return ChainWalk::kCycle;
    const int i = ShardIndex(a->parent_hash);
    if (!held.TryLock(i)) return ChainWalk::kBusy;
    a = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return FindByHash(*shards_[i], entry.ns_id, a->parent_hash);
    }();
    if (a == nullptr) return ChainWalk::kClear;  // removed: a record ends it
  }
  return ChainWalk::kCycle;  // too long to tell: leave it unlinked
}

void BlockIndex::ReleaseParent(const BlockEntry& removed) {
  if (!(removed.flags & BlockEntry::kLinked)) return;
  Shard& ps = ShardFor(removed.parent_hash);
  absl::MutexLock lock(&ps.mu);
  // The parent was removed with its children cached (and its key not
  // inserted again since): the link counts on the record. There is then no
  // non-twin entry of that hash.
  auto o = ps.orphans.find(NsHash{removed.ns_id, removed.parent_hash});
  if (o != ps.orphans.end()) {
    if (--o->second.children == 0) ps.orphans.erase(o);
    return;
  }
  BlockEntry* p = FindByHash(ps, removed.ns_id, removed.parent_hash);
  if (p == nullptr || p->children == 0) return;
  if (--p->children == 0 && p->pins == 0) LruPushBack(ps, p);
}

BlockIndex::RemoveOutcome BlockIndex::Remove(const KeyRef& key,
                                             std::unique_ptr<BlockEntry>* out) {
  Shard& s = ShardFor(key.hash);
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.set.find(key);
    if (it == s.set.end()) return RemoveOutcome::kMissing;
    BlockEntry* e = *it;
    if (e->flags & BlockEntry::kDemoting) return RemoveOutcome::kDemoting;
    if (e->pins > 0) return RemoveOutcome::kPinned;
    Detach(s, e);
    out->reset(e);
  }
  ReleaseParent(**out);
  return RemoveOutcome::kRemoved;
}

bool BlockIndex::MarkCorrupt(BlockEntry* e) {
  Shard& s = ShardFor(e->hash);
  absl::MutexLock lock(&s.mu);
  if (e->flags & BlockEntry::kCorrupt) return false;
  e->flags |= BlockEntry::kCorrupt;
  return true;
}

bool BlockIndex::IsCorrupt(BlockEntry* e) {
  Shard& s = ShardFor(e->hash);
  absl::MutexLock lock(&s.mu);
  return (e->flags & BlockEntry::kCorrupt) != 0;
}

BlockIndex::RemoveOutcome BlockIndex::RemovePinned(
    BlockEntry* e, std::unique_ptr<BlockEntry>* out) {
  Shard& s = ShardFor(e->hash);
  {
    absl::MutexLock lock(&s.mu);
    if (e->flags & BlockEntry::kDemoting) return RemoveOutcome::kDemoting;
    if (e->pins != 1) return RemoveOutcome::kPinned;
    const bool was_held = HeldByCaller(*e);
    e->pins = 0;
    CountHold(s, *e, was_held);
    Detach(s, e);
    out->reset(e);
  }
  ReleaseParent(**out);
  return RemoveOutcome::kRemoved;
}

std::vector<std::unique_ptr<BlockEntry>> BlockIndex::RemoveNamespace(
    uint32_t ns_id, uint64_t* pinned, uint64_t* demoting) {
  std::vector<std::unique_ptr<BlockEntry>> removed;
  *pinned = 0;
  *demoting = 0;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    absl::MutexLock lock(&s.mu);
    std::vector<BlockEntry*> victims;
    for (BlockEntry* e : s.set) {
      if (e->ns_id != ns_id) continue;
      if (e->flags & BlockEntry::kDemoting) {
        ++*demoting;
      } else if (e->pins > 0) {
        ++*pinned;
      } else {
        victims.push_back(e);
      }
    }
    for (BlockEntry* e : victims) {
      Detach(s, e);
      removed.emplace_back(e);
    }
  }
  // Parents of removed entries are either removed too (same namespace) or
  // pinned survivors; release the links of the latter.
  for (const auto& e : removed) ReleaseParent(*e);
  return removed;
}

BlockEntry* BlockIndex::SettleTail(Shard& s, uint32_t ns_id) {
  // Second chance: referenced entries go back to the front, unmarked. One
  // pass over the list unmarks everything, so this ends. (LruPushFront may
  // grow the namespace vector: the list is looked up each round.)
  while (true) {
    BlockEntry* e = ns_id == kAllNamespaces ? s.tail
                    : ns_id < s.ns_lru.size() ? s.ns_lru[ns_id].tail
                                              : nullptr;
    if (e == nullptr || !(e->flags & BlockEntry::kReferenced)) return e;
    e->flags &= ~BlockEntry::kReferenced;
    LruRemove(s, e);
    LruPushFront(s, e);
  }
}

std::unique_ptr<BlockEntry> BlockIndex::PopEvictable(int shard) {
  return PopTail(shard, kAllNamespaces);
}

std::unique_ptr<BlockEntry> BlockIndex::PopTail(int shard, uint32_t ns_id) {
  Shard& s = *shards_[shard];
  std::unique_ptr<BlockEntry> out;
  {
    absl::MutexLock lock(&s.mu);
    BlockEntry* e = SettleTail(s, ns_id);
    if (e == nullptr) return nullptr;
    Detach(s, e);
    out.reset(e);
  }
  ReleaseParent(*out);
  return out;
}

int BlockIndex::OldestShard(uint32_t ns_id) {
  int best = -1;
  uint32_t best_seq = 0;
  for (int i = 0; i < kShards; ++i) {
    Shard& s = *shards_[i];
    absl::MutexLock lock(&s.mu);
    BlockEntry* e = SettleTail(s, ns_id);
    if (e == nullptr) continue;
    // Wrap-aware: a is older than b when (a - b) is negative as int32.
    if (best < 0 || static_cast<int32_t>(e->seq - best_seq) < 0) {
      best = i;
      best_seq = e->seq;
    }
  }
  return best;
}

std::unique_ptr<BlockEntry> BlockIndex::PopOldest(uint32_t ns_id) {
  // Another thread may empty the chosen list before it is popped: then look
  // again, so nullptr means no shard had an evictable entry.
  while (true) {
    const int best = OldestShard(ns_id);
    if (best < 0) return nullptr;
    if (std::unique_ptr<BlockEntry> e = PopTail(best, ns_id)) return e;
  }
}

std::unique_ptr<BlockEntry> BlockIndex::PopOldestEvictable() {
  return PopOldest(kAllNamespaces);
}

std::optional<BlockIndex::Demotion> BlockIndex::BeginDemotion(uint32_t ns_id) {
  Demotion d;
  bool linked = false;
  uint64_t parent_hash = 0;
  while (d.entry == nullptr) {
    const int best = OldestShard(ns_id);
    if (best < 0) return std::nullopt;
    Shard& s = *shards_[best];
    absl::MutexLock lock(&s.mu);
    BlockEntry* e = SettleTail(s, ns_id);
    if (e == nullptr) continue;  // emptied meanwhile: look again
    LruRemove(s, e);
    ++e->pins;  // the demotion's own: not a caller's (HeldByCaller)
    e->flags |= BlockEntry::kDemoting;
    d.entry = e;
    d.reads = e->reads;
    linked = (e->flags & BlockEntry::kLinked) != 0;
    parent_hash = e->parent_hash;
  }
  if (linked) {
    // The parent stays while this entry is linked to it, unless removed
    // explicitly (Remove does not wait for children); then its record of
    // orphans keeps its key.
    Shard& ps = ShardFor(parent_hash);
    absl::MutexLock lock(&ps.mu);
    if (BlockEntry* p = FindByHash(ps, d.entry->ns_id, parent_hash)) {
      d.parent_key.assign(base_ + p->key_offset(), p->key_len);
    } else if (auto o = ps.orphans.find(NsHash{d.entry->ns_id, parent_hash});
               o != ps.orphans.end()) {
      d.parent_key = o->second.parent_key;
    }
  }
  return d;
}

std::unique_ptr<BlockEntry> BlockIndex::EndDemotion(BlockEntry* e) {
  Shard& s = ShardFor(e->hash);
  std::unique_ptr<BlockEntry> out;
  {
    absl::MutexLock lock(&s.mu);
    const bool was_held = HeldByCaller(*e);
    e->flags &= ~BlockEntry::kDemoting;
    --e->pins;
    CountHold(s, *e, was_held);
    // Pinned by a lookup meanwhile: its Unpin lists it again. With a cached
    // child it is not evictable until the child leaves.
    if (e->pins > 0 || e->children > 0) return nullptr;
    Detach(s, e);
    out.reset(e);
  }
  ReleaseParent(*out);
  return out;
}

uint64_t BlockIndex::blocks() const {
  uint64_t n = 0;
  for (const auto& s : shards_) {
    absl::MutexLock lock(&s->mu);
    n += s->set.size();
  }
  return n;
}

void BlockIndex::SweepSeqs(uint32_t now) {
  // Stamps taken after `now` (by callers racing this one) look negative
  // here and stay; the previous sweep left none older than kMaxSeqAge +
  // kSeqSweepEvery < 2^31, so none looks negative for being old.
  const uint32_t floor = now - kMaxSeqAge;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    absl::MutexLock lock(&s.mu);
    for (BlockEntry* e : s.set) {
      if (static_cast<int32_t>(now - e->seq) > static_cast<int32_t>(kMaxSeqAge)) {
        e->seq = floor;
      }
    }
  }
}

uint64_t BlockIndex::unpinned_bytes() const {
  uint64_t all = 0, held = 0;
  for (const auto& s : shards_) {
    all += s->bytes.load(std::memory_order_relaxed);
    held += s->held_bytes.load(std::memory_order_relaxed);
  }
  return all > held ? all - held : 0;  // read apart: may cross an update
}

void BlockIndex::AppendHeldOffsets(std::vector<uint64_t>* out) const {
  for (const auto& s : shards_) {
    absl::MutexLock lock(&s->mu);
    for (const BlockEntry* e : s->set) {
      if (!HeldByCaller(*e)) continue;
      out->push_back(e->data_offset());
      out->push_back(e->key_offset());
    }
  }
}

uint64_t BlockIndex::evictable() const {
  uint64_t n = 0;
  for (const auto& s : shards_) {
    absl::MutexLock lock(&s->mu);
    n += s->lru_size;
  }
  return n;
}

}  // namespace kvdepot

namespace kvdepot {

std::optional<BlockEntry> BlockIndex::Peek(const KeyRef& key,
                                           absl::Span<char> trailer) {
  Shard& s = ShardFor(key.hash);
  absl::MutexLock lock(&s.mu);
  auto it = s.set.find(key);
  if (it == s.set.end()) return std::nullopt;
  BlockEntry copy = **it;
  if (!trailer.empty()) {
    std::memcpy(trailer.data(), base_ + copy.key_offset() + copy.key_len,
                trailer.size());
  }
  copy.lru_prev = copy.lru_next = nullptr;
  copy.ns_prev = copy.ns_next = nullptr;
  return copy;
}

std::unique_ptr<BlockEntry> BlockIndex::PopOldestEvictableOf(uint32_t ns_id) {
  return PopOldest(ns_id);
}

}  // namespace kvdepot
