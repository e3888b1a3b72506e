// The C API: thin entry points that check arguments, convert handles and call into the
// internals. Every function runs inside api_guard, so no exception crosses the boundary.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>

#include "api/handles.h"
#include "comm/factories.h"
#include "core/agreement.h"
#include "core/api_guard.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "core/newton_schulz.h"
#include "core/ns_cost_model.h"
#include "core/schedule.h"
#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"

namespace shardmuon {
namespace {

thread_local std::string last_error_message;

const char* algorithm_name(int algorithm) {
  switch (algorithm) {
    case SHARDMUON_NS_AUTO: return "auto";
    case SHARDMUON_NS_DUPLICATED: return "duplicated";
    case SHARDMUON_NS_GRAM_ALLREDUCE: return "gram_allreduce";
    case SHARDMUON_NS_OWNER: return "owner";
    case SHARDMUON_NS_GRAM_NEWTON_SCHULZ: return "gram_newton_schulz";
    case SHARDMUON_NS_GRAM_APPLIED_TWICE: return "gram_applied_twice";
  }
  return "unknown";
}

// Everything a Newton-Schulz call needs, validated on this rank alone.
struct ValidatedNsCall {
  Backend* backend = nullptr;
  NsProblem problem;
  uint64_t digest = 0;
  std::string description;
};

// OWNER distributes the matrices of a step over the ranks; one matrix has nothing to spread.
void check_single_matrix_algorithm(const shardmuon_ns_options& options);

struct PlannedMatrix {
  ShardLayout layout;
  NsPlan plan;
};

// shardmuon_ns_plan's and shardmuon_ns_estimate's common part: the arguments checked, the
// layout resolved and the plan made.
PlannedMatrix plan_matrix(const shardmuon_layout* layout, int comm_size,
                          const shardmuon_ns_options* options) {
  SHARDMUON_CHECK_ARG(layout != nullptr, "layout is NULL");
  SHARDMUON_CHECK_ARG(options != nullptr, "options is NULL");
  SHARDMUON_CHECK_ARG(comm_size >= 1, "comm_size must be >= 1, got ", comm_size);
  validate_ns_options(*options);
  check_single_matrix_algorithm(*options);
  PlannedMatrix planned;
  planned.layout = ShardLayout::from_api(*layout, comm_size);
  check_algorithm_fits_layout(options->algorithm, planned.layout, "options->algorithm, layout");
  planned.plan = plan_newton_schulz(planned.layout, comm_size, *options);
  return planned;
}

void check_single_matrix_algorithm(const shardmuon_ns_options& options) {
  SHARDMUON_CHECK_ARG(options.algorithm != SHARDMUON_NS_OWNER,
                      "options->algorithm OWNER applies to the parameters of a step "
                      "(shardmuon_muon_step); for one matrix use AUTO, DUPLICATED or "
                      "GRAM_ALLREDUCE");
}

ValidatedNsCall validate_ns_call(shardmuon_context_t context, Communicator& comm,
                                 const void* local_shard, shardmuon_dtype dtype,
                                 const shardmuon_layout* layout,
                                 const shardmuon_ns_options* options) {
  ValidatedNsCall call;
  call.backend = &backend_of(context, "context");
  SHARDMUON_CHECK_ARG(layout != nullptr, "layout is NULL");
  SHARDMUON_CHECK_ARG(options != nullptr, "options is NULL");
  SHARDMUON_CHECK_ARG(is_valid_dtype(dtype), "dtype is unknown: ", static_cast<int>(dtype));
  call.backend->check_dtype(dtype);
  comm.check_compatible(*call.backend);
  validate_ns_options(*options);
  check_single_matrix_algorithm(*options);
  const ShardLayout shard_layout = ShardLayout::from_api(*layout, comm.size());
  call.backend->check_matrix_shape(shard_layout.rows(), shard_layout.cols(), "layout");
  check_algorithm_fits_layout(options->algorithm, shard_layout, "options->algorithm, layout");

  const int64_t local_elements = shard_layout.local_elements(comm.rank());
  if (local_elements > 0) {
    SHARDMUON_CHECK_ARG(local_shard != nullptr, "local_shard is NULL but this rank's shard holds ",
                        local_elements, " elements (layout ", shard_layout.describe(), ")");
    SHARDMUON_CHECK_ARG(reinterpret_cast<uintptr_t>(local_shard) % element_size(dtype) == 0,
                        "local_shard (", local_shard, ") is not aligned to the ",
                        element_size(dtype), "-byte elements of ", dtype_name(dtype));
    call.backend->check_pointer(local_shard, "local_shard");
  }

  call.problem = NsProblem{dtype, shard_layout, coefficients_for(*options), options->eps,
                           plan_newton_schulz(shard_layout, comm.size(), *options)};

  Digest digest;
  // The symmetric block width ($SHARDMUON_SYMMETRIC_BLOCK on CUDA) and the short side's
  // padding decide how a Gram sum is cut into all-reduces, so ranks must agree on them too.
  digest.add(call.backend->kind()).add(call.backend->symmetric_block_target());
  digest.add(call.backend->short_side_multiple());
  digest.add(dtype).add(layout->rows).add(layout->cols);
  digest.add(layout->partition);
  for (int64_t size : shard_layout.shard_sizes()) digest.add(size);
  for (const Coefficients& k : call.problem.coefficients) digest.add(k.a).add(k.b).add(k.c);
  digest.add(options->eps).add(options->algorithm);
  call.digest = digest.value();

  call.description = concat("dtype=", dtype_name(dtype), ", layout ", shard_layout.describe(),
                            ", iterations=", options->num_iterations,
                            ", schedule=", schedule_name(options->schedule), ", eps=", options->eps,
                            ", algorithm=", algorithm_name(options->algorithm));
  return call;
}

}  // namespace

void set_last_error(const std::string& message) {
  last_error_message = message;
}
void clear_last_error() {
  last_error_message.clear();
}

Backend& backend_of(shardmuon_context_t context, const char* name) {
  SHARDMUON_CHECK_ARG(context != nullptr, name, " is NULL");
  SHARDMUON_CHECK_ARG(context->tag == shardmuon_context_s::kTag && context->backend, name, " (",
                      static_cast<const void*>(context), ") is not a live shardmuon context");
  return *context->backend;
}

Communicator& communicator_of(shardmuon_comm_t comm, const char* name) {
  SHARDMUON_CHECK_ARG(comm != nullptr, name, " is NULL");
  SHARDMUON_CHECK_ARG(comm->tag == shardmuon_comm_s::kTag && comm->comm, name, " (",
                      static_cast<const void*>(comm), ") is not a live shardmuon communicator");
  return *comm->comm;
}

template <typename Make>
shardmuon_status create_comm(const char* function, shardmuon_comm_t* comm, Make&& make) {
  return api_guard(function, [&] {
    SHARDMUON_CHECK_ARG(comm != nullptr, "comm is NULL");
    *comm = nullptr;
    auto handle = std::make_unique<shardmuon_comm_s>();
    handle->comm = make();
    *comm = handle.release();
  });
}

}  // namespace shardmuon

