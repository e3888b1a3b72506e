// Header-only C++ wrappers over the C API: RAII handles and exceptions. Nothing here is
// compiled into the library, so the C ABI stays the only boundary.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shardmuon/shardmuon.h"

namespace shardmuon {

class Error : public std::runtime_error {
 public:
  Error(shardmuon_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  shardmuon_status status() const noexcept { return status_; }

 private:
  shardmuon_status status_;
};

// Throws Error with the library's message when status is not SHARDMUON_SUCCESS.
inline void check(shardmuon_status status) {
  if (status != SHARDMUON_SUCCESS) {
    throw Error(status, std::string(shardmuon_status_name(status)) + ": " + shardmuon_last_error());
  }
}

class Context {
 public:
  explicit Context(shardmuon_backend backend, int cuda_device = 0) {
    shardmuon_context_t handle = nullptr;
    check(shardmuon_context_create(backend, cuda_device, &handle));
    handle_.reset(handle);
  }
  shardmuon_context_t get() const noexcept { return handle_.get(); }
  size_t workspace_bytes() const {
    size_t bytes = 0;
    check(shardmuon_context_workspace_bytes(get(), &bytes));
    return bytes;
  }

 private:
  struct Destroy {
    void operator()(shardmuon_context_t handle) const noexcept {
      shardmuon_context_destroy(handle);
    }
  };
  std::unique_ptr<shardmuon_context_s, Destroy> handle_;
};

class Comm {
 public:
  static Comm self() {
    shardmuon_comm_t handle = nullptr;
    check(shardmuon_comm_create_self(&handle));
    return Comm(handle);
  }
  // mpi_comm: the address of an MPI_Comm. Collective.
  static Comm mpi(const void* mpi_comm) {
    shardmuon_comm_t handle = nullptr;
    check(shardmuon_comm_create_mpi(mpi_comm, &handle));
    return Comm(handle);
  }
  // nccl_comm: an ncclComm_t, borrowed. Collective.
  static Comm nccl(void* nccl_comm) {
    shardmuon_comm_t handle = nullptr;
    check(shardmuon_comm_create_nccl(nccl_comm, &handle));
    return Comm(handle);
  }

  shardmuon_comm_t get() const noexcept { return handle_.get(); }
  int rank() const {
    int value = 0;
    check(shardmuon_comm_rank(get(), &value));
    return value;
  }
  int size() const {
    int value = 0;
    check(shardmuon_comm_size(get(), &value));
    return value;
  }

 private:
  explicit Comm(shardmuon_comm_t handle) : handle_(handle) {}
  struct Destroy {
    void operator()(shardmuon_comm_t handle) const noexcept { shardmuon_comm_destroy(handle); }
  };
  std::unique_ptr<shardmuon_comm_s, Destroy> handle_;
};

// A layout that owns its shard sizes.
struct Layout {
  int64_t rows = 0, cols = 0;
  shardmuon_partition partition = SHARDMUON_REPLICATED;
  std::vector<int64_t> shard_sizes;  // empty: balanced split over the communicator

  static Layout replicated(int64_t rows, int64_t cols) {
    return {rows, cols, SHARDMUON_REPLICATED, {}};
  }
  static Layout sharded(int64_t rows, int64_t cols, int dim, std::vector<int64_t> sizes) {
    return {rows, cols, dim == 0 ? SHARDMUON_SHARDED_DIM0 : SHARDMUON_SHARDED_DIM1,
            std::move(sizes)};
  }

  shardmuon_layout view(int num_shards) const {
    shardmuon_layout layout{};
    layout.rows = rows;
    layout.cols = cols;
    layout.partition = partition;
    layout.num_shards = shard_sizes.empty() ? num_shards : static_cast<int>(shard_sizes.size());
    layout.shard_sizes = shard_sizes.empty() ? nullptr : shard_sizes.data();
    return layout;
  }
};

inline shardmuon_ns_options default_ns_options() {
  shardmuon_ns_options options{};
  check(shardmuon_ns_options_default(&options));
  return options;
}

// Orthogonalizes this rank's shard in place (see shardmuon_newton_schulz). Collective.
inline void newton_schulz(const Context& context, const Comm& comm, void* local_shard,
                          shardmuon_dtype dtype, const Layout& layout,
                          const shardmuon_ns_options& options = default_ns_options(),
                          void* stream = nullptr) {
  const shardmuon_layout view = layout.view(comm.size());
  check(shardmuon_newton_schulz(context.get(), comm.get(), local_shard, dtype, &view, &options,
                                stream));
}

}  // namespace shardmuon
