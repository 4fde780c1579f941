#include "storage/tiered_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "rocksdb/env.h"
#include "storage/checksum.h"
#include "storage/fake_clock.h"
#include "storage/fault_injection_fs.h"
#include "storage/internal/sync_point.h"
#include "storage/nvme_tier.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;
using Code = absl::StatusCode;

constexpr uint64_t kCap = 4 << 20;  // 4 MiB DRAM tier

class TieredStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(StoreOptions{}); }

  void Reopen(StoreOptions opts) {
    opts.dram_capacity = kCap;
    opts.hugepages = HugePageMode::kOff;
    opts.background_eviction = false;
    store_.reset();
    auto s = NewTieredStore(opts, &clock_);
    ASSERT_OK(s);
    store_ = std::move(s).value();
    auto session = store_->OpenSession(absl::ZeroDuration(), "test");
    ASSERT_OK(session);
    sid_ = session->id;
  }

  // Two-phase put of one block with the given bytes.
  absl::StatusOr<CommitOutcome> Put(const std::string& key,
                                    const std::string& bytes,
                                    const std::string& parent = "",
                                    const std::string& ns = "ns") {
    PutSpec spec{key, parent, bytes.size()};
    auto r = store_->BeginPut(sid_, ns, {&spec, 1});
    if (!r.ok()) return r.status();
    if (r->slots[0].exists) return CommitOutcome::kAlreadyExists;
    {
      auto slot = store_->AcquireSlot(sid_, r->id, 0);
      if (!slot.ok()) return slot.status();
      std::memcpy((*slot)->bytes().data(), bytes.data(), bytes.size());
    }
    uint64_t sum = BlockChecksum(bytes);
    auto c = store_->CommitPut(sid_, r->id, {&sum, 1});
    if (!c.ok()) return c.status();
    return (*c)[0];
  }

  std::string Read(const std::string& key, const std::string& ns = "ns") {
    absl::string_view k = key;
    auto r = store_->Lookup(sid_, ns, {&k, 1}, false, true);
    EXPECT_OK(r);
    if (!r.ok() || !r->entries[0].found) return "<miss>";
    std::string out(store_->dram_region().base + r->entries[0].offset,
                    r->entries[0].size);
    EXPECT_EQ(BlockChecksum(out), r->entries[0].checksum);
    EXPECT_OK(store_->Unpin(sid_, r->pin_id));
    return out;
  }

  bool Has(const std::string& key, const std::string& ns = "ns") {
    absl::string_view k = key;
    auto r = store_->Lookup(sid_, ns, {&k, 1}, false, false);
    return r.ok() && r->entries[0].found;
  }

  // BeginPut of `specs` into "ns" is refused whole (InvalidArgument, saying
  // `why`) and reserves nothing.
  void ExpectPutRefused(absl::Span<const PutSpec> specs, const std::string& why) {
    auto refused = store_->BeginPut(sid_, "ns", specs);
    EXPECT_THAT(refused, StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(refused.status().message(), ::testing::HasSubstr(why));
    EXPECT_EQ(store_->Stats().reservations, 0u);
  }

  FakeClock clock_;
  std::unique_ptr<TieredStore> store_;
  SessionId sid_ = 0;
};

// A DRAM tier full of 20000-byte blocks (two 24 KiB slots per 64 KiB page,
// whose last 16 KiB hold nothing) has room for a big block once those
// blocks go: the pages' unusable ends come back with them. The room check
// took those ends for pinned space and refused the put.
TEST_F(TieredStoreTest, ABigPutIntoDramFullOfSlabPagesEvictsAndFits) {
  const std::string small(20000, 's');
  for (int n = 0; n < 200; ++n) ASSERT_OK(Put("s" + std::to_string(n), small));
  ASSERT_GT(store_->Stats().dram.evictions, 0u) << "DRAM never filled";
  const std::string big(7 << 19, 'b');  // 3.5 MiB
  ASSERT_OK(Put("big", big));
  EXPECT_EQ(Read("big"), big);
}

// A put of a block larger than any run of pages that evicting could free
// (pinned blocks lie in every such run) fails once evicting has freed as
// much as it needs, saying the tier is fragmented; it used to drop every
// unpinned block first, and fail all the same.
TEST_F(TieredStoreTest, ABigPutIntoAnArenaFragmentedByPinsDropsLittle) {
  const std::string block(64 << 10, 'f');
  std::vector<std::string> keys;
  for (int n = 0; store_->Stats().dram.evictions == 0 && n < 200; ++n) {
    keys.push_back("f" + std::to_string(n));
    ASSERT_OK(Put(keys.back(), block));
  }
  keys.pop_back();  // evicted one to fit
  // Every fourth block pinned: no run of more than 3 free pages can form.
  std::vector<PinId> pins;
  for (size_t i = 0; i < keys.size(); i += 4) {
    absl::string_view k = keys[i];
    auto r = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
    ASSERT_OK(r);
    if (r->entries[0].found) pins.push_back(r->pin_id);
  }
  ASSERT_GT(pins.size(), 10u);
  const uint64_t before = store_->Stats().dram.evictions;
  const std::string big(512 << 10, 'B');
  auto put = Put("big", big);
  EXPECT_THAT(put, StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(put.status().message(), ::testing::HasSubstr("fragmented"));
  // About what the put needed (8 blocks), not every unpinned block.
  EXPECT_LE(store_->Stats().dram.evictions - before, 12u);
  int kept = 0;
  for (const std::string& k : keys) kept += Has(k) ? 1 : 0;
  EXPECT_GT(kept, static_cast<int>(keys.size()) / 2);
  for (PinId pin : pins) EXPECT_OK(store_->Unpin(sid_, pin));
  // With the pins gone, the put fits.
  ASSERT_OK(Put("big", big));
  EXPECT_EQ(Read("big"), big);
}

TEST_F(TieredStoreTest, PutThenReadReturnsTheSameBytes) {
  std::string bytes(5000, 'x');
  bytes[17] = 'y';
  ASSERT_OK(Put("key1", bytes));
  EXPECT_EQ(Read("key1"), bytes);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.dram.blocks, 1u);
  EXPECT_EQ(st.puts, 1u);
  EXPECT_GE(st.dram.used_bytes, 5000u);
}

TEST_F(TieredStoreTest, BlocksAreInvisibleUntilCommitted) {
  std::string bytes(1000, 'a');
  PutSpec spec{"k", "", bytes.size()};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), bytes.data(), bytes.size());
  }
  EXPECT_FALSE(Has("k"));
  uint64_t sum = BlockChecksum(bytes);
  auto c = store_->CommitPut(sid_, r->id, {&sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
  EXPECT_TRUE(Has("k"));
}

// SlotHandle::Checksum hashes a slot as its bytes land, CopyIn copies and
// hashes them; CommitPut then takes such a slot by that checksum without
// hashing it again, and hashes every other slot as before.
TEST_F(TieredStoreTest, CommitTakesSlotsHashedAsTheirBytesLanded) {
  const std::string good(1000, 'v');
  const uint64_t sum = BlockChecksum(good);
  std::vector<PutSpec> specs = {{"hashed", "", good.size()},
                                {"copied", "", good.size()},
                                {"other", "", good.size()},
                                {"trusted", "", good.size()},
                                {"plain", "", good.size()},
                                {"plain-wrong", "", good.size()}};
  auto r = store_->BeginPut(sid_, "ns", specs);
  ASSERT_OK(r);
  for (uint32_t i = 0; i < specs.size(); ++i) {
    auto slot = store_->AcquireSlot(sid_, r->id, i);
    ASSERT_OK(slot);
    if (i == 1) {
      EXPECT_EQ((*slot)->CopyIn(good.data()), sum);
      continue;
    }
    std::memcpy((*slot)->bytes().data(), good.data(), good.size());
    if (i <= 3) {
      EXPECT_EQ((*slot)->Checksum(), sum) << i;
    }
    if (i == 3) {
      // Breaking the REQUIRES shows the skip: commit does not hash again.
      (*slot)->bytes()[0] = 'X';
    }
  }
  std::vector<uint64_t> sums = {sum, sum, sum + 7, sum, sum, sum + 1};
  auto c = store_->CommitPut(sid_, r->id, sums);
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
  EXPECT_EQ((*c)[1], CommitOutcome::kStored);
  EXPECT_EQ((*c)[2], CommitOutcome::kChecksumMismatch);
  EXPECT_EQ((*c)[3], CommitOutcome::kStored);
  EXPECT_EQ((*c)[4], CommitOutcome::kStored);  // hashed here
  EXPECT_EQ((*c)[5], CommitOutcome::kChecksumMismatch);
  EXPECT_EQ(Read("hashed"), good);
  EXPECT_EQ(Read("copied"), good);
  EXPECT_EQ(Read("plain"), good);
  EXPECT_FALSE(Has("other"));
  EXPECT_FALSE(Has("plain-wrong"));
}

// A CopyInUntil that stops at its deadline voids what the slot was hashed
// to before: its bytes are part old, part new, and the commit hashes them.
TEST_F(TieredStoreTest, ACopyStoppedAtItsDeadlineVoidsAnEarlierHash) {
  const std::string old_bytes(3 << 20, 'o');
  const std::string new_bytes(old_bytes.size(), 'n');
  const uint64_t old_sum = BlockChecksum(old_bytes);
  PutSpec spec{"k", "", old_bytes.size()};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    const absl::Span<char> bytes = (*slot)->bytes();
    // Until a copy stops part way (the deadline is checked before every
    // MiB: one that passes within the first MiB stops it after that).
    bool partial = false;
    for (int attempt = 0; attempt < 200 && !partial; ++attempt) {
      ASSERT_EQ((*slot)->CopyIn(old_bytes.data()), old_sum);
      const absl::Time deadline =
          absl::Now() + absl::Microseconds(10 * (attempt % 20 + 1));
      if ((*slot)->CopyInUntil(new_bytes.data(), deadline).has_value())
        continue;
      partial = bytes.front() == 'n' && bytes.back() == 'o';
    }
    ASSERT_TRUE(partial) << "no copy stopped part way";
  }
  auto c = store_->CommitPut(sid_, r->id, {&old_sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kChecksumMismatch);
  EXPECT_FALSE(Has("k"));
}

TEST_F(TieredStoreTest, SecondPutIsANoOpAndKeepsTheFirstBytes) {
  ASSERT_OK(Put("k", std::string(100, '1')));
  auto second = Put("k", std::string(100, '2'));
  ASSERT_OK(second);
  EXPECT_EQ(*second, CommitOutcome::kAlreadyExists);
  EXPECT_EQ(Read("k"), std::string(100, '1'));
  EXPECT_EQ(store_->Stats().dram.blocks, 1u);
}

// Keys are content addresses: a put naming a stored key with another size
// is not the same block (another layout, or a client's bug). It is refused
// whole, reserving nothing, and the stored block stays as it was.
TEST_F(TieredStoreTest, APutOfAStoredKeyWithAnotherSizeIsRefused) {
  ASSERT_OK(Put("k", std::string(100, '1')));
  uint64_t used = store_->Stats().dram.used_bytes;
  PutSpec specs[2] = {{"new", "", 64}, {"k", "", 101}};
  ExpectPutRefused(specs, "stored with 100 bytes");
  EXPECT_EQ(store_->Stats().dram.used_bytes, used);
  EXPECT_FALSE(Has("new"));
  EXPECT_EQ(Read("k"), std::string(100, '1'));
  // The stored block is not left pinned by the refused put.
  auto evicted = store_->Evict("ns", {"k"}, false);
  ASSERT_OK(evicted);
  EXPECT_EQ(evicted->evicted_blocks, 1u);
}

// A key named twice in one batch is put once, by its first slot; both must
// name one block. The later one is answered as stored already: no second
// slot, no second quota charge (a batch of one block named twice fit no
// quota under twice its size).
TEST_F(TieredStoreTest, AKeyNamedTwiceInABatchIsPutOnce) {
  PutSpec differ[2] = {{"d", "", 64}, {"d", "", 65}};
  ExpectPutRefused(differ, "given earlier in the batch");

  ASSERT_OK(store_->SetQuota("ns", 96));  // one block, not two
  PutSpec same[2] = {{"s", "", 64}, {"s", "", 64}};
  auto r = store_->BeginPut(sid_, "ns", same);
  ASSERT_OK(r);
  EXPECT_FALSE(r->slots[0].exists);
  EXPECT_EQ(r->slots[0].repeat_of, -1);
  EXPECT_TRUE(r->slots[1].exists);
  EXPECT_EQ(r->slots[1].repeat_of, 0);
  EXPECT_FALSE(store_->AcquireSlot(sid_, r->id, 1).ok());
  std::string a(64, 'a');
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), a.data(), 64);
  }
  uint64_t sums[2] = {BlockChecksum(a), BlockChecksum(a)};
  auto c = store_->CommitPut(sid_, r->id, sums);
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
  EXPECT_EQ((*c)[1], CommitOutcome::kAlreadyExists);
  EXPECT_EQ(Read("s"), a);
  EXPECT_EQ(store_->Stats().dram.blocks, 1u);
  EXPECT_EQ(store_->Stats().reservations, 0u);

  // The first slot's bytes refused: the repeat, which is those bytes, is
  // refused with it (not "stored already"), and nothing is stored.
  ASSERT_OK(store_->SetQuota("ns", 160));  // s and one more
  PutSpec bad[3] = {{"b", "", 64}, {"s", "", 64}, {"b", "", 64}};
  r = store_->BeginPut(sid_, "ns", bad);
  ASSERT_OK(r);
  EXPECT_EQ(r->slots[1].repeat_of, -1);  // stored before the batch
  EXPECT_EQ(r->slots[2].repeat_of, 0);
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), a.data(), 64);
  }
  uint64_t wrong[3] = {BlockChecksum(a) ^ 1, BlockChecksum(a),
                       BlockChecksum(a) ^ 1};
  c = store_->CommitPut(sid_, r->id, wrong);
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kChecksumMismatch);
  EXPECT_EQ((*c)[1], CommitOutcome::kAlreadyExists);
  EXPECT_EQ((*c)[2], CommitOutcome::kChecksumMismatch);
  EXPECT_EQ(store_->Stats().dram.blocks, 1u);
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

// A client outliving a restart may release a pin of the old process: the
// new one must not hold a pin of that number (ids count from 1 in every
// process, before). Pins and reservations share the counter.
TEST_F(TieredStoreTest, PinIdsOfAnotherProcessAreNotThisOnes) {
  ASSERT_OK(Put("k", std::string(64, 'k')));
  auto pin_in = [&](TieredStore& store, SessionId session) -> PinId {
    absl::string_view k = "k";
    auto r = store.Lookup(session, "ns", {&k, 1}, false, true);
    EXPECT_OK(r);
    return r.ok() ? r->pin_id : 0;
  };
  const PinId before = pin_in(*store_, sid_);
  ASSERT_NE(before, 0u);
  EXPECT_LT(before, uint64_t{1} << 52);  // exact as a JSON number
  Reopen(StoreOptions{});                // the daemon restarted
  ASSERT_OK(Put("k", std::string(64, 'k')));
  const PinId after = pin_in(*store_, sid_);
  ASSERT_NE(after, 0u);
  EXPECT_NE(after, before);
  EXPECT_FALSE(store_->Unpin(sid_, before).ok());
  EXPECT_EQ(store_->Stats().pins, 1u);
  EXPECT_OK(store_->Unpin(sid_, after));
}

TEST_F(TieredStoreTest, RacingWritersPublishOnlyOnce) {
  // Both reserve before either commits; the loser's slot is freed.
  PutSpec spec{"k", "", 64};
  auto r1 = store_->BeginPut(sid_, "ns", {&spec, 1});
  auto r2 = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r1);
  ASSERT_OK(r2);
  std::string a(64, 'a'), b(64, 'b');
  for (auto [r, bytes] : {std::pair{&*r1, &a}, std::pair{&*r2, &b}}) {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), bytes->data(), 64);
  }
  uint64_t sa = BlockChecksum(a), sb = BlockChecksum(b);
  EXPECT_EQ((*store_->CommitPut(sid_, r1->id, {&sa, 1}))[0], CommitOutcome::kStored);
  EXPECT_EQ((*store_->CommitPut(sid_, r2->id, {&sb, 1}))[0],
            CommitOutcome::kAlreadyExists);
  EXPECT_EQ(Read("k"), a);
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

