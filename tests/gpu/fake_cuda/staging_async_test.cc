// StagingPipeline under stress against the fake asynchronous CUDA runtime
// (fake_cudart.cc), where its device stage's events are seen incomplete.
// Public API only, plus the fake's hooks to see the streams' pending and
// executed work.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "fake_cuda.h"
#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/internal/copy_kernel.h"
#include "gpu/internal/test_cache.h"
#include "gpu/staging.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using gpu_testing::SameBytes;
using gpu_testing::TestCache;
using ::kvdepot::testing::StatusIs;

// Every cache chunk (its first byte) that an executed kernel copied.
class ChunkLog {
 public:
  ChunkLog() {
    fake_cuda::SetKernelObserver([this](const void* params) {
      const auto& p = *static_cast<const gpu_internal::CopyLaunch*>(params);
      absl::MutexLock lock(&mu_);
      for (int l = 0; l < p.num_layers; ++l) {
        for (int i = 0; i < p.num_blocks; ++i) {
          for (int c = 0; c < p.num_components; ++c) {
            chunks_.insert(p.layer_base[l] + p.block_offset[i] +
                           static_cast<int64_t>(c) * p.component_stride);
          }
        }
      }
    });
  }
  ~ChunkLog() { fake_cuda::SetKernelObserver(nullptr); }
  void Clear() {
    absl::MutexLock lock(&mu_);
    chunks_.clear();
  }
  bool Has(const char* chunk) {
    absl::MutexLock lock(&mu_);
    return chunks_.count(chunk) != 0;
  }

 private:
  absl::Mutex mu_;
  std::set<const char*> chunks_;
};

// After a failure, the pipeline still saves `ids` out of `cache` intact.
void ExpectSavesIntact(StagingPipeline& pipeline, const TestCache& cache,
                       const std::vector<int64_t>& ids) {
  std::vector<std::string> saved(ids.size());
  ASSERT_OK(pipeline
                .StartSave(cache.view(), ids,
                           [&](size_t i, uint64_t, absl::Span<const char> b) {
                             saved[i].append(b.data(), b.size());
                             return absl::OkStatus();
                           })
                .value()
                ->Wait());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(SameBytes(saved[i], cache.ExpectedObject(ids[i])));
  }
}

class OwnStream {
 public:
  explicit OwnStream(bool legacy) {
    if (!legacy) (void)cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking);
  }
  ~OwnStream() {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  StreamRef ref() const { return StreamRef{s_}; }
  cudaStream_t native() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

void RandomPause(std::mt19937_64& rng) {
  const uint64_t r = rng() % 8;
  if (r == 0)
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
  if (r == 1) std::this_thread::yield();
}

using Param = std::tuple<KvCacheLayout, int /*ring*/, int /*layers/piece*/,
                         PieceOrder, bool /*legacy stream*/>;

class StagingStress : public ::testing::TestWithParam<Param> {};

// Save many blocks, then load them back into a zeroed cache. During the
// load, as soon as WaitForLayer(l) returns OK, layer l of every block is in
// the cache (bytes), and every chunk of it was copied by an executed
// kernel. After each Wait(), the pipeline's stream has no pending work.
TEST_P(StagingStress, SaveThenLoadRoundTrips) {
  const auto [kind, ring, lpp, order, legacy] = GetParam();
  const bool mla = kind == KvCacheLayout::kMla;
  const KvLayout layout =
      mla ? KvLayout::Mla(kind, 5, 4, 64, KvDtype::kBFloat16).value()
          : KvLayout::Mha(kind, 5, 4, 2, 16, KvDtype::kFloat16).value();
  constexpr int64_t kBlocks = 40;
  TestCache cache(layout, kBlocks);
  std::mt19937_64 rng(std::hash<std::string>()(
      ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  cache.FillRandom(rng);
  std::vector<int64_t> ids(kBlocks);
  for (int64_t i = 0; i < kBlocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(24);

  OwnStream stream(legacy);
  StagingOptions o;
  o.num_buffers = ring;
  o.layers_per_piece = lpp;
  o.order = order;
  auto pipeline = StagingPipeline::Create(layout, stream.ref(), o).value();
  ChunkLog log;

  std::vector<std::string> saved(ids.size());
  absl::Mutex saved_mu;
  std::mt19937_64 sink_rng(rng());
  auto save = pipeline
                  ->StartSave(cache.view(), ids,
                              [&](size_t i, uint64_t offset,
                                  absl::Span<const char> b) -> absl::Status {
                                RandomPause(sink_rng);
                                absl::MutexLock lock(&saved_mu);
                                if (offset != saved[i].size()) {
                                  return absl::InternalError("out of order");
                                }
                                saved[i].append(b.data(), b.size());
                                return absl::OkStatus();
                              })
                  .value();
  ASSERT_OK(save->Wait());
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u)
      << "device work still pending after a save's Wait()";
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(SameBytes(saved[i], cache.ExpectedObject(ids[i])))
        << "saved object " << i;
  }

  TestCache restored(layout, kBlocks);
  log.Clear();
  std::mt19937_64 source_rng(rng());
  auto load =
      pipeline
          ->StartLoad(restored.view(), ids,
                      [&](size_t i, uint64_t offset,
                          absl::Span<char> dst) -> absl::Status {
                        RandomPause(source_rng);
                        std::memcpy(dst.data(), saved[i].data() + offset,
                                    dst.size());
                        return absl::OkStatus();
                      })
          .value();
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSERT_OK(load->WaitForLayer(l));
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int c = 0; c < layout.num_components(); ++c) {
        ASSERT_TRUE(log.Has(restored.Row(l, ids[i], c, 0, 0)))
            << "layer " << l << " of block " << ids[i] << " component " << c
            << " not yet copied by an executed kernel when WaitForLayer "
               "returned";
      }
      ASSERT_TRUE(
          SameBytes(restored.ExpectedObject(ids[i], LayerRange{l, l + 1}),
                    cache.ExpectedObject(ids[i], LayerRange{l, l + 1})))
          << "layer " << l << " of block " << ids[i]
          << " not in the cache when WaitForLayer returned";
    }
  }
  ASSERT_OK(load->Wait());
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u)
      << "device work still pending after a load's Wait()";
  const std::string zeros(layout.object_bytes(), '\0');
  for (int64_t b = 0; b < kBlocks; ++b) {
    const bool moved = std::find(ids.begin(), ids.end(), b) != ids.end();
    ASSERT_TRUE(SameBytes(restored.ExpectedObject(b),
                          moved ? cache.ExpectedObject(b) : zeros))
        << "block " << b;
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto [kind, ring, lpp, order, legacy] = info.param;
  std::string name(KvCacheLayoutName(kind));
  std::replace(name.begin(), name.end(), '-', '_');
  return absl::StrCat(name, "_ring", ring, "_lpp", lpp,
                      order == PieceOrder::kLayerMajor ? "_layer" : "_object",
                      legacy ? "_legacy" : "_own");
}

