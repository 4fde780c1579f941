// gather_cuda_test: gather_test.cc and staging_test.cc linked against
// kvdepot_gpu_cuda, plus the cases only a device has (device memory, its
// own streams, pageable pointers). Exits 77 -- ctest's SKIP_RETURN_CODE --
// when there is no usable CUDA device.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
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

using gpu_testing::TestCache;
using ::kvdepot::testing::StatusIs;

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
  EXPECT_THAT(RegisterHostMemory(nullptr, 64),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(RegisterHostMemory(pool.data(), 0),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(GatherCudaTest, StagingSavesFromDeviceMemoryOnItsOwnStream) {
  const KvLayout layout =
      KvLayout::Mla(KvCacheLayout::kMla, 3, 16, 576, KvDtype::kBFloat16)
          .value();
  TestCache host(layout, 4);
  std::mt19937_64 rng(9);
  host.FillRandom(rng);
  std::vector<std::unique_ptr<DeviceBuffer>> tensors;
  KvCacheView view;
  view.num_blocks = 4;
  for (int i = 0; i < host.num_tensors(); ++i) {
    tensors.push_back(std::make_unique<DeviceBuffer>(host.tensor_bytes()));
    ASSERT_CUDA(cudaMemcpy(tensors.back()->data(), host.tensor(i),
                           host.tensor_bytes(), cudaMemcpyHostToDevice));
    view.tensors.push_back(tensors.back()->data());
  }
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
