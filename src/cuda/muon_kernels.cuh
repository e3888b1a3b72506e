// Launchers of the fused elementwise passes of a Muon step. Kernels stay in the .cu.
#pragma once

#include <cuda_runtime_api.h>

#include "core/backend.h"

namespace shardmuon {

void momentum_pass_cuda(const MomentumPass& pass, cudaStream_t stream);
void update_pass_cuda(void* param, const void* update, shardmuon_dtype dtype, int64_t count,
                      double decay, double step_size, cudaStream_t stream);

}  // namespace shardmuon