INSTANTIATE_TEST_SUITE_P(
    Many, StagingStress,
    ::testing::Combine(
        ::testing::Values(KvCacheLayout::kFlashAttnHnd,
                          KvCacheLayout::kFlashInferNhd,
                          KvCacheLayout::kCrossLayerHnd, KvCacheLayout::kMla),
        ::testing::Values(2, 4), ::testing::Values(1, 2, 0),
        ::testing::Values(PieceOrder::kLayerMajor, PieceOrder::kObjectMajor),
        ::testing::Bool()),
    ParamName);

KvLayout Small() {
  return KvLayout::Mha(KvCacheLayout::kFlashAttnHnd, 4, 4, 2, 16,
                       KvDtype::kFloat16)
      .value();
}

std::vector<std::string> RandomObjects(const KvLayout& layout, size_t n,
                                       std::mt19937_64& rng) {
  std::vector<std::string> objects(n, std::string(layout.object_bytes(), 0));
  for (std::string& o : objects) {
    for (char& c : o) c = static_cast<char>(rng());
  }
  return objects;
}

class FailureStress : public ::testing::TestWithParam<int /*ring*/> {
 protected:
  // A pipeline on `stream` with this test's ring, one layer per piece (so
  // that a failure may come at any of many pieces).
  static std::unique_ptr<StagingPipeline> MakePipeline(
      const KvLayout& layout, const OwnStream& stream) {
    StagingOptions o;
    o.num_buffers = GetParam();
    o.layers_per_piece = 1;
    return StagingPipeline::Create(layout, stream.ref(), o).value();
  }
};

// A sink failing at a random piece: the save ends with its error, and once
// IsDone() (or Wait()) says so, no device work of it is pending. The
// pipeline then runs the next transfer correctly.
TEST_P(FailureStress, AFailingSinkLeavesNothingRunning) {
  const KvLayout layout = Small();
  TestCache cache(layout, 16);
  std::mt19937_64 rng(100 + GetParam());
  cache.FillRandom(rng);
  std::vector<int64_t> ids = {3, 9, 1, 15, 0, 7, 12, 4};
  OwnStream stream(false);
  auto pipeline = MakePipeline(layout, stream);
  const size_t pieces = ids.size() * layout.num_layers();
  for (int round = 0; round < 20; ++round) {
    const size_t fail_at = rng() % pieces;
    std::atomic<size_t> calls{0};
    std::atomic<bool> called_after_failure{false};
    auto t = pipeline
                 ->StartSave(cache.view(), ids,
                             [&](size_t, uint64_t, absl::Span<const char>) {
                               const size_t k = calls.fetch_add(1);
                               if (k > fail_at) called_after_failure = true;
                               if (k == fail_at) {
                                 return absl::UnavailableError("link down");
                               }
                               return absl::OkStatus();
                             })
                 .value();
    if (round % 2 == 0) {
      while (!t->IsDone()) std::this_thread::yield();
      EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u)
          << "device work pending once IsDone() (round " << round << ")";
    }
    EXPECT_THAT(t->Wait(), StatusIs(absl::StatusCode::kUnavailable));
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u)
        << "device work pending after Wait() (round " << round << ")";
    EXPECT_FALSE(called_after_failure.load());
  }
  ExpectSavesIntact(*pipeline, cache, ids);
}

