// StagingPipeline with fake transports on the pipeline's threads. Written
// against the public interfaces only: staging_test runs it on the CPU twin,
// gather_cuda_test on the CUDA build.
#include "gpu/staging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gpu/internal/test_cache.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using gpu_testing::TestCache;
using ::kvdepot::testing::StatusIs;

KvLayout SmallLayout(int layers) {
  // HND, so the pipeline goes through the strided copy.
  return KvLayout::Mha(KvCacheLayout::kFlashAttnHnd, layers, 4, 2, 16,
                       KvDtype::kFloat16)
      .value();
}

std::unique_ptr<StagingPipeline> NewPipeline(const KvLayout& layout,
                                             int buffers, int layers_per_piece,
                                             PieceOrder order) {
  StagingOptions o;
  o.num_buffers = buffers;
  o.layers_per_piece = layers_per_piece;
  o.order = order;
  return StagingPipeline::Create(layout, StreamRef{}, o).value();
}

std::vector<std::string> RandomObjects(const KvLayout& layout, size_t n,
                                       uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> objects(n, std::string(layout.object_bytes(), 0));
  for (std::string& o : objects) {
    for (char& c : o) c = static_cast<char>(rng());
  }
  return objects;
}

// A fake remote store for loads: serves `objects` (by index), recording the
// calls. Piece k (in call order) first waits for gate k when gated.
struct FakeSource {
  explicit FakeSource(std::vector<std::string> o, size_t gated_pieces = 0)
      : objects(std::move(o)) {
    for (size_t i = 0; i < gated_pieces; ++i) {
      gates.push_back(std::make_unique<absl::Notification>());
    }
  }

  LoadSource Source() {
    return [this](size_t index, uint64_t offset,
                  absl::Span<char> dst) -> absl::Status {
      const size_t k = calls.fetch_add(1);
      if (k < gates.size()) gates[k]->WaitForNotification();
      if (k == fail_at) return absl::UnavailableError("link down");
      if (std::this_thread::get_id() == caller) on_caller = true;
      const std::string& o = objects.at(index);
      if (offset + dst.size() > o.size()) {
        return absl::OutOfRangeError("read past the object");
      }
      std::copy_n(o.data() + offset, dst.size(), dst.data());
      return absl::OkStatus();
    };
  }

  std::vector<std::string> objects;
  std::vector<std::unique_ptr<absl::Notification>> gates;
  std::atomic<size_t> calls{0};
  size_t fail_at = SIZE_MAX;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> on_caller{false};
};

// A fake remote store for saves: appends each piece to its object, checking
// that pieces of an object arrive in order and back to back.
struct FakeSink {
  explicit FakeSink(size_t n, size_t gated_pieces = 0) : objects(n) {
    for (size_t i = 0; i < gated_pieces; ++i) {
      gates.push_back(std::make_unique<absl::Notification>());
    }
  }

  SaveSink Sink() {
    return [this](size_t index, uint64_t offset,
                  absl::Span<const char> bytes) -> absl::Status {
      const size_t k = calls.fetch_add(1);
      if (k < gates.size()) gates[k]->WaitForNotification();
      if (k == fail_at) return absl::DeadlineExceededError("put timed out");
      absl::MutexLock lock(&mu);
      order.push_back(index);
      std::string& o = objects.at(index);
      if (offset != o.size()) {
        return absl::InternalError(absl::StrCat("piece at ", offset, " after ",
                                                o.size(), " bytes of object ",
                                                index));
      }
      o.append(bytes.data(), bytes.size());
      return absl::OkStatus();
    };
  }

  absl::Mutex mu;
  std::vector<std::string> objects;
  std::vector<size_t> order;  // the index of each call, in call order
  std::vector<std::unique_ptr<absl::Notification>> gates;
  std::atomic<size_t> calls{0};
  size_t fail_at = SIZE_MAX;
};

}  // namespace

void PrintTo(PieceOrder order, std::ostream* os) {
  *os << (order == PieceOrder::kLayerMajor ? "layer-major" : "object-major");
}

