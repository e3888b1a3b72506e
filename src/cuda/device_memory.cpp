// Whether a pointer is device-only memory, for the CPU backend's argument checks in a library
// built with CUDA. The driver answers (cuPointerGetAttribute); its functions are taken through
// the runtime's entry points, so the library does not link libcuda, which machines without a
// GPU lack. The runtime's own cudaPointerGetAttributes is not used: it would create the
// current device's primary context, hundreds of MiB of device memory in a CPU-only process.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda/cuda_backend.h"

namespace shardmuon {
namespace {

struct Driver {
  decltype(&cuPointerGetAttribute) pointer_attribute = nullptr;
  decltype(&cuDeviceGetCount) device_count = nullptr;
  decltype(&cuDeviceGet) device = nullptr;
  decltype(&cuDevicePrimaryCtxGetState) primary_context_state = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) retain_primary_context = nullptr;
  decltype(&cuDevicePrimaryCtxRelease) release_primary_context = nullptr;
  decltype(&cuCtxPushCurrent) push_context = nullptr;
  decltype(&cuCtxPopCurrent) pop_context = nullptr;
  bool loaded = false;
};

template <typename Function>
bool load(const char* symbol, Function& function) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &address, CUDART_VERSION, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // no driver or no device: not an error of any later call
    return false;
  }
  function = reinterpret_cast<Function>(address);
  return true;
}

Driver load_driver() {
  Driver driver;
  driver.loaded =
      load("cuPointerGetAttribute", driver.pointer_attribute) &&
      load("cuDeviceGetCount", driver.device_count) && load("cuDeviceGet", driver.device) &&
      load("cuDevicePrimaryCtxGetState", driver.primary_context_state) &&
      load("cuDevicePrimaryCtxRetain", driver.retain_primary_context) &&
      load("cuDevicePrimaryCtxRelease", driver.release_primary_context) &&
      load("cuCtxPushCurrent", driver.push_context) && load("cuCtxPopCurrent", driver.pop_context);
  return driver;
}

enum class Kind { device_only, host_readable, unknown };

Kind ask(const Driver& driver, CUdeviceptr address) {
  unsigned int type = 0;
  const CUresult asked = driver.pointer_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address);
  // The driver may not answer on a thread where no context is current.
  if (asked == CUDA_ERROR_INVALID_CONTEXT) return Kind::unknown;
  // Memory CUDA does not know (plain host memory) is CUDA_ERROR_INVALID_VALUE.
  if (asked != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE) return Kind::host_readable;
  // Managed memory reports the device type too, and the host may read it.
  int managed = 0;
  if (driver.pointer_attribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, address) !=
      CUDA_SUCCESS) {
    return Kind::unknown;
  }
  return managed != 0 ? Kind::host_readable : Kind::device_only;
}

// Asks under a primary context the process already has: the runtime's memory belongs to those,
// and in the unified address space any context answers for all of it. A device whose primary
// context is not active is passed over, never given one.
Kind ask_under_an_active_primary_context(const Driver& driver, CUdeviceptr address) {
  int count = 0;
  if (driver.device_count(&count) != CUDA_SUCCESS) return Kind::unknown;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    CUdevice device = 0;
    unsigned int flags = 0;
    int active = 0;
    if (driver.device(&device, ordinal) != CUDA_SUCCESS ||
        driver.primary_context_state(device, &flags, &active) != CUDA_SUCCESS || active == 0) {
      continue;
    }
    CUcontext context = nullptr;
    if (driver.retain_primary_context(&context, device) != CUDA_SUCCESS) continue;
    Kind kind = Kind::unknown;
    if (driver.push_context(context) == CUDA_SUCCESS) {
      kind = ask(driver, address);
      CUcontext popped = nullptr;
      driver.pop_context(&popped);
    }
    driver.release_primary_context(device);
    if (kind != Kind::unknown) return kind;
  }
  return Kind::unknown;
}

}  // namespace

bool is_device_only_memory(const void* pointer) {
  static const Driver driver = load_driver();
  if (!driver.loaded) return false;
  const auto address = reinterpret_cast<CUdeviceptr>(pointer);
  Kind kind = ask(driver, address);
  // This thread has no current context (it has made no CUDA call, as a fresh worker thread).
  if (kind == Kind::unknown) kind = ask_under_an_active_primary_context(driver, address);
  return kind == Kind::device_only;
}

}  // namespace shardmuon
