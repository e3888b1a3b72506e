// One rank's compute under the Gram distributions over P ranks, on one GPU: (b) with the
// standard iteration, (b) with (e), and (c), each on rank 0's block of an s x L matrix (bf16,
// quintic, 5 iterations) split along its long side over P ranks, through the library's own
// run_newton_schulz with a stand-in communicator whose collectives do nothing.
//
// What it measures: the products, passes and their shapes are exactly those rank 0 runs in a
// group of P; a real group adds its collectives, the same for (b) and (c) (the norm, and one
// s x s Gram all-reduce an iteration), and fewer for (e). So the ratio of (c)'s time to (b)'s
// here is the ratio of their compute, which a machine of P GPUs would show, less the part of
// the all-reduces the products do not hide. Without the sums the iterates are not the
// matrix's (each rank's block is iterated on its own Gram), so results are not checked here;
// the tests check (c) against the float64 oracle.
//
// Flops per rank and iteration (s <= L, blocks of L / P): (b) 3 s^2 L / P + s^3 with the
// symmetric products (the Gram's and A A's triangles), (c) 5 s^2 L / P.
// Time: CUDA events around each call, the three interleaved: 3 warm-up rounds, the median of 15.
//
//   bench_rank_compute [s L P]...   (default: the table in docs/BENCHMARKS.md)
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm/communicator.h"
#include "core/layout.h"
#include "core/newton_schulz.h"
#include "core/schedule.h"
#include "cuda/cuda_backend.h"

namespace {

using shardmuon::NsPlan;

void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(code));
    std::exit(1);
  }
}

// Rank 0 of a group of `ranks` whose collectives do nothing (see the file's comment).
class StandInGroup : public shardmuon::Communicator {
 public:
  explicit StandInGroup(int ranks) : ranks_(ranks) {}
  const char* kind_name() const override { return "stand-in"; }
  int rank() const override { return 0; }
  int size() const override { return ranks_; }
  void check_compatible(const shardmuon::Backend&) const override {}
  void all_reduce_sum(void*, int64_t, shardmuon_dtype, shardmuon::Stream) override {}
  bool sums_bfloat16() const override { return true; }  // as NCCL: the Gram travels in bf16
  void all_gather_in_place(void*, size_t, shardmuon::Stream) override {}
  void all_to_all(const void*, const std::vector<size_t>&, const std::vector<size_t>&, void*,
                  const std::vector<size_t>&, const std::vector<size_t>&,
                  shardmuon::Stream) override {}
  void agree_max(int64_t*, int) override {}

 private:
  int ranks_;
};

// A deterministic pseudo-random pattern in [-1, 1).
__global__ void fill(__nv_bfloat16* data, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    data[i] = __float2bfloat16(static_cast<float>(x) * (2.0f / 4294967296.0f) - 1.0f);
  }
}

struct Case {
  int64_t s, length;
  int ranks;
};

// The median time of each problem's call. The calls are interleaved (one of each problem per
// round: 3 warm-up rounds, the median of 15), so that the GPU's clock, which falls as it
// heats under back-to-back products (docs/BENCHMARKS.md, eleventh session), weighs on every
// problem alike rather than on whichever runs last.
std::vector<float> median_ms(shardmuon::Backend& backend, shardmuon::Communicator& group,
                             const std::vector<shardmuon::NsProblem>& problems, void* block,
                             cudaStream_t stream) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<std::vector<float>> times(problems.size());
  for (int round = 0; round < 18; ++round) {
    for (size_t p = 0; p < problems.size(); ++p) {
      check(cudaEventRecord(start, stream), "record");
      shardmuon::run_newton_schulz(backend, group, problems[p], block, stream);
      check(cudaEventRecord(stop, stream), "record");
      check(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      if (round >= 3) times[p].push_back(ms);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<float> medians;
  for (std::vector<float>& each : times) {
    std::sort(each.begin(), each.end());
    medians.push_back(each[each.size() / 2]);
  }
  return medians;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Case> cases;
  for (int i = 1; i + 2 < argc; i += 3) {
    cases.push_back({std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoi(argv[i + 2])});
  }
  if (cases.empty()) {
    for (int64_t side : {4096, 8192, 16384}) {
      for (int ranks : {2, 3, 4, 8}) cases.push_back({side, side, ranks});
    }
    for (int ranks : {2, 4, 8}) cases.push_back({8192, 28672, ranks});
    for (int ranks : {4, 8}) cases.push_back({4096, 14336, ranks});
  }
  auto backend = shardmuon::make_cuda_backend(0);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  shardmuon_ns_options options;
  shardmuon_ns_options_default(&options);
  options.schedule = SHARDMUON_SCHEDULE_QUINTIC;
  options.num_iterations = 5;
  const std::vector<shardmuon::Coefficients> coefficients = shardmuon::coefficients_for(options);
  std::printf(
      "| s x L | P | block | (b) ms | (b)+(e) ms | (c) ms | (c) / (b) | (c) / best of (b), (e) | "
      "flops (c) / (b) | AUTO runs |\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    const int64_t block_length = (c.length + c.ranks - 1) / c.ranks;
    const shardmuon_layout api{c.s, c.length, SHARDMUON_SHARDED_DIM1, c.ranks, nullptr};
    const shardmuon::ShardLayout layout = shardmuon::ShardLayout::from_api(api, c.ranks);
    void* block = nullptr;
    const int64_t elements = c.s * block_length;
    check(cudaMalloc(&block, elements * sizeof(__nv_bfloat16)), "cudaMalloc");
    fill<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(block), elements);
    StandInGroup group(c.ranks);
    const NsPlan::Iteration kinds[3] = {NsPlan::Iteration::kStandard, NsPlan::Iteration::kOnGram,
                                        NsPlan::Iteration::kAppliedTwice};
    std::vector<shardmuon::NsProblem> problems(3);
    for (int k = 0; k < 3; ++k) {
      problems[k].dtype = SHARDMUON_BFLOAT16;
      problems[k].layout = layout;
      problems[k].coefficients = coefficients;
      problems[k].eps = options.eps;
      problems[k].plan.algorithm = NsPlan::Algorithm::kGramAllReduce;
      problems[k].plan.iteration = kinds[k];
    }
    const std::vector<float> ms = median_ms(*backend, group, problems, block, stream);
    options.algorithm = SHARDMUON_NS_AUTO;
    const NsPlan chosen = shardmuon::plan_newton_schulz(layout, c.ranks, options);
    const char* auto_runs = chosen.algorithm != NsPlan::Algorithm::kGramAllReduce  ? "(a)"
                            : chosen.iteration == NsPlan::Iteration::kAppliedTwice ? "(c)"
                            : chosen.iteration == NsPlan::Iteration::kOnGram       ? "(b)+(e)"
                                                                                   : "(b)";
    const double s = static_cast<double>(c.s), l = static_cast<double>(block_length);
    const double flops_ratio = 5 * s * s * l / (3 * s * s * l + s * s * s);
    std::printf("| %lldx%lld | %d | %lldx%lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %s |\n",
                static_cast<long long>(c.s), static_cast<long long>(c.length), c.ranks,
                static_cast<long long>(c.s), static_cast<long long>(block_length), ms[0], ms[1],
                ms[2], ms[2] / ms[0], ms[2] / std::min(ms[0], ms[1]), flops_ratio, auto_runs);
    std::fflush(stdout);
    check(cudaFree(block), "cudaFree");
  }
  return 0;
}
