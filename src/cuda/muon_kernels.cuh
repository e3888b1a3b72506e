// Launchers of the fused elementwise passes of a Muon step. Kernels stay in the .cu.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "core/backend.h"

namespace shardmuon {

// Every pass of a list, those of one kind (dtypes, template switches) in one launch per up to
// a few hundred passes (Backend::momentum_passes and the others).
void momentum_passes_cuda(const std::vector<MomentumPass>& passes, cudaStream_t stream);
void update_passes_cuda(const std::vector<UpdatePass>& passes, cudaStream_t stream);
void commit_passes_cuda(const std::vector<CommitPass>& passes, cudaStream_t stream);
void flag_nonfinite_cuda(const std::vector<FiniteCheck>& checks, cudaStream_t stream);
void mark_if_set_cuda(const float* flag, float* mark, cudaStream_t stream);
void count_if_flagged_cuda(const float* flag, int64_t* counter, cudaStream_t stream);

}  // namespace shardmuon
