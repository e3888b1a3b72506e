#include "core/muon_step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

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
bool is_valid_ns_storage(int storage) {
  return storage >= SHARDMUON_NS_STORAGE_PARAM && storage <= SHARDMUON_NS_STORAGE_FLOAT32;
}

// The most matrices in one strided batch: $SHARDMUON_MAX_NS_BATCH where set (1: every
// matrix on its own, for comparing in benchmarks), else kMaxNsBatch. It changes no
// collective, but it enters the step's digest: replicated parameters, which every rank
// orthogonalizes alike, would go through other kernels on a rank with another cap and differ
// in their last bits.
int64_t ns_batch_cap() {
  const char* text = std::getenv("SHARDMUON_MAX_NS_BATCH");
  if (text == nullptr) return kMaxNsBatch;
  const int64_t cap = std::atoll(text);
  SHARDMUON_CHECK_ARG(cap >= 1 && cap <= kMaxNsBatch, "SHARDMUON_MAX_NS_BATCH must be in [1, ",
                      kMaxNsBatch, "], not '", text, "'");
  return cap;
}

// The dtype a parameter's update is orthogonalized in.
shardmuon_dtype ns_dtype_of(shardmuon_ns_storage storage, shardmuon_dtype param) {
  switch (storage) {
    case SHARDMUON_NS_STORAGE_PARAM: return param;
    case SHARDMUON_NS_STORAGE_BFLOAT16: return SHARDMUON_BFLOAT16;
    case SHARDMUON_NS_STORAGE_FLOAT32: return SHARDMUON_FLOAT32;
  }
  fail(SHARDMUON_ERROR_INTERNAL, "unknown ns_storage ", static_cast<int>(storage));
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

// The problems of row_blocks matrices stacked along dim 0 of `whole`, and where each starts
// in this rank's shard. A block of a dim-1 shard (or of a replicated matrix) is rows of every
// rank's shard; a block of a dim-0 or flat shard lies on the ranks whose range it meets, in
// pieces that are contiguous ranges of their shards (rows, or elements).
std::vector<MuonParamPlan::RowBlock> split_rows(const NsProblem& whole, int64_t row_blocks,
                                                const shardmuon_ns_options& options,
                                                const Communicator& comm) {
  const ShardLayout& layout = whole.layout;
  const int rank = comm.rank(), ranks = comm.size();
  const int64_t rows = layout.rows() / row_blocks, cols = layout.cols();
  std::vector<MuonParamPlan::RowBlock> blocks(row_blocks);
  for (int64_t b = 0; b < row_blocks; ++b) {
    std::vector<int64_t> sizes(ranks, 0);
    shardmuon_layout api{rows, cols, layout.partition(), ranks, nullptr};
    int64_t offset = b * rows * layout.local_cols(rank);
    if (layout.is_sharded() && layout.shards_are_contiguous()) {
      // In the shards' unit: rows (dim 0) or elements (flat).
      const int64_t unit = layout.is_flat() ? 1 : cols;
      const int64_t first = b * rows * cols / unit, last = first + rows * cols / unit;
      for (int r = 0; r < ranks; ++r) {
        const int64_t begin = std::max(first, layout.shard_offsets()[r]);
        const int64_t end = std::min(last, layout.shard_offsets()[r] + layout.shard_sizes()[r]);
        sizes[r] = std::max<int64_t>(0, end - begin);
      }
      offset =
          sizes[rank] > 0
              ? (std::max(first, layout.shard_offsets()[rank]) - layout.shard_offsets()[rank]) *
                    unit
              : 0;
      api.shard_sizes = sizes.data();
    } else if (layout.is_sharded()) {
      api.shard_sizes = layout.shard_sizes().data();
    }
    MuonParamPlan::RowBlock& block = blocks[b];
    block.ns = whole;
    block.ns.layout = ShardLayout::from_api(api, ranks);
    block.ns.plan = plan_newton_schulz(block.ns.layout, ranks, options);
    block.offset = offset;
  }
  return blocks;
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
  // With lr_on_device, lr is ignored (the step reads the device value).
  SHARDMUON_CHECK_ARG(group.lr_on_device != nullptr || (std::isfinite(group.lr) && group.lr >= 0),
                      name, ".lr must be finite and >= 0, got ", group.lr);
  SHARDMUON_CHECK_ARG(reinterpret_cast<uintptr_t>(group.lr_on_device) % alignof(float) == 0, name,
                      ".lr_on_device (", static_cast<const void*>(group.lr_on_device),
                      ") is not 4-byte aligned");
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
  SHARDMUON_CHECK_ARG(is_valid_ns_storage(group.ns_storage), name,
                      ".ns_storage is unknown: ", static_cast<int>(group.ns_storage));
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
  // The symmetric block width and the short sides' padding decide how Gram sums are cut into
  // all-reduces.
  digest.add(backend.symmetric_block_target()).add(backend.short_side_multiple());
  digest.add(ns_batch_cap());
  for (int g = 0; g < num_groups; ++g) {
    const shardmuon_muon_group& group = groups[g];
    // A learning rate on the device differs between ranks in its address only; the ranks agree
    // that there is one (it decides what the kernels read), not on the value.
    digest.add(group.lr_on_device != nullptr).add(group.lr_on_device != nullptr ? 0.0 : group.lr);
    digest.add(group.momentum).add(group.nesterov).add(group.weight_decay);
    digest.add(group.weight_decay_mode).add(group.scale_mode).add(group.extra_scale_factor);
    for (const Coefficients& k : coefficients_for(group.ns)) digest.add(k.a).add(k.b).add(k.c);
    digest.add(group.ns.eps).add(group.ns.algorithm).add(group.ns_storage);
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
    check_algorithm_fits_layout(
        group.ns.algorithm, layout,
        concat("groups[", group_index, "].ns.algorithm, ", name, ".layout"));
    MuonParamPlan plan;
    plan.param = &p;
    SHARDMUON_CHECK_ARG(p.no_grad == 0 || p.no_grad == 1, name, ".no_grad must be 0 or 1, got ",
                        p.no_grad);
    plan.has_grad = use_grads && p.no_grad == 0;
    plan.beta = group.momentum;
    plan.nesterov = group.nesterov != 0;
    const double lr = group.lr_on_device != nullptr ? 0.0 : group.lr, wd = group.weight_decay;
    // decay = (its part without lr) - decay_per_lr * lr; step_size = step_size_per_lr * lr.
    double decay_without_lr = 1.0, decay_per_lr = 0.0;
    switch (group.weight_decay_mode) {
      case SHARDMUON_WEIGHT_DECAY_DECOUPLED: decay_per_lr = wd; break;
      case SHARDMUON_WEIGHT_DECAY_INDEPENDENT: decay_without_lr = 1.0 - wd; break;
      case SHARDMUON_WEIGHT_DECAY_L2: plan.l2_decay = wd; break;
      case SHARDMUON_WEIGHT_DECAY_NONE: break;
    }
    plan.decay = decay_without_lr - decay_per_lr * lr;
    const int64_t row_blocks = p.row_blocks == 0 ? 1 : p.row_blocks;
    SHARDMUON_CHECK_ARG(row_blocks >= 1 && row_blocks <= SHARDMUON_MAX_ROW_BLOCKS &&
                            layout.rows() % row_blocks == 0,
                        name, ".row_blocks (", p.row_blocks, ") must divide the ", layout.rows(),
                        " rows and be at most ", SHARDMUON_MAX_ROW_BLOCKS);
    // The products see each stacked matrix on its own.
    backend.check_matrix_shape(layout.rows() / row_blocks, layout.cols(),
                               row_blocks > 1 ? name + ".layout / row_blocks" : name + ".layout");
    // Each stacked matrix is scaled by its own shape.
    const double step_size_per_lr =
        group.extra_scale_factor *
        muon_update_scale(group.scale_mode, layout.rows() / row_blocks, layout.cols());
    plan.step_size = lr * step_size_per_lr;
    // The passes compute in float32: a finite double beyond its range would write infinities.
    const auto fits_float = [](double x) {
      return std::abs(x) <= std::numeric_limits<float>::max();
    };
    SHARDMUON_CHECK_ARG(fits_float(plan.step_size) && fits_float(step_size_per_lr) &&
                            fits_float(plan.decay) && fits_float(decay_per_lr),
                        "groups[", group_index, "] gives ", name, " a step size (lr ", lr,
                        " x extra_scale_factor x scale = ", plan.step_size, ") or a decay (",
                        plan.decay, ") beyond float32's range, in which the step computes");
    if (group.lr_on_device != nullptr) {
      backend.check_pointer(group.lr_on_device,
                            concat("groups[", group_index, "].lr_on_device").c_str());
      plan.device_lr = {group.lr_on_device, decay_per_lr, step_size_per_lr};
    }
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
    const shardmuon_dtype ns_dtype = ns_dtype_of(group.ns_storage, p.dtype);
    backend.check_dtype(ns_dtype);
    plan.ns = NsProblem{ns_dtype, layout, coefficients_for(group.ns), group.ns.eps,
                        plan_newton_schulz(layout, comm.size(), group.ns)};
    plan.requested = group.ns.algorithm;
    if (row_blocks > 1) {
      plan.row_blocks = split_rows(plan.ns, row_blocks, group.ns, comm);
    }

    digest.add(p.dtype).add(p.layout.rows).add(p.layout.cols).add(p.layout.partition);
    for (int64_t size : layout.shard_sizes()) digest.add(size);
    digest.add(group_index).add(plan.has_grad).add(row_blocks);
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

  plan_owners(step, comm.size());
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

// Two matrices can run in one strided batch (NsProblem::batch): both local, with the same
// problem. Their layouts may differ: a local iteration's orientation depends on the shape
// alone (WideBlock::whole), so a square matrix sharded along dim 0 and a replicated one
// iterate alike.
bool batchable_together(const NsProblem& a, const NsProblem& b) {
  auto same = [](const Coefficients& x, const Coefficients& y) {
    return x.a == y.a && x.b == y.b && x.c == y.c;
  };
  return a.plan.algorithm == NsPlan::Algorithm::kLocal &&
         b.plan.algorithm == NsPlan::Algorithm::kLocal && a.dtype == b.dtype &&
         a.layout.rows() == b.layout.rows() && a.layout.cols() == b.layout.cols() &&
         a.plan.iteration == b.plan.iteration && a.eps == b.eps &&
         std::equal(a.coefficients.begin(), a.coefficients.end(), b.coefficients.begin(),
                    b.coefficients.end(), same);
}

// The positions 0 .. count - 1 in groups whose problems can share a batch: the groups in the
// order their first members appear, each member in its own order.
template <typename ProblemOf>
std::vector<std::vector<size_t>> grouped_by_problem(size_t count, ProblemOf problem_of) {
  std::vector<std::vector<size_t>> groups;
  for (size_t k = 0; k < count; ++k) {
    auto same = std::find_if(groups.begin(), groups.end(), [&](const std::vector<size_t>& group) {
      return batchable_together(problem_of(group.front()), problem_of(k));
    });
    if (same == groups.end()) {
      groups.push_back({k});
    } else {
      same->push_back(k);
    }
  }
  return groups;
}

// The standard and the Gram iteration of a whole matrix on one rank, by the cost model.
struct LocalCosts {
  double standard = 0.0, gram = 0.0;
};
LocalCosts local_costs(const NsProblem& whole, const MachineModel& machine) {
  const int iterations = static_cast<int>(whole.coefficients.size());
  const NsCostInputs standard{whole.layout, 1, iterations};
  NsCostInputs gram = standard;
  gram.gram_iteration_restart = gram_iteration_restart(whole.dtype, iterations);
  return {estimate_local_seconds(standard, machine), estimate_local_seconds(gram, machine)};
}

// The matrices of a parameter as owner-batch entries (owner still unassigned). An owner runs
// (e) on its whole matrix where the cost model finds it cheaper than the standard iteration (a
// long side well above the short one) under AUTO, and under GRAM_NEWTON_SCHULZ where it takes
// fewer flops: (e)'s extra products and passes then decide only on matrices whose whole
// Newton-Schulz takes microseconds either way. OWNER names the standard iteration.
std::vector<OwnedMatrix> matrices_of(const MuonParamPlan& plan, size_t index) {
  MachineModel flops_only;
  flops_only.seconds_per_gemm = 0.0;
  flops_only.memory_bytes_per_second = std::numeric_limits<double>::infinity();
  const bool requested_gram = plan.requested == SHARDMUON_NS_GRAM_NEWTON_SCHULZ;
  const bool may_choose_gram = requested_gram || plan.requested == SHARDMUON_NS_AUTO;
  std::vector<OwnedMatrix> matrices;
  auto add = [&](const NsProblem& ns, int64_t offset) {
    OwnedMatrix m;
    m.param = index;
    m.block = matrices.size();
    m.offset = offset;
    m.ns = ns;
    m.whole = ns;
    const shardmuon_layout whole{ns.layout.rows(), ns.layout.cols(), SHARDMUON_REPLICATED, 1,
                                 nullptr};
    m.whole.layout = ShardLayout::from_api(whole, 1);
    m.whole.plan = NsPlan{};  // local
    if (may_choose_gram) {
      const LocalCosts costs = local_costs(m.whole, requested_gram ? flops_only : MachineModel{});
      if (costs.gram < costs.standard) m.whole.plan.iteration = NsPlan::Iteration::kOnGram;
    }
    matrices.push_back(std::move(m));
  };
  if (plan.row_blocks.empty()) add(plan.ns, 0);
  for (const MuonParamPlan::RowBlock& block : plan.row_blocks) add(block.ns, block.offset);
  return matrices;
}

}  // namespace

void plan_owners(ValidatedMuonStep& step, int ranks) {
  if (ranks == 1) return;
  const MachineModel machine;
  std::vector<size_t> requested, automatic;  // indexes into step.plans
  for (size_t i = 0; i < step.plans.size(); ++i) {
    const MuonParamPlan& plan = step.plans[i];
    if (!plan.has_grad) continue;
    if (plan.requested == SHARDMUON_NS_OWNER) requested.push_back(i);
    // Replicated parameters join only when asked: their owner's result replaces every
    // rank's, which is right for replicas (data parallelism) and only for them. Under
    // GRAM_NEWTON_SCHULZ the choice is AUTO's, with (e) for the owners where it is less work.
    const bool chooses =
        plan.requested == SHARDMUON_NS_AUTO || plan.requested == SHARDMUON_NS_GRAM_NEWTON_SCHULZ;
    if (chooses && plan.ns.layout.is_sharded()) automatic.push_back(i);
  }
  auto local_seconds = [&](const OwnedMatrix& m) {
    const LocalCosts costs = local_costs(m.whole, machine);
    return m.whole.plan.gram_iteration() ? costs.gram : costs.standard;
  };
  // Longest processing time first over the ranks; returns the makespan.
  auto assign = [&](std::vector<OwnedMatrix>& batch) {
    std::vector<size_t> order(batch.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::vector<double> cost(batch.size());
    for (size_t k = 0; k < batch.size(); ++k) cost[k] = local_seconds(batch[k]);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return cost[x] > cost[y]; });
    std::vector<double> load(ranks, 0.0);
    for (size_t k : order) {
      const int rank = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      batch[k].owner = rank;
      load[rank] += cost[k];
    }
    return *std::max_element(load.begin(), load.end());
  };
  auto matrices_of_all = [&](const std::vector<size_t>& params) {
    std::vector<OwnedMatrix> all;
    for (size_t i : params) {
      for (OwnedMatrix& m : matrices_of(step.plans[i], i)) all.push_back(std::move(m));
    }
    return all;
  };

  std::vector<size_t> batch = requested;
  if (!automatic.empty()) {
    // Per matrix, the collectives of one matrix run one after another; with owners, the
    // work is spread and the shards move twice in all.
    double separately = 0.0, moved_bytes = 0.0;
    for (size_t i : automatic) {
      const MuonParamPlan& plan = step.plans[i];
      const int iterations = static_cast<int>(plan.ns.coefficients.size());
      if (plan.row_blocks.empty()) {
        separately += estimate_plan_seconds(
            plan.ns.plan, NsCostInputs{plan.ns.layout, ranks, iterations}, machine);
      }
      for (const MuonParamPlan::RowBlock& block : plan.row_blocks) {
        separately += estimate_plan_seconds(
            block.ns.plan, NsCostInputs{block.ns.layout, ranks, iterations}, machine);
      }
      moved_bytes += static_cast<double>(plan.ns.layout.rows()) *
                     static_cast<double>(plan.ns.layout.cols()) *
                     static_cast<double>(element_size(plan.ns.dtype)) / ranks * (ranks - 1) / ranks;
    }
    std::vector<OwnedMatrix> candidates = matrices_of_all(automatic);
    const double together =
        assign(candidates) +
        2 * (machine.seconds_per_collective + moved_bytes / machine.all_to_all_bytes_per_second);
    if (candidates.size() >= 2 && together < separately) {
      batch.insert(batch.end(), automatic.begin(), automatic.end());
    }
  }
  std::sort(batch.begin(), batch.end());
  std::vector<OwnedMatrix> owned = matrices_of_all(batch);
  assign(owned);
  // The matrices with the same problem next to each other (and so in each owner's list), so
  // that an owner runs them as strided batches (run_owner_batch): one launch per product for
  // all of a model's layers of one shape, not one per matrix.
  step.owned.clear();
  for (const std::vector<size_t>& group : grouped_by_problem(
           owned.size(), [&](size_t k) -> const NsProblem& { return owned[k].whole; })) {
    for (size_t k : group) step.owned.push_back(std::move(owned[k]));
  }
  for (size_t i : batch) step.plans[i].owned = true;
}

namespace {

// The fused momentum pass of a parameter: the update into `update`, the new momentum in place
// or, for a checked step, into new_momentum.
MomentumPass momentum_pass_of(const MuonParamPlan& plan, int64_t count, void* update,
                              void* new_momentum, float* nonfinite_flag) {
  const shardmuon_muon_param& p = *plan.param;
  MomentumPass pass;
  pass.grad = p.grad;
  pass.param = plan.l2_decay != 0.0 ? p.param : nullptr;
  pass.momentum = p.momentum;
  pass.new_momentum = new_momentum;
  pass.update = update;
  pass.dtype = p.dtype;
  pass.update_dtype = plan.ns.dtype;
  pass.count = count;
  pass.beta = plan.beta;
  pass.nesterov = plan.nesterov;
  pass.l2_decay = plan.l2_decay;
  pass.nonfinite_flag = nonfinite_flag;
  return pass;
}

// A slot for this rank's shard of a parameter's update (in the Newton-Schulz dtype) or of its
// new momentum (in the parameter's).
size_t update_bytes(const MuonParamPlan& plan, int rank) {
  return aligned_bytes(plan.ns.layout.local_elements(rank) * element_size(plan.ns.dtype));
}
size_t momentum_bytes(const MuonParamPlan& plan, int rank) {
  return aligned_bytes(plan.ns.layout.local_elements(rank) * element_size(plan.param->dtype));
}

size_t whole_bytes(const NsProblem& ns) {
  return static_cast<size_t>(ns.layout.rows() * ns.layout.cols()) * element_size(ns.dtype);
}

// What a rank sends a matrix's owner in the first exchange (and gets back in the second): its
// shard; nothing for a replicated matrix, whose owner has it already, nor for the owner's own
// shard, which it reads from and writes back to its update buffer directly.
size_t exchanged_bytes(const OwnedMatrix& m, int rank) {
  if (!m.ns.layout.is_sharded() || rank == m.owner) return 0;
  return m.ns.layout.local_elements(rank) * element_size(m.ns.dtype);
}

// Newton-Schulz batches (NsProblem::batch): consecutive matrices with the same problem on one
// rank that lie one after another in memory run as one strided batch, so that thousands of
// small matrices (experts) cost a few launches per product instead of a few per matrix. A
// batch holds at most as many as fit `batch_bytes` of scratch (StepSettings::ns_batch_bytes;
// large matrices run one at a time: batching them saves nothing).

// The largest batch of `one` (1 unless its plan is local), under ns_batch_cap().
int64_t batch_limit(const Backend& backend, const NsProblem& one, size_t batch_bytes) {
  if (one.plan.algorithm != NsPlan::Algorithm::kLocal) return 1;
  const int64_t cap = ns_batch_cap();
  const size_t bytes = std::max<size_t>(1, newton_schulz_workspace_bytes(backend, one, 0, 1));
  return static_cast<int64_t>(std::clamp<size_t>(batch_bytes / bytes, 1, static_cast<size_t>(cap)));
}

NsProblem batch_of(NsProblem one, int64_t count) {
  one.batch = count;
  return one;
}

// Runs the Newton-Schulz of `count` matrices in batches: matrix i has the problem problem_of(i)
// and lies at data_of(i); it joins the batch of the matrices before it when it has their
// problem, lies right after the one before, and the batch is below its limit.
template <typename ProblemOf, typename DataOf>
void run_in_batches(Backend& backend, Communicator& comm, size_t count, ProblemOf problem_of,
                    DataOf data_of, size_t batch_bytes, Stream stream, size_t workspace_offset) {
  for (size_t first = 0; first < count;) {
    const NsProblem& problem = problem_of(first);
    const int64_t limit = batch_limit(backend, problem, batch_bytes);
    const size_t bytes = static_cast<size_t>(problem.layout.rows() * problem.layout.cols()) *
                         element_size(problem.dtype);
    size_t end = first + 1;
    while (end < count && static_cast<int64_t>(end - first) < limit &&
           batchable_together(problem, problem_of(end)) &&
           static_cast<char*>(data_of(end)) == static_cast<char*>(data_of(end - 1)) + bytes) {
      ++end;
    }
    run_newton_schulz(backend, comm, batch_of(problem, static_cast<int64_t>(end - first)),
                      data_of(first), stream, workspace_offset);
    first = end;
  }
}

// The scratch a batch of `one` may need when `available` such matrices could join it: the
// most matrices a batch of it can have (the scratch grows with the batch).
size_t batch_scratch_bytes(const Backend& backend, const NsProblem& one, size_t available,
                           size_t batch_bytes, int rank, int ranks) {
  const int64_t count = std::min<int64_t>(batch_limit(backend, one, batch_bytes),
                                          static_cast<int64_t>(std::max<size_t>(1, available)));
  return newton_schulz_workspace_bytes(backend, batch_of(one, count), rank, ranks);
}

// The problem of a parameter's matrices where they all have one: its own, or its stacked
// blocks' (see runs_alone).
const NsProblem& matrix_problem(const MuonParamPlan& plan) {
  return plan.row_blocks.empty() ? plan.ns : plan.row_blocks.front().ns;
}

// A parameter this rank orthogonalizes whole and by itself: not in the owner batch, with a
// local plan (replicated, or a group of one rank); when stacked, every block of one such
// problem. Its matrices may then share batches with other parameters' (the experts or heads
// of every layer in one batch).
bool runs_alone(const MuonParamPlan& plan) {
  if (!plan.has_grad || plan.owned) return false;
  const NsProblem& first = matrix_problem(plan);
  return first.plan.algorithm == NsPlan::Algorithm::kLocal &&
         std::all_of(plan.row_blocks.begin(), plan.row_blocks.end(),
                     [&](const MuonParamPlan::RowBlock& block) {
                       return batchable_together(first, block.ns);
                     });
}

// How many matrices a parameter holds: 1, or its stacked blocks.
size_t matrix_count(const MuonParamPlan& plan) {
  return std::max<size_t>(1, plan.row_blocks.size());
}

// Where a step's buffers lie in the workspace, on one rank (offsets from its start):
//   flags (checked): the step's, then one per parameter;
//   new momentum (checked) and the update: one buffer each per parameter with a gradient;
//   the owner batch (DESIGN.md (f)): what this rank sends each owner, grouped by owner; what
//     each source sends this rank; the whole matrices this rank owns; and, when the batch has
//     replicated matrices, one block per rank of their results for an all-gather;
//   then the Newton-Schulz scratch.
struct StepLayout {
  size_t flags = 0;
  std::vector<size_t> new_momentum, update;  // per parameter
  std::vector<size_t> sent;                  // per owned matrix: its piece, to its owner
  // Per owned matrix: its piece is its parameter's whole update, which then lives in the send
  // slot (the momentum pass writes it there and the returned result lands there): no packing
  // and no unpacking copy.
  std::vector<bool> sent_in_place;
  size_t sending = 0, receiving = 0;            // where those two regions start
  std::vector<std::vector<size_t>> received;    // [owned matrix][source]
  std::vector<size_t> matrix;                   // per owned matrix (owner only)
  size_t gathered = 0, gather_block_bytes = 0;  // replicated results, one block per rank
  std::vector<size_t> result;                   // per replicated matrix: within its block
  bool gathers = false;
  // The parameters this rank orthogonalizes whole and alone (runs_alone), those whose
  // matrices have the same problem next to each other: their update buffers are taken in this
  // order, one after another, so that their matrices run as strided batches.
  std::vector<size_t> alone;
  size_t scratch = 0, total = 0;

  static StepLayout of(const Backend& backend, const ValidatedMuonStep& step, int rank, int ranks,
                       const StepSettings& settings) {
    const bool checked = settings.nonfinite_policy != SHARDMUON_NONFINITE_PROCEED;
    const size_t batch_bytes = settings.ns_batch_bytes;
    const size_t n = step.plans.size(), owned = step.owned.size();
    StepLayout layout;
    size_t offset = 0;
    auto take = [&offset](size_t bytes) {
      const size_t at = offset;
      offset += aligned_bytes(bytes);
      return at;
    };
    if (checked) layout.flags = take((1 + n) * sizeof(float));
    layout.sent_in_place.assign(owned, false);
    std::vector<bool> update_in_send_slot(n, false);
    for (size_t k = 0; k < owned; ++k) {
      const OwnedMatrix& m = step.owned[k];
      const bool whole_parameter = step.plans[m.param].row_blocks.empty();
      layout.sent_in_place[k] = whole_parameter && exchanged_bytes(m, rank) > 0;
      update_in_send_slot[m.param] = layout.sent_in_place[k];
    }
    layout.new_momentum.assign(n, 0);
    layout.update.assign(n, 0);
    size_t scratch = 0;  // the most any Newton-Schulz call or batch below needs
    std::vector<size_t> alone;
    for (size_t i = 0; i < n; ++i) {
      if (!step.plans[i].has_grad) continue;
      if (checked) layout.new_momentum[i] = take(momentum_bytes(step.plans[i], rank));
      if (runs_alone(step.plans[i])) {
        alone.push_back(i);
      } else if (!update_in_send_slot[i]) {
        layout.update[i] = take(update_bytes(step.plans[i], rank));
      }
    }
    for (const std::vector<size_t>& group : grouped_by_problem(
             alone.size(),
             [&](size_t k) -> const NsProblem& { return matrix_problem(step.plans[alone[k]]); })) {
      size_t matrices = 0;
      for (size_t k : group) {
        layout.alone.push_back(alone[k]);
        layout.update[alone[k]] = take(update_bytes(step.plans[alone[k]], rank));
        matrices += matrix_count(step.plans[alone[k]]);
      }
      scratch = std::max(
          scratch, batch_scratch_bytes(backend, matrix_problem(step.plans[alone[group.front()]]),
                                       matrices, batch_bytes, rank, ranks));
    }

    layout.sent.assign(owned, 0);
    layout.received.assign(owned, std::vector<size_t>(ranks, 0));
    layout.matrix.assign(owned, 0);
    layout.result.assign(owned, 0);
    layout.sending = offset;
    for (int q = 0; q < ranks; ++q) {
      for (size_t k = 0; k < owned; ++k) {
        if (step.owned[k].owner == q) layout.sent[k] = take(exchanged_bytes(step.owned[k], rank));
      }
    }
    for (size_t k = 0; k < owned; ++k) {
      if (layout.sent_in_place[k]) layout.update[step.owned[k].param] = layout.sent[k];
    }
    take(1);  // the receive region never starts where the send region does (MPI wants it)
    layout.receiving = offset;
    for (int source = 0; source < ranks; ++source) {
      for (size_t k = 0; k < owned; ++k) {
        if (step.owned[k].owner == rank) {
          layout.received[k][source] = take(exchanged_bytes(step.owned[k], source));
        }
      }
    }
    std::vector<size_t> results_of(ranks, 0);  // bytes of replicated results per owner
    const size_t owned_here = static_cast<size_t>(
        std::count_if(step.owned.begin(), step.owned.end(),
                      [rank](const OwnedMatrix& m) { return m.owner == rank; }));
    const NsProblem* sized = nullptr;  // the last problem sized (its batches need the same)
    for (size_t k = 0; k < owned; ++k) {
      const OwnedMatrix& m = step.owned[k];
      if (!m.ns.layout.is_sharded()) {
        layout.gathers = true;
        layout.result[k] = results_of[m.owner];
        results_of[m.owner] += aligned_bytes(whole_bytes(m.ns));
      }
      if (m.owner != rank) continue;
      layout.matrix[k] = take(whole_bytes(m.whole));
      if (sized == nullptr || !batchable_together(*sized, m.whole)) {
        scratch =
            std::max(scratch, batch_scratch_bytes(backend, m.whole, owned_here, batch_bytes, 0, 1));
        sized = &m.whole;
      }
    }
    if (layout.gathers) {
      layout.gather_block_bytes = *std::max_element(results_of.begin(), results_of.end());
      layout.gathered = take(layout.gather_block_bytes * ranks);
    }
    for (size_t i = 0; i < n; ++i) {
      const MuonParamPlan& plan = step.plans[i];
      if (!plan.has_grad || plan.owned || runs_alone(plan)) continue;
      if (plan.row_blocks.empty()) {
        scratch = std::max(scratch, newton_schulz_workspace_bytes(backend, plan.ns, rank, ranks));
      }
      const NsProblem* block_sized = nullptr;
      for (const MuonParamPlan::RowBlock& block : plan.row_blocks) {
        if (block_sized != nullptr && batchable_together(*block_sized, block.ns)) continue;
        scratch = std::max(scratch, batch_scratch_bytes(backend, block.ns, plan.row_blocks.size(),
                                                        batch_bytes, rank, ranks));
        block_sized = &block.ns;
      }
    }
    layout.scratch = offset;
    layout.total = offset + scratch;
    return layout;
  }
};

// Moves one shard between where it was received and its owner's whole matrix, either way.
void move_shard(Backend& backend, const OwnedMatrix& m, int source, char* staged, char* matrix,
                bool into_matrix, Stream stream) {
  const ShardLayout& layout = m.ns.layout;
  const size_t element = element_size(m.ns.dtype);
  const int64_t size = layout.shard_sizes()[source], offset = layout.shard_offsets()[source];
  if (size == 0) return;
  if (layout.shards_are_contiguous()) {  // whole rows, or flat: one contiguous range
    const size_t bytes = layout.local_elements(source) * element;
    char* in_matrix = matrix + layout.element_offset(source) * element;
    backend.copy_2d(into_matrix ? in_matrix : staged, bytes, into_matrix ? staged : in_matrix,
                    bytes, bytes, 1, stream);
  } else {  // a block of columns: one pitched copy
    const size_t row_bytes = size * element, pitch = layout.cols() * element;
    char* in_matrix = matrix + offset * element;
    if (into_matrix) {
      backend.copy_2d(in_matrix, pitch, staged, row_bytes, row_bytes, layout.rows(), stream);
    } else {
      backend.copy_2d(staged, row_bytes, in_matrix, pitch, row_bytes, layout.rows(), stream);
    }
  }
}

void copy_bytes(Backend& backend, void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes > 0) backend.copy_2d(dst, bytes, src, bytes, bytes, 1, stream);
}

// (f) in rounds: each owner's matrices (in the order of step.owned) are cut into at most
// kOwnerRounds consecutive parts, and round r holds every owner's r-th part. Every rank sends
// its pieces of the round's sharded matrices to their owners and, once the owners have
// orthogonalized them, gets its pieces back: one all-to-all each way per round, on the
// backend's side stream, so that round r + 1's pieces travel and round r - 1's results come
// back while round r is computed. A bounded number of rounds keeps the collectives' fixed
// costs bounded for steps of thousands of small matrices (MoE experts). Replicated matrices'
// results (their owner holds the whole matrix already) reach every rank by one all-gather
// at the end.
constexpr size_t kOwnerRounds = 8;

void run_owner_batch(Backend& backend, Communicator& comm, const ValidatedMuonStep& step,
                     const StepLayout& layout, size_t batch_bytes, char* base, Stream stream) {
  const int rank = comm.rank(), ranks = comm.size();
  std::vector<std::vector<size_t>> owned_by(ranks);
  for (size_t k = 0; k < step.owned.size(); ++k) owned_by[step.owned[k].owner].push_back(k);
  size_t rounds = 0;
  for (const std::vector<size_t>& list : owned_by) rounds = std::max(rounds, list.size());
  rounds = std::min(rounds, kOwnerRounds);
  // Round r holds a contiguous part of each owner's list (at positions [first, last)), so its
  // pieces are contiguous in the send and receive regions: one message per peer.
  auto round_of = [&](int owner, size_t r) {
    const size_t n = owned_by[owner].size();
    return std::pair<size_t, size_t>{r * n / rounds, (r + 1) * n / rounds};
  };

  // This rank's piece of a matrix: contiguous in its update buffer.
  auto own_piece = [&](const OwnedMatrix& m) {
    return base + layout.update[m.param] + m.offset * element_size(m.ns.dtype);
  };
  // The pieces for other owners, packed by owner (unless they are there already).
  for (size_t k = 0; k < step.owned.size(); ++k) {
    if (layout.sent_in_place[k]) continue;
    copy_bytes(backend, base + layout.sent[k], own_piece(step.owned[k]),
               exchanged_bytes(step.owned[k], rank), stream);
  }

  // Offsets relative to each region's start, so that the send and receive buffers differ.
  char* sending = base + layout.sending;
  char* receiving = base + layout.receiving;
  const Stream side = backend.side_stream(stream);
  // One round's exchange: `forward`, the pieces to their owners; otherwise the results back.
  // Every rank knows every round's matrices, so all skip the same (all-replicated) rounds.
  auto exchange_round = [&](size_t r, bool forward) {
    std::vector<size_t> to_owner(ranks, 0), to_owner_at(ranks, 0);
    std::vector<size_t> from_source(ranks, 0), from_source_at(ranks, 0);
    bool any = false;
    for (int q = 0; q < ranks; ++q) {
      const auto [first, last] = round_of(q, r);
      for (size_t i = first; i < last; ++i) {
        const size_t k = owned_by[q][i];
        any = any || step.owned[k].ns.layout.is_sharded();
        if (i == first) to_owner_at[q] = layout.sent[k] - layout.sending;
        to_owner[q] += aligned_bytes(exchanged_bytes(step.owned[k], rank));  // slots are aligned
      }
    }
    if (!any) return;
    const auto [first, last] = round_of(rank, r);
    for (size_t i = first; i < last; ++i) {
      const size_t k = owned_by[rank][i];
      for (int source = 0; source < ranks; ++source) {
        if (i == first) from_source_at[source] = layout.received[k][source] - layout.receiving;
        from_source[source] += aligned_bytes(exchanged_bytes(step.owned[k], source));
      }
    }
    if (forward) {
      comm.all_to_all(sending, to_owner, to_owner_at, receiving, from_source, from_source_at, side);
    } else {
      comm.all_to_all(receiving, from_source, from_source_at, sending, to_owner, to_owner_at, side);
    }
  };

  char* gathered = base + layout.gathered;
  backend.order_after(side, stream);  // the packed pieces
  if (rounds > 0) exchange_round(0, true);
  backend.order_after(stream, side);
  for (size_t r = 0; r < rounds; ++r) {
    // Each whole matrix assembled from its pieces (or copied, replicated), or its result
    // returned to them.
    auto move_matrix = [&](size_t k, bool into_matrix) {
      const OwnedMatrix& m = step.owned[k];
      char* matrix = base + layout.matrix[k];
      if (m.ns.layout.is_sharded()) {
        for (int source = 0; source < ranks; ++source) {
          char* piece = source == rank ? own_piece(m) : base + layout.received[k][source];
          move_shard(backend, m, source, piece, matrix, into_matrix, stream);
        }
      } else if (into_matrix) {
        copy_bytes(backend, matrix, own_piece(m), whole_bytes(m.ns), stream);
      } else {
        copy_bytes(backend, gathered + rank * layout.gather_block_bytes + layout.result[k], matrix,
                   whole_bytes(m.ns), stream);
      }
    };
    // The round's matrices in batches of consecutive ones with the same problem (their whole
    // matrices lie one after another when their sizes are multiples of the slot alignment).
    // (Named locals, not a structured binding: C++17 lambdas cannot capture those.)
    const std::pair<size_t, size_t> round = round_of(rank, r);
    const size_t first = round.first, last = round.second;
    for (size_t i = first; i < last; ++i) move_matrix(owned_by[rank][i], true);
    run_in_batches(
        backend, comm, last - first,
        [&](size_t i) -> const NsProblem& { return step.owned[owned_by[rank][first + i]].whole; },
        [&](size_t i) -> void* { return base + layout.matrix[owned_by[rank][first + i]]; },
        batch_bytes, stream, layout.scratch);
    for (size_t i = first; i < last; ++i) move_matrix(owned_by[rank][i], false);
    // The next round's pieces, which the next round's products wait for (and, with them, for
    // the results of the round before this one, sent back meanwhile).
    if (r + 1 < rounds) {
      exchange_round(r + 1, true);
      backend.order_after(stream, side);
    }
    backend.order_after(side, stream);  // this round's results
    exchange_round(r, false);
  }
  backend.order_after(stream, side);
  if (layout.gathers) comm.all_gather_in_place(gathered, layout.gather_block_bytes, stream);
  // Every piece from another owner back into its update buffer (unless it is there already).
  for (size_t k = 0; k < step.owned.size(); ++k) {
    const OwnedMatrix& m = step.owned[k];
    if (layout.sent_in_place[k]) continue;
    if (m.ns.layout.is_sharded()) {
      copy_bytes(backend, own_piece(m), base + layout.sent[k], exchanged_bytes(m, rank), stream);
    } else {
      copy_bytes(backend, own_piece(m),
                 gathered + m.owner * layout.gather_block_bytes + layout.result[k],
                 whole_bytes(m.ns), stream);
    }
  }
}

}  // namespace

