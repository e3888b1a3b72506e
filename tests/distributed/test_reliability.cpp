// Reliability: a rank that never joins a call ends in a timeout on the others, not a hang;
// a timed-out handle refuses further use.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#ifdef SHARDMUON_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "../common/harness.h"
#include "../common/ns_runner.h"
#include "../common/reference.h"

namespace shardmuon_test {
namespace {

class Reliability : public DistributedTest {};

// Where a rank is, printed when SHARDMUON_TEST_PROGRESS is set: the fault-injection test
// is the one that could hang, and a hang shows no gtest output.
void progress(const char* where) {
  if (std::getenv("SHARDMUON_TEST_PROGRESS") == nullptr) return;
  std::fprintf(stderr, "[rank %d] %s\n", Harness::get().world_rank(), where);
  std::fflush(stderr);
}

TEST_F(Reliability, ARankThatNeverCallsEndsInATimeoutOnTheOthers) {
  // Over NCCL this passed on the lent H200s (2026-11-30) once the communicator warmed its
  // private connections up at creation and destroy waited for the late rank's exchange;
  // scripts/gpu_check.sh runs it on its own under a watchdog.
  if (Harness::get().on_gpu() && Harness::get().comm_kind() == CommKind::kCallbacks) {
    // The CPU backend's run still checks the timeout over an MPI handle of its own.
    GTEST_SKIP() << "a callback communicator times out in the caller's collectives, and "
                    "MpiCallbacks abort the job instead; NCCL runs check this";
  }
  for_each_group(2, [&](const Group& group) {
    const int p = group.size;
    // A handle of its own, since a timeout leaves it unusable.
    shardmuon_comm_t comm = nullptr;
    progress("creating the communicator");
    if (Harness::get().on_gpu()) {
      ASSERT_EQ(shardmuon_comm_create_nccl(Harness::get().nccl_comm(p), &comm), SHARDMUON_SUCCESS)
          << shardmuon_last_error();
    } else {
      ASSERT_EQ(shardmuon_comm_create_mpi(&group.mpi, &comm), SHARDMUON_SUCCESS);
    }
    ASSERT_EQ(shardmuon_comm_set_timeout(comm, 0.5), SHARDMUON_SUCCESS);
    const Matrix input = random_gaussian(23, 40, 3);
    const std::vector<int64_t> sizes = balanced_sizes(40, p);
    const shardmuon_layout layout = make_layout(input, SHARDMUON_SHARDED_DIM1, p, sizes);
    shardmuon_ns_options options = make_options(SHARDMUON_SCHEDULE_QUINTIC, 5, SHARDMUON_NS_AUTO);
    const std::vector<unsigned char> before = to_bytes(
        extract_shard(input, SHARDMUON_SHARDED_DIM1, sizes, group.rank), SHARDMUON_FLOAT32);
    Buffer buffer = Harness::get().upload(before);

    const bool absent = group.rank == p - 1;  // this rank "skips" the call
    progress("created");
    if (!absent) {
      const auto start = std::chrono::steady_clock::now();
      const shardmuon_status status =
          shardmuon_newton_schulz(Harness::get().context(), comm, buffer.data(), SHARDMUON_FLOAT32,
                                  &layout, &options, Harness::get().stream());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      progress("the call returned");
      EXPECT_EQ(status, SHARDMUON_ERROR_TIMEOUT) << shardmuon_last_error();
      EXPECT_NE(std::string(shardmuon_last_error()).find("within"), std::string::npos);
      EXPECT_LT(seconds, 5.0);
      EXPECT_EQ(Harness::get().download(buffer), before);
      progress("downloaded");
      // The handle now refuses every call at once.
      EXPECT_EQ(
          shardmuon_newton_schulz(Harness::get().context(), comm, buffer.data(), SHARDMUON_FLOAT32,
                                  &layout, &options, Harness::get().stream()),
          SHARDMUON_ERROR_TIMEOUT);
      EXPECT_NE(std::string(shardmuon_last_error()).find("unusable"), std::string::npos);
    }
    // Everyone has given up: the late rank now joins the pending exchange (with arguments that
    // fail its own validation, so it stops there), which keeps MPI's state consistent.
    progress("at the barrier");
    MPI_Barrier(group.mpi);
    progress("past the barrier");
    if (absent) {
      options.num_iterations = 0;
      EXPECT_EQ(
          shardmuon_newton_schulz(Harness::get().context(), comm, buffer.data(), SHARDMUON_FLOAT32,
                                  &layout, &options, Harness::get().stream()),
          SHARDMUON_ERROR_INVALID_ARGUMENT)
          << shardmuon_last_error();
    }
    progress("destroying the communicator");
    EXPECT_EQ(shardmuon_comm_destroy(comm), SHARDMUON_SUCCESS);
    progress("destroyed");
  });
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

namespace shardmuon_test {
namespace {

// Two parameters, sharded, in two groups; the second group's schedule can be made to
// overflow (a huge coefficient), to produce a non-finite update from finite gradients.
struct NonFiniteCase {
  std::vector<Buffer> w, g, m;
  std::vector<std::vector<unsigned char>> w0, m0;
  std::vector<shardmuon_muon_param> params;
  std::vector<shardmuon_muon_group> groups;
  std::vector<double> overflow = {1e30, 0, 0, 1e30, 0, 0};
  std::vector<std::vector<int64_t>> sizes;

  NonFiniteCase(const Group& group, bool overflowing_second, double poison_value,
                bool poison_rank) {
    const int64_t shapes[2][2] = {{19, 33}, {28, 16}};
    groups.resize(2);
    shardmuon_muon_group_default(&groups[0]);
    shardmuon_muon_group_default(&groups[1]);
    groups[0].lr = groups[1].lr = 0.05;
    if (overflowing_second) {
      groups[1].ns.schedule = SHARDMUON_SCHEDULE_CUSTOM;
      groups[1].ns.num_iterations = 2;
      groups[1].ns.custom_coefficients = overflow.data();
      groups[1].ns.num_custom_coefficients = 2;
    }
    for (int i = 0; i < 2; ++i) {
      sizes.push_back(balanced_sizes(shapes[i][1], group.size));
      const Matrix weight = random_gaussian(shapes[i][0], shapes[i][1], 50 + i);
      const Matrix grad = random_gaussian(shapes[i][0], shapes[i][1], 60 + i);
      const Matrix momentum = random_gaussian(shapes[i][0], shapes[i][1], 70 + i);
      std::vector<double> g_shard =
          extract_shard(grad, SHARDMUON_SHARDED_DIM1, sizes[i], group.rank);
      if (i == 0 && poison_rank && !g_shard.empty()) g_shard[g_shard.size() / 2] = poison_value;
      w0.push_back(to_bytes(extract_shard(weight, SHARDMUON_SHARDED_DIM1, sizes[i], group.rank),
                            SHARDMUON_FLOAT32));
      m0.push_back(to_bytes(extract_shard(momentum, SHARDMUON_SHARDED_DIM1, sizes[i], group.rank),
                            SHARDMUON_FLOAT32));
      w.push_back(Harness::get().upload(w0.back()));
      g.push_back(Harness::get().upload(to_bytes(g_shard, SHARDMUON_FLOAT32)));
      m.push_back(Harness::get().upload(m0.back()));
    }
    for (int i = 0; i < 2; ++i) {
      shardmuon_muon_param p{};
      p.param = w[i].data();
      p.grad = g[i].data();
      p.momentum = m[i].data();
      p.dtype = SHARDMUON_FLOAT32;
      p.layout = shardmuon_layout{shapes[i][0], shapes[i][1], SHARDMUON_SHARDED_DIM1, group.size,
                                  sizes[i].data()};
      p.group = i;
      params.push_back(p);
    }
  }
  shardmuon_status step(const Group& group) {
    return shardmuon_muon_step(Harness::get().context(), group.comm, params.data(), 2,
                               groups.data(), 2, Harness::get().stream());
  }
  bool unchanged(int i) const {
    return Harness::get().download(w[i]) == w0[i] && Harness::get().download(m[i]) == m0[i];
  }
  bool all_finite(int i) const {
    for (double v : from_bytes(Harness::get().download(w[i]), SHARDMUON_FLOAT32)) {
      if (!std::isfinite(v)) return false;
    }
    return true;
  }
};

void counts(int64_t& steps, int64_t& params) {
  ASSERT_EQ(shardmuon_context_nonfinite_counts(Harness::get().context(), &steps, &params),
            SHARDMUON_SUCCESS)
      << shardmuon_last_error();
}

class NonFinite : public DistributedTest {
 protected:
  void TearDown() override {
    shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_SKIP);
    DistributedTest::TearDown();
  }
};

TEST_F(NonFinite, ANonFiniteGradientOnOneRankSkipsTheStepEverywhere) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  for (double poison : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    int64_t steps0, params0, steps1, params1;
    counts(steps0, params0);
    NonFiniteCase c(group, false, poison, group.rank == group.size - 1);
    EXPECT_EQ(c.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
    EXPECT_TRUE(c.unchanged(0) && c.unchanged(1)) << "poison " << poison;
    counts(steps1, params1);
    EXPECT_EQ(steps1, steps0 + 1);
    EXPECT_EQ(params1, params0);
  }
}

TEST_F(NonFinite, ANonFiniteUpdateSkipsOnlyItsParameter) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  int64_t steps0, params0, steps1, params1;
  counts(steps0, params0);
  NonFiniteCase c(group, /*overflowing_second=*/true, 0.0, false);
  EXPECT_EQ(c.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_FALSE(c.unchanged(0));  // the healthy parameter was updated
  EXPECT_TRUE(c.all_finite(0));
  EXPECT_TRUE(c.unchanged(1));  // the overflowing one was not
  counts(steps1, params1);
  EXPECT_EQ(steps1, steps0);
  EXPECT_EQ(params1, params0 + 1);
}

TEST_F(NonFinite, RaiseReportsAndWritesNothing) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  ASSERT_EQ(
      shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_RAISE),
      SHARDMUON_SUCCESS);
  NonFiniteCase c(group, false, std::nan(""), group.rank == 0);
  EXPECT_EQ(c.step(group), SHARDMUON_ERROR_NON_FINITE);
  EXPECT_NE(std::string(shardmuon_last_error()).find("skipped on every rank"), std::string::npos)
      << shardmuon_last_error();
  EXPECT_TRUE(c.unchanged(0) && c.unchanged(1));
  NonFiniteCase d(group, true, 0.0, false);
  EXPECT_EQ(d.step(group), SHARDMUON_ERROR_NON_FINITE);
  EXPECT_NE(std::string(shardmuon_last_error()).find("params[1]"), std::string::npos)
      << shardmuon_last_error();
  EXPECT_TRUE(d.unchanged(1));
  EXPECT_FALSE(d.unchanged(0));
}

TEST_F(NonFinite, ProceedWritesThroughAndOtherwiseMatchesSkip) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  NonFiniteCase skip(group, false, 0.0, false);
  ASSERT_EQ(skip.step(group), SHARDMUON_SUCCESS);
  ASSERT_EQ(
      shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_PROCEED),
      SHARDMUON_SUCCESS);
  NonFiniteCase proceed(group, false, 0.0, false);
  ASSERT_EQ(proceed.step(group), SHARDMUON_SUCCESS);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Harness::get().download(skip.w[i]), Harness::get().download(proceed.w[i]));
    EXPECT_EQ(Harness::get().download(skip.m[i]), Harness::get().download(proceed.m[i]));
  }
  NonFiniteCase poisoned(group, false, std::nan(""), true);
  ASSERT_EQ(poisoned.step(group), SHARDMUON_SUCCESS);
  EXPECT_FALSE(poisoned.all_finite(0));  // as documented: no check
}

