#pragma once

#include <memory>

#include "core/backend.h"

namespace shardmuon {

// The CUDA backend on one device; throws NOT_BUILT when the library has no CUDA.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace shardmuon
