// Tests that need no MPI: they run in every build, including one without CUDA, NCCL and
// MPI, and check that the parts left out fail with NOT_BUILT while the CPU backend works
// through the one-rank communicator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../common/reference.h"
#include "shardmuon/shardmuon.hpp"

namespace shardmuon_test {
namespace {

TEST(SingleProcess, LeftOutPartsSayNotBuilt) {
  int has_cuda = -1, has_nccl = -1, has_mpi = -1;
  ASSERT_EQ(shardmuon_build_info(&has_cuda, &has_nccl, &has_mpi), SHARDMUON_SUCCESS);
  shardmuon_comm_t comm = nullptr;
  if (!has_mpi) {
    int fake_mpi_comm = 0;
    EXPECT_EQ(shardmuon_comm_create_mpi(&fake_mpi_comm, &comm), SHARDMUON_ERROR_NOT_BUILT);
    EXPECT_NE(std::string(shardmuon_last_error()).find("built without MPI"), std::string::npos);
  }
  if (!has_nccl) {
    int fake_nccl_comm = 0;
    EXPECT_EQ(shardmuon_comm_create_nccl(&fake_nccl_comm, &comm), SHARDMUON_ERROR_NOT_BUILT);
    EXPECT_NE(std::string(shardmuon_last_error()).find("built without NCCL"), std::string::npos);
  }
  shardmuon_context_t context = nullptr;
  const shardmuon_status cuda = shardmuon_context_create(SHARDMUON_BACKEND_CUDA, 0, &context);
  if (!has_cuda) {
    EXPECT_EQ(cuda, SHARDMUON_ERROR_NOT_BUILT);
    EXPECT_NE(std::string(shardmuon_last_error()).find("built without CUDA"), std::string::npos);
  } else if (cuda != SHARDMUON_SUCCESS) {
    // Built with CUDA on a machine without a usable GPU: a CUDA error or a bad device index,
    // with a message, never a crash.
    EXPECT_TRUE(cuda == SHARDMUON_ERROR_CUDA || cuda == SHARDMUON_ERROR_INVALID_ARGUMENT)
        << shardmuon_status_name(cuda);
    EXPECT_STRNE(shardmuon_last_error(), "");
  }
  shardmuon_context_destroy(context);
  EXPECT_EQ(comm, nullptr);
}

TEST(SingleProcess, CpuBackendMatchesTheOracle) {
  shardmuon::Context context(SHARDMUON_BACKEND_CPU);
  shardmuon::Comm self = shardmuon::Comm::self();
  EXPECT_EQ(self.size(), 1);
  for (const auto& shape : {std::pair<int64_t, int64_t>{67, 131}, {131, 67}, {1, 29}}) {
    const Matrix input = random_gaussian(shape.first, shape.second, 11);
    for (shardmuon_dtype dtype : {SHARDMUON_FLOAT64, SHARDMUON_FLOAT32, SHARDMUON_BFLOAT16}) {
      const Matrix rounded = rounded_to(input, dtype);
      const Matrix expected =
          reference_newton_schulz(rounded, coefficients_for(SHARDMUON_SCHEDULE_QUINTIC, 5), 1e-7);
      std::vector<unsigned char> bytes = to_bytes(rounded.values, dtype);
      shardmuon::newton_schulz(context, self, bytes.data(), dtype,
                               shardmuon::Layout::replicated(shape.first, shape.second));
      const std::vector<double> result = from_bytes(bytes, dtype);
      double diff = 0, norm = 0;
      for (size_t i = 0; i < result.size(); ++i) {
        diff += (result[i] - expected.values[i]) * (result[i] - expected.values[i]);
        norm += expected.values[i] * expected.values[i];
      }
      const double tolerance = dtype == SHARDMUON_FLOAT64   ? 1e-11
                               : dtype == SHARDMUON_FLOAT32 ? 2e-5
                                                            : 3e-2;
      EXPECT_LT(std::sqrt(diff / norm), tolerance)
          << shape.first << "x" << shape.second << " " << dtype_label(dtype);
    }
  }
}

TEST(SingleProcess, CppWrapperThrowsWithTheMessage) {
  shardmuon::Context context(SHARDMUON_BACKEND_CPU);
  shardmuon::Comm self = shardmuon::Comm::self();
  std::vector<float> data(12, 1.0f);
  shardmuon_ns_options options = shardmuon::default_ns_options();
  options.num_iterations = 0;
  try {
    shardmuon::newton_schulz(context, self, data.data(), SHARDMUON_FLOAT32,
                             shardmuon::Layout::replicated(3, 4), options);
    FAIL() << "no exception";
  } catch (const shardmuon::Error& e) {
    EXPECT_EQ(e.status(), SHARDMUON_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("num_iterations must be in [1, 1000], got 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(data, std::vector<float>(12, 1.0f));
}

// A buffer size within an alignment block of SIZE_MAX, which rounding up would wrap to a tiny
// allocation, is refused as out of memory, and no buffer is returned.
TEST(SingleProcess, ABufferTooLargeToRoundUpIsRefused) {
  shardmuon::Context context(SHARDMUON_BACKEND_CPU);
  for (const size_t bytes : {SIZE_MAX, SIZE_MAX - 64}) {
    void* buffer = nullptr;
    EXPECT_EQ(shardmuon_buffer_create(context.get(), bytes, &buffer), SHARDMUON_ERROR_OUT_OF_MEMORY)
        << bytes;
    EXPECT_EQ(buffer, nullptr);
  }
  void* buffer = nullptr;
  ASSERT_EQ(shardmuon_buffer_create(context.get(), 100, &buffer), SHARDMUON_SUCCESS);
  EXPECT_EQ(shardmuon_buffer_destroy(context.get(), buffer), SHARDMUON_SUCCESS);
}

// shardmuon_buffer_destroy frees only the context's live buffers: a second destroy, a pointer
// of another allocator and another context's buffer are refused (they would have reached
// free), and that buffer stays usable. A buffer left alive is freed with its context (the
// sanitizer build's leak check would report it otherwise).
TEST(SingleProcess, OnlyTheContextsLiveBuffersAreFreed) {
  shardmuon::Context context(SHARDMUON_BACKEND_CPU), other(SHARDMUON_BACKEND_CPU);
  void* buffer = nullptr;
  void* others = nullptr;
  ASSERT_EQ(shardmuon_buffer_create(context.get(), 64, &buffer), SHARDMUON_SUCCESS);
  ASSERT_EQ(shardmuon_buffer_create(other.get(), 64, &others), SHARDMUON_SUCCESS);
  EXPECT_EQ(shardmuon_buffer_destroy(context.get(), buffer), SHARDMUON_SUCCESS);
  EXPECT_EQ(shardmuon_buffer_destroy(context.get(), buffer), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("is not a live buffer of this context's"),
            std::string::npos)
      << shardmuon_last_error();
  std::vector<float> mine(16);
  EXPECT_EQ(shardmuon_buffer_destroy(context.get(), mine.data()), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardmuon_buffer_destroy(context.get(), others), SHARDMUON_ERROR_INVALID_ARGUMENT);
  static_cast<float*>(others)[15] = 1.0f;  // still the other context's, and alive
  EXPECT_EQ(shardmuon_buffer_destroy(context.get(), nullptr), SHARDMUON_SUCCESS);
  void* left = nullptr;
  ASSERT_EQ(shardmuon_buffer_create(context.get(), 64, &left), SHARDMUON_SUCCESS);
}

}  // namespace
}  // namespace shardmuon_test