TEST_F(TieredStoreTest, ChecksumMismatchIsNotPublishedAndFreesTheSlot) {
  uint64_t before = store_->Stats().dram.used_bytes;
  PutSpec spec{"k", "", 128};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  uint64_t wrong = 12345;
  auto c = store_->CommitPut(sid_, r->id, {&wrong, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kChecksumMismatch);
  EXPECT_FALSE(Has("k"));
  EXPECT_EQ(store_->Stats().dram.used_bytes, before);
}

TEST_F(TieredStoreTest, RejectsBadKeysSizesAndBatches) {
  std::string big_key(257, 'k');
  EXPECT_THAT(Put("", "x"), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Put(big_key, "x"), StatusIs(Code::kInvalidArgument));
  EXPECT_OK(Put(std::string(256, 'k'), "x"));
  EXPECT_THAT(Put("k", "x", std::string(300, 'p')), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Put("k", "x", "", "bad namespace!"), StatusIs(Code::kInvalidArgument));
  PutSpec zero{"z", "", 0};
  EXPECT_THAT(store_->BeginPut(sid_, "ns", {&zero, 1}),
              StatusIs(Code::kInvalidArgument));
  PutSpec huge{"h", "", kCap + 1};
  EXPECT_THAT(store_->BeginPut(sid_, "ns", {&huge, 1}),
              StatusIs(Code::kResourceExhausted));
  std::vector<absl::string_view> keys(1025, "k");
  EXPECT_THAT(store_->Lookup(sid_, "ns", keys, false, false),
              StatusIs(Code::kInvalidArgument));
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

TEST_F(TieredStoreTest, PrefixLookupStopsAtFirstMiss) {
  ASSERT_OK(Put("b0", "x"));
  ASSERT_OK(Put("b1", "x", "b0"));
  ASSERT_OK(Put("b3", "x", "b2"));
  std::vector<absl::string_view> keys = {"b0", "b1", "b2", "b3"};
  auto r = store_->Lookup(sid_, "ns", keys, /*prefix=*/true, false);
  ASSERT_OK(r);
  EXPECT_EQ(r->prefix_hits, 2u);
  EXPECT_TRUE(r->entries[1].found);
  EXPECT_FALSE(r->entries[3].found);  // not examined after the miss
  auto all = store_->Lookup(sid_, "ns", keys, /*prefix=*/false, false);
  ASSERT_OK(all);
  EXPECT_EQ(all->prefix_hits, 2u);
  EXPECT_TRUE(all->entries[3].found);
}

TEST_F(TieredStoreTest, PinnedLookupRequiresALiveSession) {
  ASSERT_OK(Put("k", "x"));
  absl::string_view k = "k";
  EXPECT_THAT(store_->Lookup(999, "ns", {&k, 1}, false, true),
              StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->Unpin(sid_, 424242), StatusIs(Code::kInvalidArgument));
}

TEST_F(TieredStoreTest, PinnedBlocksPerSessionAreBounded) {
  StoreOptions opts;
  opts.max_pinned_blocks_per_session = 3;
  Reopen(opts);
  ASSERT_OK(Put("k", "x"));
  absl::string_view k = "k";
  std::vector<PinId> pins;
  for (int i = 0; i < 3; ++i) {
    auto r = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
    ASSERT_OK(r);
    pins.push_back(r->pin_id);
  }
  EXPECT_THAT(store_->Lookup(sid_, "ns", {&k, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  EXPECT_OK(store_->Lookup(sid_, "ns", {&k, 1}, false, false));  // no pin: fine
  ASSERT_OK(store_->Unpin(sid_, pins[0]));
  EXPECT_OK(store_->Lookup(sid_, "ns", {&k, 1}, false, true));
  // A batch counts each key: two keys do not fit in one free reference.
  ASSERT_OK(store_->Unpin(sid_, pins[1]));
  ASSERT_OK(Put("k2", "y"));
  std::vector<absl::string_view> two = {"k", "k2"};
  EXPECT_OK(store_->Lookup(sid_, "ns", {&k, 1}, false, true));
  EXPECT_THAT(store_->Lookup(sid_, "ns", two, false, true),
              StatusIs(Code::kResourceExhausted));
}

// Sessions are bounded in all (max_sessions) and per peer
// (max_sessions_per_peer): one host's clients leaking sessions take no
// more than their share; a session's end, however it ends, gives its place
// back.
TEST_F(TieredStoreTest, SessionsAreBoundedPerPeerAndInAll) {
  StoreOptions opts;
  opts.max_sessions = 6;
  opts.max_sessions_per_peer = 2;
  Reopen(opts);  // the fixture's own session (no peer) is one of the 6
  std::vector<SessionId> a;
  for (int i = 0; i < 2; ++i) {
    auto s = store_->OpenSession(absl::ZeroDuration(), "a", "ipv4:10.0.0.1");
    ASSERT_OK(s) << i;
    a.push_back(s->id);
  }
  auto refused =
      store_->OpenSession(absl::ZeroDuration(), "a", "ipv4:10.0.0.1");
  EXPECT_THAT(refused, StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("max_sessions_per_peer"));
  // Another host is not held back by the first.
  auto b = store_->OpenSession(absl::ZeroDuration(), "b", "ipv4:10.0.0.2");
  ASSERT_OK(b);
  // A closed session gives its place back to its peer.
  ASSERT_OK(store_->CloseSession(a[0]));
  EXPECT_OK(store_->OpenSession(absl::ZeroDuration(), "a", "ipv4:10.0.0.1"));
  // Expired ones too (all of them here, the fixture's included).
  clock_.Advance(absl::Hours(2));
  store_->ExpireSessions();
  for (int i = 0; i < 2; ++i) {
    auto s = store_->OpenSession(absl::ZeroDuration(), "a", "ipv4:10.0.0.1");
    ASSERT_OK(s) << i;
  }
  // max_sessions still bounds them all.
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK(store_->OpenSession(absl::ZeroDuration(), "c",
                                  absl::StrCat("ipv4:10.0.1.", i)));
  }
  EXPECT_THAT(store_->OpenSession(absl::ZeroDuration(), "d", "ipv4:10.0.2.1"),
              StatusIs(Code::kResourceExhausted));
}

// Pins of one block each cost their heap beside their one reference:
// bounded by count too (max_pins_per_session, max_pins), not only by the
// references (which let 16.7M one-block pins, about 2.3 GiB, through).
TEST_F(TieredStoreTest, PinsAreBoundedByTheirNumberToo) {
  StoreOptions opts;
  opts.max_pins_per_session = 5;
  opts.max_pins = 8;
  Reopen(opts);
  ASSERT_OK(Put("k", "x"));
  absl::string_view k = "k";
  std::vector<PinId> mine;
  for (int i = 0; i < 5; ++i) {
    auto r = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
    ASSERT_OK(r) << i;
    mine.push_back(r->pin_id);
  }
  EXPECT_THAT(store_->Lookup(sid_, "ns", {&k, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  EXPECT_OK(store_->Lookup(sid_, "ns", {&k, 1}, false, false));  // no pin
  auto other = store_->OpenSession(absl::ZeroDuration(), "other");
  ASSERT_OK(other);
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(store_->Lookup(other->id, "ns", {&k, 1}, false, true)) << i;
  }
  // 8 pins in all: the other session, under its own limit, is refused too.
  EXPECT_THAT(store_->Lookup(other->id, "ns", {&k, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  // In-process callers (a gRPC Read stream) are not refused: clients at
  // the limit would stop every Read.
  auto internal = store_->Lookup(kInternalSession, "ns", {&k, 1}, false, true);
  ASSERT_OK(internal);
  ASSERT_OK(store_->Unpin(kInternalSession, internal->pin_id));
  ASSERT_OK(store_->Unpin(sid_, mine[0]));
  EXPECT_OK(store_->Lookup(other->id, "ns", {&k, 1}, false, true));
  EXPECT_EQ(store_->Stats().pins, 8u);
}

// A pinned lookup naming one key many times pins its block once: one
// lookup of max_batch_keys copies of a key used to add that many pins to
// it (and as many block references to the session's heap).
TEST_F(TieredStoreTest, APinnedLookupPinsAKeyNamedTwiceOnce) {
  ASSERT_OK(Put("a", "1"));
  ASSERT_OK(Put("b", "2"));
  std::vector<absl::string_view> keys(1024, "a");
  keys[1] = "b";
  keys[2] = "missing";
  auto r = store_->Lookup(sid_, "ns", keys, false, true);
  ASSERT_OK(r);
  for (size_t i = 0; i < keys.size(); ++i) {
    const LookupEntry& e = r->entries[i];
    if (i == 2) {
      EXPECT_FALSE(e.found);
      continue;
    }
    ASSERT_TRUE(e.found) << i;
    EXPECT_EQ(e.offset, r->entries[i == 1 ? 1 : 0].offset) << i;
  }
  EXPECT_EQ(store_->Stats().pinned_blocks, 2u);
  EXPECT_EQ(store_->Inspect("ns", "a")->pins, 1u);
  auto released = store_->Unpin(sid_, r->pin_id);
  ASSERT_OK(released);
  EXPECT_EQ(*released, 2u);
  EXPECT_EQ(store_->Inspect("ns", "a")->pins, 0u);
  EXPECT_EQ(store_->Stats().pinned_blocks, 0u);
  // A prefix lookup stops at the first miss, repeated keys after it too.
  std::vector<absl::string_view> prefix = {"a", "missing", "a"};
  r = store_->Lookup(sid_, "ns", prefix, true, true);
  ASSERT_OK(r);
  EXPECT_EQ(r->prefix_hits, 1u);
  EXPECT_TRUE(r->entries[0].found);
  EXPECT_FALSE(r->entries[2].found);
  EXPECT_EQ(store_->Inspect("ns", "a")->pins, 1u);
  ASSERT_OK(store_->Unpin(sid_, r->pin_id));
  EXPECT_EQ(store_->Inspect("ns", "a")->pins, 0u);
}

// Pins of all sessions together are bounded (max_pinned_blocks), in-process
// callers' included: many sessions, each within its own bound, could
// otherwise pin without limit.
TEST_F(TieredStoreTest, PinnedBlocksOfAllSessionsAreBounded) {
  StoreOptions opts;
  opts.max_pinned_blocks = 3;
  Reopen(opts);
  for (const char* k : {"a", "b", "c", "d"}) ASSERT_OK(Put(k, k));
  auto other = store_->OpenSession(absl::ZeroDuration(), "other");
  ASSERT_OK(other);
  std::vector<absl::string_view> ab = {"a", "b"};
  absl::string_view c = "c", d = "d";
  auto mine = store_->Lookup(sid_, "ns", ab, false, true);
  ASSERT_OK(mine);
  auto theirs = store_->Lookup(other->id, "ns", {&c, 1}, false, true);
  ASSERT_OK(theirs);
  ASSERT_OK(store_->HandOverPin(other->id, theirs->pin_id));  // still counts
  EXPECT_THAT(store_->Lookup(other->id, "ns", {&d, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(store_->Lookup(kInternalSession, "ns", {&d, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  EXPECT_OK(store_->Lookup(other->id, "ns", {&d, 1}, false, false));  // no pin
  ASSERT_OK(store_->Unpin(sid_, mine->pin_id));
  auto internal = store_->Lookup(kInternalSession, "ns", {&d, 1}, false, true);
  ASSERT_OK(internal);
  ASSERT_OK(store_->Lookup(other->id, "ns", {&d, 1}, false, true));
  EXPECT_THAT(store_->Lookup(sid_, "ns", {&d, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  ASSERT_OK(store_->Unpin(kInternalSession, internal->pin_id));
  ASSERT_OK(store_->Unpin(kInternalSession, theirs->pin_id));
  EXPECT_OK(store_->Lookup(sid_, "ns", ab, false, true));
}

// A pin handed over for a transfer (PushBlocks: the daemon's until the
// transfer ends, however long it stalls) still counts against its session's
// bound until released: stalled transfers cannot pin more than the bound.
TEST_F(TieredStoreTest, HandedOverPinsStillCountAgainstTheirSession) {
  StoreOptions opts;
  opts.max_pinned_blocks_per_session = 3;
  Reopen(opts);
  ASSERT_OK(Put("k", "x"));
  absl::string_view k = "k";
  std::vector<PinId> held;
  for (int i = 0; i < 3; ++i) {
    auto r = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
    ASSERT_OK(r);
    ASSERT_OK(store_->HandOverPin(sid_, r->pin_id));
    held.push_back(r->pin_id);
  }
  EXPECT_THAT(store_->Lookup(sid_, "ns", {&k, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  // Released by the store (the transfer ended): the session may pin again.
  ASSERT_OK(store_->Unpin(kInternalSession, held[0]));
  auto again = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
  ASSERT_OK(again);
  EXPECT_THAT(store_->Lookup(sid_, "ns", {&k, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  // The session's end does not release the handed-over pins; their release
  // after it is fine.
  ASSERT_OK(store_->CloseSession(sid_));
  EXPECT_EQ(store_->Stats().pins, 2u);
  ASSERT_OK(store_->Unpin(kInternalSession, held[1]));
  ASSERT_OK(store_->Unpin(kInternalSession, held[2]));
  EXPECT_EQ(store_->Stats().pins, 0u);
}

TEST_F(TieredStoreTest, FailedBatchPutFreesOnlyWhatItAllocated) {
  // A block that stays pinned at the start of the arena, then a two-block
  // put whose second block cannot fit: nothing may be freed twice, and the
  // pinned block's bytes must survive later puts of other contents.
  std::string first(1 << 20, '1');
  ASSERT_OK(Put("first", first));
  absl::string_view k = "first";
  auto pin = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
  ASSERT_OK(pin);
  const StoreStats before = store_->Stats();
  PutSpec specs[2] = {{"a", "", 1 << 20}, {"b", "", 3 << 20}};
  EXPECT_THAT(store_->BeginPut(sid_, "ns", specs),
              StatusIs(Code::kResourceExhausted));
  StoreStats after = store_->Stats();
  EXPECT_EQ(after.dram.used_bytes, before.dram.used_bytes);
  EXPECT_EQ(after.reservations, 0u);
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK(Put("other" + std::to_string(i), std::string(1 << 20, 'x')));
  }
  EXPECT_EQ(Read("first"), first);
  ASSERT_OK(store_->Unpin(sid_, pin->pin_id));
}

TEST_F(TieredStoreTest, PinsSurviveEvictionPressureAndFullTierFailsPut) {
  std::string block(512 << 10, 'p');  // 512 KiB
  ASSERT_OK(Put("pinned", block));
  absl::string_view k = "pinned";
  auto pin = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
  ASSERT_OK(pin);
  ASSERT_NE(pin->pin_id, 0u);
  // Write far more than the tier holds: old blocks are evicted, not the pin.
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(Put("fill" + std::to_string(i), block));
  }
  EXPECT_TRUE(Has("pinned"));
  EXPECT_FALSE(Has("fill0"));
  EXPECT_TRUE(Has("fill39"));
  EXPECT_GT(store_->Stats().dram.evictions, 0u);
  // Pin everything: a new put cannot make room, and its failure frees
  // nothing it did not allocate.
  std::vector<std::string> names;
  for (int i = 0; i < 40; ++i) names.push_back("fill" + std::to_string(i));
  std::vector<absl::string_view> views(names.begin(), names.end());
  auto all = store_->Lookup(sid_, "ns", views, false, true);
  ASSERT_OK(all);
  uint64_t used = store_->Stats().dram.used_bytes;
  EXPECT_THAT(Put("one-more", block), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(store_->Stats().reservations, 0u);
  EXPECT_EQ(store_->Stats().dram.used_bytes, used);
  // Unpinning makes room again; the new block does not land on a pinned one.
  ASSERT_OK(store_->Unpin(sid_, all->pin_id));
  std::string other(512 << 10, 'n');
  EXPECT_OK(Put("one-more", other));
  EXPECT_EQ(Read("pinned"), block);
  EXPECT_EQ(Read("one-more"), other);
}

TEST_F(TieredStoreTest, EvictionKeepsPrefixesOfCachedChains) {
  // Two chains of 4 x 256 KiB; chain A is older. Fill (without looking
  // anything up, which would count as use) until two blocks were evicted:
  // they must be chain A's last two, leaf first; chain A keeps its prefix
  // and chain B is untouched.
  std::string block(256 << 10, 'c');
  for (const char* c : {"A", "B"}) {
    for (int i = 0; i < 4; ++i) {
      std::string key = std::string(c) + std::to_string(i);
      std::string parent = i ? std::string(c) + std::to_string(i - 1) : "";
      ASSERT_OK(Put(key, block, parent));
    }
  }
  for (int i = 0; store_->Stats().dram.evictions < 2; ++i) {
    ASSERT_LT(i, 20);
    ASSERT_OK(Put("f" + std::to_string(i), block));
  }
  ASSERT_EQ(store_->Stats().dram.evictions, 2u);
  EXPECT_FALSE(Has("A3"));
  EXPECT_FALSE(Has("A2"));
  EXPECT_TRUE(Has("A1"));
  EXPECT_TRUE(Has("A0"));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(Has("B" + std::to_string(i))) << i;
}

TEST_F(TieredStoreTest, ExpiredSessionReleasesPinsAndReservations) {
  ASSERT_OK(Put("k", std::string(1000, 'k')));
  absl::string_view k = "k";
  ASSERT_OK(store_->Lookup(sid_, "ns", {&k, 1}, false, true));
  const uint64_t used_before = store_->Stats().dram.used_bytes;
  PutSpec spec{"pending", "", 100000};
  ASSERT_OK(store_->BeginPut(sid_, "ns", {&spec, 1}));
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.pins, 1u);
  EXPECT_EQ(st.reservations, 1u);
  uint64_t used_with_resv = st.dram.used_bytes;

  clock_.Advance(absl::Seconds(29));
  EXPECT_EQ(store_->ExpireSessions(), 0);
  ASSERT_OK(store_->KeepAlive(sid_));  // renews to now + 30 s
  clock_.Advance(absl::Seconds(29));
  EXPECT_EQ(store_->ExpireSessions(), 0);
  EXPECT_TRUE(store_->HasSession(sid_));
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(store_->ExpireSessions(), 1);
  EXPECT_FALSE(store_->HasSession(sid_));

  st = store_->Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.pins, 0u);
  EXPECT_EQ(st.reservations, 0u);
  EXPECT_LT(st.dram.used_bytes, used_with_resv);
  EXPECT_EQ(st.dram.used_bytes, used_before);
  EXPECT_THAT(store_->KeepAlive(sid_), StatusIs(Code::kNotFound));
  // The pin is gone: the block is evictable now.
  auto ev = store_->Evict("ns", {&k, 1}, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks, 1u);
}

// A session whose lease has run out is gone at once, before
// ExpireSessions ends it: none of its calls succeeds any more (a CommitPut
// after KeepAlive had said NOT_FOUND used to store the block).
TEST_F(TieredStoreTest, AnExpiredSessionIsGoneBeforeItIsReaped) {
  ASSERT_OK(Put("a", "1"));
  auto session = store_->OpenSession(absl::Seconds(1), "short");
  ASSERT_OK(session);
  const SessionId sid = session->id;
  absl::string_view a = "a";
  auto pin = store_->Lookup(sid, "ns", {&a, 1}, false, true);
  ASSERT_OK(pin);
  auto handed = store_->Lookup(sid, "ns", {&a, 1}, false, true);
  ASSERT_OK(handed);
  const std::string bytes(1000, 'b');
  PutSpec specs[2] = {{"b", "", bytes.size()}, {"c", "", bytes.size()}};
  auto r = store_->BeginPut(sid, "ns", specs);
  ASSERT_OK(r);
  {
    auto slot = store_->AcquireSlot(sid, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), bytes.data(), bytes.size());
  }
  clock_.Advance(absl::Milliseconds(1010));
  EXPECT_FALSE(store_->HasSession(sid));
  EXPECT_THAT(store_->KeepAlive(sid), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->AcquireSlot(sid, r->id, 1), StatusIs(Code::kNotFound));
  const uint64_t sums[2] = {BlockChecksum(bytes), BlockChecksum(bytes)};
  EXPECT_THAT(store_->CommitPut(sid, r->id, sums), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->AbortPut(sid, r->id), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->Unpin(sid, pin->pin_id), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->HandOverPin(sid, handed->pin_id), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->Lookup(sid, "ns", {&a, 1}, false, true),
              StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->BeginPut(sid, "ns", specs), StatusIs(Code::kNotFound));
  EXPECT_FALSE(Has("b"));
  // The reaper then releases what it held.
  EXPECT_EQ(store_->ExpireSessions(), 1);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.pins, 0u);
  EXPECT_EQ(st.reservations, 0u);
  EXPECT_FALSE(Has("b"));
  EXPECT_EQ(store_->Inspect("ns", "a")->pins, 0u);
}

TEST_F(TieredStoreTest, SlotHandleOutlivesAnAbortedReservation) {
  PutSpec spec{"k", "", 4096};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  auto slot = store_->AcquireSlot(sid_, r->id, 0);
  ASSERT_OK(slot);
  uint64_t sum = 0;
  EXPECT_THAT(store_->CommitPut(sid_, r->id, {&sum, 1}), StatusIs(Code::kAborted));
  uint64_t used = store_->Stats().dram.used_bytes;
  ASSERT_OK(store_->CloseSession(sid_));
  // Still writable and still allocated while the handle lives.
  std::memset((*slot)->bytes().data(), 7, 4096);
  EXPECT_EQ(store_->Stats().dram.used_bytes, used);
  slot->reset();
  EXPECT_LT(store_->Stats().dram.used_bytes, used);
}

// A commit while a slot is still being written is a conflict (Aborted),
// not a refusal of the put (FailedPrecondition is for draining and
// undeclared namespaces, on which clients stop putting): the reservation
// stays open and the same commit succeeds once the writer is done.
TEST_F(TieredStoreTest, CommitWhileASlotIsBeingWrittenIsAbortedAndRetryable) {
  const std::string bytes(1000, 'w');
  const uint64_t sum = BlockChecksum(bytes);
  PutSpec spec{"k", "", bytes.size()};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  auto slot = store_->AcquireSlot(sid_, r->id, 0);
  ASSERT_OK(slot);
  std::memcpy((*slot)->bytes().data(), bytes.data(), bytes.size());
  EXPECT_THAT(store_->CommitPut(sid_, r->id, {&sum, 1}), StatusIs(Code::kAborted));
  EXPECT_EQ(store_->Stats().reservations, 1u);
  EXPECT_FALSE(Has("k"));
  slot->reset();
  auto c = store_->CommitPut(sid_, r->id, {&sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
  EXPECT_EQ(Read("k"), bytes);
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

// session_reservations counts the two-phase puts of sessions, not those of
// in-process callers (a Write stream's), which a shutdown drain waits for
// through the stream instead.
TEST_F(TieredStoreTest, SessionReservationsLeaveOutInternalOnes) {
  PutSpec a{"a", "", 100}, b{"b", "", 100};
  auto mine = store_->BeginPut(sid_, "ns", {&a, 1});
  ASSERT_OK(mine);
  auto internal = store_->BeginPut(kInternalSession, "ns", {&b, 1});
  ASSERT_OK(internal);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.reservations, 2u);
  EXPECT_EQ(st.session_reservations, 1u);
  ASSERT_OK(store_->AbortPut(sid_, mine->id));
  st = store_->Stats();
  EXPECT_EQ(st.reservations, 1u);
  EXPECT_EQ(st.session_reservations, 0u);
  ASSERT_OK(store_->AbortPut(kInternalSession, internal->id));
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

// A slot has one writer at a time: a second AcquireSlot of it fails
// (Aborted: a conflict) while the first handle lives, and succeeds once it
// is released. Other slots of the reservation are not affected.
TEST_F(TieredStoreTest, ASlotHasOneWriterAtATime) {
  const std::string a(1000, 'a'), b(1000, 'b');
  std::vector<PutSpec> specs = {{"k0", "", a.size()}, {"k1", "", b.size()}};
  auto r = store_->BeginPut(sid_, "ns", specs);
  ASSERT_OK(r);
  auto first = store_->AcquireSlot(sid_, r->id, 0);
  ASSERT_OK(first);
  EXPECT_THAT(store_->AcquireSlot(sid_, r->id, 0), StatusIs(Code::kAborted));
  {
    auto other = store_->AcquireSlot(sid_, r->id, 1);
    ASSERT_OK(other);
    std::memcpy((*other)->bytes().data(), b.data(), b.size());
    EXPECT_THAT(store_->AcquireSlot(sid_, r->id, 1), StatusIs(Code::kAborted));
  }
  std::memcpy((*first)->bytes().data(), a.data(), a.size());
  first->reset();
  {
    auto again = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(again);
    EXPECT_EQ(std::string((*again)->bytes().data(), a.size()), a);
  }
  std::vector<uint64_t> sums = {BlockChecksum(a), BlockChecksum(b)};
  auto c = store_->CommitPut(sid_, r->id, sums);
  ASSERT_OK(c);
  EXPECT_THAT(*c, ::testing::Each(CommitOutcome::kStored));
  EXPECT_EQ(Read("k0"), a);
  EXPECT_EQ(Read("k1"), b);
}

// Verified before visible: a slot hashed as its bytes landed (Checksum,
// CopyIn) and then rewritten through a later handle is hashed again at
// commit, so the old hash cannot publish the new bytes (a Write stream
// aiming at a slot PullBlocks had filled and hashed). A later handle that
// hashes its own bytes is trusted for those.
TEST_F(TieredStoreTest, ASlotRewrittenAfterItsHashIsHashedAgainAtCommit) {
  const std::string a(1000, 'a'), b(1000, 'b');
  const uint64_t sum_a = BlockChecksum(a), sum_b = BlockChecksum(b);
  std::vector<PutSpec> specs = {{"rewritten", "", a.size()},
                                {"rehashed", "", a.size()}};
  auto r = store_->BeginPut(sid_, "ns", specs);
  ASSERT_OK(r);
  for (uint32_t i = 0; i < specs.size(); ++i) {
    auto slot = store_->AcquireSlot(sid_, r->id, i);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), a.data(), a.size());
    EXPECT_EQ((*slot)->Checksum(), sum_a) << i;
  }
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), b.data(), b.size());  // not hashed
  }
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 1);
    ASSERT_OK(slot);
    EXPECT_EQ((*slot)->CopyIn(b.data()), sum_b);
  }
  std::vector<uint64_t> sums = {sum_a, sum_b};
  auto c = store_->CommitPut(sid_, r->id, sums);
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kChecksumMismatch);
  EXPECT_EQ((*c)[1], CommitOutcome::kStored);
  EXPECT_FALSE(Has("rewritten"));
  EXPECT_EQ(Read("rehashed"), b);
}

// A pin or reservation whose session ended went with it: asking for it
// again is NotFound (the session is gone: its client must open another),
// not InvalidArgument, which stays for ids a live session never had.
TEST_F(TieredStoreTest, PinsAndReservationsOfAnEndedSessionAreNotFound) {
  ASSERT_OK(Put("a", "1"));
  absl::string_view a = "a";
  auto pin = store_->Lookup(sid_, "ns", {&a, 1}, false, true);
  ASSERT_OK(pin);
  PutSpec spec{"b", "", 4096};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  EXPECT_THAT(store_->Unpin(sid_, pin->pin_id + 100), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(store_->AcquireSlot(sid_, r->id + 100, 0), StatusIs(Code::kInvalidArgument));
  uint64_t sum = 0;
  EXPECT_THAT(store_->CommitPut(sid_, r->id + 100, {&sum, 1}),
              StatusIs(Code::kInvalidArgument));
  // Another live session asking for this one's: still InvalidArgument.
  auto other = store_->OpenSession(absl::ZeroDuration(), "other");
  ASSERT_OK(other);
  EXPECT_THAT(store_->Unpin(other->id, pin->pin_id), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(store_->AbortPut(other->id, r->id), StatusIs(Code::kInvalidArgument));

  ASSERT_OK(store_->CloseSession(sid_));
  EXPECT_THAT(store_->Unpin(sid_, pin->pin_id), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->AcquireSlot(sid_, r->id, 0), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->CommitPut(sid_, r->id, {&sum, 1}), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->AbortPut(sid_, r->id), StatusIs(Code::kNotFound));
  EXPECT_EQ(store_->Stats().reservations, 0u);
  EXPECT_EQ(store_->Stats().pins, 0u);
}

// A pin handed over to kInternalSession outlives its session and is
// released with kInternalSession.
TEST_F(TieredStoreTest, EndAllSessionsReleasesEveryClientsPinsAndReservations) {
  ASSERT_OK(Put("a", "1"));
  ASSERT_OK(Put("b", "2"));
  absl::string_view a = "a", b = "b";
  auto other = store_->OpenSession(absl::Seconds(30), "other");
  ASSERT_OK(other);
  ASSERT_OK(store_->Lookup(sid_, "ns", {&a, 1}, false, true));
  ASSERT_OK(store_->Lookup(other->id, "ns", {&b, 1}, false, true));
  PutSpec spec{"pending", "", 1000};
  ASSERT_OK(store_->BeginPut(other->id, "ns", {&spec, 1}));
  // A pin handed over to the store is not a session's: it stays.
  auto held = store_->Lookup(sid_, "ns", {&b, 1}, false, true);
  ASSERT_OK(held);
  ASSERT_OK(store_->HandOverPin(sid_, held->pin_id));

  EXPECT_EQ(store_->EndAllSessions(), 2);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.pins, 1u);
  EXPECT_EQ(st.reservations, 0u);
  EXPECT_FALSE(store_->HasSession(sid_));
  EXPECT_FALSE(store_->HasSession(other->id));
  EXPECT_EQ(store_->EndAllSessions(), 0);
  auto ev = store_->Evict("ns", {}, true);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks, 1u);  // "a"; "b" is held by the store
  EXPECT_EQ(ev->pinned_blocks, 1u);
}

TEST_F(TieredStoreTest, AHandedOverPinOutlivesItsSession) {
  ASSERT_OK(Put("a", "1"));
  absl::string_view a = "a";
  auto pin = store_->Lookup(sid_, "ns", {&a, 1}, false, true);
  ASSERT_OK(pin);
  EXPECT_THAT(store_->HandOverPin(sid_, pin->pin_id + 100), StatusIs(Code::kInvalidArgument));
  ASSERT_OK(store_->HandOverPin(sid_, pin->pin_id));
  // The session can no longer release it; its end does not either.
  EXPECT_THAT(store_->Unpin(sid_, pin->pin_id), StatusIs(Code::kInvalidArgument));
  ASSERT_OK(store_->CloseSession(sid_));
  EXPECT_EQ(store_->Stats().pins, 1u);
  auto ev = store_->Evict("ns", {&a, 1}, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->pinned_keys, std::vector<std::string>{"a"});
  EXPECT_THAT(store_->HandOverPin(sid_, pin->pin_id), StatusIs(Code::kNotFound));
  auto released = store_->Unpin(kInternalSession, pin->pin_id);
  ASSERT_OK(released);
  EXPECT_EQ(*released, 1u);
  EXPECT_EQ(store_->Stats().pins, 0u);
  ev = store_->Evict("ns", {&a, 1}, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks, 1u);
}

TEST_F(TieredStoreTest, EvictReportsPinnedAndMissingKeys) {
  ASSERT_OK(Put("a", "1"));
  ASSERT_OK(Put("b", "2"));
  absl::string_view a = "a";
  ASSERT_OK(store_->Lookup(sid_, "ns", {&a, 1}, false, true));
  std::vector<absl::string_view> keys = {"a", "b", "c"};
  auto ev = store_->Evict("ns", keys, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks, 1u);
  EXPECT_EQ(ev->pinned_keys, std::vector<std::string>{"a"});
  EXPECT_EQ(ev->missing_keys, 1u);
  // A key named twice is one block, counted once.
  ASSERT_OK(Put("b", "2"));
  std::vector<absl::string_view> twice = {"a", "a", "b", "b", "c", "c"};
  ev = store_->Evict("ns", twice, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks, 1u);
  EXPECT_EQ(ev->pinned_keys, std::vector<std::string>{"a"});
  EXPECT_EQ(ev->pinned_blocks, 1u);
  EXPECT_EQ(ev->missing_keys, 1u);
  auto all = store_->Evict("ns", {}, true);
  ASSERT_OK(all);
  EXPECT_EQ(all->pinned_blocks, 1u);
  EXPECT_TRUE(Has("a"));
}

TEST_F(TieredStoreTest, DrainingRefusesNewPuts) {
  store_->SetDraining(true);
  EXPECT_THAT(Put("k", "x"), StatusIs(Code::kFailedPrecondition));
  store_->SetDraining(false);
  EXPECT_OK(Put("k", "x"));
}

// While draining, a put of a session that is gone is told so (NOT_FOUND:
// open a new session), not FAILED_PRECONDITION, which a client retries with
// its dead session.
TEST_F(TieredStoreTest, DrainingTellsAPutOfAGoneSessionThatItIsGone) {
  store_->SetDraining(true);
  PutSpec spec{"k", "", 100};
  EXPECT_THAT(store_->BeginPut(sid_ + 1, "ns", {&spec, 1}),
              StatusIs(Code::kNotFound));
  clock_.Advance(absl::Seconds(31));  // sid_'s lease (30 s) ran out
  EXPECT_THAT(store_->BeginPut(sid_, "ns", {&spec, 1}), StatusIs(Code::kNotFound));
  auto live = store_->OpenSession(absl::ZeroDuration(), "new");
  ASSERT_OK(live);
  EXPECT_THAT(store_->BeginPut(live->id, "ns", {&spec, 1}),
              StatusIs(Code::kFailedPrecondition));
}

TEST_F(TieredStoreTest, NamespacesAreIsolatedAndListed) {
  ASSERT_OK(Put("k", "one", "", "model-a/tp0"));
  ASSERT_OK(Put("k", "two", "", "model-b/tp0"));
  EXPECT_EQ(Read("k", "model-a/tp0"), "one");
  EXPECT_EQ(Read("k", "model-b/tp0"), "two");
  auto list = store_->ListNamespaces();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].blocks, 1u);
  EXPECT_EQ(list[0].bytes, 3u);
}

TEST_F(TieredStoreTest, EvictionTakesOldBlocksBeforeFreshOnes) {
  // A full tier of old blocks, then a small fresh working set in another
  // namespace: every fresh block must survive the evictions it causes.
  std::string block(64 << 10, 'o');
  for (int i = 0; i < 200; ++i) ASSERT_OK(Put("old" + std::to_string(i), block));
  for (int i = 0; i < 16; ++i) {
    ASSERT_OK(Put("fresh" + std::to_string(i), block, "", "other"));
  }
  store_->RunEviction();
  for (int i = 0; i < 16; ++i) {
    EXPECT_TRUE(Has("fresh" + std::to_string(i), "other")) << i;
  }
}

TEST_F(TieredStoreTest, BackgroundEvictorRunsByItself) {
  StoreOptions opts;
  opts.dram_capacity = kCap;
  opts.hugepages = HugePageMode::kOff;
  opts.background_eviction = true;  // the real thread, unlike Reopen()
  opts.high_watermark = 0.5;
  opts.low_watermark = 0.25;
  store_.reset();
  store_ = std::move(NewTieredStore(opts, &clock_)).value();
  sid_ = store_->OpenSession(absl::ZeroDuration(), "t")->id;
  std::string block(256 << 10, 'w');
  // 12 x 256 KiB = 3 MiB fits in the 4 MiB tier, so no put has to evict;
  // only the thread, woken above the high mark (2 MiB), does.
  for (int i = 0; i < 12; ++i) ASSERT_OK(Put("w" + std::to_string(i), block));
  bool done = false;
  for (int i = 0; i < 500 && !done; ++i) {
    StoreStats st = store_->Stats();
    done = st.dram.used_bytes <= kCap / 2 && st.dram.evictions > 0;
    if (!done) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(done) << store_->Stats().dram.used_bytes;
  EXPECT_TRUE(Has("w11"));
  EXPECT_FALSE(Has("w0"));
}

TEST_F(TieredStoreTest, BackgroundEvictionHonoursWatermarks) {
  StoreOptions opts;
  opts.high_watermark = 0.5;
  opts.low_watermark = 0.25;
  Reopen(opts);
  std::string block(256 << 10, 'w');
  for (int i = 0; i < 12; ++i) ASSERT_OK(Put("w" + std::to_string(i), block));
  EXPECT_GT(store_->Stats().dram.used_bytes, kCap / 2);
  EXPECT_GT(store_->RunEviction(), 0u);
  EXPECT_LE(store_->Stats().dram.used_bytes, kCap / 4);
  EXPECT_TRUE(Has("w11"));
  EXPECT_FALSE(Has("w0"));
}

}  // namespace
}  // namespace kvdepot

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;

// With create_namespaces off, a client's put into a namespace nobody
// declared is refused (FAILED_PRECONDITION: NOT_FOUND would tell a client
// that its session is gone) and reserves nothing; an operator's quota
// declares the namespace.
TEST_F(TieredStoreTest, WithoutCreateNamespacesPutsGoOnlyIntoDeclaredOnes) {
  StoreOptions opts;
  opts.create_namespaces = false;
  Reopen(opts);
  const std::string block(4096, 'n');
  absl::StatusOr<CommitOutcome> refused = Put("k", block, "", "undeclared");
  EXPECT_THAT(refused, StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("create_namespaces"));
  EXPECT_EQ(store_->Stats().reservations, 0u);
  EXPECT_TRUE(store_->ListNamespaces().empty());
  ASSERT_OK(store_->SetQuota("declared", 0));  // no limit, but it exists
  ASSERT_OK(Put("k", block, "", "declared"));
  EXPECT_EQ(Read("k", "declared"), block);
  EXPECT_THAT(Put("k", block, "", "undeclared"), StatusIs(Code::kFailedPrecondition));
}

// The store with an NVMe tier under a temporary directory.
// A namespace over its quota makes room by evicting its own least recently
// used blocks; other namespaces are untouched.
TEST_F(TieredStoreTest, QuotaEvictsTheNamespacesOwnOldBlocks) {
  const std::string block(64 << 10, 'q');
  ASSERT_OK(store_->SetQuota("small", 3 * block.size()));
  EXPECT_EQ(store_->Quota("small"), 3 * block.size());
  EXPECT_EQ(store_->Quota("other"), 0u);
  for (int i = 0; i < 3; ++i) ASSERT_OK(Put("o" + std::to_string(i), block, "", "other"));
  for (int i = 0; i < 3; ++i) ASSERT_OK(Put("s" + std::to_string(i), block, "", "small"));
  EXPECT_TRUE(Has("s0", "small"));  // s0 is now the most recently used
  ASSERT_OK(Put("s3", block, "", "small"));
  EXPECT_FALSE(Has("s1", "small"));
  for (const char* k : {"s0", "s2", "s3"}) EXPECT_TRUE(Has(k, "small")) << k;
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Has("o" + std::to_string(i), "other"));
  for (const NamespaceStats& ns : store_->ListNamespaces()) {
    if (ns.name == "small") {
      EXPECT_LE(ns.bytes, 3 * block.size());
    }
  }
  // A batch bigger than the quota, or a namespace full of pinned blocks,
  // is refused without evicting anything.
  PutSpec big{"huge", "", 4 * block.size()};
  EXPECT_THAT(store_->BeginPut(sid_, "small", {&big, 1}),
              StatusIs(Code::kResourceExhausted));
  std::vector<absl::string_view> all = {"s0", "s2", "s3"};
  auto pin = store_->Lookup(sid_, "small", all, false, true);
  ASSERT_OK(pin);
  EXPECT_THAT(Put("s4", block, "", "small"), StatusIs(Code::kResourceExhausted));
  for (const char* k : {"s0", "s2", "s3"}) EXPECT_TRUE(Has(k, "small")) << k;
  ASSERT_OK(store_->Unpin(sid_, pin->pin_id));
  ASSERT_OK(store_->SetQuota("small", 0));  // removed: no limit
  for (int i = 4; i < 10; ++i) ASSERT_OK(Put("s" + std::to_string(i), block, "", "small"));
  EXPECT_TRUE(Has("s0", "small"));
}

// Bytes of namespace `ns`'s DRAM blocks, as ListNamespaces reports them.
uint64_t NamespaceBytes(TieredStore& store, const std::string& ns) {
  for (const NamespaceStats& n : store.ListNamespaces()) {
    if (n.name == ns) return n.bytes;
  }
  return 0;
}

// An open reservation counts against its namespace's quota from BeginPut
// on: two reservations cannot together pass it (they would both commit),
// and the room comes back when one ends without publishing.
TEST_F(TieredStoreTest, QuotaCountsOpenReservations) {
  const std::string block(64 << 10, 'q');
  const uint64_t b = block.size();
  const uint64_t sum = BlockChecksum(block);
  const uint64_t sums[2] = {sum, sum};
  ASSERT_OK(store_->SetQuota("q", 2 * b));
  PutSpec first[2] = {{"k1", "", b}, {"k2", "", b}};
  PutSpec second[2] = {{"k3", "", b}, {"k4", "", b}};
  auto r1 = store_->BeginPut(sid_, "q", first);
  ASSERT_OK(r1);
  EXPECT_THAT(store_->BeginPut(sid_, "q", second),
              StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(store_->Stats().reservations, 1u);

  // Aborting gives the room back.
  ASSERT_OK(store_->AbortPut(sid_, r1->id));
  auto r2 = store_->BeginPut(sid_, "q", second);
  ASSERT_OK(r2);
  EXPECT_THAT(store_->BeginPut(sid_, "q", first),
              StatusIs(Code::kResourceExhausted));

  // So does the end of the reservation's session.
  ASSERT_OK(store_->CloseSession(sid_));
  sid_ = store_->OpenSession(absl::ZeroDuration(), "again")->id;
  r1 = store_->BeginPut(sid_, "q", first);
  ASSERT_OK(r1);

  // Committed, the blocks hold the quota as blocks: unpinned, a later put
  // evicts them.
  for (uint32_t i = 0; i < 2; ++i) {
    auto slot = store_->AcquireSlot(sid_, r1->id, i);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), block.data(), b);
  }
  auto c = store_->CommitPut(sid_, r1->id, sums);
  ASSERT_OK(c);
  EXPECT_THAT(*c, ::testing::Each(CommitOutcome::kStored));
  EXPECT_EQ(NamespaceBytes(*store_, "q"), 2 * b);
  ASSERT_OK(Put("k3", block, "", "q"));
  EXPECT_EQ(NamespaceBytes(*store_, "q"), 2 * b);
  EXPECT_NE(Has("k1", "q"), Has("k2", "q"));  // one made room
  EXPECT_TRUE(Has("k3", "q"));
}

// Slots that are not published (a writer that lost the race for its key, a
// checksum mismatch) give their quota charge back at commit: the blocks
// that were published are not evicted for them.
TEST_F(TieredStoreTest, UnpublishedSlotsGiveTheirQuotaBack) {
  const std::string block(64 << 10, 'u');
  const uint64_t b = block.size();
  ASSERT_OK(store_->SetQuota("q", 3 * b));
  PutSpec spec{"k", "", b};
  auto r1 = store_->BeginPut(sid_, "q", {&spec, 1});
  auto r2 = store_->BeginPut(sid_, "q", {&spec, 1});
  ASSERT_OK(r1);
  ASSERT_OK(r2);
  for (ReservationId id : {r1->id, r2->id}) {
    auto slot = store_->AcquireSlot(sid_, id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), block.data(), b);
  }
  uint64_t sum = BlockChecksum(block);
  EXPECT_EQ((*store_->CommitPut(sid_, r1->id, {&sum, 1}))[0], CommitOutcome::kStored);
  EXPECT_EQ((*store_->CommitPut(sid_, r2->id, {&sum, 1}))[0],
            CommitOutcome::kAlreadyExists);
  PutSpec bad{"bad", "", b};
  auto r3 = store_->BeginPut(sid_, "q", {&bad, 1});
  ASSERT_OK(r3);
  uint64_t wrong = sum + 1;
  EXPECT_EQ((*store_->CommitPut(sid_, r3->id, {&wrong, 1}))[0],
            CommitOutcome::kChecksumMismatch);
  // "k" and two more blocks fill the quota exactly.
  ASSERT_OK(Put("x", block, "", "q"));
  ASSERT_OK(Put("y", block, "", "q"));
  for (const char* k : {"k", "x", "y"}) EXPECT_TRUE(Has(k, "q")) << k;
  EXPECT_EQ(NamespaceBytes(*store_, "q"), 3 * b);
}

// reserved_bytes is the arena space reservations hold, the key's stamp
// included (a 60-byte key and its 8-byte stamp take a 128-byte class).
TEST_F(TieredStoreTest, ReservedBytesAreTheArenaSpaceTaken) {
  const uint64_t before = store_->Stats().dram.used_bytes;
  const std::string key(60, 'k');
  PutSpec spec{key, "", 1000};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.reserved_bytes, st.dram.used_bytes - before);
  ASSERT_OK(store_->AbortPut(sid_, r->id));
  st = store_->Stats();
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.dram.used_bytes, before);
}

// A flood of tiny blocks fills the DRAM tier at dram_max_blocks: each
// block's bytes take at least the block floor of the arena (here 4 MiB /
// 256 = 16 KiB), so eviction keeps their number, and the index's heap,
// within the bound. 1-byte blocks took 128 bytes each (64 for the bytes, 64
// for the key): 32768 of them, and as many index entries, in 4 MiB.
// The floor shares the arena, less its blocks' keys, among dram_max_blocks:
// 4 KiB blocks keep their own size class under the default bound whatever
// the capacity's digits (a decimal 64 MB made it 6 KiB); no more blocks
// than the bound fit, and a bound of 1 holds one (it held none: the floor
// was the whole arena, with no room for the key).
TEST(DramBlockFloorTest, SharesTheArenaLessItsKeys) {
  StoreOptions o;
  o.dram_capacity = 64'000'000;  // "64MB"
  EXPECT_EQ(DramBlockFloor(o), 4096u);
  o.dram_capacity = uint64_t{64} << 20;
  EXPECT_EQ(DramBlockFloor(o), 4096u);
  const uint64_t page = DramArena::kPageSize;
  for (uint64_t n : {1, 2, 4, 7, 16}) {
    o.dram_max_blocks = n;
    const uint64_t floor = DramBlockFloor(o);
    EXPECT_GT((n + 1) * floor, o.dram_capacity - page) << n;  // at most n
    EXPECT_GE(floor, page) << n;
  }
  o.dram_max_blocks = 1;
  EXPECT_LE(DramBlockFloor(o) + page, o.dram_capacity);  // and a key's page
  o.dram_max_blocks = 4;  // 1022 pages for blocks: 3 of 256 pages fit
  EXPECT_EQ(DramBlockFloor(o), 256 * page);
}

TEST_F(TieredStoreTest, TinyBlocksFillDramAtItsBlockBound) {
  StoreOptions opts;
  opts.dram_max_blocks = 256;
  Reopen(opts);
  opts.dram_capacity = kCap;
  ASSERT_EQ(DramBlockFloor(opts), 16384u);
  // A reservation holds the floor (and the key's 64 bytes); the slot, the
  // lookup and the namespace's bytes say the block's size.
  PutSpec spec{"r", "", 1};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  EXPECT_EQ(r->slots[0].size, 1u);
  EXPECT_EQ(store_->Stats().reserved_bytes, 16384u + 64u);
  EXPECT_EQ(store_->Stats().dram.used_bytes, 16384u + 64u);
  ASSERT_OK(store_->AbortPut(sid_, r->id));
  EXPECT_EQ(store_->Stats().dram.used_bytes, 0u);

  for (int i = 0; i < 1000; ++i) {
    ASSERT_OK(Put("t" + std::to_string(i), "x"));
    ASSERT_LE(store_->Stats().dram.blocks, 256u) << i;
  }
  StoreStats st = store_->Stats();
  EXPECT_GT(st.dram.evictions, 0u);
  EXPECT_GE(st.dram.blocks, 200u);  // the bound evicts, and nothing sooner
  EXPECT_EQ(st.dram.used_bytes, st.dram.blocks * (16384u + 64u));
  ASSERT_EQ(st.namespaces.size(), 1u);
  EXPECT_EQ(st.namespaces[0].bytes, st.dram.blocks);  // 1 byte each
  EXPECT_EQ(st.put_bytes, 1000u);
  absl::string_view k = "t999";
  auto hit = store_->Lookup(sid_, "ns", {&k, 1}, false, false);
  ASSERT_OK(hit);
  ASSERT_TRUE(hit->entries[0].found);
  EXPECT_EQ(hit->entries[0].size, 1u);
  EXPECT_EQ(Read("t999"), "x");
}

// Blocks of the floor's size or larger take the arena space they took
// without the bound: only smaller ones are raised to the floor.
TEST_F(TieredStoreTest, BlocksOfTheFloorOrLargerAreNotRaised) {
  StoreOptions opts;
  opts.dram_max_blocks = 256;  // a 16 KiB floor
  Reopen(opts);
  uint64_t used = store_->Stats().dram.used_bytes;
  auto grew = [&] {
    const uint64_t now = store_->Stats().dram.used_bytes;
    return now - std::exchange(used, now);
  };
  ASSERT_OK(Put("floor", std::string(16384, 'f')));
  EXPECT_EQ(grew(), 16384u + 64u);
  ASSERT_OK(Put("above", std::string(32768, 'a')));
  EXPECT_EQ(grew(), 32768u + 64u);
  ASSERT_OK(Put("pages", std::string(100000, 'p')));
  EXPECT_EQ(grew(), 2u * DramArena::kPageSize + 64u);
  ASSERT_OK(Put("tiny", std::string(100, 't')));
  EXPECT_EQ(grew(), 16384u + 64u);
  EXPECT_EQ(Read("above"), std::string(32768, 'a'));
  EXPECT_EQ(Read("tiny"), std::string(100, 't'));
}

// What evicting a tiny block frees is its floor, and the room check counts
// it so (BlockIndex's footprint): a tier of few floor-sized blocks, full of
// 1-byte ones, takes more by evicting them, a block larger than the floor
// too, rather than finding too little unpinned space and refusing the put.
TEST_F(TieredStoreTest, EvictingTinyBlocksFreesTheirFloor) {
  StoreOptions opts;
  opts.dram_max_blocks = 16;  // 256 KiB each
  Reopen(opts);
  for (int i = 0; i < 40; ++i)
    ASSERT_OK(Put("t" + std::to_string(i), "x")) << i;
  StoreStats st = store_->Stats();
  EXPECT_LE(st.dram.blocks, 16u);
  EXPECT_GE(st.dram.blocks, 14u);
  EXPECT_EQ(st.dram.evictions, 40u - st.dram.blocks);
  EXPECT_EQ(Read("t39"), "x");
  const std::string big(300 << 10, 'b');  // 5 pages: more than is free
  ASSERT_OK(Put("big", big));
  EXPECT_EQ(Read("big"), big);
  EXPECT_EQ(Read("t39"), "x");
}

// A batch of more tiny blocks than the tier holds can never fit: refused
// at once, saying why.
TEST_F(TieredStoreTest, ABatchOfMoreBlocksThanTheBoundIsRefused) {
  StoreOptions opts;
  opts.dram_max_blocks = 256;
  Reopen(opts);
  std::vector<std::string> keys;
  std::vector<PutSpec> specs;
  for (int i = 0; i < 300; ++i) keys.push_back("k" + std::to_string(i));
  for (const std::string& key : keys) specs.push_back(PutSpec{key, "", 1});
  auto r = store_->BeginPut(sid_, "ns", specs);
  EXPECT_THAT(r, StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr("dram_max_blocks"));
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

TEST_F(TieredStoreTest, InspectReportsABlockWithoutTouchingIt) {
  ASSERT_OK(Put("p", std::string(1000, 'p')));
  ASSERT_OK(Put("c", std::string(2000, 'c'), "p"));
  clock_.Advance(absl::Seconds(90));
  sid_ = store_->OpenSession(absl::ZeroDuration(), "later")->id;  // lease ran out
  EXPECT_TRUE(Has("p"));
  auto d = store_->Inspect("ns", "p");
  ASSERT_OK(d);
  EXPECT_TRUE(d->in_dram);
  EXPECT_FALSE(d->in_nvme);
  EXPECT_EQ(d->size, 1000u);
  EXPECT_EQ(d->checksum, BlockChecksum(std::string(1000, 'p')));
  EXPECT_EQ(d->cached_children, 1u);
  EXPECT_EQ(d->pins, 0u);
  EXPECT_EQ(d->dram_reads, 1u);
  EXPECT_EQ(d->age, absl::Seconds(90));
  absl::string_view k = "c";
  auto pin = store_->Lookup(sid_, "ns", {&k, 1}, false, true);
  ASSERT_OK(pin);
  EXPECT_EQ(store_->Inspect("ns", "c")->pins, 1u);
  ASSERT_OK(store_->Unpin(sid_, pin->pin_id));
  EXPECT_THAT(store_->Inspect("ns", "nope"), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->Inspect("ns", ""), StatusIs(Code::kInvalidArgument));
}

// Puts `keys` into `ns` in batches of 1024, each block `size` bytes of 'x'.
absl::Status PutMany(TieredStore& store, SessionId sid, const std::string& ns,
                     const std::vector<std::string>& keys, size_t size) {
  const std::string bytes(size, 'x');
  const uint64_t sum = BlockChecksum(bytes);
  for (size_t i = 0; i < keys.size(); i += 1024) {
    std::vector<PutSpec> specs;
    for (size_t j = i; j < keys.size() && j < i + 1024; ++j) {
      specs.push_back({keys[j], "", size});
    }
    auto r = store.BeginPut(sid, ns, specs);
    if (!r.ok()) return r.status();
    if (r->id == 0) continue;
    for (const PutSlot& slot : r->slots) {
      if (!slot.exists) {
        std::memcpy(store.dram_region().base + slot.offset, bytes.data(), size);
      }
    }
    std::vector<uint64_t> sums(specs.size(), sum);
    auto c = store.CommitPut(sid, r->id, sums);
    if (!c.ok()) return c.status();
  }
  return absl::OkStatus();
}

// A quota's eviction finds the namespace's own least recently used block
// however many older blocks of other namespaces lie at the old end of
// every shard's list (it looked at 4096 entries per shard, and so found
// none behind 300k foreign ones: the put failed as if everything was
// pinned).
TEST_F(TieredStoreTest, QuotaEvictsOwnBlocksBehindManyOlderForeignBlocks) {
  StoreOptions o;
  o.dram_capacity = uint64_t{48} << 20;
  // 300k 64-byte blocks (and their keys) in 48 MiB: a block bound whose
  // floor is the arena's smallest allocation, so that it raises none.
  o.dram_max_blocks = o.dram_capacity / DramArena::kMinAlloc;
  o.hugepages = HugePageMode::kOff;
  o.background_eviction = false;
  auto made = NewTieredStore(o, &clock_);
  ASSERT_OK(made);
  TieredStore& store = **made;
  const SessionId sid = store.OpenSession(absl::ZeroDuration(), "t")->id;
  std::vector<std::string> foreign;
  for (int i = 0; i < 300000; ++i) foreign.push_back("f" + std::to_string(i));
  ASSERT_OK(PutMany(store, sid, "big", foreign, 64));
  ASSERT_OK(store.SetQuota("q", 64 * 64));
  for (int i = 0; i < 64; ++i) {  // one put each: q0 is the oldest
    ASSERT_OK(PutMany(store, sid, "q", {"q" + std::to_string(i)}, 64));
  }
  const uint64_t evictions = store.Stats().dram.evictions;
  ASSERT_OK(PutMany(store, sid, "q", {"q-next"}, 64));
  EXPECT_EQ(store.Stats().dram.evictions, evictions + 1);
  auto has = [&](const std::string& ns, const std::string& key) {
    absl::string_view k = key;
    auto r = store.Lookup(kInternalSession, ns, {&k, 1}, false, false);
    return r.ok() && r->entries[0].found;
  };
  EXPECT_FALSE(has("q", "q0"));  // the namespace's oldest
  EXPECT_TRUE(has("q", "q1"));
  EXPECT_TRUE(has("q", "q-next"));
  EXPECT_TRUE(has("big", "f0"));  // other namespaces are untouched
  EXPECT_EQ(store.Stats().dram.blocks, 300000u + 64u);
}

// A batch that no eviction can make room for (the space not pinned is too
// small) fails before evicting anything: it emptied DRAM of every unpinned
// block, and then failed "having reserved nothing".
TEST_F(TieredStoreTest, UnsatisfiableBatchEvictsNothing) {
  std::vector<std::string> keys;
  for (int i = 0; i < 32; ++i) keys.push_back("c" + std::to_string(i));
  ASSERT_OK(PutMany(*store_, sid_, "c", keys, 64 << 10));
  std::vector<absl::string_view> pin(keys.begin(), keys.begin() + 16);
  auto pinned = store_->Lookup(sid_, "c", pin, false, true);
  ASSERT_OK(pinned);
  ASSERT_EQ(store_->Stats().pinned_blocks, 16u);
  const StoreStats before = store_->Stats();
  ASSERT_EQ(before.dram.blocks, 32u);
  std::vector<std::string> names;
  for (int i = 0; i < 7; ++i) names.push_back("n" + std::to_string(i));
  std::vector<PutSpec> specs;
  for (const std::string& n : names) specs.push_back({n, "", 512 << 10});
  // 3.5 MiB: less than the tier's 4 MiB, more than all but the pinned 1 MiB.
  EXPECT_THAT(store_->BeginPut(sid_, "c", specs),
              StatusIs(Code::kResourceExhausted));
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.dram.blocks, 32u);
  EXPECT_EQ(after.dram.evictions, before.dram.evictions);
  EXPECT_EQ(after.dram.used_bytes, before.dram.used_bytes);
  EXPECT_EQ(after.reservations, 0u);
  // A batch that fits once the unpinned blocks go still makes room.
  specs.resize(4);
  auto r = store_->BeginPut(sid_, "c", specs);
  ASSERT_OK(r);
  EXPECT_GT(store_->Stats().dram.evictions, before.dram.evictions);
  ASSERT_OK(store_->AbortPut(sid_, r->id));
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(Has(keys[i], "c")) << keys[i];
  ASSERT_OK(store_->Unpin(sid_, pinned->pin_id));
}

// A put of keys stored already is a no-op, even under a full quota: it
// charged the whole batch first, evicting the namespace's least recently
// used block for bytes never written (or the re-put key itself, answering
// with a fresh slot instead of EXISTS), and refused a batch of stored keys
// larger than the quota.
TEST_F(TieredStoreTest, PutOfExistingKeysUnderAFullQuotaEvictsNothing) {
  const std::string block(4096, 'e');
  ASSERT_OK(store_->SetQuota("r", 4 * block.size()));
  const std::vector<std::string> keys = {"k0", "k1", "k2", "k3"};
  for (const std::string& k : keys) ASSERT_OK(Put(k, block, "", "r"));
  const uint64_t evictions = store_->Stats().dram.evictions;
  PutSpec spec{"k3", "", block.size()};
  auto r = store_->BeginPut(sid_, "r", {&spec, 1});
  ASSERT_OK(r);
  EXPECT_EQ(r->id, 0u);
  EXPECT_TRUE(r->slots[0].exists);
  EXPECT_EQ(store_->Stats().dram.evictions, evictions);
  for (const std::string& k : keys) EXPECT_TRUE(Has(k, "r")) << k;
  // k0 is the least recently used: a put of it must not evict it either.
  spec.key = "k0";
  r = store_->BeginPut(sid_, "r", {&spec, 1});
  ASSERT_OK(r);
  EXPECT_TRUE(r->slots[0].exists);
  EXPECT_EQ(store_->Stats().dram.evictions, evictions);
  // Five stored blocks (20 KiB, the quota is 16 KiB), one of them twice.
  std::vector<PutSpec> specs = {{"k1", "", block.size()}, {"k2", "", block.size()},
                                {"k3", "", block.size()}, {"k1", "", block.size()},
                                {"k2", "", block.size()}};
  r = store_->BeginPut(sid_, "r", specs);
  ASSERT_OK(r);
  EXPECT_EQ(r->id, 0u);
  for (const PutSlot& slot : r->slots) EXPECT_TRUE(slot.exists);
  EXPECT_EQ(store_->Stats().dram.evictions, evictions);
  EXPECT_EQ(NamespaceBytes(*store_, "r"), 4 * block.size());
  // A batch of stored keys and a new one evicts for the new one only, and
  // not one of the stored keys it names.
  specs = {{"k0", "", block.size()}, {"k4", "", block.size()}};
  r = store_->BeginPut(sid_, "r", specs);
  ASSERT_OK(r);
  EXPECT_TRUE(r->slots[0].exists);
  EXPECT_FALSE(r->slots[1].exists);
  EXPECT_EQ(store_->Stats().dram.evictions, evictions + 1);
  EXPECT_TRUE(Has("k0", "r"));
  ASSERT_OK(store_->AbortPut(sid_, r->id));
}

// A parent evicted explicitly while its child is cached, then stored again
// with a new child: the old child names its key too, so the new entry
// counts both, and the old child's eviction leaves the new one's count.
// (The old child's release counted down the new entry, which then looked
// childless, and evictable, while its new child was cached.)
TEST_F(TieredStoreTest, AParentStoredAgainCountsTheChildrenOfItsEvictedSelf) {
  const std::string block(4096, 'p');
  ASSERT_OK(Put("P", block));
  ASSERT_OK(Put("C", block, "P"));
  absl::string_view p = "P", c = "C";
  ASSERT_EQ(store_->Evict("ns", {&p, 1}, false)->evicted_blocks, 1u);
  ASSERT_OK(Put("P", block));
  ASSERT_OK(Put("C2", block, "P"));
  EXPECT_EQ(store_->Inspect("ns", "P")->cached_children, 2u);
  ASSERT_EQ(store_->Evict("ns", {&c, 1}, false)->evicted_blocks, 1u);
  EXPECT_TRUE(Has("C2"));
  EXPECT_EQ(store_->Inspect("ns", "P")->cached_children, 1u);
  // Leaves first: filling DRAM evicts C2 before P (Inspect does not touch
  // them, as a lookup would).
  std::vector<std::string> fill;
  for (int i = 0; i < 200; ++i) fill.push_back("fill" + std::to_string(i));
  bool c2_gone_first = false;
  for (const std::string& k : fill) {
    ASSERT_OK(Put(k, std::string(64 << 10, 'f')));
    const bool has_p = store_->Inspect("ns", "P").ok();
    const bool has_c2 = store_->Inspect("ns", "C2").ok();
    ASSERT_FALSE(has_c2 && !has_p) << "the parent went before its child";
    if (!has_c2) {
      c2_gone_first = true;
      break;
    }
  }
  EXPECT_TRUE(c2_gone_first);
}

// A parent evicted explicitly while its child is cached, then stored again
// naming that child as its parent (a client's bogus chain): the two must not
// wait on each other for ever. (They did: neither was ever evictable, yet
// both counted as room, so a put needing it dropped every other block first
// and then failed.) The parent is left a root: its child goes, then it.
TEST_F(TieredStoreTest, AParentStoredBelowItsOwnChildStaysEvictable) {
  const std::string block(64 << 10, 'c');
  ASSERT_OK(Put("A", block));
  ASSERT_OK(Put("B", block, "A"));
  absl::string_view a = "A";
  ASSERT_EQ(store_->Evict("ns", {&a, 1}, false)->evicted_blocks, 1u);
  ASSERT_OK(Put("A", block, "B"));
  EXPECT_EQ(store_->Inspect("ns", "A")->cached_children, 1u);
  EXPECT_EQ(store_->Inspect("ns", "B")->cached_children, 0u);
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put("f" + std::to_string(i), block));
  // Room for this needs every block gone, A and B included (the keys take
  // one page of the arena).
  const std::string big(kCap - (128 << 10), 'b');
  ASSERT_OK(Put("big", big));
  EXPECT_FALSE(store_->Inspect("ns", "A").ok());
  EXPECT_FALSE(store_->Inspect("ns", "B").ok());
  EXPECT_EQ(Read("big"), big);
  EXPECT_EQ(store_->Stats().dram.blocks, 1u);
}

// A put that fails creates no namespace (namespaces are never removed: a
// client could use up max_namespaces with failed puts).
TEST_F(TieredStoreTest, AFailedPutCreatesNoNamespace) {
  StoreOptions o;
  o.max_namespaces = 2;
  Reopen(o);
  std::vector<std::string> keys = {"a0", "a1", "a2"};
  ASSERT_OK(PutMany(*store_, sid_, "a", keys, 1 << 20));
  std::vector<absl::string_view> views(keys.begin(), keys.end());
  auto pin = store_->Lookup(sid_, "a", views, false, true);
  ASSERT_OK(pin);
  for (const char* ns : {"g1", "g2", "g3"}) {
    PutSpec spec{"k", "", 2 << 20};
    EXPECT_THAT(store_->BeginPut(sid_, ns, {&spec, 1}),
                StatusIs(Code::kResourceExhausted));
  }
  std::vector<std::string> names;
  for (const NamespaceStats& ns : store_->ListNamespaces()) names.push_back(ns.name);
  EXPECT_THAT(names, ::testing::ElementsAre("a"));
  ASSERT_OK(store_->Unpin(sid_, pin->pin_id));
  ASSERT_OK(Put("k", std::string(1000, 'b'), "", "b"));
  EXPECT_TRUE(Has("k", "b"));
}

// A namespace left with nothing (no block, reservation, pin or quota) is
// forgotten when max_namespaces exist and a new one is needed: a client
// that put one block into a new namespace and evicted it, over and over,
// used to fill the table, after which every put into a new namespace
// failed until a restart. An operator's namespaces (SetQuota) stay.
TEST_F(TieredStoreTest, EmptyNamespacesAreReclaimedWhenTheTableIsFull) {
  StoreOptions o;
  o.max_namespaces = 4;
  Reopen(o);
  ASSERT_OK(store_->SetQuota("declared", 0));  // created by an operator
  ASSERT_OK(store_->SetQuota("limited", 1 << 20));
  ASSERT_OK(Put("kept", "x", "", "full"));
  for (int i = 0; i < 50; ++i) {
    const std::string ns = "churn-" + std::to_string(i);
    ASSERT_OK(Put("k", std::string(1000, 'c'), "", ns)) << i;
    EXPECT_TRUE(Has("k", ns));
    ASSERT_OK(store_->Evict(ns, {}, true));
    EXPECT_FALSE(Has("k", ns));
  }
  std::vector<std::string> names;
  for (const NamespaceStats& ns : store_->ListNamespaces()) names.push_back(ns.name);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("declared", "limited",
                                                     "full", "churn-49"));
  EXPECT_EQ(store_->Quota("limited"), 1u << 20);
  EXPECT_EQ(Read("kept", "full"), "x");
  // A forgotten namespace is unknown again; a new one (which may have its
  // id) sees none of its blocks, nor do the others see the new one's.
  absl::string_view k = "k";
  auto r = store_->Lookup(sid_, "churn-0", {&k, 1}, false, false);
  ASSERT_OK(r);
  EXPECT_FALSE(r->entries[0].found);
  EXPECT_FALSE(r->namespace_known);
  ASSERT_OK(Put("k", "new", "", "last"));
  EXPECT_EQ(Read("k", "last"), "new");
  EXPECT_FALSE(Has("k", "full"));
  EXPECT_EQ(Read("kept", "full"), "x");
  // Every namespace holds something now: the table is full.
  EXPECT_THAT(Put("k", "y", "", "one-more"), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(store_->ListNamespaces().size(), 4u);
}

// Bug: a namespace an operator declared (SetQuota, kept in the quota file)
// could never be taken back: once max_namespaces were declared, every put
// into a new namespace failed for good.
TEST_F(TieredStoreTest, UndeclaredNamespacesMakeRoomAgain) {
  StoreOptions o;
  o.max_namespaces = 3;
  Reopen(o);
  ASSERT_OK(store_->SetQuota("d1", 0));
  ASSERT_OK(store_->SetQuota("d2", 1 << 20));
  ASSERT_OK(Put("k", "kept", "", "d3"));
  ASSERT_OK(store_->SetQuota("d3", 0));
  EXPECT_THAT(Put("k", "v", "", "new"), StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(store_->SetQuota("new", 0), StatusIs(Code::kResourceExhausted));
  // An empty one goes at once; its quota with it.
  ASSERT_OK(store_->Undeclare("d2"));
  EXPECT_EQ(store_->ListNamespaces().size(), 2u);
  EXPECT_EQ(store_->Quota("d2"), 0u);
  ASSERT_OK(Put("k", "v", "", "new"));
  // One with blocks keeps them, and goes once they do.
  ASSERT_OK(store_->Undeclare("d3"));
  EXPECT_EQ(Read("k", "d3"), "kept");
  EXPECT_THAT(Put("k", "v", "", "new2"), StatusIs(Code::kResourceExhausted));
  ASSERT_OK(store_->Evict("d3", {}, true));
  ASSERT_OK(Put("k", "w", "", "new2"));
  // Unknown or invalid names.
  EXPECT_OK(store_->Undeclare("never"));
  EXPECT_THAT(store_->Undeclare(""), StatusIs(Code::kInvalidArgument));
}

// Without create_namespaces, an undeclared empty namespace refuses puts
// again, as before it was declared.
TEST_F(TieredStoreTest, AnUndeclaredNamespaceRefusesPutsWithoutCreateNamespaces) {
  StoreOptions o;
  o.create_namespaces = false;
  Reopen(o);
  EXPECT_THAT(Put("k", "v", "", "d"), StatusIs(Code::kFailedPrecondition));
  ASSERT_OK(store_->SetQuota("d", 0));
  ASSERT_OK(Put("k", "v", "", "d"));
  ASSERT_OK(store_->Evict("d", {}, true));
  ASSERT_OK(store_->Undeclare("d"));
  EXPECT_THAT(Put("k", "v", "", "d"), StatusIs(Code::kFailedPrecondition));
}

// A namespace something still refers to is not forgotten: an open
// reservation, a pinned block that Evict(all) could not remove, a slot
// still being written for a reservation aborted meanwhile.
TEST_F(TieredStoreTest, NamespacesInUseAreNotReclaimed) {
  StoreOptions o;
  o.max_namespaces = 3;
  Reopen(o);
  const std::string bytes(1000, 'r');
  PutSpec spec{"r", "", bytes.size()};
  auto open = store_->BeginPut(sid_, "open", {&spec, 1});
  ASSERT_OK(open);
  ASSERT_OK(Put("p", "x", "", "pinned"));
  absl::string_view p = "p";
  auto pin = store_->Lookup(sid_, "pinned", {&p, 1}, false, true);
  ASSERT_OK(pin);
  auto ev = store_->Evict("pinned", {}, true);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->pinned_blocks, 1u);
  auto doomed = store_->BeginPut(sid_, "doomed", {&spec, 1});
  ASSERT_OK(doomed);
  auto slot = store_->AcquireSlot(sid_, doomed->id, 0);
  ASSERT_OK(slot);
  ASSERT_OK(store_->AbortPut(sid_, doomed->id));
  EXPECT_EQ(store_->Stats().reservations, 1u);  // "open"'s

  EXPECT_THAT(Put("k", "z", "", "new"), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ((*slot)->ns(), "doomed");
  EXPECT_EQ(store_->ListNamespaces().size(), 3u);
  // The reservation still commits into its namespace.
  {
    auto s = store_->AcquireSlot(sid_, open->id, 0);
    ASSERT_OK(s);
    std::memcpy((*s)->bytes().data(), bytes.data(), bytes.size());
  }
  const uint64_t sum = BlockChecksum(bytes);
  auto c = store_->CommitPut(sid_, open->id, {&sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
  EXPECT_EQ(Read("r", "open"), bytes);

  // Once let go, each may go.
  slot->reset();
  ASSERT_OK(Put("k", "z", "", "new"));  // takes "doomed"'s place
  EXPECT_THAT(Put("k", "z", "", "new2"), StatusIs(Code::kResourceExhausted));
  ASSERT_OK(store_->Unpin(sid_, pin->pin_id));
  ASSERT_OK(store_->Evict("pinned", {}, true));
  ASSERT_OK(Put("k", "w", "", "new2"));
  EXPECT_EQ(Read("k", "new"), "z");
  EXPECT_EQ(Read("k", "new2"), "w");
  EXPECT_EQ(Read("r", "open"), bytes);
}

// Namespaces created, used, emptied and reclaimed by several threads at
// once: every block read back is the one its own namespace was given (an
// id given to a new namespace while an old one still used it would mix
// them up), and a put fails only for want of a free namespace.
TEST_F(TieredStoreTest, NamespacesAreReclaimedSafelyWhileInUse) {
  StoreOptions o;
  o.max_namespaces = 6;
  Reopen(o);
  constexpr int kThreads = 4;
  constexpr int kRounds = 400;
  std::atomic<int> stored{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto session = store_->OpenSession(absl::ZeroDuration(), "stress");
      ASSERT_OK(session);
      const SessionId sid = session->id;
      const std::string bytes(100 + t, static_cast<char>('a' + t));
      const uint64_t sum = BlockChecksum(bytes);
      for (int i = 0; i < kRounds; ++i) {
        const std::string ns = "t" + std::to_string(t) + "-" + std::to_string(i % 5);
        PutSpec spec{"k", "", bytes.size()};
        auto r = store_->BeginPut(sid, ns, {&spec, 1});
        if (!r.ok()) {
          EXPECT_THAT(r, StatusIs(Code::kResourceExhausted));
          continue;
        }
        ASSERT_NE(r->id, 0u);  // evicted at the end of every round
        std::memcpy(store_->dram_region().base + r->slots[0].offset,
                    bytes.data(), bytes.size());
        auto c = store_->CommitPut(sid, r->id, {&sum, 1});
        ASSERT_OK(c);
        EXPECT_EQ((*c)[0], CommitOutcome::kStored);
        ++stored;
        absl::string_view k = "k";
        auto l = store_->Lookup(sid, ns, {&k, 1}, false, true);
        ASSERT_OK(l);
        ASSERT_TRUE(l->entries[0].found);
        EXPECT_EQ(std::string(store_->dram_region().base + l->entries[0].offset,
                              l->entries[0].size),
                  bytes);
        ASSERT_OK(store_->Unpin(sid, l->pin_id));
        auto ev = store_->Evict(ns, {}, true);
        ASSERT_OK(ev);
        EXPECT_EQ(ev->evicted_blocks, 1u);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_GT(stored.load(), kRounds);
  EXPECT_LE(store_->ListNamespaces().size(), 6u);
  EXPECT_EQ(store_->Stats().dram.blocks, 0u);
}

// A put into a new namespace when max_namespaces are in use fails before it
// evicts anything for its slots (it used to make room, dropping other
// namespaces' blocks, and only then find it could not create its own).
TEST_F(TieredStoreTest, APutThatCannotCreateItsNamespaceEvictsNothing) {
  StoreOptions o;
  o.max_namespaces = 1;
  Reopen(o);
  std::vector<std::string> keys;
  for (int i = 0; i < 15; ++i) keys.push_back("a" + std::to_string(i));
  ASSERT_OK(PutMany(*store_, sid_, "a", keys, 256 << 10));  // DRAM nearly full
  const StoreStats before = store_->Stats();
  PutSpec specs[2] = {{"b0", "", 256 << 10}, {"b1", "", 256 << 10}};
  EXPECT_THAT(store_->BeginPut(sid_, "b", specs), StatusIs(Code::kResourceExhausted));
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.dram.evictions, before.dram.evictions);
  EXPECT_EQ(after.dram.blocks, before.dram.blocks);
  for (const std::string& k : keys) EXPECT_TRUE(Has(k, "a")) << k;
}

// A put of a stored key is not a read of it: it neither counts toward the
// NVMe admission policy (nvme_admit_min_reads) nor shows in dram_reads.
TEST_F(TieredStoreTest, APutOfAStoredKeyIsNotCountedAsARead) {
  const std::string block(1000, 'r');
  ASSERT_OK(Put("k", block));
  EXPECT_EQ(store_->Inspect("ns", "k")->dram_reads, 0u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Put("k", block).value_or(CommitOutcome::kStored),
              CommitOutcome::kAlreadyExists);
  }
  EXPECT_EQ(store_->Inspect("ns", "k")->dram_reads, 0u);
  EXPECT_EQ(store_->Inspect("ns", "k")->pins, 0u);
  EXPECT_TRUE(Has("k"));
  EXPECT_EQ(store_->Inspect("ns", "k")->dram_reads, 1u);
}

class TieredStoreNvmeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/tiered_store_nvme_" +
           std::to_string(reinterpret_cast<uintptr_t>(this));
    std::filesystem::remove_all(dir_);
    Open();
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open(uint32_t admit_min_reads = 0, bool background_eviction = false,
            double high_watermark = 0.5) {
    store_.reset();
    StoreOptions o;
    o.nvme_admit_min_reads = admit_min_reads;
    o.dram_capacity = 4 << 20;
    o.hugepages = HugePageMode::kOff;
    o.background_eviction = background_eviction;
    o.high_watermark = high_watermark;
    o.low_watermark = 0.25;
    o.nvme_path = dir_ + "/nvme";
    o.nvme_capacity = nvme_capacity_;
    o.nvme_max_blocks = nvme_max_blocks_;
    o.create_namespaces = create_namespaces_;
    o.max_pinned_blocks_per_session = max_pinned_blocks_per_session_;
    o.max_queued_promotions = max_queued_promotions_;
    o.max_namespaces = max_namespaces_;
    o.nvme_env = nvme_env_;
    auto s = NewTieredStore(o, &clock_);
    ASSERT_OK(s);
    store_ = std::move(s).value();
    sid_ = store_->OpenSession(absl::ZeroDuration(), "t")->id;
  }
  void Put(const std::string& key, const std::string& bytes,
           const std::string& parent = "", const std::string& ns = "ns") {
    PutSpec spec{key, parent, bytes.size()};
    auto r = store_->BeginPut(sid_, ns, {&spec, 1});
    ASSERT_OK(r);
    if (r->slots[0].exists) return;  // stored already, in either tier
    {
      auto slot = store_->AcquireSlot(sid_, r->id, 0);
      ASSERT_OK(slot);
      std::memcpy((*slot)->bytes().data(), bytes.data(), bytes.size());
    }
    uint64_t sum = BlockChecksum(bytes);
    ASSERT_OK(store_->CommitPut(sid_, r->id, {&sum, 1}));
  }
  LookupEntry Look(const std::string& key, bool pin, PinId* pin_id = nullptr) {
    absl::string_view k = key;
    auto r = store_->Lookup(sid_, "ns", {&k, 1}, false, pin);
    EXPECT_OK(r);
    if (pin_id) *pin_id = r->pin_id;
    return r->entries[0];
  }
  // Puts blocks b0, b1, ... (Block(i)) until DRAM is full: the first put
  // that would wait for room; *stored of them went in.
  void FillDram(int* stored) {
    for (*stored = 0; *stored < 64; ++*stored) {
      const std::string key = "b" + std::to_string(*stored);
      PutSpec spec{key, "", 256 << 10};
      bool would_wait = false;
      auto r = store_->BeginPut(sid_, "ns", {&spec, 1}, &would_wait);
      if (!r.ok()) {
        ASSERT_TRUE(would_wait) << r.status();
        break;
      }
      const std::string bytes = Block(*stored);
      std::memcpy(store_->dram_region().base + r->slots[0].offset, bytes.data(),
                  bytes.size());
      const uint64_t sum = BlockChecksum(bytes);
      ASSERT_OK(store_->CommitPut(sid_, r->id, {&sum, 1}));
    }
    ASSERT_GE(*stored, 8);
    ASSERT_LT(*stored, 64) << "DRAM never filled";
  }
  // How many of the keys prefix0 .. prefix<n-1> are in neither tier.
  int Lost(const std::string& prefix, int n) {
    int lost = 0;
    for (int i = 0; i < n; ++i) lost += !Look(prefix + std::to_string(i), false).found;
    return lost;
  }
  // Both kinds of lookup of `key` report `bytes`' checksum, and a pinned
  // one serves those bytes.
  void ExpectServes(const std::string& key, const std::string& bytes) {
    const uint64_t sum = BlockChecksum(bytes);
    EXPECT_EQ(Look(key, false).checksum, sum);
    PinId pin = 0;
    LookupEntry e = Look(key, true, &pin);
    ASSERT_TRUE(e.found);
    EXPECT_EQ(e.checksum, sum);
    EXPECT_TRUE(Bytes(e) == bytes);
    ASSERT_OK(store_->Unpin(sid_, pin));
  }
  std::string Bytes(const LookupEntry& e) {
    return std::string(store_->dram_region().base + e.offset, e.size);
  }
  static std::string Block(int i) { return std::string(256 << 10, static_cast<char>('a' + i % 26)); }
  // The NVMe tier's files as a crash would leave them now (what RocksDB
  // wrote; not its memtables), opened as a tier of their own; null (and a
  // failure) if that fails.
  std::unique_ptr<NvmeTier> OpenCrashImage() {
    const std::string image = dir_ + "/crash";
    std::filesystem::copy(dir_ + "/nvme", image);
    NvmeTierOptions o;
    o.path = image;
    o.capacity_bytes = 64 << 20;
    auto tier = OpenNvmeTier(o, &clock_);
    EXPECT_OK(tier);
    return tier.ok() ? std::move(tier).value() : nullptr;
  }

  FakeClock clock_;
  bool create_namespaces_ = true;
  uint32_t max_pinned_blocks_per_session_ =
      StoreOptions{}.max_pinned_blocks_per_session;
  uint32_t max_queued_promotions_ = StoreOptions().max_queued_promotions;
  uint32_t max_namespaces_ = StoreOptions().max_namespaces;
  rocksdb::Env* nvme_env_ = nullptr;
  uint64_t nvme_capacity_ = 64 << 20;
  uint64_t nvme_max_blocks_ = 0;
  std::string dir_;
  std::unique_ptr<TieredStore> store_;
  SessionId sid_ = 0;
};

TEST_F(TieredStoreNvmeTest, DemotedBlocksAreFoundOnNvmeAndPromotedWhenPinned) {
  for (int i = 0; i < 12; ++i) Put("b" + std::to_string(i), Block(i));
  EXPECT_GT(store_->RunEviction(), 0u);  // the background evictor's work
  StoreStats st = store_->Stats();
  EXPECT_GT(st.demotions, 0u);
  EXPECT_EQ(st.nvme.blocks, st.demotions);
  // The oldest block left DRAM: a plain lookup reports it on NVMe.
  LookupEntry e = Look("b0", false);
  EXPECT_TRUE(e.found);
  EXPECT_EQ(e.tier, Tier::kNvme);
  EXPECT_EQ(e.size, 256u << 10);
  EXPECT_EQ(e.checksum, BlockChecksum(Block(0)));
  // A pinned lookup brings it back into DRAM with the right bytes. It is
  // an NVMe hit, like the plain lookup's.
  const uint64_t dram_hits = store_->Stats().dram.hits;
  PinId pin = 0;
  e = Look("b0", true, &pin);
  ASSERT_TRUE(e.found);
  EXPECT_EQ(e.tier, Tier::kDram);
  EXPECT_TRUE(e.promoted);
  EXPECT_EQ(Bytes(e), Block(0));
  st = store_->Stats();
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_EQ(st.nvme.hits, 2u);
  EXPECT_EQ(st.dram.hits, dram_hits);
  ASSERT_OK(store_->Unpin(sid_, pin));
  // From then on it is a DRAM hit.
  e = Look("b0", true, &pin);
  EXPECT_FALSE(e.promoted);
  EXPECT_EQ(store_->Stats().dram.hits, dram_hits + 1);
  ASSERT_OK(store_->Unpin(sid_, pin));
}

// A promoted block is on both tiers; leaving DRAM again writes nothing, and
// is no demotion (StoreStats::demotions, PersistDram's count: blocks
// written to NVMe).
TEST_F(TieredStoreNvmeTest, APromotedBlockLeavingDramAgainIsNoDemotion) {
  Put("b0", Block(0));
  auto persisted = store_->PersistDram();
  ASSERT_OK(persisted);
  EXPECT_EQ(*persisted, 1u);
  const uint64_t written = store_->Stats().nvme_write_bytes;
  PinId pin = 0;
  ASSERT_TRUE(Look("b0", true, &pin).promoted);
  ASSERT_OK(store_->Unpin(sid_, pin));
  persisted = store_->PersistDram();
  ASSERT_OK(persisted);
  EXPECT_EQ(*persisted, 0u);
  const StoreStats st = store_->Stats();
  EXPECT_EQ(st.demotions, 1u);
  EXPECT_EQ(st.demotion_failures, 0u);
  EXPECT_EQ(st.nvme_write_bytes, written);
  EXPECT_EQ(st.dram.blocks, 0u);
  EXPECT_EQ(Look("b0", false).tier, Tier::kNvme);
}

// A DRAM block whose bytes changed after its put (memory corruption) is
// not written to NVMe with its old checksum when demoted: it is dropped
// and counted as a DRAM integrity error, not as a demotion failure (which
// means a disk that takes no writes).
TEST_F(TieredStoreNvmeTest, ABlockCorruptedInDramIsDroppedWhenDemoted) {
  Put("b0", Block(0));
  PinId pin = 0;
  LookupEntry e = Look("b0", true, &pin);
  ASSERT_TRUE(e.found);
  store_->dram_region().base[e.offset + 1000] ^= 0x01;  // one bit
  ASSERT_OK(store_->Unpin(sid_, pin));
  for (int i = 1; i < 12; ++i) Put("b" + std::to_string(i), Block(i));
  EXPECT_GT(store_->RunEviction(), 0u);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.dram_integrity_errors, 1u);
  EXPECT_EQ(st.demotion_failures, 0u);
  EXPECT_EQ(st.nvme.blocks, st.demotions);
  EXPECT_FALSE(Look("b0", false).found) << "the corrupt block was kept";
  // The blocks demoted with it are served, byte for byte.
  ExpectServes("b1", Block(1));
}

// DropCorruptDram drops a DRAM copy only while it is the block named and
// its bytes are bad; one a session pins is hidden from lookups and dropped
// by RetryCorruptDrops once unpinned. An NVMe copy stays: the next pinned
// lookup reads that back.
TEST_F(TieredStoreNvmeTest, DropCorruptDramDropsOnlyABadDramCopy) {
  auto flip = [&](const std::string& key) {
    PinId pin = 0;
    LookupEntry e = Look(key, true, &pin);
    ASSERT_TRUE(e.found);
    ASSERT_EQ(e.tier, Tier::kDram);
    store_->dram_region().base[e.offset + 7] ^= 0x01;
    ASSERT_OK(store_->Unpin(sid_, pin));
  };
  const uint64_t sum0 = BlockChecksum(Block(0));
  Put("b0", Block(0));
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
            CorruptDramCheck::kNotCorrupt)
      << "its bytes are good";
  EXPECT_TRUE(Look("b0", false).found);
  flip("b0");
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0 + 1),
            CorruptDramCheck::kNotCorrupt)
      << "not that block";
  EXPECT_EQ(store_->DropCorruptDram("ns", "nope", sum0),
            CorruptDramCheck::kNotCorrupt);
  EXPECT_EQ(store_->DropCorruptDram("other", "b0", sum0),
            CorruptDramCheck::kNotCorrupt);
  EXPECT_EQ(store_->DropCorruptDram("ns", "", sum0),
            CorruptDramCheck::kNotCorrupt);
  // Pinned (the reader's own pin, as an engine holds it from its lookup
  // until after the get): kept and listed, then dropped once unpinned.
  PinId held = 0;
  ASSERT_TRUE(Look("b0", true, &held).found);
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0), CorruptDramCheck::kKept)
      << "pinned by a session";
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
            CorruptDramCheck::kKeptAlready);
  EXPECT_EQ(store_->RetryCorruptDrops(), 0) << "still pinned";
  EXPECT_FALSE(Look("b0", false).found) << "a lookup found it while kept";
  EXPECT_FALSE(Look("b0", true).found);
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions, 0u);
  ASSERT_OK(store_->Unpin(sid_, held));
  EXPECT_EQ(store_->RetryCorruptDrops(), 1);
  EXPECT_EQ(store_->RetryCorruptDrops(), 0) << "forgotten once dropped";
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
            CorruptDramCheck::kNotCorrupt)
      << "dropped already";
  EXPECT_FALSE(Look("b0", false).found);
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions, 1u);
  Put("b0", Block(0));  // stored again
  ExpectServes("b0", Block(0));

  // Unpinned at once: dropped at once.
  flip("b0");
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
            CorruptDramCheck::kDropped);
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions, 2u);

  // Kept, then unpinned: a second report drops it (kDroppedAlready: the
  // first counted it), and the retry finds nothing left.
  Put("b0", Block(0));
  auto keep = [&] {
    flip("b0");
    ASSERT_TRUE(Look("b0", true, &held).found);
    EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
              CorruptDramCheck::kKept);
    ASSERT_OK(store_->Unpin(sid_, held));
  };
  keep();
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
            CorruptDramCheck::kDroppedAlready);
  EXPECT_EQ(store_->RetryCorruptDrops(), 0);
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions, 3u);

  // Kept, then unpinned: a put of its key drops it and stores the block
  // again (it was told "stored already" before, and the block stayed lost).
  Put("b0", Block(0));
  keep();
  Put("b0", Block(0));
  ExpectServes("b0", Block(0));
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions, 4u);
  EXPECT_EQ(store_->RetryCorruptDrops(), 0);

  // Kept, then evicted and stored again before the retry: the retry drops
  // nothing and forgets it, even with the new copy bad too (an entry not
  // marked is a newer block; the retry never hashes).
  keep();
  absl::string_view b0 = "b0";
  absl::StatusOr<EvictResult> evicted = store_->Evict("ns", {&b0, 1}, false);
  ASSERT_OK(evicted.status());
  EXPECT_EQ(evicted->evicted_blocks, 1u);
  Put("b0", Block(0));
  flip("b0");
  EXPECT_EQ(store_->RetryCorruptDrops(), 0);
  EXPECT_TRUE(Look("b0", false).found) << "not found bad yet";
  EXPECT_EQ(store_->DropCorruptDram("ns", "b0", sum0),
            CorruptDramCheck::kDropped);
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions, 5u);

  // At most kMaxCorruptKept are listed: past that the oldest are forgotten.
  std::vector<PinId> pins;
  for (size_t i = 0; i <= TieredStore::kMaxCorruptKept; ++i) {
    const std::string key = "c" + std::to_string(i);
    const std::string bytes(512, static_cast<char>('a' + i % 26));
    Put(key, bytes);
    flip(key);
    PinId pin = 0;
    ASSERT_TRUE(Look(key, true, &pin).found);
    pins.push_back(pin);
    EXPECT_EQ(store_->DropCorruptDram("ns", key, BlockChecksum(bytes)),
              CorruptDramCheck::kKept);
  }
  for (PinId pin : pins) ASSERT_OK(store_->Unpin(sid_, pin));
  EXPECT_EQ(store_->RetryCorruptDrops(),
            static_cast<int>(TieredStore::kMaxCorruptKept));
  // The oldest went unlisted: hidden all the same, and still in DRAM until
  // evicted.
  EXPECT_FALSE(Look("c0", false).found);
  absl::string_view c0 = "c0", c1 = "c1";
  absl::StatusOr<EvictResult> ev = store_->Evict("ns", {&c0, 1}, false);
  ASSERT_OK(ev.status());
  EXPECT_EQ(ev->evicted_blocks, 1u);
  ev = store_->Evict("ns", {&c1, 1}, false);
  ASSERT_OK(ev.status());
  EXPECT_EQ(ev->evicted_blocks, 0u) << "dropped by the retry";

  // A block on both tiers (demoted, then read back): its NVMe copy stays.
  for (int i = 1; i < 12; ++i) Put("b" + std::to_string(i), Block(i));
  EXPECT_GT(store_->RunEviction(), 0u);
  ASSERT_EQ(Look("b1", false).tier, Tier::kNvme);
  flip("b1");  // the pinned lookup promotes it; the DRAM copy goes bad
  EXPECT_EQ(store_->DropCorruptDram("ns", "b1", BlockChecksum(Block(1))),
            CorruptDramCheck::kDropped);
  EXPECT_EQ(Look("b1", false).tier, Tier::kNvme);
  ExpectServes("b1", Block(1));
  EXPECT_EQ(store_->Stats().dram_corrupt_evictions,
            6u + TieredStore::kMaxCorruptKept);
  // Each bad copy counted once, when first found.
  EXPECT_EQ(store_->Stats().dram_integrity_errors,
            8u + TieredStore::kMaxCorruptKept);
}