// The step flag (shardmuon_context_set_step_flag) as another optimizer beside the step uses
// it: set on one rank before the step, it skips the step on every rank as a NaN would; after
// the step it holds the verdict on every rank, whichever set it (the caller's flag or a
// gradient); PROCEED neither reads nor writes it.
class StepFlag : public NonFinite {
 protected:
  float read(const Buffer& flag) const {
    return static_cast<float>(from_bytes(Harness::get().download(flag), SHARDMUON_FLOAT32)[0]);
  }
  Buffer flag_of(float value) const {
    return Harness::get().upload(to_bytes({static_cast<double>(value)}, SHARDMUON_FLOAT32));
  }
  void use(const Buffer& flag) const {
    ASSERT_EQ(
        shardmuon_context_set_step_flag(Harness::get().context(), static_cast<float*>(flag.data())),
        SHARDMUON_SUCCESS)
        << shardmuon_last_error();
  }
  void TearDown() override {
    shardmuon_context_set_step_flag(Harness::get().context(), nullptr);
    NonFinite::TearDown();
  }
};

TEST_F(StepFlag, SetOnOneRankSkipsTheStepEverywhereAndHoldsTheVerdict) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  const Buffer flag = flag_of(group.rank == group.size - 1 ? 1.0f : 0.0f);
  use(flag);
  int64_t steps0, params0, steps1, params1;
  counts(steps0, params0);
  NonFiniteCase c(group, false, 0.0, false);  // finite gradients everywhere
  EXPECT_EQ(c.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_TRUE(c.unchanged(0) && c.unchanged(1));
  EXPECT_NE(read(flag), 0.0f) << "rank " << group.rank;
  counts(steps1, params1);
  EXPECT_EQ(steps1, steps0 + 1);
  EXPECT_EQ(params1, params0);
}