// A source failing at a random piece: the load ends with its error; the
// layers WaitForLayer called done are in the cache; after Wait() nothing
// writes the cache any more.
TEST_P(FailureStress, AFailingSourceLeavesNothingRunning) {
  const KvLayout layout = Small();
  std::mt19937_64 rng(200 + GetParam());
  std::vector<int64_t> ids = {3, 9, 1, 15, 0, 7, 12, 4};
  const std::vector<std::string> objects =
      RandomObjects(layout, ids.size(), rng);
  OwnStream stream(false);
  auto pipeline = MakePipeline(layout, stream);
  const size_t pieces = ids.size() * layout.num_layers();
  for (int round = 0; round < 20; ++round) {
    TestCache cache(layout, 16);
    const size_t fail_at = rng() % pieces;
    std::atomic<size_t> calls{0};
    auto t =
        pipeline
            ->StartLoad(cache.view(), ids,
                        [&](size_t i, uint64_t offset, absl::Span<char> d) {
                          const size_t k = calls.fetch_add(1);
                          if (k == fail_at) {
                            return absl::UnavailableError("link down");
                          }
                          std::memcpy(d.data(), objects[i].data() + offset,
                                      d.size());
                          return absl::OkStatus();
                        })
            .value();
    std::vector<bool> done(layout.num_layers());
    for (int l = 0; l < layout.num_layers(); ++l) {
      const absl::Status s = t->WaitForLayer(l);
      done[l] = s.ok();
      if (done[l]) {
        for (size_t i = 0; i < ids.size(); ++i) {
          EXPECT_TRUE(
              SameBytes(cache.ExpectedObject(ids[i], LayerRange{l, l + 1}),
                        objects[i].substr(l * layout.layer_bytes(),
                                          layout.layer_bytes())))
              << "round " << round << " layer " << l;
        }
      } else {
        EXPECT_TRUE(t->IsDone());
        EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u)
            << "device work pending when a failed WaitForLayer returned";
      }
    }
    EXPECT_THAT(t->Wait(), StatusIs(absl::StatusCode::kUnavailable));
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
    const std::string snapshot = cache.Snapshot();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_TRUE(cache.Snapshot() == snapshot) << "the cache changed after Wait";
  }
}

// A launch that fails (the fake refuses it, enqueueing nothing): the
// transfer ends with the launch's error after the stream has drained; the
// pipeline goes on.
TEST_P(FailureStress, AFailedLaunchEndsTheTransferCleanly) {
  const KvLayout layout = Small();
  TestCache cache(layout, 16);
  std::mt19937_64 rng(300 + GetParam());
  cache.FillRandom(rng);
  std::vector<int64_t> ids = {3, 9, 1, 15, 0, 7};
  OwnStream stream(false);
  auto pipeline = MakePipeline(layout, stream);
  const int pieces = static_cast<int>(ids.size()) * layout.num_layers();
  for (int round = 0; round < 10; ++round) {
    const bool save = round % 2 == 0;
    fake_cuda::FailLaunchAfter(static_cast<int>(rng() % pieces));
    std::atomic<size_t> calls{0};
    std::unique_ptr<PendingTransfer> t;
    TestCache target(layout, 16);
    if (save) {
      t = pipeline
              ->StartSave(cache.view(), ids,
                          [&](size_t, uint64_t, absl::Span<const char>) {
                            ++calls;
                            return absl::OkStatus();
                          })
              .value();
    } else {
      t = pipeline
              ->StartLoad(target.view(), ids,
                          [&](size_t, uint64_t, absl::Span<char> d) {
                            ++calls;
                            std::memset(d.data(), 1, d.size());
                            return absl::OkStatus();
                          })
              .value();
    }
    const absl::Status s = t->Wait();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal)) << s;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("launching"));
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
    fake_cuda::FailLaunchAfter(-1);
  }
  ExpectSavesIntact(*pipeline, cache, ids);
}

