#include "storage/block_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "storage/dram_arena.h"

namespace kvdepot {
namespace {

// Inserts a root entry for `key` of namespace `ns`, its key bytes in `buf`'s
// 64-byte unit `unit` (a plain buffer standing in for the arena), last used
// at `seq`. False when the index refused it.
bool InsertAt(BlockIndex& index, std::vector<char>& buf, uint32_t unit,
              const std::string& key, uint32_t ns, uint32_t seq) {
  std::copy(key.begin(), key.end(), buf.begin() + size_t{unit} * 64);
  auto e = std::make_unique<BlockEntry>();
  e->key_unit = unit;
  e->key_len = static_cast<uint16_t>(key.size());
  e->ns_id = ns;
  e->hash = BlockIndex::Hash(ns, key);
  e->size = 64;
  e->seq = seq;
  return index.Insert(std::move(e), "") == nullptr;
}

// The key of a popped entry ("<none>" for none).
std::string KeyIn(const std::vector<char>& buf, const std::unique_ptr<BlockEntry>& e) {
  return e ? std::string(buf.data() + e->key_offset(), e->key_len) : "<none>";
}

// Keys live in a plain buffer standing in for the arena; each entry's key
// goes in its own 64-byte unit.
class BlockIndexTest : public ::testing::Test {
 protected:
  BlockIndexTest() : buf_(1 << 20), index_(buf_.data()) {}

  // `hash` 0 means BlockIndex::Hash(ns, key); tests force collisions with
  // another (the caller supplies an entry's hash).
  BlockEntry* Put(const std::string& key, const std::string& parent = "",
                  uint32_t ns = 1, uint32_t seq = 0, uint64_t hash = 0) {
    auto e = std::make_unique<BlockEntry>();
    uint32_t unit = next_unit_++;
    std::copy(key.begin(), key.end(), buf_.begin() + unit * 64);
    e->key_unit = unit;
    e->key_len = static_cast<uint16_t>(key.size());
    e->ns_id = ns;
    e->hash = hash != 0 ? hash : BlockIndex::Hash(ns, key);
    e->size = 100;
    e->data_unit = 1000 + unit;
    e->seq = seq ? seq : index_.NextSeq();
    BlockEntry* raw = e.get();
    if (index_.Insert(std::move(e), parent) != nullptr) return nullptr;
    return raw;
  }

  // Evicts everything evictable; returns keys in eviction order.
  std::vector<std::string> DrainEvictable() {
    std::vector<std::string> order;
    bool progress = true;
    while (progress) {
      progress = false;
      for (int s = 0; s < BlockIndex::kShards; ++s) {
        // Pop everything evictable from each shard repeatedly, so the
        // order is the global recency order only within a shard; tests
        // below use one shard-independent property: leaves before parents.
        if (auto e = index_.PopEvictable(s)) {
          order.emplace_back(buf_.data() + e->key_offset(), e->key_len);
          progress = true;
        }
      }
    }
    return order;
  }

  std::string KeyOf(const BlockEntry& e) const {
    return std::string(buf_.data() + e.key_offset(), e.key_len);
  }

