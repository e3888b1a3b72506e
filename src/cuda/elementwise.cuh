// Launchers of the CUDA backend's elementwise and reduction kernels. Kernels stay in the .cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/symmetric_tiles.h"
#include "shardmuon/shardmuon.h"

namespace shardmuon {

// The reductions, the division and the unpacking take a batch: `batch` vectors or matrices
// one after another (Backend's contracts).
size_t sum_of_squares_scratch_bytes_cuda(shardmuon_dtype dtype, int64_t count, int64_t batch);
void sum_of_squares_cuda(const void* x, shardmuon_dtype dtype, int64_t count, int64_t batch,
                         void* result, void* scratch, size_t scratch_bytes, cudaStream_t stream);
void divide_by_norm_cuda(const void* x, void* y, shardmuon_dtype dtype, int64_t count,
                         int64_t batch, const void* sum_of_squares, double eps,
                         cudaStream_t stream);
void unpack_symmetric_cuda(const void* packed, shardmuon_dtype src_type,
                           const SymmetricTiles& tiles, int64_t batch, void* dst,
                           shardmuon_dtype dst_type, double shift, cudaStream_t stream);

}  // namespace shardmuon
