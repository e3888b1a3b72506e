// What the C API's opaque handles hold. A tag guards against handles that were never
// created (or were destroyed) reaching the internals.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_set>

#include "comm/communicator.h"
#include "core/backend.h"
#include "core/muon_step.h"

struct shardmuon_context_s {
  static constexpr uint64_t kTag = 0x73686d75'63747821ull;
  uint64_t tag = kTag;
  std::unique_ptr<shardmuon::Backend> backend;
  shardmuon::StepSettings settings;  // how its steps run (shardmuon_context_set_*)
  // The live allocations of shardmuon_buffer_create: only those are freed by
  // shardmuon_buffer_destroy (another pointer would reach free or cudaFree), and the context's
  // destruction frees those left.
  std::unordered_set<void*> buffers;
};

struct shardmuon_comm_s {
  static constexpr uint64_t kTag = 0x73686d75'636f6d6dull;
  uint64_t tag = kTag;
  std::unique_ptr<shardmuon::Communicator> comm;
};

namespace shardmuon {

// The handle's contents, or INVALID_ARGUMENT naming the parameter.
Backend& backend_of(shardmuon_context_t context, const char* name);
Communicator& communicator_of(shardmuon_comm_t comm, const char* name);

// Brackets a call on a backend (device selection, stream ordering), also when it throws.
class BackendCallScope {
 public:
  BackendCallScope(Backend& backend, Stream stream) : backend_(backend), stream_(stream) {
    backend_.begin_call(stream_);
  }
  ~BackendCallScope() { backend_.end_call(stream_); }
  BackendCallScope(const BackendCallScope&) = delete;
  BackendCallScope& operator=(const BackendCallScope&) = delete;

 private:
  Backend& backend_;
  Stream stream_;
};

}  // namespace shardmuon