  std::vector<char> buf_;
  BlockIndex index_;
  uint32_t next_unit_ = 0;
};

TEST_F(BlockIndexTest, FindsByNamespaceAndKey) {
  ASSERT_NE(Put("alpha", "", 1), nullptr);
  ASSERT_NE(Put("alpha", "", 2), nullptr);  // other namespace: distinct
  EXPECT_TRUE(index_.Find(BlockIndex::MakeKey(1, "alpha"), false));
  EXPECT_TRUE(index_.Find(BlockIndex::MakeKey(2, "alpha"), false));
  EXPECT_FALSE(index_.Find(BlockIndex::MakeKey(3, "alpha"), false));
  EXPECT_FALSE(index_.Find(BlockIndex::MakeKey(1, "alph"), false));
  EXPECT_EQ(index_.blocks(), 2u);
}

TEST_F(BlockIndexTest, InsertIsPutIfAbsent) {
  BlockEntry* first = Put("k");
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(Put("k"), nullptr);
  auto hit = index_.Find(BlockIndex::MakeKey(1, "k"), false);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->entry, first);
  EXPECT_EQ(index_.blocks(), 1u);
}

TEST_F(BlockIndexTest, ChainEvictsLeavesBeforeParents) {
  // A chain a <- b <- c <- d and a branch b <- x; touch the root last so a
  // plain LRU would keep it, and check parents still go after children.
  Put("a");
  Put("b", "a");
  Put("c", "b");
  Put("d", "c");
  Put("x", "b");
  index_.Find(BlockIndex::MakeKey(1, "d"), false);
  EXPECT_EQ(index_.evictable(), 2u);  // only the leaves d and x
  std::vector<std::string> order = DrainEvictable();
  ASSERT_EQ(order.size(), 5u);
  auto pos = [&](const std::string& k) {
    return std::find(order.begin(), order.end(), k) - order.begin();
  };
  EXPECT_LT(pos("d"), pos("c"));
  EXPECT_LT(pos("c"), pos("b"));
  EXPECT_LT(pos("x"), pos("b"));
  EXPECT_LT(pos("b"), pos("a"));
  EXPECT_EQ(index_.blocks(), 0u);
}

TEST_F(BlockIndexTest, PinnedEntriesAreNeverEvictedOrRemoved) {
  Put("p");
  Put("q");
  auto hit = index_.Find(BlockIndex::MakeKey(1, "p"), /*pin=*/true);
  ASSERT_TRUE(hit);
  std::vector<std::string> order = DrainEvictable();
  EXPECT_EQ(order, std::vector<std::string>{"q"});
  std::unique_ptr<BlockEntry> out;
  EXPECT_EQ(index_.Remove(BlockIndex::MakeKey(1, "p"), &out),
            BlockIndex::RemoveOutcome::kPinned);
  index_.Unpin(hit->entry);
  EXPECT_EQ(index_.Remove(BlockIndex::MakeKey(1, "p"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  EXPECT_EQ(index_.Remove(BlockIndex::MakeKey(1, "p"), &out),
            BlockIndex::RemoveOutcome::kMissing);
}

// RemovePinned takes the caller's entry only while the caller's pin is its
// only one and it is not being demoted; the pin goes with it, and its
// parent becomes evictable again.
TEST_F(BlockIndexTest,
       RemovePinnedTakesTheEntryOnlyWhenTheCallersPinIsItsOnlyOne) {
  Put("root");
  Put("child", "root");
  Put("other");
  const uint64_t all_unpinned = index_.unpinned_bytes();
  BlockEntry* e = index_.PinIfPresent(BlockIndex::MakeKey(1, "child"));
  ASSERT_NE(e, nullptr);
  const uint64_t unpinned = index_.unpinned_bytes();
  ASSERT_LT(unpinned, all_unpinned);
  ASSERT_GT(unpinned, 0u);
  auto reader = index_.Find(BlockIndex::MakeKey(1, "child"), /*pin=*/true);
  ASSERT_TRUE(reader);
  std::unique_ptr<BlockEntry> out;
  EXPECT_EQ(index_.RemovePinned(e, &out), BlockIndex::RemoveOutcome::kPinned);
  EXPECT_EQ(out, nullptr);
  index_.Unpin(reader->entry);
  ASSERT_EQ(index_.RemovePinned(e, &out), BlockIndex::RemoveOutcome::kRemoved);
  EXPECT_EQ(KeyIn(buf_, out), "child");
  EXPECT_EQ(out->pins, 0u);
  // Its bytes left the pinned ones, not the others' (unpinned_bytes clamps
  // at 0: a second subtraction would show as 0).
  EXPECT_EQ(index_.unpinned_bytes(), unpinned);
  EXPECT_FALSE(index_.Find(BlockIndex::MakeKey(1, "child"), false));
  EXPECT_EQ(index_.blocks(), 2u);
  // Its parent, no longer held by a child, is evictable with the other.
  std::vector<std::string> order = DrainEvictable();
  std::sort(order.begin(), order.end());
  EXPECT_EQ(order, (std::vector<std::string>{"other", "root"}));

  // Being demoted: kept, whoever pins it.
  Put("d");
  std::optional<BlockIndex::Demotion> dem = index_.BeginDemotion();
  ASSERT_TRUE(dem);
  BlockEntry* d = index_.PinIfPresent(BlockIndex::MakeKey(1, "d"));
  ASSERT_EQ(d, dem->entry);
  EXPECT_EQ(index_.RemovePinned(d, &out), BlockIndex::RemoveOutcome::kDemoting);
  index_.Unpin(d);
  EXPECT_NE(index_.EndDemotion(dem->entry), nullptr);
}

// An entry marked corrupt is absent to Find and PinIfPresent (so that its
// pins drain), but still holds its key: a put-if-absent of the key finds it,
// and PinIfPresent(even_corrupt) and Remove reach it.
TEST_F(BlockIndexTest, AnEntryMarkedCorruptIsPassedByUntilRemoved) {
  Put("bad");
  const BlockIndex::KeyRef key = BlockIndex::MakeKey(1, "bad");
  auto reader = index_.Find(key, /*pin=*/true);
  ASSERT_TRUE(reader);
  EXPECT_FALSE(index_.IsCorrupt(reader->entry));
  EXPECT_TRUE(index_.MarkCorrupt(reader->entry));
  EXPECT_FALSE(index_.MarkCorrupt(reader->entry)) << "marked already";
  EXPECT_TRUE(index_.IsCorrupt(reader->entry));
  EXPECT_FALSE(index_.Find(key, /*pin=*/false));
  EXPECT_FALSE(index_.Find(key, /*pin=*/true));
  EXPECT_EQ(index_.PinIfPresent(key), nullptr);
  BlockEntry* e = index_.PinIfPresent(key, /*even_corrupt=*/true);
  ASSERT_EQ(e, reader->entry);
  index_.Unpin(e);
  // Its key is taken still.
  EXPECT_EQ(Put("bad"), nullptr) << "inserted beside the marked entry";
  index_.Unpin(reader->entry);
  std::unique_ptr<BlockEntry> out;
  ASSERT_EQ(index_.Remove(key, &out), BlockIndex::RemoveOutcome::kRemoved);
  // Stored again: a new entry, not marked.
  BlockEntry* again = Put("bad");
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(index_.Find(key, /*pin=*/false));
}

// A pin count at its limit refuses another pin (a miss, for a lookup)
// instead of wrapping to 0: a wrapped count would let the pinned block be
// evicted, and its holders' Unpins would touch freed memory.
TEST_F(BlockIndexTest, APinCountNeverWraps) {
  BlockEntry* e = Put("a");
  ASSERT_NE(e, nullptr);
  const BlockIndex::KeyRef key = BlockIndex::MakeKey(1, "a");
  ASSERT_TRUE(index_.Find(key, /*pin=*/true).has_value());
  // 2^32 pins take too long: start the count just below its limit (the
  // test is the entry's only user, and it stays held by a caller).
  e->pins = BlockIndex::kMaxPins - 1;
  ASSERT_TRUE(index_.Find(key, /*pin=*/true).has_value());
  EXPECT_EQ(e->pins, BlockIndex::kMaxPins);
  EXPECT_FALSE(index_.Find(key, /*pin=*/true).has_value());
  EXPECT_EQ(index_.PinIfPresent(key), nullptr);
  EXPECT_FALSE(index_.AddPin(e));
  EXPECT_EQ(e->pins, BlockIndex::kMaxPins);
  EXPECT_TRUE(index_.Find(key, /*pin=*/false).has_value());  // still there
  // Still pinned: neither evicted nor removed.
  EXPECT_EQ(index_.PopOldestEvictable(), nullptr);
  std::unique_ptr<BlockEntry> out;
  EXPECT_EQ(index_.Remove(key, &out), BlockIndex::RemoveOutcome::kPinned);
  e->pins = 1;
  index_.Unpin(e);
  ASSERT_NE(index_.PinIfPresent(key), nullptr);  // room again
  index_.Unpin(e);
  EXPECT_EQ(index_.Remove(key, &out), BlockIndex::RemoveOutcome::kRemoved);
}

TEST_F(BlockIndexTest, LruOrderWithinAShard) {
  // Find keys that share a shard, then check recency order among them.
  std::vector<std::string> same;
  uint64_t shard0 = BlockIndex::Hash(1, "k0") >> (64 - BlockIndex::kShardBits);
  for (int i = 0; same.size() < 3; ++i) {
    std::string k = "k" + std::to_string(i);
    if ((BlockIndex::Hash(1, k) >> (64 - BlockIndex::kShardBits)) == shard0) {
      same.push_back(k);
    }
  }
  int shard = static_cast<int>(shard0);
  for (const auto& k : same) Put(k);
  index_.Find(BlockIndex::MakeKey(1, same[0]), false);  // most recent now
  auto key_of = [&](std::unique_ptr<BlockEntry> e) {
    return std::string(buf_.data() + e->key_offset(), e->key_len);
  };
  EXPECT_EQ(key_of(index_.PopEvictable(shard)), same[1]);
  EXPECT_EQ(key_of(index_.PopEvictable(shard)), same[2]);
  EXPECT_EQ(key_of(index_.PopEvictable(shard)), same[0]);
  EXPECT_EQ(index_.PopEvictable(shard), nullptr);
}

TEST_F(BlockIndexTest, PopOldestEvictableFollowsLastUseAcrossShards) {
  // 200 keys spread over the shards, stored in order; then the first ten
  // are looked up again. Eviction must take keys 10..199 in store order,
  // then the looked-up ten.
  for (int i = 0; i < 200; ++i) Put("k" + std::to_string(i));
  const uint32_t later = index_.NextSeq();
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(index_.Find(BlockIndex::MakeKey(1, "k" + std::to_string(i)), false, later));
  }
  std::vector<std::string> order;
  while (auto e = index_.PopOldestEvictable()) {
    order.emplace_back(buf_.data() + e->key_offset(), e->key_len);
  }
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 190; ++i) EXPECT_EQ(order[i], "k" + std::to_string(i + 10));
  for (int i = 190; i < 200; ++i) {
    int k = std::stoi(order[i].substr(1));
    EXPECT_LT(k, 10) << order[i];
  }
}

TEST_F(BlockIndexTest, RemoveNamespaceKeepsPinnedAndOtherNamespaces) {
  Put("a", "", 1);
  Put("b", "a", 1);
  Put("c", "", 2);
  auto hit = index_.Find(BlockIndex::MakeKey(1, "a"), true);
  uint64_t pinned = 0;
  uint64_t demoting = 0;
  auto removed = index_.RemoveNamespace(1, &pinned, &demoting);
  EXPECT_EQ(removed.size(), 1u);
  EXPECT_EQ(pinned, 1u);
  EXPECT_TRUE(index_.Find(BlockIndex::MakeKey(2, "c"), false));
  // "a" lost its only child: once unpinned it is evictable.
  index_.Unpin(hit->entry);
  EXPECT_EQ(DrainEvictable().size(), 2u);  // a and c
}

// A block being demoted stays findable; removing it waits for the demotion
// (kDemoting), and it leaves the index when the demotion ends.
TEST_F(BlockIndexTest, AnEntryBeingDemotedStaysFindableUntilItsDemotionEnds) {
  Put("old", "", 1, 10);
  Put("new", "", 1, 20);
  std::optional<BlockIndex::Demotion> d = index_.BeginDemotion();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(std::string(buf_.data() + d->entry->key_offset(), d->entry->key_len), "old");
  EXPECT_EQ(d->parent_key, "");
  EXPECT_TRUE(index_.Find(BlockIndex::MakeKey(1, "old"), false));
  std::unique_ptr<BlockEntry> out;
  EXPECT_EQ(index_.Remove(BlockIndex::MakeKey(1, "old"), &out),
            BlockIndex::RemoveOutcome::kDemoting);
  uint64_t pinned = 0, demoting = 0;
  auto removed = index_.RemoveNamespace(1, &pinned, &demoting);
  EXPECT_EQ(removed.size(), 1u);  // "new"
  EXPECT_EQ(pinned, 0u);
  EXPECT_EQ(demoting, 1u);
  // Not offered to another demotion or eviction meanwhile.
  EXPECT_FALSE(index_.BeginDemotion().has_value());
  EXPECT_EQ(index_.PopOldestEvictable(), nullptr);
  std::unique_ptr<BlockEntry> gone = index_.EndDemotion(d->entry);
  ASSERT_NE(gone, nullptr);
  EXPECT_FALSE(index_.Find(BlockIndex::MakeKey(1, "old"), false));
  EXPECT_EQ(index_.blocks(), 0u);
}

// A lookup that pins a block being demoted, or a child stored meanwhile,
// keeps it in DRAM; the demotion carries the cached parent's key.
TEST_F(BlockIndexTest, ADemotionKeepsAnEntryPinnedOrGivenAChildMeanwhile) {
  Put("a", "", 1, 10);
  std::optional<BlockIndex::Demotion> d = index_.BeginDemotion();
  ASSERT_TRUE(d.has_value());
  auto hit = index_.Find(BlockIndex::MakeKey(1, "a"), true);
  ASSERT_TRUE(hit);
  EXPECT_EQ(index_.EndDemotion(d->entry), nullptr);
  EXPECT_EQ(index_.evictable(), 0u);  // still pinned by the lookup
  std::unique_ptr<BlockEntry> out;
  EXPECT_EQ(index_.Remove(BlockIndex::MakeKey(1, "a"), &out),
            BlockIndex::RemoveOutcome::kPinned);
  index_.Unpin(hit->entry);
  EXPECT_EQ(index_.evictable(), 1u);

  d = index_.BeginDemotion();
  ASSERT_TRUE(d.has_value());
  Put("a/child", "a", 1, 30);
  EXPECT_EQ(index_.EndDemotion(d->entry), nullptr);
  EXPECT_TRUE(index_.Find(BlockIndex::MakeKey(1, "a"), false));

  // Only the leaf is evictable; its demotion names its parent.
  d = index_.BeginDemotion();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->parent_key, "a");
  ASSERT_NE(index_.EndDemotion(d->entry), nullptr);
  d = index_.BeginDemotion();  // now the parent
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->parent_key, "");
  ASSERT_NE(index_.EndDemotion(d->entry), nullptr);
  EXPECT_EQ(index_.blocks(), 0u);
}

