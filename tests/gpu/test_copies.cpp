// The CUDA backend's 2D copies (staging blocks, moving shards, copying whole buffers) must take
// any size and pitch the library passes: a whole buffer of 2 GiB or more as one row, and rows
// at a pitch that large. cudaMemcpy2DAsync's documentation lets it refuse pitches above
// cudaDevAttrMaxPitch (2^31 - 1); CUDA 13 on an H200 takes them (checked 2026-12-02 up to
// 4 GiB), and these tests would tell if a driver stopped. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "cuda/cuda_backend.h"
#include "gpu_available.h"

namespace shardmuon {
namespace {

// Device memory freed at scope exit.
struct DeviceBytes {
  explicit DeviceBytes(size_t bytes) {
    if (cudaMalloc(&data, bytes) != cudaSuccess) {
      cudaGetLastError();
      data = nullptr;
    }
  }
  ~DeviceBytes() { cudaFree(data); }
  char* bytes() const { return static_cast<char*>(data); }
  void* data = nullptr;
};

// A 4 KiB pattern written at `offset`, different at each offset.
std::vector<unsigned char> pattern_at(size_t offset) {
  std::vector<unsigned char> pattern(4096);
  for (size_t i = 0; i < pattern.size(); ++i) {
    pattern[i] = static_cast<unsigned char>((offset >> 12) * 131 + i * 7 + 1);
  }
  return pattern;
}

void write_pattern(char* base, size_t offset) {
  const std::vector<unsigned char> pattern = pattern_at(offset);
  ASSERT_EQ(cudaMemcpy(base + offset, pattern.data(), pattern.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
}

void expect_pattern(const char* base, size_t offset, const std::string& where) {
  std::vector<unsigned char> read(4096);
  ASSERT_EQ(cudaMemcpy(read.data(), base + offset, read.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(read, pattern_at(offset)) << where << " at byte " << offset;
}

TEST(CudaCopies, OneRowOfMoreThanTwoGibibytes) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const size_t bytes = (size_t{1} << 31) + 4096;
  DeviceBytes src(bytes), dst(bytes);
  if (src.data == nullptr || dst.data == nullptr) GTEST_SKIP() << "not 4.3 GB of device memory";
  ASSERT_EQ(cudaMemset(dst.data, 0, bytes), cudaSuccess);
  const std::vector<size_t> offsets = {0, size_t{1} << 30, bytes - 4096};
  for (size_t offset : offsets) write_pattern(src.bytes(), offset);
  std::unique_ptr<Backend> cuda = make_cuda_backend(0);
  // As muon_step copies a whole buffer: one row, pitch = width.
  cuda->copy_2d(dst.data, bytes, src.data, bytes, bytes, 1, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t offset : offsets) expect_pattern(dst.bytes(), offset, "one row");
}

TEST(CudaCopies, RowsAtAPitchOfMoreThanTwoGibibytes) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  // Two rows of 4 KiB, 16-byte aligned, at a pitch of 2 GiB + 4 KiB in the source and a
  // packed destination: a column block of a very wide matrix.
  const size_t pitch = (size_t{1} << 31) + 4096, row_bytes = 4096;
  DeviceBytes src(pitch + row_bytes), dst(2 * row_bytes);
  if (src.data == nullptr || dst.data == nullptr) GTEST_SKIP() << "not 2.2 GB of device memory";
  ASSERT_EQ(cudaMemset(dst.data, 0, 2 * row_bytes), cudaSuccess);
  write_pattern(src.bytes(), 0);
  write_pattern(src.bytes(), pitch);
  std::unique_ptr<Backend> cuda = make_cuda_backend(0);
  cuda->copy_2d(dst.data, row_bytes, src.data, pitch, row_bytes, 2, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<unsigned char> read(2 * row_bytes);
  ASSERT_EQ(cudaMemcpy(read.data(), dst.data, read.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  const std::vector<unsigned char> first = pattern_at(0), second = pattern_at(pitch);
  EXPECT_TRUE(std::equal(first.begin(), first.end(), read.begin()));
  EXPECT_TRUE(std::equal(second.begin(), second.end(), read.begin() + row_bytes));
}

}  // namespace
}  // namespace shardmuon
