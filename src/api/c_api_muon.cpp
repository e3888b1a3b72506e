// The C entry points of the Muon step.
#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "api/handles.h"
#include "core/agreement.h"
#include "core/api_guard.h"
#include "core/muon_step.h"

using shardmuon::api_guard;

namespace {

// What shardmuon_muon_step would run for each parameter, from a validated step: the reported
// algorithm, the owner (-1 without one) and whether it runs (e).
struct ParamRun {
  shardmuon_ns_algorithm algorithm = SHARDMUON_NS_AUTO;
  int owner = -1;
  shardmuon::NsPlan::Iteration iteration = shardmuon::NsPlan::Iteration::kStandard;
};

std::vector<ParamRun> planned_runs(shardmuon_context_t context, shardmuon_comm_t comm,
                                   const shardmuon_muon_param* params, int num_params,
                                   const shardmuon_muon_group* groups, int num_groups) {
  shardmuon::Communicator& group = shardmuon::communicator_of(comm, "comm");
  shardmuon::Backend& backend = shardmuon::backend_of(context, "context");
  group.check_compatible(backend);
  const shardmuon::ValidatedMuonStep step =
      shardmuon::validate_muon_step(backend, group, params, num_params, groups, num_groups);
  std::vector<ParamRun> runs(step.plans.size());
  for (size_t i = 0; i < step.plans.size(); ++i) {
    const shardmuon::MuonParamPlan& plan = step.plans[i];
    const shardmuon::NsPlan& ns =
        plan.row_blocks.empty() ? plan.ns.plan : plan.row_blocks.front().ns.plan;
    runs[i].algorithm = shardmuon::reported_algorithm(ns);
    runs[i].iteration = ns.iteration;
    for (const shardmuon::OwnedMatrix& m : step.owned) {
      if (m.param == i && m.block == 0) {  // the first of its matrices
        runs[i] = {SHARDMUON_NS_OWNER, m.owner, m.whole.plan.iteration};
        break;
      }
    }
  }
  return runs;
}

// For every parameter, 1 into out where it runs `iteration`, else 0 (`name`: out in errors).
void planned_flags(shardmuon_context_t context, shardmuon_comm_t comm,
                   const shardmuon_muon_param* params, int num_params,
                   const shardmuon_muon_group* groups, int num_groups,
                   shardmuon::NsPlan::Iteration iteration, int* out, const char* name) {
  SHARDMUON_CHECK_ARG(out != nullptr || num_params == 0, name, " is NULL");
  const std::vector<ParamRun> runs =
      planned_runs(context, comm, params, num_params, groups, num_groups);
  for (size_t i = 0; i < runs.size(); ++i) out[i] = runs[i].iteration == iteration ? 1 : 0;
}

}  // namespace

extern "C" {

shardmuon_status shardmuon_muon_group_default(shardmuon_muon_group* group) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(group != nullptr, "group is NULL");
    *group = shardmuon_muon_group{};
    group->lr = 3e-4;
    group->momentum = 0.95;
    group->nesterov = 1;
    group->weight_decay = 0.01;
    group->weight_decay_mode = SHARDMUON_WEIGHT_DECAY_DECOUPLED;
    group->scale_mode = SHARDMUON_SCALE_SPECTRAL;
    group->extra_scale_factor = 1.0;
    group->ns_storage = SHARDMUON_NS_STORAGE_PARAM;
    if (shardmuon_ns_options_default(&group->ns) != SHARDMUON_SUCCESS) {
      shardmuon::fail(SHARDMUON_ERROR_INTERNAL, "shardmuon_ns_options_default failed");
    }
  });
}