// Two keys of one namespace with one 64-bit hash (a collision, forced here)
// are two blocks. A namespace's quota eviction takes the evictable one: it
// neither spins on its pinned twin nor takes it, in either insertion order.
TEST_F(BlockIndexTest, QuotaEvictionTellsHashTwinsApartByKey) {
  for (uint32_t ns : {7u, 8u}) {
    const bool pinned_first = ns == 7;
    SCOPED_TRACE(pinned_first ? "pinned twin inserted first"
                              : "pinned twin inserted second");
    const uint64_t h = BlockIndex::Hash(ns, "pinned");
    BlockIndex::KeyRef pinned_key{ns, "pinned", h};
    if (pinned_first) {
      ASSERT_NE(Put("pinned", "", ns, 20), nullptr);
      ASSERT_NE(Put("evictable", "", ns, 10, h), nullptr);
    } else {
      ASSERT_NE(Put("evictable", "", ns, 10, h), nullptr);
      ASSERT_NE(Put("pinned", "", ns, 20), nullptr);
    }
    auto pin = index_.Find(pinned_key, /*pin=*/true);
    ASSERT_TRUE(pin);
    EXPECT_EQ(KeyOf(*pin->entry), "pinned");
    auto other = index_.Find({ns, "evictable", h}, false);
    ASSERT_TRUE(other);
    EXPECT_NE(other->entry, pin->entry);

    std::unique_ptr<BlockEntry> popped;
    absl::Notification done;
    std::thread pop([&] {
      popped = index_.PopOldestEvictableOf(ns);
      done.Notify();
    });
    // A bound against a hang: the pop is immediate unless it spins.
    const bool returned = done.WaitForNotificationWithTimeout(absl::Seconds(10));
    EXPECT_TRUE(returned) << "PopOldestEvictableOf spins on the pinned twin";
    if (!returned) index_.Unpin(pin->entry);  // lets it end
    pop.join();
    ASSERT_NE(popped, nullptr);
    EXPECT_EQ(KeyOf(*popped), "evictable");
    if (returned) {
      EXPECT_TRUE(index_.Find(pinned_key, false));
      EXPECT_EQ(index_.PopOldestEvictableOf(ns), nullptr);  // only the pinned
      index_.Unpin(pin->entry);
    }
  }
}