// A block found corrupt and kept (pinned) that leaves DRAM by demotion is
// not written to NVMe, nor counted again, and counts as a corrupt eviction.
TEST_F(TieredStoreNvmeTest, ABlockFoundCorruptIsNotDemoted) {
  for (int i = 0; i < 12; ++i) Put("d" + std::to_string(i), Block(i));
  PinId pin = 0;
  LookupEntry e = Look("d0", true, &pin);
  ASSERT_TRUE(e.found);
  store_->dram_region().base[e.offset + 7] ^= 0x01;
  EXPECT_EQ(store_->DropCorruptDram("ns", "d0", BlockChecksum(Block(0))),
            CorruptDramCheck::kKept);
  ASSERT_OK(store_->Unpin(sid_, pin));
  ASSERT_OK(store_->PersistDram().status());
  const StoreStats st = store_->Stats();
  EXPECT_EQ(st.dram.blocks, 0u);
  EXPECT_EQ(st.nvme.blocks, 11u);
  EXPECT_EQ(st.demotions, 11u);
  EXPECT_EQ(st.demotion_failures, 0u);
  EXPECT_EQ(st.dram_integrity_errors, 1u)
      << "counted once, by the report, not again by the demotion";
  EXPECT_EQ(st.dram_corrupt_evictions, 1u);
  EXPECT_FALSE(Look("d0", false).found);
  ExpectServes("d1", Block(1));
}

