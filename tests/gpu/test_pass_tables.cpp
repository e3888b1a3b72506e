// The elementwise passes of a step take lists, and the CUDA backend runs the passes of one
// kind in one launch, each with its own range of blocks (src/cuda/muon_kernels.cu). Here
// hundreds of passes of every kind (dtypes, Nesterov, L2 decay, in place or not, a learning
// rate on the device or not, aligned or not, sizes from 0 to 70001 elements, so that a pass
// spans many blocks and ends in a remainder), more of one kind than a launch's table holds,
// run three ways: all in one call, each in a call of its own (a launch each), and on the CPU
// backend. The first two must agree bitwise (the tables only decide which block does what);
// the CUDA results must match the CPU's within a rounding of the storage dtype (the GPU fuses
// multiply-adds), and the flags and the skipped-parameter count exactly. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"
#include "gpu_available.h"

namespace shardmuon {
namespace {

enum Array { kGrad, kParam, kMomentum, kNewMomentum, kUpdate, kArrays };

// What pass p does, a function of p alone. With `mixed` false every pass is of one kind
// (float32, Nesterov, aligned), so that one kernel gets more passes than a table holds.
struct PassSpec {
  int64_t count = 0;
  shardmuon_dtype state = SHARDMUON_FLOAT32, update = SHARDMUON_FLOAT32;
  int64_t misaligned = 0;  // elements past the slot's 256-byte aligned start
  bool nesterov = true, separate_momentum = false, device_lr = false;
  double l2_decay = 0.0, beta = 0.95;
  bool bad_grad = false, bad_update = false, param_flag = false;

