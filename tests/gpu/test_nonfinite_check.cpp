// The finite check of a checked step's updates (flag_nonfinite_cuda): a single NaN or Inf
// anywhere in a buffer sets the flag, in the vectorized bulk and in the scalar remainder,
// from an aligned start and from one that is not; the largest finite values do not. Skipped
// without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda/muon_kernels.cuh"
#include "encoded.h"
#include "gpu_available.h"

namespace shardmuon {
namespace {

// The flag after checking `values`, placed `offset` elements into a fresh allocation.
float flag_of(const std::vector<float>& values, shardmuon_dtype dtype, size_t offset) {
  const size_t element = dtype == SHARDMUON_BFLOAT16 ? 2 : 4;
  const std::vector<unsigned char> bytes = encoded(values, dtype);
  void* buffer = nullptr;
  float* flag = nullptr;
  EXPECT_EQ(cudaMalloc(&buffer, bytes.size() + offset * element), cudaSuccess);
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&flag), sizeof(float)), cudaSuccess);
  char* start = static_cast<char*>(buffer) + offset * element;
  EXPECT_EQ(cudaMemcpy(start, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(flag, 0, sizeof(float)), cudaSuccess);
  flag_nonfinite_cuda({{start, dtype, static_cast<int64_t>(values.size()), flag}}, nullptr);
  float result = -1.0f;
  EXPECT_EQ(cudaMemcpy(&result, flag, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(buffer);
  cudaFree(flag);
  return result;
}

TEST(NonFiniteCheck, OneBadElementAnywhereSetsTheFlag) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const float largest_bf16 = 3.3895314e38f;  // 0x7f7f: finite in both dtypes
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (const shardmuon_dtype dtype : {SHARDMUON_FLOAT32, SHARDMUON_BFLOAT16}) {
    for (const size_t count :
         {size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{4099}, (size_t{1} << 20) + 5}) {
      for (const size_t offset : {size_t{0}, size_t{1}}) {  // aligned, then not
        std::vector<float> values(count);
        for (size_t i = 0; i < count; ++i) {
          values[i] = i % 3 == 0 ? largest_bf16 : -static_cast<float>(i % 251);
        }
        const std::string where = std::string(dtype == SHARDMUON_BFLOAT16 ? "bf16" : "float32") +
                                  " count " + std::to_string(count) + " offset " +
                                  std::to_string(offset);
        EXPECT_EQ(flag_of(values, dtype, offset), 0.0f) << where << ": all finite";
        for (const size_t position : {size_t{0}, count / 2, count - 1}) {
          for (const float bad : bad_values) {
            std::vector<float> poisoned = values;
            poisoned[position] = bad;
            EXPECT_EQ(flag_of(poisoned, dtype, offset), 1.0f)
                << where << ": " << bad << " at " << position;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardmuon
