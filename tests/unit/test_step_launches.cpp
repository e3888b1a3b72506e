// How many calls a step makes to its backend, counted at the Backend interface (each call is
// one launch or a few on the CUDA backend). A step of several layers of the same shapes must
// make as many product calls as a step of one layer: the layers' matrices run as strided
// batches. And every parameter's elementwise passes go in one call per kind. Where a batch
// stops forming, a step of many small parameters becomes bound by launches again, and the
// tests that compare results (MuonStepBatches) would not notice.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/factories.h"
#include "core/backend.h"
#include "core/muon_step.h"
#include "core/newton_schulz.h"
#include "core/schedule.h"
#include "cpu/cpu_backend.h"

namespace shardmuon {
namespace {

// Forwards every call to the CPU backend, counting the products and the elementwise calls.
class CountingBackend final : public Backend {
 public:
  int64_t gemm_calls = 0;     // calls of gemm()
  int64_t products = 0;       // the matrix products in them (strided batches and lists)
  int64_t pass_calls = 0;     // calls of the four elementwise passes
  int64_t passes = 0;         // the passes in them
  int64_t largest_batch = 0;  // of a gemm() call

  shardmuon_backend kind() const override { return inner_->kind(); }
  void begin_call(Stream stream) override { inner_->begin_call(stream); }
  void end_call(Stream stream) override { inner_->end_call(stream); }
  void check_pointer(const void* ptr, const char* name) const override {
    inner_->check_pointer(ptr, name);
  }
  void check_dtype(shardmuon_dtype dtype) const override { inner_->check_dtype(dtype); }
  void check_matrix_shape(int64_t rows, int64_t cols, const std::string& name) const override {
    inner_->check_matrix_shape(rows, cols, name);
  }
  void* workspace(size_t bytes, Stream stream) override { return inner_->workspace(bytes, stream); }
  size_t workspace_bytes() const override { return inner_->workspace_bytes(); }
  void* allocate_zeroed(size_t bytes) override { return inner_->allocate_zeroed(bytes); }
  void release(void* pointer) override { inner_->release(pointer); }
  size_t sum_of_squares_scratch_bytes(shardmuon_dtype dtype, int64_t count,
                                      int64_t batch) const override {
    return inner_->sum_of_squares_scratch_bytes(dtype, count, batch);
  }
  void sum_of_squares(const void* x, shardmuon_dtype dtype, int64_t count, int64_t batch,
                      void* result, void* scratch, size_t scratch_bytes, Stream stream) override {
    inner_->sum_of_squares(x, dtype, count, batch, result, scratch, scratch_bytes, stream);
  }
  void divide_by_norm(const void* x, void* y, shardmuon_dtype dtype, int64_t count, int64_t batch,
                      const void* sums, double eps, Stream stream) override {
    inner_->divide_by_norm(x, y, dtype, count, batch, sums, eps, stream);
  }
  void divide_by_norm_padded(const void* x, int64_t rows, int64_t cols, void* y,
                             int64_t padded_rows, int64_t padded_cols, shardmuon_dtype dtype,
                             int64_t batch, const void* sums, double eps, Stream stream) override {
    inner_->divide_by_norm_padded(x, rows, cols, y, padded_rows, padded_cols, dtype, batch, sums,
                                  eps, stream);
  }
  void gemm(const GemmCall& call, Stream stream) override {
    ++gemm_calls;
    products += call.batch * (call.product_count > 0 ? call.product_count : 1);
    largest_batch = std::max(largest_batch, call.batch);
    inner_->gemm(call, stream);
  }
  void momentum_passes(const std::vector<MomentumPass>& list, Stream stream) override {
    count_passes(list.size());
    inner_->momentum_passes(list, stream);
  }
  void update_passes(const std::vector<UpdatePass>& list, Stream stream) override {
    count_passes(list.size());
    inner_->update_passes(list, stream);
  }
  void commit_passes(const std::vector<CommitPass>& list, Stream stream) override {
    count_passes(list.size());
    inner_->commit_passes(list, stream);
  }
  void flag_nonfinite(const std::vector<FiniteCheck>& list, Stream stream) override {
    count_passes(list.size());
    inner_->flag_nonfinite(list, stream);
  }
  void mark_if_set(const float* flag, float* mark, Stream stream) override {
    inner_->mark_if_set(flag, mark, stream);
  }
  void count_if_flagged(const float* flag, int64_t* counter, Stream stream) override {
    inner_->count_if_flagged(flag, counter, stream);
  }
  void* persistent_status() override { return inner_->persistent_status(); }
  int64_t symmetric_block_target() const override { return inner_->symmetric_block_target(); }
  int64_t short_side_multiple() const override { return inner_->short_side_multiple(); }
  SymmetricTiles product_tiles(int64_t n) const override { return inner_->product_tiles(n); }
  int64_t column_square_parts(int64_t n) const override { return inner_->column_square_parts(n); }
  void unpack_symmetric(const void* packed, shardmuon_dtype src_type, const SymmetricTiles& tiles,
                        int64_t batch, void* dst, shardmuon_dtype dst_type, double shift,
                        void* square_parts, Stream stream) override {
    inner_->unpack_symmetric(packed, src_type, tiles, batch, dst, dst_type, shift, square_parts,
                             stream);
  }
  void mirror_lower(void* matrix, shardmuon_dtype dtype, int64_t n, int64_t batch,
                    const SymmetricDiagonal& diagonal, void* square_parts, bool upper_computed,
                    Stream stream) override {
    inner_->mirror_lower(matrix, dtype, n, batch, diagonal, square_parts, upper_computed, stream);
  }
  Stream side_stream(Stream stream) override { return inner_->side_stream(stream); }
  void order_after(Stream waiter, Stream signaller) override {
    inner_->order_after(waiter, signaller);
  }
  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
               size_t rows, Stream stream) override {
    inner_->copy_2d(dst, dst_pitch, src, src_pitch, row_bytes, rows, stream);
  }
  void fill_zero(void* dst, size_t bytes, Stream stream) override {
    inner_->fill_zero(dst, bytes, stream);
  }
  void copy_to_host(void* host, const void* src, size_t bytes, Stream stream) override {
    inner_->copy_to_host(host, src, bytes, stream);
  }
  void copy_from_host(void* dst, const void* host, size_t bytes, Stream stream) override {
    inner_->copy_from_host(dst, host, bytes, stream);
  }
  void synchronize(Stream stream) override { inner_->synchronize(stream); }
  void wait_for_last_call() override { inner_->wait_for_last_call(); }
  // The keys of the work the CUDA backend would record, in call order (run as it is here).
  std::vector<std::vector<int64_t>> recording_keys;
  void run_recorded(const std::vector<int64_t>& key, Stream stream,
                    const std::function<void(Stream)>& enqueue) override {
    recording_keys.push_back(key);
    enqueue(stream);
  }

 private:
  void count_passes(size_t count) {
    ++pass_calls;
    passes += static_cast<int64_t>(count);
  }
  std::unique_ptr<Backend> inner_ = make_cpu_backend();
};

// What a step of `layers` layers asked of its backend. A layer's parameters are GPT-like
// matrices, or with `stacked` a mixture-of-experts weight (4 experts of 32 x 48) and a fused
// QKV split by head (6 heads of 16 x 48) (replicated on one rank, float32).
struct Counts {
  int64_t gemm_calls, products, largest_batch, pass_calls, passes;
  size_t workspace;                // muon_step_workspace_bytes
  size_t smallest_matrix_scratch;  // of one matrix's Newton-Schulz, the least of its problems
};

// The buffers and parameters of a step: `layers` copies of `shapes` (rows, cols, row_blocks),
// replicated on one rank, float32, each buffer filled with its own pattern.
struct StepParams {
  struct Shape {
    int64_t rows, cols, row_blocks;
  };
  std::vector<std::vector<float>> buffers;  // param, grad, momentum of each parameter
  std::vector<shardmuon_muon_param> params;

  StepParams(const std::vector<Shape>& shapes, int layers) {
    for (int layer = 0; layer < layers; ++layer) {
      for (const Shape& shape : shapes) {
        const size_t elements = static_cast<size_t>(shape.rows * shape.cols);
        shardmuon_muon_param param{};
        for (int b = 0; b < 3; ++b) {
          buffers.emplace_back(elements);
          for (size_t i = 0; i < elements; ++i) {
            buffers.back()[i] = static_cast<float>((i * 37 + b * 11 + layer) % 101) / 50.0f - 1.0f;
          }
        }
        param.param = buffers[buffers.size() - 3].data();
        param.grad = buffers[buffers.size() - 2].data();
        param.momentum = buffers[buffers.size() - 1].data();
        param.dtype = SHARDMUON_FLOAT32;
        param.layout = {shape.rows, shape.cols, SHARDMUON_REPLICATED, 1, nullptr};
        param.row_blocks = shape.row_blocks;
        params.push_back(param);
      }
    }
  }

  // The step of these parameters, one group of the defaults but for `algorithm`.
  ValidatedMuonStep validate(Backend& backend, Communicator& comm,
                             shardmuon_ns_algorithm algorithm) const {
    shardmuon_muon_group group;
    EXPECT_EQ(shardmuon_muon_group_default(&group), SHARDMUON_SUCCESS);
    group.ns.algorithm = algorithm;
    return validate_muon_step(backend, comm, params.data(), static_cast<int>(params.size()), &group,
                              1);
  }
};

Counts count_step(int layers, shardmuon_ns_algorithm algorithm, shardmuon_nonfinite_policy policy,
                  bool stacked = false, size_t ns_batch_bytes = kDefaultNsBatchBytes) {
  using Shape = StepParams::Shape;
  const std::vector<Shape> shapes =
      stacked ? std::vector<Shape>{{4 * 32, 48, 4}, {6 * 16, 48, 6}}
              : std::vector<Shape>{{48, 144, 1}, {48, 48, 1}, {48, 192, 1}, {192, 48, 1}};
  const StepParams params(shapes, layers);
  CountingBackend backend;
  const std::unique_ptr<Communicator> comm = make_self_communicator();
  const ValidatedMuonStep step = params.validate(backend, *comm, algorithm);
  const StepSettings settings{policy, ns_batch_bytes};
  size_t smallest = SIZE_MAX;
  for (const MuonParamPlan& plan : step.plans) {
    smallest = std::min(smallest, newton_schulz_workspace_bytes(backend, plan.ns, 0, 1));
  }
  const size_t workspace = muon_step_workspace_bytes(backend, step, 0, 1, settings);
  run_muon_step(backend, *comm, step, nullptr, settings);
  return {backend.gemm_calls,
          backend.products,
          backend.largest_batch,
          backend.pass_calls,
          backend.passes,
          workspace,
          smallest};
}

// $SHARDMUON_MAX_NS_BATCH set for the test's scope.
struct BatchCap {
  explicit BatchCap(const char* value) { setenv("SHARDMUON_MAX_NS_BATCH", value, 1); }
  ~BatchCap() { unsetenv("SHARDMUON_MAX_NS_BATCH"); }
};

class StepLaunches : public ::testing::TestWithParam<
                         std::tuple<shardmuon_ns_algorithm, shardmuon_nonfinite_policy>> {};

TEST_P(StepLaunches, LayersOfOneShapeShareTheirCalls) {
  const auto [algorithm, policy] = GetParam();
  const Counts one = count_step(1, algorithm, policy);
  const Counts four = count_step(4, algorithm, policy);
  EXPECT_GT(one.gemm_calls, 0);
  // Four layers: the same calls, each a batch of four.
  EXPECT_EQ(four.gemm_calls, one.gemm_calls);
  EXPECT_EQ(four.products, 4 * one.products);
  EXPECT_EQ(one.largest_batch, 1);
  EXPECT_EQ(four.largest_batch, 4);
  // The passes: one call per kind, whatever the number of parameters (momentum and update;
  // a checked step's momentum, finite check and commit).
  const int64_t kinds = policy == SHARDMUON_NONFINITE_PROCEED ? 2 : 3;
  EXPECT_EQ(one.pass_calls, kinds);
  EXPECT_EQ(four.pass_calls, kinds);
  EXPECT_EQ(four.passes, kinds * 16);
}

// The experts or heads of every layer: one batch per problem for the whole step.
TEST_P(StepLaunches, StackedMatricesOfEveryLayerShareTheirCalls) {
  const auto [algorithm, policy] = GetParam();
  const Counts one = count_step(1, algorithm, policy, true);
  const Counts four = count_step(4, algorithm, policy, true);
  EXPECT_GT(one.gemm_calls, 0);
  EXPECT_EQ(four.gemm_calls, one.gemm_calls);
  EXPECT_EQ(four.products, 4 * one.products);
  EXPECT_EQ(one.largest_batch, 6);
  EXPECT_EQ(four.largest_batch, 24);
}

// The counter counts what it should: with batches of one, four layers make four times the
// calls.
TEST_P(StepLaunches, BatchesOfOneMakeACallPerMatrix) {
  const auto [algorithm, policy] = GetParam();
  const BatchCap cap("1");
  const Counts one = count_step(1, algorithm, policy);
  const Counts four = count_step(4, algorithm, policy);
  EXPECT_EQ(four.gemm_calls, 4 * one.gemm_calls);
  EXPECT_EQ(four.products, 4 * one.products);
  EXPECT_EQ(four.largest_batch, 1);
}

// The context's batch budget (shardmuon_context_set_ns_batch_bytes) sizes the batches and the
// workspace: none runs every matrix by itself; twice the least scratch of one matrix allows
// batches of two at most (of the problems whose matrices need that least).
TEST_P(StepLaunches, TheBatchBudgetSizesTheBatchesAndTheWorkspace) {
  const auto [algorithm, policy] = GetParam();
  const Counts whole = count_step(4, algorithm, policy);
  const Counts none = count_step(4, algorithm, policy, false, 0);
  const Counts pairs = count_step(4, algorithm, policy, false, 2 * whole.smallest_matrix_scratch);
  const BatchCap cap("1");
  const Counts one_by_one = count_step(4, algorithm, policy);
  EXPECT_EQ(none.gemm_calls, one_by_one.gemm_calls);
  EXPECT_EQ(none.largest_batch, 1);
  EXPECT_EQ(pairs.largest_batch, 2);
  EXPECT_LT(whole.gemm_calls, pairs.gemm_calls);
  EXPECT_LT(pairs.gemm_calls, none.gemm_calls);
  EXPECT_EQ(none.products, whole.products);
  EXPECT_EQ(pairs.products, whole.products);
  // The largest problem's scratch sizes the workspace: one matrix of it in both of these.
  EXPECT_LE(none.workspace, pairs.workspace);
  EXPECT_LT(pairs.workspace, whole.workspace);
}

// A step's Newton-Schulz work is recorded by the CUDA backend under keys (run_recorded): the same
// step again must ask for the same keys, or no later step would replay a recording; and two
// problems of one step, each its own work, must not share one.
TEST_P(StepLaunches, RepeatedStepsAskForTheSameRecordings) {
  const auto [algorithm, policy] = GetParam();
  const StepParams params({{48, 144, 1}, {48, 48, 1}, {48, 192, 1}, {192, 48, 1}, {48, 48, 1}}, 1);
  CountingBackend backend;
  const std::unique_ptr<Communicator> comm = make_self_communicator();
  const ValidatedMuonStep step = params.validate(backend, *comm, algorithm);
  const StepSettings settings{policy, kDefaultNsBatchBytes};
  backend.workspace(muon_step_workspace_bytes(backend, step, 0, 1, settings), nullptr);
  run_muon_step(backend, *comm, step, nullptr, settings);
  const std::vector<std::vector<int64_t>> first = backend.recording_keys;
  backend.recording_keys.clear();
  run_muon_step(backend, *comm, step, nullptr, settings);
  // Four problems: the two 48 x 48 matrices share a batch.
  EXPECT_EQ(first.size(), 4u);
  EXPECT_EQ(backend.recording_keys, first);
  for (size_t i = 0; i < first.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_NE(first[i], first[j]) << i << " and " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AlgorithmsAndPolicies, StepLaunches,
    ::testing::Combine(::testing::Values(SHARDMUON_NS_AUTO, SHARDMUON_NS_DUPLICATED,
                                         SHARDMUON_NS_OWNER),
                       ::testing::Values(SHARDMUON_NONFINITE_PROCEED, SHARDMUON_NONFINITE_SKIP)));

// The key of a local Newton-Schulz call tells apart every argument its launches depend on, and
// only those: the same call gives the same key, and changing any one of them another.
TEST(RecordingKeys, EveryArgumentOfALocalCallIsInItsKey) {
  struct Call {
    shardmuon_dtype dtype = SHARDMUON_FLOAT32;
    int64_t rows = 40, cols = 72, batch = 1;
    double eps = 1e-7;
    shardmuon_schedule schedule = SHARDMUON_SCHEDULE_QUINTIC;
    int iterations = 5;
    shardmuon_ns_algorithm algorithm = SHARDMUON_NS_AUTO;
    int buffer = 0;
  };
  std::vector<std::vector<double>> buffers(2, std::vector<double>(2 * 72 * 72, 0.5));
  CountingBackend backend;
  const std::unique_ptr<Communicator> comm = make_self_communicator();
  const auto problem_of = [](const Call& call) {
    shardmuon_ns_options options;
    EXPECT_EQ(shardmuon_ns_options_default(&options), SHARDMUON_SUCCESS);
    options.eps = call.eps;
    options.schedule = call.schedule;
    options.num_iterations = call.iterations;
    options.algorithm = call.algorithm;
    const ShardLayout layout =
        ShardLayout::from_api({call.rows, call.cols, SHARDMUON_REPLICATED, 1, nullptr}, 1);
    NsProblem problem{call.dtype, layout, coefficients_for(options), call.eps,
                      plan_newton_schulz(layout, 1, options)};
    problem.batch = call.batch;
    return problem;
  };
  const auto key_of = [&](const Call& call) {
    backend.recording_keys.clear();
    run_newton_schulz(backend, *comm, problem_of(call), buffers[call.buffer].data(), nullptr);
    EXPECT_EQ(backend.recording_keys.size(), 1u);
    return backend.recording_keys.empty() ? std::vector<int64_t>{} : backend.recording_keys[0];
  };
  const Call base;
  std::vector<Call> changed(9, base);
  changed[0].dtype = SHARDMUON_FLOAT64;
  changed[1].rows = 72;
  changed[1].cols = 40;
  changed[2].cols = 64;
  changed[3].batch = 2;
  changed[4].eps = 1e-6;
  changed[5].schedule = SHARDMUON_SCHEDULE_POLAR_EXPRESS;
  changed[6].iterations = 4;
  changed[7].algorithm = SHARDMUON_NS_GRAM_NEWTON_SCHULZ;
  changed[8].buffer = 1;
  // One workspace for all the calls, so that it never moves: only the arguments differ.
  size_t workspace = 0;
  for (const Call& call : changed) {
    workspace = std::max(workspace, newton_schulz_workspace_bytes(backend, problem_of(call), 0, 1));
  }
  backend.workspace(workspace, nullptr);
  const std::vector<int64_t> base_key = key_of(base);
  for (size_t i = 0; i < changed.size(); ++i) EXPECT_NE(key_of(changed[i]), base_key) << i;
  EXPECT_EQ(key_of(base), base_key);
}

}  // namespace
}  // namespace shardmuon