// A kernel that faults asynchronously (sticky error): the transfer ends
// with that error, promptly, with nothing pending.
TEST_P(FailureStress, AnAsynchronousFaultEndsTheTransfer) {
  const KvLayout layout = Small();
  TestCache cache(layout, 16);
  std::mt19937_64 rng(400 + GetParam());
  cache.FillRandom(rng);
  std::vector<int64_t> ids = {3, 9, 1, 15, 0, 7};
  OwnStream stream(false);
  auto pipeline = MakePipeline(layout, stream);
  const int pieces = static_cast<int>(ids.size()) * layout.num_layers();
  for (int round = 0; round < 6; ++round) {
    fake_cuda::FaultKernelAfter(static_cast<int>(rng() % pieces));
    auto t = pipeline
                 ->StartSave(cache.view(), ids,
                             [&](size_t, uint64_t, absl::Span<const char>) {
                               return absl::OkStatus();
                             })
                 .value();
    const absl::Status s = t->Wait();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal)) << s;
    EXPECT_THAT(std::string(s.message()),
                ::testing::HasSubstr("cudaErrorIllegalAddress"));
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
    fake_cuda::FaultKernelAfter(-1);
    fake_cuda::ClearStickyError();
    (void)cudaGetLastError();
  }
}

// After a sticky fault (an earlier kernel's, here one of Gather's own; the
// engine's kernels' faults are the same) every runtime call returns it,
// cudaPointerGetAttributes included. Gather then reports the context's
// error, not InvalidArgument about memory the device could not reach,
// which would send its caller after a registration problem that is not
// there.
TEST(StickyFault, GatherReportsTheContextsErrorNotBadInput) {
  const KvLayout layout = Small();
  TestCache cache(layout, 4);
  std::mt19937_64 rng(61);
  cache.FillRandom(rng);
  const int64_t id = 2;
  HostBuffer pinned = AllocateHostBuffer(layout.object_bytes()).value();
  void* to_pinned[] = {pinned.data()};
  std::vector<char> pageable(layout.object_bytes());
  void* to_pageable[] = {pageable.data()};

  fake_cuda::FaultKernelAfter(0);
  ASSERT_OK(Gather(layout, cache.view(), absl::MakeConstSpan(&id, 1),
                   layout.AllLayers(), to_pinned, StreamRef{}));
  EXPECT_THAT(SynchronizeStream(StreamRef{}),
              StatusIs(absl::StatusCode::kInternal));
  for (void** to : {to_pinned, to_pageable}) {
    const absl::Status s =
        Gather(layout, cache.view(), absl::MakeConstSpan(&id, 1),
               layout.AllLayers(), absl::MakeConstSpan(to, 1), StreamRef{});
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal)) << s;
    EXPECT_THAT(std::string(s.message()),
                ::testing::HasSubstr("cudaErrorIllegalAddress"));
  }
  fake_cuda::FaultKernelAfter(-1);
  fake_cuda::ClearStickyError();
  (void)cudaGetLastError();

  // Once the context is good again, pageable memory is what it is.
  if (std::getenv("FAKE_CUDA_PAGEABLE") == nullptr) {
    EXPECT_THAT(Gather(layout, cache.view(), absl::MakeConstSpan(&id, 1),
                       layout.AllLayers(), to_pageable, StreamRef{}),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
  ASSERT_OK(Gather(layout, cache.view(), absl::MakeConstSpan(&id, 1),
                   layout.AllLayers(), to_pinned, StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_TRUE(SameBytes(std::string(pinned.data(), layout.object_bytes()),
                        cache.ExpectedObject(id)));
}

// A pipeline made on device 1, started from a thread whose current device
// is 0: a cache on device 1 is accepted (and round-trips), one on device 0
// is refused at StartSave. Needs FAKE_CUDA_DEVICES=2.
TEST(StagingDevices, TheCacheIsCheckedAgainstThePipelinesDevice) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < 2) GTEST_SKIP() << "needs FAKE_CUDA_DEVICES=2";
  const KvLayout layout = Small();
  constexpr int64_t kBlocks = 6;
  TestCache host(layout, kBlocks);
  std::mt19937_64 rng(99);
  host.FillRandom(rng);
  const size_t bytes = host.tensor_bytes();
  auto device_view = [&](int device, std::vector<void*>* owned) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    KvCacheView v;
    v.num_blocks = kBlocks;
    for (int i = 0; i < host.num_tensors(); ++i) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, host.tensor(i), bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      owned->push_back(p);
      v.tensors.push_back(p);
    }
    return v;
  };
  std::vector<void*> owned;
  const KvCacheView on0 = device_view(0, &owned);
  const KvCacheView on1 = device_view(1, &owned);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  std::unique_ptr<StagingPipeline> pipeline;
  {
    OwnStream stream(false);  // on device 1 (the fake does not care)
    StagingOptions o;
    o.num_buffers = 2;
    o.layers_per_piece = 1;
    pipeline = StagingPipeline::Create(layout, stream.ref(), o).value();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const std::vector<int64_t> ids = {5, 2, 0};
    std::vector<std::string> saved(ids.size());
    auto t = pipeline->StartSave(
        on1, ids, [&](size_t i, uint64_t, absl::Span<const char> b) {
          saved[i].append(b.data(), b.size());
          return absl::OkStatus();
        });
    ASSERT_OK(t);
    ASSERT_OK((*t)->Wait());
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_TRUE(SameBytes(saved[i], host.ExpectedObject(ids[i])));
    }
    auto refused = pipeline->StartSave(
        on0, ids, [&](size_t, uint64_t, absl::Span<const char>) {
          return absl::OkStatus();
        });
    EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
    if (!refused.ok()) {
      EXPECT_THAT(std::string(refused.status().message()),
                  ::testing::HasSubstr("memory of device 0, not of the "
                                       "current device 1"))
          << refused.status();
    }
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0) << "StartSave changed the caller's device";
    pipeline.reset();
  }
  for (void* p : owned) (void)cudaFree(p);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// More than kLaunchMaxLayers (64) layers per piece: each piece takes two
