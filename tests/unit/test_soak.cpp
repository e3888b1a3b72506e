// Soak: 10,000 Muon steps on small replicated shapes on one rank through the C API, with the
// hyperparameters changing every step and the shapes and dtypes every 500 steps (each time
// with a new context and communicator), checked at intervals against the float64 oracle. Memory
// must stay flat: the workspace is bounded by the largest shape, and the process does not grow
// (checked here without AddressSanitizer, whose quarantine holds freed memory; with it,
// LeakSanitizer checks for leaks at exit).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "../common/reference.h"
#include "shardmuon/shardmuon.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define SHARDMUON_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SHARDMUON_UNDER_ASAN 1
#endif
#endif

namespace shardmuon_test {
namespace {

long resident_kilobytes() {
  long pages = 0, resident = 0;
  FILE* file = std::fopen("/proc/self/statm", "r");
  if (file == nullptr) return 0;
  if (std::fscanf(file, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(file);
  return resident * 4;
}

TEST(Soak, TenThousandStepsWithChangingShapesAndHyperparameters) {
  constexpr int kSteps = 10000, kEpoch = 500;
  const int64_t shapes[][2] = {{17, 29}, {40, 12}, {1, 33}, {25, 25}, {9, 64}};
  [[maybe_unused]] long resident_after_warmup = 0;
  size_t largest_workspace = 0;
  int checked = 0;
  for (int epoch = 0; epoch < kSteps / kEpoch; ++epoch) {
    shardmuon::Context context(SHARDMUON_BACKEND_CPU);
    shardmuon::Comm comm = shardmuon::Comm::self();
    const int64_t rows = shapes[epoch % 5][0], cols = shapes[epoch % 5][1];
    const shardmuon_dtype dtype = epoch % 2 ? SHARDMUON_FLOAT32 : SHARDMUON_FLOAT64;
    const Matrix w0 = random_gaussian(rows, cols, epoch);
    std::vector<double> w = w0.values, m(w.size(), 0.0);
    std::vector<unsigned char> w_bytes = to_bytes(w, dtype), m_bytes = to_bytes(m, dtype);
    Matrix w_ref = rounded_to(w0, dtype), m_ref(rows, cols);
    shardmuon_muon_group group = shardmuon::default_muon_group();
    shardmuon_muon_param param{};
    param.param = w_bytes.data();
    param.momentum = m_bytes.data();
    param.dtype = dtype;
    param.layout = shardmuon_layout{rows, cols, SHARDMUON_REPLICATED, 1, nullptr};
    for (int step = 0; step < kEpoch; ++step) {
      const Matrix g =
          rounded_to(random_gaussian(rows, cols, 100000 + epoch * kEpoch + step), dtype);
      const std::vector<unsigned char> g_bytes = to_bytes(g.values, dtype);
      param.grad = g_bytes.data();
      group.lr = 0.01 * (1 + step % 7);
      group.momentum = 0.8 + 0.02 * (step % 5);
      group.nesterov = step % 2;
      group.weight_decay_mode = static_cast<shardmuon_weight_decay>(step % 4);
      group.scale_mode = static_cast<shardmuon_scale_mode>((step / 4) % 4);
      ASSERT_EQ(shardmuon_muon_step(context.get(), comm.get(), &param, 1, &group, 1, nullptr),
                SHARDMUON_SUCCESS)
          << shardmuon_last_error();
      // The oracle follows every step of the first 20 of each epoch (it is slow to keep up).
      if (step < 20) {
        ReferenceGroup r;
        r.lr = group.lr;
        r.momentum = group.momentum;
        r.nesterov = group.nesterov;
        r.weight_decay = group.weight_decay;
        r.weight_decay_mode = group.weight_decay_mode;
        r.scale_mode = group.scale_mode;
        r.coefficients = coefficients_for(SHARDMUON_SCHEDULE_QUINTIC, 5);
        reference_muon_step(w_ref, g, m_ref, r);
        if (step == 19) {
          const std::vector<double> ours = from_bytes(w_bytes, dtype);
          double diff = 0, norm = 0;
          for (size_t i = 0; i < ours.size(); ++i) {
            diff += (ours[i] - w_ref.values[i]) * (ours[i] - w_ref.values[i]);
            norm += w_ref.values[i] * w_ref.values[i];
          }
          EXPECT_LT(std::sqrt(diff / norm), dtype == SHARDMUON_FLOAT64 ? 1e-10 : 1e-4)
              << "epoch " << epoch;
          ++checked;
        }
      }
    }
    for (double v : from_bytes(w_bytes, dtype)) ASSERT_TRUE(std::isfinite(v));
    largest_workspace = std::max(largest_workspace, context.workspace_bytes());
    if (epoch == 4) resident_after_warmup = resident_kilobytes();
  }
  EXPECT_EQ(checked, kSteps / kEpoch);
  EXPECT_LT(largest_workspace, size_t{1} << 20);  // small shapes, small workspace
#ifndef SHARDMUON_UNDER_ASAN
  const long growth = resident_kilobytes() - resident_after_warmup;
  std::printf("soak: resident memory after 5 epochs %ld kB, growth since %ld kB\n",
              resident_after_warmup, growth);
  EXPECT_LT(growth, 4096) << "kB of growth over 15 epochs";
#endif
}

// Contexts and communicators made and destroyed many times, also after errors.
TEST(Soak, HandlesSurviveManyCreateDestroyCyclesAndErrors) {
  for (int i = 0; i < 2000; ++i) {
    shardmuon_context_t context = nullptr;
    shardmuon_comm_t comm = nullptr;
    ASSERT_EQ(shardmuon_context_create(SHARDMUON_BACKEND_CPU, 0, &context), SHARDMUON_SUCCESS);
    ASSERT_EQ(shardmuon_comm_create_self(&comm), SHARDMUON_SUCCESS);
    float data[6] = {1, 2, 3, 4, 5, 6};
    shardmuon_layout layout{2, 3, SHARDMUON_REPLICATED, 1, nullptr};
    shardmuon_ns_options options;
    shardmuon_ns_options_default(&options);
    options.num_iterations = i % 3;  // 0 is an error, left behind on purpose
    shardmuon_newton_schulz(context, comm, data, SHARDMUON_FLOAT32, &layout, &options, nullptr);
    // Destroy in either order.
    if (i % 2) {
      ASSERT_EQ(shardmuon_comm_destroy(comm), SHARDMUON_SUCCESS);
      ASSERT_EQ(shardmuon_context_destroy(context), SHARDMUON_SUCCESS);
    } else {
      ASSERT_EQ(shardmuon_context_destroy(context), SHARDMUON_SUCCESS);
      ASSERT_EQ(shardmuon_comm_destroy(comm), SHARDMUON_SUCCESS);
    }
  }
}

}  // namespace
}  // namespace shardmuon_test