// A child links to its parent found by full key, never to another key that
// shares the parent's hash: the twin stays evictable, and a demotion of the
// child never names the twin as its parent.
TEST_F(BlockIndexTest, AChildNeverLinksToItsParentsHashTwin) {
  for (uint32_t ns : {1u, 2u}) {
    const bool twin_first = ns == 1;
    SCOPED_TRACE(twin_first ? "twin inserted first" : "parent inserted first");
    const uint64_t h = BlockIndex::Hash(ns, "parent");
    BlockIndex::KeyRef parent_key{ns, "parent", h};
    BlockIndex::KeyRef twin_key{ns, "twin", h};
    if (twin_first) {
      ASSERT_NE(Put("twin", "", ns, 30, h), nullptr);
      ASSERT_NE(Put("parent", "", ns, 20), nullptr);
    } else {
      ASSERT_NE(Put("parent", "", ns, 20), nullptr);
      ASSERT_NE(Put("twin", "", ns, 30, h), nullptr);
    }
    ASSERT_NE(Put("child", "parent", ns, 10), nullptr);
    std::optional<BlockEntry> twin = index_.Peek(twin_key);
    ASSERT_TRUE(twin);
    EXPECT_EQ(twin->children, 0u);
    EXPECT_TRUE(twin->flags & BlockEntry::kInLru) << "the twin is not evictable";
    std::optional<BlockEntry> parent = index_.Peek(parent_key);
    ASSERT_TRUE(parent);
    if (!twin_first) {
      // The parent came first: the link is made, to it.
      EXPECT_EQ(parent->children, 1u);
      EXPECT_FALSE(parent->flags & BlockEntry::kInLru);
    }

    // The child is the oldest evictable entry.
    std::optional<BlockIndex::Demotion> d = index_.BeginDemotion();
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(KeyOf(*d->entry), "child");
    EXPECT_NE(d->parent_key, "twin");
    if (!twin_first) {
      EXPECT_EQ(d->parent_key, "parent");
    }
    ASSERT_NE(index_.EndDemotion(d->entry), nullptr);
    // Its link released on the parent, not on the twin.
    EXPECT_EQ(index_.Peek(parent_key)->children, 0u);
    EXPECT_EQ(index_.Peek(twin_key)->children, 0u);
    EXPECT_TRUE(index_.Peek(parent_key)->flags & BlockEntry::kInLru);
    uint64_t pinned = 0, demoting = 0;
    EXPECT_EQ(index_.RemoveNamespace(ns, &pinned, &demoting).size(), 2u);
  }
  EXPECT_EQ(index_.blocks(), 0u);
}

