// libFuzzer target: the C API's argument validation. Each input is decoded into one call of
// shardmuon_newton_schulz, shardmuon_muon_step, or the planner's queries of either
// (shardmuon_ns_plan*, shardmuon_ns_estimate, shardmuon_muon_plan*) (CPU backend, one rank)
// with fuzzed shapes, layouts, shard sizes, dtypes, schedules, coefficients, eps, algorithms
// (every requestable one, the reported-only ones and unknown values), group sizes, pointers
// (NULL, aligned, misaligned) and hyperparameters. The call must not crash, must return a
// known status, and when it fails, must leave every buffer bit-identical; a query never
// writes the buffers.
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

// Every choice is decoded before the buffers' contents, so that short inputs (the bytes past
// the end read as zeros) reach every call and argument.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fixture;
  Input in(data, size);
  enum class Call { kNewtonSchulz, kStep, kNsPlan, kStepPlan };
  const Call call = static_cast<Call>(in.take<uint8_t>() % 4);
  const int query = in.small(0, 3);  // which of the planner's queries
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
  // -1 .. 6 (AUTO .. GRAM_APPLIED_TWICE and unknown values on either side), or the values
  // shardmuon_ns_plan reports and a request must not name (LOCAL, ..._REDISTRIBUTED).
  const int algorithm = in.small(-1, 7);
  options.algorithm =
      static_cast<shardmuon_ns_algorithm>(algorithm == 7 ? 100 + in.small(0, 1) : algorithm);

  const size_t bytes = 24 * 24 * 8 + 16;  // large enough for any shape above
  std::vector<unsigned char> param(bytes), grad(bytes), momentum(bytes);

  // The planner's queries of one matrix.
  const int comm_size = in.small(-1, 5);
  const shardmuon_layout* layout_arg = in.take<uint8_t>() % 8 ? &layout : nullptr;
  const shardmuon_ns_options* options_arg = in.take<uint8_t>() % 8 ? &options : nullptr;

  // A step's group and parameter.
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
  const int num_params = in.small(0, 1), num_groups = in.small(0, 1);
  const bool outputs = in.take<uint8_t>() % 8 != 0;  // a step query's outputs, else NULL

  // The buffers' contents, from what is left.
  for (auto* buffer : {&param, &grad, &momentum}) {
    for (unsigned char& b : *buffer) b = static_cast<unsigned char>(in.take<uint8_t>() & 0x3f);
  }
  const std::vector<unsigned char> param0 = param, grad0 = grad, momentum0 = momentum;

  shardmuon_status status = SHARDMUON_SUCCESS;
  bool writes = false;  // whether the call may write the buffers when it succeeds
  switch (call) {
    case Call::kNewtonSchulz:
      status = shardmuon_newton_schulz(fixture.context, fixture.comm, p.param, dtype, &layout,
                                       &options, nullptr);
      writes = true;
      break;
    case Call::kStep:
      status = shardmuon_muon_step(fixture.context, fixture.comm, &p, num_params, &group,
                                   num_groups, nullptr);
      writes = true;
      break;
    case Call::kNsPlan: {
      shardmuon_ns_algorithm chosen = SHARDMUON_NS_AUTO;
      int flag = 0;
      double seconds = 0.0;
      switch (query) {
        case 0: status = shardmuon_ns_plan(layout_arg, comm_size, options_arg, &chosen); break;
        case 1:
          status = shardmuon_ns_plan_gram_iteration(layout_arg, comm_size, options_arg, &flag);
          break;
        case 2:
          status = shardmuon_ns_plan_applied_twice(layout_arg, comm_size, options_arg, &flag);
          break;
        default: status = shardmuon_ns_estimate(layout_arg, comm_size, options_arg, &seconds);
      }
      if (status == SHARDMUON_SUCCESS && (flag < 0 || flag > 1 || !(seconds >= 0.0))) {
        std::abort();
      }
      break;
    }
    case Call::kStepPlan: {
      shardmuon_ns_algorithm algorithms[1] = {SHARDMUON_NS_AUTO};
      int owners[1] = {-1}, flags[1] = {0};
      switch (query % 3) {
        case 0:
          status =
              shardmuon_muon_plan(fixture.context, fixture.comm, &p, num_params, &group, num_groups,
                                  outputs ? algorithms : nullptr, outputs ? owners : nullptr);
          break;
        case 1:
          status =
              shardmuon_muon_plan_gram_iteration(fixture.context, fixture.comm, &p, num_params,
                                                 &group, num_groups, outputs ? flags : nullptr);
          break;
        default:
          status = shardmuon_muon_plan_applied_twice(fixture.context, fixture.comm, &p, num_params,
                                                     &group, num_groups, outputs ? flags : nullptr);
      }
      // One rank owns nothing; a flag is 0 or 1.
      if (status == SHARDMUON_SUCCESS && (owners[0] != -1 || flags[0] < 0 || flags[0] > 1)) {
        std::abort();
      }
      break;
    }
  }
  if (status < SHARDMUON_SUCCESS || status > SHARDMUON_ERROR_NON_FINITE) std::abort();
  if (std::strlen(shardmuon_last_error()) == 0 && status != SHARDMUON_SUCCESS) std::abort();
  const bool unchanged = param == param0 && grad == grad0 && momentum == momentum0;
  if (!unchanged &&
      (!writes || (status != SHARDMUON_SUCCESS && status != SHARDMUON_ERROR_NON_FINITE))) {
    std::abort();  // a failed call, or a query, modified the caller's memory
  }
  if (grad != grad0) std::abort();  // the gradient is never written
  return 0;
}
