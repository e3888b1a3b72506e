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

template <typename Source, typename Destination>
__global__ void convert_kernel(const Source* src, Destination* dst, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = from_accumulate<Destination>(to_float(src[i]));
  }
}

// dst = src + shift * I over an n x n matrix, converting float32 -> storage type.
template <typename Destination>
__global__ void shift_diagonal_kernel(const float* src, Destination* dst, int64_t n, float shift) {
  const int64_t count = n * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float value = src[i] + (i / n == i % n ? shift : 0.0f);
    dst[i] = from_accumulate<Destination>(value);
  }
}

// In place: only the n diagonal entries change.
__global__ void shift_diagonal_in_place_kernel(float* matrix, int64_t n, float shift) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    matrix[i * n + i] += shift;
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

void shift_diagonal_cuda(const void* src, shardmuon_dtype src_type, void* dst,
                         shardmuon_dtype dst_type, int64_t n, double shift, cudaStream_t stream) {
  if (src_type != SHARDMUON_FLOAT32) {
    fail(SHARDMUON_ERROR_INTERNAL, "shift_diagonal_cuda takes float32 sources");
  }
  const float* source = static_cast<const float*>(src);
  const float amount = static_cast<float>(shift);
  if (dst_type == SHARDMUON_FLOAT32 && dst == src) {
    shift_diagonal_in_place_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<float*>(dst),
                                                                         n, amount);
  } else if (dst_type == SHARDMUON_FLOAT32) {
    shift_diagonal_kernel<<<grid_for(n * n), kThreads, 0, stream>>>(
        source, static_cast<float*>(dst), n, amount);
  } else {
    shift_diagonal_kernel<<<grid_for(n * n), kThreads, 0, stream>>>(
        source, static_cast<__nv_bfloat16*>(dst), n, amount);
  }
  check_launch("shift_diagonal_kernel");
}

void convert_cuda(const void* src, shardmuon_dtype src_type, void* dst, shardmuon_dtype dst_type,
                  int64_t count, cudaStream_t stream) {
  if (src_type == SHARDMUON_FLOAT32 && dst_type == SHARDMUON_BFLOAT16) {
    convert_kernel<<<grid_for(count), kThreads, 0, stream>>>(
        static_cast<const float*>(src), static_cast<__nv_bfloat16*>(dst), count);
  } else if (src_type == SHARDMUON_BFLOAT16 && dst_type == SHARDMUON_FLOAT32) {
    convert_kernel<<<grid_for(count), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src),
                                                             static_cast<float*>(dst), count);
  } else {
    fail(SHARDMUON_ERROR_INTERNAL, "no CUDA conversion from dtype ", static_cast<int>(src_type),
         " to ", static_cast<int>(dst_type));
  }
  check_launch("convert_kernel");
}

}  // namespace shardmuon
