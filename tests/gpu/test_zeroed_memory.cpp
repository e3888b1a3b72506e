// The CUDA backend's zero-filled buffers (shardmuon_buffer_create's, the C++ Muon class's
// momentum) must be zero before any stream's later work: a caller may write into one on its
// own non-blocking stream right after allocating it, as a checkpoint's load does. Skipped
// without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "core/backend.h"
#include "cuda/cuda_backend.h"
#include "gpu_available.h"

namespace shardmuon {
namespace {

// Host work enqueued on a stream, holding that stream's later work back.
void CUDART_CB hold_the_stream(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
}

TEST(ZeroedMemory, IsZeroBeforeANonBlockingStreamWritesIt) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Backend> cuda = make_cuda_backend(0);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);

  // The legacy default stream busy for 200 ms: zeros enqueued behind that and not waited
  // for would land after the copy below, which the non-blocking stream runs at once.
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, hold_the_stream, nullptr), cudaSuccess);
  constexpr size_t kBytes = size_t{1} << 20;
  void* buffer = cuda->allocate_zeroed(kBytes);
  const std::vector<unsigned char> written(kBytes, 0x5a);
  ASSERT_EQ(cudaMemcpyAsync(buffer, written.data(), kBytes, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // whatever the legacy stream still held

  std::vector<unsigned char> read(kBytes);
  ASSERT_EQ(cudaMemcpy(read.data(), buffer, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  const auto kept = std::count(read.begin(), read.end(), static_cast<unsigned char>(0x5a));
  EXPECT_EQ(kept, static_cast<std::ptrdiff_t>(kBytes)) << "bytes of the copy left after zeroing";
  cuda->release(buffer);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace shardmuon
