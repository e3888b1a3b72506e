// The Muon optimizer step over a batch of parameters (DESIGN.md section 1), written once
// against the Backend and Communicator interfaces: per parameter, the fused momentum pass,
// the distributed Newton-Schulz of the update, and the fused update pass.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/backend.h"
#include "core/newton_schulz.h"

namespace shardmuon {

// One parameter of a validated step.
struct MuonParamPlan {
  const shardmuon_muon_param* param = nullptr;  // the caller's pointers
  NsProblem ns;  // its layout, the dtype of its iteration (ns_storage), the group's schedule
  bool has_grad = false;
  double decay = 1.0;      // param <- param * decay - step_size * O
  double step_size = 0.0;  // lr * extra_scale_factor * scale(m, n)
  // The group's lr_on_device: decay and step_size then come from the value it holds when the
  // passes run (they are computed above with lr = 0).
  DeviceLearningRate device_lr;
  double l2_decay = 0.0;  // g = grad + l2_decay * param
  double beta = 0.0;
  bool nesterov = false;
  // (f): the parameter's matrices are in the step's owner batch (ValidatedMuonStep::owned).
  bool owned = false;
  // With row_blocks > 1, the stacked matrices' own problems and where each starts in this
  // rank's shard (elements); empty otherwise (ns is then the one problem).
  struct RowBlock {
    NsProblem ns;
    int64_t offset = 0;
  };
  std::vector<RowBlock> row_blocks;
  shardmuon_ns_algorithm requested = SHARDMUON_NS_AUTO;  // the group's ns.algorithm
};

// A matrix of the owner batch: a parameter, or one of its stacked blocks.
struct OwnedMatrix {
  size_t param = 0;    // index into the plans
  size_t block = 0;    // which of its stacked matrices (row_blocks; 0 when it has one)
  int64_t offset = 0;  // elements into the parameter's local shard where this matrix starts
  NsProblem ns;        // its layout over the group (sharded, or replicated)
  NsProblem whole;     // the owner's local problem on the whole matrix
  int owner = 0;
};

struct ValidatedMuonStep {
  std::vector<MuonParamPlan> plans;
  // The owner batch: in parameter (then block) order, except that the matrices with the same
  // problem are next to each other (where the first of them is).
  std::vector<OwnedMatrix> owned;
  uint64_t digest = 0;
  std::string description;
};

// A context's default for StepSettings::ns_batch_bytes (256 MiB).
constexpr size_t kDefaultNsBatchBytes = SHARDMUON_DEFAULT_NS_BATCH_BYTES;

// How a context runs its steps (shardmuon_context_set_nonfinite_policy,
// shardmuon_context_set_ns_batch_bytes and shardmuon_context_set_step_flag). The first two
// enter the digest the ranks agree on: the policy decides the step's collectives, and the
// batches decide the kernels of replicated matrices, which every rank must run alike to get
// the same bits.
struct StepSettings {
  shardmuon_nonfinite_policy nonfinite_policy = SHARDMUON_NONFINITE_SKIP;
  // The most scratch one strided batch of Newton-Schulz may take: a batch holds as many
  // matrices of one problem as fit in it, and at least one.
  size_t ns_batch_bytes = kDefaultNsBatchBytes;
  // shardmuon_context_set_step_flag: read into a checked step's own flag before its checks and
  // written with the step's verdict after them; not in the digest (it changes no collective).
  float* step_flag = nullptr;
};

// The scale of the orthogonalized update for a logical rows x cols matrix.
double muon_update_scale(shardmuon_scale_mode mode, int64_t rows, int64_t cols);

// Checks a group's hyperparameters; messages name "groups[index]".
void validate_muon_group(const shardmuon_muon_group& group, int index);

// Checks everything a step needs on this rank alone (pointers, alignment, overlaps, layouts,
// dtypes, groups) and computes what must agree across ranks. Throws INVALID_ARGUMENT naming
// the parameter and field at fault. With require_grads false, grad pointers are ignored
// (checkpoints use the same checks).
ValidatedMuonStep validate_muon_step(const Backend& backend, const Communicator& comm,
                                     const shardmuon_muon_param* params, int num_params,
                                     const shardmuon_muon_group* groups, int num_groups,
                                     bool use_grads = true);

// Forms the step's owner batch and assigns its matrices to ranks: the parameters whose group
// asks for OWNER (sharded or replicated; stacked ones block by block), and the sharded AUTO
// ones if the cost model prefers owners to distributing each matrix (core/ns_cost_model.h).
// Longest processing time first: the most expensive matrix goes to the least loaded rank,
// ties to the lower index and rank, so every rank assigns alike.
void plan_owners(ValidatedMuonStep& step, int ranks);

// Bytes of workspace a step needs on this rank: every parameter's update buffer (and, for
// checked policies, its new momentum and the flags), the owner's staging and whole matrices,
// and the largest Newton-Schulz scratch.
size_t muon_step_workspace_bytes(const Backend& backend, const ValidatedMuonStep& step, int rank,
                                 int ranks, const StepSettings& settings);

// Where the backend's persistent status keeps the non-finite counters (int64 each).
constexpr size_t kSkippedStepsOffset = 0;
constexpr size_t kSkippedParamsOffset = 8;

// Runs the step. With SKIP or RAISE, a non-finite gradient skips the step on every rank and a
// non-finite update skips its parameter (nothing of them is written); RAISE then throws
// NON_FINITE naming them, after waiting for the stream.
void run_muon_step(Backend& backend, Communicator& comm, const ValidatedMuonStep& step,
                   Stream stream, const StepSettings& settings);

}  // namespace shardmuon
