#include "ns_runner.h"

#include <cstdio>
#include <cstdlib>

namespace shardmuon_test {

const char* pattern_name(ShardPattern pattern) {
  switch (pattern) {
    case ShardPattern::kBalanced: return "balanced";
    case ShardPattern::kUneven: return "uneven";
    case ShardPattern::kLastHoldsAll: return "lastholdsall";
  }
  return "?";
}

std::vector<int64_t> pattern_sizes(ShardPattern pattern, int64_t extent, int parts) {
  switch (pattern) {
    case ShardPattern::kBalanced: return {};
    case ShardPattern::kUneven: return uneven_sizes(extent, parts);
    case ShardPattern::kLastHoldsAll: return last_holds_all(extent, parts);
  }
  return {};
}

shardmuon_layout make_layout(const Matrix& m, shardmuon_partition partition, int parts,
                             const std::vector<int64_t>& sizes) {
  shardmuon_layout layout{};
  layout.rows = m.rows;
  layout.cols = m.cols;
  layout.partition = partition;
  layout.num_shards = parts;
  layout.shard_sizes = sizes.empty() ? nullptr : sizes.data();
  return layout;
}

NsRun run_newton_schulz(const Group& group, const Matrix& input, shardmuon_dtype dtype,
                        shardmuon_partition partition, const std::vector<int64_t>& sizes,
                        const shardmuon_ns_options& options, size_t pointer_offset) {
  const Harness& harness = Harness::get();
  const int64_t extent = sharded_extent(input.rows, input.cols, partition);
  const std::vector<int64_t> actual_sizes =
      sizes.empty() ? balanced_sizes(extent, group.size) : sizes;
  NsRun run;
  run.input_shard = extract_shard(input, partition, actual_sizes, group.rank);
  std::vector<unsigned char> bytes(pointer_offset, 0);
  const std::vector<unsigned char> shard = to_bytes(run.input_shard, dtype);
  bytes.insert(bytes.end(), shard.begin(), shard.end());
  Buffer buffer = harness.upload(bytes);
  const shardmuon_layout layout = make_layout(input, partition, group.size, sizes);
  run.status = shardmuon_newton_schulz(harness.context(), group.comm,
                                       static_cast<char*>(buffer.data()) + pointer_offset, dtype,
                                       &layout, &options, harness.stream());
  run.error = shardmuon_last_error();
  const std::vector<unsigned char> out = harness.download(buffer);
  run.output_shard =
      from_bytes(std::vector<unsigned char>(out.begin() + pointer_offset, out.end()), dtype);
  return run;
}

bool all_succeeded(const NsRun& run, const Group& group) {
  return group_all(run.status == SHARDMUON_SUCCESS, group.mpi);
}

shardmuon_ns_options make_options(shardmuon_schedule schedule, int iterations,
                                  shardmuon_ns_algorithm algorithm) {
  shardmuon_ns_options options{};
  shardmuon_ns_options_default(&options);
  options.schedule = schedule;
  options.num_iterations = iterations;
  options.algorithm = algorithm;
  return options;
}

const Matrix& cached_reference(const std::string& key, const Matrix& input,
                               const std::vector<Triple>& coefficients, double eps) {
  static std::map<std::string, Matrix> cache;
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  return cache.emplace(key, reference_newton_schulz(input, coefficients, eps)).first->second;
}

void report_error(double error, double tolerance, int group_rank) {
  if (group_rank != 0 || std::getenv("SHARDMUON_TEST_REPORT_ERRORS") == nullptr) return;
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::printf("%s.%s error=%.3e tolerance=%.1e ratio=%.3f\n", info->test_suite_name(), info->name(),
              error, tolerance, error / tolerance);
}

double tolerance_for(shardmuon_dtype dtype) {
  switch (dtype) {
    case SHARDMUON_FLOAT64: return 1e-11;
    case SHARDMUON_FLOAT32: return 2e-5;  // "well under 1e-4"
    case SHARDMUON_BFLOAT16: return 3e-2;
  }
  return 0;
}

}  // namespace shardmuon_test
