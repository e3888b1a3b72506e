#include "core/muon_step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/agreement.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/schedule.h"
#include "core/workspace_carver.h"

namespace shardmuon {
namespace {

bool is_valid_weight_decay(int mode) {
  return mode >= SHARDMUON_WEIGHT_DECAY_DECOUPLED && mode <= SHARDMUON_WEIGHT_DECAY_NONE;
}
bool is_valid_scale_mode(int mode) {
  return mode >= SHARDMUON_SCALE_SPECTRAL && mode <= SHARDMUON_SCALE_NONE;
}

size_t aligned_bytes(size_t bytes) {
  return (bytes + WorkspaceCarver::kAlignment - 1) / WorkspaceCarver::kAlignment *
         WorkspaceCarver::kAlignment;
}

// A caller's buffer, for the overlap check.
struct BufferRange {
  uintptr_t begin, end;
  int param;
  const char* field;
};

void check_buffer(const Backend& backend, const void* pointer, const char* field, int index,
                  int64_t elements, shardmuon_dtype dtype, std::vector<BufferRange>& ranges) {
  const std::string name = concat("params[", index, "].", field);
  SHARDMUON_CHECK_ARG(pointer != nullptr, name, " is NULL but this rank's shard holds ", elements,
                      " elements");
  SHARDMUON_CHECK_ARG(reinterpret_cast<uintptr_t>(pointer) % element_size(dtype) == 0, name, " (",
                      pointer, ") is not aligned to the ", element_size(dtype),
                      "-byte elements of ", dtype_name(dtype));
  backend.check_pointer(pointer, name.c_str());
  const uintptr_t begin = reinterpret_cast<uintptr_t>(pointer);
  ranges.push_back({begin, begin + elements * element_size(dtype), index, field});
}

}  // namespace

double muon_update_scale(shardmuon_scale_mode mode, int64_t rows, int64_t cols) {
  const double m = static_cast<double>(rows), n = static_cast<double>(cols);
  switch (mode) {
    case SHARDMUON_SCALE_SPECTRAL: return std::sqrt(std::max(m, n));
    case SHARDMUON_SCALE_SHAPE_SCALING: return std::sqrt(std::max(1.0, m / n));
    case SHARDMUON_SCALE_UNIT_RMS_NORM: return std::sqrt(m / n);
    case SHARDMUON_SCALE_NONE: return 1.0;
  }
  fail(SHARDMUON_ERROR_INTERNAL, "unknown scale mode ", static_cast<int>(mode));
}

void validate_muon_group(const shardmuon_muon_group& group, int index) {
  const std::string name = "groups[" + std::to_string(index) + "]";
  SHARDMUON_CHECK_ARG(std::isfinite(group.lr) && group.lr >= 0, name,
                      ".lr must be finite and >= 0, got ", group.lr);
  SHARDMUON_CHECK_ARG(group.momentum >= 0 && group.momentum < 1, name,
                      ".momentum must be in [0, 1), got ", group.momentum);
  SHARDMUON_CHECK_ARG(group.nesterov == 0 || group.nesterov == 1, name,
                      ".nesterov must be 0 or 1, got ", group.nesterov);
  SHARDMUON_CHECK_ARG(std::isfinite(group.weight_decay) && group.weight_decay >= 0, name,
                      ".weight_decay must be finite and >= 0, got ", group.weight_decay);
  SHARDMUON_CHECK_ARG(is_valid_weight_decay(group.weight_decay_mode), name,
                      ".weight_decay_mode is unknown: ", static_cast<int>(group.weight_decay_mode));
  SHARDMUON_CHECK_ARG(is_valid_scale_mode(group.scale_mode), name,
                      ".scale_mode is unknown: ", static_cast<int>(group.scale_mode));
  SHARDMUON_CHECK_ARG(std::isfinite(group.extra_scale_factor), name,
                      ".extra_scale_factor must be finite, got ", group.extra_scale_factor);
  try {
    validate_ns_options(group.ns);
  } catch (const Failure& e) {
    // "options->..." from the Newton-Schulz check becomes "groups[i].ns...".
    std::string message = e.what();
    const std::string from = "options->";
    for (size_t at = message.find(from); at != std::string::npos; at = message.find(from)) {
      message.replace(at, from.size(), name + ".ns.");
    }
    throw Failure(e.status(), message);
  }
}

ValidatedMuonStep validate_muon_step(const Backend& backend, const Communicator& comm,
                                     const shardmuon_muon_param* params, int num_params,
                                     const shardmuon_muon_group* groups, int num_groups,
                                     bool use_grads) {
  SHARDMUON_CHECK_ARG(num_params >= 0, "num_params must be >= 0, got ", num_params);
  SHARDMUON_CHECK_ARG(num_params == 0 || params != nullptr, "params is NULL but num_params is ",
                      num_params);
  // Checkpoint loads may leave out the groups; the parameters' checks do not need them.
  shardmuon_muon_group default_group;
  const bool groups_optional = !use_grads && groups == nullptr;
  if (groups_optional) {
    if (shardmuon_muon_group_default(&default_group) != SHARDMUON_SUCCESS) {
      fail(SHARDMUON_ERROR_INTERNAL, "shardmuon_muon_group_default failed");
    }
    groups = &default_group;
    num_groups = 1;
  }
  SHARDMUON_CHECK_ARG(num_groups >= 1, "num_groups must be >= 1, got ", num_groups);
  SHARDMUON_CHECK_ARG(groups != nullptr, "groups is NULL");
  for (int g = 0; g < num_groups; ++g) validate_muon_group(groups[g], g);

  ValidatedMuonStep step;
  Digest digest;
  digest.add(num_params).add(num_groups).add(backend.kind()).add(use_grads);
  for (int g = 0; g < num_groups; ++g) {
    const shardmuon_muon_group& group = groups[g];
    digest.add(group.lr).add(group.momentum).add(group.nesterov).add(group.weight_decay);
    digest.add(group.weight_decay_mode).add(group.scale_mode).add(group.extra_scale_factor);
    for (const Coefficients& k : coefficients_for(group.ns)) digest.add(k.a).add(k.b).add(k.c);
    digest.add(group.ns.eps).add(group.ns.algorithm);
  }

  std::vector<BufferRange> ranges;
  for (int i = 0; i < num_params; ++i) {
    const shardmuon_muon_param& p = params[i];
    const std::string name = "params[" + std::to_string(i) + "]";
    const int group_index = groups_optional ? 0 : p.group;
    SHARDMUON_CHECK_ARG(group_index >= 0 && group_index < num_groups, name, ".group (", p.group,
                        ") is not a group index in [0, ", num_groups, ")");
    SHARDMUON_CHECK_ARG(is_valid_dtype(p.dtype), name,
                        ".dtype is unknown: ", static_cast<int>(p.dtype));
    backend.check_dtype(p.dtype);
    ShardLayout layout;
    try {
      layout = ShardLayout::from_api(p.layout, comm.size());
    } catch (const Failure& e) {  // "layout->rows" becomes "params[i].layout.rows"
      std::string message = e.what();
      const std::string from = "layout->";
      for (size_t at = message.find(from); at != std::string::npos; at = message.find(from)) {
        message.replace(at, from.size(), name + ".layout.");
      }
      throw Failure(e.status(), message);
    }
    const shardmuon_muon_group& group = groups[group_index];
    MuonParamPlan plan;
    plan.param = &p;
    SHARDMUON_CHECK_ARG(p.no_grad == 0 || p.no_grad == 1, name, ".no_grad must be 0 or 1, got ",
                        p.no_grad);
    plan.has_grad = use_grads && p.no_grad == 0;
    plan.beta = group.momentum;
    plan.nesterov = group.nesterov != 0;
    const double lr = group.lr, wd = group.weight_decay;
    switch (group.weight_decay_mode) {
      case SHARDMUON_WEIGHT_DECAY_DECOUPLED: plan.decay = 1.0 - lr * wd; break;
      case SHARDMUON_WEIGHT_DECAY_INDEPENDENT: plan.decay = 1.0 - wd; break;
      case SHARDMUON_WEIGHT_DECAY_L2: plan.l2_decay = wd; break;
      case SHARDMUON_WEIGHT_DECAY_NONE: break;
    }
    plan.step_size = lr * group.extra_scale_factor *
                     muon_update_scale(group.scale_mode, layout.rows(), layout.cols());
    const int64_t elements = layout.local_elements(comm.rank());
    if (elements > 0) {
      check_buffer(backend, p.param, "param", i, elements, p.dtype, ranges);
      // A step reads momentum only with a gradient (a framework may not have made the buffer
      // of a parameter that never had one); checkpoints always read it.
      if (plan.has_grad || !use_grads) {
        check_buffer(backend, p.momentum, "momentum", i, elements, p.dtype, ranges);
      }
      if (plan.has_grad) check_buffer(backend, p.grad, "grad", i, elements, p.dtype, ranges);
    }
    plan.ns = NsProblem{
        p.dtype, layout, coefficients_for(group.ns), group.ns.eps,
        plan_newton_schulz(layout, comm.size(), group.ns.algorithm, group.ns.num_iterations)};

    digest.add(p.dtype).add(p.layout.rows).add(p.layout.cols).add(p.layout.partition);
    for (int64_t size : layout.shard_sizes()) digest.add(size);
    digest.add(group_index).add(plan.has_grad);
    step.plans.push_back(std::move(plan));
  }

  // No two of the caller's buffers may share memory: the step writes param and momentum.
  std::sort(ranges.begin(), ranges.end(),
            [](const BufferRange& a, const BufferRange& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < ranges.size(); ++k) {
    const BufferRange& a = ranges[k - 1];
    const BufferRange& b = ranges[k];
    SHARDMUON_CHECK_ARG(b.begin >= a.end, "params[", a.param, "].", a.field, " and params[",
                        b.param, "].", b.field, " overlap in memory");
  }

  step.digest = digest.value();
  step.description = concat(num_params, " parameters in ", num_groups, " groups (group 0: lr ",
                            groups[0].lr, ", momentum ", groups[0].momentum, ")");
  for (int i = 0; i < std::min(num_params, 3); ++i) {
    step.description +=
        concat("; params[", i, "]: ", step.plans[i].ns.layout.describe(), " ",
               dtype_name(params[i].dtype), step.plans[i].has_grad ? "" : " without grad");
  }
  return step;
}

namespace {

// The fused momentum pass of a parameter: the update into `update`, the new momentum in place
// or, for a checked step, into new_momentum.
void run_momentum_pass(Backend& backend, const MuonParamPlan& plan, int64_t count, void* update,
                       void* new_momentum, Stream stream) {
  const shardmuon_muon_param& p = *plan.param;
  MomentumPass pass;
  pass.grad = p.grad;
  pass.param = plan.l2_decay != 0.0 ? p.param : nullptr;
  pass.momentum = p.momentum;
  pass.new_momentum = new_momentum;
  pass.update = update;
  pass.dtype = p.dtype;
  pass.count = count;
  pass.beta = plan.beta;
  pass.nesterov = plan.nesterov;
  pass.l2_decay = plan.l2_decay;
  backend.momentum_pass(pass, stream);
}

size_t flag_bytes(const ValidatedMuonStep& step) {
  return aligned_bytes((1 + step.plans.size()) * sizeof(float));
}

// A checked step (SKIP or RAISE). The workspace holds the flags (the step's, then one per
// parameter), then per parameter its new momentum, its update and the Newton-Schulz scratch.
void run_checked_step(Backend& backend, Communicator& comm, const ValidatedMuonStep& step,
                      Stream stream, shardmuon_nonfinite_policy policy) {
  const int rank = comm.rank();
  char* base = static_cast<char*>(backend.workspace(
      muon_step_workspace_bytes(backend, step, rank, comm.size(), policy), stream));
  float* flags = reinterpret_cast<float*>(base);
  char* counters = static_cast<char*>(backend.persistent_status());
  int64_t* skipped_steps = reinterpret_cast<int64_t*>(counters + kSkippedStepsOffset);
  int64_t* skipped_params = reinterpret_cast<int64_t*>(counters + kSkippedParamsOffset);
  const size_t region = flag_bytes(step);
  backend.fill_zero(flags, (1 + step.plans.size()) * sizeof(float), stream);

  // Any non-finite gradient, on any rank, skips the whole step.
  for (const MuonParamPlan& plan : step.plans) {
    if (!plan.has_grad) continue;
    backend.flag_nonfinite(plan.param->grad, plan.ns.dtype, plan.ns.layout.local_elements(rank),
                           flags, stream);
  }
  if (comm.size() > 1) comm.all_reduce_sum(flags, 1, SHARDMUON_FLOAT32, stream);

  for (size_t i = 0; i < step.plans.size(); ++i) {
    const MuonParamPlan& plan = step.plans[i];
    if (!plan.has_grad) continue;
    const shardmuon_muon_param& p = *plan.param;
    const int64_t count = plan.ns.layout.local_elements(rank);
    const size_t shard_bytes = aligned_bytes(count * element_size(p.dtype));
    char* new_momentum = base + region;
    char* update = new_momentum + shard_bytes;
    run_momentum_pass(backend, plan, count, update, new_momentum, stream);
    run_newton_schulz(backend, comm, plan.ns, update, stream, region + 2 * shard_bytes);

    // A sharded update must be skipped on every rank or on none.
    float* param_flag = flags + 1 + i;
    backend.flag_nonfinite(update, p.dtype, count, param_flag, stream);
    if (comm.size() > 1 && plan.ns.layout.is_sharded()) {
      comm.all_reduce_sum(param_flag, 1, SHARDMUON_FLOAT32, stream);
    }
    CommitPass commit;
    commit.param = p.param;
    commit.update = update;
    commit.momentum = p.momentum;
    commit.new_momentum = new_momentum;
    commit.dtype = p.dtype;
    commit.count = count;
    commit.decay = plan.decay;
    commit.step_size = plan.step_size;
    commit.step_flag = flags;
    commit.param_flag = param_flag;
    commit.skipped_params = skipped_params;
    backend.commit_pass(commit, stream);
  }
  backend.count_if_flagged(flags, skipped_steps, stream);

  if (policy != SHARDMUON_NONFINITE_RAISE) return;
  std::vector<float> host(1 + step.plans.size());
  backend.copy_to_host(host.data(), flags, host.size() * sizeof(float), stream);
  backend.synchronize(stream);
  if (host[0] != 0.0f) {
    fail(SHARDMUON_ERROR_NON_FINITE,
         "a gradient of the step was not finite (NaN or Inf, on this rank or another); the step "
         "was skipped on every rank and nothing was written");
  }
  std::string bad;
  for (size_t i = 0; i < step.plans.size(); ++i) {
    if (host[1 + i] != 0.0f) bad += concat(bad.empty() ? "" : ", ", "params[", i, "]");
  }
  if (!bad.empty()) {
    fail(SHARDMUON_ERROR_NON_FINITE, "the orthogonalized update of ", bad,
         " was not finite; those parameters and their momentum were left as they were, the "
         "others were updated");
  }
}

}  // namespace

size_t muon_step_workspace_bytes(const Backend& backend, const ValidatedMuonStep& step, int rank,
                                 int ranks, shardmuon_nonfinite_policy policy) {
  const bool checked = policy != SHARDMUON_NONFINITE_PROCEED;
  size_t largest = 0;
  for (const MuonParamPlan& plan : step.plans) {
    if (!plan.has_grad) continue;
    const size_t shard =
        aligned_bytes(plan.ns.layout.local_elements(rank) * element_size(plan.ns.dtype));
    largest = std::max(largest, (checked ? 2 : 1) * shard +
                                    newton_schulz_workspace_bytes(backend, plan.ns, rank, ranks));
  }
  return (checked ? flag_bytes(step) : 0) + largest;
}

void run_muon_step(Backend& backend, Communicator& comm, const ValidatedMuonStep& step,
                   Stream stream, shardmuon_nonfinite_policy policy) {
  if (policy != SHARDMUON_NONFINITE_PROCEED) {
    run_checked_step(backend, comm, step, stream, policy);
    return;
  }
  // Grown once up front: a later, larger request would move the buffer under the update.
  backend.workspace(muon_step_workspace_bytes(backend, step, comm.rank(), comm.size(), policy),
                    stream);
  for (const MuonParamPlan& plan : step.plans) {
    if (!plan.has_grad) continue;  // skipped on every rank alike (the digest saw to it)
    const shardmuon_muon_param& p = *plan.param;
    const int64_t count = plan.ns.layout.local_elements(comm.rank());
    // The update U lives at the start of the workspace; Newton-Schulz's scratch follows.
    const size_t update_bytes = aligned_bytes(count * element_size(p.dtype));
    void* update = backend.workspace(update_bytes, stream);
    run_momentum_pass(backend, plan, count, update, nullptr, stream);
    run_newton_schulz(backend, comm, plan.ns, update, stream, update_bytes);
    backend.update_pass(p.param, update, p.dtype, count, plan.decay, plan.step_size, stream);
  }
}

}  // namespace shardmuon
