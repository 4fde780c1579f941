// Bad input against a real kvdepotd: each gets its exact gRPC status, the
// daemon stays healthy, and no reservation or DRAM space leaks afterwards.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "storage/checksum.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using testing::DaemonProcess;
using ::kvdepot::testing::StatusIs;
using Code = absl::StatusCode;

constexpr char kNs[] = "e2e/bad-input";
constexpr uint64_t kDram = 64 << 20;

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
    ASSERT_OK(d);
    daemon_ = std::move(d).value();
    ClientOptions o;
    o.server = daemon_->address();
    client_ = std::move(Client::Connect(o)).value();
    // One good block, so leaks and corruption of a neighbour would show.
    good_ = std::string(100000, 'g');
    BlockToPut b{"good", "", good_};
    ASSERT_OK(client_->Put(kNs, {&b, 1}));
    auto st = client_->Stats();
    ASSERT_OK(st);
    baseline_used_ = st->dram().used_bytes();
  }

  void TearDown() override {
    // The daemon is healthy, nothing leaked, the good block is intact.
    EXPECT_OK(client_->Health());
    auto st = client_->Stats();
    ASSERT_OK(st);
    EXPECT_EQ(st->reservations(), 0u);
    EXPECT_EQ(st->reserved_bytes(), 0u);
    EXPECT_EQ(st->dram().used_bytes(), baseline_used_);
    absl::string_view k = "good";
    auto got = client_->Get(kNs, {&k, 1});
    ASSERT_OK(got);
    EXPECT_EQ((*got)[0].bytes, good_);
    EXPECT_TRUE(daemon_->Running()) << daemon_->Log();
  }

  grpc::Status WriteRaw(const std::vector<v1::WriteRequest>& msgs,
                        bool writes_done = true, v1::WriteResponse* out = nullptr) {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto w = client_->stub().Write(&ctx, &resp);
    for (const auto& m : msgs) {
      if (!w->Write(m)) break;
    }
    if (writes_done) w->WritesDone();
    grpc::Status st = w->Finish();
    if (out) *out = resp;
    return st;
  }

  // A raw BeginPut of (key, size) pairs; returns the call's status.
  grpc::Status BeginPutRaw(uint64_t session,
                           std::vector<std::pair<std::string, uint64_t>> blocks,
                           v1::BeginPutResponse* out) {
    grpc::ClientContext ctx;
    v1::BeginPutRequest bp;
    bp.set_session_id(session);
    bp.set_namespace_(kNs);
    for (const auto& [key, size] : blocks) {
      v1::PutSpec* spec = bp.add_blocks();
      spec->set_key(key);
      spec->set_size(size);
    }
    return client_->stub().BeginPut(&ctx, bp, out);
  }

  static v1::WriteRequest Header(const std::string& key, uint64_t size,
                                 uint64_t checksum) {
    v1::WriteRequest m;
    m.mutable_header()->set_namespace_(kNs);
    m.mutable_header()->set_key(key);
    m.mutable_header()->set_size(size);
    m.mutable_header()->set_checksum(checksum);
    return m;
  }
  static v1::WriteRequest Data(const std::string& bytes) {
    v1::WriteRequest m;
    m.set_data(bytes);
    return m;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  std::string good_;
  uint64_t baseline_used_ = 0;
};

TEST_F(BadInputTest, EmptyKeyIsInvalidArgument) {
  absl::string_view empty = "";
  EXPECT_THAT(client_->Lookup(kNs, {&empty, 1}, false, false),
              StatusIs(Code::kInvalidArgument));
  grpc::Status st = WriteRaw({Header("", 10, 0), Data("0123456789")});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("key is empty"), std::string::npos);
}

TEST_F(BadInputTest, KeyOf257BytesIsInvalidArgument) {
  std::string key(257, 'k');
  absl::string_view k = key;
  EXPECT_THAT(client_->Lookup(kNs, {&k, 1}, false, false),
              StatusIs(Code::kInvalidArgument));
  grpc::Status st = WriteRaw({Header(key, 10, 0), Data("0123456789")});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("257 bytes"), std::string::npos)
      << st.error_message();
  // 256 bytes is fine.
  std::string ok(256, 'k');
  BlockToPut b{ok, "", "x"};
  EXPECT_OK(client_->Put(kNs, {&b, 1}));
  absl::string_view okv = ok;
  ASSERT_OK(client_->Evict(kNs, {&okv, 1}, false));
}

