// The GPU unit tests skip where no CUDA device is present (CI has none).
#pragma once

#include <cuda_runtime_api.h>

namespace shardmuon {

// Whether a CUDA device is present; the failed query's error is cleared, so that it does not
// surface in a later call's cudaGetLastError.
inline bool cuda_device_available() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace shardmuon
