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
  // heuristic may pick vectorized kernels only for aligned operands), the SM count, and the
  // batch with its strides.
  using PlanKey = std::array<int64_t, 20>;

  const Plan& plan_for(const GemmCall& call);

  cublasLtHandle_t handle_ = nullptr;
  UniqueDeviceMemory workspace_;
  size_t workspace_bytes_ = 0;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace shardmuon