// Bug: evicting a whole namespace counted a block held in both tiers (read
// back into DRAM, its NVMe copy kept) twice: once for each copy.
TEST_F(TieredStoreNvmeTest, EvictingANamespaceCountsABlockInBothTiersOnce) {
  constexpr int kBlocks = 12;
  for (int i = 0; i < kBlocks; ++i) Put("b" + std::to_string(i), Block(i));
  EXPECT_GT(store_->RunEviction(), 0u);
  PinId pin = 0;
  LookupEntry e = Look("b0", true, &pin);
  ASSERT_TRUE(e.promoted);
  ASSERT_OK(store_->Unpin(sid_, pin));
  absl::StatusOr<BlockDetails> inspected = store_->Inspect("ns", "b0");
  ASSERT_OK(inspected.status());
  ASSERT_TRUE(inspected->in_dram && inspected->in_nvme);
  absl::StatusOr<EvictResult> ev = store_->Evict("ns", {}, true);
  ASSERT_OK(ev.status());
  EXPECT_EQ(ev->evicted_blocks, static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(ev->evicted_bytes, uint64_t{kBlocks} * (256 << 10));
  EXPECT_FALSE(Look("b0", false).found);
}

// With the evictor and an NVMe tier, a batch that cannot fit while the rest
// of DRAM is pinned waits, and then fails having dropped nothing: the quota's
// charge does not drop the namespace's blocks (which NVMe would have kept)
// for a put that then finds no room.
// A namespace's quota bounds its DRAM, not what it keeps: the blocks a put
// (or a promotion) evicts to stay within it are demoted to NVMe as the
// evictor's are. They were dropped from both tiers, and a pinned lookup of
// one block on NVMe dropped another that had never been written there.
TEST_F(TieredStoreNvmeTest, AQuotaDemotesWhatItEvicts) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  ASSERT_OK(store_->SetQuota("q", 1 << 20));  // 4 blocks of 256 KiB
  auto put = [&](const std::string& key, int i) {
    PutSpec spec{key, "", Block(i).size()};
    auto r = store_->BeginPut(sid_, "q", {&spec, 1});
    if (!r.ok()) return r.status();
    std::memcpy(store_->dram_region().base + r->slots[0].offset,
                Block(i).data(), Block(i).size());
    const uint64_t sum = BlockChecksum(Block(i));
    return store_->CommitPut(sid_, r->id, {&sum, 1}).status();
  };
  for (int i = 0; i < 4; ++i) ASSERT_OK(put("q" + std::to_string(i), i));
  // A caller that must not block (a UCX request) is told to wait: the
  // demotion would write to NVMe on its thread.
  PutSpec spec{"q4", "", Block(4).size()};
  bool would_wait = false;
  EXPECT_THAT(store_->BeginPut(sid_, "q", {&spec, 1}, &would_wait),
              StatusIs(Code::kUnavailable));
  EXPECT_TRUE(would_wait);
  EXPECT_EQ(store_->Stats().demotions, 0u);
  for (int i = 4; i < 8; ++i) ASSERT_OK(put("q" + std::to_string(i), i));
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.demotions, 4u);
  EXPECT_EQ(st.dram.evictions, 4u);
  for (int i = 0; i < 8; ++i) {
    const std::string key = "q" + std::to_string(i);
    absl::string_view k = key;
    auto l = store_->Lookup(sid_, "q", {&k, 1}, false, false);
    ASSERT_OK(l);
    EXPECT_TRUE(l->entries[0].found) << key << " was dropped";
  }
  // A pinned lookup of a block on NVMe promotes it within the quota: the
  // block it evicts for that goes to NVMe too, and every block is served.
  PinId pin = 0;
  absl::string_view k0 = "q0";
  auto l = store_->Lookup(sid_, "q", {&k0, 1}, false, /*pin=*/true);
  ASSERT_OK(l);
  ASSERT_TRUE(l->entries[0].found);
  pin = l->pin_id;
  EXPECT_TRUE(std::string(store_->dram_region().base + l->entries[0].offset,
                          l->entries[0].size) == Block(0));
  ASSERT_OK(store_->Unpin(sid_, pin));
  for (int i = 0; i < 8; ++i) {
    const std::string key = "q" + std::to_string(i);
    absl::string_view k = key;
    auto r = store_->Lookup(sid_, "q", {&k, 1}, false, /*pin=*/true);
    ASSERT_OK(r);
    ASSERT_TRUE(r->entries[0].found) << key << " was dropped";
    EXPECT_TRUE(std::string(store_->dram_region().base + r->entries[0].offset,
                            r->entries[0].size) == Block(i))
        << key;
    ASSERT_OK(store_->Unpin(sid_, r->pin_id));
  }
}

