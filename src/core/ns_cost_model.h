// How long each distributed Newton-Schulz algorithm should take for one matrix, from a
// machine model: GEMM rate, link rates and fixed costs per GEMM and per collective. The
// planner runs the cheapest. The model is deterministic (every rank computes the same
// plan without talking to the others) and describes the GPUs the library is tuned for; its
// rates are the ones measured on them (docs/BENCHMARKS.md), not measured at run time.
#pragma once

#include <cstdint>

#include "core/layout.h"

namespace shardmuon {

struct MachineModel {
  // One H200 of the lent nvidia-h200-x2 machine, bf16 (docs/BENCHMARKS.md, 2026-11-30).
  double gemm_flops_per_second = 760e12;
  double memory_bytes_per_second = 3.5e12;  // the unpacking passes
  double all_reduce_bus_bytes_per_second = 270e9;
  double all_gather_bytes_per_second = 250e9;  // bytes arriving at a rank
  double all_to_all_bytes_per_second = 250e9;  // bytes leaving a rank
  double seconds_per_gemm = 15e-6;             // launch, ramp-up and tail of one product
  double seconds_per_collective = 30e-6;
  int64_t symmetric_block_target = 512;
  int64_t short_side_multiple = 512;  // product_side's, as the CUDA backend pads
  int element_bytes = 2;              // bf16 storage
  // A Gram summed over a group travels in bf16 (newton_schulz.cpp, gram_sum_dtype; a callback
  // communicator sums float32, twice the bytes, which the model does not see).
  int gram_sum_bytes = 2;
};

// (d) moves the shards to the long side and back in this many pieces of the long side, each
// overlapping products (newton_schulz.cpp, PiecewiseExchange): only the first piece in and the
// last piece out are not hidden.
constexpr int kExchangePieces = 4;

// A Gram summed over a group is computed and all-reduced this many block columns at a time
// (newton_schulz.cpp, gram_product): each group's all-reduce overlaps the next group's products.
constexpr int kGramColumnsPerLaunch = 4;

struct NsCostInputs {
  ShardLayout layout;
  int ranks = 1;
  int iterations = 5;
  // 0: the standard iteration. Otherwise (e)'s Gram iteration (newton_schulz.cpp
  // iterate_on_gram), restarting every this many steps: per restart the Gram (summed over
  // the group when there is one) and one product by X, per step products of s x s symmetric
  // matrices only. Cheaper than the standard iteration when the long side is well above the
  // short one (at 4096 x 28672, bf16, on one rank: about 0.7 of its time), dearer when square.
  int gram_iteration_restart = 0;
  // (c) (newton_schulz.cpp iterate_applied_twice): per step the Gram (and its unpacking) and
  // two products by X, no A A. For the standard iteration only (restart 0).
  bool applied_twice = false;
};

// Estimated seconds of the whole matrix on one rank, no communication; of (a) duplicated; and
// of (b) Gram all-reduce on the long side, which includes (d)'s two all-to-alls when the
// shards lie along the short side. Each of the iteration `inputs` names.
double estimate_local_seconds(const NsCostInputs& inputs, const MachineModel& machine);
double estimate_duplicated_seconds(const NsCostInputs& inputs, const MachineModel& machine);
double estimate_gram_all_reduce_seconds(const NsCostInputs& inputs, const MachineModel& machine);

}  // namespace shardmuon
