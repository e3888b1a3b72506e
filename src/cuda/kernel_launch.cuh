// Kernel launches, each checked by its own result.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/cuda_check.h"

namespace shardmuon {

// kernel<<<grid, block, 0, stream>>>(args...), checked by what cudaLaunchKernelEx returns for
// this launch. cudaGetLastError() after a <<<>>> launch would instead return (and clear) any
// earlier failure that the caller's own code left unread, a failed cudaMalloc it recovered
// from say, and report it as this kernel's.
template <typename... Params, typename... Args>
void launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  const cudaError_t code = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (code != cudaSuccess) check_cuda(code, (std::string(name) + " launch").c_str());
}

}  // namespace shardmuon
