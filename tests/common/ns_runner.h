// Runs shardmuon_newton_schulz on a group from a whole matrix that every rank knows, and
// returns this rank's result shard: the glue between the oracle and the library.
#pragma once

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "harness.h"
#include "reference.h"

namespace shardmuon_test {

struct NsRun {
  shardmuon_status status = SHARDMUON_SUCCESS;
  std::string error;
  std::vector<double> input_shard;   // what this rank passed
  std::vector<double> output_shard;  // what the call left in the rank's buffer
};

enum class ShardPattern { kBalanced, kUneven, kLastHoldsAll };
const char* pattern_name(ShardPattern pattern);

// Sizes along the sharded dim for a pattern; kBalanced gives an empty vector, meaning the
// layout passes NULL and the library splits.
std::vector<int64_t> pattern_sizes(ShardPattern pattern, int64_t extent, int parts);

shardmuon_layout make_layout(const Matrix& m, shardmuon_partition partition, int parts,
                             const std::vector<int64_t>& sizes);

// Every member of the group calls this; input must be representable in dtype. The shard
// starts `pointer_offset` bytes into its buffer (a multiple of the element size: a valid
// address that need not be aligned further).
NsRun run_newton_schulz(const Group& group, const Matrix& input, shardmuon_dtype dtype,
                        shardmuon_partition partition, const std::vector<int64_t>& sizes,
                        const shardmuon_ns_options& options, size_t pointer_offset = 0);

// Whether the call succeeded on every member: assert on this, not on the local status, so
// that all ranks return together and none waits alone in a later collective.
bool all_succeeded(const NsRun& run, const Group& group);

shardmuon_ns_options make_options(shardmuon_schedule schedule, int iterations,
                                  shardmuon_ns_algorithm algorithm);

// The oracle's result for a (rounded) input, cached by shape, seed, dtype and schedule.
const Matrix& cached_reference(const std::string& key, const Matrix& input,
                               const std::vector<Triple>& coefficients, double eps);

// Prints "<test name> error=<e> tolerance=<t>" on the group's first rank when the
// environment sets SHARDMUON_TEST_REPORT_ERRORS, to see the margins behind each tolerance.
void report_error(double error, double tolerance, int group_rank);

// Relative Frobenius error allowed against the float64 oracle (DESIGN.md section 4), (e)'s
// Gram iteration held to the same since it restarts every two steps.
double tolerance_for(shardmuon_dtype dtype);

}  // namespace shardmuon_test