TEST_F(BadInputTest, MoreBytesThanDeclaredIsInvalidArgument) {
  std::string bytes = "0123456789";
  grpc::Status st =
      WriteRaw({Header("k1", 5, BlockChecksum(bytes)), Data(bytes)});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("more bytes than its declared size"),
            std::string::npos);
  absl::string_view k = "k1";
  auto r = client_->Lookup(kNs, {&k, 1}, false, false);
  ASSERT_OK(r);
  EXPECT_FALSE(r->entries[0].found);
}

TEST_F(BadInputTest, WrongChecksumIsInvalidArgumentAndNotStored) {
  grpc::Status st = WriteRaw({Header("k2", 10, 42), Data("0123456789")});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("checksum mismatch"), std::string::npos);
  absl::string_view k = "k2";
  EXPECT_THAT(client_->Get(kNs, {&k, 1}), StatusIs(Code::kNotFound));
}

TEST_F(BadInputTest, TruncatedWriteStreamPublishesNothing) {
  std::string bytes(3 << 20, 't');  // 3 MiB declared, 1 MiB sent
  grpc::Status st = WriteRaw({Header("k3", bytes.size(), BlockChecksum(bytes)),
                              Data(bytes.substr(0, 1 << 20))});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("stream ended inside block"), std::string::npos)
      << st.error_message();
  absl::string_view k = "k3";
  auto r = client_->Lookup(kNs, {&k, 1}, false, false);
  ASSERT_OK(r);
  EXPECT_FALSE(r->entries[0].found);
}