using shardmuon::api_guard;
using shardmuon::create_comm;

extern "C" {

const char* shardmuon_last_error(void) {
  return shardmuon::last_error_message.c_str();
}

const char* shardmuon_status_name(shardmuon_status status) {
  switch (status) {
    case SHARDMUON_SUCCESS: return "SHARDMUON_SUCCESS";
    case SHARDMUON_ERROR_INVALID_ARGUMENT: return "SHARDMUON_ERROR_INVALID_ARGUMENT";
    case SHARDMUON_ERROR_NOT_BUILT: return "SHARDMUON_ERROR_NOT_BUILT";
    case SHARDMUON_ERROR_UNSUPPORTED: return "SHARDMUON_ERROR_UNSUPPORTED";
    case SHARDMUON_ERROR_RANK_MISMATCH: return "SHARDMUON_ERROR_RANK_MISMATCH";
    case SHARDMUON_ERROR_PEER_FAILED: return "SHARDMUON_ERROR_PEER_FAILED";
    case SHARDMUON_ERROR_OUT_OF_MEMORY: return "SHARDMUON_ERROR_OUT_OF_MEMORY";
    case SHARDMUON_ERROR_CUDA: return "SHARDMUON_ERROR_CUDA";
    case SHARDMUON_ERROR_CUBLAS: return "SHARDMUON_ERROR_CUBLAS";
    case SHARDMUON_ERROR_NCCL: return "SHARDMUON_ERROR_NCCL";
    case SHARDMUON_ERROR_MPI: return "SHARDMUON_ERROR_MPI";
    case SHARDMUON_ERROR_INTERNAL: return "SHARDMUON_ERROR_INTERNAL";
    case SHARDMUON_ERROR_TIMEOUT: return "SHARDMUON_ERROR_TIMEOUT";
    case SHARDMUON_ERROR_NON_FINITE: return "SHARDMUON_ERROR_NON_FINITE";
  }
  return "SHARDMUON_ERROR_UNKNOWN_STATUS";
}

shardmuon_status shardmuon_version(int* major, int* minor, int* patch) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(major && minor && patch, "major, minor and patch must not be NULL");
    *major = SHARDMUON_VERSION_MAJOR;
    *minor = SHARDMUON_VERSION_MINOR;
    *patch = SHARDMUON_VERSION_PATCH;
  });
}

