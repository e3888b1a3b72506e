// GEMMs through cuBLASLt with cached plans: the descriptors, layouts and the algorithm
// the heuristic picked are made once per distinct call shape, so a steady-state call does
// no host-side setup beyond a map lookup.
#pragma once

#include <cublasLt.h>

#include <array>
#include <map>
#include <memory>

#include "core/backend.h"
#include "cuda/cuda_handles.h"

namespace shardmuon {

class CublasLtGemm {
 public:
  CublasLtGemm();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  void run(const GemmCall& call, cudaStream_t stream);

 private:
  struct Plan;
  // transpose flags, m, n, k, leading dims, types, the alignment of each pointer (the
  // heuristic may pick vectorized kernels only for aligned operands), the SM count, the
  // batch with its strides, and whether the batch is read from pointer arrays.
  using PlanKey = std::array<int64_t, 21>;

  const Plan& plan_for(const GemmCall& call, bool pointer_arrays, int64_t alignment_a,
                       int64_t alignment_b, int64_t alignment_cd);
  void run_plan(const Plan& plan, const GemmCall& call, const void* a, const void* b, const void* c,
                void* d, cudaStream_t stream);
  // A call with a list of products: pointer arrays filled on the stream, as few launches as
  // the arrays' capacity allows.
  void run_list(const GemmCall& call, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  UniqueDeviceMemory workspace_;
  size_t workspace_bytes_ = 0;
  // The pointer arrays of list calls, kPointerCapacity entries per operand. One set serves
  // every list call: the calls' launches are ordered on their stream (every product of a
  // library call runs on the call's stream), so a fill never overtakes the product before it.
  static constexpr int64_t kPointerCapacity = 16384;
  UniqueDeviceMemory pointer_arrays_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace shardmuon
