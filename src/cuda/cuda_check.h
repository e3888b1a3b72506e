// Turns CUDA runtime errors into shardmuon errors that name the failed call.
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace shardmuon {

inline void check_cuda(cudaError_t code, const char* what) {
  if (code == cudaSuccess) return;
  // Reset the runtime's last-error record, so a later cudaGetLastError() after a kernel
  // launch does not report this (non-sticky) failure again.
  cudaGetLastError();
  const shardmuon_status status =
      code == cudaErrorMemoryAllocation ? SHARDMUON_ERROR_OUT_OF_MEMORY : SHARDMUON_ERROR_CUDA;
  fail(status, what, " failed: ", cudaGetErrorName(code), " (", cudaGetErrorString(code), ")");
}

// Makes a device current for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace shardmuon

#define SHARDMUON_CUDA(call) ::shardmuon::check_cuda((call), #call)
