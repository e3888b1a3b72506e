// Launchers of the CUDA backend's elementwise and reduction kernels. Kernels stay in the .cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "shardmuon/shardmuon.h"

namespace shardmuon {

size_t sum_of_squares_scratch_bytes_cuda(shardmuon_dtype dtype, int64_t count);
void sum_of_squares_cuda(const void* x, shardmuon_dtype dtype, int64_t count, void* result,
                         void* scratch, size_t scratch_bytes, cudaStream_t stream);
void divide_by_norm_cuda(const void* x, void* y, shardmuon_dtype dtype, int64_t count,
                         const void* sum_of_squares, double eps, cudaStream_t stream);
void shift_diagonal_cuda(const void* src, shardmuon_dtype src_type, void* dst,
                         shardmuon_dtype dst_type, int64_t n, double shift, cudaStream_t stream);
void convert_cuda(const void* src, shardmuon_dtype src_type, void* dst, shardmuon_dtype dst_type,
                  int64_t count, cudaStream_t stream);

}  // namespace shardmuon
