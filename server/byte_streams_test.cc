#include "server/byte_streams.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "absl/functional/function_ref.h"
#include "storage/checksum.h"
#include "storage/fake_clock.h"
#include "storage/internal/sync_point.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::StatusIs;
using Code = absl::StatusCode;

class ByteStreamsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions o;
    o.dram_capacity = 64 << 20;
    o.hugepages = HugePageMode::kOff;
    o.background_eviction = false;
    auto s = NewTieredStore(o, &clock_);
    ASSERT_OK(s);
    store_ = std::move(s).value();
  }

  // A session with one reserved 500-byte slot for `key` in "ns".
  void ReserveSlot(const std::string& key, SessionId* session,
                   ReservationId* reservation) {
    auto opened = store_->OpenSession(absl::ZeroDuration(), "t");
    ASSERT_OK(opened);
    PutSpec spec{key, "", 500};
    auto r = store_->BeginPut(opened->id, "ns", {&spec, 1});
    ASSERT_OK(r);
    *session = opened->id;
    *reservation = r->id;
  }

  static v1::WriteRequest Header(const std::string& key, const std::string& bytes,
                                 const std::string& first_chunk) {
    v1::WriteRequest m;
    m.mutable_header()->set_namespace_("ns");
    m.mutable_header()->set_key(key);
    m.mutable_header()->set_size(bytes.size());
    m.mutable_header()->set_checksum(BlockChecksum(bytes));
    m.set_data(first_chunk);
    return m;
  }
  // A Write of slot 0 of `reservation`, with its first chunk.
  static v1::WriteRequest SlotWrite(SessionId session, ReservationId reservation,
                                    uint64_t size, const std::string& first_chunk) {
    v1::WriteRequest m;
    m.mutable_header()->set_session_id(session);
    m.mutable_header()->set_reservation_id(reservation);
    m.mutable_header()->set_slot(0);
    m.mutable_header()->set_size(size);
    m.set_data(first_chunk);
    return m;
  }
  static v1::WriteRequest Data(const std::string& bytes) {
    v1::WriteRequest m;
    m.set_data(bytes);
    return m;
  }

  // Writes the first KiB of a 4 KiB reservation slot, runs `interrupt` on
  // its session and reservation, then writes the rest: returns that status.
  // The block is never reported (no result), and no reservation is left.
  absl::Status WriteSlotInterruptedBy(
      absl::FunctionRef<absl::Status(SessionId, ReservationId)> interrupt) {
    TieredStore& store = *store_;
    // A step before the interruption that fails fails the test (and is no
    // status the caller expects).
    auto setup = [](const absl::Status& st) {
      EXPECT_OK(st);
      return st.ok() ? st : absl::InternalError(st.ToString());
    };
    auto session = store.OpenSession(absl::ZeroDuration(), "t");
    if (!session.ok()) return setup(session.status());
    PutSpec spec{"slot-key", "", 4096};
    auto r = store.BeginPut(session->id, "ns", {&spec, 1});
    if (!r.ok()) return setup(r.status());
    v1::WriteResponse resp;
    WriteStream ws(store, &resp);
    if (absl::Status st = setup(ws.Consume(SlotWrite(session->id, r->id, 4096,
                                                     std::string(1024, 'h'))));
        !st.ok()) {
      return st;
    }
    if (absl::Status st = setup(interrupt(session->id, r->id)); !st.ok()) return st;
    absl::Status st = ws.Consume(Data(std::string(3072, 'h')));
    EXPECT_EQ(resp.results_size(), 0);
    EXPECT_EQ(store.Stats().reservations, 0u);
    return st;
  }

  // Reads `keys` through a ReadStream; returns the messages.
  absl::Status ReadAll(std::vector<std::string> keys,
                       std::vector<v1::ReadResponse>* out) {
    v1::ReadRequest req;
    req.set_namespace_("ns");
    for (auto& k : keys) req.add_keys(k);
    ReadStream rs(*store_, req);
    if (absl::Status st = rs.Validate(); !st.ok()) return st;
    bool last = false;
    while (!last) {
      ReadChunk chunk;
      if (absl::Status st = rs.Next(&chunk, &last); !st.ok()) return st;
      // The chunk is a valid ReadResponse on the wire.
      v1::ReadResponse msg;
      EXPECT_TRUE(msg.ParseFromString(chunk.Serialize()));
      chunk.pin->Unref();
      out->push_back(msg);
    }
    return absl::OkStatus();
  }

  FakeClock clock_;
  std::unique_ptr<TieredStore> store_;
};