// Set flags of opposite signs on two ranks: the step counts the ranks whose flag is set, so
// they skip it everywhere instead of summing to zero.
TEST_F(StepFlag, SetFlagsOfOppositeSignsDoNotCancel) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  if (group.size < 2) GTEST_SKIP() << "needs two ranks";
  const Buffer flag = flag_of(group.rank == 0 ? -1.0f : group.rank == 1 ? 1.0f : 0.0f);
  use(flag);
  NonFiniteCase c(group, false, 0.0, false);
  EXPECT_EQ(c.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_TRUE(c.unchanged(0) && c.unchanged(1)) << "rank " << group.rank;
  EXPECT_NE(read(flag), 0.0f) << "rank " << group.rank;
}

TEST_F(StepFlag, ClearGivesTheStepAndAGradientSetsIt) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  const Buffer flag = flag_of(0.0f);
  use(flag);
  NonFiniteCase plain(group, false, 0.0, false);
  NonFiniteCase flagged(group, false, 0.0, false);
  ASSERT_EQ(shardmuon_context_set_step_flag(Harness::get().context(), nullptr), SHARDMUON_SUCCESS);
  ASSERT_EQ(plain.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  use(flag);
  ASSERT_EQ(flagged.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_EQ(read(flag), 0.0f);
  for (int i = 0; i < 2; ++i) {  // a clear flag changes nothing of the step
    EXPECT_EQ(Harness::get().download(plain.w[i]), Harness::get().download(flagged.w[i]));
    EXPECT_EQ(Harness::get().download(plain.m[i]), Harness::get().download(flagged.m[i]));
  }
  // A NaN gradient on rank 0 only: every rank's flag says the step was skipped.
  NonFiniteCase poisoned(group, false, std::nan(""), group.rank == 0);
  ASSERT_EQ(poisoned.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_TRUE(poisoned.unchanged(0) && poisoned.unchanged(1));
  EXPECT_NE(read(flag), 0.0f) << "rank " << group.rank;
}

TEST_F(StepFlag, RaiseReportsItAndProceedIgnoresIt) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  const Buffer flag = flag_of(group.rank == 0 ? 1.0f : 0.0f);
  use(flag);
  ASSERT_EQ(
      shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_RAISE),
      SHARDMUON_SUCCESS);
  NonFiniteCase raised(group, false, 0.0, false);
  EXPECT_EQ(raised.step(group), SHARDMUON_ERROR_NON_FINITE);
  EXPECT_NE(std::string(shardmuon_last_error()).find("step flag"), std::string::npos)
      << shardmuon_last_error();
  EXPECT_TRUE(raised.unchanged(0) && raised.unchanged(1));
  ASSERT_EQ(
      shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_PROCEED),
      SHARDMUON_SUCCESS);
  const Buffer unread = flag_of(7.0f);
  use(unread);
  NonFiniteCase proceeded(group, false, 0.0, false);
  EXPECT_EQ(proceeded.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_FALSE(proceeded.unchanged(0) || proceeded.unchanged(1));
  EXPECT_EQ(read(unread), 7.0f);
}

