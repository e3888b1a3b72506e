// GEMMs through cuBLASLt with cached plans: the descriptors, layouts and the algorithm
// the heuristic picked are made once per distinct call shape, so a steady-state call does
// no host-side setup beyond a map lookup.
#pragma once

#include <cublasLt.h>

#include <array>
#include <map>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "cuda/cuda_handles.h"
#include "cuda/elementwise.cuh"

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
  // The heuristic's first algorithm for the plan's operation within a workspace limit; false
  // if it has none.
  bool heuristic_choice(const Plan& plan, size_t workspace_limit, const uint32_t (&alignments)[4],
                        cublasLtMatmulAlgo_t& algorithm) const;
  void run_plan(const Plan& plan, const GemmCall& call, const void* a, const void* b, const void* c,
                void* d, cudaStream_t stream);
  // A call with a list of products: pointer arrays filled on the stream, as few launches as
  // the arrays' capacity allows.
  void run_list(const GemmCall& call, cudaStream_t stream);
  // Where the pointer arrays of one launch lie (a, b, c, d), filled there if they must be: the
  // products' operands (C's read from D where c_is_d), each a strided batch of `batch`
  // matrices `strides` bytes apart.
  void pointer_arrays_for(const GemmOperands* products, int64_t count, int64_t batch,
                          const int64_t (&strides)[4], bool c_is_d, cudaStream_t stream,
                          void** arrays[4]);

  cublasLtHandle_t handle_ = nullptr;
  UniqueDeviceMemory workspace_;
  size_t workspace_bytes_ = 0;
  // The pointer arrays of list calls, kPointerCapacity entries per operand. One set serves
  // every list call: the calls' launches are ordered on their stream (every product of a
  // library call runs on the call's stream), so a fill never overtakes the product before it.
  static constexpr int64_t kPointerCapacity = 16384;
  UniqueDeviceMemory pointer_arrays_;
  // Pointer arrays kept for reuse: a launch whose products and batch an earlier uncaptured
  // launch had finds its arrays filled already, and skips the fill (a kernel and the gap after
  // it, about 3 us on an H200; ten per 4096^2 Newton-Schulz). Entries are written once and never
  // again, so a captured graph may read them too; once kKeptCapacity entries per operand are
  // used, new lists are filled into the arrays above at every launch. Keyed by the launch's
  // batch, strides and operand pointers.
  static constexpr int64_t kKeptCapacity = 65536;
  UniqueDeviceMemory kept_arrays_;
  int64_t kept_used_ = 0;
  std::map<std::vector<int64_t>, int64_t> kept_offsets_;
  std::vector<int64_t> key_scratch_;  // a launch's key into kept_offsets_
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace shardmuon