// A namespace's eviction finds its least recently used entry behind any
// number of older entries of other namespaces (it looked at 4096 entries
// from the old end of each shard, and found none behind 300k), and its
// per-namespace order follows pins, unpins and lookups.
TEST(BlockIndexNamespaceTest, EvictionFindsTheNamespacesOldestBehindOthers) {
  constexpr int kForeign = 300000;
  std::vector<char> buf(size_t{kForeign + 16} * 64);
  BlockIndex index(buf.data());
  uint32_t next_unit = 0;
  auto put = [&](const std::string& key, uint32_t ns) {
    ASSERT_TRUE(InsertAt(index, buf, next_unit++, key, ns, index.NextSeq()));
  };
  auto key_of = [&](const std::unique_ptr<BlockEntry>& e) { return KeyIn(buf, e); };
  for (int i = 0; i < kForeign; ++i) put("f" + std::to_string(i), 1);
  for (const char* k : {"a", "b", "c"}) put(k, 2);
  auto pin = index.Find(BlockIndex::MakeKey(2, "a"), /*pin=*/true);
  ASSERT_TRUE(pin);
  EXPECT_EQ(key_of(index.PopOldestEvictableOf(2)), "b");
  index.Unpin(pin->entry);
  ASSERT_TRUE(index.Find(BlockIndex::MakeKey(2, "a"), false, index.NextSeq()));
  EXPECT_EQ(key_of(index.PopOldestEvictableOf(2)), "c");
  EXPECT_EQ(key_of(index.PopOldestEvictableOf(2)), "a");
  EXPECT_EQ(index.PopOldestEvictableOf(2), nullptr);
  EXPECT_EQ(index.blocks(), uint64_t{kForeign});
  EXPECT_EQ(index.evictable(), uint64_t{kForeign});
  // The other namespace's own order is intact: its oldest goes first.
  EXPECT_EQ(key_of(index.PopOldestEvictableOf(1)), "f0");
  EXPECT_EQ(key_of(index.PopOldestEvictable()), "f1");
}

