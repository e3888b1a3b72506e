// Entry points of the optional parts (CUDA, NCCL, MPI) for builds without them: the same
// symbols exist and fail with NOT_BUILT.
#include "comm/factories.h"
#include "core/error.h"
#include "cuda/cuda_backend.h"

namespace shardmuon {

#ifndef SHARDMUON_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  fail(SHARDMUON_ERROR_NOT_BUILT, "shardmuon was built without CUDA (SHARDMUON_WITH_CUDA=OFF)");
}

bool is_device_only_memory(const void*) {
  return false;
}
#endif

#ifndef SHARDMUON_WITH_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(void*) {
  fail(SHARDMUON_ERROR_NOT_BUILT, "shardmuon was built without NCCL (SHARDMUON_WITH_NCCL=OFF)");
}
#endif

#ifndef SHARDMUON_WITH_MPI
std::unique_ptr<Communicator> make_mpi_communicator(const void*) {
  fail(SHARDMUON_ERROR_NOT_BUILT, "shardmuon was built without MPI (SHARDMUON_WITH_MPI=OFF)");
}
#endif

}  // namespace shardmuon