TEST_F(TieredStoreNvmeTest, AQuotaPutThatCannotFitDropsNothing) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true, /*high_watermark=*/1.0);
  const size_t kB = 256 << 10;
  ASSERT_OK(store_->SetQuota("q", 2 << 20));
  auto put = [&](const std::string& ns, const std::string& key) {
    PutSpec spec{key, "", kB};
    bool would_wait = false;
    auto r = store_->BeginPut(sid_, ns, {&spec, 1}, &would_wait);
    if (!r.ok()) return r.status();
    std::string bytes(kB, key[0]);
    std::memcpy(store_->dram_region().base + r->slots[0].offset, bytes.data(), kB);
    const uint64_t sum = BlockChecksum(bytes);
    return store_->CommitPut(sid_, r->id, {&sum, 1}).status();
  };
  for (int i = 0; i < 4; ++i) ASSERT_OK(put("q", "q" + std::to_string(i)));
  std::vector<PinId> pins;  // the rest of DRAM: pinned blocks of "p"
  for (int i = 0; i < 64; ++i) {
    const std::string key = "p" + std::to_string(i);
    if (!put("p", key).ok()) break;
    absl::string_view k = key;
    auto l = store_->Lookup(sid_, "p", {&k, 1}, false, true);
    ASSERT_OK(l);
    pins.push_back(l->pin_id);
  }
  ASSERT_GE(pins.size(), 4u);
  std::vector<std::string> keys;  // outlive the specs' views of them
  for (int i = 0; i < 6; ++i) keys.push_back("n" + std::to_string(i));
  std::vector<PutSpec> specs;
  for (const std::string& key : keys) specs.push_back({key, "", kB});
  EXPECT_THAT(store_->BeginPut(sid_, "q", specs), StatusIs(Code::kResourceExhausted));
  for (int i = 0; i < 4; ++i) {
    const std::string key = "q" + std::to_string(i);
    absl::string_view k = key;
    auto l = store_->Lookup(sid_, "q", {&k, 1}, false, false);
    ASSERT_OK(l);
    EXPECT_TRUE(l->entries[0].found) << key << " was dropped";
  }
  for (PinId pin : pins) ASSERT_OK(store_->Unpin(sid_, pin));
}