#ifdef SHARDMUON_TEST_WITH_CUDA
// A step captured into a CUDA graph reads the flag and writes its verdict at every replay:
// set on rank 0 before a replay, that replay changes nothing on any rank and every rank's
// flag says so; cleared, the next replay steps.
TEST_F(StepFlag, ACapturedStepReadsAndWritesItAtEveryReplay) {
  if (!Harness::get().on_gpu()) GTEST_SKIP() << "CUDA graphs";
  if (Harness::get().comm_kind() == CommKind::kCallbacks) {
    GTEST_SKIP() << "MpiCallbacks synchronize the stream, which a capture cannot hold";
  }
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  const Harness& harness = Harness::get();
  cudaStream_t stream = static_cast<cudaStream_t>(harness.stream());
  const OwnedContext context = harness.own_context();  // a capture pins its workspace
  ASSERT_NE(context, nullptr) << shardmuon_last_error();
  const Buffer flag = flag_of(0.0f);
  ASSERT_EQ(shardmuon_context_set_step_flag(context.get(), static_cast<float*>(flag.data())),
            SHARDMUON_SUCCESS)
      << shardmuon_last_error();
  NonFiniteCase c(group, false, 0.0, false);
  auto step = [&] {
    return shardmuon_muon_step(context.get(), group.comm, c.params.data(), 2, c.groups.data(), 2,
                               stream);
  };
  ASSERT_TRUE(group_all(step() == SHARDMUON_SUCCESS, group.mpi)) << shardmuon_last_error();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const shardmuon_status captured = step();
  const std::string capture_error = shardmuon_last_error();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(group_all(captured == SHARDMUON_SUCCESS, group.mpi)) << capture_error;
  cudaGraphExec_t replay = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&replay, graph, 0), cudaSuccess);

  harness.synchronize();
  const std::vector<unsigned char> before = harness.download(c.w[0]);
  harness.upload_into(flag.data(), to_bytes({group.rank == 0 ? 1.0 : 0.0}, SHARDMUON_FLOAT32));
  ASSERT_EQ(cudaGraphLaunch(replay, stream), cudaSuccess);
  harness.synchronize();
  EXPECT_EQ(harness.download(c.w[0]), before) << "a flagged replay stepped, rank " << group.rank;
  EXPECT_NE(read(flag), 0.0f) << "rank " << group.rank;
  harness.upload_into(flag.data(), to_bytes({0.0}, SHARDMUON_FLOAT32));
  ASSERT_EQ(cudaGraphLaunch(replay, stream), cudaSuccess);
  harness.synchronize();
  EXPECT_TRUE(before.empty() || harness.download(c.w[0]) != before) << "rank " << group.rank;
  EXPECT_EQ(read(flag), 0.0f) << "rank " << group.rank;
  cudaGraphExecDestroy(replay);
  cudaGraphDestroy(graph);
}
#endif

