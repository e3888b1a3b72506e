// Launchers of the CUDA backend's elementwise and reduction kernels. Kernels stay in the .cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/backend.h"
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
void divide_by_norm_padded_cuda(const void* x, int64_t rows, int64_t cols, void* y,
                                int64_t padded_rows, int64_t padded_cols, shardmuon_dtype dtype,
                                int64_t batch, const void* sum_of_squares, double eps,
                                cudaStream_t stream);
int64_t column_square_parts_cuda(int64_t n);
void unpack_symmetric_cuda(const void* packed, shardmuon_dtype src_type,
                           const SymmetricTiles& tiles, int64_t batch, void* dst,
                           shardmuon_dtype dst_type, double shift, void* square_parts,
                           cudaStream_t stream);

void mirror_lower_cuda(void* matrix, shardmuon_dtype dtype, int64_t n, int64_t batch,
                       const SymmetricDiagonal& diagonal, void* square_parts, bool upper_computed,
                       cudaStream_t stream);

// Backend::copy_2d between device buffers: `rows` rows of row_bytes each. A kernel moving the
// widest unit that divides both pointers, both pitches and row_bytes; cudaMemcpy2DAsync
// where that is 16 bytes or there is one row.
void copy_2d_cuda(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                  size_t rows, cudaStream_t stream);

// The pointer arrays of a cuBLASLt pointer-array batch: product p's matrix m (of a strided
// batch of `batch`) is entry p * batch + m, at its pointer plus m times the stride (bytes).
// The operands travel as kernel arguments, so a captured graph replays the same arrays.
struct PointerArraySource {
  // At least the 528 tiles of 32 blocks (CudaBackend::product_tiles), in one launch. The
  // arrays travel as kernel arguments: 18 KB here, within the 32 KB CUDA 12.1 allows.
  static constexpr int kMaxProducts = 576;
  const char* operands[4][kMaxProducts];  // a, b, c, d
  int64_t stride_bytes[4];
  int products;
  int64_t batch;
};
void fill_pointer_arrays_cuda(const PointerArraySource& source, void** arrays[4],
                              cudaStream_t stream);

}  // namespace shardmuon
