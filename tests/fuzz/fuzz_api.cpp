// libFuzzer target: the C API's argument validation. Each input is decoded into one call of
// shardmuon_newton_schulz or shardmuon_muon_step (CPU backend, one rank) with fuzzed shapes,
// layouts, shard sizes, dtypes, schedules, coefficients, eps, pointers (NULL, aligned,
// misaligned) and hyperparameters. The call must not crash, must return a known status, and
// when it fails, must leave every buffer bit-identical.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "shardmuon/shardmuon.h"

namespace {

// Reads typed values off the input, zeros once it runs out.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T take() {
    T value{};
    const size_t n = std::min(sizeof(T), size_ - std::min(size_, at_));
    if (n > 0) std::memcpy(&value, data_ + at_, n);
    at_ += sizeof(T);
    return value;
  }
  int small(int low, int high) {
    return low + static_cast<int>(take<uint8_t>() % (high - low + 1));
  }
  double number() {
    switch (take<uint8_t>() % 6) {
      case 0: return std::nan("");
      case 1: return INFINITY;
      case 2: return -1.0;
      case 3: return 0.0;
      default: return take<double>();
    }
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

struct Fixture {
  shardmuon_context_t context = nullptr;
  shardmuon_comm_t comm = nullptr;
  Fixture() {
    if (shardmuon_context_create(SHARDMUON_BACKEND_CPU, 0, &context) != SHARDMUON_SUCCESS ||
        shardmuon_comm_create_self(&comm) != SHARDMUON_SUCCESS) {
      std::abort();
    }
  }
};

void* pointer_into(std::vector<unsigned char>& buffer, int kind) {
  switch (kind) {
    case 0: return nullptr;
    case 1: return buffer.data() + 1;  // misaligned for every dtype but one byte
    default: return buffer.data() + 8;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fixture;
  Input in(data, size);
  const bool step = in.take<uint8_t>() % 2;
  shardmuon_layout layout{};
  layout.rows = in.small(-2, 24);
  layout.cols = in.small(-2, 24);
  layout.partition = static_cast<shardmuon_partition>(in.small(-1, 4));  // 3: flat
  layout.num_shards = in.small(-1, 3);
  int64_t sizes[3] = {in.small(-3, 30), in.small(-3, 30), in.small(-3, 30)};
  if (in.take<uint8_t>() % 4 == 0) sizes[0] = layout.rows * layout.cols;  // a valid flat shard
  layout.shard_sizes = in.take<uint8_t>() % 2 ? sizes : nullptr;
  const shardmuon_dtype dtype = static_cast<shardmuon_dtype>(in.small(-1, 3));

  shardmuon_ns_options options{};
  shardmuon_ns_options_default(&options);
  options.num_iterations = in.small(-1, 6);
  options.schedule = static_cast<shardmuon_schedule>(in.small(-1, 6));
  double custom[18];
  for (double& c : custom) c = in.small(-4, 4) * 0.5;
  if (in.take<uint8_t>() % 5 == 0) custom[in.small(0, 17)] = in.number();
  options.custom_coefficients = in.take<uint8_t>() % 4 ? custom : nullptr;
  options.num_custom_coefficients = in.small(-1, 6);
  options.eps = in.take<uint8_t>() % 4 ? 1e-7 : in.number();
  options.algorithm = static_cast<shardmuon_ns_algorithm>(in.small(-1, 3));

  // Buffers large enough for any shape above, with random contents.
  const size_t bytes = 24 * 24 * 8 + 16;
  std::vector<unsigned char> param(bytes), grad(bytes), momentum(bytes);
  for (auto* buffer : {&param, &grad, &momentum}) {
    for (unsigned char& b : *buffer) b = static_cast<unsigned char>(in.take<uint8_t>() & 0x3f);
  }
  const std::vector<unsigned char> param0 = param, grad0 = grad, momentum0 = momentum;

  shardmuon_status status;
  if (!step) {
    status =
        shardmuon_newton_schulz(fixture.context, fixture.comm, pointer_into(param, in.small(0, 2)),
                                dtype, &layout, &options, nullptr);
  } else {
    shardmuon_muon_group group{};
    shardmuon_muon_group_default(&group);
    group.ns = options;
    group.lr = in.take<uint8_t>() % 3 ? 0.02 : in.number();
    group.momentum = in.take<uint8_t>() % 3 ? 0.9 : in.number();
    group.nesterov = in.small(-1, 2);
    group.weight_decay = in.take<uint8_t>() % 3 ? 0.01 : in.number();
    group.weight_decay_mode = static_cast<shardmuon_weight_decay>(in.small(-1, 4));
    group.scale_mode = static_cast<shardmuon_scale_mode>(in.small(-1, 4));
    // A learning rate in memory, or a misaligned pointer (refused before it is read).
    static float device_lr = 0.02f;
    const int lr_choice = in.small(0, 3);
    group.lr_on_device =
        lr_choice == 1 ? &device_lr
        : lr_choice == 2
            ? reinterpret_cast<const float*>(reinterpret_cast<const char*>(&device_lr) + 1)
            : nullptr;
    shardmuon_muon_param p{};
    p.param = pointer_into(param, in.small(0, 2));
    p.grad = in.take<uint8_t>() % 5 ? pointer_into(grad, in.small(0, 2)) : p.param;  // aliasing
    p.momentum = pointer_into(momentum, in.small(0, 2));
    p.dtype = dtype;
    p.layout = layout;
    p.group = in.small(-1, 1);
    p.no_grad = in.small(-1, 2);
    p.row_blocks = in.small(-1, 3);
    status = shardmuon_muon_step(fixture.context, fixture.comm, &p, in.small(0, 1), &group,
                                 in.small(0, 1), nullptr);
  }
  if (status < SHARDMUON_SUCCESS || status > SHARDMUON_ERROR_NON_FINITE) std::abort();
  if (std::strlen(shardmuon_last_error()) == 0 && status != SHARDMUON_SUCCESS) std::abort();
  if (status != SHARDMUON_SUCCESS && status != SHARDMUON_ERROR_NON_FINITE &&
      (param != param0 || grad != grad0 || momentum != momentum0)) {
    std::abort();  // a failed call modified the caller's memory
  }
  if (grad != grad0) std::abort();  // the gradient is never written
  return 0;
}
