#pragma once

#include <memory>

#include "core/backend.h"

namespace shardmuon {

// The reference backend: host memory, OpenBLAS. float64 is the precision of the test
// oracle; float32 and bf16 storage follow the CUDA backend's rounding points (products in
// float32, bf16 rounding of A, B and each iterate) so the two backends compute the same thing.
std::unique_ptr<Backend> make_cpu_backend();

}  // namespace shardmuon