shardmuon_status shardmuon_build_info(int* has_cuda, int* has_nccl, int* has_mpi) {
  return api_guard(__func__, [&] {
#ifdef SHARDMUON_WITH_CUDA
    const int cuda = 1;
#else
    const int cuda = 0;
#endif
#ifdef SHARDMUON_WITH_NCCL
    const int nccl = 1;
#else
    const int nccl = 0;
#endif
#ifdef SHARDMUON_WITH_MPI
    const int mpi = 1;
#else
    const int mpi = 0;
#endif
    if (has_cuda) *has_cuda = cuda;
    if (has_nccl) *has_nccl = nccl;
    if (has_mpi) *has_mpi = mpi;
  });
}

shardmuon_status shardmuon_ns_options_default(shardmuon_ns_options* options) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(options != nullptr, "options is NULL");
    *options = shardmuon_ns_options{};
    options->num_iterations = 5;
    options->schedule = SHARDMUON_SCHEDULE_QUINTIC;
    options->custom_coefficients = nullptr;
    options->num_custom_coefficients = 0;
    options->eps = 1e-7;
    options->algorithm = SHARDMUON_NS_AUTO;
  });
}

shardmuon_status shardmuon_schedule_from_name(const char* name, shardmuon_schedule* schedule) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(name != nullptr, "name is NULL");
    SHARDMUON_CHECK_ARG(schedule != nullptr, "schedule is NULL");
    for (int s = SHARDMUON_SCHEDULE_SIMPLE; s <= SHARDMUON_SCHEDULE_CUSTOM; ++s) {
      if (std::strcmp(name, shardmuon::schedule_name(s)) == 0) {
        *schedule = static_cast<shardmuon_schedule>(s);
        return;
      }
    }
    shardmuon::fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "name \"", name,
                    "\" is not a schedule (simple, quintic, polar_express, cans, aol, custom)");
  });
}

shardmuon_status shardmuon_schedule_coefficients(shardmuon_schedule schedule, int iteration,
                                                 const shardmuon_ns_options* options, double* a,
                                                 double* b, double* c) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(a && b && c, "a, b and c must not be NULL");
    SHARDMUON_CHECK_ARG(shardmuon::is_valid_schedule(schedule),
                        "schedule is unknown: ", static_cast<int>(schedule));
    SHARDMUON_CHECK_ARG(iteration >= 0, "iteration must be >= 0, got ", iteration);
    shardmuon::Coefficients k;
    if (schedule == SHARDMUON_SCHEDULE_CUSTOM) {
      SHARDMUON_CHECK_ARG(options != nullptr, "options is NULL for the custom schedule");
      SHARDMUON_CHECK_ARG(options->schedule == SHARDMUON_SCHEDULE_CUSTOM,
                          "schedule is custom but options->schedule is ",
                          shardmuon::schedule_name(options->schedule),
                          ": the options hold no custom coefficients");
      shardmuon::validate_ns_options(*options);
      SHARDMUON_CHECK_ARG(iteration < options->num_iterations, "iteration ", iteration,
                          " is past the ", options->num_iterations, " custom coefficients");
      k = shardmuon::coefficients_for(*options)[iteration];
    } else {
      k = shardmuon::builtin_coefficients(schedule, iteration);
    }
    *a = k.a;
    *b = k.b;
    *c = k.c;
  });
}

