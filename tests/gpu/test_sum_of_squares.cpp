// The norm's sums of squares (sum_of_squares_cuda): chunks loaded 16 bytes at a time between
// their 16-byte boundaries, the elements before and after one by one. Every element must be
// counted once, from any start and for any count, matrix by matrix of a batch whose matrices
// start at different alignments. The values are small integers, exact in bf16, whose squares
// add up exactly in float32 (every partial sum stays below 2^24), so the sums must equal the
// host's. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/elementwise.cuh"
#include "encoded.h"
#include "gpu_available.h"

namespace shardmuon {
namespace {

struct Sums {
  std::vector<float> device;
  std::vector<double> host;
};

// The batch's sums of squares on the GPU, its values placed `offset` elements into an
// allocation, against the host's.
Sums sums_of(shardmuon_dtype dtype, int64_t count, int64_t batch, int64_t offset,
             std::mt19937& random) {
  const size_t element = dtype == SHARDMUON_BFLOAT16 ? 2 : 4;
  const int64_t total = count * batch;
  // Values of at most 3 in size, or 1 for the largest counts: every sum stays below 2^24.
  const int largest = total * 9 < (int64_t{1} << 24) ? 3 : 1;
  EXPECT_LT(total * largest * largest, int64_t{1} << 24);
  std::uniform_int_distribution<int> value_of(-largest, largest);
  std::vector<float> values(total);
  Sums sums;
  sums.host.assign(batch, 0.0);
  for (int64_t i = 0; i < total; ++i) {
    values[i] = static_cast<float>(value_of(random));  // a small integer, exact in bf16
    sums.host[i / count] += double{values[i]} * values[i];
  }
  const std::vector<unsigned char> bytes = encoded(values, dtype);
  const size_t scratch_bytes = sum_of_squares_scratch_bytes_cuda(dtype, count, batch);
  void *buffer = nullptr, *scratch = nullptr, *result = nullptr;
  EXPECT_EQ(cudaMalloc(&buffer, bytes.size() + offset * element), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&scratch, scratch_bytes), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&result, batch * sizeof(float)), cudaSuccess);
  char* start = static_cast<char*>(buffer) + offset * element;
  EXPECT_EQ(cudaMemcpy(start, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(result, 0xff, batch * sizeof(float)), cudaSuccess);  // NaN until written
  sum_of_squares_cuda(start, dtype, count, batch, result, scratch, scratch_bytes, nullptr);
  sums.device.assign(batch, -1.0f);
  EXPECT_EQ(cudaMemcpy(sums.device.data(), result, batch * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(buffer);
  cudaFree(scratch);
  cudaFree(result);
  return sums;
}

TEST(SumOfSquares, EveryElementCountsOnceFromAnyStart) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 random(20261203);
  // Shorter than a vector, one vector and a bit, several chunks (8192 elements at least each)
  // with a remainder, chunks of odd lengths (123457: 16 of 7717), and 2001 chunks of 8188.
  const int64_t counts[] = {1, 3, 7, 8, 9, 17, 100, 8191, 8192 * 2 + 3, 123457, 2000 * 8192 + 5};
  int cases = 0;
  for (const shardmuon_dtype dtype : {SHARDMUON_BFLOAT16, SHARDMUON_FLOAT32}) {
    for (const int64_t count : counts) {
      for (const int64_t batch : {1, 3}) {
        if (count * batch >= int64_t{1} << 24) continue;  // the largest alone
        for (int64_t offset = 0; offset < 8; ++offset) {
          const Sums sums = sums_of(dtype, count, batch, offset, random);
          for (int64_t b = 0; b < batch; ++b) {
            EXPECT_EQ(double{sums.device[b]}, sums.host[b])
                << (dtype == SHARDMUON_BFLOAT16 ? "bf16" : "float32") << " count " << count
                << " batch " << batch << " matrix " << b << " offset " << offset;
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 2 * (10 * 2 + 1) * 8);
}

}  // namespace
}  // namespace shardmuon
