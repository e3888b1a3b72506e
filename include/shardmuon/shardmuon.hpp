// Header-only C++ wrappers over the C API: RAII handles and exceptions. Nothing here is
// compiled into the library, so the C ABI stays the only boundary.
#pragma once

#include <deque>
#include <memory>
#include <optional>
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
  explicit Context(shardmuon_backend backend, int cuda_device = 0)
      : handle_(nullptr, Destroy{true}) {
    shardmuon_context_t handle = nullptr;
    check(shardmuon_context_create(backend, cuda_device, &handle));
    handle_.reset(handle);
  }
  // Wraps a handle made through the C API without taking ownership.
  static Context borrow(shardmuon_context_t handle) { return Context(handle, false); }

  shardmuon_context_t get() const noexcept { return handle_.get(); }
  size_t workspace_bytes() const {
    size_t bytes = 0;
    check(shardmuon_context_workspace_bytes(get(), &bytes));
    return bytes;
  }
  // What its Muon steps do with a NaN or Inf (shardmuon_context_set_nonfinite_policy).
  void set_nonfinite_policy(shardmuon_nonfinite_policy policy) const {
    check(shardmuon_context_set_nonfinite_policy(get(), policy));
  }
  // A float its checked steps read and then write (shardmuon_context_set_step_flag).
  void set_step_flag(float* flag) const { check(shardmuon_context_set_step_flag(get(), flag)); }
  struct NonfiniteCounts {
    int64_t skipped_steps = 0;
    int64_t skipped_params = 0;
  };
  // Steps and parameters its Muon steps skipped (shardmuon_context_nonfinite_counts: waits for
  // the device).
  NonfiniteCounts nonfinite_counts() const {
    NonfiniteCounts counts;
    check(shardmuon_context_nonfinite_counts(get(), &counts.skipped_steps, &counts.skipped_params));
    return counts;
  }

 private:
  Context(shardmuon_context_t handle, bool owned) : handle_(handle, Destroy{owned}) {}
  struct Destroy {
    bool owned = true;
    void operator()(shardmuon_context_t handle) const noexcept {
      if (owned) shardmuon_context_destroy(handle);
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
  // Wraps a handle made through the C API without taking ownership.
  static Comm borrow(shardmuon_comm_t handle) { return Comm(handle, false); }

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
  explicit Comm(shardmuon_comm_t handle, bool owned = true) : handle_(handle, Destroy{owned}) {}
  struct Destroy {
    bool owned = true;
    void operator()(shardmuon_comm_t handle) const noexcept {
      if (owned) shardmuon_comm_destroy(handle);
    }
  };
  std::unique_ptr<shardmuon_comm_s, Destroy> handle_;
};

// Sums the context's step flag over comm's ranks, after they agree (see
// shardmuon_context_reduce_step_flag): over each communicator of a step split over several,
// before the first, so that all their steps skip or none does. Collective.
inline void reduce_step_flag(const Context& context, const Comm& comm, void* stream = nullptr) {
  check(shardmuon_context_reduce_step_flag(context.get(), comm.get(), stream));
}

// A layout that owns its shard sizes.
struct Layout {
  int64_t rows = 0, cols = 0;
  shardmuon_partition partition = SHARDMUON_REPLICATED;
  std::vector<int64_t> shard_sizes;  // empty: balanced split over the communicator

  static Layout replicated(int64_t rows, int64_t cols) {
    return {rows, cols, SHARDMUON_REPLICATED, {}};
  }
  // dim: 0 (rows split) or 1 (columns split).
  static Layout sharded(int64_t rows, int64_t cols, int dim, std::vector<int64_t> sizes) {
    if (dim != 0 && dim != 1) {
      throw Error(SHARDMUON_ERROR_INVALID_ARGUMENT,
                  "Layout::sharded: dim must be 0 or 1, got " + std::to_string(dim));
    }
    return {rows, cols, dim == 0 ? SHARDMUON_SHARDED_DIM0 : SHARDMUON_SHARDED_DIM1,
            std::move(sizes)};
  }
  // Ranges of the row-major elements (ZeRO-style); sizes count elements.
  static Layout flat(int64_t rows, int64_t cols, std::vector<int64_t> sizes) {
    return {rows, cols, SHARDMUON_SHARDED_FLAT, std::move(sizes)};
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

inline shardmuon_muon_group default_muon_group() {
  shardmuon_muon_group group{};
  check(shardmuon_muon_group_default(&group));
  return group;
}

// A Muon optimizer that owns its parameters' momentum buffers, for C++ training code. Every
// rank of the communicator registers the same parameters in the same order (with its own
// shards) and calls step, save and load together. It keeps the handles of the Context and Comm
// it is given, not the wrappers (which may be moved, or be temporaries of borrow()): the
// context and communicator they wrap must outlive it. A Context or Comm passed as a temporary
// that owns its handle is taken over, and destroyed with the Muon.
//
//   shardmuon::Muon muon(context, comm, {shardmuon::default_muon_group()});
//   muon.add_parameter("layers.0.qkv.weight", qkv, SHARDMUON_BFLOAT16,
//                      shardmuon::Layout::sharded(6144, 4096, 0, {}));
//   muon.groups()[0].lr = schedule(step);
//   muon.step({qkv_grad}, stream);          // std::nullopt for a parameter without gradient
class Muon {
 public:
  Muon(const Context& context, const Comm& comm, std::vector<shardmuon_muon_group> groups)
      : context_(context.get()), comm_(comm.get()), groups_(std::move(groups)) {}
  Muon(Context&& context, const Comm& comm, std::vector<shardmuon_muon_group> groups)
      : Muon(context, comm, std::move(groups)) {
    owned_context_.emplace(std::move(context));
  }
  Muon(const Context& context, Comm&& comm, std::vector<shardmuon_muon_group> groups)
      : Muon(context, comm, std::move(groups)) {
    owned_comm_.emplace(std::move(comm));
  }
  Muon(Context&& context, Comm&& comm, std::vector<shardmuon_muon_group> groups)
      : Muon(context, comm, std::move(groups)) {
    owned_context_.emplace(std::move(context));
    owned_comm_.emplace(std::move(comm));
  }
  ~Muon() {
    for (Entry& entry : entries_) shardmuon_buffer_destroy(context_, entry.momentum);
  }
  Muon(const Muon&) = delete;
  Muon& operator=(const Muon&) = delete;

  // Registers a parameter and allocates its momentum buffer (zeros) in the context's
  // memory. Returns its index. The parameter is checked as a step would check it (on this
  // rank), so that a bad one is refused here rather than failing every later step.
  // row_blocks: matrices stacked along dim 0, each orthogonalized on its own (the experts of
  // an MoE weight, the heads of a fused QKV; shardmuon_muon_param.row_blocks).
  size_t add_parameter(const std::string& name, void* param, shardmuon_dtype dtype,
                       const Layout& layout, int group = 0, int64_t row_blocks = 1) {
    Entry entry;
    entry.name = name;
    entry.layout = layout;
    entry.param.param = param;
    entry.param.dtype = dtype;
    entry.param.group = group;
    entry.param.row_blocks = row_blocks;
    const int ranks = comm_size();
    // The momentum buffer is sized from this rank's shard size before the library sees the
    // layout, so a list of sizes of another length is refused here.
    if (!layout.shard_sizes.empty() && layout.shard_sizes.size() != static_cast<size_t>(ranks)) {
      throw Error(SHARDMUON_ERROR_INVALID_ARGUMENT,
                  "Muon::add_parameter(\"" + name + "\"): the layout lists " +
                      std::to_string(layout.shard_sizes.size()) + " shard sizes for a " +
                      "communicator of " + std::to_string(ranks) + " ranks");
    }
    const shardmuon_layout view = entry.layout.view(ranks);
    shardmuon_muon_param checked = entry.param;
    checked.layout = view;
    checked.no_grad = 1;  // nor is the momentum read: it does not exist yet
    const shardmuon_status status =
        shardmuon_muon_plan(context_, comm_, &checked, 1, groups_.data(),
                            static_cast<int>(groups_.size()), nullptr, nullptr);
    if (status != SHARDMUON_SUCCESS) {
      throw Error(status, "Muon::add_parameter(\"" + name + "\"): " + shardmuon_last_error());
    }
    const size_t element = dtype == SHARDMUON_FLOAT64 ? 8 : dtype == SHARDMUON_FLOAT32 ? 4 : 2;
    check(shardmuon_buffer_create(context_, local_elements(view, comm_rank()) * element,
                                  &entry.momentum));
    entry.param.momentum = entry.momentum;
    entries_.push_back(std::move(entry));
    // The layout view points into the stored Layout, which a deque never moves.
    entries_.back().param.layout = entries_.back().layout.view(ranks);
    return entries_.size() - 1;
  }

  // One step. grads[i] is parameter i's gradient (which may be nullptr on a rank whose shard
  // is empty), or std::nullopt when it has none this step on every rank.
  void step(const std::vector<std::optional<const void*>>& grads, void* stream = nullptr) {
    if (grads.size() != entries_.size()) {
      // The other ranks are in (or about to enter) the step's collective argument check: a
      // call with a negative parameter count fails it, so that they return PEER_FAILED at
      // once instead of waiting for this rank until the timeout.
      shardmuon_muon_step(context_, comm_, nullptr, -1, groups_.data(),
                          static_cast<int>(groups_.size()), stream);
      throw Error(SHARDMUON_ERROR_INVALID_ARGUMENT,
                  "Muon::step: " + std::to_string(grads.size()) + " gradients for " +
                      std::to_string(entries_.size()) + " parameters");
    }
    std::vector<shardmuon_muon_param> params = batch();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].grad = grads[i].value_or(nullptr);
      params[i].no_grad = grads[i].has_value() ? 0 : 1;
    }
    check(shardmuon_muon_step(context_, comm_, params.data(), static_cast<int>(params.size()),
                              groups_.data(), static_cast<int>(groups_.size()), stream));
    ++steps_taken_;
  }

  // The hyperparameters, to change between steps (the learning rate, say).
  std::vector<shardmuon_muon_group>& groups() { return groups_; }
  int64_t steps_taken() const { return steps_taken_; }
  void* momentum(size_t index) const { return entries_.at(index).momentum; }
  size_t size() const { return entries_.size(); }

  // Saves momentum, step count and hyperparameters (see shardmuon_muon_save).
  void save(const std::string& directory, void* stream = nullptr) const {
    std::vector<shardmuon_muon_param> params = batch();
    std::vector<const char*> names = name_pointers();
    check(shardmuon_muon_save(context_, comm_, directory.c_str(), params.data(), names.data(),
                              static_cast<int>(params.size()), groups_.data(),
                              static_cast<int>(groups_.size()), steps_taken_, stream));
  }

  // Restores momentum, step count and hyperparameters; on error nothing changes.
  void load(const std::string& directory, void* stream = nullptr) {
    std::vector<shardmuon_muon_param> params = batch();
    std::vector<const char*> names = name_pointers();
    std::vector<shardmuon_muon_group> loaded = groups_;
    int64_t steps = 0;
    check(shardmuon_muon_load(context_, comm_, directory.c_str(), params.data(), names.data(),
                              static_cast<int>(params.size()), loaded.data(),
                              static_cast<int>(loaded.size()), &steps, stream));
    groups_ = std::move(loaded);
    steps_taken_ = steps;
  }

 private:
  struct Entry {
    std::string name;
    Layout layout;
    shardmuon_muon_param param{};
    void* momentum = nullptr;
  };

  static int64_t local_elements(const shardmuon_layout& layout, int rank) {
    if (layout.partition == SHARDMUON_REPLICATED) return layout.rows * layout.cols;
    const bool flat = layout.partition == SHARDMUON_SHARDED_FLAT;
    const bool rows_split = layout.partition == SHARDMUON_SHARDED_DIM0;
    const int64_t extent = flat         ? layout.rows * layout.cols
                           : rows_split ? layout.rows
                                        : layout.cols;
    int64_t size = extent / layout.num_shards + (rank < extent % layout.num_shards ? 1 : 0);
    if (layout.shard_sizes != nullptr) size = layout.shard_sizes[rank];
    return size * (flat ? 1 : rows_split ? layout.cols : layout.rows);
  }

  std::vector<shardmuon_muon_param> batch() const {
    std::vector<shardmuon_muon_param> params;
    for (const Entry& entry : entries_) params.push_back(entry.param);
    return params;
  }

  std::vector<const char*> name_pointers() const {
    std::vector<const char*> names;
    for (const Entry& entry : entries_) names.push_back(entry.name.c_str());
    return names;
  }

  int comm_size() const { return Comm::borrow(comm_).size(); }
  int comm_rank() const { return Comm::borrow(comm_).rank(); }

  // Declared first, so destroyed last: after the destructor has released the buffers.
  std::optional<Context> owned_context_;
  std::optional<Comm> owned_comm_;
  shardmuon_context_t context_;
  shardmuon_comm_t comm_;
  std::vector<shardmuon_muon_group> groups_;
  std::deque<Entry> entries_;
  int64_t steps_taken_ = 0;
};

}  // namespace shardmuon