// launches, and its event must follow both. A launch failing on the
// second launch of a piece (the first already enqueued) ends the transfer
// with nothing left running.
TEST(StagingMultiLaunch, PiecesOfTwoLaunchesRoundTripAndFailCleanly) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashInferHnd, 70, 2, 1,
                                        8, KvDtype::kFloat16)
                              .value();
  TestCache cache(layout, 8);
  std::mt19937_64 rng(70);
  cache.FillRandom(rng);
  const std::vector<int64_t> ids = {7, 1, 4, 0, 6};
  OwnStream stream(false);
  StagingOptions o;
  o.num_buffers = 2;
  o.layers_per_piece = 0;  // whole objects: 70 layers, two launches each
  auto pipeline = StagingPipeline::Create(layout, stream.ref(), o).value();
  for (int round = 0; round < 4; ++round) {
    std::vector<std::string> saved(ids.size());
    const uint64_t before = fake_cuda::KernelLaunches();
    ASSERT_OK(
        pipeline
            ->StartSave(cache.view(), ids,
                        [&](size_t i, uint64_t, absl::Span<const char> b) {
                          saved[i].append(b.data(), b.size());
                          return absl::OkStatus();
                        })
            .value()
            ->Wait());
    EXPECT_EQ(fake_cuda::KernelLaunches() - before, 2 * ids.size());
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE(SameBytes(saved[i], cache.ExpectedObject(ids[i])));
    }
    TestCache restored(layout, 8);
    ASSERT_OK(pipeline
                  ->StartLoad(restored.view(), ids,
                              [&](size_t i, uint64_t off, absl::Span<char> d) {
                                std::memcpy(d.data(), saved[i].data() + off,
                                            d.size());
                                return absl::OkStatus();
                              })
                  .value()
                  ->Wait());
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
    for (int64_t id : ids) {
      ASSERT_TRUE(
          SameBytes(restored.ExpectedObject(id), cache.ExpectedObject(id)));
    }
  }
  for (int second_of_piece = 0; second_of_piece < 5; ++second_of_piece) {
    fake_cuda::FailLaunchAfter(2 * second_of_piece + 1);
    TestCache target(layout, 8);
    const absl::Status s =
        pipeline
            ->StartLoad(target.view(), ids,
                        [&](size_t, uint64_t, absl::Span<char> d) {
                          std::memset(d.data(), 7, d.size());
                          return absl::OkStatus();
                        })
            .value()
            ->Wait();
    fake_cuda::FailLaunchAfter(-1);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal)) << s;
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
    const std::string snapshot = target.Snapshot();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_TRUE(target.Snapshot() == snapshot);
  }
}

INSTANTIATE_TEST_SUITE_P(Rings, FailureStress, ::testing::Values(2, 3, 4));

// Several transfers queued at once on one pipeline (the events are reused
// across transfers): each sees its own bytes.
TEST(StagingQueueStress, QueuedTransfersReuseTheEvents) {
  const KvLayout layout = Small();
  std::mt19937_64 rng(7);
  TestCache cache(layout, 16);
  cache.FillRandom(rng);
  OwnStream stream(false);
  StagingOptions o;
  o.num_buffers = 3;
  o.layers_per_piece = 1;
  auto pipeline = StagingPipeline::Create(layout, stream.ref(), o).value();
  constexpr int kTransfers = 8;
  std::vector<std::vector<std::string>> saved(kTransfers);
  std::vector<std::vector<int64_t>> ids(kTransfers);
  std::vector<std::unique_ptr<PendingTransfer>> ts;
  for (int k = 0; k < kTransfers; ++k) {
    ids[k] = {static_cast<int64_t>(rng() % 16),
              static_cast<int64_t>(rng() % 16),
              static_cast<int64_t>(rng() % 16)};
    saved[k].resize(3);
    ts.push_back(pipeline
                     ->StartSave(cache.view(), ids[k],
                                 [&saved, k](size_t i, uint64_t,
                                             absl::Span<const char> b) {
                                   saved[k][i].append(b.data(), b.size());
                                   return absl::OkStatus();
                                 })
                     .value());
  }
  for (int k = 0; k < kTransfers; ++k) {
    ASSERT_OK(ts[k]->Wait());
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(SameBytes(saved[k][i], cache.ExpectedObject(ids[k][i])))
          << "transfer " << k << " object " << i;
    }
  }
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
}

