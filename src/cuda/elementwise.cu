#include <cuda_bf16.h>

#include <cub/device/device_reduce.cuh>
#include <cuda/std/functional>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/elementwise.cuh"

namespace shardmuon {
namespace {

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_accumulate(float x);
template <>
__device__ __forceinline__ float from_accumulate<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_accumulate<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// x -> x^2 in the accumulate type (float32 for float32 and bf16 storage).
template <typename T>
struct SquareInFloat {
  __device__ __forceinline__ float operator()(T x) const {
    const float value = to_float(x);
    return value * value;
  }
};

constexpr int kThreads = 256;

unsigned int grid_for(int64_t count) {
  // Grid-stride loops: enough blocks to fill an H200 several times over, no more.
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

// y = x * (1 / max(sqrt(sum), eps)), with a zero sum giving y = 0 rather than 0 * inf.
template <typename T>
__global__ void divide_by_norm_kernel(const T* x, T* y, int64_t count, const float* sum_of_squares,
                                      float eps) {
  const float norm = fmaxf(sqrtf(*sum_of_squares), eps);
  const float scale = norm > 0.0f ? 1.0f / norm : 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = from_accumulate<T>(to_float(x[i]) * scale);
  }
}

// One 32 x 32 tile pair of unpack_symmetric: tile (I, J) of the lower triangle (I >= J,
// in tiles) is read once from the packed block columns (coalesced down its columns) and
// written to its own place and, transposed through shared memory, to tile (J, I). On a
// diagonal tile the entries above the diagonal come from their mirror images below it, so
// the result is exactly symmetric.
struct PackedTriangle {
  static constexpr int kMaxBlocks = 64;
  int64_t n;
  int blocks;
  int64_t starts[kMaxBlocks + 1];
  int64_t offsets[kMaxBlocks + 1];

  // Where entry (r, c), r >= c, of the lower triangle is kept.
  __device__ int64_t index(int64_t r, int64_t c) const {
    int j = 0;
    while (c >= starts[j + 1]) ++j;
    return offsets[j] + (r - starts[j]) + (c - starts[j]) * (n - starts[j]);
  }
};

constexpr int kTile = 32;
constexpr int kTileRowsPerPass = 8;

template <typename Source, typename Destination>
__global__ void unpack_symmetric_kernel(const Source* packed, PackedTriangle layout,
                                        Destination* dst, float shift) {
  const int64_t tile_row = blockIdx.x, tile_col = blockIdx.y;
  if (tile_col > tile_row) return;
  __shared__ float tile[kTile][kTile + 1];  // [row][col]; +1 avoids bank conflicts
  const int64_t n = layout.n;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  const int64_t r = row0 + threadIdx.x;
  for (int y = threadIdx.y; y < kTile; y += kTileRowsPerPass) {
    const int64_t c = col0 + y;
    tile[threadIdx.x][y] = r < n && c < n && r >= c ? to_float(packed[layout.index(r, c)]) : 0.0f;
  }
  __syncthreads();
  for (int y = threadIdx.y; y < kTile; y += kTileRowsPerPass) {
    const int64_t c = col0 + y;
    if (r >= n || c >= n) continue;
    // r < c only on a diagonal tile, where row0 == col0 and the mirror is tile[y][x].
    float value = r >= c ? tile[threadIdx.x][y] : tile[y][threadIdx.x];
    if (r == c) value += shift;
    dst[c * n + r] = from_accumulate<Destination>(value);
  }
  if (tile_row == tile_col) return;
  for (int y = threadIdx.y; y < kTile; y += kTileRowsPerPass) {
    const int64_t upper_row = col0 + threadIdx.x, upper_col = row0 + y;
    if (upper_row < n && upper_col < n) {
      dst[upper_col * n + upper_row] = from_accumulate<Destination>(tile[y][threadIdx.x]);
    }
  }
}

template <typename T>
size_t transform_reduce(void* scratch, size_t scratch_bytes, const void* x, int64_t count,
                        void* result, cudaStream_t stream) {
  SHARDMUON_CUDA(cub::DeviceReduce::TransformReduce(
      scratch, scratch_bytes, static_cast<const T*>(x), static_cast<float*>(result), count,
      ::cuda::std::plus<float>{}, SquareInFloat<T>{}, 0.0f, stream));
  return scratch_bytes;
}

void check_launch(const char* kernel) {
  check_cuda(cudaGetLastError(), kernel);
}

}  // namespace

size_t sum_of_squares_scratch_bytes_cuda(shardmuon_dtype dtype, int64_t count) {
  size_t bytes = 0;
  if (dtype == SHARDMUON_BFLOAT16) {
    bytes = transform_reduce<__nv_bfloat16>(nullptr, 0, nullptr, count, nullptr, nullptr);
  } else {
    bytes = transform_reduce<float>(nullptr, 0, nullptr, count, nullptr, nullptr);
  }
  return bytes;
}

void sum_of_squares_cuda(const void* x, shardmuon_dtype dtype, int64_t count, void* result,
                         void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  if (dtype == SHARDMUON_BFLOAT16) {
    transform_reduce<__nv_bfloat16>(scratch, scratch_bytes, x, count, result, stream);
  } else {
    transform_reduce<float>(scratch, scratch_bytes, x, count, result, stream);
  }
}

void divide_by_norm_cuda(const void* x, void* y, shardmuon_dtype dtype, int64_t count,
                         const void* sum_of_squares, double eps, cudaStream_t stream) {
  const float* sum = static_cast<const float*>(sum_of_squares);
  if (dtype == SHARDMUON_BFLOAT16) {
    divide_by_norm_kernel<<<grid_for(count), kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), count, sum,
        static_cast<float>(eps));
  } else {
    divide_by_norm_kernel<<<grid_for(count), kThreads, 0, stream>>>(
        static_cast<const float*>(x), static_cast<float*>(y), count, sum, static_cast<float>(eps));
  }
  check_launch("divide_by_norm_kernel");
}

