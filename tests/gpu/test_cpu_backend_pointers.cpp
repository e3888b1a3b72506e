// The CPU backend reads its arguments on the host: in a library built with CUDA it refuses
// device memory with a clear error instead of crashing on it, takes every kind of memory the
// host can read, and asks without creating a CUDA context. Skipped without a GPU.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"
#include "gpu_available.h"
#include "shardmuon/shardmuon.hpp"

namespace shardmuon {
namespace {

// The message of check_pointer's failure, or "" when it accepted the pointer.
std::string refusal(const Backend& backend, const void* pointer) {
  try {
    backend.check_pointer(pointer, "the_argument");
  } catch (const Failure& failure) {
    EXPECT_EQ(failure.status(), SHARDMUON_ERROR_INVALID_ARGUMENT);
    return failure.what();
  }
  return "";
}

TEST(CpuBackendPointers, RefusesDeviceMemoryAndTakesWhatTheHostCanRead) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  constexpr size_t kBytes = 1 << 20;

  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, kBytes), cudaSuccess);
  const std::string message = refusal(*cpu, device);
  EXPECT_NE(message.find("the_argument"), std::string::npos) << message;
  EXPECT_NE(message.find("is CUDA device memory; the CPU backend needs host memory"),
            std::string::npos)
      << message;
  EXPECT_NE(refusal(*cpu, static_cast<char*>(device) + 4100), "") << "inside the allocation";

  // Memory of the stream-ordered allocator (PyTorch's, where configured) is device memory too.
  void* pooled = nullptr;
  ASSERT_EQ(cudaMallocAsync(&pooled, kBytes, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  EXPECT_NE(refusal(*cpu, pooled), "");

  // From a thread that has made no CUDA call, as a training loop's worker may be.
  std::string from_new_thread;
  std::thread([&] { from_new_thread = refusal(*cpu, device); }).join();
  EXPECT_NE(from_new_thread, "") << "device memory accepted on a thread without a CUDA call";

  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, kBytes), cudaSuccess);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, kBytes), cudaSuccess);
  std::vector<float> pageable(1024);
  for (void* readable : {managed, pinned, static_cast<void*>(pageable.data())}) {
    EXPECT_EQ(refusal(*cpu, readable), "") << readable;
  }
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(pooled, cudaStreamLegacy), cudaSuccess);
  EXPECT_EQ(cudaFree(managed), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Through the C API: the call fails naming the argument, and the device buffer is untouched.
TEST(CpuBackendPointers, ACpuContextRefusesADeviceMatrix) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> values(23 * 41, 1.5f);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, values.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(device, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice),
      cudaSuccess);
  const Context context(SHARDMUON_BACKEND_CPU);
  const Comm self = Comm::self();
  try {
    newton_schulz(context, self, device, SHARDMUON_FLOAT32, Layout::replicated(23, 41));
    ADD_FAILURE() << "device memory accepted by a CPU context";
  } catch (const Error& error) {
    EXPECT_EQ(error.status(), SHARDMUON_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(error.what()).find("local_shard"), std::string::npos) << error.what();
  }
  std::vector<float> after(values.size());
  ASSERT_EQ(cudaMemcpy(after.data(), device, after.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(after, values);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

// Whether device 0's primary context is active, asked of the driver, which creates none.
bool primary_context_active() {
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &function, CUDART_VERSION,
                                       cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    std::exit(3);
  }
  unsigned int flags = 0;
  int active = 0;
  if (reinterpret_cast<GetState>(function)(0, &flags, &active) != CUDA_SUCCESS) std::exit(4);
  return active != 0;
}

// A CPU-only process on a GPU machine gets no CUDA context (hundreds of MiB of device memory)
// from the check, also where it has loaded the driver (cudaGetDeviceCount does, without a
// context): then the driver is asked, with no context current and none to borrow. Run in a
// fresh process ("threadsafe" death tests re-execute the binary); this one has contexts already.
TEST(CpuBackendPointers, CheckingCreatesNoCudaContext) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        // A context from before the check leaves nothing to judge: fail with a code of its own.
        if (primary_context_active()) std::exit(2);
        std::vector<float> host(64);
        const std::unique_ptr<Backend> cpu = make_cpu_backend();
        cpu->check_pointer(host.data(), "host");
        std::exit(primary_context_active() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace shardmuon