shardmuon_status shardmuon_context_create(shardmuon_backend backend, int cuda_device,
                                          shardmuon_context_t* context) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(context != nullptr, "context is NULL");
    *context = nullptr;
    auto handle = std::make_unique<shardmuon_context_s>();
    switch (backend) {
      case SHARDMUON_BACKEND_CPU: handle->backend = shardmuon::make_cpu_backend(); break;
      case SHARDMUON_BACKEND_CUDA:
        handle->backend = shardmuon::make_cuda_backend(cuda_device);
        break;
      default:
        shardmuon::fail(SHARDMUON_ERROR_INVALID_ARGUMENT,
                        "backend is unknown: ", static_cast<int>(backend));
    }
    *context = handle.release();
  });
}

shardmuon_status shardmuon_context_destroy(shardmuon_context_t context) {
  return api_guard(__func__, [&] {
    if (context == nullptr) return;
    shardmuon::Backend& backend = shardmuon::backend_of(context, "context");
    // The buffers the caller did not destroy, then the context, even if a release fails (its
    // error is returned after).
    std::exception_ptr failure;
    for (void* buffer : context->buffers) {
      try {
        backend.release(buffer);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    context->tag = 0;
    delete context;
    if (failure) std::rethrow_exception(failure);
  });
}

shardmuon_status shardmuon_context_backend(shardmuon_context_t context,
                                           shardmuon_backend* backend) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(backend != nullptr, "backend is NULL");
    *backend = shardmuon::backend_of(context, "context").kind();
  });
}

shardmuon_status shardmuon_context_workspace_bytes(shardmuon_context_t context, size_t* bytes) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(bytes != nullptr, "bytes is NULL");
    *bytes = shardmuon::backend_of(context, "context").workspace_bytes();
  });
}

shardmuon_status shardmuon_buffer_create(shardmuon_context_t context, size_t bytes, void** buffer) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(buffer != nullptr, "buffer is NULL");
    *buffer = nullptr;
    shardmuon::Backend& backend = shardmuon::backend_of(context, "context");
    void* created = backend.allocate_zeroed(bytes);
    try {
      context->buffers.insert(created);
    } catch (...) {
      backend.release(created);
      throw;
    }
    *buffer = created;
  });
}

shardmuon_status shardmuon_buffer_destroy(shardmuon_context_t context, void* buffer) {
  return api_guard(__func__, [&] {
    shardmuon::Backend& backend = shardmuon::backend_of(context, "context");
    if (buffer == nullptr) return;
    SHARDMUON_CHECK_ARG(context->buffers.count(buffer) == 1, "buffer (", buffer,
                        ") is not a live buffer of this context's shardmuon_buffer_create (freed "
                        "already, or another context's)");
    backend.release(buffer);
    context->buffers.erase(buffer);
  });
}

shardmuon_status shardmuon_comm_create_self(shardmuon_comm_t* comm) {
  return create_comm(__func__, comm, [] { return shardmuon::make_self_communicator(); });
}

shardmuon_status shardmuon_comm_create_mpi(const void* mpi_comm, shardmuon_comm_t* comm) {
  return create_comm(__func__, comm, [&] { return shardmuon::make_mpi_communicator(mpi_comm); });
}

shardmuon_status shardmuon_comm_create_nccl(void* nccl_comm, shardmuon_comm_t* comm) {
  return create_comm(__func__, comm, [&] { return shardmuon::make_nccl_communicator(nccl_comm); });
}

shardmuon_status shardmuon_comm_create_callbacks(const shardmuon_comm_callbacks* callbacks,
                                                 shardmuon_backend backend,
                                                 shardmuon_comm_t* comm) {
  return create_comm(__func__, comm, [&] {
    SHARDMUON_CHECK_ARG(callbacks != nullptr, "callbacks is NULL");
    return shardmuon::make_callback_communicator(*callbacks, backend);
  });
}

