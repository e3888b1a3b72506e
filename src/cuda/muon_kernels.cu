// The two elementwise passes of a Muon step. Both are bound by memory bandwidth, so each
// touches every byte once: the momentum pass reads grad and momentum (and param for L2
// decay) and writes momentum and the update; the update pass reads param and the
// orthogonalized update and writes param. Each thread moves 16 bytes per access of its widest
// array when every pointer allows it. T is the dtype of param, grad and momentum, U the
// update's (the Newton-Schulz dtype, which may differ: ns_storage).
#include <cuda_bf16.h>

#include <cstdint>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/float_conversions.cuh"
#include "cuda/kernel_launch.cuh"
#include "cuda/muon_kernels.cuh"

namespace shardmuon {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorBytes = 16;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vector {
  T values[N];
};

// Elements per vector access: 16 bytes of the wider of T and U.
template <typename T, typename U>
constexpr int vector_width() {
  return kVectorBytes / (sizeof(T) > sizeof(U) ? sizeof(T) : sizeof(U));
}

// Each thread handles N consecutive elements per access; count is in elements and a multiple
// of N (the caller runs the remainder with N = 1).
// momentum_out is momentum itself, or the buffer a checked step commits from later.
template <typename T, typename U, int N, bool kNesterov, bool kL2>
__global__ void momentum_kernel(const T* __restrict__ grad, const T* __restrict__ param,
                                const T* momentum, T* momentum_out, U* __restrict__ update,
                                int64_t count, float beta, float l2_decay, float* nonfinite_flag) {
  using V = Vector<T, N>;
  using UV = Vector<U, N>;
  const float weight = 1.0f - beta;
  bool finite = true;
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * N; i < count;
       i += int64_t{gridDim.x} * blockDim.x * N) {
    const V g_in = *reinterpret_cast<const V*>(grad + i);
    V m_io = *reinterpret_cast<const V*>(momentum + i);
    V p_in;
    if constexpr (kL2) p_in = *reinterpret_cast<const V*>(param + i);
    UV u_out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = to_float(g_in.values[j]);
      finite = finite && isfinite(g);
      if constexpr (kL2) g = fmaf(l2_decay, to_float(p_in.values[j]), g);
      float m = to_float(m_io.values[j]);
      m = fmaf(weight, g - m, m);  // lerp(m, g, 1 - beta)
      m_io.values[j] = from_float<T>(m);
      u_out.values[j] = from_float<U>(kNesterov ? fmaf(beta, m - g, g) : m);
    }
    *reinterpret_cast<V*>(momentum_out + i) = m_io;
    *reinterpret_cast<UV*>(update + i) = u_out;
  }
  // Every thread that saw a non-finite value stores the same 1: no atomics needed.
  if (!finite && nonfinite_flag != nullptr) *nonfinite_flag = 1.0f;
}

// DeviceLearningRate as kernel arguments: with lr set, decay and step_size are computed from
// the value it holds when the kernel runs (the same in every thread).
struct DeviceRate {
  const float* lr;
  float decay_per_lr, step_size_per_lr;

  static DeviceRate of(const DeviceLearningRate& rate) {
    return {rate.lr, static_cast<float>(rate.decay_per_lr),
            static_cast<float>(rate.step_size_per_lr)};
  }
  __device__ void apply(float& decay, float& step_size) const {
    if (lr == nullptr) return;
    const float value = *lr;
    decay -= decay_per_lr * value;
    step_size = step_size_per_lr * value;
  }
};

// param <- param * decay - step_size * update on the N elements from i.
template <typename T, typename U, int N>
__device__ __forceinline__ void update_vector(T* __restrict__ param, const U* __restrict__ update,
                                              int64_t i, float decay, float step_size) {
  using V = Vector<T, N>;
  V w = *reinterpret_cast<const V*>(param + i);
  const Vector<U, N> o = *reinterpret_cast<const Vector<U, N>*>(update + i);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    w.values[j] =
        from_float<T>(fmaf(to_float(w.values[j]), decay, -step_size * to_float(o.values[j])));
  }
  *reinterpret_cast<V*>(param + i) = w;
}

template <typename T, typename U, int N>
__global__ void update_kernel(T* __restrict__ param, const U* __restrict__ update, int64_t count,
                              float decay, float step_size, DeviceRate rate) {
  rate.apply(decay, step_size);
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * N; i < count;
       i += int64_t{gridDim.x} * blockDim.x * N) {
    update_vector<T, U, N>(param, update, i, decay, step_size);
  }
}

// Unless a flag is set: param <- param * decay - step_size * update, momentum <- new_momentum.
template <typename T, typename U, int N>
__global__ void commit_kernel(T* __restrict__ param, const U* __restrict__ update,
                              T* __restrict__ momentum, const T* __restrict__ new_momentum,
                              int64_t count, float decay, float step_size, const float* step_flag,
                              const float* param_flag, long long* skipped_params, DeviceRate rate) {
  rate.apply(decay, step_size);
  const bool step_bad = *step_flag != 0.0f, param_bad = *param_flag != 0.0f;
  if (step_bad || param_bad) {
    if (!step_bad && skipped_params != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      *skipped_params += 1;
    }
    return;
  }
  using V = Vector<T, N>;
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * N; i < count;
       i += int64_t{gridDim.x} * blockDim.x * N) {
    update_vector<T, U, N>(param, update, i, decay, step_size);
    *reinterpret_cast<V*>(momentum + i) = *reinterpret_cast<const V*>(new_momentum + i);
  }
}