// Pieces of several blocks (StagingOptions::blocks_per_piece): a short
// last chunk, pieces of more blocks than one launch takes (192), both
// orders (object-major with whole objects only). Save, then load back with
// each layer checked as WaitForLayer returns; then a launch failure and a
// send failure, after which nothing of the transfer is left on the stream.
using BlocksParam =
    std::tuple<int /*blocks/piece*/, int /*ring*/, int /*layers/piece*/,
               int /*blocks*/, PieceOrder>;

class StagingBlocksPerPiece : public ::testing::TestWithParam<BlocksParam> {};

TEST_P(StagingBlocksPerPiece, RoundTripsAndFailsCleanly) {
  const auto [per_piece, ring, layers_per_piece, num_ids, order] = GetParam();
  if (order == PieceOrder::kObjectMajor && layers_per_piece != 0) {
    GTEST_SKIP() << "object-major pieces of several blocks are whole objects";
  }
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnHnd, 5, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  constexpr int kBlocks = 260;
  TestCache cache(layout, kBlocks);
  std::mt19937_64 rng(per_piece * 1000 + ring * 100 + layers_per_piece * 10 +
                      num_ids);
  cache.FillRandom(rng);
  std::vector<int64_t> ids(kBlocks);
  for (int i = 0; i < kBlocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(num_ids);
  OwnStream stream(/*legacy=*/false);
  StagingOptions o;
  o.num_buffers = ring;
  o.layers_per_piece = layers_per_piece;
  o.blocks_per_piece = per_piece;
  o.order = order;
  auto pipeline = StagingPipeline::Create(layout, stream.ref(), o).value();

  std::vector<std::string> saved(ids.size());
  ASSERT_OK(
      pipeline
          ->StartSave(cache.view(), ids,
                      [&](size_t i, uint64_t offset, absl::Span<const char> b) {
                        RandomPause(rng);
                        if (offset != saved[i].size()) {
                          return absl::InternalError("out of order");
                        }
                        saved[i].append(b.data(), b.size());
                        return absl::OkStatus();
                      })
          .value()
          ->Wait());
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(SameBytes(saved[i], cache.ExpectedObject(ids[i])))
        << "object " << i;
  }
  TestCache back(layout, kBlocks);
  auto load =
      pipeline
          ->StartLoad(back.view(), ids,
                      [&](size_t i, uint64_t offset, absl::Span<char> d) {
                        std::memcpy(d.data(), saved[i].data() + offset,
                                    d.size());
                        return absl::OkStatus();
                      })
          .value();
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSERT_OK(load->WaitForLayer(l));
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE(SameBytes(back.ExpectedObject(ids[i], LayerRange{l, l + 1}),
                            cache.ExpectedObject(ids[i], LayerRange{l, l + 1})))
          << "layer " << l << " of object " << i;
    }
  }
  ASSERT_OK(load->Wait());
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);

  fake_cuda::FailLaunchAfter(static_cast<int>(rng() % 3));
  const absl::Status launch_failed =
      pipeline
          ->StartSave(cache.view(), ids,
                      [](size_t, uint64_t, absl::Span<const char>) {
                        return absl::OkStatus();
                      })
          .value()
          ->Wait();
  fake_cuda::FailLaunchAfter(-1);
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u) << launch_failed;
  std::atomic<int> calls{0};
  const absl::Status send_failed =
      pipeline
          ->StartSave(cache.view(), ids,
                      [&](size_t, uint64_t, absl::Span<const char>) {
                        return ++calls == 2 ? absl::UnavailableError("down")
                                            : absl::OkStatus();
                      })
          .value()
          ->Wait();
  const int groups =
      layers_per_piece == 0 ? 1 : (5 + layers_per_piece - 1) / layers_per_piece;
  if (num_ids * groups >= 2) {
    EXPECT_THAT(send_failed, StatusIs(absl::StatusCode::kUnavailable));
  } else {
    EXPECT_OK(send_failed);
  }
  EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, StagingBlocksPerPiece,
    ::testing::Combine(::testing::Values(2, 3, 200), ::testing::Values(2, 3),
                       ::testing::Values(1, 0), ::testing::Values(7, 250),
                       ::testing::Values(PieceOrder::kLayerMajor,
                                         PieceOrder::kObjectMajor)));

