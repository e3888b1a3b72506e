// Reliability: a rank that never joins a call ends in a timeout on the others, not a hang;
// a timed-out handle refuses further use.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "../common/harness.h"
#include "../common/ns_runner.h"
#include "../common/reference.h"

namespace shardmuon_test {
namespace {

class Reliability : public DistributedTest {};

TEST_F(Reliability, ARankThatNeverCallsEndsInATimeoutOnTheOthers) {
  if (Harness::get().on_gpu()) GTEST_SKIP() << "the GPU variant runs in scripts/gpu_check.sh";
  for (int p = 2; p <= Harness::get().max_group_size(); ++p) {
    const Group& group = Harness::get().group(p);
    if (!group.member) continue;
    // A handle of its own, since a timeout leaves it unusable.
    shardmuon_comm_t comm = nullptr;
    ASSERT_EQ(shardmuon_comm_create_mpi(&group.mpi, &comm), SHARDMUON_SUCCESS);
    ASSERT_EQ(shardmuon_comm_set_timeout(comm, 0.5), SHARDMUON_SUCCESS);
    const Matrix input = random_gaussian(23, 40, 3);
    const std::vector<int64_t> sizes = balanced_sizes(40, p);
    const shardmuon_layout layout = make_layout(input, SHARDMUON_SHARDED_DIM1, p, sizes);
    shardmuon_ns_options options = make_options(SHARDMUON_SCHEDULE_QUINTIC, 5, SHARDMUON_NS_AUTO);
    const std::vector<unsigned char> before = to_bytes(
        extract_shard(input, SHARDMUON_SHARDED_DIM1, sizes, group.rank), SHARDMUON_FLOAT32);
    Buffer buffer = Harness::get().upload(before);

    const bool absent = group.rank == p - 1;  // this rank "skips" the call
    if (!absent) {
      const auto start = std::chrono::steady_clock::now();
      const shardmuon_status status =
          shardmuon_newton_schulz(Harness::get().context(), comm, buffer.data(), SHARDMUON_FLOAT32,
                                  &layout, &options, Harness::get().stream());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_EQ(status, SHARDMUON_ERROR_TIMEOUT) << shardmuon_last_error();
      EXPECT_NE(std::string(shardmuon_last_error()).find("within"), std::string::npos);
      EXPECT_LT(seconds, 5.0);
      EXPECT_EQ(Harness::get().download(buffer), before);
      // The handle now refuses every call at once.
      EXPECT_EQ(
          shardmuon_newton_schulz(Harness::get().context(), comm, buffer.data(), SHARDMUON_FLOAT32,
                                  &layout, &options, Harness::get().stream()),
          SHARDMUON_ERROR_TIMEOUT);
      EXPECT_NE(std::string(shardmuon_last_error()).find("unusable"), std::string::npos);
    }
    // Everyone has given up: the late rank now joins the pending exchange (with arguments that
    // fail its own validation, so it stops there), which keeps MPI's state consistent.
    MPI_Barrier(group.mpi);
    if (absent) {
      options.num_iterations = 0;
      EXPECT_EQ(
          shardmuon_newton_schulz(Harness::get().context(), comm, buffer.data(), SHARDMUON_FLOAT32,
                                  &layout, &options, Harness::get().stream()),
          SHARDMUON_ERROR_INVALID_ARGUMENT);
    }
    EXPECT_EQ(shardmuon_comm_destroy(comm), SHARDMUON_SUCCESS);
  }
}

TEST_F(Reliability, TimeoutArgumentIsChecked) {
  shardmuon_comm_t comm = nullptr;
  ASSERT_EQ(shardmuon_comm_create_self(&comm), SHARDMUON_SUCCESS);
  EXPECT_EQ(shardmuon_comm_set_timeout(comm, -1.0), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("seconds must be finite and >= 0, got -1"),
            std::string::npos);
  EXPECT_EQ(shardmuon_comm_set_timeout(comm, 0.0), SHARDMUON_SUCCESS);
  shardmuon_comm_destroy(comm);
}

}  // namespace
}  // namespace shardmuon_test