  static PassSpec of(int p, bool mixed) {
    PassSpec spec;
    if (!mixed) {
      const int64_t sizes[] = {1, 9, 17, 1031};
      spec.count = sizes[p % 4];
      spec.bad_grad = p % 97 == 5;
      spec.bad_update = p % 89 == 3;
      spec.param_flag = p % 83 == 6;
      return spec;
    }
    const int64_t sizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 1000, 1031, 12293, 70001};
    spec.count = sizes[p % 12];
    spec.state = (p / 3) % 2 ? SHARDMUON_BFLOAT16 : SHARDMUON_FLOAT32;
    spec.update = (p / 5) % 2 ? SHARDMUON_BFLOAT16 : SHARDMUON_FLOAT32;
    spec.misaligned = p % 7 == 3 ? 1 : 0;
    spec.nesterov = p % 2 == 0;
    spec.separate_momentum = p % 4 == 1;
    spec.device_lr = p % 5 == 2;
    spec.l2_decay = p % 3 == 0 ? 0.01 : 0.0;
    spec.beta = 0.9 + 0.001 * (p % 50);
    spec.bad_grad = p % 37 == 5 && spec.count > 0;
    spec.bad_update = p % 29 == 3 && spec.count > 0;
    spec.param_flag = p % 13 == 6;
    return spec;
  }
  size_t element(Array array) const {
    const shardmuon_dtype dtype = array == kUpdate ? update : state;
    return dtype == SHARDMUON_BFLOAT16 ? 2 : 4;
  }
};

float decode(const unsigned char* bytes, size_t element) {
  uint32_t bits = 0;
  if (element == 2) {
    uint16_t half = 0;
    std::memcpy(&half, bytes, 2);
    bits = uint32_t{half} << 16;
  } else {
    std::memcpy(&bits, bytes, 4);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

void encode(float value, unsigned char* bytes, size_t element) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (element == 2) {
    const uint16_t half = static_cast<uint16_t>(bits >> 16);  // exact: values are bf16 already
    std::memcpy(bytes, &half, 2);
  } else {
    std::memcpy(bytes, &bits, 4);
  }
}

// Every array of every pass, in slots of one host buffer per array; flags (one per pass, then
// the step's), the skipped-parameter counter and a learning rate after them in `status`.
struct State {
  std::vector<PassSpec> specs;
  std::vector<size_t> slots;  // bytes from an array's start
  std::array<std::vector<unsigned char>, kArrays> arrays;
  std::vector<unsigned char> status;

  size_t flags_at() const { return 0; }
  size_t counter_at() const { return (specs.size() + 1 + 1) / 2 * 8; }  // 8-byte aligned
  size_t lr_at() const { return counter_at() + 8; }

  static State make(int passes, bool mixed) {
    State state;
    size_t offset = 0;
    for (int p = 0; p < passes; ++p) {
      state.specs.push_back(PassSpec::of(p, mixed));
      state.slots.push_back(offset);
      offset += (state.specs.back().count * 4 + 16 + 255) / 256 * 256;
    }
    uint32_t seed = 12345;
    auto next = [&seed] {  // a bf16-exact value in [-1, 1)
      seed = seed * 1664525u + 1013904223u;
      const float value = static_cast<float>(seed >> 8) / 8388608.0f - 1.0f;
      uint32_t bits;
      std::memcpy(&bits, &value, 4);
      bits &= 0xffff0000u;
      float rounded;
      std::memcpy(&rounded, &bits, 4);
      return rounded;
    };
    for (int a = 0; a < kArrays; ++a) {
      state.arrays[a].assign(offset, 0);
      for (size_t p = 0; p < state.specs.size(); ++p) {
        const PassSpec& spec = state.specs[p];
        const size_t element = spec.element(static_cast<Array>(a));
        for (int64_t i = 0; i < spec.count; ++i) {
          encode(next(), state.at(static_cast<Array>(a), p, i), element);
        }
      }
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    for (size_t p = 0; p < state.specs.size(); ++p) {
      const PassSpec& spec = state.specs[p];
      if (spec.bad_grad) encode(nan, state.at(kGrad, p, spec.count - 1), spec.element(kGrad));
      if (spec.bad_update) encode(inf, state.at(kUpdate, p, spec.count / 2), spec.element(kUpdate));
    }
    state.status.assign(state.lr_at() + 8, 0);
    for (size_t p = 0; p < state.specs.size(); ++p) {
      const float flag = state.specs[p].param_flag ? 1.0f : 0.0f;
      std::memcpy(state.status.data() + p * 4, &flag, 4);
    }
    const float lr = 0.02f;
    std::memcpy(state.status.data() + state.lr_at(), &lr, 4);
    return state;
  }

  unsigned char* at(Array a, size_t p, int64_t i) {
    const PassSpec& spec = specs[p];
    return arrays[a].data() + slots[p] + (spec.misaligned + i) * spec.element(a);
  }
};

// Where a State lives for one backend (host memory as it is, or a device copy).
struct Placed {
  std::array<char*, kArrays> arrays{};
  char* status = nullptr;
  std::vector<void*> device_buffers;  // freed at the end

  ~Placed() {
    for (void* buffer : device_buffers) cudaFree(buffer);
  }
};

std::unique_ptr<Placed> place(State& state, bool on_device) {
  auto placed = std::make_unique<Placed>();
  auto put = [&](std::vector<unsigned char>& bytes) -> char* {
    if (!on_device) return reinterpret_cast<char*>(bytes.data());
    void* buffer = nullptr;
    EXPECT_EQ(cudaMalloc(&buffer, bytes.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(buffer, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    placed->device_buffers.push_back(buffer);
    return static_cast<char*>(buffer);
  };
  for (int a = 0; a < kArrays; ++a) placed->arrays[a] = put(state.arrays[a]);
  placed->status = put(state.status);
  return placed;
}

// The state after a run on the device, read back.
void read_back(State& state, const Placed& placed) {
  for (int a = 0; a < kArrays; ++a) {
    EXPECT_EQ(cudaMemcpy(state.arrays[a].data(), placed.arrays[a], state.arrays[a].size(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  EXPECT_EQ(
      cudaMemcpy(state.status.data(), placed.status, state.status.size(), cudaMemcpyDeviceToHost),
      cudaSuccess);
}

char* pointer(const State& state, const Placed& placed, Array a, size_t p) {
  const PassSpec& spec = state.specs[p];
  return placed.arrays[a] + state.slots[p] + spec.misaligned * spec.element(a);
}

// One kind of pass over every pass of a state: issue(backend, state, placed, together) makes
// the calls (all passes in one list, or each in a list of its own).
using Issue = std::function<void(Backend&, const State&, const Placed&, bool together)>;

// The state after `issue` on the CPU backend, on the CUDA backend in one call, and on the
// CUDA backend one pass per call.
struct Outcomes {
  State cpu, together, apart;
};

Outcomes run_three_ways(const State& initial, const Issue& issue) {
  Outcomes out{initial, initial, initial};
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0);
  {
    std::unique_ptr<Placed> placed = place(out.cpu, false);
    issue(*cpu, out.cpu, *placed, true);
  }
  for (State* state : {&out.together, &out.apart}) {
    std::unique_ptr<Placed> placed = place(*state, true);
    issue(*cuda, *state, *placed, state == &out.together);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    read_back(*state, *placed);
  }
  return out;
}

// The CUDA states agree bitwise; each matches the CPU's to a rounding of its dtype (bf16: a
// unit in the last place; float32: a few, the GPU fusing multiply-adds); flags and counter
// exactly.
void expect_agreement(const Outcomes& out, const std::string& what) {
  for (int a = 0; a < kArrays; ++a) {
    EXPECT_TRUE(out.together.arrays[a] == out.apart.arrays[a])
        << what << ": array " << a << " differs between one call and a call per pass";
  }
  EXPECT_TRUE(out.together.status == out.apart.status)
      << what << ": flags or counter differ between one call and a call per pass";
  EXPECT_TRUE(out.together.status == out.cpu.status)
      << what << ": flags or counter differ from the CPU backend's";
  int reported = 0;
  for (int a = 0; a < kArrays; ++a) {
    for (size_t p = 0; p < out.cpu.specs.size(); ++p) {
      const PassSpec& spec = out.cpu.specs[p];
      const size_t element = spec.element(static_cast<Array>(a));
      const double ulp = element == 2 ? 0x1p-7 : 0x1p-21;
      for (int64_t i = 0; i < spec.count; ++i) {
        const size_t at = out.cpu.slots[p] + (spec.misaligned + i) * element;
        const float gpu = decode(out.together.arrays[a].data() + at, element);
        const float cpu = decode(out.cpu.arrays[a].data() + at, element);
        if (gpu == cpu || (std::isnan(gpu) && std::isnan(cpu))) continue;  // infinities too
        // Relative, plus a little absolute for results near zero out of a difference of
        // values near one.
        const double tolerance =
            ulp * std::fmax(std::fabs(double{cpu}), std::fabs(double{gpu})) + 0x1p-20;
        if (!(std::fabs(double{gpu} - double{cpu}) <= tolerance) && reported++ < 5) {
          ADD_FAILURE() << what << ": array " << a << " pass " << p << " element " << i << ": CUDA "
                        << gpu << ", CPU " << cpu;
        }
      }
    }
  }
  EXPECT_EQ(reported, 0) << what << ": elements beyond the tolerance";
}

float* flag_of(const State& state, const Placed& placed, size_t p) {
  return reinterpret_cast<float*>(placed.status + state.flags_at() + p * 4);
}

// Hands `passes` to a Backend list method: all in one list, or each in a list of its own.
template <typename Pass>
void hand_over(Backend& backend, void (Backend::*method)(const std::vector<Pass>&, Stream),
               const std::vector<Pass>& passes, bool together) {
  if (together) {
    (backend.*method)(passes, nullptr);
  } else {
    for (const Pass& pass : passes) (backend.*method)({pass}, nullptr);
  }
}

void momentum_issue(Backend& backend, const State& state, const Placed& placed, bool together) {
  std::vector<MomentumPass> passes;
  for (size_t p = 0; p < state.specs.size(); ++p) {
    const PassSpec& spec = state.specs[p];
    MomentumPass pass;
    pass.grad = pointer(state, placed, kGrad, p);
    pass.param = spec.l2_decay != 0.0 ? pointer(state, placed, kParam, p) : nullptr;
    pass.momentum = pointer(state, placed, kMomentum, p);
    pass.new_momentum = spec.separate_momentum ? pointer(state, placed, kNewMomentum, p) : nullptr;
    pass.update = pointer(state, placed, kUpdate, p);
    pass.dtype = spec.state;
    pass.update_dtype = spec.update;
    pass.count = spec.count;
    pass.beta = spec.beta;
    pass.nesterov = spec.nesterov;
    pass.l2_decay = spec.l2_decay;
    pass.nonfinite_flag = flag_of(state, placed, p);
    passes.push_back(pass);
  }
  hand_over(backend, &Backend::momentum_passes, passes, together);
}

DeviceLearningRate rate_of(const State& state, const Placed& placed, const PassSpec& spec) {
  DeviceLearningRate rate;
  if (spec.device_lr) {
    rate.lr = reinterpret_cast<const float*>(placed.status + state.lr_at());
    rate.decay_per_lr = 0.1;
    rate.step_size_per_lr = 3.0;
  }
  return rate;
}

void update_issue(Backend& backend, const State& state, const Placed& placed, bool together) {
  std::vector<UpdatePass> passes;
  for (size_t p = 0; p < state.specs.size(); ++p) {
    const PassSpec& spec = state.specs[p];
    passes.push_back({pointer(state, placed, kParam, p), pointer(state, placed, kUpdate, p),
                      spec.state, spec.update, spec.count, 0.999,
                      0.05 + 0.001 * static_cast<double>(p % 7), rate_of(state, placed, spec)});
  }
  hand_over(backend, &Backend::update_passes, passes, together);
}

// The step's flag is the one after the passes' (clear: the parameters' own flags decide).
void commit_issue(Backend& backend, const State& state, const Placed& placed, bool together) {
  std::vector<CommitPass> passes;
  for (size_t p = 0; p < state.specs.size(); ++p) {
    const PassSpec& spec = state.specs[p];
    CommitPass pass;
    pass.param = pointer(state, placed, kParam, p);
    pass.update = pointer(state, placed, kUpdate, p);
    pass.momentum = pointer(state, placed, kMomentum, p);
    pass.new_momentum = pointer(state, placed, kNewMomentum, p);
    pass.dtype = spec.state;
    pass.update_dtype = spec.update;
    pass.count = spec.count;
    pass.decay = 0.999;
    pass.step_size = 0.05;
    pass.step_flag = flag_of(state, placed, state.specs.size());
    pass.param_flag = flag_of(state, placed, p);
    pass.skipped_params = reinterpret_cast<int64_t*>(placed.status + state.counter_at());
    pass.device_lr = rate_of(state, placed, spec);
    passes.push_back(pass);
  }
  hand_over(backend, &Backend::commit_passes, passes, together);
}

void finite_issue(Backend& backend, const State& state, const Placed& placed, bool together) {
  std::vector<FiniteCheck> checks;
  for (size_t p = 0; p < state.specs.size(); ++p) {
    const PassSpec& spec = state.specs[p];
    checks.push_back(
        {pointer(state, placed, kUpdate, p), spec.update, spec.count, flag_of(state, placed, p)});
  }
  hand_over(backend, &Backend::flag_nonfinite, checks, together);
}

class PassTables : public ::testing::TestWithParam<bool> {};

TEST_P(PassTables, OneCallEqualsACallPerPassAndTheCpuBackend) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const bool mixed = GetParam();
  // More passes of one kind than any table holds (1096 finite checks, fewer of the others).
  const State initial = State::make(mixed ? 480 : 1200, mixed);
  const std::string kinds = mixed ? "mixed kinds" : "one kind";

  const Outcomes momentum = run_three_ways(initial, momentum_issue);
  expect_agreement(momentum, "momentum passes, " + kinds);
  const Outcomes update = run_three_ways(initial, update_issue);
  expect_agreement(update, "update passes, " + kinds);

  // The commit's counter counts the parameters skipped for their own flag.
  const Outcomes commit = run_three_ways(initial, commit_issue);
  expect_agreement(commit, "commit passes, " + kinds);
  int64_t expected_skips = 0, skips = 0;
  for (const PassSpec& spec : initial.specs) expected_skips += spec.param_flag ? 1 : 0;
  std::memcpy(&skips, commit.together.status.data() + initial.counter_at(), 8);
  EXPECT_GT(expected_skips, 0);
  EXPECT_EQ(skips, expected_skips) << kinds;

  // The flags name exactly the passes with a bad value (and those flagged before).
  const Outcomes finite = run_three_ways(initial, finite_issue);
  expect_agreement(finite, "finite checks, " + kinds);
  for (size_t p = 0; p < initial.specs.size(); ++p) {
    const PassSpec& spec = initial.specs[p];
    float after_check = 0.0f, after_momentum = 0.0f;
    std::memcpy(&after_check, finite.together.status.data() + p * 4, 4);
    std::memcpy(&after_momentum, momentum.together.status.data() + p * 4, 4);
    EXPECT_EQ(after_check, spec.bad_update || spec.param_flag ? 1.0f : 0.0f) << "pass " << p;
    EXPECT_EQ(after_momentum, spec.bad_grad || spec.param_flag ? 1.0f : 0.0f) << "pass " << p;
  }
}

std::string kind_name(const ::testing::TestParamInfo<bool>& param) {
  return param.param ? "Mixed" : "OneKind";
}
INSTANTIATE_TEST_SUITE_P(Kinds, PassTables, ::testing::Values(true, false), kind_name);

}  // namespace
}  // namespace shardmuon
