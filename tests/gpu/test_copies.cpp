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

// Rows at every alignment the library can pass (staging and copying back blocks whose rows have
// an odd element count, of 1, 2, 4 or 8 bytes): each case against the bytes a host copy gives,
// the destination's bytes between and after the rows left as they were.
TEST(CudaCopies, RowsAtAnyAlignmentMatchAHostCopy) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kCapacity = 1 << 20;
  DeviceBytes src(kCapacity), dst(kCapacity);
  ASSERT_NE(src.data, nullptr);
  ASSERT_NE(dst.data, nullptr);
  std::vector<unsigned char> source(kCapacity), before(kCapacity), read(kCapacity);
  for (size_t i = 0; i < kCapacity; ++i) {
    source[i] = static_cast<unsigned char>(i * 37 + (i >> 8) * 11 + 5);
    before[i] = static_cast<unsigned char>(i * 53 + 201);
  }
  ASSERT_EQ(cudaMemcpy(src.data, source.data(), kCapacity, cudaMemcpyHostToDevice), cudaSuccess);
  std::unique_ptr<Backend> cuda = make_cuda_backend(0);
  int cases = 0;
  for (size_t unit : {1, 2, 4, 8}) {
    for (size_t dst_offset : {size_t{0}, unit, 3 * unit, 16 - unit, 16 + 2 * unit}) {
      for (size_t src_offset : {size_t{0}, unit, 5 * unit}) {
        for (size_t row_units : {1, 3, 8, 17, 1001, 10007}) {
          for (size_t pitch_units : {size_t{0}, size_t{1}, size_t{9}}) {
            const size_t row_bytes = row_units * unit, rows = row_units > 1000 ? 5 : 7;
            const size_t dst_pitch = row_bytes + pitch_units * unit;
            const size_t src_pitch = row_bytes + (pitch_units + 1) % 3 * unit;
            const std::string where =
                "unit " + std::to_string(unit) + ", offsets " + std::to_string(dst_offset) + " / " +
                std::to_string(src_offset) + ", row " + std::to_string(row_bytes) +
                " bytes, pitches " + std::to_string(dst_pitch) + " / " + std::to_string(src_pitch);
            ASSERT_LE(dst_offset + rows * dst_pitch, kCapacity) << where;
            ASSERT_LE(src_offset + rows * src_pitch, kCapacity) << where;
            ASSERT_EQ(cudaMemcpy(dst.data, before.data(), kCapacity, cudaMemcpyHostToDevice),
                      cudaSuccess);
            cuda->copy_2d(dst.bytes() + dst_offset, dst_pitch, src.bytes() + src_offset, src_pitch,
                          row_bytes, rows, nullptr);
            ASSERT_EQ(cudaMemcpy(read.data(), dst.data, kCapacity, cudaMemcpyDeviceToHost),
                      cudaSuccess)
                << where;
            std::vector<unsigned char> expected = before;
            for (size_t r = 0; r < rows; ++r) {
              std::copy_n(source.begin() + src_offset + r * src_pitch, row_bytes,
                          expected.begin() + dst_offset + r * dst_pitch);
            }
            ASSERT_EQ(read, expected) << where;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 5 * 3 * 6 * 3);
}

}  // namespace
}  // namespace shardmuon