// A parent removed explicitly while its child is cached, then inserted
// again: the new entry counts the old child (it names the same key), and
// that child's release counts down the new entry, not below its new
// child. (The old child's release took the new entry's count from its new
// child, making it evictable before it.)
TEST_F(BlockIndexTest, AParentInsertedAgainAdoptsTheChildrenOfItsRemovedSelf) {
  Put("P");
  Put("C", "P");
  std::unique_ptr<BlockEntry> out;
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "P"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  // Meanwhile the child's demotion still names its parent's key.
  std::optional<BlockIndex::Demotion> d = index_.BeginDemotion();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(KeyOf(*d->entry), "C");
  EXPECT_EQ(d->parent_key, "P");
  index_.AddPin(d->entry);  // keeps C through the demotion's end
  EXPECT_EQ(index_.EndDemotion(d->entry), nullptr);
  index_.Unpin(d->entry);

  ASSERT_NE(Put("P"), nullptr);
  EXPECT_EQ(index_.Peek(BlockIndex::MakeKey(1, "P"))->children, 1u);
  ASSERT_NE(Put("C2", "P"), nullptr);
  EXPECT_EQ(index_.Peek(BlockIndex::MakeKey(1, "P"))->children, 2u);
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "C"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  std::optional<BlockEntry> p = index_.Peek(BlockIndex::MakeKey(1, "P"));
  EXPECT_EQ(p->children, 1u);
  EXPECT_FALSE(p->flags & BlockEntry::kInLru);
  EXPECT_EQ(DrainEvictable(), (std::vector<std::string>{"C2", "P"}));
}

// While the removed parent's children are cached, another key of its hash
// (a collision, forced here) is a twin: their links never count on it.
TEST_F(BlockIndexTest, AnotherKeyOfARemovedParentsHashIsATwin) {
  const uint64_t h = BlockIndex::Hash(1, "P");
  Put("P");
  Put("C", "P");
  std::unique_ptr<BlockEntry> out;
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "P"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  ASSERT_NE(Put("T", "", 1, 0, h), nullptr);
  std::optional<BlockEntry> t = index_.Peek({1, "T", h});
  ASSERT_TRUE(t);
  EXPECT_TRUE(t->flags & BlockEntry::kHashTwin);
  EXPECT_EQ(t->children, 0u);
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "C"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  EXPECT_EQ(index_.Peek({1, "T", h})->children, 0u);
  // The children gone, the key comes back childless.
  ASSERT_NE(Put("P"), nullptr);
  EXPECT_EQ(index_.Peek(BlockIndex::MakeKey(1, "P"))->children, 0u);
  EXPECT_EQ(DrainEvictable().size(), 2u);
}

