// The collectives of shardmuon_comm_callbacks over MPI, as a framework bridges its own process
// group (the PyTorch front end does the same over gloo). Host buffers go to MPI directly.
// Device buffers are staged through host memory once the call's stream has finished: slow,
// but any number of ranks can then share one GPU, so the distributed CUDA paths are checked
// against the single-rank result without NCCL too (over NCCL, ranks share a GPU only with a
// host id each: scripts/rank_host_id.sh).
#pragma once

#include <mpi.h>

#include "shardmuon/shardmuon.h"

namespace shardmuon_test {

class MpiCallbacks {
 public:
  // Duplicates `group`, so the callbacks' messages never match the tests' own checks.
  MpiCallbacks(MPI_Comm group, bool device_memory);
  ~MpiCallbacks();
  MpiCallbacks(const MpiCallbacks&) = delete;
  MpiCallbacks& operator=(const MpiCallbacks&) = delete;

  // The table for shardmuon_comm_create_callbacks; `this` must outlive the handle.
  shardmuon_comm_callbacks table();

 private:
  static int all_reduce_sum(void* self, void* buffer, int64_t count, shardmuon_dtype dtype,
                            void* stream);
  static int all_gather(void* self, void* buffer, size_t block_bytes, void* stream);
  static int all_to_all(void* self, const void* send, const size_t* send_bytes,
                        const size_t* send_offsets, void* recv, const size_t* recv_bytes,
                        const size_t* recv_offsets, void* stream);
  static int agree_max(void* self, int64_t* values, int count);

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool device_memory_ = false;
  int rank_ = 0, size_ = 1;
};

}  // namespace shardmuon_test
