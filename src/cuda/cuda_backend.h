#pragma once

#include <memory>

#include "core/backend.h"

namespace shardmuon {

// The CUDA backend on one device; throws NOT_BUILT when the library has no CUDA.
std::unique_ptr<Backend> make_cuda_backend(int device);

// Whether pointer is memory that only a CUDA device can read (device memory; not managed,
// pinned or ordinary host memory), for the CPU backend's argument checks. False where CUDA
// cannot say: no driver, no device, memory CUDA does not know, or a library built without
// CUDA. It creates no CUDA context, so a CPU-only process on a GPU machine gets none from it.
bool is_device_only_memory(const void* pointer);

}  // namespace shardmuon