// A removed parent's key inserted again naming one of its own cached
// descendants as its parent: it adopts its old children, and a link to that
// parent would close a cycle (each waiting for the other to leave: never
// evictable, though counted as unpinned). It is left unlinked, a root, so
// the chain still drains leaves first. (It linked, and neither ever left.)
TEST_F(BlockIndexTest, AParentInsertedBelowItsOwnChildIsLeftARoot) {
  Put("A");
  Put("B", "A");
  std::unique_ptr<BlockEntry> out;
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "A"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  ASSERT_NE(Put("A", "B"), nullptr);
  std::optional<BlockEntry> a = index_.Peek(BlockIndex::MakeKey(1, "A"));
  std::optional<BlockEntry> b = index_.Peek(BlockIndex::MakeKey(1, "B"));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->children, 1u);  // B still names it
  EXPECT_FALSE(a->flags & BlockEntry::kLinked);
  EXPECT_EQ(b->children, 0u);
  EXPECT_TRUE(b->flags & BlockEntry::kInLru);
  EXPECT_EQ(DrainEvictable(), (std::vector<std::string>{"B", "A"}));
  EXPECT_EQ(index_.blocks(), 0u);
}

// The same through a longer chain (A <- B <- C <- D, A inserted again under
// D): the walk up from the new parent finds the entry's own key. A parent
// that is not its descendant is linked as usual.
TEST_F(BlockIndexTest, ACycleThroughALongerChainIsNotClosed) {
  Put("A");
  Put("B", "A");
  Put("C", "B");
  Put("D", "C");
  Put("X");
  std::unique_ptr<BlockEntry> out;
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "A"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  ASSERT_NE(Put("A", "D"), nullptr);
  EXPECT_FALSE(index_.Peek(BlockIndex::MakeKey(1, "A"))->flags & BlockEntry::kLinked);
  EXPECT_EQ(index_.Peek(BlockIndex::MakeKey(1, "D"))->children, 0u);
  // B removed too: B inserted again adopts C and may link to X.
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "B"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  ASSERT_NE(Put("B", "X"), nullptr);
  EXPECT_TRUE(index_.Peek(BlockIndex::MakeKey(1, "B"))->flags & BlockEntry::kLinked);
  EXPECT_EQ(index_.Peek(BlockIndex::MakeKey(1, "X"))->children, 1u);
  std::vector<std::string> order = DrainEvictable();
  ASSERT_EQ(order.size(), 5u);
  auto pos = [&](const std::string& k) {
    return std::find(order.begin(), order.end(), k) - order.begin();
  };
  EXPECT_LT(pos("D"), pos("C"));
  EXPECT_LT(pos("C"), pos("B"));
  EXPECT_LT(pos("B"), pos("X"));
  EXPECT_EQ(index_.blocks(), 0u);
}

// Parents removed and inserted again from many threads at once, each naming
// another key of the ring as its parent: no cycle forms however the inserts
// interleave (they walk and link holding the shards on the way), and nothing
// deadlocks. Everything drains in the end.
TEST(BlockIndexCycleTest, ConcurrentReinsertsNeverCloseACycle) {
  constexpr int kKeys = 16, kThreads = 4, kEpochs = 50, kRounds = 200;
  std::vector<char> buf(size_t{kKeys} * 64);
  auto key = [](int k) { return "k" + std::to_string(k); };
  for (int k = 0; k < kKeys; ++k) {
    const std::string s = key(k);
    std::copy(s.begin(), s.end(), buf.begin() + k * 64);
  }
  BlockIndex index(buf.data());
  auto insert = [&](int k, int parent) {
    auto e = std::make_unique<BlockEntry>();
    e->key_unit = static_cast<uint32_t>(k);
    e->key_len = static_cast<uint16_t>(key(k).size());
    e->ns_id = 1;
    e->hash = BlockIndex::Hash(1, key(k));
    e->size = 64;
    e->seq = index.NextSeq();
    // Refused when present: the entry is freed here.
    index.Insert(std::move(e), parent < 0 ? "" : key(parent)).reset();
  };
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    for (int k = 0; k < kKeys; ++k) insert(k, k == 0 ? -1 : k - 1);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        uint32_t x = 12345u + 977u * static_cast<uint32_t>(epoch * kThreads + t);
        for (int i = 0; i < kRounds; ++i) {
          x = x * 1103515245u + 12345u;
          const int k = (x >> 8) % kKeys;
          const int parent = (x >> 16) % kKeys;
          std::unique_ptr<BlockEntry> out;
          index.Remove(BlockIndex::MakeKey(1, key(k)), &out);
          insert(k, parent);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    const uint64_t blocks = index.blocks();
    uint64_t drained = 0;
    while (index.PopOldestEvictable() != nullptr) ++drained;
    ASSERT_EQ(drained, blocks) << "entries left on a cycle in epoch " << epoch;
    ASSERT_EQ(index.blocks(), 0u);
  }
}