TEST_F(BadInputTest, ClientThatVanishesMidWriteLeaksNothing) {
  std::string chunk(1 << 20, 'v');
  {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto w = client_->stub().Write(&ctx, &resp);
    ASSERT_TRUE(w->Write(Header("k4", 8 << 20, 0)));
    ASSERT_TRUE(w->Write(Data(chunk)));
    ctx.TryCancel();  // the client goes away mid-block
    EXPECT_FALSE(w->Finish().ok());
  }
  // The daemon notices the cancellation asynchronously; wait until the
  // internal reservation is gone (TearDown checks the space is back).
  for (int i = 0; i < 200; ++i) {
    auto st = client_->Stats();
    ASSERT_OK(st);
    if (st->dram().used_bytes() == baseline_used_) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

TEST_F(BadInputTest, ClientThatVanishesMidReadReleasesItsPin) {
  std::string big(8 << 20, 'b');
  BlockToPut b{"big", "", big};
  ASSERT_OK(client_->Put(kNs, {&b, 1}));
  {
    grpc::ClientContext ctx;
    v1::ReadRequest req;
    req.set_namespace_(kNs);
    req.add_keys("big");
    auto reader = client_->stub().Read(&ctx, req);
    v1::ReadResponse msg;
    ASSERT_TRUE(reader->Read(&msg));  // first 1 MiB; the block is pinned
    EXPECT_TRUE(msg.has_header());
    ctx.TryCancel();  // the client goes away mid-block
    (void)reader->Finish();
  }
  // The daemon notices asynchronously: poll until the pin is gone, then the
  // block must be evictable (TearDown checks nothing else leaked).
  uint64_t pins = 1;
  for (int i = 0; i < 200 && pins != 0; ++i) {
    auto st = client_->Stats();
    ASSERT_OK(st);
    pins = st->pins();
    if (pins != 0) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(pins, 0u);
  absl::string_view k = "big";
  auto ev = client_->Evict(kNs, {&k, 1}, false);
  ASSERT_OK(ev);
  EXPECT_EQ(ev->evicted_blocks(), 1u);
}

// Over the gRPC byte path (buffers not registered), a get reports each key
// on its own: a buffer of the wrong size fails that key only, the others
// arrive and a miss stays a miss (as over UCX). The synchronous GetInto
// keeps its contract: a wrong size fails the call before anything is
// written.
TEST_F(BadInputTest, AGrpcGetWithOneWrongBufferFailsOnlyThatKey) {
  const std::string a(4096, 'a'), b(4096, 'b'), c(4096, 'c');
  std::vector<BlockToPut> puts = {{"ka", "", a}, {"kb", "", b}, {"kc", "", c}};
  ASSERT_OK(client_->Put(kNs, puts));
  std::vector<absl::string_view> keys = {"ka", "kb", "kc", "kd"};
  std::vector<std::string> out = {std::string(4096, '.'), std::string(100, '.'),
                                  std::string(4096, '.'), std::string(4096, '.')};
  std::vector<absl::Span<char>> dst;
  for (std::string& o : out) dst.emplace_back(o);
  EXPECT_THAT(client_->GetInto(kNs, keys, dst), StatusIs(Code::kInvalidArgument));
  for (const std::string& o : out) EXPECT_EQ(o.find_first_not_of('.'), std::string::npos);

  TransferOp op = client_->GetIntoAsync(kNs, keys, dst);
  op.Wait();
  EXPECT_STREQ(op.transport(), "grpc");
  EXPECT_OK(op.statuses()[0]);
  EXPECT_THAT(op.statuses()[1], StatusIs(Code::kInvalidArgument));
  EXPECT_OK(op.statuses()[2]);
  EXPECT_THAT(op.statuses()[3], StatusIs(Code::kNotFound));
  EXPECT_EQ(out[0], a);
  EXPECT_EQ(out[1], std::string(100, '.'));
  EXPECT_EQ(out[2], c);
  EXPECT_EQ(out[3], std::string(4096, '.'));
  // The Read stream's pin goes when gRPC has let go of the block's last
  // slice, which may be just after the client has the stream's status.
  uint64_t pins = 1;
  for (int i = 0; i < 200 && pins != 0; ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(10));
    auto st = client_->Stats();
    ASSERT_OK(st);
    pins = st->pins();
  }
  EXPECT_EQ(pins, 0u);
  ASSERT_OK(client_->Evict(kNs, {keys.data(), 3}, false));
}

// Keys are content addresses: a put of a stored key with another size is
// refused (over the two-phase put and the Write stream), not taken as an
// idempotent no-op that the client would count as stored. TearDown checks
// the stored block is intact.
TEST_F(BadInputTest, APutOfAStoredKeyWithAnotherSizeIsInvalidArgument) {
  const std::string shorter(good_.size() - 1, 'g');
  BlockToPut b{"good", "", shorter};
  auto put = client_->Put(kNs, {&b, 1});
  EXPECT_THAT(put, StatusIs(Code::kInvalidArgument));
  EXPECT_NE(put.status().message().find("stored with 100000 bytes"),
            std::string::npos)
      << put.status().message();
  grpc::Status st = WriteRaw({Header("good", shorter.size(), BlockChecksum(shorter)),
                              Data(shorter)});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  // The same size is still put-if-absent.
  const std::string other(good_.size(), 'h');
  BlockToPut same{"good", "", other};
  auto again = client_->Put(kNs, {&same, 1});
  ASSERT_OK(again);
  EXPECT_EQ((*again)[0], PutResult::kAlreadyExists);
}

// A put batch with an empty block is refused whole before anything is
// stored, over the gRPC byte path as over UCX: no block reported failed
// while it was in fact stored.
TEST_F(BadInputTest, AGrpcPutWithAnEmptyBlockStoresNothing) {
  const std::string x(4096, 'x'), y(4096, 'y');
  std::vector<BlockToPut> puts = {{"kx", "", x}, {"kempty", "", ""}, {"ky", "", y}};
  TransferOp op = client_->PutFromAsync(kNs, puts);
  op.Wait();
  EXPECT_STREQ(op.transport(), "grpc");
  for (const absl::Status& s : op.statuses()) {
    EXPECT_THAT(s, StatusIs(Code::kInvalidArgument));
  }
  std::vector<absl::string_view> keys = {"kx", "ky"};
  auto found = client_->Lookup(kNs, keys, false, false);
  ASSERT_OK(found);
  EXPECT_FALSE(found->entries[0].found);
  EXPECT_FALSE(found->entries[1].found);
}

TEST_F(BadInputTest, DataBeforeHeaderIsInvalidArgument) {
  grpc::Status st = WriteRaw({Data("orphan")});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(BadInputTest, ChunkOverOneMiBIsInvalidArgument) {
  std::string bytes((1 << 20) + 1, 'c');
  grpc::Status st =
      WriteRaw({Header("k5", bytes.size(), BlockChecksum(bytes)), Data(bytes)});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(BadInputTest, UnknownSessionIsNotFound) {
  grpc::ClientContext ctx;
  v1::KeepAliveRequest req;
  req.set_session_id(987654321);
  v1::KeepAliveResponse resp;
  EXPECT_EQ(client_->stub().KeepAlive(&ctx, req, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::BeginPutResponse bpr;
  EXPECT_EQ(BeginPutRaw(987654321, {{"k6", 100}}, &bpr).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Session 0 is never a client's session.
  EXPECT_EQ(BeginPutRaw(0, {{"k6", 100}}, &bpr).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(BadInputTest, OversizedOrControlCharacterSessionStringsAreInvalidArgument) {
  auto open = [&](const std::string& name, const std::string& host,
                  const std::string& address) {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_client_name(name);
    req.set_host_id(host);
    req.set_ucx_worker_address(address);
    v1::OpenSessionResponse resp;
    return client_->stub().OpenSession(&ctx, req, &resp).error_code();
  };
  const std::string big(1 << 20, 'n');
  EXPECT_EQ(open(big, "", ""), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(open(std::string(257, 'n'), "", ""), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(open("engine\n2026-01-01 info forged", "", ""),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(open("ok", std::string(257, 'h'), ""), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(open("ok", "", std::string((64 << 10) + 1, 'a')),
            grpc::StatusCode::INVALID_ARGUMENT);
  auto st = client_->Stats();
  ASSERT_OK(st);
  EXPECT_EQ(st->sessions(), 0u) << "a refused OpenSession left a session";
  // At the limits: a session.
  EXPECT_EQ(open(std::string(256, 'n'), std::string(256, 'h'), ""), grpc::StatusCode::OK);
}

TEST_F(BadInputTest, UnknownPinIsInvalidArgument) {
  ASSERT_OK(client_->EnsureSession());
  EXPECT_THAT(client_->Unpin(123456), StatusIs(Code::kInvalidArgument));
  // A real pin of this session unpins once; the second time it is unknown.
  absl::string_view k = "good";
  auto r = client_->Lookup(kNs, {&k, 1}, false, /*pin=*/true);
  ASSERT_OK(r);
  ASSERT_NE(r->pin_id, 0u);
  EXPECT_OK(client_->Unpin(r->pin_id));
  EXPECT_THAT(client_->Unpin(r->pin_id), StatusIs(Code::kInvalidArgument));
  ASSERT_OK(client_->CloseSession());
}

TEST_F(BadInputTest, ReadOfMissingKeyIsNotFound) {
  absl::string_view k = "missing";
  auto r = client_->Get(kNs, {&k, 1});
  EXPECT_THAT(r, StatusIs(Code::kNotFound));
  EXPECT_NE(r.status().message().find("not found"), std::string::npos);
  // Unknown namespace too.
  auto r2 = client_->Get("no/such/ns", {&k, 1});
  EXPECT_THAT(r2, StatusIs(Code::kNotFound));
}

TEST_F(BadInputTest, BatchOverTheLimitIsInvalidArgument) {
  std::vector<std::string> keys(1025);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = absl::StrCat("key", i);
  std::vector<absl::string_view> views(keys.begin(), keys.end());
  EXPECT_THAT(client_->Lookup(kNs, views, false, false),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(client_->Get(kNs, views), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(client_->Evict(kNs, views, false), StatusIs(Code::kInvalidArgument));
  views.resize(1024);
  EXPECT_OK(client_->Lookup(kNs, views, false, false));
}

TEST_F(BadInputTest, PutLargerThanTheWholeDramTierIsResourceExhausted) {
  // Over the gRPC byte path: refused at the header, before any byte lands.
  grpc::Status st = WriteRaw({Header("huge", kDram + 1, 0), Data("x")});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << st.error_message();
  // And through BeginPut.
  auto sid = client_->EnsureSession();
  ASSERT_OK(sid);
  v1::BeginPutResponse bpr;
  EXPECT_EQ(BeginPutRaw(*sid, {{"huge", kDram * 2}}, &bpr).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_OK(client_->CloseSession());
}

TEST_F(BadInputTest, CommitWithWrongChecksumsIsRejectedPerBlock) {
  auto sid = client_->EnsureSession();
  ASSERT_OK(sid);
  std::string bytes(5000, 'q');
  v1::BeginPutResponse bpr;
  ASSERT_TRUE(BeginPutRaw(*sid, {{"tp1", bytes.size()}, {"tp2", bytes.size()}}, &bpr).ok());
  ASSERT_EQ(bpr.slots_size(), 2);
  // Fill both slots through the Write stream's reservation target.
  std::vector<v1::WriteRequest> msgs;
  for (uint32_t slot = 0; slot < 2; ++slot) {
    v1::WriteRequest h;
    h.mutable_header()->set_session_id(*sid);
    h.mutable_header()->set_reservation_id(bpr.reservation_id());
    h.mutable_header()->set_slot(slot);
    h.mutable_header()->set_size(bytes.size());
    msgs.push_back(h);
    msgs.push_back(Data(bytes));
  }
  v1::WriteResponse wr;
  ASSERT_TRUE(WriteRaw(msgs, true, &wr).ok());
  ASSERT_EQ(wr.results_size(), 2);
  EXPECT_EQ(wr.results(0), v1::WRITE_SLOT_FILLED);
  // Wrong number of checksums: rejected, reservation still open.
  grpc::ClientContext c1;
  v1::CommitPutRequest cp;
  cp.set_session_id(*sid);
  cp.set_reservation_id(bpr.reservation_id());
  cp.add_checksums(BlockChecksum(bytes));
  v1::CommitPutResponse cpr;
  EXPECT_EQ(client_->stub().CommitPut(&c1, cp, &cpr).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // One right, one wrong: only the right one is published.
  grpc::ClientContext c2;
  cp.add_checksums(7);
  ASSERT_TRUE(client_->stub().CommitPut(&c2, cp, &cpr).ok());
  EXPECT_EQ(cpr.results(0), v1::COMMIT_STORED);
  EXPECT_EQ(cpr.results(1), v1::COMMIT_CHECKSUM_MISMATCH);
  std::vector<absl::string_view> keys = {"tp1", "tp2"};
  auto r = client_->Lookup(kNs, keys, false, false);
  ASSERT_OK(r);
  EXPECT_TRUE(r->entries[0].found);
  EXPECT_FALSE(r->entries[1].found);
  // Unknown reservation afterwards.
  grpc::ClientContext c3;
  v1::AbortPutRequest ap;
  ap.set_session_id(*sid);
  ap.set_reservation_id(bpr.reservation_id());
  v1::AbortPutResponse apr;
  EXPECT_EQ(client_->stub().AbortPut(&c3, ap, &apr).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_OK(client_->Evict(kNs, keys, false));
  ASSERT_OK(client_->CloseSession());
}

TEST_F(BadInputTest, BadNamespaceIsInvalidArgument) {
  absl::string_view k = "good";
  EXPECT_THAT(client_->Lookup("", {&k, 1}, false, false),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(client_->Lookup("spaces are bad", {&k, 1}, false, false),
              StatusIs(Code::kInvalidArgument));
}

// ReportCorrupt is checked, not trusted: bad input is INVALID_ARGUMENT, and
// a report the daemon's own copy does not confirm (its bytes are intact,
// another checksum, a key or namespace not stored) drops nothing and counts
// nothing, so no client can make the daemon drop good blocks.
TEST_F(BadInputTest, ACorruptionReportIsCheckedNotTrusted) {
  auto report = [&](const std::string& ns,
                    const std::vector<std::pair<std::string, uint64_t>>& blocks,
                    v1::ReportCorruptResponse* resp) {
    grpc::ClientContext ctx;
    v1::ReportCorruptRequest req;
    req.set_namespace_(ns);
    for (const auto& [key, sum] : blocks) {
      v1::CorruptBlock* b = req.add_blocks();
      b->set_key(key);
      b->set_checksum(sum);
    }
    resp->Clear();
    return client_->stub().ReportCorrupt(&ctx, req, resp).error_code();
  };
  const uint64_t sum = BlockChecksum(good_);
  v1::ReportCorruptResponse resp;
  constexpr auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  EXPECT_EQ(report("", {{"good", sum}}, &resp), kInvalid);
  EXPECT_EQ(report("spaces are bad", {{"good", sum}}, &resp), kInvalid);
  EXPECT_EQ(report(kNs, {{"good", sum}, {"", sum}}, &resp), kInvalid);
  EXPECT_EQ(report(kNs, {{std::string(257, 'k'), sum}}, &resp), kInvalid);
  std::vector<std::pair<std::string, uint64_t>> many(65, {"good", sum});
  EXPECT_EQ(report(kNs, many, &resp), kInvalid);

  ASSERT_EQ(report(kNs, {}, &resp), grpc::StatusCode::OK);
  EXPECT_EQ(resp.verdicts_size(), 0);
  many.resize(64);  // the limit (the same block 64 times: checked once)
  ASSERT_EQ(report(kNs, many, &resp), grpc::StatusCode::OK);
  EXPECT_EQ(resp.verdicts_size(), 64);
  ASSERT_EQ(
      report(kNs, {{"good", sum}, {"good", sum + 1}, {"absent", sum}}, &resp),
      grpc::StatusCode::OK);
  ASSERT_EQ(resp.verdicts_size(), 3);
  for (int v : resp.verdicts()) EXPECT_EQ(v, v1::CORRUPT_NOT_CONFIRMED);
  ASSERT_EQ(report("no/such/ns", {{"good", sum}}, &resp), grpc::StatusCode::OK);
  ASSERT_EQ(resp.verdicts_size(), 1);
  EXPECT_EQ(resp.verdicts(0), v1::CORRUPT_NOT_CONFIRMED);

  // Nothing dropped (TearDown reads "good" back), nothing counted.
  absl::string_view k = "good";
  absl::StatusOr<LookupReply> found =
      client_->Lookup(kNs, {&k, 1}, false, false);
  ASSERT_OK(found.status());
  EXPECT_TRUE(found->entries[0].found);
  const std::string metrics = testing::ScrapeMetrics(*daemon_);
  EXPECT_EQ(testing::MetricValue(
                metrics, "kvdepot_integrity_errors_total{tier=\"dram\"}"),
            0)
      << metrics;
  absl::StatusOr<v1::StatsResponse> st = client_->Stats();
  ASSERT_OK(st.status());
  EXPECT_EQ(st->integrity_errors(), 0u);
  EXPECT_EQ(st->dram().integrity_errors(), 0u);
  EXPECT_EQ(st->dram().blocks(), 1u);
}

// The store's session limit, set in the config file: past it OpenSession is
// RESOURCE_EXHAUSTED, and a closed session makes room again.
TEST(ConfiguredLimitsTest, SessionsPastMaxSessionsAreResourceExhausted) {
  const std::string dir = testing::MakeTempDir("limits");
  const std::string config = dir + "/kvdepot.yaml";
  std::ofstream(config) << "max_sessions: 2\n";
  auto d = DaemonProcess::Start({"--config", config, "--dram-capacity", "16MiB"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  std::unique_ptr<Client> client = std::move(Client::Connect(o)).value();
  auto open = [&](v1::OpenSessionResponse* resp) {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_client_name("limits");
    return client->stub().OpenSession(&ctx, req, resp);
  };
  v1::OpenSessionResponse first, second, third;
  ASSERT_TRUE(open(&first).ok());
  ASSERT_TRUE(open(&second).ok());
  grpc::Status refused = open(&third);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find("too many sessions (2)"), std::string::npos)
      << refused.error_message();
  grpc::ClientContext ctx;
  v1::CloseSessionRequest close;
  close.set_session_id(first.session_id());
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(client->stub().CloseSession(&ctx, close, &closed).ok());
  EXPECT_TRUE(open(&third).ok());
  EXPECT_TRUE((*d)->Running()) << (*d)->Log();
}

// Puts that wait for room (DRAM full of reserved blocks, NVMe tier on).
class WaitingPutsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start({"--dram-capacity", "64MiB"});
    ASSERT_OK(d);
    daemon_ = std::move(d).value();
    ClientOptions o;
    o.server = daemon_->address();
    client_ = std::move(Client::Connect(o)).value();
    // Another session reserves nearly all of DRAM.
    holder_ = OpenSession();
    ASSERT_NE(holder_, 0u);
    v1::BeginPutResponse r;
    ASSERT_TRUE(BeginPut(holder_, "hold", 60 << 20, absl::Seconds(10), &r).ok());
    held_ = r.reservation_id();
    ASSERT_NE(held_, 0u);
  }

  uint64_t OpenSession() {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_client_name("waiting-puts");
    v1::OpenSessionResponse resp;
    return client_->stub().OpenSession(&ctx, req, &resp).ok() ? resp.session_id() : 0;
  }

  grpc::Status BeginPut(uint64_t session, const std::string& key, uint64_t size,
                        absl::Duration deadline, v1::BeginPutResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::BeginPutRequest req;
    req.set_session_id(session);
    req.set_namespace_(kNs);
    v1::PutSpec* spec = req.add_blocks();
    spec->set_key(key);
    spec->set_size(size);
    return client_->stub().BeginPut(&ctx, req, resp);
  }

  grpc::Status AbortHeld() {
    grpc::ClientContext ctx;
    v1::AbortPutRequest req;
    req.set_session_id(holder_);
    req.set_reservation_id(held_);
    v1::AbortPutResponse resp;
    return client_->stub().AbortPut(&ctx, req, &resp);
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  uint64_t holder_ = 0;
  uint64_t held_ = 0;
};

// A client gives up (its deadline) while its BeginPut waits for room; the
// room comes afterwards. The reservation made then is not kept: no one
// knows its id, and the session's keep-alives would hold the space.
TEST_F(WaitingPutsTest, APutWhoseClientGaveUpWhileItWaitedReservesNothing) {
  const uint64_t session = OpenSession();
  ASSERT_NE(session, 0u);
  v1::BeginPutResponse resp;
  grpc::Status st = BeginPut(session, "late", 16 << 20, absl::Seconds(1), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  ASSERT_TRUE(AbortHeld().ok());  // room, while the put still waits
  // The waiting put sees the room within its next poll (50 ms at most);
  // until then no reservation is held either.
  absl::SleepFor(absl::Seconds(1));
  EXPECT_TRUE(testing::PollUntil([&] {
    absl::StatusOr<v1::StatsResponse> s = client_->Stats();
    return s.ok() && s->reservations() == 0 && s->reserved_bytes() == 0;
  })) << "a reservation nobody knows of is held";
}

// Many puts waiting for room at once: each is answered (ResourceExhausted,
// the room never came) within about twice the store's 5 s wait, not one
// 5 s wait after another on a pool of a few threads.
TEST_F(WaitingPutsTest, ManyPutsWaitingForRoomAreEachAnsweredInTime) {
  constexpr int kPuts = 16;
  std::vector<grpc::Status> outcomes(kPuts);
  std::vector<std::thread> threads;
  for (int i = 0; i < kPuts; ++i) {
    threads.emplace_back([&, i] {
      const uint64_t session = OpenSession();
      v1::BeginPutResponse resp;
      outcomes[i] = BeginPut(session, absl::StrCat("wait", i), 16 << 20,
                             absl::Seconds(15), &resp);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kPuts; ++i) {
    EXPECT_EQ(outcomes[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << i << ": " << outcomes[i].error_message();
  }
  ASSERT_TRUE(AbortHeld().ok());
  auto s = client_->Stats();
  ASSERT_OK(s);
  EXPECT_EQ(s->reservations(), 0u);
  EXPECT_TRUE(daemon_->Running()) << daemon_->Log();
}

// OpenSession's max_block_bytes can be stored (on an empty DRAM tier no
// larger than max_block_size, the tier less a page for the key's slab).
TEST(ConfiguredLimitsTest, TheAdvertisedLargestBlockFitsAnEmptyDramTier) {
  auto d = DaemonProcess::Start({"--dram-capacity", "16MiB", "--nvme-capacity", "0"});
  ASSERT_OK(d);
  ClientOptions o;
  o.server = (*d)->address();
  std::unique_ptr<Client> client = std::move(Client::Connect(o)).value();
  grpc::ClientContext ctx;
  v1::OpenSessionRequest open;
  v1::OpenSessionResponse session;
  ASSERT_TRUE(client->stub().OpenSession(&ctx, open, &session).ok());
  EXPECT_LT(session.max_block_bytes(), uint64_t{16} << 20);
  EXPECT_GE(session.max_block_bytes(), uint64_t{15} << 20);
  grpc::ClientContext put_ctx;
  v1::BeginPutRequest req;
  req.set_session_id(session.session_id());
  req.set_namespace_(kNs);
  v1::PutSpec* spec = req.add_blocks();
  spec->set_key(std::string(256, 'k'));  // the longest key
  spec->set_size(session.max_block_bytes());
  v1::BeginPutResponse resp;
  grpc::Status st = client->stub().BeginPut(&put_ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

}  // namespace
}  // namespace kvdepot