shardmuon_status shardmuon_comm_set_timeout(shardmuon_comm_t comm, double seconds) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(std::isfinite(seconds) && seconds >= 0,
                        "seconds must be finite and >= 0, got ", seconds);
    shardmuon::communicator_of(comm, "comm").set_timeout(seconds);
  });
}

shardmuon_status shardmuon_comm_destroy(shardmuon_comm_t comm) {
  return api_guard(__func__, [&] {
    if (comm == nullptr) return;
    shardmuon::communicator_of(comm, "comm");
    comm->tag = 0;
    delete comm;
  });
}

shardmuon_status shardmuon_comm_rank(shardmuon_comm_t comm, int* rank) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(rank != nullptr, "rank is NULL");
    *rank = shardmuon::communicator_of(comm, "comm").rank();
  });
}

shardmuon_status shardmuon_comm_size(shardmuon_comm_t comm, int* size) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(size != nullptr, "size is NULL");
    *size = shardmuon::communicator_of(comm, "comm").size();
  });
}

shardmuon_status shardmuon_newton_schulz(shardmuon_context_t context, shardmuon_comm_t comm,
                                         void* local_shard, shardmuon_dtype dtype,
                                         const shardmuon_layout* layout,
                                         const shardmuon_ns_options* options, void* stream) {
  return api_guard(__func__, [&] {
    // Without a communicator the ranks cannot be told; this error stays local.
    shardmuon::Communicator& group = shardmuon::communicator_of(comm, "comm");
    shardmuon::ValidatedNsCall call;
    shardmuon::Backend* backend = nullptr;
    std::optional<shardmuon::BackendCallScope> scope;
    const std::exception_ptr local_error = shardmuon::capture_local_failure([&] {
      backend = &shardmuon::backend_of(context, "context");
      call = shardmuon::validate_ns_call(context, group, local_shard, dtype, layout, options);
      // Grow the workspace now, so that running out of memory is this rank's validation
      // failure, reported to every rank, rather than a failure after the others have
      // entered a collective.
      scope.emplace(*call.backend, stream);
      call.backend->workspace(shardmuon::newton_schulz_workspace_bytes(*call.backend, call.problem,
                                                                       group.rank(), group.size()),
                              stream);
    });
    // Refused whatever else is wrong: a call under capture must not reach the host-side check.
    if (backend != nullptr && backend->is_capturing(stream)) {
      shardmuon::fail(SHARDMUON_ERROR_UNSUPPORTED,
                      "the stream is being captured into a CUDA graph, and "
                      "shardmuon_newton_schulz checks its arguments across the ranks on the "
                      "host first; capture shardmuon_muon_step instead (see its rules)");
    }
    shardmuon::agree_across_ranks(group, local_error, call.digest, call.description);
    shardmuon::run_newton_schulz(*call.backend, group, call.problem, local_shard, stream);
  });
}

shardmuon_status shardmuon_abi_layout(const char* type, const char* field, size_t* size,
                                      size_t* offset) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(type != nullptr, "type is NULL");
    SHARDMUON_CHECK_ARG(size != nullptr, "size is NULL");
    const std::string t = type, f = field ? field : "";
    struct Entry {
      const char* type;
      const char* field;
      size_t size, offset;
    };