// A pinned lookup of an NVMe block that no eviction can make room for in
// DRAM (the rest is pinned) is a miss at once: it demotes nothing, as a
// put of the same block (BeginPut's CheckRoom) would not. It used to ask
// the evictor for room and wait while every unpinned block was demoted.
TEST_F(TieredStoreNvmeTest, APromotionThatCannotFitDemotesNothing) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  const std::string big(2 << 20, 'B');
  Put("big", big);
  ASSERT_OK(store_->PersistDram());
  ASSERT_EQ(Look("big", false).tier, Tier::kNvme);
  std::vector<PinId> pins;  // 2 MiB pinned
  for (int i = 0; i < 8; ++i) {
    Put("p" + std::to_string(i), Block(i));
    PinId pin = 0;
    ASSERT_TRUE(Look("p" + std::to_string(i), true, &pin).found);
    pins.push_back(pin);
  }
  for (int i = 0; i < 4; ++i) Put("u" + std::to_string(i), Block(i));
  const StoreStats before = store_->Stats();

  PinId pin = 0;
  const LookupEntry e = Look("big", true, &pin);
  EXPECT_FALSE(e.found && e.tier == Tier::kDram) << "promoted into no room";
  // A miss, that says why: stored, on NVMe, not readable into DRAM now.
  EXPECT_FALSE(e.found);
  EXPECT_TRUE(e.on_nvme);
  EXPECT_FALSE(Look("absent", true).on_nvme);
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.demotions, before.demotions);
  EXPECT_EQ(after.dram.blocks, before.dram.blocks);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Look("u" + std::to_string(i), false).tier, Tier::kDram) << i;
  }
  if (e.found) {
    ASSERT_OK(store_->Unpin(sid_, pin));
  }
  for (PinId p : pins) ASSERT_OK(store_->Unpin(sid_, p));
  // With the pins gone it fits, and is promoted.
  ASSERT_TRUE(Look("big", true, &pin).found);
  EXPECT_EQ(store_->Stats().promotions, before.promotions + 1);
  ASSERT_OK(store_->Unpin(sid_, pin));
}

// With the evictor and an NVMe tier, a put that finds DRAM full waits for
// room; a caller that must not block (a UCX progress thread) can decline
// to: Unavailable at once, would_wait set, nothing reserved (also when every
// block is pinned: pins end). A put that waits and finds no room in time
// fails ResourceExhausted.
TEST_F(TieredStoreNvmeTest, APutThatWouldWaitForRoomCanDeclineTo) {
  // The evictor only runs when asked (its high mark is never passed), and
  // every block is pinned: nothing can make room.
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  std::vector<PinId> pins;
  bool declined = false;
  for (int i = 0; i < 32 && !declined; ++i) {
    const std::string key = "p" + std::to_string(i);
    PutSpec spec{key, "", 256 << 10};
    bool would_wait = true;  // BeginPut clears it unless it would wait
    auto r = store_->BeginPut(sid_, "ns", {&spec, 1}, &would_wait);
    if (!r.ok()) {
      EXPECT_TRUE(would_wait);
      EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
      declined = true;
      break;
    }
    EXPECT_FALSE(would_wait);
    {
      auto slot = store_->AcquireSlot(sid_, r->id, 0);
      ASSERT_OK(slot);
      std::memset((*slot)->bytes().data(), 'p', spec.size);
    }
    const uint64_t sum = BlockChecksum(std::string(spec.size, 'p'));
    ASSERT_OK(store_->CommitPut(sid_, r->id, {&sum, 1}));
    PinId pin = 0;
    ASSERT_TRUE(Look(key, true, &pin).found);
    pins.push_back(pin);
  }
  ASSERT_TRUE(declined) << "DRAM never filled";
  EXPECT_GE(pins.size(), 8u);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.reservations, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  // Without would_wait the same put waits for a round of the evictor, which
  // cannot move pinned blocks: nothing makes room.
  PutSpec spec{"late", "", 256 << 10};
  EXPECT_TRUE(absl::IsResourceExhausted(
      store_->BeginPut(sid_, "ns", {&spec, 1}).status()));
  for (PinId pin : pins) ASSERT_OK(store_->Unpin(sid_, pin));
}

// A put that finds DRAM full waits for room for its own block, not for the
// evictor's whole round down to the low watermark: it goes on once the
// round's first demotion made room, while the round still runs (held here
// at its second demotion). It used to wait for the round's end; with the
// round held past kMaxWaitForRoom it then dropped a block to make room.
TEST_F(TieredStoreNvmeTest, APutIntoFullDramWaitsForRoomNotForTheWholeRound) {
  // The evictor runs only when asked (its high mark is never passed); a
  // round goes down to the low mark, a quarter of DRAM.
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  int stored = 0;
  ASSERT_NO_FATAL_FAILURE(FillDram(&stored));
  // The put refused above may have woken the evictor already: count from
  // here, both of them.
  const StoreStats before = store_->Stats();

  std::atomic<int> demotion_writes{0};
  absl::Notification held, release, left;
  internal::SyncPointCallback hold("NvmeTier::Put:Writing", [&](void*) {
    if (demotion_writes.fetch_add(1) != 1) return;
    held.Notify();
    release.WaitForNotification();
    left.Notify();
  });
  absl::Notification put_done;
  std::thread put([&] {
    Put("new", Block(25));
    put_done.Notify();
  });
  const bool done_while_held =
      put_done.WaitForNotificationWithTimeout(absl::Seconds(60)) &&
      !left.HasBeenNotified();
  release.Notify();
  put.join();
  if (held.HasBeenNotified()) left.WaitForNotification();
  EXPECT_TRUE(done_while_held);
  // Every block left DRAM by demotion: none was dropped to make room. (The
  // round goes on after the put: a demotion is counted a moment before its
  // eviction, so the two are compared once they agree or time is up.)
  StoreStats st = store_->Stats();
  for (int i = 0; i < 500 && st.dram.evictions - before.dram.evictions !=
                                 st.demotions - before.demotions;
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    st = store_->Stats();
  }
  EXPECT_EQ(st.room_wait_timeouts, 0u) << "the put waited for the round";
  EXPECT_EQ(st.dram.evictions - before.dram.evictions, st.demotions - before.demotions);
  EXPECT_EQ(Lost("b", stored), 0);
  ExpectServes("new", Block(25));
}

// A reader pins the block the evictor is demoting for a waiting put: the
// block stays in DRAM, nothing was freed. The evictor woke the put all the
// same, and the put, seeing no room made, dropped a block itself (lost
// from both tiers although NVMe had room). Only a block that left wakes it.
TEST_F(TieredStoreNvmeTest, ADemotedBlockAReaderPinnedWakesNoWaitingPut) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  int stored = 0;
  ASSERT_NO_FATAL_FAILURE(FillDram(&stored));
  // (The put refused above started no round: the high mark is never
  // passed.)
  const StoreStats before = store_->Stats();

  std::atomic<int> writes{0};
  std::string pinned_key;
  PinId pin = 0;
  internal::SyncPointCallback during("NvmeTier::Put:Writing", [&](void*) {
    const int n = writes.fetch_add(1);
    if (n == 0) {
      // The first block demoted for the put: a reader pins it meanwhile.
      for (int i = 0; i < stored && pin == 0; ++i) {
        const std::string key = "b" + std::to_string(i);
        absl::string_view k = key;
        auto r = store_->Lookup(sid_, "ns", {&k, 1}, false, /*pin=*/true);
        if (r.ok() && r->entries[0].found && r->pin_id != 0) {
          // Pinned the oldest block still in DRAM: the one being demoted.
          pinned_key = key;
          pin = r->pin_id;
        }
      }
    } else if (n == 1) {
      absl::SleepFor(absl::Milliseconds(300));  // a slow write
    }
  });
  Put("new", Block(25));
  // Every block that left DRAM was demoted, and one demoted block stayed
  // (pinned). (A demotion is counted a moment before its eviction: compared
  // once they agree or time is up.)
  StoreStats st = store_->Stats();
  for (int i = 0; i < 500 && st.dram.evictions - before.dram.evictions + 1 !=
                                 st.demotions - before.demotions;
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    st = store_->Stats();
  }
  ASSERT_NE(pin, 0u);
  ASSERT_OK(store_->Unpin(sid_, pin));
  EXPECT_EQ(Lost("b", stored), 0) << "blocks dropped from both tiers";
  EXPECT_EQ(st.dram.evictions - before.dram.evictions + 1,
            st.demotions - before.demotions)
      << "blocks dropped, not demoted";
  EXPECT_EQ(st.room_wait_timeouts, 0u);
  ExpectServes("new", Block(25));
}

// Many puts of one block each into a full DRAM, at once (as UCX data
// requests make them): each waits for the evictor to demote room, round
// after round while others take a round's room first, and none drops a
// block that NVMe had room for. (Each waited for one round only, and then
// dropped blocks itself: 5-15 of 96 were lost over UCX.)
TEST_F(TieredStoreNvmeTest, ConcurrentOneBlockPutsIntoFullDramLoseNothing) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true);
  constexpr int kThreads = 8, kPerThread = 12;  // 24 MiB into 4 MiB of DRAM
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int n = t * kPerThread + i;
        const std::string key = "c" + std::to_string(n);
        const std::string bytes = Block(n);
        PutSpec spec{key, "", bytes.size()};
        auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
        if (!r.ok()) {
          failed++;
          continue;
        }
        {
          auto slot = store_->AcquireSlot(sid_, r->id, 0);
          if (!slot.ok()) {
            failed++;
            continue;
          }
          std::memcpy((*slot)->bytes().data(), bytes.data(), bytes.size());
        }
        const uint64_t sum = BlockChecksum(bytes);
        if (!store_->CommitPut(sid_, r->id, {&sum, 1}).ok()) failed++;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  // The evictor may still be demoting: a block is then found in DRAM.
  int missing = 0;
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    LookupEntry e = Look("c" + std::to_string(n), false);
    if (!e.found) {
      ++missing;
      continue;
    }
    EXPECT_EQ(e.checksum, BlockChecksum(Block(n))) << n;
  }
  EXPECT_EQ(missing, 0);
  StoreStats st = store_->Stats();
  // Every eviction was a demotion (the evictor may be between a demotion
  // and its eviction, and a block demoted twice counts twice).
  EXPECT_LE(st.dram.evictions, st.demotions) << "blocks dropped, not demoted";
}