// Every fake stream paused (fake_cuda::PauseStreams) until Resume() or the
// end of the scope. Declare it after anything whose destructor waits for a
// stream (a PendingTransfer, a stream), so that it resumes first.
class PausedStreams {
 public:
  PausedStreams() { fake_cuda::PauseStreams(true); }
  ~PausedStreams() { Resume(); }
  PausedStreams(const PausedStreams&) = delete;
  PausedStreams& operator=(const PausedStreams&) = delete;
  void Resume() { fake_cuda::PauseStreams(false); }
};

// Enqueues on `stream` an item that occupies its worker for `ms`, standing
// for an earlier long copy: the pipeline's copies enqueued after it run
// well after work on another stream that does not wait for them.
void HoldStream(cudaStream_t stream, int ms) {
  const char unused = 0;
  ASSERT_EQ(
      fake_cuda::EnqueueKernel(
          stream,
          [ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); },
          &unused, sizeof(unused)),
      cudaSuccess);
}

// One layer per piece, every block in it: piece l is layer l's only piece.
std::unique_ptr<StagingPipeline> LayerPerPiecePipeline(const KvLayout& layout,
                                                       const OwnStream& stream,
                                                       size_t blocks) {
  StagingOptions o;
  o.num_buffers = 2;
  o.layers_per_piece = 1;
  o.blocks_per_piece = static_cast<int>(blocks);
  return StagingPipeline::Create(layout, stream.ref(), o).value();
}

std::vector<std::string> ObjectsOf(const TestCache& cache,
                                   const std::vector<int64_t>& ids) {
  std::vector<std::string> objects;
  for (int64_t id : ids) objects.push_back(cache.ExpectedObject(id));
  return objects;
}

// WaitForLayerOn returns once layer 0's scatter is enqueued, before any of
// it has run (the streams are paused), and the engine's copy of layer 0
// enqueued after it on another stream then reads the loaded bytes, although
// the pipeline's stream runs late (held 50 ms).
TEST(StagingLayerEvents, WaitForLayerOnOrdersTheEnginesStreamOnTheDevice) {
  const KvLayout layout = Small();  // per-layer tensors: tensor 0 is layer 0
  constexpr int64_t kBlocks = 8;
  TestCache source_cache(layout, kBlocks);
  std::mt19937_64 rng(81);
  source_cache.FillRandom(rng);
  const std::vector<int64_t> ids = {6, 1, 4, 3};
  const std::vector<std::string> objects = ObjectsOf(source_cache, ids);
  OwnStream stream(/*legacy=*/false);
  OwnStream engine(/*legacy=*/false);
  auto pipeline = LayerPerPiecePipeline(layout, stream, ids.size());
  TestCache restored(layout, kBlocks);  // zeroed
  TestCache snapshot(layout, kBlocks);  // layer 0 as the engine read it

  std::unique_ptr<PendingTransfer> load;
  PausedStreams paused;
  HoldStream(stream.native(), 50);
  load = pipeline
             ->StartLoad(restored.view(), ids,
                         [&](size_t i, uint64_t offset, absl::Span<char> d) {
                           std::memcpy(d.data(), objects[i].data() + offset,
                                       d.size());
                           return absl::OkStatus();
                         })
             .value();
  ASSERT_OK(load->WaitForLayerOn(0, engine.ref()));
  EXPECT_FALSE(load->IsLayerDone(0))
      << "the streams are paused: nothing can have been scattered";
  ASSERT_EQ(cudaMemcpyAsync(snapshot.tensor(0), restored.tensor(0),
                            restored.tensor_bytes(), cudaMemcpyDefault,
                            engine.native()),
            cudaSuccess);
  paused.Resume();
  ASSERT_OK(SynchronizeStream(engine.ref()));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(SameBytes(snapshot.ExpectedObject(ids[i], LayerRange{0, 1}),
                          objects[i].substr(0, layout.layer_bytes())))
        << "layer 0 of block " << ids[i]
        << " read by the engine's stream before the scatter ran";
  }
  ASSERT_OK(load->Wait());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(SameBytes(restored.ExpectedObject(ids[i]), objects[i]));
  }
}

