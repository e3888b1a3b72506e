// Distributed Newton-Schulz orthogonalization of one matrix, written once against the
// Backend and Communicator interfaces. DESIGN.md section 3 names the algorithms:
//   (a) duplicated: all-gather, full iteration everywhere, keep the own shard;
//   (b) Gram all-reduce: blocks along the long side, the s x s Gram summed every iteration;
//   (c) as (b), with the Gram applied to the block twice instead of squared;
//   (d) shards along the short side moved to long-side blocks by all-to-all, (b), and back.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/backend.h"
#include "core/layout.h"
#include "core/ns_cost_model.h"
#include "core/schedule.h"

namespace shardmuon {

struct NsPlan {
  // Never AUTO: LOCAL when no communication is needed (replicated, or one rank).
  enum class Algorithm { kLocal, kDuplicated, kGramAllReduce };
  Algorithm algorithm = Algorithm::kLocal;
  // (d): the shards lie along the short side and are moved to the long side and back.
  bool redistributes = false;
  // How each iteration runs on that distribution.
  enum class Iteration {
    // A = X X^T, P = a I + b A + c A A, X <- P X.
    kStandard,
    // (e) Gram Newton-Schulz: iterate on the s x s Gram matrix and apply the accumulated
    // polynomial to X at the end (and at restarts).
    kOnGram,
    // (c): A applied to X twice (AppliedTwiceStep), no A A. Per rank of P it takes 5 s^2 L / P
    // flops an iteration against the standard iteration's 3 s^2 L / P + s^3 (the s^3 of A A
    // repeated on every rank): fewer where s > 2 L / P, from 3 ranks on for a square matrix.
    kAppliedTwice,
  };
  Iteration iteration = Iteration::kStandard;
  bool gram_iteration() const { return iteration == Iteration::kOnGram; }
  bool applied_twice() const { return iteration == Iteration::kAppliedTwice; }
};

// (c)'s products for one iteration's (a, b, c): with S = A + shift I,
//   Y  = first_alpha S X + first_beta X,
//   X' = S Y + second_beta X           (or X' = Y where one_product).
// The iterate a X + b A X + c A A X is written so that the one rounded intermediate, Y, is no
// larger than the result's polynomial where that has no real root: with c delta > 0 (delta = a
// - b^2 / (4 c)), p(t) = a + b t + c t^2 = c (t - m)^2 + delta (m = -b / (2 c)), so Y = c (A - m
// I) X and X' = (A - m I) Y + delta X, and |c (t - m)^2| < |p(t)| for every eigenvalue t of A:
// no cancellation. Otherwise Y = c A X + b X and X' = A Y + a X; with c = 0, one product.
// (Emulated in bf16 on 256 x 4096 with polar_express, the second form's error was 5.9x the
// standard iteration's, the vertex form's 1.3x: polar_express's third step maps singular values
// up to 1.9 through terms of size 5 to 8 that cancel to about 0.3.)
struct AppliedTwiceStep {
  double shift = 0.0, first_alpha = 0.0, first_beta = 0.0, second_beta = 0.0;
  bool one_product = false;
  static AppliedTwiceStep of(const Coefficients& coefficients);
};

// The algorithm for one matrix: the requested one, or for AUTO the cheaper of (a) and
// (b)/(d), each with the standard iteration or (e), and (b)/(d) with (c) too, by the cost model
// (core/ns_cost_model.h). The same on every rank.
// AUTO leaves (c) out for the CANS schedule (see plan_newton_schulz).
NsPlan plan_newton_schulz(const ShardLayout& layout, int comm_size,
                          const shardmuon_ns_options& options);

// Throws INVALID_ARGUMENT when the requested algorithm cannot run on the layout (the Gram
// all-reduce, (b) or (c), on flat shards); `where` names the arguments in the message.
void check_algorithm_fits_layout(shardmuon_ns_algorithm requested, const ShardLayout& layout,
                                 const std::string& where);

// The plan as the C API reports it: LOCAL, DUPLICATED, GRAM_ALLREDUCE or
// GRAM_ALLREDUCE_REDISTRIBUTED.
shardmuon_ns_algorithm reported_algorithm(const NsPlan& plan);

// The cost model's seconds for a plan (core/ns_cost_model.h).
double estimate_plan_seconds(const NsPlan& plan, const NsCostInputs& inputs,
                             const MachineModel& machine);

// (e)'s restart period. M = Q_k ... Q_0 multiplies X's small singular values by up to the
// product of the steps' a coefficients (3.44 per quintic step: 485x over five), and so M's
// rounding errors, relative to the result, by as much; the standard iteration has no such
// gain. X <- M X and R recomputed every two steps keeps the gain near 12x (34x for
// polar_express's first steps). In float32 this matters as well as in bfloat16: 2085 x 2301,
// quintic, on an H200, (e)'s error against the float64 oracle was 4.3e-5 without restarts,
// 7.8e-6 every three steps and 2.9e-6 every two, against the standard iteration's 2.0e-6
// (the tolerance is 2e-5). float64 has the digits to spare and never restarts.
inline int gram_iteration_restart(shardmuon_dtype dtype, int iterations) {
  return dtype == SHARDMUON_FLOAT64 ? iterations : 2;
}

struct NsProblem {
  shardmuon_dtype dtype = SHARDMUON_FLOAT32;
  ShardLayout layout;
  std::vector<Coefficients> coefficients;  // one per iteration
  double eps = 0.0;
  NsPlan plan;
  // LOCAL plans only: `batch` matrices of this layout one after another in the buffer
  // (rows * cols elements apart), each orthogonalized on its own with every product a
  // strided batch: one launch per product for many small matrices (experts).
  int64_t batch = 1;
};

// The most matrices in one batch (the CUDA kernels put a batch along a grid dimension).
constexpr int64_t kMaxNsBatch = 4096;

// Bytes of workspace run_newton_schulz needs on this rank of a group of `ranks`.
size_t newton_schulz_workspace_bytes(const Backend& backend, const NsProblem& problem, int rank,
                                     int ranks);

// Orthogonalizes this rank's shard in place. Arguments already validated and agreed on by
// every rank; the caller's buffer is written only at the end. The scratch starts at
// workspace_offset bytes into the backend's workspace (what lies before it is the caller's).
void run_newton_schulz(Backend& backend, Communicator& comm, const NsProblem& problem,
                       void* local_shard, Stream stream, size_t workspace_offset = 0);

}  // namespace shardmuon