// A put of a block bigger than the free space the low watermark leaves
// (here 3.5 MiB, in 4 MiB of DRAM kept 25% full) waits for the evictor to
// demote room for it, past the low watermark, rather than dropping blocks
// that NVMe has room for. (The forced round stopped at the low watermark,
// freeing nothing, and the put then dropped blocks from both tiers.)
TEST_F(TieredStoreNvmeTest, ABigPutDemotesPastTheLowWatermarkInsteadOfDropping) {
  // The evictor runs only when a put asks (its high mark is never passed).
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  const std::string small(64 << 10, 's');
  constexpr int kSmall = 100;  // 6.25 MiB: DRAM fills and demotes already
  for (int i = 0; i < kSmall; ++i) Put("s" + std::to_string(i), small);
  const std::string big((7 << 20) / 2, 'B');
  Put("big", big);
  EXPECT_EQ(Look("big", false).tier, Tier::kDram);
  EXPECT_EQ(Lost("s", kSmall), 0) << "blocks dropped from both tiers";
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.dram.evictions, st.demotions) << "blocks dropped, not demoted";
  EXPECT_EQ(st.demotion_failures, 0u);
}

// The same for a fragmented arena: the free space below the low watermark
// is enough in sum but not in one piece (the blocks left are every other
// one: lookups gave them a second chance). The evictor demotes on until the
// block fits.
TEST_F(TieredStoreNvmeTest, ABigPutIntoAFragmentedArenaDemotesInsteadOfDropping) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true,
       /*high_watermark=*/1.0);
  const std::string small(64 << 10, 's');
  constexpr int kSmall = 40;  // 2.5 MiB: no eviction yet
  for (int i = 0; i < kSmall; ++i) Put("s" + std::to_string(i), small);
  ASSERT_EQ(store_->Stats().dram.evictions, 0u);
  for (int i = 1; i < kSmall; i += 2) Look("s" + std::to_string(i), false);
  const std::string big(2 << 20, 'B');  // 32 pages; the low mark frees 48
  Put("big", big);
  EXPECT_EQ(Look("big", false).tier, Tier::kDram);
  EXPECT_EQ(Lost("s", kSmall), 0) << "blocks dropped from both tiers";
  StoreStats st = store_->Stats();
  EXPECT_GT(st.demotions, 0u);
  EXPECT_EQ(st.dram.evictions, st.demotions) << "blocks dropped, not demoted";
}

// While the evictor demotes, a block is always found in one tier or the
// other, and an Evict removes it from both. (A block used to leave the DRAM
// index before its NVMe write: lookups then missed it, and an Evict in that
// moment found nothing and was undone when the write landed.)
TEST_F(TieredStoreNvmeTest, BlocksBeingDemotedAreNeitherMissedNorBroughtBackByTheirWrite) {
  Open(/*admit_min_reads=*/0, /*background_eviction=*/true);
  constexpr int kDoomed = 32, kKept = 40;  // 18 MiB into 4 MiB of DRAM
  for (int n = 0; n < kDoomed; ++n) Put("d" + std::to_string(n), Block(n));
  std::atomic<int> kept_stored{0};
  std::atomic<bool> writing{true};
  std::atomic<int> misses{0};
  std::thread writer([&] {
    for (int n = 0; n < kKept; ++n) {
      Put("k" + std::to_string(n), Block(n));
      kept_stored.store(n + 1);
    }
    writing.store(false);
  });
  std::thread reader([&] {
    while (writing.load()) {
      const int stored = kept_stored.load();
      for (int n = 0; n < stored; ++n) {
        if (!Look("k" + std::to_string(n), false).found) misses++;
      }
    }
  });
  // The evictor demotes the oldest blocks first: the doomed ones, in order.
  uint64_t evicted = 0, not_found = 0;
  for (int n = 0; n < kDoomed; ++n) {
    const std::string key = "d" + std::to_string(n);
    absl::string_view k = key;
    absl::StatusOr<EvictResult> r = store_->Evict("ns", {&k, 1}, false);
    ASSERT_OK(r);
    evicted += r->evicted_blocks;
    not_found += r->missing_keys;
    EXPECT_TRUE(r->pinned_keys.empty()) << key;
  }
  writer.join();
  reader.join();
  EXPECT_EQ(misses.load(), 0) << "stored blocks missed while being demoted";
  EXPECT_EQ(not_found, 0u) << "stored blocks not found by Evict";
  EXPECT_GE(evicted, uint64_t{kDoomed});  // DRAM and NVMe copies both count
  ASSERT_OK(store_->PersistDram());  // every demotion has ended
  for (int n = 0; n < kDoomed; ++n) {
    EXPECT_FALSE(Look("d" + std::to_string(n), false).found) << "d" << n << " came back";
  }
  for (int n = 0; n < kKept; ++n) {
    LookupEntry e = Look("k" + std::to_string(n), false);
    ASSERT_TRUE(e.found) << n;
    EXPECT_EQ(e.checksum, BlockChecksum(Block(n))) << n;
  }
}

// A pinned lookup that needs promotions answers from a promotion thread,
// with every block read in one batch; one served from DRAM answers on the
// caller's thread before LookupAsync returns.
TEST_F(TieredStoreNvmeTest, PinnedLookupPromotesOffTheCallersThread) {
  for (int i = 0; i < 4; ++i) Put("n" + std::to_string(i), Block(i));
  ASSERT_OK(store_->PersistDram());  // all four only on NVMe now
  Put("d", Block(9));                // and one in DRAM
  const std::thread::id caller = std::this_thread::get_id();

  std::vector<absl::string_view> dram_only = {"d"};
  bool answered_inline = false;
  store_->LookupAsync(sid_, "ns", dram_only, false, true,
                      [&](absl::StatusOr<LookupResult> r) {
                        answered_inline = std::this_thread::get_id() == caller;
                        ASSERT_OK(r);
                        EXPECT_OK(store_->Unpin(sid_, r->pin_id));
                      });
  EXPECT_TRUE(answered_inline);

  std::vector<absl::string_view> keys = {"n0", "n1", "d", "n2", "n3"};
  absl::Notification done;
  absl::StatusOr<LookupResult> result;
  std::thread::id answered_on;
  store_->LookupAsync(sid_, "ns", keys, false, true,
                      [&](absl::StatusOr<LookupResult> r) {
                        answered_on = std::this_thread::get_id();
                        result = std::move(r);
                        done.Notify();
                      });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_NE(answered_on, caller);
  ASSERT_OK(result);
  EXPECT_EQ(result->prefix_hits, 5u);
  for (size_t i = 0; i < keys.size(); ++i) {
    const LookupEntry& e = result->entries[i];
    ASSERT_TRUE(e.found) << keys[i];
    EXPECT_EQ(e.tier, Tier::kDram);
    int block = keys[i] == "d" ? 9 : keys[i][1] - '0';
    EXPECT_EQ(Bytes(e), Block(block)) << keys[i];
  }
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.promotions, 4u);
  EXPECT_EQ(st.pinned_blocks, 5u);
  // The promoted blocks are pinned: eviction cannot take them.
  store_->RunEviction();
  ASSERT_OK(store_->Evict("ns", {}, true));
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(Bytes(result->entries[i]), Block(keys[i] == "d" ? 9 : keys[i][1] - '0'));
  }
  auto released = store_->Unpin(sid_, result->pin_id);
  ASSERT_OK(released);
  EXPECT_EQ(*released, 5u);
  EXPECT_EQ(store_->Stats().pinned_blocks, 0u);
}

// Pinned lookups waiting for their promotions count against the session's
// pin limit from the moment they are accepted, not only once answered: a
// session cannot pass the limit by asking faster than the disk reads.
TEST_F(TieredStoreNvmeTest, PinnedLookupsWaitingForPromotionCountAgainstTheLimit) {
  constexpr int kLimit = 4, kLookups = 10;
  max_pinned_blocks_per_session_ = kLimit;
  Open();
  for (int i = 0; i < kLookups; ++i) Put("n" + std::to_string(i), Block(i));
  ASSERT_OK(store_->PersistDram());  // all only on NVMe now

  // NVMe reads wait until released (a bound against a hang only).
  absl::Notification release;
  internal::SyncPointCallback hold("NvmeTier::MultiRead:Planned", [&](void*) {
    EXPECT_TRUE(release.WaitForNotificationWithTimeout(absl::Seconds(60)));
  });
  absl::Mutex mu;
  int answered = 0, pinned = 0, refused = 0;
  std::vector<PinId> pins;
  std::vector<std::string> keys;
  for (int i = 0; i < kLookups; ++i) keys.push_back("n" + std::to_string(i));
  for (int i = 0; i < kLookups; ++i) {
    absl::string_view k = keys[i];
    store_->LookupAsync(
        sid_, "ns", {&k, 1}, false, true, [&](absl::StatusOr<LookupResult> r) {
          absl::MutexLock lock(&mu);
          ++answered;
          if (r.ok()) {
            EXPECT_TRUE(r->entries[0].found);
            ++pinned;
            pins.push_back(r->pin_id);
          } else {
            EXPECT_THAT(r.status(), StatusIs(Code::kResourceExhausted));
            ++refused;
          }
        });
  }
  release.Notify();
  {
    absl::MutexLock lock(&mu);
    auto all_answered = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return answered == kLookups;
    };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all_answered),
                                    absl::Seconds(60)));
    EXPECT_EQ(pinned, kLimit);
    EXPECT_EQ(refused, kLookups - kLimit);
  }
  EXPECT_EQ(store_->Stats().pinned_blocks, static_cast<uint64_t>(kLimit));
  // At the limit, another pinned lookup is refused; after an unpin it fits.
  absl::string_view k = keys[0];
  EXPECT_THAT(store_->Lookup(sid_, "ns", {&k, 1}, false, true),
              StatusIs(Code::kResourceExhausted));
  ASSERT_OK(store_->Unpin(sid_, pins[0]));
  EXPECT_OK(store_->Lookup(sid_, "ns", {&k, 1}, false, true));
}

// The promotion queue is bounded across all lookups: once
// max_queued_promotions blocks wait for the disk, a pinned lookup reports a
// block found only on NVMe as a miss at once (shed, counted) instead of
// queueing; the places come back when the promotions finish.
TEST_F(TieredStoreNvmeTest, PinnedLookupsPastTheQueuedPromotionsLimitGetMisses) {
  constexpr int kQueued = 2, kLookups = 5;
  max_queued_promotions_ = kQueued;
  Open();
  std::vector<std::string> keys;
  for (int i = 0; i < kLookups; ++i) {
    keys.push_back("q" + std::to_string(i));
    Put(keys.back(), Block(i));
  }
  ASSERT_OK(store_->PersistDram());  // all only on NVMe now
  Put("dram", Block(7));             // in DRAM: needs no promotion

  absl::Notification release;
  internal::SyncPointCallback hold("NvmeTier::MultiRead:Planned", [&](void*) {
    EXPECT_TRUE(release.WaitForNotificationWithTimeout(absl::Seconds(60)));
  });
  absl::Mutex mu;
  int answered = 0, found = 0, missed = 0;
  std::vector<PinId> pins;
  for (int i = 0; i < kLookups; ++i) {
    absl::string_view k = keys[i];
    store_->LookupAsync(
        sid_, "ns", {&k, 1}, false, true, [&, i](absl::StatusOr<LookupResult> r) {
          ASSERT_OK(r);
          absl::MutexLock lock(&mu);
          ++answered;
          if (r->entries[0].found) {
            ++found;
            pins.push_back(r->pin_id);
            EXPECT_EQ(Bytes(r->entries[0]), Block(i));
          } else {
            ++missed;
            EXPECT_EQ(r->pin_id, 0u);
          }
        });
  }
  {
    // The shed lookups answered at once, while the queued ones still wait.
    absl::MutexLock lock(&mu);
    EXPECT_EQ(answered, kLookups - kQueued);
    EXPECT_EQ(missed, kLookups - kQueued);
  }
  EXPECT_EQ(store_->Stats().promotions_shed, static_cast<uint64_t>(kLookups - kQueued));
  // A pinned DRAM hit needs no place in the queue.
  PinId dram_pin = 0;
  EXPECT_TRUE(Look("dram", /*pin=*/true, &dram_pin).found);
  ASSERT_OK(store_->Unpin(sid_, dram_pin));
  release.Notify();
  {
    absl::MutexLock lock(&mu);
    auto all_answered = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return answered == kLookups;
    };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all_answered),
                                    absl::Seconds(60)));
    EXPECT_EQ(found, kQueued);
  }
  for (PinId p : pins) ASSERT_OK(store_->Unpin(sid_, p));
  // The queue is empty again: a batch of kQueued promotions fits.
  std::vector<absl::string_view> rest = {keys[kLookups - 2], keys[kLookups - 1]};
  auto r = store_->Lookup(sid_, "ns", rest, false, true);
  ASSERT_OK(r);
  EXPECT_TRUE(r->entries[0].found);
  EXPECT_TRUE(r->entries[1].found);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.promotions, static_cast<uint64_t>(kQueued + 2));
  EXPECT_EQ(st.promotions_shed, static_cast<uint64_t>(kLookups - kQueued));
}

// A pinned lookup waiting for its promotions holds planned pins only for the
// blocks it can pin (its DRAM hits and promotions), not for its misses: a
// 4-key lookup of 1 NVMe block and 3 misses leaves room under a limit of 4.
TEST_F(TieredStoreNvmeTest, WaitingLookupsPlanPinsOnlyForBlocksTheyCanPin) {
  max_pinned_blocks_per_session_ = 4;
  Open();
  Put("nvme", Block(1));
  ASSERT_OK(store_->PersistDram());
  Put("a", Block(2));
  Put("b", Block(3));

  absl::Notification release, answered;
  internal::SyncPointCallback hold("NvmeTier::MultiRead:Planned", [&](void*) {
    EXPECT_TRUE(release.WaitForNotificationWithTimeout(absl::Seconds(60)));
  });
  // A failed assertion below must not leave the promotion waiting.
  absl::Cleanup unblock = [&] {
    if (!release.HasBeenNotified()) release.Notify();
    answered.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  std::vector<absl::string_view> first = {"nvme", "x", "y", "z"};
  PinId first_pin = 0;
  store_->LookupAsync(sid_, "ns", first, false, true,
                      [&](absl::StatusOr<LookupResult> r) {
                        EXPECT_OK(r);
                        if (r.ok()) {
                          EXPECT_TRUE(r->entries[0].found);
                          EXPECT_FALSE(r->entries[1].found);
                          first_pin = r->pin_id;
                        }
                        answered.Notify();
                      });
  // 1 planned + 2 = 3 <= 4 (before: 4 planned + 2 > 4, ResourceExhausted).
  std::vector<absl::string_view> second = {"a", "b"};
  auto r = store_->Lookup(sid_, "ns", second, false, true);
  ASSERT_OK(r);
  EXPECT_EQ(r->prefix_hits, 2u);
  std::move(unblock).Invoke();
  ASSERT_TRUE(answered.HasBeenNotified());
  EXPECT_EQ(store_->Stats().pinned_blocks, 3u);
  ASSERT_OK(store_->Unpin(sid_, first_pin));
  ASSERT_OK(store_->Unpin(sid_, r->pin_id));
}

// With `prefix`, nothing after the first miss is reported or stays pinned,
// also when the miss is found only after the DRAM pass.
TEST_F(TieredStoreNvmeTest, PinnedPrefixLookupAcrossTiersStopsAtTheFirstMiss) {
  Put("a", Block(0));
  ASSERT_OK(store_->PersistDram());  // "a" on NVMe
  Put("b", Block(1));
  Put("d", Block(3));  // "c" is missing
  std::vector<absl::string_view> keys = {"a", "b", "c", "d"};
  auto r = store_->Lookup(sid_, "ns", keys, /*prefix=*/true, /*pin=*/true);
  ASSERT_OK(r);
  EXPECT_EQ(r->prefix_hits, 2u);
  EXPECT_TRUE(r->entries[0].found);
  EXPECT_TRUE(r->entries[1].found);
  EXPECT_FALSE(r->entries[2].found);
  EXPECT_FALSE(r->entries[3].found);
  EXPECT_EQ(store_->Stats().pinned_blocks, 2u);
  EXPECT_EQ(Bytes(r->entries[0]), Block(0));
  ASSERT_OK(store_->Unpin(sid_, r->pin_id));
  // Without prefix every hit counts; the leading run is still reported.
  auto all = store_->Lookup(sid_, "ns", keys, /*prefix=*/false, /*pin=*/true);
  ASSERT_OK(all);
  EXPECT_EQ(all->prefix_hits, 2u);
  EXPECT_TRUE(all->entries[3].found);
  EXPECT_EQ(store_->Stats().pinned_blocks, 3u);
  ASSERT_OK(store_->Unpin(sid_, all->pin_id));
}

TEST_F(TieredStoreNvmeTest, PersistedBlocksSurviveARestart) {
  for (int i = 0; i < 6; ++i) Put("p" + std::to_string(i), Block(i));
  auto n = store_->PersistDram();
  ASSERT_OK(n);
  EXPECT_EQ(*n, 6u);
  EXPECT_EQ(store_->Stats().dram.blocks, 0u);
  Open();  // a new store over the same NVMe directory
  EXPECT_EQ(store_->Stats().nvme.blocks, 6u);
  for (int i = 0; i < 6; ++i) {
    PinId pin = 0;
    LookupEntry e = Look("p" + std::to_string(i), true, &pin);
    ASSERT_TRUE(e.found) << i;
    EXPECT_EQ(Bytes(e), Block(i));
    ASSERT_OK(store_->Unpin(sid_, pin));
  }
}

// The store passes nvme_max_blocks to its NVMe tier: tiny blocks demoted
// there are charged at least nvme_capacity / nvme_max_blocks each, so the
// tier holds at most that many, before and after a restart; a restart with
// a lower bound evicts down to it.
TEST_F(TieredStoreNvmeTest, TinyBlocksOnNvmeAreBoundedByNvmeMaxBlocks) {
  nvme_max_blocks_ = 64;  // 1 MiB each
  Open();
  for (int i = 0; i < 200; ++i) Put("t" + std::to_string(i), "x");
  ASSERT_OK(store_->PersistDram());
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.dram.blocks, 0u);
  EXPECT_EQ(st.nvme.blocks, 64u);
  EXPECT_EQ(st.nvme.used_bytes, 64u << 20);
  EXPECT_GT(st.nvme.evictions, 0u);
  EXPECT_EQ(Look("t199", false).size, 1u);  // its size, not its charge

  Open();  // restart
  st = store_->Stats();
  EXPECT_EQ(st.nvme.blocks, 64u);
  EXPECT_EQ(st.nvme.used_bytes, 64u << 20);
  PinId pin = 0;
  LookupEntry e = Look("t199", true, &pin);
  ASSERT_TRUE(e.found);
  EXPECT_EQ(Bytes(e), "x");
  ASSERT_OK(store_->Unpin(sid_, pin));

  nvme_max_blocks_ = 16;
  Open();
  EXPECT_EQ(store_->Stats().nvme.blocks, 16u);
}

// A namespace whose blocks are on NVMe exists after a restart even with
// create_namespaces off: its clients may put into it, and its blocks are
// promoted when looked up.
TEST_F(TieredStoreNvmeTest, NamespacesOnNvmeExistWithoutCreateNamespaces) {
  for (int i = 0; i < 2; ++i) Put("p" + std::to_string(i), Block(i));
  ASSERT_OK(store_->PersistDram());
  // With create_namespaces on as well: an operator listing namespaces (or
  // asking for a quota) after a restart sees those on NVMe, before any of
  // their blocks is read back.
  Open();
  ASSERT_EQ(store_->ListNamespaces().size(), 1u);
  EXPECT_EQ(store_->ListNamespaces()[0].name, "ns");
  create_namespaces_ = false;
  Open();
  ASSERT_EQ(store_->ListNamespaces().size(), 1u);
  EXPECT_EQ(store_->ListNamespaces()[0].name, "ns");
  Put("p2", Block(2));  // before anything of "ns" was read back
  PinId pin = 0;
  LookupEntry e = Look("p0", true, &pin);
  ASSERT_TRUE(e.found);
  EXPECT_EQ(Bytes(e), Block(0));
  ASSERT_OK(store_->Unpin(sid_, pin));
}

// A namespace whose blocks are all on NVMe still exists (see above): it is
// not forgotten to make room in a full namespace table; one emptied in both
// tiers is.
TEST_F(TieredStoreNvmeTest, ANamespaceWithBlocksOnlyOnNvmeIsNotReclaimed) {
  max_namespaces_ = 2;
  Open();
  Put("p0", Block(0));
  ASSERT_OK(store_->PersistDram());  // "ns" is on NVMe only now
  EXPECT_EQ(store_->Stats().dram.blocks, 0u);
  Put("o", Block(1), "", "other");
  ASSERT_OK(store_->Evict("other", {}, true));  // gone from both tiers
  Put("n", Block(2), "", "new");  // takes "other"'s place
  std::vector<std::string> names;
  for (const NamespaceStats& ns : store_->ListNamespaces()) names.push_back(ns.name);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("ns", "new"));
  ASSERT_OK(store_->PersistDram());  // "new" is on NVMe only too
  PutSpec spec{"k", "", 4096};
  EXPECT_THAT(store_->BeginPut(sid_, "third", {&spec, 1}),
              StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(Look("p0", false).tier, Tier::kNvme);
  // Emptied: its place is taken once the store looks at NVMe again (not
  // within a second of its last look).
  ASSERT_OK(store_->Evict("new", {}, true));
  EXPECT_THAT(store_->BeginPut(sid_, "third", {&spec, 1}),
              StatusIs(Code::kResourceExhausted));
  clock_.Advance(absl::Seconds(2));
  Put("t", Block(3), "", "third");
  names.clear();
  for (const NamespaceStats& ns : store_->ListNamespaces()) names.push_back(ns.name);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("ns", "third"));
  ExpectServes("p0", Block(0));
}

