// The C entry points of optimizer checkpoints.
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "api/handles.h"
#include "core/agreement.h"
#include "core/api_guard.h"
#include "core/muon_step.h"
#include "io/checkpoint.h"

namespace shardmuon {
namespace {

struct ValidatedCheckpointCall {
  Backend* backend = nullptr;
  ValidatedMuonStep params;
  std::vector<std::string> names;
  uint64_t digest = 0;
};

// The checks every checkpoint call makes on this rank, and what the ranks must agree on.
ValidatedCheckpointCall validate_checkpoint_call(shardmuon_context_t context, Communicator& comm,
                                                 const char* directory,
                                                 const shardmuon_muon_param* params,
                                                 const char* const* names, int num_params,
                                                 const shardmuon_muon_group* groups,
                                                 int num_groups) {
  ValidatedCheckpointCall call;
  call.backend = &backend_of(context, "context");
  comm.check_compatible(*call.backend);
  SHARDMUON_CHECK_ARG(directory != nullptr && directory[0] != '\0', "directory is NULL or empty");
  call.params = validate_muon_step(*call.backend, comm, params, num_params, groups, num_groups,
                                   /*use_grads=*/false);
  call.names = validate_checkpoint_names(names, num_params);
  Digest digest;
  digest.add(call.params.digest).add_string(directory);
  for (const std::string& name : call.names) digest.add_string(name);
  call.digest = digest.value();
  return call;
}

template <typename Validate, typename Run>
void run_checkpoint_call(Communicator& comm, void* stream, Validate&& validate, Run&& run) {
  ValidatedCheckpointCall call;
  std::optional<BackendCallScope> scope;
  const std::exception_ptr local_error = capture_local_failure([&] {
    call = validate();
    scope.emplace(*call.backend, stream);
  });
  agree_across_ranks(comm, local_error, call.digest, call.params.description);
  run(call);
}

}  // namespace
}  // namespace shardmuon

using shardmuon::api_guard;

extern "C" {

shardmuon_status shardmuon_muon_save(shardmuon_context_t context, shardmuon_comm_t comm,
                                     const char* directory, const shardmuon_muon_param* params,
                                     const char* const* names, int num_params,
                                     const shardmuon_muon_group* groups, int num_groups,
                                     int64_t step, void* stream) {
  return api_guard(__func__, [&] {
    shardmuon::Communicator& group = shardmuon::communicator_of(comm, "comm");
    shardmuon::run_checkpoint_call(
        group, stream,
        [&] {
          SHARDMUON_CHECK_ARG(groups != nullptr,
                              "groups is NULL (their hyperparameters are saved)");
          SHARDMUON_CHECK_ARG(step >= 0, "step must be >= 0, got ", step);
          auto call = shardmuon::validate_checkpoint_call(context, group, directory, params, names,
                                                          num_params, groups, num_groups);
          call.digest = shardmuon::Digest().add(call.digest).add(step).value();
          return call;
        },
        [&](const shardmuon::ValidatedCheckpointCall& call) {
          shardmuon::save_muon_checkpoint(*call.backend, group, directory, call.params, call.names,
                                          groups, num_groups, step, stream);
        });
  });
}

shardmuon_status shardmuon_muon_load(shardmuon_context_t context, shardmuon_comm_t comm,
                                     const char* directory, const shardmuon_muon_param* params,
                                     const char* const* names, int num_params,
                                     shardmuon_muon_group* groups, int num_groups, int64_t* step,
                                     void* stream) {
  return api_guard(__func__, [&] {
    shardmuon::Communicator& group = shardmuon::communicator_of(comm, "comm");
    shardmuon::run_checkpoint_call(
        group, stream,
        [&] {
          SHARDMUON_CHECK_ARG(step != nullptr, "step is NULL");
          // groups is output: the caller's hyperparameters are not checked (a zero-initialized
          // array is fine). The parameters are checked here with placeholders, the defaults,
          // which every layout can step; the saved groups replace them once read, and load
          // checks those against the parameters as a step would.
          std::vector<shardmuon_muon_group> placeholders;
          if (groups != nullptr) {
            SHARDMUON_CHECK_ARG(num_groups >= 1, "num_groups must be >= 1, got ", num_groups);
            shardmuon_muon_group defaults;
            shardmuon_muon_group_default(&defaults);
            placeholders.assign(static_cast<size_t>(num_groups), defaults);
          }
          return shardmuon::validate_checkpoint_call(
              context, group, directory, params, names, num_params,
              groups != nullptr ? placeholders.data() : nullptr, num_groups);
        },
        [&](const shardmuon::ValidatedCheckpointCall& call) {
          shardmuon::load_muon_checkpoint(*call.backend, group, directory, call.params, call.names,
                                          groups, num_groups, step, stream);
        });
  });
}

}  // extern "C"