// unpinned_bytes is the arena space of the entries no caller holds pinned
// (a demotion's own pin does not count).
TEST_F(BlockIndexTest, UnpinnedBytesLeaveOutWhatCallersPin) {
  Put("a", "", 1, 10);
  Put("b", "", 1, 20);
  const uint64_t each = DramArena::AllocationSize(100) + DramArena::AllocationSize(1);
  EXPECT_EQ(index_.unpinned_bytes(), 2 * each);
  BlockEntry* a = index_.PinIfPresent(BlockIndex::MakeKey(1, "a"));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(index_.PinIfPresent(BlockIndex::MakeKey(1, "zz")), nullptr);
  EXPECT_EQ(index_.unpinned_bytes(), each);
  std::optional<BlockIndex::Demotion> d = index_.BeginDemotion();  // b
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(KeyOf(*d->entry), "b");
  EXPECT_EQ(index_.unpinned_bytes(), each);
  auto hit = index_.Find(BlockIndex::MakeKey(1, "b"), /*pin=*/true);
  EXPECT_EQ(index_.unpinned_bytes(), 0u);
  index_.Unpin(hit->entry);
  EXPECT_EQ(index_.unpinned_bytes(), each);
  ASSERT_NE(index_.EndDemotion(d->entry), nullptr);  // b leaves
  EXPECT_EQ(index_.unpinned_bytes(), 0u);
  index_.Unpin(a);
  EXPECT_EQ(index_.unpinned_bytes(), each);
  // PinIfPresent counted no lookup.
  EXPECT_EQ(index_.Peek(BlockIndex::MakeKey(1, "a"))->reads, 0u);
  std::unique_ptr<BlockEntry> out;
  ASSERT_EQ(index_.Remove(BlockIndex::MakeKey(1, "a"), &out),
            BlockIndex::RemoveOutcome::kRemoved);
  EXPECT_EQ(index_.unpinned_bytes(), 0u);
}

// Recency stamps are 32 bits, compared wrap-aware. A block left unused for
// about 2^31 stamps must still look older than fresh ones (it looked
// newest, and stayed while fresh blocks went).
TEST(BlockIndexSeqTest, AnOldStampNeverLooksNewerThanAFreshOne) {
  std::vector<char> buf(1 << 12);
  constexpr uint32_t kStart = (uint32_t{1} << 31) - 4;
  BlockIndex index(buf.data(), 0, kStart);
  uint32_t next_unit = 0;
  auto put = [&](const std::string& key, uint32_t ns, uint32_t seq) {
    ASSERT_TRUE(InsertAt(index, buf, next_unit++, key, ns, seq));
  };
  auto shard = [](uint32_t ns, const std::string& key) {
    return BlockIndex::Hash(ns, key) >> (64 - BlockIndex::kShardBits);
  };
  // Keys in another shard than "old" (in one shard, list order decides).
  auto fresh_key = [&](uint32_t ns) {
    for (int i = 0;; ++i) {
      std::string k = "new" + std::to_string(i);
      if (shard(ns, k) != shard(ns, "old")) return k;
    }
  };
  // Last used just under 2^31 stamps before the counter's start.
  put("old", 1, 1);
  put("old", 2, 1);
  for (int i = 0; i < 20; ++i) index.NextSeq();  // past 2^31
  const std::string new1 = fresh_key(1), new2 = fresh_key(2);
  put(new1, 1, index.NextSeq());
  put(new2, 2, index.NextSeq());
  auto key_of = [&](const std::unique_ptr<BlockEntry>& e) { return KeyIn(buf, e); };
  std::unique_ptr<BlockEntry> e = index.PopOldestEvictableOf(2);
  EXPECT_EQ(key_of(e), "old");
  e = index.PopOldestEvictable();
  EXPECT_EQ(key_of(e), "old");
  EXPECT_EQ(e->ns_id, 1u);
}

TEST(BlockEntryTest, MetadataStaysSmall) {
  EXPECT_LE(sizeof(BlockEntry), 88u);
}

}  // namespace
}  // namespace kvdepot