shardmuon_status shardmuon_muon_step(shardmuon_context_t context, shardmuon_comm_t comm,
                                     const shardmuon_muon_param* params, int num_params,
                                     const shardmuon_muon_group* groups, int num_groups,
                                     void* stream) {
  return api_guard(__func__, [&] {
    shardmuon::Communicator& group = shardmuon::communicator_of(comm, "comm");
    shardmuon::Backend* backend = nullptr;
    shardmuon::ValidatedMuonStep step;
    std::optional<shardmuon::BackendCallScope> scope;
    const std::exception_ptr local_error = shardmuon::capture_local_failure([&] {
      backend = &shardmuon::backend_of(context, "context");
      group.check_compatible(*backend);
      step = shardmuon::validate_muon_step(*backend, group, params, num_params, groups, num_groups);
      // The workspace grows before the ranks agree, so running out of memory is reported to
      // every rank instead of stranding the others in a collective.
      scope.emplace(*backend, stream);
      backend->workspace(shardmuon::muon_step_workspace_bytes(*backend, step, group.rank(),
                                                              group.size(), context->settings),
                         stream);
    });
    // The digest the ranks agree on covers the context's settings too (see StepSettings); a
    // rank whose context is not one sends only its failure.
    const uint64_t digest = backend == nullptr ? 0
                                               : shardmuon::Digest{}
                                                     .add(step.digest)
                                                     .add(context->settings.nonfinite_policy)
                                                     .add(context->settings.ns_batch_bytes)
                                                     .value();
    if (backend != nullptr && backend->is_capturing(stream)) {
      // Captured into a CUDA graph: nothing may wait on the host, so the ranks cannot compare
      // arguments now. They did at the last uncaptured step; the captured one must repeat it.
      if (local_error != nullptr) std::rethrow_exception(local_error);
      SHARDMUON_CHECK_ARG(context->settings.nonfinite_policy != SHARDMUON_NONFINITE_RAISE,
                          "the stream is being captured into a CUDA graph, and the non-finite "
                          "policy RAISE waits on the host for the step's flags; use SKIP or "
                          "PROCEED for a captured step");
      SHARDMUON_CHECK_ARG(group.agreed_on_step(digest),
                          "the stream is being captured into a CUDA graph, where the ranks "
                          "cannot check that their arguments agree; capture a step only after "
                          "running it once uncaptured, with the same parameters, layouts and "
                          "hyperparameters (learning rate included: the graph replays the "
                          "captured values), on this communicator. This step: ",
                          step.description);
      backend->pin_workspace();  // the graph will hold its address
      shardmuon::run_muon_step(*backend, group, step, stream, context->settings);
      return;
    }
    shardmuon::agree_across_ranks(group, local_error, digest, step.description);
    group.remember_agreed_step(digest);
    shardmuon::run_muon_step(*backend, group, step, stream, context->settings);
  });
}

shardmuon_status shardmuon_context_reduce_step_flag(shardmuon_context_t context,
                                                    shardmuon_comm_t comm, void* stream) {
  return api_guard(__func__, [&] {
    shardmuon::Communicator& group = shardmuon::communicator_of(comm, "comm");
    shardmuon::Backend* backend = nullptr;
    bool checked = false;
    std::optional<shardmuon::BackendCallScope> scope;
    const std::exception_ptr local_error = shardmuon::capture_local_failure([&] {
      backend = &shardmuon::backend_of(context, "context");
      group.check_compatible(*backend);
      checked = context->settings.nonfinite_policy != SHARDMUON_NONFINITE_PROCEED;
      SHARDMUON_CHECK_ARG(
          !checked || context->settings.step_flag != nullptr,
          "the context has no step flag to reduce (shardmuon_context_set_step_flag) "
          "under a checked non-finite policy");
      scope.emplace(*backend, stream);
    });
    if (backend != nullptr && backend->is_capturing(stream)) {
      if (local_error != nullptr) std::rethrow_exception(local_error);
    } else {
      // Tagged apart from every step's digest: a rank making a step where the others reduce
      // their flags disagrees with them instead of joining other collectives.
      const uint64_t digest = backend == nullptr
                                  ? 0
                                  : shardmuon::Digest{}
                                        .add_string("shardmuon_context_reduce_step_flag")
                                        .add(context->settings.nonfinite_policy)
                                        .value();
      shardmuon::agree_across_ranks(
          group, local_error, digest,
          backend == nullptr
              ? std::string("no context")
              : shardmuon::concat("shardmuon_context_reduce_step_flag under non-finite "
                                  "policy ",
                                  static_cast<int>(context->settings.nonfinite_policy)));
    }
    if (checked) {
      // The sum counts the ranks whose flag is set: flags of opposite signs cannot cancel. A
      // group of one marks its flag too, so that every caller reads a count (1, not -3 or NaN).
      backend->mark_if_set(context->settings.step_flag, context->settings.step_flag, stream);
      if (group.size() > 1) {
        group.all_reduce_sum(context->settings.step_flag, 1, SHARDMUON_FLOAT32, stream);
      }
    }
  });
}