#define SHARDMUON_STRUCT(T) \
  { #T, "", sizeof(T), 0 }
#define SHARDMUON_FIELD(T, F) \
  { #T, #F, sizeof(T::F), offsetof(T, F) }
    static const Entry entries[] = {
        SHARDMUON_STRUCT(shardmuon_layout),
        SHARDMUON_FIELD(shardmuon_layout, rows),
        SHARDMUON_FIELD(shardmuon_layout, cols),
        SHARDMUON_FIELD(shardmuon_layout, partition),
        SHARDMUON_FIELD(shardmuon_layout, num_shards),
        SHARDMUON_FIELD(shardmuon_layout, shard_sizes),
        SHARDMUON_STRUCT(shardmuon_ns_options),
        SHARDMUON_FIELD(shardmuon_ns_options, num_iterations),
        SHARDMUON_FIELD(shardmuon_ns_options, schedule),
        SHARDMUON_FIELD(shardmuon_ns_options, custom_coefficients),
        SHARDMUON_FIELD(shardmuon_ns_options, num_custom_coefficients),
        SHARDMUON_FIELD(shardmuon_ns_options, eps),
        SHARDMUON_FIELD(shardmuon_ns_options, algorithm),
        SHARDMUON_STRUCT(shardmuon_muon_group),
        SHARDMUON_FIELD(shardmuon_muon_group, lr),
        SHARDMUON_FIELD(shardmuon_muon_group, momentum),
        SHARDMUON_FIELD(shardmuon_muon_group, nesterov),
        SHARDMUON_FIELD(shardmuon_muon_group, weight_decay),
        SHARDMUON_FIELD(shardmuon_muon_group, weight_decay_mode),
        SHARDMUON_FIELD(shardmuon_muon_group, scale_mode),
        SHARDMUON_FIELD(shardmuon_muon_group, extra_scale_factor),
        SHARDMUON_FIELD(shardmuon_muon_group, ns),
        SHARDMUON_FIELD(shardmuon_muon_group, lr_on_device),
        SHARDMUON_FIELD(shardmuon_muon_group, ns_storage),
        SHARDMUON_STRUCT(shardmuon_muon_param),
        SHARDMUON_FIELD(shardmuon_muon_param, param),
        SHARDMUON_FIELD(shardmuon_muon_param, grad),
        SHARDMUON_FIELD(shardmuon_muon_param, momentum),
        SHARDMUON_FIELD(shardmuon_muon_param, dtype),
        SHARDMUON_FIELD(shardmuon_muon_param, layout),
        SHARDMUON_FIELD(shardmuon_muon_param, group),
        SHARDMUON_FIELD(shardmuon_muon_param, no_grad),
        SHARDMUON_FIELD(shardmuon_muon_param, row_blocks),
        SHARDMUON_STRUCT(shardmuon_comm_callbacks),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, user_data),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, rank),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, size),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, all_reduce_sum),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, all_gather),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, all_to_all),
        SHARDMUON_FIELD(shardmuon_comm_callbacks, agree_max),
    };
#undef SHARDMUON_STRUCT
#undef SHARDMUON_FIELD
    for (const Entry& entry : entries) {
      if (t == entry.type && f == entry.field) {
        *size = entry.size;
        if (offset != nullptr) *offset = entry.offset;
        return;
      }
    }
    shardmuon::fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "no struct or field \"", t,
                    f.empty() ? "" : ".", f, "\" in shardmuon.h");
  });
}

shardmuon_status shardmuon_ns_estimate(const shardmuon_layout* layout, int comm_size,
                                       const shardmuon_ns_options* options, double* seconds) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(seconds != nullptr, "seconds is NULL");
    const shardmuon::PlannedMatrix planned = shardmuon::plan_matrix(layout, comm_size, options);
    *seconds = shardmuon::estimate_plan_seconds(
        planned.plan, shardmuon::NsCostInputs{planned.layout, comm_size, options->num_iterations},
        shardmuon::MachineModel{});
  });
}

shardmuon_status shardmuon_ns_plan_gram_iteration(const shardmuon_layout* layout, int comm_size,
                                                  const shardmuon_ns_options* options,
                                                  int* gram_iteration) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(gram_iteration != nullptr, "gram_iteration is NULL");
    *gram_iteration = shardmuon::plan_matrix(layout, comm_size, options).plan.gram_iteration();
  });
}

shardmuon_status shardmuon_ns_plan_applied_twice(const shardmuon_layout* layout, int comm_size,
                                                 const shardmuon_ns_options* options,
                                                 int* applied_twice) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(applied_twice != nullptr, "applied_twice is NULL");
    *applied_twice = shardmuon::plan_matrix(layout, comm_size, options).plan.applied_twice();
  });
}

shardmuon_status shardmuon_ns_plan(const shardmuon_layout* layout, int comm_size,
                                   const shardmuon_ns_options* options,
                                   shardmuon_ns_algorithm* chosen) {
  return api_guard(__func__, [&] {
    SHARDMUON_CHECK_ARG(chosen != nullptr, "chosen is NULL");
    *chosen =
        shardmuon::reported_algorithm(shardmuon::plan_matrix(layout, comm_size, options).plan);
  });
}

}  // extern "C"
