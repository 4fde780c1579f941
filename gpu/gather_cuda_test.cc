// gather_cuda_test: gather_test.cc and staging_test.cc linked against
// kvdepot_gpu_cuda, plus the cases only a device has (device memory, its
// own streams, pageable pointers). Exits 77 -- ctest's SKIP_RETURN_CODE --
// when there is no usable CUDA device.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/device_memory.h"
#include "gpu/gather.h"
#include "gpu/internal/test_cache.h"
#include "gpu/staging.h"
#include "tests/status_matchers.h"

namespace kvdepot {
namespace {

using gpu_testing::FilledBuffer;
using gpu_testing::TestCache;
using ::kvdepot::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device memory freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&data_, bytes) != cudaSuccess) data_ = nullptr;
  }
  ~DeviceBuffer() { (void)cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data() const { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
};

// Pageable host memory, page-aligned (so that registering a whole number
// of pages registers exactly those), filled with `fill`.
class PageableBuffer {
 public:
  static constexpr size_t kPage = 4096;
  PageableBuffer(size_t pages, char fill)
      : data_(static_cast<char*>(std::aligned_alloc(kPage, pages * kPage))),
        size_(pages * kPage) {
    if (data_ != nullptr) std::memset(data_, fill, size_);
  }
  ~PageableBuffer() { std::free(data_); }
  PageableBuffer(const PageableBuffer&) = delete;
  PageableBuffer& operator=(const PageableBuffer&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }
  std::string bytes() const { return std::string(data_, size_); }

 private:
  char* data_;
  size_t size_;
};

class CudaStream {
 public:
  CudaStream() { (void)cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  ~CudaStream() { (void)cudaStreamDestroy(s_); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  StreamRef ref() const { return StreamRef{s_}; }

 private:
  cudaStream_t s_ = nullptr;
};

// A paged cache in device memory, as an engine has it: one buffer per
// tensor of `layout`, `blocks` blocks each, copied from `host` (of the same
// shape) when given, else zeroed.
struct DeviceCache {
  std::vector<std::unique_ptr<DeviceBuffer>> tensors;
  KvCacheView view;
};
void MakeDeviceCache(const KvLayout& layout, int64_t blocks,
                     const TestCache* host, DeviceCache* out) {
  const uint64_t bytes = layout.TensorBytes(blocks).value();
  out->view.num_blocks = blocks;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    out->tensors.push_back(std::make_unique<DeviceBuffer>(bytes));
    char* tensor = out->tensors.back()->data();
    ASSERT_NE(tensor, nullptr);
    if (host != nullptr) {
      ASSERT_CUDA(
          cudaMemcpy(tensor, host->tensor(i), bytes, cudaMemcpyHostToDevice));
    } else {
      ASSERT_CUDA(cudaMemset(tensor, 0, bytes));
    }
    out->view.tensors.push_back(tensor);
  }
}

TEST(GatherCudaTest, LinksTheCudaImplementation) {
  EXPECT_EQ(GpuBackendName(), "cuda");
}

// The host TestCache is the reference; its tensors are copied to device
// memory, gathered there into device objects on a stream of our own, and
// scattered back into a zeroed device cache.
TEST(GatherCudaTest, RoundTripsThroughDeviceMemory) {
  for (KvCacheLayout kind :
       {KvCacheLayout::kFlashAttnHnd, KvCacheLayout::kCrossLayerNhd}) {
    const KvLayout layout =
        KvLayout::Mha(kind, 4, 16, 4, 64, KvDtype::kBFloat16).value();
    SCOPED_TRACE(layout.DebugString());
    const int64_t num_blocks = 10;
    TestCache host(layout, num_blocks);
    std::mt19937_64 rng(5);
    host.FillRandom(rng);
    const size_t tensor_bytes = host.tensor_bytes();
    std::vector<std::unique_ptr<DeviceBuffer>> tensors, restored;
    KvCacheView view, restored_view;
    view.num_blocks = restored_view.num_blocks = num_blocks;
    for (int i = 0; i < host.num_tensors(); ++i) {
      tensors.push_back(std::make_unique<DeviceBuffer>(tensor_bytes));
      restored.push_back(std::make_unique<DeviceBuffer>(tensor_bytes));
      ASSERT_NE(tensors.back()->data(), nullptr);
      ASSERT_NE(restored.back()->data(), nullptr);
      ASSERT_CUDA(cudaMemcpy(tensors.back()->data(), host.tensor(i),
                             tensor_bytes, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemset(restored.back()->data(), 0, tensor_bytes));
      view.tensors.push_back(tensors.back()->data());
      restored_view.tensors.push_back(restored.back()->data());
    }
    const std::vector<int64_t> ids = {9, 2, 2, 5};
    const std::vector<int64_t> distinct = {9, 2, 5};
    DeviceBuffer objects(ids.size() * layout.object_bytes());
    std::vector<void*> dst;
    for (size_t i = 0; i < ids.size(); ++i) {
      dst.push_back(objects.data() + i * layout.object_bytes());
    }
    CudaStream stream;
    ASSERT_OK(Gather(layout, view, ids, layout.AllLayers(), dst, stream.ref()));
    ASSERT_OK(SynchronizeStream(stream.ref()));
    std::string got(ids.size() * layout.object_bytes(), '\0');
    ASSERT_CUDA(cudaMemcpy(got.data(), objects.data(), got.size(),
                           cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_TRUE(got.compare(i * layout.object_bytes(), layout.object_bytes(),
                              host.ExpectedObject(ids[i])) == 0)
          << "object " << i;
    }

    const std::vector<const void*> src = {dst[0], dst[1], dst[3]};
    ASSERT_OK(Scatter(layout, restored_view, distinct, layout.AllLayers(), src,
                      stream.ref()));
    ASSERT_OK(SynchronizeStream(stream.ref()));
    TestCache back(layout, num_blocks);
    for (int i = 0; i < host.num_tensors(); ++i) {
      ASSERT_CUDA(cudaMemcpy(back.tensor(i), restored[i]->data(), tensor_bytes,
                             cudaMemcpyDeviceToHost));
    }
    const std::string zeros(layout.object_bytes(), '\0');
    for (int64_t b = 0; b < num_blocks; ++b) {
      const bool moved = b == 9 || b == 2 || b == 5;
      EXPECT_EQ(back.ExpectedObject(b), moved ? host.ExpectedObject(b) : zeros)
          << "block " << b;
    }
  }
}

TEST(GatherCudaTest, RejectsPageableMemoryTheDeviceCannotRead) {
  int device = 0, pageable = 0;
  ASSERT_CUDA(cudaGetDevice(&device));
  ASSERT_CUDA(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess,
                                     device));
  if (pageable != 0) GTEST_SKIP() << "this device reads pageable memory";
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 2, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  TestCache cache(layout, 2);
  std::vector<char> pageable_object(layout.object_bytes(), 'x');
  const int64_t id = 1;
  void* dst[] = {pageable_object.data()};
  EXPECT_THAT(Gather(layout, cache.view(), absl::MakeConstSpan(&id, 1),
                     layout.AllLayers(), dst, StreamRef{}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(pageable_object, std::vector<char>(layout.object_bytes(), 'x'));
}

// Pageable memory registered with RegisterHostMemory (as the Python shim
// registers UCX staging buffers) is accepted and gathered into and
// scattered from correctly; registration twice, and unregistering what is
// not registered, are reported.
TEST(GatherCudaTest, RegisteredPageableMemoryRoundTrips) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashInferHnd, 3, 5, 2,
                                        24, KvDtype::kBFloat16)
                              .value();
  std::mt19937_64 rng(17);
  TestCache cache(layout, 6);
  cache.FillRandom(rng);
  const std::vector<int64_t> ids = {5, 2, 5};
  const size_t bytes = layout.object_bytes();
  std::vector<char> pool(ids.size() * bytes, 'x');  // pageable
  std::vector<void*> dst;
  for (size_t i = 0; i < ids.size(); ++i) dst.push_back(pool.data() + i * bytes);

  ASSERT_OK(RegisterHostMemory(pool.data(), pool.size()));
  EXPECT_THAT(RegisterHostMemory(pool.data(), pool.size()),
              StatusIs(absl::StatusCode::kAlreadyExists));
  // The refused registration's error is returned, not left behind for the
  // next cudaGetLastError(): the launch below once reported it as its own
  // and failed, with the kernel enqueued anyway.
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  ASSERT_OK(Gather(layout, cache.view(), ids, layout.AllLayers(), dst,
                   StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(std::string(pool.data() + i * bytes, bytes),
              cache.ExpectedObject(ids[i]))
        << "object " << i;
  }
  TestCache restored(layout, 6);
  const std::vector<int64_t> to = {0, 3};
  const std::vector<const void*> src = {dst[0], dst[1]};
  ASSERT_OK(Scatter(layout, restored.view(), to, layout.AllLayers(), src,
                    StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_EQ(restored.ExpectedObject(0), cache.ExpectedObject(5));
  EXPECT_EQ(restored.ExpectedObject(3), cache.ExpectedObject(2));
  EXPECT_EQ(restored.ExpectedObject(1), std::string(bytes, '\0'));

  ASSERT_OK(UnregisterHostMemory(pool.data()));
  EXPECT_THAT(UnregisterHostMemory(pool.data()),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  EXPECT_THAT(RegisterHostMemory(nullptr, 64),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(RegisterHostMemory(pool.data(), 0),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Every failure the API returns is cleared from the thread's last-error
// state, where the engine's next cudaGetLastError() (PyTorch's check after
// each of its launches) would take it for its own.
TEST(GatherCudaTest, ReturnedFailuresLeaveNoErrorBehind) {
  (void)cudaGetLastError();  // start clean
  int devices = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&devices));
  EXPECT_THAT(SetCurrentDevice(devices),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "after SetCurrentDevice";
  HostBuffer pinned = AllocateHostBuffer(4096).value();
  EXPECT_THAT(RegisterHostMemory(pinned.data(), pinned.size()),
              StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "after RegisterHostMemory";
  EXPECT_THAT(UnregisterHostMemory(pinned.data()),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "after UnregisterHostMemory";
}

// A non-sticky error that someone else left on this thread (here: a raw
// cudaSetDevice to a device that does not exist) does not make a good
// launch report failure: the launch's own result is checked. Gather and
// Scatter succeed and are bit-exact.
TEST(GatherCudaTest, AStaleErrorOfAnEarlierCallDoesNotFailTheLaunch) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 2, 8, 2,
                                        32, KvDtype::kFloat16)
                              .value();
  std::mt19937_64 rng(23);
  TestCache cache(layout, 4);
  cache.FillRandom(rng);
  const std::vector<int64_t> ids = {3, 0};
  const size_t bytes = layout.object_bytes();
  HostBuffer objects = FilledBuffer(ids.size() * bytes, 'x');
  std::vector<void*> dst = {objects.data(), objects.data() + bytes};
  int devices = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&devices));

  ASSERT_NE(cudaSetDevice(devices), cudaSuccess);
  ASSERT_NE(cudaPeekAtLastError(), cudaSuccess) << "no stale error to test";
  ASSERT_OK(
      Gather(layout, cache.view(), ids, layout.AllLayers(), dst, StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(std::string(objects.data() + i * bytes, bytes),
              cache.ExpectedObject(ids[i]))
        << "object " << i;
  }

  ASSERT_NE(cudaSetDevice(devices), cudaSuccess);
  TestCache restored(layout, 4);
  const std::vector<const void*> src = {dst[0], dst[1]};
  const std::vector<int64_t> to = {1, 2};
  ASSERT_OK(Scatter(layout, restored.view(), to, layout.AllLayers(), src,
                    StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_EQ(restored.ExpectedObject(1), cache.ExpectedObject(3));
  EXPECT_EQ(restored.ExpectedObject(2), cache.ExpectedObject(0));
  EXPECT_EQ(restored.ExpectedObject(0), std::string(bytes, '\0'));
  (void)cudaGetLastError();  // the stale error is ours to clear here
}

// A buffer that starts in registered memory but runs past its end would
// fault in the kernel: its last byte is checked too, and the call refused
// before anything is enqueued. Also where the device reads pageable memory
// (ctest runs these under the fake's FAKE_CUDA_PAGEABLE=1 too): past a
// registration or allocation lies memory of another kind, unmapped as
// often as not.
TEST(GatherCudaTest, RefusesBuffersThatRunPastTheirRegisteredMemory) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashInferHnd, 3, 5, 2,
                                        24, KvDtype::kBFloat16)
                              .value();
  const size_t bytes = layout.object_bytes();  // 2880
  ASSERT_GT(bytes, 1024u);
  std::mt19937_64 rng(29);
  TestCache cache(layout, 4);
  cache.FillRandom(rng);
  const std::string cache_before = cache.Snapshot();
  // Four pages; the first two registered. Object 0 lies in them, object 1
  // starts 1 KiB before their end and runs on into page 2.
  PageableBuffer pool(4, 'x');
  ASSERT_NE(pool.data(), nullptr);
  const size_t registered = 2 * PageableBuffer::kPage;
  ASSERT_OK(RegisterHostMemory(pool.data(), registered));
  const std::string pool_before = pool.bytes();
  const std::vector<int64_t> ids = {1, 2};
  std::vector<void*> dst = {pool.data(), pool.data() + registered - 1024};

  const absl::Status gather =
      Gather(layout, cache.view(), ids, layout.AllLayers(), dst, StreamRef{});
  EXPECT_THAT(gather, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(gather.message()),
              AllOf(HasSubstr("object buffer 1 (2880 bytes) runs past the end "
                              "of its memory: its last byte is pageable"),
                    HasSubstr("RegisterHostMemory")))
      << gather;
  const std::vector<const void*> src = {dst[0], dst[1]};
  EXPECT_THAT(
      Scatter(layout, cache.view(), ids, layout.AllLayers(), src, StreamRef{}),
      StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_TRUE(pool.bytes() == pool_before) << "a refused gather wrote";
  EXPECT_TRUE(cache.Snapshot() == cache_before) << "a refused scatter wrote";

  // The check covers the bytes the call moves: one layer (960 bytes) at
  // the same address fits in the registered pages and is gathered.
  ASSERT_OK(
      Gather(layout, cache.view(), ids, LayerRange{0, 1}, dst, StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_EQ(std::string(static_cast<const char*>(dst[1]), layout.layer_bytes()),
            cache.ExpectedObject(2, LayerRange{0, 1}));
  ASSERT_OK(UnregisterHostMemory(pool.data()));
}

// The same for a cache tensor: a view claiming more blocks than the
// registered memory holds is refused; one that fits is gathered.
TEST(GatherCudaTest, RefusesCacheTensorsThatRunPastTheirRegisteredMemory) {
  // Cross-layer NHD: block b is bytes [b, b + 1) x object_bytes (1 KiB) of
  // the one tensor, in object order.
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kCrossLayerNhd, 2, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  const size_t bytes = layout.object_bytes();
  ASSERT_EQ(bytes, 1024u);
  PageableBuffer tensor(4, 'x');
  ASSERT_NE(tensor.data(), nullptr);
  std::mt19937_64 rng(31);
  for (size_t i = 0; i < tensor.size(); ++i) {
    tensor.data()[i] = static_cast<char>(rng());
  }
  ASSERT_OK(RegisterHostMemory(tensor.data(), 2 * PageableBuffer::kPage));
  HostBuffer object = FilledBuffer(bytes, 'o');
  const int64_t id = 7;
  void* dst[] = {object.data()};

  KvCacheView too_big;
  too_big.tensors = {tensor.data()};
  too_big.num_blocks = 12;  // 12 KiB: past the 8 registered
  const absl::Status s = Gather(layout, too_big, absl::MakeConstSpan(&id, 1),
                                layout.AllLayers(), dst, StreamRef{});
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("cache tensor 0 (12288 bytes) runs past "
                        "the end of its memory"))
      << s;
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_EQ(std::string(object.data(), bytes), std::string(bytes, 'o'));

  KvCacheView fits = too_big;
  fits.num_blocks = 8;
  ASSERT_OK(Gather(layout, fits, absl::MakeConstSpan(&id, 1),
                   layout.AllLayers(), dst, StreamRef{}));
  ASSERT_OK(SynchronizeStream(StreamRef{}));
  EXPECT_EQ(std::string(object.data(), bytes),
            std::string(tensor.data() + id * bytes, bytes));
  ASSERT_OK(UnregisterHostMemory(tensor.data()));
}

// Memory of another device faults the kernel unless peer access is on; it
// is refused. Needs two devices.
TEST(GatherCudaTest, RefusesMemoryOfAnotherDevice) {
  int devices = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs two devices";
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 2, 4, 2,
                                        16, KvDtype::kFloat16)
                              .value();
  TestCache cache(layout, 2);
  ASSERT_CUDA(cudaSetDevice(1));
  DeviceBuffer other(layout.object_bytes());
  ASSERT_CUDA(cudaSetDevice(0));
  ASSERT_NE(other.data(), nullptr);
  const int64_t id = 1;
  void* dst[] = {other.data()};
  const absl::Status s =
      Gather(layout, cache.view(), absl::MakeConstSpan(&id, 1),
             layout.AllLayers(), dst, StreamRef{});
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("object buffer 0 is memory of device 1, "
                        "not of the current device 0"))
      << s;
}

TEST(GatherCudaTest, StagingSavesFromDeviceMemoryOnItsOwnStream) {
  const KvLayout layout =
      KvLayout::Mla(KvCacheLayout::kMla, 3, 16, 576, KvDtype::kBFloat16)
          .value();
  TestCache host(layout, 4);
  std::mt19937_64 rng(9);
  host.FillRandom(rng);
  DeviceCache cache;
  ASSERT_NO_FATAL_FAILURE(MakeDeviceCache(layout, 4, &host, &cache));
  const KvCacheView& view = cache.view;
  CudaStream stream;
  StagingOptions options;
  options.layers_per_piece = 1;
  auto pipeline =
      StagingPipeline::Create(layout, stream.ref(), options).value();
  std::vector<std::string> saved(2);
  const std::vector<int64_t> ids = {3, 1};
  auto transfer =
      pipeline
          ->StartSave(view, ids,
                      [&saved](size_t i, uint64_t, absl::Span<const char> b) {
                        saved[i].append(b.data(), b.size());
                        return absl::OkStatus();
                      })
          .value();
  ASSERT_OK(transfer->Wait());
  EXPECT_EQ(saved[0], host.ExpectedObject(3));
  EXPECT_EQ(saved[1], host.ExpectedObject(1));
}

// A load on the pipeline's own stream, one layer per piece, through a ring
// of two: once WaitForLayer(l) returns, layer l of every block is in device
// memory, as another stream (which nothing orders after the pipeline's)
// reads it. The pieces of later layers are meanwhile still being scattered
// or received.
TEST(GatherCudaTest, StagingLoadsIntoDeviceMemoryLayerByLayer) {
  const KvLayout layout = KvLayout::Mha(KvCacheLayout::kFlashAttnNhd, 6, 16, 8,
                                        128, KvDtype::kFloat16)
                              .value();
  constexpr int kBlocks = 8;
  TestCache src(layout, kBlocks);
  std::mt19937_64 rng(11);
  src.FillRandom(rng);
  DeviceCache cache;
  ASSERT_NO_FATAL_FAILURE(MakeDeviceCache(layout, kBlocks, nullptr, &cache));
  const KvCacheView& view = cache.view;
  CudaStream stream;
  StagingOptions options;
  options.num_buffers = 2;
  options.layers_per_piece = 1;
  auto pipeline =
      StagingPipeline::Create(layout, stream.ref(), options).value();
  const std::vector<int64_t> ids = {5, 0, 7, 2, 3, 6, 1, 4};
  auto transfer =
      pipeline
          ->StartLoad(view, ids,
                      [&](size_t i, uint64_t offset, absl::Span<char> dst) {
                        const std::string object = src.ExpectedObject(ids[i]);
                        std::memcpy(dst.data(), object.data() + offset,
                                    dst.size());
                        return absl::OkStatus();
                      })
          .value();
  CudaStream reader;
  std::string layer(src.tensor_bytes(), '\0');
  for (int l = 0; l < layout.num_layers(); ++l) {
    ASSERT_OK(transfer->WaitForLayer(l));
    ASSERT_CUDA(
        cudaMemcpyAsync(layer.data(), cache.tensors[l]->data(), layer.size(),
                        cudaMemcpyDeviceToHost,
                        static_cast<cudaStream_t>(reader.ref().native)));
    ASSERT_CUDA(
        cudaStreamSynchronize(static_cast<cudaStream_t>(reader.ref().native)));
    EXPECT_EQ(std::memcmp(layer.data(), src.tensor(l), layer.size()), 0)
        << "layer " << l << " was not all there when WaitForLayer returned";
  }
  ASSERT_OK(transfer->Wait());
}

// A save whose sink fails while later pieces are still being gathered ends
// only once they have: when Wait returns, nothing of it is left on the
// pipeline's stream (the device stage runs up to the ring ahead, so pieces
// 1 to 3 are in flight when piece 0's send fails). Pieces of 48 MiB, so
// that they take a while even on a fast device. (Too heavy for the fake
// runtime of tests/gpu/fake_cuda, where staging_async_test covers failures
// at every piece instead.)
TEST(GatherCudaTest, AFailedStagingSaveLeavesNoWorkOnItsStream) {
#ifdef KVDEPOT_FAKE_CUDA
  GTEST_SKIP() << "covered by staging_fake_cuda_test";
#endif
  // 4 layers of 24 MiB per block: objects of 96 MiB.
  const KvLayout layout =
      KvLayout::Mla(KvCacheLayout::kMla, 4, 16384, 384, KvDtype::kFloat32)
          .value();
  constexpr int kBlocks = 6;
  DeviceCache cache;
  ASSERT_NO_FATAL_FAILURE(MakeDeviceCache(layout, kBlocks, nullptr, &cache));
  const KvCacheView& view = cache.view;
  CudaStream stream;
  StagingOptions options;
  options.num_buffers = 4;
  options.layers_per_piece = 2;
  auto pipeline =
      StagingPipeline::Create(layout, stream.ref(), options).value();
  const std::vector<int64_t> ids = {0, 1, 2, 3, 4, 5};
  auto transfer = pipeline
                      ->StartSave(view, ids,
                                  [](size_t, uint64_t, absl::Span<const char>) {
                                    return absl::UnavailableError("link down");
                                  })
                      .value();
  EXPECT_THAT(transfer->Wait(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(stream.ref().native)),
            cudaSuccess)
      << "gathers of the failed save were still running when it ended";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// An event marks the work enqueued before it: after Synchronize that work
// has finished, and the event says it is complete.
TEST(GatherCudaTest, DeviceEventsMarkTheWorkBeforeThem) {
  CudaStream stream;
  constexpr size_t kBytes = size_t{64} << 20;
  DeviceBuffer buffer(kBytes);
  ASSERT_NE(buffer.data(), nullptr);
  absl::StatusOr<DeviceEvent> event = DeviceEvent::Create();
  ASSERT_OK(event);
  absl::StatusOr<bool> complete = event->IsComplete();
  ASSERT_OK(complete);
  EXPECT_TRUE(*complete);  // never recorded
  const auto native = static_cast<cudaStream_t>(stream.ref().native);
  for (int i = 0; i < 8; ++i) {
    ASSERT_CUDA(cudaMemsetAsync(buffer.data(), i, kBytes, native));
  }
  ASSERT_OK(event->Record(stream.ref()));
  ASSERT_OK(event->Synchronize());
  EXPECT_EQ(cudaStreamQuery(native), cudaSuccess);  // nothing left before it
  complete = event->IsComplete();
  ASSERT_OK(complete);
  EXPECT_TRUE(*complete);
  char last = 0;
  ASSERT_CUDA(
      cudaMemcpy(&last, buffer.data() + kBytes - 1, 1, cudaMemcpyDeviceToHost));
  EXPECT_EQ(last, 7);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // nothing left behind
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("no usable CUDA device (%s): skipping\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 77;
  }
  ::testing::InitGoogleMock(&argc, argv);
  return RUN_ALL_TESTS();
}
