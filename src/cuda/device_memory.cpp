// Whether a pointer is device-only memory, for the CPU backend's argument checks in a library
// built with CUDA. The driver answers (cuPointerGetAttributes), and only where the process has
// loaded it already: without libcuda loaded there is no CUDA context and so no device memory.
// Neither the driver nor the runtime is ever started from here; the runtime's own
// cudaPointerGetAttributes would create the current device's primary context, hundreds of
// MiB of device memory in a CPU-only process. The library does not link libcuda, which
// machines without a GPU lack.
#include <cuda.h>
#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <mutex>

#include "cuda/cuda_backend.h"

namespace shardmuon {
namespace {

struct Driver {
  decltype(&cuPointerGetAttributes) pointer_attributes = nullptr;
  decltype(&cuDeviceGetCount) device_count = nullptr;
  decltype(&cuDeviceGet) device = nullptr;
  decltype(&cuDevicePrimaryCtxGetState) primary_context_state = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) retain_primary_context = nullptr;
  decltype(&cuDevicePrimaryCtxRelease) release_primary_context = nullptr;
  decltype(&cuCtxPushCurrent) push_context = nullptr;
  decltype(&cuCtxPopCurrent) pop_context = nullptr;
};

// The exported name of a driver function: cuda.h maps some names to versioned ones
// (cuCtxPushCurrent to cuCtxPushCurrent_v2), and the macro's expansion is what is exported.
#define SHARDMUON_DRIVER_NAME(function) SHARDMUON_DRIVER_NAME_EXPANDED(function)
#define SHARDMUON_DRIVER_NAME_EXPANDED(function) #function

template <typename Function>
bool resolve(void* library, const char* name, Function& function) {
  function = reinterpret_cast<Function>(dlsym(library, name));
  return function != nullptr;
}

// Whether the process has loaded libcuda (any libcuda.so*): a walk over the names of the loaded
// objects, a fraction of a microsecond. dlopen with RTLD_NOLOAD of a library that is not
// loaded searches the file system for it first: 114 us a call, measured here, on every pointer
// of every CPU step.
bool driver_is_loaded() {
  const auto is_the_driver = [](dl_phdr_info* info, size_t, void*) {
    const char* slash = std::strrchr(info->dlpi_name, '/');
    const char* file = slash == nullptr ? info->dlpi_name : slash + 1;
    return std::strncmp(file, "libcuda.so", std::strlen("libcuda.so")) == 0 ? 1 : 0;
  };
  return dl_iterate_phdr(is_the_driver, nullptr) != 0;
}

// The driver's functions once the process has loaded libcuda (RTLD_NOLOAD: never loaded from
// here), null until then. The reference that dlopen takes is kept, so that they stay valid.
const Driver* loaded_driver() {
  static std::mutex mutex;
  static Driver driver;
  static bool found = false;
  const std::lock_guard<std::mutex> lock(mutex);
  if (found) return &driver;
  if (!driver_is_loaded()) return nullptr;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return nullptr;
#define SHARDMUON_RESOLVE(member, function) \
  resolve(library, SHARDMUON_DRIVER_NAME(function), driver.member)
  found = SHARDMUON_RESOLVE(pointer_attributes, cuPointerGetAttributes) &&
          SHARDMUON_RESOLVE(device_count, cuDeviceGetCount) &&
          SHARDMUON_RESOLVE(device, cuDeviceGet) &&
          SHARDMUON_RESOLVE(primary_context_state, cuDevicePrimaryCtxGetState) &&
          SHARDMUON_RESOLVE(retain_primary_context, cuDevicePrimaryCtxRetain) &&
          SHARDMUON_RESOLVE(release_primary_context, cuDevicePrimaryCtxRelease) &&
          SHARDMUON_RESOLVE(push_context, cuCtxPushCurrent) &&
          SHARDMUON_RESOLVE(pop_context, cuCtxPopCurrent);
#undef SHARDMUON_RESOLVE
  if (!found) dlclose(library);  // a driver without these: the check passes, as without CUDA
  return found ? &driver : nullptr;
}

enum class Kind { device_only, host_readable, unknown };

// The plural cuPointerGetAttributes, not cuPointerGetAttribute: for memory CUDA does not know
// (plain host memory) it succeeds with a memory type of 0, where the singular fails with
// CUDA_ERROR_INVALID_VALUE, an error that compute-sanitizer reports as the program's own on
// every host pointer checked (measured on an H200, driver 580, docs/GPU_RUNS.md).
Kind ask(const Driver& driver, CUdeviceptr address) {
  unsigned int type = 0;
  int managed = 0;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                      CU_POINTER_ATTRIBUTE_IS_MANAGED};
  void* values[] = {&type, &managed};
  const CUresult asked = driver.pointer_attributes(2, attributes, values, address);
  // The driver may not answer on a thread where no context is current.
  if (asked == CUDA_ERROR_INVALID_CONTEXT) return Kind::unknown;
  if (asked != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE) return Kind::host_readable;
  // Managed memory reports the device type too, and the host may read it.
  return managed != 0 ? Kind::host_readable : Kind::device_only;
}

// Asks under a primary context the process already has: the runtime's memory belongs to those,
// and in the unified address space any context answers for all of it. A device whose primary
// context is not active is passed over, never given one. Should another thread release the
// context's last reference between the state query and the retain, the retain creates it anew
// and the release below, the last reference again, resets it: the race costs time, and leaves
// no context behind.
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
  const Driver* driver = loaded_driver();
  if (driver == nullptr) return false;
  const auto address = reinterpret_cast<CUdeviceptr>(pointer);
  Kind kind = ask(*driver, address);
  // This thread has no current context (it has made no CUDA call, as a fresh worker thread).
  if (kind == Kind::unknown) kind = ask_under_an_active_primary_context(*driver, address);
  return kind == Kind::device_only;
}

}  // namespace shardmuon
