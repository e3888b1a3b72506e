#include "core/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace shardmuon {
namespace {

// The tables of DESIGN.md section 1 (the same numbers TransformerEngine and
// Emerging-Optimizers ship). Polar Express has its 1.01^degree safety factor folded in.
constexpr Coefficients kSimple[] = {{3.4445, -4.7750, 2.0315}};
constexpr Coefficients kQuintic[] = {{4.0848, -6.8946, 2.9270},
                                     {3.9505, -6.3029, 2.6377},
                                     {3.7418, -5.5913, 2.3037},
                                     {2.8769, -3.1427, 1.2046},
                                     {2.8366, -3.0525, 1.2012}};
constexpr Coefficients kPolarExpress[] = {{8.2051, -22.9019, 16.4607}, {4.0664, -2.8612, 0.5184},
                                          {3.9096, -2.8234, 0.5250},   {3.2856, -2.4153, 0.4853},
                                          {2.2779, -1.6198, 0.3985},   {1.8726, -1.2307, 0.3585},
                                          {1.8564, -1.2132, 0.3568},   {1.8750, -1.2500, 0.3750}};
constexpr Coefficients kCans[] = {{8.4703, -25.1081, 18.6293},
                                  {4.1828, -3.1087, 0.5806},
                                  {3.9619, -2.9541, 0.5630},
                                  {3.2866, -2.4647, 0.5074},
                                  {2.2737, -1.6447, 0.4162}};
constexpr Coefficients kAol[] = {{4.0098, -7.0585, 2.4635},
                                 {3.4585, -5.5479, 2.5959},
                                 {2.7573, -3.2939, 1.4254},
                                 {2.7215, -3.0494, 1.3169}};

struct Table {
  const Coefficients* entries;
  int size;
  bool cycled;  // false: the last entry repeats
};

template <size_t N>
constexpr Table make_table(const Coefficients (&entries)[N], bool cycled) {
  return Table{entries, static_cast<int>(N), cycled};
}

Table table_of(shardmuon_schedule schedule) {
  switch (schedule) {
    case SHARDMUON_SCHEDULE_SIMPLE: return make_table(kSimple, true);
    case SHARDMUON_SCHEDULE_QUINTIC: return make_table(kQuintic, true);
    case SHARDMUON_SCHEDULE_POLAR_EXPRESS: return make_table(kPolarExpress, false);
    case SHARDMUON_SCHEDULE_CANS: return make_table(kCans, false);
    case SHARDMUON_SCHEDULE_AOL: return make_table(kAol, true);
    case SHARDMUON_SCHEDULE_CUSTOM: break;
  }
  fail(SHARDMUON_ERROR_INTERNAL, "no built-in table for schedule ", static_cast<int>(schedule));
}

}  // namespace

bool is_valid_schedule(int schedule) {
  return schedule >= SHARDMUON_SCHEDULE_SIMPLE && schedule <= SHARDMUON_SCHEDULE_CUSTOM;
}

const char* schedule_name(int schedule) {
  switch (schedule) {
    case SHARDMUON_SCHEDULE_SIMPLE: return "simple";
    case SHARDMUON_SCHEDULE_QUINTIC: return "quintic";
    case SHARDMUON_SCHEDULE_POLAR_EXPRESS: return "polar_express";
    case SHARDMUON_SCHEDULE_CANS: return "cans";
    case SHARDMUON_SCHEDULE_AOL: return "aol";
    case SHARDMUON_SCHEDULE_CUSTOM: return "custom";
  }
  return "unknown";
}

void validate_ns_options(const shardmuon_ns_options& options) {
  SHARDMUON_CHECK_ARG(
      options.num_iterations >= 1 && options.num_iterations <= SHARDMUON_MAX_NS_ITERATIONS,
      "options->num_iterations must be in [1, ", SHARDMUON_MAX_NS_ITERATIONS, "], got ",
      options.num_iterations);
  SHARDMUON_CHECK_ARG(is_valid_schedule(options.schedule),
                      "options->schedule is unknown: ", static_cast<int>(options.schedule));
  SHARDMUON_CHECK_ARG(std::isfinite(options.eps) && options.eps >= 0,
                      "options->eps must be finite and >= 0, got ", options.eps);
  SHARDMUON_CHECK_ARG(options.algorithm >= SHARDMUON_NS_AUTO &&
                          options.algorithm <= SHARDMUON_NS_GRAM_APPLIED_TWICE,
                      "options->algorithm is unknown: ", static_cast<int>(options.algorithm));
  // (c) on CANS: its near double roots (newton_schulz.cpp, plan_newton_schulz) took bf16 errors
  // from 4e-2 to 0.4 on a Gaussian 64 x 200 and to 5e2 on a rank-8 one (bench/ns_accuracy.py).
  SHARDMUON_CHECK_ARG(!(options.algorithm == SHARDMUON_NS_GRAM_APPLIED_TWICE &&
                        options.schedule == SHARDMUON_SCHEDULE_CANS),
                      "options->algorithm GRAM_APPLIED_TWICE does not take options->schedule CANS "
                      "(near double roots: it loses bf16 accuracy there); use AUTO or "
                      "GRAM_ALLREDUCE");
  if (options.schedule == SHARDMUON_SCHEDULE_CUSTOM) {
    SHARDMUON_CHECK_ARG(options.custom_coefficients != nullptr,
                        "options->custom_coefficients is NULL for the custom schedule");
    SHARDMUON_CHECK_ARG(options.num_custom_coefficients == options.num_iterations,
                        "options->num_custom_coefficients must equal num_iterations (",
                        options.num_iterations, ": one (a, b, c) per iteration), got ",
                        options.num_custom_coefficients);
    for (int i = 0; i < 3 * options.num_custom_coefficients; ++i) {
      SHARDMUON_CHECK_ARG(std::isfinite(options.custom_coefficients[i]),
                          "options->custom_coefficients[", i,
                          "] is not finite: ", options.custom_coefficients[i]);
    }
  }
}

Coefficients builtin_coefficients(shardmuon_schedule schedule, int iteration) {
  const Table table = table_of(schedule);
  const int index = table.cycled ? iteration % table.size : std::min(iteration, table.size - 1);
  return table.entries[index];
}

std::vector<Coefficients> coefficients_for(const shardmuon_ns_options& options) {
  std::vector<Coefficients> result(options.num_iterations);
  for (int k = 0; k < options.num_iterations; ++k) {
    if (options.schedule == SHARDMUON_SCHEDULE_CUSTOM) {
      const double* triple = options.custom_coefficients + 3 * k;
      result[k] = Coefficients{triple[0], triple[1], triple[2]};
    } else {
      result[k] = builtin_coefficients(options.schedule, k);
    }
  }
  return result;
}

}  // namespace shardmuon