TEST_F(ByteStreamsTest, HeaderWithWholeBlockPublishesIt) {
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  std::string bytes(1000, 'a');
  ASSERT_OK(ws.Consume(Header("k", bytes, bytes)));
  ASSERT_OK(ws.End());
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0), v1::WRITE_STORED);
  EXPECT_EQ(ws.bytes_in(), 1000u);
  // Again: already stored, bytes consumed and dropped.
  ASSERT_OK(ws.Consume(Header("k", bytes, bytes)));
  EXPECT_EQ(resp.results(1), v1::WRITE_ALREADY_EXISTS);
}

TEST_F(ByteStreamsTest, ChunkedBlockIsInvisibleUntilComplete) {
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  std::string bytes(3000, 'b');
  ASSERT_OK(ws.Consume(Header("k", bytes, bytes.substr(0, 1000))));
  ASSERT_OK(ws.Consume(Data(bytes.substr(1000, 1000))));
  absl::string_view k = "k";
  EXPECT_FALSE(store_->Lookup(0, "ns", {&k, 1}, false, false)->entries[0].found);
  EXPECT_EQ(store_->Stats().reservations, 1u);
  ASSERT_OK(ws.Consume(Data(bytes.substr(2000))));
  EXPECT_TRUE(store_->Lookup(0, "ns", {&k, 1}, false, false)->entries[0].found);
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

TEST_F(ByteStreamsTest, EndingInsideABlockIsAnErrorAndFreesIt) {
  uint64_t used = store_->Stats().dram.used_bytes;
  {
    v1::WriteResponse resp;
    WriteStream ws(*store_, &resp);
    std::string bytes(3000, 'c');
    ASSERT_OK(ws.Consume(Header("k", bytes, bytes.substr(0, 10))));
    EXPECT_THAT(ws.End(), StatusIs(Code::kInvalidArgument));
  }
  EXPECT_EQ(store_->Stats().dram.used_bytes, used);
  EXPECT_EQ(store_->Stats().reservations, 0u);
}

TEST_F(ByteStreamsTest, RejectsMalformedStreams) {
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  EXPECT_THAT(ws.Consume(v1::WriteRequest()), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(ws.Consume(Data("x")), StatusIs(Code::kInvalidArgument));
  std::string bytes(10, 'd');
  ASSERT_OK(ws.Consume(Header("k", bytes, "12345")));
  EXPECT_THAT(ws.Consume(Header("k2", bytes, "")), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(ws.Consume(Data("1234567")), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(ws.Consume(Data(std::string(kMaxChunkBytes + 1, 'x'))),
              StatusIs(Code::kInvalidArgument));
}

TEST_F(ByteStreamsTest, FillsAReservationSlotWithoutPublishing) {
  SessionId sid = 0;
  ReservationId rid = 0;
  ASSERT_NO_FATAL_FAILURE(ReserveSlot("slot-key", &sid, &rid));
  std::string bytes(500, 'e');
  v1::WriteRequest m = SlotWrite(sid, rid, 500, bytes);
  v1::WriteResponse resp;
  {
    // A size that is not the slot's, and session 0, are refused.
    m.mutable_header()->set_size(499);
    WriteStream bad_size(*store_, &resp);
    absl::Status st = bad_size.Consume(m);
    EXPECT_THAT(st, StatusIs(Code::kInvalidArgument));
    EXPECT_NE(st.message().find("holds 500"), std::string::npos) << st;
    m.mutable_header()->set_size(500);
    m.mutable_header()->set_session_id(0);
    WriteStream no_session(*store_, &resp);
    EXPECT_THAT(no_session.Consume(m), StatusIs(Code::kNotFound));
    m.mutable_header()->set_session_id(sid);
  }
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(m));
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0), v1::WRITE_SLOT_FILLED);
  absl::string_view k = "slot-key";
  EXPECT_FALSE(store_->Lookup(0, "ns", {&k, 1}, false, false)->entries[0].found);
  uint64_t sum = BlockChecksum(bytes);
  auto c = store_->CommitPut(sid, rid, {&sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
  EXPECT_TRUE(store_->Lookup(0, "ns", {&k, 1}, false, false)->entries[0].found);
}

// A CommitPut that comes as a slot's Write ends (a client committing right
// after sending the last chunk, retrying on ABORTED as the contract says)
// cannot take the reservation while the Write still holds the slot: the
// Write reports the slot filled, not "its slot went with it" for a block
// the commit stored, and the commit after it stores the block.
TEST_F(ByteStreamsTest, ACommitRacingTheSlotWritesEndIsRefusedUntilItEnds) {
  SessionId sid = 0;
  ReservationId rid = 0;
  ASSERT_NO_FATAL_FAILURE(ReserveSlot("raced", &sid, &rid));
  const std::string bytes(500, 'q');
  const uint64_t sum = BlockChecksum(bytes);
  absl::Status racing_commit;
  internal::SyncPointCallback commit_now(
      "WriteStream::Complete:CheckingReservation", [&](void*) {
        racing_commit = store_->CommitPut(sid, rid, {&sum, 1}).status();
      });
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(SlotWrite(sid, rid, 500, bytes)));
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0), v1::WRITE_SLOT_FILLED);
  EXPECT_THAT(racing_commit, StatusIs(Code::kAborted));
  auto c = store_->CommitPut(sid, rid, {&sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
}

// A slot Write whose header names another block (key or namespace), or
// declares a checksum its bytes do not have, is refused; the slot stays
// open, and a right Write of it then succeeds. Key, namespace and checksum
// may be left out.
TEST_F(ByteStreamsTest, ASlotWriteNamingAnotherBlockIsRefused) {
  SessionId sid = 0;
  ReservationId rid = 0;
  ASSERT_NO_FATAL_FAILURE(ReserveSlot("slot-key", &sid, &rid));
  const std::string bytes(500, 's');
  v1::WriteResponse resp;
  auto refused = [&](auto change, const std::string& why) {
    v1::WriteRequest m = SlotWrite(sid, rid, 500, bytes);
    change(m.mutable_header());
    WriteStream ws(*store_, &resp);
    absl::Status st = ws.Consume(m);
    EXPECT_THAT(st, StatusIs(Code::kInvalidArgument)) << why;
    EXPECT_NE(st.message().find(why), std::string::npos) << st;
  };
  refused([](v1::WriteHeader* h) { h->set_key("other-key"); }, "is for block");
  refused([](v1::WriteHeader* h) { h->set_namespace_("other"); }, "is in namespace ns");
  refused([&](v1::WriteHeader* h) { h->set_checksum(BlockChecksum(bytes) + 1); },
          "checksum mismatch");
  EXPECT_EQ(resp.results_size(), 0);
  // Named right, with its checksum: filled, and committed.
  v1::WriteRequest m = SlotWrite(sid, rid, 500, bytes);
  m.mutable_header()->set_key("slot-key");
  m.mutable_header()->set_namespace_("ns");
  m.mutable_header()->set_checksum(BlockChecksum(bytes));
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(m));
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0), v1::WRITE_SLOT_FILLED);
  uint64_t sum = BlockChecksum(bytes);
  auto c = store_->CommitPut(sid, rid, {&sum, 1});
  ASSERT_OK(c);
  EXPECT_EQ((*c)[0], CommitOutcome::kStored);
}