void unpack_symmetric_cuda(const void* packed, shardmuon_dtype src_type,
                           const SymmetricTiles& tiles, void* dst, shardmuon_dtype dst_type,
                           double shift, cudaStream_t stream) {
  if (src_type != SHARDMUON_FLOAT32) {
    fail(SHARDMUON_ERROR_INTERNAL, "unpack_symmetric_cuda takes float32 sources");
  }
  if (tiles.blocks() > PackedTriangle::kMaxBlocks) {
    fail(SHARDMUON_ERROR_INTERNAL, "unpack_symmetric_cuda takes at most ",
         PackedTriangle::kMaxBlocks, " blocks, not ", tiles.blocks());
  }
  if (tiles.n == 0) return;
  PackedTriangle layout{};
  layout.n = tiles.n;
  layout.blocks = tiles.blocks();
  for (int j = 0; j <= tiles.blocks(); ++j) {
    layout.starts[j] = tiles.starts[j];
    layout.offsets[j] = tiles.offset(j);
  }
  const int64_t tile_count = (tiles.n + kTile - 1) / kTile;
  if (tile_count > 65535) fail(SHARDMUON_ERROR_UNSUPPORTED, "matrix side ", tiles.n, " too large");
  const dim3 grid(static_cast<unsigned int>(tile_count), static_cast<unsigned int>(tile_count));
  const dim3 block(kTile, kTileRowsPerPass);
  const float* source = static_cast<const float*>(packed);
  if (dst_type == SHARDMUON_FLOAT32) {
    unpack_symmetric_kernel<<<grid, block, 0, stream>>>(source, layout, static_cast<float*>(dst),
                                                        static_cast<float>(shift));
  } else {
    unpack_symmetric_kernel<<<grid, block, 0, stream>>>(
        source, layout, static_cast<__nv_bfloat16*>(dst), static_cast<float>(shift));
  }
  check_launch("unpack_symmetric_kernel");
}

}  // namespace shardmuon
