// Owning handles for CUDA objects: unique_ptrs whose deleters release them, made by small
// make_* factories that check the creation call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "cuda/cuda_check.h"

namespace shardmuon {

struct StreamDeleter {
  void operator()(cudaStream_t stream) const { cudaStreamDestroy(stream); }
};
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;

struct EventDeleter {
  void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
};
using UniqueEvent = std::unique_ptr<CUevent_st, EventDeleter>;

struct GraphDeleter {
  void operator()(cudaGraph_t graph) const { cudaGraphDestroy(graph); }
};
using UniqueGraph = std::unique_ptr<CUgraph_st, GraphDeleter>;

struct GraphExecDeleter {
  void operator()(cudaGraphExec_t exec) const { cudaGraphExecDestroy(exec); }
};
using UniqueGraphExec = std::unique_ptr<CUgraphExec_st, GraphExecDeleter>;

struct DeviceMemoryDeleter {
  void operator()(void* pointer) const { cudaFree(pointer); }
};
using UniqueDeviceMemory = std::unique_ptr<void, DeviceMemoryDeleter>;

struct PinnedMemoryDeleter {
  void operator()(void* pointer) const { cudaFreeHost(pointer); }
};
using UniquePinnedMemory = std::unique_ptr<void, PinnedMemoryDeleter>;

// priority: 0 is the default; lower numbers run first (cudaDeviceGetStreamPriorityRange).
inline UniqueStream make_nonblocking_stream(int priority = 0) {
  cudaStream_t stream = nullptr;
  SHARDMUON_CUDA(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority));
  return UniqueStream(stream);
}

inline UniqueEvent make_timing_free_event() {
  cudaEvent_t event = nullptr;
  SHARDMUON_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return UniqueEvent(event);
}

inline UniqueDeviceMemory make_device_memory(size_t bytes) {
  void* pointer = nullptr;
  SHARDMUON_CUDA(cudaMalloc(&pointer, bytes));
  return UniqueDeviceMemory(pointer);
}

inline UniquePinnedMemory make_pinned_memory(size_t bytes) {
  void* pointer = nullptr;
  SHARDMUON_CUDA(cudaMallocHost(&pointer, bytes));
  return UniquePinnedMemory(pointer);
}

}  // namespace shardmuon