size_t muon_step_workspace_bytes(const Backend& backend, const ValidatedMuonStep& step, int rank,
                                 int ranks, const StepSettings& settings) {
  return StepLayout::of(backend, step, rank, ranks, settings).total;
}

// The step: momentum passes into update buffers, the Newton-Schulz of every update (the
// owner batch together, then those this rank runs alone in batches, then the others one by
// one), then the writes. A checked step (SKIP or
// RAISE) computes the new momentum aside and writes param and momentum only where no flag
// is set: a non-finite gradient on any rank flags the step, a non-finite update its
// parameter (summed over the ranks, so that a sharded parameter is skipped everywhere or
// nowhere).
void run_muon_step(Backend& backend, Communicator& comm, const ValidatedMuonStep& step,
                   Stream stream, const StepSettings& settings) {
  const bool checked = settings.nonfinite_policy != SHARDMUON_NONFINITE_PROCEED;
  const int rank = comm.rank();
  const StepLayout layout = StepLayout::of(backend, step, rank, comm.size(), settings);
  // Grown once up front: a later, larger request would move the buffer under the updates.
  char* base = static_cast<char*>(backend.workspace(layout.total, stream));
  const size_t count_of_flags = 1 + step.plans.size();
  float* flags = checked ? reinterpret_cast<float*>(base + layout.flags) : nullptr;
  char* counters = static_cast<char*>(backend.persistent_status());
  int64_t* skipped_steps = reinterpret_cast<int64_t*>(counters + kSkippedStepsOffset);
  int64_t* skipped_params = reinterpret_cast<int64_t*>(counters + kSkippedParamsOffset);

  // A checked step's momentum passes flag a non-finite gradient in flags[0] as they read it;
  // the caller's step flag starts it (shardmuon_context_set_step_flag), as 1 if set, so that
  // flags of opposite signs on two ranks cannot sum to zero.
  if (checked) {
    backend.fill_zero(flags, count_of_flags * sizeof(float), stream);
    if (settings.step_flag != nullptr) backend.mark_if_set(settings.step_flag, flags, stream);
  }
  std::vector<MomentumPass> momentum_passes;
  for (size_t i = 0; i < step.plans.size(); ++i) {
    const MuonParamPlan& plan = step.plans[i];
    if (!plan.has_grad) continue;  // skipped on every rank alike (the digest saw to it)
    momentum_passes.push_back(
        momentum_pass_of(plan, plan.ns.layout.local_elements(rank), base + layout.update[i],
                         checked ? base + layout.new_momentum[i] : nullptr, flags));
  }
  backend.momentum_passes(momentum_passes, stream);
  if (!step.owned.empty()) {
    run_owner_batch(backend, comm, step, layout, settings.ns_batch_bytes, base, stream);
  }
  // The matrices of the parameters run alone, in the order of their update buffers.
  std::vector<std::pair<const NsProblem*, char*>> alone;
  for (size_t i : layout.alone) {
    const MuonParamPlan& plan = step.plans[i];
    char* update = base + layout.update[i];
    if (plan.row_blocks.empty()) alone.emplace_back(&plan.ns, update);
    for (const MuonParamPlan::RowBlock& block : plan.row_blocks) {
      alone.emplace_back(&block.ns, update + block.offset * element_size(block.ns.dtype));
    }
  }
  run_in_batches(
      backend, comm, alone.size(), [&](size_t k) -> const NsProblem& { return *alone[k].first; },
      [&](size_t k) -> void* { return alone[k].second; }, settings.ns_batch_bytes, stream,
      layout.scratch);
  for (size_t i = 0; i < step.plans.size(); ++i) {
    const MuonParamPlan& plan = step.plans[i];
    if (!plan.has_grad || plan.owned || runs_alone(plan)) continue;
    char* update = base + layout.update[i];
    if (plan.row_blocks.empty()) {
      run_newton_schulz(backend, comm, plan.ns, update, stream, layout.scratch);
      continue;
    }
    // Stacked matrices of other plans (sharded blocks): each by its own plan, in batches
    // where consecutive blocks are local to this rank and share a problem.
    const size_t element = element_size(plan.ns.dtype);
    const std::vector<MuonParamPlan::RowBlock>& blocks = plan.row_blocks;
    run_in_batches(
        backend, comm, blocks.size(), [&](size_t b) -> const NsProblem& { return blocks[b].ns; },
        [&](size_t b) -> void* { return update + blocks[b].offset * element; },
        settings.ns_batch_bytes, stream, layout.scratch);
  }

  if (!checked) {
    std::vector<UpdatePass> updates;
    for (size_t i = 0; i < step.plans.size(); ++i) {
      const MuonParamPlan& plan = step.plans[i];
      if (!plan.has_grad) continue;
      updates.push_back({plan.param->param, base + layout.update[i], plan.param->dtype,
                         plan.ns.dtype, plan.ns.layout.local_elements(rank), plan.decay,
                         plan.step_size, plan.device_lr});
    }
    backend.update_passes(updates, stream);
    return;
  }

  bool any_sharded = false;
  std::vector<FiniteCheck> checks;
  for (size_t i = 0; i < step.plans.size(); ++i) {
    const MuonParamPlan& plan = step.plans[i];
    if (!plan.has_grad) continue;
    any_sharded = any_sharded || plan.ns.layout.is_sharded();
    checks.push_back({base + layout.update[i], plan.ns.dtype, plan.ns.layout.local_elements(rank),
                      flags + 1 + i});
  }
  backend.flag_nonfinite(checks, stream);
  // The step's flag (any rank's gradients) and, when a parameter is sharded, the parameters'
  // (any rank's piece of the update) in one all-reduce; a replicated parameter's update is the
  // same on every rank, and every rank knows whether any is sharded.
  if (comm.size() > 1) {
    const int64_t summed = any_sharded ? static_cast<int64_t>(count_of_flags) : 1;
    comm.all_reduce_sum(flags, summed, SHARDMUON_FLOAT32, stream);
  }
  std::vector<CommitPass> commits;
  for (size_t i = 0; i < step.plans.size(); ++i) {
    const MuonParamPlan& plan = step.plans[i];
    if (!plan.has_grad) continue;
    const shardmuon_muon_param& p = *plan.param;
    CommitPass commit;
    commit.param = p.param;
    commit.update = base + layout.update[i];
    commit.momentum = p.momentum;
    commit.new_momentum = base + layout.new_momentum[i];
    commit.dtype = p.dtype;
    commit.update_dtype = plan.ns.dtype;
    commit.count = plan.ns.layout.local_elements(rank);
    commit.decay = plan.decay;
    commit.step_size = plan.step_size;
    commit.step_flag = flags;
    commit.param_flag = flags + 1 + i;
    commit.skipped_params = skipped_params;
    commit.device_lr = plan.device_lr;
    commits.push_back(commit);
  }
  backend.commit_passes(commits, stream);
  backend.count_if_flagged(flags, skipped_steps, stream);
  if (settings.step_flag != nullptr) {  // the verdict, summed over the ranks
    backend.copy_2d(settings.step_flag, sizeof(float), flags, sizeof(float), sizeof(float), 1,
                    stream);
  }

  if (settings.nonfinite_policy != SHARDMUON_NONFINITE_RAISE) return;
  std::vector<float> host(count_of_flags);
  backend.copy_to_host(host.data(), flags, host.size() * sizeof(float), stream);
  backend.synchronize(stream);
  if (host[0] != 0.0f) {
    fail(SHARDMUON_ERROR_NON_FINITE,
         "a gradient of the step was not finite (NaN or Inf, on this rank or another), or a rank's "
         "step flag was set (shardmuon_context_set_step_flag); the step was skipped on every "
         "rank and nothing was written");
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

}  // namespace shardmuon