// N elements per access as in the passes (count a multiple of N): a check of one element per
// access ran at a fraction of the copy rate.
template <typename T, int N>
__global__ void flag_nonfinite_kernel(const T* __restrict__ x, int64_t count, float* flag) {
  using V = Vector<T, N>;
  bool bad = false;
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * N; i < count;
       i += int64_t{gridDim.x} * blockDim.x * N) {
    const V v = *reinterpret_cast<const V*>(x + i);
#pragma unroll
    for (int j = 0; j < N; ++j) bad |= !isfinite(to_float(v.values[j]));
  }
  if (bad) *flag = 1.0f;  // every writer writes the same value
}

__global__ void count_if_flagged_kernel(const float* flag, long long* counter) {
  if (*flag != 0.0f) *counter += 1;
}

unsigned int grid_for(int64_t accesses) {
  // A grid-stride loop over as many blocks as keep every multiprocessor busy.
  const int64_t blocks = (accesses + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < 8192 ? (blocks > 0 ? blocks : 1) : 8192);
}

bool aligned(const void* pointer) {
  return pointer == nullptr || reinterpret_cast<uintptr_t>(pointer) % kVectorBytes == 0;
}

template <typename T, typename U, bool kNesterov, bool kL2>
void launch_momentum(const MomentumPass& pass, cudaStream_t stream) {
  constexpr int N = vector_width<T, U>();
  const T* grad = static_cast<const T*>(pass.grad);
  const T* param = static_cast<const T*>(pass.param);
  T* momentum = static_cast<T*>(pass.momentum);
  T* momentum_out = pass.new_momentum ? static_cast<T*>(pass.new_momentum) : momentum;
  U* update = static_cast<U*>(pass.update);
  const float beta = static_cast<float>(pass.beta), l2 = static_cast<float>(pass.l2_decay);
  const bool vectorized = aligned(grad) && aligned(param) && aligned(momentum) &&
                          aligned(momentum_out) && aligned(update);
  const int64_t bulk = vectorized ? pass.count / N * N : 0;
  if (bulk > 0) {
    launch_kernel("momentum_kernel", momentum_kernel<T, U, N, kNesterov, kL2>,
                  dim3(grid_for(bulk / N)), dim3(kThreads), stream, grad, param, momentum,
                  momentum_out, update, bulk, beta, l2, pass.nonfinite_flag);
  }
  if (pass.count > bulk) {
    const int64_t rest = pass.count - bulk;
    launch_kernel("momentum_kernel", momentum_kernel<T, U, 1, kNesterov, kL2>, dim3(grid_for(rest)),
                  dim3(kThreads), stream, grad + bulk, kL2 ? param + bulk : nullptr,
                  momentum + bulk, momentum_out + bulk, update + bulk, rest, beta, l2,
                  pass.nonfinite_flag);
  }
}

template <typename T, typename U>
void launch_momentum(const MomentumPass& pass, cudaStream_t stream) {
  const bool l2 = pass.l2_decay != 0.0;
  if (pass.nesterov) {
    l2 ? launch_momentum<T, U, true, true>(pass, stream)
       : launch_momentum<T, U, true, false>(pass, stream);
  } else {
    l2 ? launch_momentum<T, U, false, true>(pass, stream)
       : launch_momentum<T, U, false, false>(pass, stream);
  }
}

template <typename T, typename U>
void launch_update(void* param_bytes, const void* update_bytes, int64_t count, float decay,
                   float step_size, DeviceRate rate, cudaStream_t stream) {
  constexpr int N = vector_width<T, U>();
  T* param = static_cast<T*>(param_bytes);
  const U* update = static_cast<const U*>(update_bytes);
  const int64_t bulk = aligned(param) && aligned(update) ? count / N * N : 0;
  if (bulk > 0) {
    launch_kernel("update_kernel", update_kernel<T, U, N>, dim3(grid_for(bulk / N)), dim3(kThreads),
                  stream, param, update, bulk, decay, step_size, rate);
  }
  if (count > bulk) {
    launch_kernel("update_kernel", update_kernel<T, U, 1>, dim3(grid_for(count - bulk)),
                  dim3(kThreads), stream, param + bulk, update + bulk, count - bulk, decay,
                  step_size, rate);
  }
}