shardmuon_status shardmuon_muon_plan(shardmuon_context_t context, shardmuon_comm_t comm,
                                     const shardmuon_muon_param* params, int num_params,
                                     const shardmuon_muon_group* groups, int num_groups,
                                     shardmuon_ns_algorithm* algorithms, int* owners) {
  return api_guard(__func__, [&] {
    const std::vector<ParamRun> runs =
        planned_runs(context, comm, params, num_params, groups, num_groups);
    for (size_t i = 0; i < runs.size(); ++i) {
      if (algorithms != nullptr) algorithms[i] = runs[i].algorithm;
      if (owners != nullptr) owners[i] = runs[i].owner;
    }
  });
}

shardmuon_status shardmuon_muon_plan_gram_iteration(
    shardmuon_context_t context, shardmuon_comm_t comm, const shardmuon_muon_param* params,
    int num_params, const shardmuon_muon_group* groups, int num_groups, int* gram_iteration) {
  return api_guard(__func__, [&] {
    planned_flags(context, comm, params, num_params, groups, num_groups,
                  shardmuon::NsPlan::Iteration::kOnGram, gram_iteration, "gram_iteration");
  });
}

shardmuon_status shardmuon_muon_plan_applied_twice(
    shardmuon_context_t context, shardmuon_comm_t comm, const shardmuon_muon_param* params,
    int num_params, const shardmuon_muon_group* groups, int num_groups, int* applied_twice) {
  return api_guard(__func__, [&] {
    planned_flags(context, comm, params, num_params, groups, num_groups,
                  shardmuon::NsPlan::Iteration::kAppliedTwice, applied_twice, "applied_twice");
  });
}

shardmuon_status shardmuon_context_set_nonfinite_policy(shardmuon_context_t context,
                                                        shardmuon_nonfinite_policy policy) {
  return api_guard(__func__, [&] {
    shardmuon::backend_of(context, "context");
    SHARDMUON_CHECK_ARG(policy >= SHARDMUON_NONFINITE_SKIP && policy <= SHARDMUON_NONFINITE_PROCEED,
                        "policy is unknown: ", static_cast<int>(policy));
    context->settings.nonfinite_policy = policy;
  });
}

shardmuon_status shardmuon_context_set_ns_batch_bytes(shardmuon_context_t context, size_t bytes) {
  return api_guard(__func__, [&] {
    shardmuon::backend_of(context, "context");
    context->settings.ns_batch_bytes = bytes;
  });
}

shardmuon_status shardmuon_context_set_step_flag(shardmuon_context_t context, float* flag) {
  return api_guard(__func__, [&] {
    shardmuon::Backend& backend = shardmuon::backend_of(context, "context");
    if (flag != nullptr) {
      backend.check_pointer(flag, "flag");
      SHARDMUON_CHECK_ARG(reinterpret_cast<uintptr_t>(flag) % alignof(float) == 0,
                          "flag must be 4-byte aligned, got ", static_cast<const void*>(flag));
    }
    context->settings.step_flag = flag;
  });
}

shardmuon_status shardmuon_context_nonfinite_counts(shardmuon_context_t context,
                                                    int64_t* skipped_steps,
                                                    int64_t* skipped_params) {
  return api_guard(__func__, [&] {
    shardmuon::Backend& backend = shardmuon::backend_of(context, "context");
    SHARDMUON_CHECK_ARG(skipped_steps != nullptr && skipped_params != nullptr,
                        "skipped_steps and skipped_params must not be NULL");
    int64_t counters[2] = {0, 0};
    // The counters are written in stream order by the context's steps: wait for the last one.
    backend.wait_for_last_call();
    shardmuon::BackendCallScope scope(backend, nullptr);
    backend.copy_to_host(counters, backend.persistent_status(), sizeof counters, nullptr);
    backend.synchronize(nullptr);
    *skipped_steps = counters[0];
    *skipped_params = counters[1];
  });
}

}  // extern "C"
