// Launchers of the fused elementwise passes of a Muon step. Kernels stay in the .cu.
#pragma once

#include <cuda_runtime_api.h>

#include "core/backend.h"

namespace shardmuon {

void momentum_pass_cuda(const MomentumPass& pass, cudaStream_t stream);
void commit_pass_cuda(const CommitPass& pass, cudaStream_t stream);
void flag_nonfinite_cuda(const void* x, shardmuon_dtype dtype, int64_t count, float* flag,
                         cudaStream_t stream);
void count_if_flagged_cuda(const float* flag, int64_t* counter, cudaStream_t stream);
void update_pass_cuda(void* param, shardmuon_dtype param_dtype, const void* update,
                      shardmuon_dtype update_dtype, int64_t count, double decay, double step_size,
                      const DeviceLearningRate& device_lr, cudaStream_t stream);

}  // namespace shardmuon
