// Newton-Schulz coefficient schedules: the public tables and the rule that maps an
// iteration to its (a, b, c).
#pragma once

#include <vector>

#include "shardmuon/shardmuon.h"

namespace shardmuon {

struct Coefficients {
  double a, b, c;
};

bool is_valid_schedule(int schedule);
const char* schedule_name(int schedule);

// Checks the options (iteration count, schedule, custom list) and throws INVALID_ARGUMENT
// naming the field at fault.
void validate_ns_options(const shardmuon_ns_options& options);

// The coefficients of every iteration, options already validated.
std::vector<Coefficients> coefficients_for(const shardmuon_ns_options& options);

// The coefficients of one iteration of a built-in (non-custom) schedule.
Coefficients builtin_coefficients(shardmuon_schedule schedule, int iteration);

}  // namespace shardmuon
