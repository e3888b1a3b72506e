// Local Newton-Schulz calls replayed as CUDA graphs (Backend::run_recorded): a key's second
// call is recorded and later ones replay it. The replays must give the bits of the first call
// (the same kernels and GEMM algorithms) and of a context that never records, read the data
// the buffer holds when they run, and never replay another shape's, schedule's or buffer's
// work. The caller's legacy default stream, which cannot be captured itself, is used
// throughout. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "api/handles.h"
#include "encoded.h"
#include "gpu_available.h"
#include "shardmuon/shardmuon.h"

namespace shardmuon {
namespace {

struct Case {
  int64_t rows, cols;
  shardmuon_dtype dtype;
};

std::string name_of(const Case& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.cols) +
         (c.dtype == SHARDMUON_BFLOAT16 ? " bf16" : " float32");
}

// Random values in the case's dtype.
std::vector<unsigned char> random_matrix(const Case& c, std::mt19937& random) {
  std::normal_distribution<float> normal;
  std::vector<float> values(c.rows * c.cols);
  for (float& value : values) value = normal(random);
  return encoded(values, c.dtype);
}

class Context {
 public:
  explicit Context(bool record) {
    if (!record) setenv("SHARDMUON_NS_GRAPHS", "0", 1);
    EXPECT_EQ(shardmuon_context_create(SHARDMUON_BACKEND_CUDA, 0, &context_), SHARDMUON_SUCCESS)
        << shardmuon_last_error();
    if (!record) unsetenv("SHARDMUON_NS_GRAPHS");
    EXPECT_EQ(shardmuon_comm_create_self(&comm_), SHARDMUON_SUCCESS);
  }
  ~Context() {
    shardmuon_comm_destroy(comm_);
    shardmuon_context_destroy(context_);
  }
  int64_t replays() { return backend_of(context_, "context").replayed_recordings(); }

  // The result of orthogonalizing `input`, copied into `buffer` first (on the legacy stream).
  std::vector<unsigned char> orthogonalize(const Case& c, const std::vector<unsigned char>& input,
                                           void* buffer, shardmuon_schedule schedule) {
    EXPECT_EQ(cudaMemcpy(buffer, input.data(), input.size(), cudaMemcpyHostToDevice), cudaSuccess);
    shardmuon_layout layout{};
    layout.rows = c.rows;
    layout.cols = c.cols;
    layout.partition = SHARDMUON_REPLICATED;
    layout.num_shards = 1;
    shardmuon_ns_options options;
    shardmuon_ns_options_default(&options);
    options.schedule = schedule;
    options.num_iterations = schedule == SHARDMUON_SCHEDULE_POLAR_EXPRESS ? 8 : 5;
    EXPECT_EQ(shardmuon_newton_schulz(context_, comm_, buffer, c.dtype, &layout, &options, nullptr),
              SHARDMUON_SUCCESS)
        << shardmuon_last_error();
    std::vector<unsigned char> result(input.size());
    EXPECT_EQ(cudaMemcpy(result.data(), buffer, result.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return result;
  }

 private:
  shardmuon_context_t context_ = nullptr;
  shardmuon_comm_t comm_ = nullptr;
};

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&data, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(data); }
  void* data = nullptr;
};

TEST(RecordedCalls, ReplaysGiveTheBitsOfCallsThatAreNotRecorded) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  // Aligned; staged in a padded block (odd sides); Gram Newton-Schulz (a long side well above
  // the short one); a side split into many tiles; a short side along the columns.
  const Case cases[] = {{256, 512, SHARDMUON_BFLOAT16},  {301, 1007, SHARDMUON_BFLOAT16},
                        {200, 3000, SHARDMUON_BFLOAT16}, {1024, 1024, SHARDMUON_BFLOAT16},
                        {1007, 301, SHARDMUON_FLOAT32},  {256, 512, SHARDMUON_FLOAT32}};
  std::mt19937 random(34);
  Context recording(true), plain(false);
  for (const Case& c : cases) {
    SCOPED_TRACE(name_of(c));
    const std::vector<unsigned char> first_input = random_matrix(c, random),
                                     second_input = random_matrix(c, random);
    DeviceBuffer buffer(first_input.size()), other_buffer(first_input.size()),
        plain_buffer(first_input.size());
    const shardmuon_schedule quintic = SHARDMUON_SCHEDULE_QUINTIC;
    const std::vector<unsigned char> expected =
        plain.orthogonalize(c, first_input, plain_buffer.data, quintic);
    const int64_t replays_before = recording.replays();
    // Run as it is, recorded, replayed: the same bits each time.
    for (int call = 0; call < 3; ++call) {
      EXPECT_EQ(recording.orthogonalize(c, first_input, buffer.data, quintic), expected)
          << "call " << call;
    }
    EXPECT_EQ(recording.replays(), replays_before + 2);
    // New data in the same buffer: replayed, on that data.
    EXPECT_EQ(recording.orthogonalize(c, second_input, buffer.data, quintic),
              plain.orthogonalize(c, second_input, plain_buffer.data, quintic));
    EXPECT_EQ(recording.replays(), replays_before + 3);
    // Another buffer, or another schedule: not the recording above (each its own first call).
    EXPECT_EQ(recording.orthogonalize(c, second_input, other_buffer.data, quintic),
              plain.orthogonalize(c, second_input, plain_buffer.data, quintic));
    const shardmuon_schedule polar = SHARDMUON_SCHEDULE_POLAR_EXPRESS;
    EXPECT_EQ(recording.orthogonalize(c, first_input, buffer.data, polar),
              plain.orthogonalize(c, first_input, plain_buffer.data, polar));
    EXPECT_EQ(recording.replays(), replays_before + 3);
  }
  EXPECT_EQ(plain.replays(), 0);
}

}  // namespace
}  // namespace shardmuon
