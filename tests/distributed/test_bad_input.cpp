// Bad input: every invalid argument gives a clear error naming it, leaves the caller's
// buffer bit-identical, and, when only some ranks are at fault or the ranks disagree,
// every rank returns an error instead of hanging.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../common/harness.h"
#include "../common/ns_runner.h"
#include "../common/reference.h"

namespace shardmuon_test {
namespace {

// A value outside an enum's enumerators, as a C caller can pass one.
template <typename Enum>
Enum out_of_range(int value) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized");
  Enum result;
  std::memcpy(&result, &value, sizeof result);
  return result;
}

// One call's arguments, which each case perturbs.
struct Call {
  Matrix input = random_gaussian(23, 41, 5);
  shardmuon_dtype dtype = SHARDMUON_FLOAT32;
  shardmuon_partition partition = SHARDMUON_SHARDED_DIM1;
  std::vector<int64_t> sizes;  // filled for the group
  int num_shards = 0;
  shardmuon_ns_options options = make_options(SHARDMUON_SCHEDULE_QUINTIC, 5, SHARDMUON_NS_AUTO);
  shardmuon_context_t context = nullptr;
  shardmuon_comm_t comm = nullptr;
  bool null_layout = false, null_options = false, null_shard = false;
  size_t pointer_offset = 0;  // bytes added to the shard pointer (misalignment)
};

struct Outcome {
  shardmuon_status status;
  std::string error;
  bool buffer_unchanged;
};

Call valid_call(const Group& group) {
  Call call;
  call.context = Harness::get().context();
  call.comm = group.comm;
  call.sizes = uneven_sizes(call.input.cols, group.size);
  call.num_shards = group.size;
  return call;
}

// Runs the call on a fresh copy of the rank's shard and reports whether its bytes survived.
// The buffer is as large as the whole matrix (plus room for a misaligned pointer), so even
// a call that wrongly went ahead would stay inside it.
Outcome perform(const Group& group, const Call& call) {
  const Harness& harness = Harness::get();
  const std::vector<double> shard = extract_shard(
      call.input, call.partition, uneven_sizes(call.input.cols, group.size), group.rank);
  const shardmuon_dtype storage =
      call.dtype == SHARDMUON_BFLOAT16 || call.dtype == SHARDMUON_FLOAT64 ? call.dtype
                                                                          : SHARDMUON_FLOAT32;
  std::vector<unsigned char> bytes = to_bytes(shard, storage);
  bytes.resize(call.input.values.size() * 8 + 8, 0xAB);
  Buffer buffer = harness.upload(bytes);
  shardmuon_layout layout = make_layout(call.input, call.partition, call.num_shards, call.sizes);
  void* pointer =
      call.null_shard ? nullptr : static_cast<char*>(buffer.data()) + call.pointer_offset;
  Outcome outcome;
  outcome.status = shardmuon_newton_schulz(
      call.context, call.comm, pointer, call.dtype, call.null_layout ? nullptr : &layout,
      call.null_options ? nullptr : &call.options, harness.stream());
  outcome.error = shardmuon_last_error();
  outcome.buffer_unchanged = harness.download(buffer) == bytes;
  return outcome;
}

struct BadCase {
  const char* name;
  std::function<void(Call&)> perturb;
  shardmuon_status expected;
  const char* message;  // a fragment the error must contain
};

const std::vector<BadCase>& bad_cases() {
  static const std::vector<double> two_triples = {3, -3, 1, 2, -2, 1};
  static const std::vector<double> nan_triple = {3, -3, 1,  2,   -2, 1, 1, 0.0 / 0.0,
                                                 1, 2,  -1, 0.5, 1,  1, 1};
  static const std::vector<BadCase> cases = {
      {"null context", [](Call& c) { c.context = nullptr; }, SHARDMUON_ERROR_INVALID_ARGUMENT,
       "context is NULL"},
      {"null layout", [](Call& c) { c.null_layout = true; }, SHARDMUON_ERROR_INVALID_ARGUMENT,
       "layout is NULL"},
      {"null options", [](Call& c) { c.null_options = true; }, SHARDMUON_ERROR_INVALID_ARGUMENT,
       "options is NULL"},
      {"null shard",  // balanced sizes: every rank's shard is non-empty
       [](Call& c) {
         c.null_shard = true;
         c.sizes = balanced_sizes(c.input.cols, static_cast<int>(c.sizes.size()));
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "local_shard is NULL"},
      {"misaligned shard",  // balanced sizes: every rank's shard is non-empty
       [](Call& c) {
         c.pointer_offset = 2;
         c.sizes = balanced_sizes(c.input.cols, static_cast<int>(c.sizes.size()));
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "not aligned"},
      {"unknown dtype", [](Call& c) { c.dtype = out_of_range<shardmuon_dtype>(7); },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "dtype is unknown: 7"},
      {"unknown schedule",
       [](Call& c) { c.options.schedule = out_of_range<shardmuon_schedule>(42); },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "options->schedule is unknown: 42"},
      {"zero iterations", [](Call& c) { c.options.num_iterations = 0; },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "num_iterations must be in [1, 1000], got 0"},
      {"too many iterations",
       [](Call& c) { c.options.num_iterations = SHARDMUON_MAX_NS_ITERATIONS + 1; },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "num_iterations must be in [1, 1000], got 1001"},
      {"custom list too short",
       [](Call& c) {
         c.options.schedule = SHARDMUON_SCHEDULE_CUSTOM;
         c.options.custom_coefficients = two_triples.data();
         c.options.num_custom_coefficients = 2;
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "num_custom_coefficients must equal num_iterations (5"},
      {"custom list null",
       [](Call& c) {
         c.options.schedule = SHARDMUON_SCHEDULE_CUSTOM;
         c.options.num_custom_coefficients = 5;
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "custom_coefficients is NULL"},
      {"custom coefficient NaN",
       [](Call& c) {
         c.options.schedule = SHARDMUON_SCHEDULE_CUSTOM;
         c.options.custom_coefficients = nan_triple.data();
         c.options.num_custom_coefficients = 5;
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "custom_coefficients[7] is not finite"},
      {"negative eps", [](Call& c) { c.options.eps = -1; }, SHARDMUON_ERROR_INVALID_ARGUMENT,
       "options->eps must be finite and >= 0, got -1"},
      {"unknown algorithm",
       [](Call& c) { c.options.algorithm = out_of_range<shardmuon_ns_algorithm>(9); },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "options->algorithm is unknown: 9"},
      {"zero rows",
       [](Call& c) {
         c.input = Matrix(0, 41);
         c.partition = SHARDMUON_REPLICATED;
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "layout->rows must be >= 1, got 0"},
      {"unknown partition", [](Call& c) { c.partition = out_of_range<shardmuon_partition>(5); },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "layout->partition is unknown: 5"},
      {"flat shards under the Gram all-reduce",
       [](Call& c) {
         c.partition = SHARDMUON_SHARDED_FLAT;
         c.sizes = uneven_sizes(c.input.rows * c.input.cols, static_cast<int>(c.sizes.size()));
         c.options.algorithm = SHARDMUON_NS_GRAM_ALLREDUCE;
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT,
       "options->algorithm, layout: algorithm GRAM_ALLREDUCE needs shards along dim 0 or 1"},
      {"flat shard sizes do not add up",
       [](Call& c) {
         c.partition = SHARDMUON_SHARDED_FLAT;
         c.sizes = uneven_sizes(c.input.rows * c.input.cols - 1, static_cast<int>(c.sizes.size()));
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "but the sharded elements number"},
      {"shard sizes do not add up", [](Call& c) { c.sizes.front() -= 1; },
       SHARDMUON_ERROR_INVALID_ARGUMENT,
       "layout->shard_sizes add up to 40, but the sharded cols number 41"},
      {"negative shard size",
       [](Call& c) {  // still adds up
         c.sizes.back() += c.sizes.front() + 1;
         c.sizes.front() = -1;
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "layout->shard_sizes[0] = -1 is outside [0, 41]"},
      {"shard count is not the group size",
       [](Call& c) {
         c.num_shards += 1;
         c.sizes.push_back(0);
       },
       SHARDMUON_ERROR_INVALID_ARGUMENT, "must equal the communicator's size"},
  };
  return cases;
}

class BadInput : public DistributedTest {};

// Every rank passes the same bad argument: every rank gets the error naming it.
TEST_F(BadInput, EveryRankAtFault) {
  for_each_group(1, [&](const Group& group) {
    const int p = group.size;
    for (const BadCase& bad : bad_cases()) {
      Call call = valid_call(group);
      bad.perturb(call);
      const Outcome outcome = perform(group, call);
      EXPECT_EQ(outcome.status, bad.expected) << bad.name << " (P=" << p << "): " << outcome.error;
      EXPECT_NE(outcome.error.find(bad.message), std::string::npos)
          << bad.name << ": message \"" << outcome.error << "\" lacks \"" << bad.message << "\"";
      EXPECT_TRUE(outcome.buffer_unchanged) << bad.name;
    }
  });
}

// Only the group's last rank passes the bad argument: it gets the error naming it, every
// other rank PEER_FAILED naming that rank; no rank hangs, nothing is modified.
TEST_F(BadInput, OneRankAtFaultFailsEveryRank) {
  for_each_group(2, [&](const Group& group) {
    const int p = group.size;
    const bool at_fault = group.rank == p - 1;
    for (const BadCase& bad : bad_cases()) {
      Call call = valid_call(group);
      if (at_fault) bad.perturb(call);
      const Outcome outcome = perform(group, call);
      if (at_fault) {
        EXPECT_EQ(outcome.status, bad.expected) << bad.name << ": " << outcome.error;
        EXPECT_NE(outcome.error.find(bad.message), std::string::npos) << outcome.error;
      } else {
        EXPECT_EQ(outcome.status, SHARDMUON_ERROR_PEER_FAILED) << bad.name << ": " << outcome.error;
        EXPECT_NE(outcome.error.find("rank " + std::to_string(p - 1)), std::string::npos)
            << outcome.error;
      }
      EXPECT_TRUE(outcome.buffer_unchanged) << bad.name;
    }
    // The communicator still works after all of that.
    const Outcome fine = perform(group, valid_call(group));
    EXPECT_EQ(fine.status, SHARDMUON_SUCCESS) << fine.error;
  });
}

// Valid arguments that differ between ranks: RANK_MISMATCH on every rank.
TEST_F(BadInput, RanksThatDisagreeAllFail) {
  const std::vector<std::pair<const char*, std::function<void(Call&)>>> disagreements = {
      {"other shape", [](Call& c) { c.input = random_gaussian(24, 41, 5); }},
      {"other shard sizes",
       [](Call& c) { c.sizes = balanced_sizes(41, static_cast<int>(c.sizes.size())); }},
      {"other dtype", [](Call& c) { c.dtype = SHARDMUON_BFLOAT16; }},
      {"other iterations", [](Call& c) { c.options.num_iterations = 6; }},
      {"other schedule", [](Call& c) { c.options.schedule = SHARDMUON_SCHEDULE_AOL; }},
      {"other eps", [](Call& c) { c.options.eps = 1e-6; }},
      {"other algorithm", [](Call& c) { c.options.algorithm = SHARDMUON_NS_DUPLICATED; }},
      {"other partition", [](Call& c) { c.partition = SHARDMUON_REPLICATED; }},
  };
  for_each_group(2, [&](const Group& group) {
    for (const auto& [name, perturb] : disagreements) {
      Call call = valid_call(group);
      if (group.rank == 0) perturb(call);
      const Outcome outcome = perform(group, call);
      EXPECT_EQ(outcome.status, SHARDMUON_ERROR_RANK_MISMATCH) << name << ": " << outcome.error;
      EXPECT_NE(outcome.error.find("disagree"), std::string::npos) << outcome.error;
      EXPECT_TRUE(outcome.buffer_unchanged) << name;
    }
  });
}

TEST_F(BadInput, HandlesAndHelpers) {
  EXPECT_EQ(shardmuon_newton_schulz(Harness::get().context(), nullptr, nullptr, SHARDMUON_FLOAT32,
                                    nullptr, nullptr, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("comm is NULL"), std::string::npos);

  shardmuon_schedule schedule;
  EXPECT_EQ(shardmuon_schedule_from_name("quintc", &schedule), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("\"quintc\""), std::string::npos);
  EXPECT_EQ(shardmuon_schedule_from_name("polar_express", &schedule), SHARDMUON_SUCCESS);
  EXPECT_EQ(schedule, SHARDMUON_SCHEDULE_POLAR_EXPRESS);
  EXPECT_STREQ(shardmuon_last_error(), "");  // a successful call clears the message

  shardmuon_context_t context = nullptr;
  EXPECT_EQ(shardmuon_context_create(out_of_range<shardmuon_backend>(3), 0, &context),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(context, nullptr);
  EXPECT_EQ(shardmuon_comm_create_mpi(nullptr, nullptr), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardmuon_context_destroy(nullptr), SHARDMUON_SUCCESS);
  EXPECT_EQ(shardmuon_comm_destroy(nullptr), SHARDMUON_SUCCESS);

  int has_cuda = 0, has_nccl = 0, has_mpi = 0;
  ASSERT_EQ(shardmuon_build_info(&has_cuda, &has_nccl, &has_mpi), SHARDMUON_SUCCESS);
  EXPECT_EQ(has_mpi, 1);  // this test binary runs over MPI
  if (!has_cuda) {
    EXPECT_EQ(shardmuon_context_create(SHARDMUON_BACKEND_CUDA, 0, &context),
              SHARDMUON_ERROR_NOT_BUILT);
    EXPECT_NE(std::string(shardmuon_last_error()).find("built without CUDA"), std::string::npos);
  }
  if (!has_nccl) {
    shardmuon_comm_t comm = nullptr;
    int dummy = 0;
    EXPECT_EQ(shardmuon_comm_create_nccl(&dummy, &comm), SHARDMUON_ERROR_NOT_BUILT);
  }
}

// The CUDA backend refuses what it cannot compute on.
TEST_F(BadInput, CudaBackendChecksMemoryAndDtype) {
  if (!Harness::get().on_gpu()) GTEST_SKIP() << "CUDA backend only";
  const Group& group = Harness::get().group(1);
  if (!group.member) return;
  Call call = valid_call(group);
  call.dtype = SHARDMUON_FLOAT64;
  Outcome outcome = perform(group, call);
  EXPECT_EQ(outcome.status, SHARDMUON_ERROR_UNSUPPORTED) << outcome.error;
  EXPECT_TRUE(outcome.buffer_unchanged);

  std::vector<float> host(23 * 41, 1.0f);
  const shardmuon_layout layout = make_layout(call.input, SHARDMUON_REPLICATED, 1, {});
  const shardmuon_ns_options options =
      make_options(SHARDMUON_SCHEDULE_QUINTIC, 5, SHARDMUON_NS_AUTO);
  EXPECT_EQ(shardmuon_newton_schulz(Harness::get().context(), group.comm, host.data(),
                                    SHARDMUON_FLOAT32, &layout, &options, Harness::get().stream()),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("host memory"), std::string::npos)
      << shardmuon_last_error();
  EXPECT_EQ(host, std::vector<float>(23 * 41, 1.0f));
}

// OpenBLAS takes 32-bit dimensions: a 64 x 2^31 matrix is refused while validating, naming
// the argument, on every rank, before anything is allocated or any collective entered.
TEST_F(BadInput, CpuBackendRefusesDimensionsBeyondItsBlas) {
  if (Harness::get().on_gpu()) GTEST_SKIP() << "CPU backend only";
  for_each_group(1, [&](const Group& group) {
    const int64_t rows = 64, cols = int64_t{1} << 31;
    std::vector<int64_t> sizes(group.size, 1);
    sizes.back() = cols - (group.size - 1);
    const shardmuon_layout layout{rows, cols, SHARDMUON_SHARDED_DIM1, group.size, sizes.data()};
    const shardmuon_ns_options options =
        make_options(SHARDMUON_SCHEDULE_QUINTIC, 5, SHARDMUON_NS_AUTO);
    // Small buffers: a refused call never reads them.
    std::vector<float> param(64, 1.0f), grad(64, 2.0f), momentum(64, 3.0f);
    EXPECT_EQ(shardmuon_newton_schulz(Harness::get().context(), group.comm, param.data(),
                                      SHARDMUON_FLOAT32, &layout, &options, nullptr),
              SHARDMUON_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(shardmuon_last_error()).find("layout is 64 x 2147483648"),
              std::string::npos)
        << shardmuon_last_error();

    shardmuon_muon_group hyper;
    ASSERT_EQ(shardmuon_muon_group_default(&hyper), SHARDMUON_SUCCESS);
    shardmuon_muon_param entry{};
    entry.param = param.data();
    entry.grad = grad.data();
    entry.momentum = momentum.data();
    entry.dtype = SHARDMUON_FLOAT32;
    entry.layout = layout;
    EXPECT_EQ(
        shardmuon_muon_step(Harness::get().context(), group.comm, &entry, 1, &hyper, 1, nullptr),
        SHARDMUON_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(shardmuon_last_error()).find("params[0].layout is 64 x 2147483648"),
              std::string::npos)
        << shardmuon_last_error();
    EXPECT_EQ(param, std::vector<float>(64, 1.0f));
    EXPECT_EQ(momentum, std::vector<float>(64, 3.0f));
  });
}

// One rank cannot allocate its workspace (its shard of a 64 x 2^31 bf16 matrix needs two
// 275 GB iterates) while the others, holding one column each, can: it reports OUT_OF_MEMORY,
// the others PEER_FAILED, before any collective.
TEST_F(BadInput, WorkspaceOutOfMemoryFailsEveryRank) {
  if (!Harness::get().on_gpu())
    GTEST_SKIP() << "CUDA backend only (host allocation may overcommit)";
  const int p = Harness::get().max_group_size();
  const Group& group = Harness::get().group(p);
  if (!group.member) return;
  const int64_t rows = 64, cols = int64_t{1} << 31;  // long side: the columns
  std::vector<int64_t> sizes(p, 1);
  sizes.back() = cols - (p - 1);
  shardmuon_layout layout{rows, cols, SHARDMUON_SHARDED_DIM1, p, sizes.data()};
  const shardmuon_ns_options options =
      make_options(SHARDMUON_SCHEDULE_QUINTIC, 5, SHARDMUON_NS_AUTO);
  // The buffer only has to be device memory: a failing call must not touch it.
  const std::vector<unsigned char> bytes(4096, 0x5A);
  Buffer buffer = Harness::get().upload(bytes);
  const shardmuon_status status =
      shardmuon_newton_schulz(Harness::get().context(), group.comm, buffer.data(),
                              SHARDMUON_BFLOAT16, &layout, &options, Harness::get().stream());
  const std::string error = shardmuon_last_error();
  if (group.rank == p - 1) {
    EXPECT_EQ(status, SHARDMUON_ERROR_OUT_OF_MEMORY) << error;
  } else {
    EXPECT_EQ(status, SHARDMUON_ERROR_PEER_FAILED) << error;
  }
  EXPECT_EQ(Harness::get().download(buffer), bytes);
  // And the context still works afterwards.
  Call call = valid_call(group);
  call.dtype = SHARDMUON_BFLOAT16;
  const Outcome fine = perform(group, call);
  EXPECT_EQ(fine.status, SHARDMUON_SUCCESS) << fine.error;
}

}  // namespace
}  // namespace shardmuon_test