// A session that ends while one of its slots is written takes the
// reservation with it: the block's end reports NotFound, not SLOT_FILLED.
TEST_F(ByteStreamsTest, ASlotWhoseSessionEndedMidBlockIsNotFound) {
  EXPECT_THAT(WriteSlotInterruptedBy([&](SessionId session, ReservationId) {
                return store_->CloseSession(session).status();
              }),
              StatusIs(Code::kNotFound));
}

// The reservation aborted while its slot was written (the session lives):
// the slot is gone, so the write is refused, not reported filled.
TEST_F(ByteStreamsTest, ASlotWhoseReservationWasAbortedMidBlockIsRefused) {
  absl::Status st = WriteSlotInterruptedBy([&](SessionId session, ReservationId id) {
    return store_->AbortPut(session, id);
  });
  EXPECT_THAT(st, StatusIs(Code::kInvalidArgument));
  EXPECT_NE(st.message().find("aborted"), std::string::npos) << st;
  EXPECT_EQ(store_->Stats().dram.used_bytes, 0u);
}

// Progress, for the idle timeout, is a block started or finished or a
// sixteenth of one received: not any message, or a trickle of single bytes
// would hold a reservation for ever.
TEST_F(ByteStreamsTest, ProgressIsAShareOfTheBlockNotAnyMessage) {
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  EXPECT_FALSE(ws.TakeProgress());
  const std::string bytes(16 << 20, 'p');  // a sixteenth is 1 MiB
  ASSERT_OK(ws.Consume(Header("big", bytes, "p")));
  EXPECT_TRUE(ws.TakeProgress());  // a block started
  EXPECT_FALSE(ws.TakeProgress());
  size_t sent = 1;
  for (int i = 0; i < 10; ++i, ++sent) ASSERT_OK(ws.Consume(Data("p")));
  EXPECT_FALSE(ws.TakeProgress());
  const std::string chunk((1 << 20) - 11, 'p');
  ASSERT_OK(ws.Consume(Data(chunk)));
  sent += chunk.size();
  EXPECT_TRUE(ws.TakeProgress());  // 1 MiB since the header
  while (sent < bytes.size()) {
    const size_t n = std::min<size_t>(kMaxChunkBytes, bytes.size() - sent);
    ASSERT_OK(ws.Consume(Data(std::string(n, 'p'))));
    sent += n;
  }
  EXPECT_TRUE(ws.TakeProgress());
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0), v1::WRITE_STORED);
}