TEST(StepFlagArguments, AMisalignedFlagIsRefusedByName) {
  float storage[2] = {0.0f, 0.0f};
  float* misaligned = reinterpret_cast<float*>(reinterpret_cast<char*>(storage) + 1);
  if (Harness::get().backend() != SHARDMUON_BACKEND_CPU) GTEST_SKIP() << "host memory";
  EXPECT_EQ(shardmuon_context_set_step_flag(Harness::get().context(), misaligned),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("flag must be 4-byte aligned"),
            std::string::npos)
      << shardmuon_last_error();
  EXPECT_EQ(shardmuon_context_set_step_flag(nullptr, storage), SHARDMUON_ERROR_INVALID_ARGUMENT);
}

// shardmuon_context_reduce_step_flag over several communicators, the way a step split over a
// mesh's dimensions uses it: reduced over each in turn, every rank holds the counts of set
// flags a host replay of the same reductions gives; so steps over those communicators afterwards
// all skip where, without it, the first step would have written.
class StepFlagReduction : public StepFlag {
 protected:
  shardmuon_status reduce(const Group& group) const {
    return shardmuon_context_reduce_step_flag(Harness::get().context(), group.comm,
                                              Harness::get().stream());
  }
};

TEST_F(StepFlagReduction, OverEachCommunicatorInTurnGivesTheReplayedCounts) {
  const int ranks = Harness::get().max_group_size();
  const int rank = Harness::get().world_rank();
  if (ranks < 2) GTEST_SKIP() << "needs two ranks";
  // Rank 0 starts with -1 and the last rank (in the largest group only) with 1: summed as they
  // are, on two ranks they would cancel.
  auto initial = [&](int r) { return (r == 0 ? -1.0 : 0.0) + (r == ranks - 1 ? 1.0 : 0.0); };
  std::vector<double> replay(ranks);
  for (int r = 0; r < ranks; ++r) replay[r] = initial(r);
  const Buffer flag = flag_of(static_cast<float>(initial(rank)));
  use(flag);
  for (int size = 2; size <= ranks; ++size) {  // the groups of the first 2, 3, ... ranks
    double set = 0.0;
    for (int r = 0; r < size; ++r) set += replay[r] != 0.0 ? 1.0 : 0.0;
    for (int r = 0; r < size; ++r) replay[r] = set;
    const Group& group = Harness::get().group(size);
    if (group.member) {
      ASSERT_EQ(reduce(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
    }
  }
  EXPECT_EQ(read(flag), static_cast<float>(replay[rank])) << "rank " << rank;
  EXPECT_NE(read(flag), 0.0f) << "rank " << rank;
}

TEST_F(StepFlagReduction, OverOneRankGivesACountToo) {
  const Group& alone = Harness::get().group(1);
  if (!alone.member) GTEST_SKIP() << "rank 0 alone";
  for (float initial : {-3.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 2.0f}) {
    const Buffer flag = flag_of(initial);
    use(flag);
    ASSERT_EQ(reduce(alone), SHARDMUON_SUCCESS) << shardmuon_last_error();
    EXPECT_EQ(read(flag), initial == 0.0f ? 0.0f : 1.0f) << "from " << initial;
  }
}

TEST_F(StepFlagReduction, BeforeStepsOverTwoCommunicatorsAllOfThemSkip) {
  const int ranks = Harness::get().max_group_size();
  if (ranks < 2) GTEST_SKIP() << "needs two ranks";
  const Group& pair = Harness::get().group(2);  // the first step's, on ranks 0 and 1
  const Group& all = Harness::get().group(ranks);
  // The last rank's own check found something (it sets its flag; all gradients are finite).
  const float mine = Harness::get().world_rank() == ranks - 1 ? 1.0f : 0.0f;
  for (bool reduced : {false, true}) {
    const Buffer flag = flag_of(mine);
    use(flag);
    if (reduced) {
      if (pair.member) {
        ASSERT_EQ(reduce(pair), SHARDMUON_SUCCESS) << shardmuon_last_error();
      }
      ASSERT_EQ(reduce(all), SHARDMUON_SUCCESS) << shardmuon_last_error();
    }
    NonFiniteCase second(all, false, 0.0, false);
    if (pair.member) {  // a case is built only on its group's ranks (it takes their shards)
      NonFiniteCase first(pair, false, 0.0, false);
      ASSERT_EQ(first.step(pair), SHARDMUON_SUCCESS) << shardmuon_last_error();
      // Without the reduction ranks 0 and 1 know nothing of the last rank's flag yet (where
      // it is one of them, with two ranks, they do).
      EXPECT_EQ(first.unchanged(0), reduced || ranks == 2) << "reduced " << reduced;
    }
    ASSERT_EQ(second.step(all), SHARDMUON_SUCCESS) << shardmuon_last_error();
    EXPECT_TRUE(second.unchanged(0) && second.unchanged(1)) << "reduced " << reduced;
  }
}

TEST_F(StepFlagReduction, RanksAgreeFirstOrAllFail) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member || group.size < 2) GTEST_SKIP() << "needs two ranks";
  const Buffer flag = flag_of(group.rank == 1 ? 1.0f : 0.0f);
  use(flag);
  shardmuon_muon_group defaults{};
  ASSERT_EQ(shardmuon_muon_group_default(&defaults), SHARDMUON_SUCCESS);
  // Rank 0 failed before the reduction and refuses it through a step (a negative count).
  const shardmuon_status refused =
      group.rank == 0 ? shardmuon_muon_step(Harness::get().context(), group.comm, nullptr, -1,
                                            &defaults, 1, Harness::get().stream())
                      : reduce(group);
  EXPECT_EQ(refused,
            group.rank == 0 ? SHARDMUON_ERROR_INVALID_ARGUMENT : SHARDMUON_ERROR_PEER_FAILED)
      << shardmuon_last_error();
  EXPECT_EQ(read(flag), group.rank == 1 ? 1.0f : 0.0f) << "reduced after a failure";
  // Rank 0 steps while the others reduce: their digests differ, nothing is written.
  NonFiniteCase c(group, false, 0.0, false);
  const shardmuon_status mixed = group.rank == 0 ? c.step(group) : reduce(group);
  EXPECT_EQ(mixed, SHARDMUON_ERROR_RANK_MISMATCH) << shardmuon_last_error();
  EXPECT_TRUE(c.unchanged(0) && c.unchanged(1));
  EXPECT_EQ(read(flag), group.rank == 1 ? 1.0f : 0.0f);
  // Rank 0 under another policy: the same.
  if (group.rank == 0) {
    ASSERT_EQ(
        shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_RAISE),
        SHARDMUON_SUCCESS);
  }
  EXPECT_EQ(reduce(group), SHARDMUON_ERROR_RANK_MISMATCH) << shardmuon_last_error();
  // Under a checked policy without a flag: refused by name on that rank.
  ASSERT_EQ(
      shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_SKIP),
      SHARDMUON_SUCCESS);
  if (group.rank == 0) {
    ASSERT_EQ(shardmuon_context_set_step_flag(Harness::get().context(), nullptr),
              SHARDMUON_SUCCESS);
  }
  const shardmuon_status flagless = reduce(group);
  EXPECT_EQ(flagless,
            group.rank == 0 ? SHARDMUON_ERROR_INVALID_ARGUMENT : SHARDMUON_ERROR_PEER_FAILED);
  if (group.rank == 0) {
    EXPECT_NE(std::string(shardmuon_last_error()).find("no step flag"), std::string::npos)
        << shardmuon_last_error();
  }
  // Under PROCEED no flag is needed, and the flags are left as they are.
  ASSERT_EQ(
      shardmuon_context_set_nonfinite_policy(Harness::get().context(), SHARDMUON_NONFINITE_PROCEED),
      SHARDMUON_SUCCESS);
  EXPECT_EQ(reduce(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
  EXPECT_EQ(read(flag), group.rank == 1 ? 1.0f : 0.0f);
}

TEST(StepFlagArguments, AReductionRefusesAContextThatIsNotOne) {
  const Group& group = Harness::get().group(1);
  if (!group.member) return;
  EXPECT_EQ(shardmuon_context_reduce_step_flag(nullptr, group.comm, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("context"), std::string::npos)
      << shardmuon_last_error();
  EXPECT_EQ(shardmuon_context_reduce_step_flag(Harness::get().context(), nullptr, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  // A step with no context sends its failure (it used to read the null context's settings).
  shardmuon_muon_group defaults{};
  ASSERT_EQ(shardmuon_muon_group_default(&defaults), SHARDMUON_SUCCESS);
  EXPECT_EQ(shardmuon_muon_step(nullptr, group.comm, nullptr, 0, &defaults, 1, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
}

// Zero and tiny gradients give finite updates (eps bounds the normalization).
TEST_F(NonFinite, ZeroAndTinyGradientsGiveFiniteUpdates) {
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  for (double scale : {0.0, 1e-30, 1e-40}) {
    NonFiniteCase c(group, false, 0.0, false);
    for (int i = 0; i < 2; ++i) {
      std::vector<double> tiny = from_bytes(Harness::get().download(c.g[i]), SHARDMUON_FLOAT32);
      for (double& v : tiny) v *= scale;
      c.g[i] = Harness::get().upload(to_bytes(tiny, SHARDMUON_FLOAT32));
      c.params[i].grad = c.g[i].data();
    }
    int64_t steps0, params0, steps1, params1;
    counts(steps0, params0);
    EXPECT_EQ(c.step(group), SHARDMUON_SUCCESS) << shardmuon_last_error();
    EXPECT_TRUE(c.all_finite(0) && c.all_finite(1)) << "scale " << scale;
    counts(steps1, params1);
    EXPECT_EQ(steps1, steps0);
    EXPECT_EQ(params1, params0);
  }
}

}  // namespace
}  // namespace shardmuon_test