template <typename T, typename U>
void launch_commit(const CommitPass& pass, cudaStream_t stream) {
  constexpr int N = vector_width<T, U>();
  T* param = static_cast<T*>(pass.param);
  const U* update = static_cast<const U*>(pass.update);
  T* momentum = static_cast<T*>(pass.momentum);
  const T* new_momentum = static_cast<const T*>(pass.new_momentum);
  long long* counter = reinterpret_cast<long long*>(pass.skipped_params);
  const float decay = static_cast<float>(pass.decay), step = static_cast<float>(pass.step_size);
  const bool vectorized =
      aligned(param) && aligned(update) && aligned(momentum) && aligned(new_momentum);
  const int64_t bulk = vectorized ? pass.count / N * N : 0;
  // One launch counts a skipped parameter; the remainder's launch does not count it again.
  if (bulk > 0) {
    launch_kernel("commit_kernel", commit_kernel<T, U, N>, dim3(grid_for(bulk / N)), dim3(kThreads),
                  stream, param, update, momentum, new_momentum, bulk, decay, step, pass.step_flag,
                  pass.param_flag, counter, DeviceRate::of(pass.device_lr));
  }
  if (pass.count > bulk || pass.count == 0) {
    launch_kernel("commit_kernel", commit_kernel<T, U, 1>, dim3(grid_for(pass.count - bulk)),
                  dim3(kThreads), stream, param + bulk, update + bulk, momentum + bulk,
                  new_momentum + bulk, pass.count - bulk, decay, step, pass.step_flag,
                  pass.param_flag, bulk > 0 ? nullptr : counter, DeviceRate::of(pass.device_lr));
  }
}

// Calls launch<T, U>() for the CUDA backend's dtypes: T of the parameter's state, U of the
// update (float32 or bf16 each).
template <typename Launch>
void with_dtypes(shardmuon_dtype state, shardmuon_dtype update, const char* what, Launch launch) {
  using Bf16 = __nv_bfloat16;
  if (state == SHARDMUON_FLOAT32 && update == SHARDMUON_FLOAT32) return launch(float{}, float{});
  if (state == SHARDMUON_FLOAT32 && update == SHARDMUON_BFLOAT16) return launch(float{}, Bf16{});
  if (state == SHARDMUON_BFLOAT16 && update == SHARDMUON_FLOAT32) return launch(Bf16{}, float{});
  if (state == SHARDMUON_BFLOAT16 && update == SHARDMUON_BFLOAT16) return launch(Bf16{}, Bf16{});
  fail(SHARDMUON_ERROR_INTERNAL, what, ": unsupported dtypes ", static_cast<int>(state), ", ",
       static_cast<int>(update));
}

}  // namespace

void commit_pass_cuda(const CommitPass& pass, cudaStream_t stream) {
  with_dtypes(pass.dtype, pass.update_dtype, "commit_pass_cuda", [&](auto state, auto update) {
    launch_commit<decltype(state), decltype(update)>(pass, stream);
  });
}

void flag_nonfinite_cuda(const void* x, shardmuon_dtype dtype, int64_t count, float* flag,
                         cudaStream_t stream) {
  if (count == 0) return;
  auto launch = [&](auto element) {
    using T = decltype(element);
    constexpr int N = kVectorBytes / sizeof(T);
    const T* values = static_cast<const T*>(x);
    const int64_t bulk = aligned(values) ? count / N * N : 0;
    if (bulk > 0) {
      launch_kernel("flag_nonfinite_kernel", flag_nonfinite_kernel<T, N>, dim3(grid_for(bulk / N)),
                    dim3(kThreads), stream, values, bulk, flag);
    }
    if (count > bulk) {
      launch_kernel("flag_nonfinite_kernel", flag_nonfinite_kernel<T, 1>,
                    dim3(grid_for(count - bulk)), dim3(kThreads), stream, values + bulk,
                    count - bulk, flag);
    }
  };
  if (dtype == SHARDMUON_BFLOAT16) {
    launch(__nv_bfloat16{});
  } else {
    launch(float{});
  }
}

void count_if_flagged_cuda(const float* flag, int64_t* counter, cudaStream_t stream) {
  launch_kernel("count_if_flagged_kernel", count_if_flagged_kernel, dim3(1), dim3(1), stream, flag,
                reinterpret_cast<long long*>(counter));
}

void momentum_pass_cuda(const MomentumPass& pass, cudaStream_t stream) {
  if (pass.count == 0) return;
  with_dtypes(pass.dtype, pass.update_dtype, "momentum_pass_cuda", [&](auto state, auto update) {
    launch_momentum<decltype(state), decltype(update)>(pass, stream);
  });
}

void update_pass_cuda(void* param, shardmuon_dtype param_dtype, const void* update,
                      shardmuon_dtype update_dtype, int64_t count, double decay, double step_size,
                      const DeviceLearningRate& device_lr, cudaStream_t stream) {
  if (count == 0) return;
  const float d = static_cast<float>(decay), s = static_cast<float>(step_size);
  const DeviceRate rate = DeviceRate::of(device_lr);
  with_dtypes(param_dtype, update_dtype, "update_pass_cuda", [&](auto state, auto other) {
    launch_update<decltype(state), decltype(other)>(param, update, count, d, s, rate, stream);
  });
}

}  // namespace shardmuon