TEST_F(ByteStreamsTest, ReadSplitsBlocksIntoChunksWithTheHeaderFirst) {
  std::string big(kMaxChunkBytes * 2 + 123, 'f');
  std::string small(10, 'g');
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(Header("big", big, big.substr(0, kMaxChunkBytes))));
  ASSERT_OK(ws.Consume(Data(big.substr(kMaxChunkBytes, kMaxChunkBytes))));
  ASSERT_OK(ws.Consume(Data(big.substr(2 * kMaxChunkBytes))));
  ASSERT_OK(ws.Consume(Header("small", small, small)));

  std::vector<v1::ReadResponse> msgs;
  ASSERT_OK(ReadAll({"big", "small"}, &msgs));
  ASSERT_EQ(msgs.size(), 4u);
  EXPECT_TRUE(msgs[0].has_header());
  EXPECT_EQ(msgs[0].header().size(), big.size());
  EXPECT_EQ(msgs[0].header().checksum(), BlockChecksum(big));
  EXPECT_FALSE(msgs[1].has_header());
  EXPECT_EQ(msgs[0].data() + msgs[1].data() + msgs[2].data(), big);
  EXPECT_TRUE(msgs[3].has_header());
  EXPECT_EQ(msgs[3].data(), small);
  EXPECT_EQ(store_->Stats().pins, 0u);
}

TEST_F(ByteStreamsTest, ChunksKeepTheirBlockPinnedUntilReleased) {
  std::string bytes(5000, 'p');
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(Header("p", bytes, bytes)));
  v1::ReadRequest req;
  req.set_namespace_("ns");
  req.add_keys("p");
  ReadChunk chunk;
  {
    ReadStream rs(*store_, req);
    bool last = false;
    ASSERT_OK(rs.Next(&chunk, &last));
    EXPECT_TRUE(last);
  }
  // The stream is gone but gRPC would still be sending: pinned, unevictable.
  EXPECT_EQ(store_->Stats().pins, 1u);
  absl::string_view k = "p";
  auto ev = store_->Evict("ns", {&k, 1}, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->pinned_blocks, 1u);
  EXPECT_EQ(std::string(chunk.data, chunk.size), bytes);
  chunk.pin->Unref();
  EXPECT_EQ(store_->Stats().pins, 0u);
}

TEST_F(ByteStreamsTest, ReadStopsWithNotFoundAtTheFirstMissAndUnpins) {
  std::string bytes(100, 'h');
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(Header("a", bytes, bytes)));
  std::vector<v1::ReadResponse> msgs;
  EXPECT_THAT(ReadAll({"a", "missing", "a"}, &msgs), StatusIs(Code::kNotFound));
  EXPECT_EQ(msgs.size(), 1u);
  EXPECT_EQ(store_->Stats().pins, 0u);
  msgs.clear();
  EXPECT_THAT(ReadAll({}, &msgs), StatusIs(Code::kInvalidArgument));
}

// Every key is checked before any byte goes: a bad key later in the batch
// fails the stream at once, not after the blocks before it were sent.
TEST_F(ByteStreamsTest, ReadRefusesABadKeyAnywhereBeforeSendingAnything) {
  std::string bytes(100, 'h');
  v1::WriteResponse resp;
  WriteStream ws(*store_, &resp);
  ASSERT_OK(ws.Consume(Header("a", bytes, bytes)));
  for (const std::string& bad : {std::string(), std::string(257, 'k')}) {
    std::vector<v1::ReadResponse> msgs;
    EXPECT_THAT(ReadAll({"a", bad}, &msgs), StatusIs(Code::kInvalidArgument));
    EXPECT_TRUE(msgs.empty());
  }
  EXPECT_EQ(store_->Stats().pins, 0u);
}

}  // namespace
}  // namespace kvdepot
