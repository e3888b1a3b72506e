// The elementwise passes of a Muon step. Each is bound by memory bandwidth, so it touches
// every byte once: the momentum pass reads grad and momentum (and param for L2 decay) and
// writes momentum and the update; the update pass reads param and the orthogonalized update
// and writes param. Each thread moves 16 bytes per access of its widest array when every
// pointer allows it. T is the dtype of param, grad and momentum, U the update's (the
// Newton-Schulz dtype, which may differ: ns_storage).
//
// One launch runs the passes of many parameters: its arguments carry a table of them, each
// with its own range of the grid's blocks. With a launch per parameter, a step of many small
// parameters was bound by launching (GPT-2's 48 matrices: 144 launches).
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/float_conversions.cuh"
#include "cuda/kernel_launch.cuh"
#include "cuda/muon_kernels.cuh"

namespace shardmuon {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorBytes = 16;
// A block covers kAccessesPerBlock accesses of one pass, each thread kAccessesPerThread of
// them, kThreads apart (coalesced).
constexpr int kAccessesPerThread = 4;
constexpr int64_t kAccessesPerBlock = int64_t{kThreads} * kAccessesPerThread;
// A table's bytes in a launch's arguments: CUDA 12.1 allows 32764 on Volta and later.
constexpr size_t kTableBytes = 30 * 1024;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vector {
  T values[N];
};

// Elements per vector access: 16 bytes of the wider of T and U.
template <typename T, typename U>
constexpr int vector_width() {
  return kVectorBytes / (sizeof(T) > sizeof(U) ? sizeof(T) : sizeof(U));
}

// The passes of one launch (Args: one pass's pointers and scalars). Pass p owns the blocks
// [first_block[p], first_block[p + 1]), one at least.
template <typename Args>
struct PassTable {
  static constexpr int kCapacity =
      static_cast<int>((kTableBytes - 2 * sizeof(int)) / (sizeof(Args) + sizeof(int)));
  Args passes[kCapacity];
  int first_block[kCapacity + 1];
  int size;

  // The pass that block `block` works on: the last p with first_block[p] <= block.
  __device__ int pass_of(int block) const {
    int low = 0, high = size - 1;
    while (low < high) {
      const int middle = (low + high + 1) / 2;
      if (first_block[middle] <= block) {
        low = middle;
      } else {
        high = middle - 1;
      }
    }
    return low;
  }
};

// Calls visit(std::integral_constant<int, M>{}, i) for each run [i, i + M) of the `count`
// elements of pass p that this thread handles: vector accesses of N elements, then, in the
// pass's last block, the count % N elements after the last whole vector, one per thread.
template <int N, typename Table, typename Visit>
__device__ __forceinline__ void for_each_access(const Table& table, int p, int64_t count,
                                                Visit&& visit) {
  const int block = static_cast<int>(blockIdx.x);
  const int64_t vectors = count / N;
  const int64_t first = (block - table.first_block[p]) * kAccessesPerBlock + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kAccessesPerThread; ++j) {
    const int64_t access = first + int64_t{j} * kThreads;
    if (access < vectors) visit(std::integral_constant<int, N>{}, access * N);
  }
  if constexpr (N > 1) {
    const int64_t rest = vectors * N + threadIdx.x;
    if (block + 1 == table.first_block[p + 1] && rest < count) {
      visit(std::integral_constant<int, 1>{}, rest);
    }
  }
}

// Launches kernel over `passes` (all of its kind), as many per launch as a table holds, each
// pass with blocks for its count / width vector accesses (one at least).
template <typename Args>
void launch_tables(const char* name, void (*kernel)(PassTable<Args>), int width,
                   const std::vector<Args>& passes, cudaStream_t stream) {
  static_assert(sizeof(PassTable<Args>) <= 32764, "a table must fit a launch's arguments");
  constexpr int64_t kMaxBlocks = (int64_t{1} << 31) - 1;
  PassTable<Args> table{};
  auto launch = [&] {
    if (table.size == 0) return;
    launch_kernel(name, kernel, dim3(static_cast<unsigned int>(table.first_block[table.size])),
                  dim3(kThreads), stream, table);
    table.size = 0;
  };
  for (const Args& pass : passes) {
    const int64_t vectors = pass.count / width;
    const int64_t blocks =
        std::max<int64_t>(1, (vectors + kAccessesPerBlock - 1) / kAccessesPerBlock);
    SHARDMUON_CHECK_ARG(blocks < kMaxBlocks, name, ": a pass of ", pass.count,
                        " elements is more than one launch can cover");
    if (table.size == PassTable<Args>::kCapacity ||
        table.first_block[table.size] + blocks > kMaxBlocks) {
      launch();
    }
    table.passes[table.size] = pass;
    table.first_block[table.size + 1] = static_cast<int>(table.first_block[table.size] + blocks);
    ++table.size;
  }
  launch();
}