// A client that makes namespaces one after another in a full table (a put
// into a new one, its blocks evicted, again) gets a pass over the NVMe
// tier's index at most once a second, not one per namespace: each pass
// takes the tier's index lock for as long as it reads the whole index.
// (Only passes that forgot nothing were spaced out before.)
TEST_F(TieredStoreNvmeTest, NamespacesMadeOneAfterAnotherScanNvmeAtMostOnceASecond) {
  max_namespaces_ = 2;
  Open();
  Put("p0", Block(0));
  ASSERT_OK(store_->PersistDram());  // "ns" stays, on NVMe only
  Put("a", Block(1), "", "a");
  ASSERT_OK(store_->Evict("a", {}, true));
  Put("b", Block(2), "", "b");  // a pass forgets "a"
  ASSERT_OK(store_->Evict("b", {}, true));
  PutSpec spec{"c", "", 4096};
  // "b" is empty, but the last pass was just now.
  EXPECT_THAT(store_->BeginPut(sid_, "c", {&spec, 1}),
              StatusIs(Code::kResourceExhausted));
  clock_.Advance(absl::Milliseconds(1100));
  Put("c", Block(3), "", "c");  // the next pass forgets "b"
  std::vector<std::string> names;
  for (const NamespaceStats& ns : store_->ListNamespaces()) names.push_back(ns.name);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("ns", "c"));
  ExpectServes("p0", Block(0));
  absl::string_view c = "c";
  auto found = store_->Lookup(sid_, "c", {&c, 1}, false, false);
  ASSERT_OK(found);
  EXPECT_EQ(found->entries[0].checksum, BlockChecksum(Block(3)));
}

// Puts into new namespaces at once, in a full table: the one that finds a
// pass over the NVMe index running waits for it and takes the room it made,
// rather than being refused. (It was refused RESOURCE_EXHAUSTED once the
// passes were spaced out: the first caller's pass had just started.) The
// index holds many blocks so that a pass takes long enough to be met.
TEST_F(TieredStoreNvmeTest, PutsIntoNewNamespacesDuringAPassWaitForItsRoom) {
  max_namespaces_ = 6;
  Open();
  const std::string small(1024, 's');
  for (int i = 0; i < 20000; ++i) Put("k" + std::to_string(i), small);
  ASSERT_OK(store_->PersistDram());  // "ns": 20000 blocks, on NVMe only
  int refused = 0;
  for (int round = 0; round < 5; ++round) {
    // Five empty namespaces fill the table (the last round's four are
    // reclaimed on the way).
    clock_.Advance(absl::Seconds(2));
    std::vector<std::string> empty;
    for (int i = 0; i < 5; ++i) {
      empty.push_back(absl::StrCat("e", round, "_", i));
      Put("x", Block(i), "", empty.back());
      ASSERT_OK(store_->Evict(empty.back(), {}, true));
    }
    clock_.Advance(absl::Seconds(2));  // a pass may start
    std::atomic<int> ready{0};
    std::vector<std::thread> puts;
    for (int t = 0; t < 4; ++t) {
      puts.emplace_back([&, t] {
        const std::string ns = absl::StrCat("n", round, "_", t);
        PutSpec spec{"y", "", 4096};
        ready++;
        while (ready.load() < 4) {
        }
        auto r = store_->BeginPut(sid_, ns, {&spec, 1});
        if (!r.ok()) {
          EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
          refused++;
          return;
        }
        EXPECT_OK(store_->AbortPut(sid_, r->id));
      });
    }
    for (std::thread& t : puts) t.join();  // their namespaces stay, empty
  }
  EXPECT_EQ(refused, 0) << "puts refused a namespace while a pass made room";
}

// Demotion keeps a block's parent key, which the NVMe tier's prefix-aware
// eviction and later promotions rely on.
TEST_F(TieredStoreNvmeTest, DemotedBlocksKeepTheirParentKeys) {
  Put("root", Block(0));
  Put("mid", Block(1), "root");
  Put("end", Block(2), "mid");
  Put("lone", Block(3), "not-cached");  // its parent was never stored
  ASSERT_OK(store_->PersistDram());
  store_.reset();
  NvmeTierOptions o;
  o.path = dir_ + "/nvme";
  o.capacity_bytes = 64 << 20;
  auto tier = OpenNvmeTier(o, &clock_);
  ASSERT_OK(tier);
  std::map<std::string, std::string> parents;
  (*tier)->ForEachBlock([&](const NvmeBlockView& b) {
    parents[std::string(b.key)] = std::string(b.parent);
  });
  EXPECT_THAT(parents, ::testing::UnorderedElementsAre(
                           ::testing::Pair("root", ""),
                           ::testing::Pair("mid", "root"),
                           ::testing::Pair("end", "mid"),
                           ::testing::Pair("lone", "")));
}

TEST_F(TieredStoreNvmeTest, EvictRemovesBlocksFromBothTiers) {
  for (int i = 0; i < 4; ++i) Put("e" + std::to_string(i), Block(i));
  ASSERT_OK(store_->PersistDram());
  PinId pin = 0;
  ASSERT_TRUE(Look("e0", true, &pin).found);  // back in DRAM too (promoted)
  ASSERT_OK(store_->Unpin(sid_, pin));
  std::vector<absl::string_view> keys = {"e0", "e1", "missing"};
  auto ev = store_->Evict("ns", keys, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->missing_keys, 1u);
  // e0 was in both tiers, e1 on NVMe only: each counts once.
  EXPECT_EQ(ev->evicted_blocks, 2u);
  EXPECT_EQ(ev->evicted_bytes, 2 * Block(0).size());
  EXPECT_FALSE(Look("e0", false).found);
  EXPECT_FALSE(Look("e1", false).found);
  EXPECT_TRUE(Look("e2", false).found);
  auto all = store_->Evict("ns", {}, true);
  ASSERT_OK(all);
  EXPECT_EQ(all->evicted_blocks, 2u);
  EXPECT_EQ(store_->Stats().nvme.blocks, 0u);
}

// An admin Evict landing while a pinned lookup promotes one of its keys
// from NVMe waits for that promotion: the block it pinned is reported
// pinned (and stays), the rest go from both tiers, and nothing reported
// evicted comes back. (Before, the Evict deleted the NVMe copy between the
// promotion's read and its publish, reported it evicted, and the promotion
// then put it back in DRAM.)
TEST_F(TieredStoreNvmeTest, AnEvictDuringAPromotionIsNotUndoneByIt) {
  for (const bool all : {false, true}) {
    SCOPED_TRACE(all ? "evict all" : "evict keys");
    for (int i = 0; i < 3; ++i) Put("v" + std::to_string(i), Block(i));
    ASSERT_OK(store_->PersistDram());  // all only on NVMe
    std::thread evictor;
    absl::StatusOr<EvictResult> ev;
    bool first = true;
    {
      internal::SyncPointCallback hold("NvmeTier::MultiRead:Planned", [&](void*) {
        if (!first) return;
        first = false;
        absl::Notification started;
        evictor = std::thread([&] {
          started.Notify();
          std::vector<absl::string_view> keys = {"v0", "v1"};
          ev = store_->Evict("ns", all ? std::vector<absl::string_view>{} : keys,
                             all);
        });
        started.WaitForNotification();
        // Time for the Evict to run into the promotion's window (without the
        // exclusion it finished within it).
        absl::SleepFor(absl::Milliseconds(200));
      });
      PinId pin = 0;
      ASSERT_TRUE(Look("v0", true, &pin).found);
      evictor.join();
      ASSERT_OK(ev);
      EXPECT_EQ(ev->pinned_blocks, 1u);
      if (!all) {
        EXPECT_THAT(ev->pinned_keys, ::testing::ElementsAre("v0"));
      }
      EXPECT_EQ(ev->evicted_blocks, all ? 2u : 1u);
      ASSERT_OK(store_->Unpin(sid_, pin));
    }
    EXPECT_TRUE(Look("v0", false).found);  // reported pinned: stays
    EXPECT_FALSE(Look("v1", false).found);
    EXPECT_EQ(Look("v2", false).found, !all);
    // Unpinned now, it goes.
    std::vector<absl::string_view> v0 = {"v0"};
    auto again = store_->Evict("ns", v0, false);
    ASSERT_OK(again);
    EXPECT_EQ(again->evicted_blocks, 1u);
    PinId pin = 0;
    EXPECT_FALSE(Look("v0", true, &pin).found);
    ASSERT_OK(store_->Evict("ns", {}, true));
  }
}

// An Evict whose NVMe delete cannot be made durable (RocksDB cannot write:
// the disk is full) fails with that error instead of reporting the block
// evicted or missing: it would come back after a restart. The other blocks
// are untouched.
TEST_F(TieredStoreNvmeTest, AnEvictTheNvmeTierCannotMakeDurableFails) {
  auto fault_fs = std::make_shared<FaultInjectionFileSystem>();
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fault_fs);
  nvme_env_ = env.get();
  absl::Cleanup close = [&] { store_.reset(); };  // before env goes
  Open();
  Put("d0", Block(0));
  Put("d1", Block(1));
  ASSERT_OK(store_->PersistDram());
  fault_fs->SetDiskFull(true);
  std::vector<absl::string_view> keys = {"d0"};
  auto ev = store_->Evict("ns", keys, false);
  EXPECT_FALSE(ev.ok());
  EXPECT_THAT(std::string(ev.status().message()),
              ::testing::HasSubstr("evict: deleting a block from NVMe"));
  EXPECT_GT(fault_fs->injected_errors(), 0u);
  fault_fs->SetDiskFull(false);
  ExpectServes("d1", Block(1));
}

// An operator's Evict is durable at once: a crash right after it (the
// files as kill -9 leaves them) does not bring the blocks back from NVMe.
TEST_F(TieredStoreNvmeTest, EvictedBlocksStayGoneAfterACrash) {
  for (int i = 0; i < 3; ++i) Put("e" + std::to_string(i), Block(i));
  ASSERT_OK(store_->PersistDram());
  std::vector<absl::string_view> keys = {"e1"};
  auto ev = store_->Evict("ns", keys, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks, 1u);
  std::unique_ptr<NvmeTier> tier = OpenCrashImage();
  ASSERT_NE(tier, nullptr);
  EXPECT_FALSE(tier->Contains("ns", "e1"));
  EXPECT_TRUE(tier->Contains("ns", "e0"));
  EXPECT_TRUE(tier->Contains("ns", "e2"));
}

// The NVMe tier's own evictions (for capacity, as demotions fill it) are
// written without the WAL, durable only at the next flush. An admin evict
// of a namespace whose blocks the tier had just evicted that way did not
// find them, wrote nothing for them, and after a crash they came back:
// Evict makes every delete before it durable before it answers.
TEST_F(TieredStoreNvmeTest,
       BlocksTheTierEvictedStayGoneAfterAnAdminEvictAndACrash) {
  nvme_capacity_ = 3 << 20;
  Open(/*admit_min_reads=*/0, /*background_eviction=*/false);
  for (int i = 0; i < 8; ++i) Put("a" + std::to_string(i), Block(i), "", "A");
  ASSERT_OK(store_->PersistDram());  // A on NVMe, flushed
  // B demoted without a flush (the flush timer's clock is fake): the tier
  // evicts A's oldest blocks to make room, those deletes not in the WAL.
  for (int i = 0; i < 12; ++i) Put("b" + std::to_string(i), Block(i), "", "B");
  EXPECT_GT(store_->RunEviction(), 0u);
  int a_left = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string key = "a" + std::to_string(i);
    absl::string_view kv = key;
    auto l = store_->Lookup(sid_, "A", {&kv, 1}, false, false);
    ASSERT_OK(l);
    a_left += l->entries[0].found;
  }
  ASSERT_LT(a_left, 8) << "the tier evicted none of A: nothing to test";
  ASSERT_OK(store_->Evict("A", {}, /*all=*/true));
  std::unique_ptr<NvmeTier> tier = OpenCrashImage();
  ASSERT_NE(tier, nullptr);
  for (int i = 0; i < 8; ++i) {
    EXPECT_FALSE(tier->Contains("A", "a" + std::to_string(i))) << i;
  }
}

// The same, with the admin evict of the block while the tier's own eviction
// of it is in flight (the demotion's batch, without the WAL, not written
// yet): the evict saw no block (the tier no longer listed it), made nothing
// durable (the batch had not landed), and after a crash the block was back.
// It now waits for that write and makes it durable before it answers.
class TieredStoreNvmeEvictTest : public TieredStoreNvmeTest,
                                 public ::testing::WithParamInterface<bool> {};

TEST_P(TieredStoreNvmeEvictTest,
       AnAdminEvictDuringTheTiersOwnEvictionOfTheBlockMakesItDurable) {
  const bool all = GetParam();  // the namespace, else the one key
  nvme_capacity_ = 3 << 20;
  Open(/*admit_min_reads=*/0, /*background_eviction=*/false);
  for (int i = 0; i < 8; ++i) Put("a" + std::to_string(i), Block(i), "", "A");
  ASSERT_OK(store_->PersistDram());  // A on NVMe, flushed
  for (int i = 0; i < 12; ++i) Put("b" + std::to_string(i), Block(i), "", "B");
  std::thread evict;
  absl::Notification evict_started;
  absl::StatusOr<EvictResult> evicted;
  internal::SyncPointCallback during("NvmeTier::Put:Writing", [&](void*) {
    if (evict_started.HasBeenNotified()) return;
    // A demotion whose batch retires a0 (the tier no longer lists it).
    absl::StatusOr<BlockDetails> a0 = store_->Inspect("A", "a0");
    if (a0.ok() && a0->in_nvme) return;
    evict_started.Notify();
    evict = std::thread([&] {
      absl::string_view k = "a0";
      evicted = all ? store_->Evict("A", {}, /*all=*/true)
                    : store_->Evict("A", {&k, 1}, /*all=*/false);
    });
    absl::SleepFor(absl::Milliseconds(200));  // the evict runs meanwhile
  });
  EXPECT_GT(store_->RunEviction(), 0u);
  ASSERT_TRUE(evict_started.HasBeenNotified())
      << "the tier evicted none of A: nothing to test";
  evict.join();
  ASSERT_OK(evicted.status());
  std::unique_ptr<NvmeTier> tier = OpenCrashImage();
  ASSERT_NE(tier, nullptr);
  EXPECT_FALSE(tier->Contains("A", "a0")) << "back after a crash";
}

INSTANTIATE_TEST_SUITE_P(KeyOrNamespace, TieredStoreNvmeEvictTest,
                         ::testing::Bool());

// Put-if-absent holds across the tiers: a key kept only on NVMe is stored,
// so a second put of it writes nothing, even with other bytes (which only
// a broken client sends), and every lookup reports the first bytes.
TEST_F(TieredStoreNvmeTest, APutOfAKeyOnlyOnNvmeFindsItStored) {
  const std::string a = Block(0), b = Block(1);
  Put("k", a);
  ASSERT_OK(store_->PersistDram());  // "k" only on NVMe now
  PutSpec spec{"k", "", b.size()};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  EXPECT_TRUE(r->slots[0].exists);
  EXPECT_EQ(r->id, 0u);
  if (!r->slots[0].exists) {  // went on as a client would: write b
    {
      auto slot = store_->AcquireSlot(sid_, r->id, 0);
      ASSERT_OK(slot);
      std::memcpy((*slot)->bytes().data(), b.data(), b.size());
    }
    uint64_t sum = BlockChecksum(b);
    ASSERT_OK(store_->CommitPut(sid_, r->id, {&sum, 1}));
  }
  ExpectServes("k", a);
  ASSERT_OK(store_->PersistDram());
  ExpectServes("k", a);
  EXPECT_EQ(store_->Stats().puts, 1u);
}

TEST_F(TieredStoreNvmeTest, APutOfAKeyOnlyOnNvmeWithAnotherSizeIsRefused) {
  const std::string a = Block(0);
  Put("k", a);
  ASSERT_OK(store_->PersistDram());  // "k" only on NVMe now
  PutSpec spec{"k", "", a.size() / 2};
  auto refused = store_->BeginPut(sid_, "ns", {&spec, 1});
  EXPECT_THAT(refused, StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("stored with"));
  EXPECT_EQ(store_->Stats().reservations, 0u);
  ExpectServes("k", a);
}

// The key may reach NVMe between BeginPut and CommitPut (another writer
// stored it, and it was demoted and left DRAM): CommitPut then finds it
// stored and publishes nothing.
TEST_F(TieredStoreNvmeTest, ACommitOfAKeyDemotedMeanwhileFindsItStored) {
  const std::string a = Block(0), b = Block(1);
  PutSpec spec{"k", "", b.size()};
  auto r = store_->BeginPut(sid_, "ns", {&spec, 1});
  ASSERT_OK(r);
  ASSERT_FALSE(r->slots[0].exists);
  {
    auto slot = store_->AcquireSlot(sid_, r->id, 0);
    ASSERT_OK(slot);
    std::memcpy((*slot)->bytes().data(), b.data(), b.size());
  }
  Put("k", a);                       // the other writer
  ASSERT_OK(store_->PersistDram());  // "k" only on NVMe now
  const uint64_t sum_b = BlockChecksum(b);
  auto c = store_->CommitPut(sid_, r->id, {&sum_b, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kAlreadyExists);
  ExpectServes("k", a);
  EXPECT_EQ(store_->Stats().reserved_bytes, 0u);
}

TEST_F(TieredStoreNvmeTest, AdmissionByReadsSparesColdBlocks) {
  Open(/*admit_min_reads=*/2);
  Put("hot", Block(0));
  Put("cold", Block(1));
  Look("hot", false);
  Look("hot", false);  // read twice: admitted
  Look("cold", false);  // once: not admitted
  auto n = store_->PersistDram();
  ASSERT_OK(n);
  EXPECT_EQ(*n, 1u);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.demotions_skipped, 1u);
  EXPECT_TRUE(Look("hot", false).found);
  EXPECT_FALSE(Look("cold", false).found);
}

// A promotion makes room in its namespace's quota as a put does; a block
// it cannot make room for (the namespace's other blocks are pinned, or
// promoted by the same lookup) stays on NVMe and is a miss of that lookup.
TEST_F(TieredStoreNvmeTest, PromotionsStayWithinTheQuota) {
  const uint64_t b = Block(0).size();
  for (int i = 0; i < 3; ++i) Put("p" + std::to_string(i), Block(i));
  ASSERT_OK(store_->PersistDram());
  ASSERT_OK(store_->SetQuota("ns", b));
  std::vector<absl::string_view> keys = {"p0", "p1", "p2"};
  auto r = store_->Lookup(sid_, "ns", keys, /*prefix=*/false, /*pin=*/true);
  ASSERT_OK(r);
  ASSERT_TRUE(r->entries[0].found);
  EXPECT_EQ(r->entries[0].tier, Tier::kDram);
  EXPECT_EQ(Bytes(r->entries[0]), Block(0));
  EXPECT_FALSE(r->entries[1].found);
  EXPECT_FALSE(r->entries[2].found);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_EQ(st.dram.blocks, 1u);
  EXPECT_EQ(NamespaceBytes(*store_, "ns"), b);
  EXPECT_EQ(Look("p1", false).tier, Tier::kNvme);  // still there

  // Unpinned, the promoted block makes way for the next promotion.
  ASSERT_OK(store_->Unpin(sid_, r->pin_id));
  PinId pin = 0;
  LookupEntry e = Look("p1", true, &pin);
  ASSERT_TRUE(e.found);
  EXPECT_EQ(Bytes(e), Block(1));
  EXPECT_EQ(NamespaceBytes(*store_, "ns"), b);
  EXPECT_EQ(Look("p0", false).tier, Tier::kNvme);
  ASSERT_OK(store_->Unpin(sid_, pin));
}

// A prefix lookup answers nothing after its first miss, even a block it
// has promoted meanwhile (its promotions run together, and an earlier one
// may fail): that block is read back into DRAM (a promotion, and it stays
// there unpinned) but is no hit, in the NVMe tier's hits as in the
// lookup's.
TEST_F(TieredStoreNvmeTest, APromotionAPrefixLookupDoesNotAnswerIsNoHit) {
  const std::string small(64 << 10, 's');
  Put("p0", Block(0));
  Put("p1", small);
  ASSERT_OK(store_->PersistDram());
  // p0 can never fit the quota; p1 can.
  ASSERT_OK(store_->SetQuota("ns", small.size() * 2));
  std::vector<absl::string_view> keys = {"p0", "p1"};
  auto r = store_->Lookup(sid_, "ns", keys, /*prefix=*/true, /*pin=*/true);
  ASSERT_OK(r);
  EXPECT_FALSE(r->entries[0].found);
  EXPECT_FALSE(r->entries[1].found);
  EXPECT_EQ(r->prefix_hits, 0u);
  EXPECT_EQ(r->pin_id, 0u);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.lookup_hits, 0u);
  EXPECT_EQ(st.nvme.hits, 0u);
  EXPECT_EQ(st.dram.hits, 0u);
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_EQ(st.pinned_blocks, 0u);
  EXPECT_EQ(Look("p1", false).tier, Tier::kDram);
}

TEST_F(TieredStoreNvmeTest, NoNvmeTierMeansPersistFails) {
  StoreOptions o;
  o.dram_capacity = 1 << 20;
  o.hugepages = HugePageMode::kOff;
  o.background_eviction = false;
  auto s = NewTieredStore(o, &clock_);
  ASSERT_OK(s);
  EXPECT_THAT((*s)->PersistDram(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace kvdepot