// A load whose source fails at layer 1's piece (after layer 0's copies were
// enqueued): layer 0 still orders the engine's stream (OK); layers 1.. answer
// the error, and only once the transfer is done, while its stream is still
// busy (held) when the source fails.
TEST(StagingLayerEvents, WaitForLayerOnAFailedLoadAnswersOnceDone) {
  const KvLayout layout = Small();
  constexpr int64_t kBlocks = 8;
  TestCache source_cache(layout, kBlocks);
  std::mt19937_64 rng(82);
  source_cache.FillRandom(rng);
  const std::vector<int64_t> ids = {2, 7, 0};
  const std::vector<std::string> objects = ObjectsOf(source_cache, ids);
  OwnStream stream(/*legacy=*/false);
  OwnStream engine(/*legacy=*/false);
  auto pipeline = LayerPerPiecePipeline(layout, stream, ids.size());
  TestCache restored(layout, kBlocks);
  TestCache snapshot(layout, kBlocks);

  // Layer 1's piece fails only once layer 0's copies are enqueued (else the
  // device stage could see the failure first and launch nothing).
  absl::Notification fail_now;
  HoldStream(stream.native(), 30);
  auto load =
      pipeline
          ->StartLoad(restored.view(), ids,
                      [&](size_t i, uint64_t offset,
                          absl::Span<char> d) -> absl::Status {
                        if (offset == layout.layer_bytes()) {
                          fail_now.WaitForNotification();
                          return absl::UnavailableError("link down");
                        }
                        std::memcpy(d.data(), objects[i].data() + offset,
                                    d.size());
                        return absl::OkStatus();
                      })
          .value();
  const absl::Status layer0 = load->WaitForLayerOn(0, engine.ref());
  fail_now.Notify();
  ASSERT_OK(layer0);
  ASSERT_EQ(cudaMemcpyAsync(snapshot.tensor(0), restored.tensor(0),
                            restored.tensor_bytes(), cudaMemcpyDefault,
                            engine.native()),
            cudaSuccess);
  for (int l = 1; l < layout.num_layers(); ++l) {
    EXPECT_THAT(load->WaitForLayerOn(l, engine.ref()),
                StatusIs(absl::StatusCode::kUnavailable))
        << "layer " << l;
    EXPECT_TRUE(load->IsDone()) << "a failed layer answered before the end";
    EXPECT_EQ(fake_cuda::PendingWork(stream.native()), 0u);
  }
  ASSERT_OK(SynchronizeStream(engine.ref()));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(SameBytes(snapshot.ExpectedObject(ids[i], LayerRange{0, 1}),
                          objects[i].substr(0, layout.layer_bytes())))
        << "layer 0 of block " << ids[i];
  }
  EXPECT_THAT(load->Wait(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_OK(load->WaitForLayerOn(0, engine.ref()));
  const auto kInvalid = StatusIs(absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(load->WaitForLayerOn(-1, engine.ref()), kInvalid);
  EXPECT_THAT(load->WaitForLayerOn(layout.num_layers(), engine.ref()),
              kInvalid);
}

// A save: once WaitForLayerOn(0) returns (before the gather has run), the
// engine may overwrite layer 0 on its own stream; the save still sends the
// bytes from before the overwrite.
TEST(StagingLayerEvents, WaitForLayerOnLetsTheEngineOverwriteASavedLayer) {
  const KvLayout layout = Small();
  constexpr int64_t kBlocks = 8;
  TestCache cache(layout, kBlocks);
  std::mt19937_64 rng(83);
  cache.FillRandom(rng);
  const std::vector<int64_t> ids = {5, 0, 7, 2};
  const std::vector<std::string> objects = ObjectsOf(cache, ids);
  OwnStream stream(/*legacy=*/false);
  OwnStream engine(/*legacy=*/false);
  auto pipeline = LayerPerPiecePipeline(layout, stream, ids.size());
  std::vector<std::string> saved(ids.size());

  std::unique_ptr<PendingTransfer> save;
  PausedStreams paused;
  HoldStream(stream.native(), 50);
  save = pipeline
             ->StartSave(cache.view(), ids,
                         [&](size_t i, uint64_t, absl::Span<const char> b) {
                           saved[i].append(b.data(), b.size());
                           return absl::OkStatus();
                         })
             .value();
  ASSERT_OK(save->WaitForLayerOn(0, engine.ref()));
  EXPECT_FALSE(save->IsLayerDone(0))
      << "the streams are paused: nothing can have been gathered";
  ASSERT_EQ(cudaMemsetAsync(cache.tensor(0), 0x5a, cache.tensor_bytes(),
                            engine.native()),
            cudaSuccess);
  paused.Resume();
  ASSERT_OK(save->Wait());
  ASSERT_OK(SynchronizeStream(engine.ref()));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(SameBytes(saved[i], objects[i]))
        << "object " << i << " saved after the engine overwrote layer 0";
    EXPECT_TRUE(SameBytes(cache.ExpectedObject(ids[i], LayerRange{0, 1}),
                          std::string(layout.layer_bytes(), 0x5a)));
  }
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  int rc = RUN_ALL_TESTS();
  // The harness itself: the fake's work really was asynchronous, so that
  // the pipeline's events were seen incomplete.
  std::printf(
      "fake runtime: %llu kernels launched, %llu work items run, %llu "
      "event queries answered NotReady\n",
      static_cast<unsigned long long>(fake_cuda::KernelLaunches()),
      static_cast<unsigned long long>(fake_cuda::ExecutedWork()),
      static_cast<unsigned long long>(fake_cuda::NotReadyQueries()));
  if (fake_cuda::KernelLaunches() > 0 && fake_cuda::NotReadyQueries() == 0) {
    std::printf("HARNESS FAILURE: no event was ever seen incomplete\n");
    rc = 1;
  }
  return rc;
}