bool aligned(const void* pointer) {
  return pointer == nullptr || reinterpret_cast<uintptr_t>(pointer) % kVectorBytes == 0;
}

// f(std::true_type{}) or f(std::false_type{}): a runtime switch as a template argument.
template <typename F>
void with_switch(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls launch(T{}, U{}) for the CUDA backend's dtypes: T of the parameter's state, U of the
// update (float32 or bf16 each).
template <typename Launch>
void with_dtypes(int state, int update, const char* what, Launch launch) {
  using Bf16 = __nv_bfloat16;
  if (state == SHARDMUON_FLOAT32 && update == SHARDMUON_FLOAT32) return launch(float{}, float{});
  if (state == SHARDMUON_FLOAT32 && update == SHARDMUON_BFLOAT16) return launch(float{}, Bf16{});
  if (state == SHARDMUON_BFLOAT16 && update == SHARDMUON_FLOAT32) return launch(Bf16{}, float{});
  if (state == SHARDMUON_BFLOAT16 && update == SHARDMUON_BFLOAT16) return launch(Bf16{}, Bf16{});
  fail(SHARDMUON_ERROR_INTERNAL, what, ": unsupported dtypes ", state, ", ", update);
}

// Launches each list of `kinds` (keyed by the state's dtype, the update's, and whether every
// pointer allows vector accesses) with kernel_of(T{}, U{}, std::integral_constant<int, N>{}).
template <typename Args, typename KernelOf>
void launch_kinds(const char* name, const std::map<std::array<int, 3>, std::vector<Args>>& kinds,
                  KernelOf kernel_of, cudaStream_t stream) {
  for (const auto& kind : kinds) {
    const std::array<int, 3>& key = kind.first;
    with_dtypes(key[0], key[1], name, [&](auto state, auto update) {
      using T = decltype(state);
      using U = decltype(update);
      with_switch(key[2], [&](auto vectorized) {
        constexpr int N = decltype(vectorized)::value ? vector_width<T, U>() : 1;
        launch_tables(name, kernel_of(state, update, std::integral_constant<int, N>{}), N,
                      kind.second, stream);
      });
    });
  }
}

// MomentumPass as kernel arguments. momentum_out is momentum itself, or the buffer a checked
// step commits from later.
struct MomentumArgs {
  const void* grad;
  const void* param;  // read for L2 decay only
  const void* momentum;
  void* momentum_out;
  void* update;
  float* nonfinite_flag;
  int64_t count;
  float beta, l2_decay;
};

template <typename T, typename U, int N, bool kNesterov, bool kL2>
__global__ void __launch_bounds__(kThreads)
    momentum_kernel(const __grid_constant__ PassTable<MomentumArgs> table) {
  const int p = table.pass_of(static_cast<int>(blockIdx.x));
  const MomentumArgs& pass = table.passes[p];
  const T* grad = static_cast<const T*>(pass.grad);
  const T* param = static_cast<const T*>(pass.param);
  const T* momentum = static_cast<const T*>(pass.momentum);
  T* momentum_out = static_cast<T*>(pass.momentum_out);
  U* update = static_cast<U*>(pass.update);
  const float beta = pass.beta, weight = 1.0f - beta, l2_decay = pass.l2_decay;
  bool finite = true;
  for_each_access<N>(table, p, pass.count, [&](auto width, int64_t i) {
    constexpr int M = decltype(width)::value;
    using V = Vector<T, M>;
    const V g_in = *reinterpret_cast<const V*>(grad + i);
    V m_io = *reinterpret_cast<const V*>(momentum + i);
    V p_in;
    if constexpr (kL2) p_in = *reinterpret_cast<const V*>(param + i);
    Vector<U, M> u_out;
#pragma unroll
    for (int j = 0; j < M; ++j) {
      float g = to_float(g_in.values[j]);
      finite = finite && isfinite(g);
      if constexpr (kL2) g = fmaf(l2_decay, to_float(p_in.values[j]), g);
      float m = to_float(m_io.values[j]);
      m = fmaf(weight, g - m, m);  // lerp(m, g, 1 - beta)
      m_io.values[j] = from_float<T>(m);
      u_out.values[j] = from_float<U>(kNesterov ? fmaf(beta, m - g, g) : m);
    }
    *reinterpret_cast<V*>(momentum_out + i) = m_io;
    *reinterpret_cast<Vector<U, M>*>(update + i) = u_out;
  });
  // Every thread that saw a non-finite value stores the same 1: no atomics needed.
  if (!finite && pass.nonfinite_flag != nullptr) *pass.nonfinite_flag = 1.0f;
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
__device__ __forceinline__ void update_vector(T* param, const U* update, int64_t i, float decay,
                                              float step_size) {
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

struct UpdateArgs {
  void* param;
  const void* update;
  int64_t count;
  float decay, step_size;
  DeviceRate rate;
};

template <typename T, typename U, int N>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const __grid_constant__ PassTable<UpdateArgs> table) {
  const int p = table.pass_of(static_cast<int>(blockIdx.x));
  const UpdateArgs& pass = table.passes[p];
  float decay = pass.decay, step_size = pass.step_size;
  pass.rate.apply(decay, step_size);
  T* param = static_cast<T*>(pass.param);
  const U* update = static_cast<const U*>(pass.update);
  for_each_access<N>(table, p, pass.count, [&](auto width, int64_t i) {
    update_vector<T, U, decltype(width)::value>(param, update, i, decay, step_size);
  });
}

struct CommitArgs {
  void* param;
  const void* update;
  void* momentum;
  const void* new_momentum;
  const float* step_flag;
  const float* param_flag;
  unsigned long long* skipped_params;
  int64_t count;
  float decay, step_size;
  DeviceRate rate;
};

// Unless a flag is set: param <- param * decay - step_size * update, momentum <- new_momentum.
template <typename T, typename U, int N>
__global__ void __launch_bounds__(kThreads)
    commit_kernel(const __grid_constant__ PassTable<CommitArgs> table) {
  const int p = table.pass_of(static_cast<int>(blockIdx.x));
  const CommitArgs& pass = table.passes[p];
  const bool step_bad = *pass.step_flag != 0.0f, param_bad = *pass.param_flag != 0.0f;
  if (step_bad || param_bad) {
    // The pass's first block counts it; the parameters of a launch share the counter.
    if (!step_bad && pass.skipped_params != nullptr &&
        static_cast<int>(blockIdx.x) == table.first_block[p] && threadIdx.x == 0) {
      atomicAdd(pass.skipped_params, 1ull);
    }
    return;
  }
  float decay = pass.decay, step_size = pass.step_size;
  pass.rate.apply(decay, step_size);
  T* param = static_cast<T*>(pass.param);
  const U* update = static_cast<const U*>(pass.update);
  T* momentum = static_cast<T*>(pass.momentum);
  const T* new_momentum = static_cast<const T*>(pass.new_momentum);
  for_each_access<N>(table, p, pass.count, [&](auto width, int64_t i) {
    constexpr int M = decltype(width)::value;
    using V = Vector<T, M>;
    update_vector<T, U, M>(param, update, i, decay, step_size);
    *reinterpret_cast<V*>(momentum + i) = *reinterpret_cast<const V*>(new_momentum + i);
  });
}

struct FiniteArgs {
  const void* values;
  float* flag;
  int64_t count;
};

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    flag_nonfinite_kernel(const __grid_constant__ PassTable<FiniteArgs> table) {
  const int p = table.pass_of(static_cast<int>(blockIdx.x));
  const FiniteArgs& check = table.passes[p];
  const T* values = static_cast<const T*>(check.values);
  bool bad = false;
  for_each_access<N>(table, p, check.count, [&](auto width, int64_t i) {
    constexpr int M = decltype(width)::value;
    const Vector<T, M> v = *reinterpret_cast<const Vector<T, M>*>(values + i);
#pragma unroll
    for (int j = 0; j < M; ++j) bad |= !isfinite(to_float(v.values[j]));
  });
  if (bad) *check.flag = 1.0f;  // every writer writes the same value
}

__global__ void mark_if_set_kernel(const float* flag, float* mark) {
  *mark = *flag != 0.0f ? 1.0f : 0.0f;  // NaN != 0: set
}

__global__ void count_if_flagged_kernel(const float* flag, long long* counter) {
  if (*flag != 0.0f) *counter += 1;
}

}  // namespace

void momentum_passes_cuda(const std::vector<MomentumPass>& passes, cudaStream_t stream) {
  // One list per kernel: the dtypes, Nesterov, L2 decay, and whether every pointer allows
  // vector accesses.
  std::map<std::array<int, 5>, std::vector<MomentumArgs>> kinds;
  for (const MomentumPass& pass : passes) {
    if (pass.count == 0) continue;
    const bool l2 = pass.l2_decay != 0.0;
    const void* param = l2 ? pass.param : nullptr;
    void* momentum_out = pass.new_momentum != nullptr ? pass.new_momentum : pass.momentum;
    const bool vectorized = aligned(pass.grad) && aligned(param) && aligned(pass.momentum) &&
                            aligned(momentum_out) && aligned(pass.update);
    kinds[{pass.dtype, pass.update_dtype, pass.nesterov, l2, vectorized}].push_back(
        {pass.grad, param, pass.momentum, momentum_out, pass.update, pass.nonfinite_flag,
         pass.count, static_cast<float>(pass.beta), static_cast<float>(pass.l2_decay)});
  }
  for (const auto& kind : kinds) {
    const std::array<int, 5>& key = kind.first;
    with_dtypes(key[0], key[1], "momentum_passes_cuda", [&](auto state, auto update) {
      using T = decltype(state);
      using U = decltype(update);
      with_switch(key[2], [&](auto nesterov) {
        with_switch(key[3], [&](auto l2) {
          with_switch(key[4], [&](auto vectorized) {
            constexpr int N = decltype(vectorized)::value ? vector_width<T, U>() : 1;
            launch_tables("momentum_kernel",
                          momentum_kernel<T, U, N, decltype(nesterov)::value, decltype(l2)::value>,
                          N, kind.second, stream);
          });
        });
      });
    });
  }
}

void update_passes_cuda(const std::vector<UpdatePass>& passes, cudaStream_t stream) {
  std::map<std::array<int, 3>, std::vector<UpdateArgs>> kinds;
  for (const UpdatePass& pass : passes) {
    if (pass.count == 0) continue;
    const bool vectorized = aligned(pass.param) && aligned(pass.update);
    kinds[{pass.dtype, pass.update_dtype, vectorized}].push_back(
        {pass.param, pass.update, pass.count, static_cast<float>(pass.decay),
         static_cast<float>(pass.step_size), DeviceRate::of(pass.device_lr)});
  }
  launch_kinds(
      "update_kernel", kinds,
      [](auto state, auto update, auto width) {
        return update_kernel<decltype(state), decltype(update), decltype(width)::value>;
      },
      stream);
}

void commit_passes_cuda(const std::vector<CommitPass>& passes, cudaStream_t stream) {
  // Empty passes too: a skipped parameter is counted whatever its size.
  std::map<std::array<int, 3>, std::vector<CommitArgs>> kinds;
  for (const CommitPass& pass : passes) {
    const bool vectorized = aligned(pass.param) && aligned(pass.update) && aligned(pass.momentum) &&
                            aligned(pass.new_momentum);
    kinds[{pass.dtype, pass.update_dtype, vectorized}].push_back(
        {pass.param, pass.update, pass.momentum, pass.new_momentum, pass.step_flag, pass.param_flag,
         reinterpret_cast<unsigned long long*>(pass.skipped_params), pass.count,
         static_cast<float>(pass.decay), static_cast<float>(pass.step_size),
         DeviceRate::of(pass.device_lr)});
  }
  launch_kinds(
      "commit_kernel", kinds,
      [](auto state, auto update, auto width) {
        return commit_kernel<decltype(state), decltype(update), decltype(width)::value>;
      },
      stream);
}

void flag_nonfinite_cuda(const std::vector<FiniteCheck>& checks, cudaStream_t stream) {
  // Keyed as launch_kinds keys passes: the values' dtype twice (state and update alike).
  std::map<std::array<int, 3>, std::vector<FiniteArgs>> kinds;
  for (const FiniteCheck& check : checks) {
    if (check.count == 0) continue;
    kinds[{check.dtype, check.dtype, aligned(check.values)}].push_back(
        {check.values, check.flag, check.count});
  }
  launch_kinds(
      "flag_nonfinite_kernel", kinds,
      [](auto values, auto, auto width) {
        return flag_nonfinite_kernel<decltype(values), decltype(width)::value>;
      },
      stream);
}

void mark_if_set_cuda(const float* flag, float* mark, cudaStream_t stream) {
  launch_kernel("mark_if_set_kernel", mark_if_set_kernel, dim3(1), dim3(1), stream, flag, mark);
}

void count_if_flagged_cuda(const float* flag, int64_t* counter, cudaStream_t stream) {
  launch_kernel("count_if_flagged_kernel", count_if_flagged_kernel, dim3(1), dim3(1), stream, flag,
                reinterpret_cast<long long*>(counter));
}

}  // namespace shardmuon