namespace {

class StagingOrderTest : public ::testing::TestWithParam<PieceOrder> {};

TEST_P(StagingOrderTest, SaveDeliversEveryObjectInPieces) {
  const KvLayout layout = SmallLayout(6);
  TestCache cache(layout, 8);
  std::mt19937_64 rng(11);
  cache.FillRandom(rng);
  const std::vector<int64_t> ids = {5, 1, 5, 7, 0};       // repeats are fine
  auto pipeline = NewPipeline(layout, 3, 4, GetParam());  // pieces: 4 + 2
  EXPECT_EQ(pipeline->buffer_bytes(), 4 * layout.layer_bytes());
  FakeSink sink(ids.size());
  auto transfer = pipeline->StartSave(cache.view(), ids, sink.Sink()).value();
  ASSERT_OK(transfer->Wait());
  EXPECT_TRUE(transfer->IsDone());
  EXPECT_EQ(sink.calls.load(), ids.size() * 2);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(sink.objects[i], cache.ExpectedObject(ids[i])) << "object " << i;
  }
  for (int l = 0; l < layout.num_layers(); ++l) {
    EXPECT_TRUE(transfer->IsLayerDone(l));
  }
}

TEST_P(StagingOrderTest, LoadScattersEveryObjectIntoTheCache) {
  const KvLayout layout = SmallLayout(5);
  const int64_t num_blocks = 9;
  TestCache cache(layout, num_blocks);
  const std::vector<int64_t> ids = {4, 8, 0, 2};
  FakeSource source(RandomObjects(layout, ids.size(), 5));
  auto pipeline = NewPipeline(layout, 2, 2, GetParam());  // pieces: 2 + 2 + 1
  auto transfer =
      pipeline->StartLoad(cache.view(), ids, source.Source()).value();
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSERT_OK(transfer->WaitForLayer(l));
  }
  ASSERT_OK(transfer->Wait());
  EXPECT_FALSE(source.on_caller.load()) << "the transport ran on the caller";
  EXPECT_EQ(source.calls.load(), ids.size() * 3);
  const std::string zeros(layout.object_bytes(), '\0');
  for (int64_t b = 0; b < num_blocks; ++b) {
    const auto it = std::find(ids.begin(), ids.end(), b);
    EXPECT_EQ(cache.ExpectedObject(b),
              it == ids.end() ? zeros : source.objects[it - ids.begin()])
        << "block " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(BothOrders, StagingOrderTest,
                         ::testing::Values(PieceOrder::kLayerMajor,
                                           PieceOrder::kObjectMajor),
                         [](const auto& param_info) {
                           return param_info.param == PieceOrder::kLayerMajor
                                      ? std::string("LayerMajor")
                                      : std::string("ObjectMajor");
                         });

// The load path streams: a layer is done, and its bytes are in the cache,
// as soon as every block's piece of it has arrived, while later pieces are
// still held back by the transport.
TEST(StagingTest, LayersBecomeDoneInOrderAsTheirBytesArrive) {
  const KvLayout layout = SmallLayout(3);
  TestCache cache(layout, 4);
  const std::vector<int64_t> ids = {3, 1};
  // Layer-major, one layer per piece: (l0,b3) (l0,b1) (l1,b3) (l1,b1) ...
  FakeSource source(RandomObjects(layout, ids.size(), 9), /*gated_pieces=*/6);
  auto pipeline = NewPipeline(layout, 2, 1, PieceOrder::kLayerMajor);
  auto transfer =
      pipeline->StartLoad(cache.view(), ids, source.Source()).value();
  auto layer_of = [&](size_t i, int l) {
    return source.objects[i].substr(l * layout.layer_bytes(),
                                    layout.layer_bytes());
  };
  const std::string zero_layer(layout.layer_bytes(), '\0');

  source.gates[0]->Notify();  // layer 0 of block 3 only
  EXPECT_FALSE(transfer->IsLayerDone(0));
  source.gates[1]->Notify();  // and of block 1
  ASSERT_OK(transfer->WaitForLayer(0));
  EXPECT_EQ(cache.ExpectedObject(3, {0, 1}), layer_of(0, 0));
  EXPECT_EQ(cache.ExpectedObject(1, {0, 1}), layer_of(1, 0));
  // Piece 2 is still held: layer 1 is neither done nor written.
  EXPECT_FALSE(transfer->IsLayerDone(1));
  EXPECT_EQ(cache.ExpectedObject(3, {1, 2}), zero_layer);

  source.gates[2]->Notify();
  source.gates[3]->Notify();
  ASSERT_OK(transfer->WaitForLayer(1));
  EXPECT_EQ(cache.ExpectedObject(3, {1, 2}), layer_of(0, 1));
  EXPECT_EQ(cache.ExpectedObject(1, {1, 2}), layer_of(1, 1));
  source.gates[4]->Notify();
  EXPECT_FALSE(transfer->IsLayerDone(2));
  EXPECT_FALSE(transfer->IsDone());
  source.gates[5]->Notify();
  ASSERT_OK(transfer->Wait());
  EXPECT_TRUE(transfer->IsLayerDone(2));
  EXPECT_EQ(cache.ExpectedObject(1), source.objects[1]);
}

// Saves overlap: while the transport is stuck sending piece 0, the device
// stage gathers ahead -- into free ring buffers only.
TEST(StagingTest, SaveGathersAheadOfABlockedSendByAtMostTheRing) {
  const KvLayout layout = SmallLayout(6);
  TestCache cache(layout, 2);
  std::mt19937_64 rng(2);
  cache.FillRandom(rng);
  const int64_t id = 1;
  FakeSink sink(1, /*gated_pieces=*/1);
  auto pipeline = NewPipeline(layout, 3, 1, PieceOrder::kLayerMajor);
  auto transfer =
      pipeline
          ->StartSave(cache.view(), absl::MakeConstSpan(&id, 1), sink.Sink())
          .value();
  // Pieces 0..2 fill the three buffers while send 0 is held.
  ASSERT_OK(transfer->WaitForLayer(2));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(transfer->IsLayerDone(3)) << "gathered into a busy buffer";
  EXPECT_LE(sink.calls.load(), 1u);
  sink.gates[0]->Notify();
  ASSERT_OK(transfer->Wait());
  EXPECT_EQ(sink.objects[0], cache.ExpectedObject(id));
}

TEST(StagingTest, AFailedLoadKeepsTheLayersItFinished) {
  const KvLayout layout = SmallLayout(3);
  TestCache cache(layout, 4);
  const std::vector<int64_t> ids = {0, 2};
  // Pieces (l0,b0) (l0,b1) (l1,b0) (l1,b1) ...: the fourth fails, after
  // layer 0 is done.
  FakeSource source(RandomObjects(layout, ids.size(), 4), /*gated_pieces=*/3);
  source.fail_at = 3;
  auto pipeline = NewPipeline(layout, 2, 1, PieceOrder::kLayerMajor);
  auto transfer =
      pipeline->StartLoad(cache.view(), ids, source.Source()).value();
  source.gates[0]->Notify();
  source.gates[1]->Notify();
  ASSERT_OK(transfer->WaitForLayer(0));
  source.gates[2]->Notify();
  EXPECT_THAT(transfer->WaitForLayer(1),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(transfer->WaitForLayer(2),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(transfer->IsDone());  // answered only once nothing runs
  EXPECT_THAT(transfer->Wait(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_OK(transfer->WaitForLayer(0));
  EXPECT_EQ(source.calls.load(), 4u);  // nothing asked for after the failure
  EXPECT_THAT(transfer->WaitForLayer(3),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StagingTest, AFailedSendFailsTheSave) {
  const KvLayout layout = SmallLayout(2);
  TestCache cache(layout, 4);
  const std::vector<int64_t> ids = {0, 1, 2, 3};
  FakeSink sink(ids.size());
  sink.fail_at = 1;
  auto pipeline = NewPipeline(layout, 2, 0, PieceOrder::kObjectMajor);
  auto transfer = pipeline->StartSave(cache.view(), ids, sink.Sink()).value();
  EXPECT_THAT(transfer->Wait(), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(sink.calls.load(), 2u);  // nothing sent after the failure
  // The pipeline goes on with the next transfer.
  FakeSink next(1);
  const int64_t id = 3;
  ASSERT_OK(
      pipeline
          ->StartSave(cache.view(), absl::MakeConstSpan(&id, 1), next.Sink())
          .value()
          ->Wait());
  EXPECT_EQ(next.objects[0], cache.ExpectedObject(3));
}

TEST(StagingTest, RejectsBadInputBeforeCallingTheTransport) {
  const KvLayout layout = SmallLayout(2);
  TestCache cache(layout, 4);
  auto pipeline = NewPipeline(layout, 2, 0, PieceOrder::kLayerMajor);
  FakeSource source(RandomObjects(layout, 3, 1));
  FakeSink sink(3);
  const auto kInvalid = StatusIs(absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pipeline->StartLoad(cache.view(), {0, 4}, source.Source()),
              kInvalid);
  EXPECT_THAT(pipeline->StartLoad(cache.view(), {1, 2, 1}, source.Source()),
              kInvalid);
  EXPECT_THAT(pipeline->StartSave(cache.view(), {-1}, sink.Sink()), kInvalid);
  KvCacheView bad = cache.view();
  bad.tensors.pop_back();
  EXPECT_THAT(pipeline->StartSave(bad, {0}, sink.Sink()), kInvalid);
  EXPECT_THAT(pipeline->StartSave(cache.view(), {0}, SaveSink()), kInvalid);
  EXPECT_EQ(source.calls.load(), 0u);
  EXPECT_EQ(sink.calls.load(), 0u);

  StagingOptions o;
  o.num_buffers = 1;
  EXPECT_THAT(StagingPipeline::Create(layout, StreamRef{}, o), kInvalid);
  o.num_buffers = 2;
  o.layers_per_piece = -1;
  EXPECT_THAT(StagingPipeline::Create(layout, StreamRef{}, o), kInvalid);
  o.layers_per_piece = 0;
  o.blocks_per_piece = 0;
  EXPECT_THAT(StagingPipeline::Create(layout, StreamRef{}, o), kInvalid);
  // Object-major pieces of several blocks but not whole objects would hand
  // the transport their objects interleaved.
  o.blocks_per_piece = 2;
  o.layers_per_piece = 1;
  o.order = PieceOrder::kObjectMajor;
  EXPECT_THAT(StagingPipeline::Create(layout, StreamRef{}, o), kInvalid);
}

// Pieces of several blocks (one launch each, 3 blocks of 2 layers per
// buffer here; the last piece of each layer group has 1 block): every
// object is saved and loaded whole, each block's piece handed to the
// transport on its own, and layers finish as their pieces do.
TEST(StagingTest, PiecesOfSeveralBlocksMoveEveryObject) {
  const KvLayout layout = SmallLayout(5);
  TestCache cache(layout, 9);
  std::mt19937_64 rng(13);
  cache.FillRandom(rng);
  StagingOptions o;
  o.num_buffers = 2;
  o.layers_per_piece = 2;
  o.blocks_per_piece = 3;
  auto pipeline = StagingPipeline::Create(layout, StreamRef{}, o).value();
  EXPECT_EQ(pipeline->buffer_bytes(), 3 * 2 * layout.layer_bytes());
  const std::vector<int64_t> ids = {8, 2, 8, 0, 5, 1, 7};  // a repeat
  FakeSink sink(ids.size());
  auto save = pipeline->StartSave(cache.view(), ids, sink.Sink()).value();
  ASSERT_OK(save->Wait());
  EXPECT_EQ(sink.calls.load(), ids.size() * 3);  // layer groups 2 + 2 + 1
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(sink.objects[i], cache.ExpectedObject(ids[i])) << "object " << i;
  }
  // Layer-major: every block's first group before any block's second.
  for (size_t k = 0; k < sink.order.size(); ++k) {
    EXPECT_EQ(sink.order[k], k % ids.size()) << "call " << k;
  }

  const std::vector<int64_t> load_ids = {4, 0, 6, 2, 8};
  TestCache loaded(layout, 9);
  FakeSource source(RandomObjects(layout, load_ids.size(), 14));
  auto load =
      pipeline->StartLoad(loaded.view(), load_ids, source.Source()).value();
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSERT_OK(load->WaitForLayer(l));
    for (size_t i = 0; i < load_ids.size(); ++i) {
      EXPECT_EQ(loaded.ExpectedObject(load_ids[i], {l, l + 1}),
                source.objects[i].substr(l * layout.layer_bytes(),
                                         layout.layer_bytes()))
          << "layer " << l << " of object " << i;
    }
  }
  ASSERT_OK(load->Wait());
  EXPECT_EQ(source.calls.load(), load_ids.size() * 3);
  const std::string zeros(layout.object_bytes(), '\0');
  for (int64_t b : {1, 3, 5, 7}) EXPECT_EQ(loaded.ExpectedObject(b), zeros);
}

// Object-major pieces of several whole objects still hand the transport
// one object at a time, in order.
TEST(StagingTest, ObjectMajorPiecesOfSeveralBlocksKeepObjectsWhole) {
  const KvLayout layout = SmallLayout(3);
  TestCache cache(layout, 6);
  std::mt19937_64 rng(15);
  cache.FillRandom(rng);
  StagingOptions o;
  o.num_buffers = 2;
  o.blocks_per_piece = 4;
  o.order = PieceOrder::kObjectMajor;
  auto pipeline = StagingPipeline::Create(layout, StreamRef{}, o).value();
  const std::vector<int64_t> ids = {5, 4, 3, 2, 1, 0};
  FakeSink sink(ids.size());
  ASSERT_OK(
      pipeline->StartSave(cache.view(), ids, sink.Sink()).value()->Wait());
  EXPECT_THAT(sink.order, ::testing::ElementsAre(0, 1, 2, 3, 4, 5));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(sink.objects[i], cache.ExpectedObject(ids[i])) << "object " << i;
  }
}

TEST(StagingTest, TransfersRunOneAfterAnotherInOrder) {
  const KvLayout layout = SmallLayout(2);
  TestCache cache(layout, 6);
  std::mt19937_64 rng(8);
  cache.FillRandom(rng);
  const std::vector<int64_t> save_ids = {0, 1, 2};
  const std::vector<int64_t> load_ids = {3, 4, 5};
  FakeSink sink(save_ids.size(), /*gated_pieces=*/1);
  FakeSource source(RandomObjects(layout, load_ids.size(), 3));
  auto pipeline = NewPipeline(layout, 2, 1, PieceOrder::kLayerMajor);
  auto save = pipeline->StartSave(cache.view(), save_ids, sink.Sink()).value();
  auto load =
      pipeline->StartLoad(cache.view(), load_ids, source.Source()).value();
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(source.calls.load(), 0u) << "the load overtook the save";
  EXPECT_FALSE(load->IsLayerDone(0));
  sink.gates[0]->Notify();
  ASSERT_OK(load->Wait());
  EXPECT_TRUE(save->IsDone());
  ASSERT_OK(save->Wait());
  for (size_t i = 0; i < save_ids.size(); ++i) {
    EXPECT_EQ(sink.objects[i], cache.ExpectedObject(save_ids[i]));
  }
  for (size_t i = 0; i < load_ids.size(); ++i) {
    EXPECT_EQ(cache.ExpectedObject(load_ids[i]), source.objects[i]);
  }
}

TEST(StagingTest, DestroyingThePipelineFinishesStartedTransfers) {
  const KvLayout layout = SmallLayout(2);
  TestCache cache(layout, 3);
  FakeSource source(RandomObjects(layout, 3, 6));
  std::unique_ptr<PendingTransfer> transfer;
  {
    auto pipeline = NewPipeline(layout, 2, 1, PieceOrder::kObjectMajor);
    transfer =
        pipeline->StartLoad(cache.view(), {2, 0, 1}, source.Source()).value();
  }
  EXPECT_TRUE(transfer->IsDone());
  ASSERT_OK(transfer->Wait());
  EXPECT_EQ(cache.ExpectedObject(0), source.objects[1]);
}

// The device-side form of WaitForLayer: once WaitForLayerOn returns and the
// engine's stream (the default one here) has caught up, the layer is in the
// cache. Out-of-range layers are refused.
TEST(StagingTest, WaitForLayerOnOrdersTheStreamAfterTheLayer) {
  const KvLayout layout = SmallLayout(3);
  TestCache cache(layout, 5);
  const std::vector<int64_t> ids = {4, 1, 3};
  FakeSource source(RandomObjects(layout, ids.size(), 21));
  auto pipeline = NewPipeline(layout, 2, 1, PieceOrder::kLayerMajor);
  auto transfer =
      pipeline->StartLoad(cache.view(), ids, source.Source()).value();
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSERT_OK(transfer->WaitForLayerOn(l, StreamRef{}));
    ASSERT_OK(SynchronizeStream(StreamRef{}));
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(cache.ExpectedObject(ids[i], {l, l + 1}),
                source.objects[i].substr(l * layout.layer_bytes(),
                                         layout.layer_bytes()))
          << "layer " << l << " of object " << i;
    }
  }
  const auto kInvalid = StatusIs(absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(transfer->WaitForLayerOn(-1, StreamRef{}), kInvalid);
  EXPECT_THAT(transfer->WaitForLayerOn(3, StreamRef{}), kInvalid);
  ASSERT_OK(transfer->Wait());

  // No blocks: nothing to wait for, every layer answers at once.
  FakeSink sink(0);
  auto empty = pipeline->StartSave(cache.view(), {}, sink.Sink()).value();
  EXPECT_OK(empty->WaitForLayerOn(2, StreamRef{}));
  EXPECT_THAT(empty->WaitForLayerOn(3, StreamRef{}), kInvalid);
}

TEST(StagingTest, AnEmptyTransferIsDoneAtOnce) {
  const KvLayout layout = SmallLayout(2);
  TestCache cache(layout, 1);
  auto pipeline = NewPipeline(layout, 2, 0, PieceOrder::kLayerMajor);
  FakeSink sink(0);
  auto transfer = pipeline->StartSave(cache.view(), {}, sink.Sink()).value();
  ASSERT_OK(transfer->WaitForLayer(1));
  ASSERT_OK(transfer->Wait());
  EXPECT_EQ(sink.calls.load(), 0u);
}

}  // namespace
}  // namespace kvdepot
