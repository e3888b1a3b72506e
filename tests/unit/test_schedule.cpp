// The coefficient schedules against DESIGN.md's tables and their cycle / repeat-last rules,
// schedule names, and the plans the library reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../common/harness.h"
#include "../common/reference.h"

namespace shardmuon_test {
namespace {

class Schedules : public DistributedTest {};

// What shardmuon_ns_plan, shardmuon_ns_plan_gram_iteration and shardmuon_ns_plan_applied_twice
// report for these arguments (the default options otherwise).
struct ReportedPlan {
  shardmuon_ns_algorithm algorithm = SHARDMUON_NS_AUTO;
  int gram_iteration = -1;
  int applied_twice = -1;
};
ReportedPlan plan_of(int64_t rows, int64_t cols, shardmuon_partition partition, int ranks,
                     shardmuon_ns_algorithm requested,
                     shardmuon_schedule schedule = SHARDMUON_SCHEDULE_QUINTIC) {
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  options.algorithm = requested;
  options.schedule = schedule;
  const shardmuon_layout layout{rows, cols, partition, ranks, nullptr};
  ReportedPlan plan;
  EXPECT_EQ(shardmuon_ns_plan(&layout, ranks, &options, &plan.algorithm), SHARDMUON_SUCCESS)
      << shardmuon_last_error();
  EXPECT_EQ(shardmuon_ns_plan_gram_iteration(&layout, ranks, &options, &plan.gram_iteration),
            SHARDMUON_SUCCESS)
      << shardmuon_last_error();
  EXPECT_EQ(shardmuon_ns_plan_applied_twice(&layout, ranks, &options, &plan.applied_twice),
            SHARDMUON_SUCCESS)
      << shardmuon_last_error();
  return plan;
}

TEST_F(Schedules, TablesAndRulesMatchTheDesign) {
  for (shardmuon_schedule schedule :
       {SHARDMUON_SCHEDULE_SIMPLE, SHARDMUON_SCHEDULE_QUINTIC, SHARDMUON_SCHEDULE_POLAR_EXPRESS,
        SHARDMUON_SCHEDULE_CANS, SHARDMUON_SCHEDULE_AOL}) {
    const std::vector<Triple> expected = coefficients_for(schedule, 20);
    for (int k = 0; k < 20; ++k) {
      double a, b, c;
      ASSERT_EQ(shardmuon_schedule_coefficients(schedule, k, nullptr, &a, &b, &c),
                SHARDMUON_SUCCESS);
      EXPECT_EQ(a, expected[k].a) << "schedule " << schedule << " iteration " << k;
      EXPECT_EQ(b, expected[k].b) << "schedule " << schedule << " iteration " << k;
      EXPECT_EQ(c, expected[k].c) << "schedule " << schedule << " iteration " << k;
    }
  }
  // Spot checks of the rules themselves: quintic cycles after 5, polar_express repeats its 8th.
  double a, b, c;
  shardmuon_schedule_coefficients(SHARDMUON_SCHEDULE_QUINTIC, 5, nullptr, &a, &b, &c);
  EXPECT_EQ(a, 4.0848);
  shardmuon_schedule_coefficients(SHARDMUON_SCHEDULE_POLAR_EXPRESS, 11, nullptr, &a, &b, &c);
  EXPECT_EQ(a, 1.8750);
  EXPECT_EQ(c, 0.3750);
}

TEST_F(Schedules, CustomCoefficientsAndNames) {
  const double triples[] = {1, 2, 3, 4, 5, 6};
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  EXPECT_EQ(options.num_iterations, 5);
  EXPECT_EQ(options.schedule, SHARDMUON_SCHEDULE_QUINTIC);
  EXPECT_EQ(options.eps, 1e-7);
  options.schedule = SHARDMUON_SCHEDULE_CUSTOM;
  options.num_iterations = 2;
  options.custom_coefficients = triples;
  options.num_custom_coefficients = 2;
  double a, b, c;
  ASSERT_EQ(shardmuon_schedule_coefficients(SHARDMUON_SCHEDULE_CUSTOM, 1, &options, &a, &b, &c),
            SHARDMUON_SUCCESS);
  EXPECT_EQ(a, 4);
  EXPECT_EQ(c, 6);
  EXPECT_EQ(shardmuon_schedule_coefficients(SHARDMUON_SCHEDULE_CUSTOM, 2, &options, &a, &b, &c),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  // Options of another schedule hold no custom coefficients (they used to give quintic's).
  shardmuon_ns_options quintic;
  shardmuon_ns_options_default(&quintic);
  EXPECT_EQ(shardmuon_schedule_coefficients(SHARDMUON_SCHEDULE_CUSTOM, 0, &quintic, &a, &b, &c),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("options->schedule is quintic"),
            std::string::npos)
      << shardmuon_last_error();

  const char* names[] = {"simple", "quintic", "polar_express", "cans", "aol", "custom"};
  for (int s = 0; s < 6; ++s) {
    shardmuon_schedule parsed;
    ASSERT_EQ(shardmuon_schedule_from_name(names[s], &parsed), SHARDMUON_SUCCESS) << names[s];
    EXPECT_EQ(parsed, s);
  }
}

// Shard sizes each within the extent whose int64 sum wraps around to it (33 x 2^59 = 2^64 +
// 2^59): the sum is checked before each addition.
TEST_F(Schedules, ShardSizesWhoseSumWrapsAroundAreRefused) {
  const int ranks = 34;
  const int64_t rows = int64_t{1} << 59;
  std::vector<int64_t> sizes(ranks, rows);
  sizes[ranks - 1] = 0;
  const shardmuon_layout layout{rows, 1, SHARDMUON_SHARDED_DIM0, ranks, sizes.data()};
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  shardmuon_ns_algorithm chosen;
  EXPECT_EQ(shardmuon_ns_plan(&layout, ranks, &options, &chosen), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("layout->shard_sizes[0..1] add up to more"),
            std::string::npos)
      << shardmuon_last_error();
}

TEST_F(Schedules, PlansFollowTheLayout) {
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  auto plan = [](int64_t rows, int64_t cols, shardmuon_partition partition, int ranks,
                 shardmuon_ns_algorithm requested) {
    return plan_of(rows, cols, partition, ranks, requested).algorithm;
  };
  const shardmuon_ns_algorithm gram = SHARDMUON_NS_GRAM_ALLREDUCE;
  // Wide matrix: the long side is the columns.
  EXPECT_EQ(plan(64, 257, SHARDMUON_SHARDED_DIM1, 2, gram), SHARDMUON_NS_GRAM_ALLREDUCE);
  EXPECT_EQ(plan(64, 257, SHARDMUON_SHARDED_DIM0, 2, gram),
            SHARDMUON_NS_GRAM_ALLREDUCE_REDISTRIBUTED);
  // Tall matrix: the long side is the rows.
  EXPECT_EQ(plan(257, 64, SHARDMUON_SHARDED_DIM0, 3, gram), SHARDMUON_NS_GRAM_ALLREDUCE);
  EXPECT_EQ(plan(257, 64, SHARDMUON_SHARDED_DIM1, 3, gram),
            SHARDMUON_NS_GRAM_ALLREDUCE_REDISTRIBUTED);
  // Square: whichever dim is sharded is treated as the long side.
  EXPECT_EQ(plan(61, 61, SHARDMUON_SHARDED_DIM0, 2, gram), SHARDMUON_NS_GRAM_ALLREDUCE);
  EXPECT_EQ(plan(61, 61, SHARDMUON_SHARDED_DIM1, 2, gram), SHARDMUON_NS_GRAM_ALLREDUCE);
  // AUTO asks the cost model: small matrices are cheaper gathered (the collectives' fixed
  // costs dominate), large ones with the Gram all-reduce, on the long side or moved there
  // (measured on 2 H200s: docs/BENCHMARKS.md).
  EXPECT_EQ(plan(64, 257, SHARDMUON_SHARDED_DIM1, 2, SHARDMUON_NS_AUTO), SHARDMUON_NS_DUPLICATED);
  EXPECT_EQ(plan(2048, 2048, SHARDMUON_SHARDED_DIM0, 4, SHARDMUON_NS_AUTO),
            SHARDMUON_NS_DUPLICATED);
  EXPECT_EQ(plan(8192, 28672, SHARDMUON_SHARDED_DIM1, 2, SHARDMUON_NS_AUTO),
            SHARDMUON_NS_GRAM_ALLREDUCE);
  EXPECT_EQ(plan(8192, 28672, SHARDMUON_SHARDED_DIM0, 2, SHARDMUON_NS_AUTO),
            SHARDMUON_NS_GRAM_ALLREDUCE_REDISTRIBUTED);
  EXPECT_EQ(plan(28672, 8192, SHARDMUON_SHARDED_DIM0, 8, SHARDMUON_NS_AUTO),
            SHARDMUON_NS_GRAM_ALLREDUCE);
  EXPECT_EQ(plan(8192, 8192, SHARDMUON_SHARDED_DIM1, 2, SHARDMUON_NS_AUTO),
            SHARDMUON_NS_GRAM_ALLREDUCE);
  EXPECT_EQ(plan(64, 257, SHARDMUON_SHARDED_DIM0, 2, SHARDMUON_NS_DUPLICATED),
            SHARDMUON_NS_DUPLICATED);
  EXPECT_EQ(plan(64, 257, SHARDMUON_REPLICATED, 4, SHARDMUON_NS_AUTO), SHARDMUON_NS_LOCAL);
  // The estimate is of the plan AUTO picks: never more than another request's, (e) included.
  for (const int64_t side : {512, 4096, 8192}) {
    shardmuon_layout layout{side, 3 * side, SHARDMUON_SHARDED_DIM1, 2, nullptr};
    auto estimate = [&](shardmuon_ns_algorithm algorithm) {
      options.algorithm = algorithm;
      double seconds = 0;
      EXPECT_EQ(shardmuon_ns_estimate(&layout, 2, &options, &seconds), SHARDMUON_SUCCESS);
      return seconds;
    };
    const double chosen = estimate(SHARDMUON_NS_AUTO);
    EXPECT_GT(chosen, 0.0);
    EXPECT_EQ(chosen,
              std::min({estimate(SHARDMUON_NS_DUPLICATED), estimate(SHARDMUON_NS_GRAM_ALLREDUCE),
                        estimate(SHARDMUON_NS_GRAM_NEWTON_SCHULZ),
                        estimate(SHARDMUON_NS_GRAM_APPLIED_TWICE)}))
        << "side " << side;
  }
  EXPECT_EQ(plan(64, 257, SHARDMUON_SHARDED_DIM1, 1, SHARDMUON_NS_DUPLICATED), SHARDMUON_NS_LOCAL);

  // (e) on one rank (where DUPLICATED names the standard iteration): about two thirds of its work
  // when the long side is seven times the short one (the Llama-8B gate+up); no saving on a square
  // matrix, where it runs more products of the short side.
  auto local_seconds = [&](int64_t rows, int64_t cols, shardmuon_ns_algorithm algorithm) {
    shardmuon_layout layout{rows, cols, SHARDMUON_REPLICATED, 1, nullptr};
    options.algorithm = algorithm;
    double seconds = 0;
    EXPECT_EQ(shardmuon_ns_estimate(&layout, 1, &options, &seconds), SHARDMUON_SUCCESS);
    return seconds;
  };
  const double long_ratio = local_seconds(28672, 4096, SHARDMUON_NS_GRAM_NEWTON_SCHULZ) /
                            local_seconds(28672, 4096, SHARDMUON_NS_DUPLICATED);
  EXPECT_GT(long_ratio, 0.55);
  EXPECT_LT(long_ratio, 0.8);
  EXPECT_GE(local_seconds(4096, 4096, SHARDMUON_NS_GRAM_NEWTON_SCHULZ),
            local_seconds(4096, 4096, SHARDMUON_NS_DUPLICATED));
}

// (c) takes 5 s^2 L / P flops a rank and iteration against (b)'s 3 s^2 L / P + s^3: AUTO runs it
// on a Gram summed over the group where s > 2 L / P (square matrices from 3 ranks on), never
// on one rank, where it is never fewer flops, and never for CANS (plan_newton_schulz says why).
TEST_F(Schedules, AutoAppliesTheGramTwiceWhereItIsCheaper) {
  auto twice = [](int64_t rows, int64_t cols, shardmuon_partition partition, int ranks,
                  shardmuon_ns_algorithm requested,
                  shardmuon_schedule schedule = SHARDMUON_SCHEDULE_QUINTIC) {
    const ReportedPlan plan = plan_of(rows, cols, partition, ranks, requested, schedule);
    EXPECT_FALSE(plan.applied_twice == 1 && plan.gram_iteration == 1);
    return plan.applied_twice;
  };
  const shardmuon_ns_algorithm automatic = SHARDMUON_NS_AUTO;
  for (const shardmuon_partition partition : {SHARDMUON_SHARDED_DIM0, SHARDMUON_SHARDED_DIM1}) {
    for (const int ranks : {4, 8}) {
      EXPECT_EQ(twice(8192, 8192, partition, ranks, automatic), 1) << ranks;
      EXPECT_EQ(twice(16384, 16384, partition, ranks, automatic), 1) << ranks;
      EXPECT_EQ(plan_of(8192, 8192, partition, ranks, automatic).algorithm,
                SHARDMUON_NS_GRAM_ALLREDUCE);
      EXPECT_EQ(twice(8192, 8192, partition, ranks, automatic, SHARDMUON_SCHEDULE_CANS), 0);
    }
    // s < 2 L / P: (b), or (e) on a long side.
    EXPECT_EQ(twice(8192, 28672, partition, 2, automatic), 0);
    EXPECT_EQ(twice(28672, 8192, partition, 2, automatic), 0);
    EXPECT_EQ(twice(4096, 14336, partition, 4, automatic), 0);
    // Where the planner gathers small matrices, there is no summed Gram.
    EXPECT_EQ(twice(256, 256, partition, 8, automatic), 0);
    // The other requests decide it themselves.
    EXPECT_EQ(twice(8192, 8192, partition, 8, SHARDMUON_NS_GRAM_ALLREDUCE), 0);
    EXPECT_EQ(twice(8192, 8192, partition, 8, SHARDMUON_NS_DUPLICATED), 0);
    EXPECT_EQ(twice(8192, 8192, partition, 8, SHARDMUON_NS_GRAM_NEWTON_SCHULZ), 0);
    EXPECT_EQ(twice(64, 257, partition, 2, SHARDMUON_NS_GRAM_APPLIED_TWICE), 1);
  }
  // One rank: never under AUTO (a square matrix too); where requested, the whole matrix.
  EXPECT_EQ(twice(8192, 8192, SHARDMUON_REPLICATED, 1, automatic), 0);
  EXPECT_EQ(twice(64, 64, SHARDMUON_REPLICATED, 1, automatic), 0);
  EXPECT_EQ(twice(64, 64, SHARDMUON_REPLICATED, 1, SHARDMUON_NS_GRAM_APPLIED_TWICE), 1);
  EXPECT_EQ(plan_of(64, 64, SHARDMUON_REPLICATED, 1, SHARDMUON_NS_GRAM_APPLIED_TWICE).algorithm,
            SHARDMUON_NS_LOCAL);
  // Flat shards hold no block of the long side: refused, naming the request.
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  options.algorithm = SHARDMUON_NS_GRAM_APPLIED_TWICE;
  const shardmuon_layout flat{64, 64, SHARDMUON_SHARDED_FLAT, 2, nullptr};
  shardmuon_ns_algorithm chosen = SHARDMUON_NS_AUTO;
  EXPECT_EQ(shardmuon_ns_plan(&flat, 2, &options, &chosen), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("algorithm GRAM_APPLIED_TWICE needs shards"),
            std::string::npos)
      << shardmuon_last_error();
  const shardmuon_layout whole{64, 64, SHARDMUON_REPLICATED, 1, nullptr};
  // CANS is refused under (c), naming both arguments.
  options.schedule = SHARDMUON_SCHEDULE_CANS;
  int applied_twice = -1;
  EXPECT_EQ(shardmuon_ns_plan_applied_twice(&whole, 1, &options, &applied_twice),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error())
                .find("options->algorithm GRAM_APPLIED_TWICE does not take options->schedule CANS"),
            std::string::npos)
      << shardmuon_last_error();
  options.schedule = SHARDMUON_SCHEDULE_QUINTIC;
  EXPECT_EQ(shardmuon_ns_plan_applied_twice(&whole, 1, &options, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("applied_twice is NULL"), std::string::npos);
}

TEST_F(Schedules, AutoRunsTheGramIterationWhereItIsCheaper) {
  auto gram_iteration = [](int64_t rows, int64_t cols, shardmuon_partition partition, int ranks,
                           shardmuon_ns_algorithm requested) {
    return plan_of(rows, cols, partition, ranks, requested).gram_iteration;
  };
  const shardmuon_ns_algorithm automatic = SHARDMUON_NS_AUTO;
  // A long side several times the short one: (e), on one rank and on two, either dim.
  EXPECT_EQ(gram_iteration(4096, 14336, SHARDMUON_REPLICATED, 1, automatic), 1);
  EXPECT_EQ(gram_iteration(28672, 8192, SHARDMUON_SHARDED_DIM0, 1, automatic), 1);
  EXPECT_EQ(gram_iteration(8192, 28672, SHARDMUON_SHARDED_DIM0, 2, automatic), 1);
  EXPECT_EQ(gram_iteration(8192, 28672, SHARDMUON_SHARDED_DIM1, 2, automatic), 1);
  // Square, or small enough that (e)'s extra launches decide: the standard iteration.
  EXPECT_EQ(gram_iteration(8192, 8192, SHARDMUON_SHARDED_DIM1, 2, automatic), 0);
  EXPECT_EQ(gram_iteration(4096, 4096, SHARDMUON_REPLICATED, 1, automatic), 0);
  EXPECT_EQ(gram_iteration(64, 257, SHARDMUON_SHARDED_DIM1, 2, automatic), 0);
  // The other requests decide it themselves.
  EXPECT_EQ(gram_iteration(4096, 14336, SHARDMUON_SHARDED_DIM1, 2, SHARDMUON_NS_DUPLICATED), 0);
  EXPECT_EQ(gram_iteration(4096, 14336, SHARDMUON_SHARDED_DIM1, 2, SHARDMUON_NS_GRAM_ALLREDUCE), 0);
  EXPECT_EQ(gram_iteration(64, 64, SHARDMUON_REPLICATED, 1, SHARDMUON_NS_GRAM_NEWTON_SCHULZ), 1);
  // Bad arguments name themselves.
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  shardmuon_layout layout{64, 64, SHARDMUON_REPLICATED, 1, nullptr};
  EXPECT_EQ(shardmuon_ns_plan_gram_iteration(&layout, 1, &options, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("gram_iteration"), std::string::npos);
  options.algorithm = SHARDMUON_NS_OWNER;
  int chosen = -1;
  EXPECT_EQ(shardmuon_ns_plan_gram_iteration(&layout, 1, &options, &chosen),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace shardmuon_test
