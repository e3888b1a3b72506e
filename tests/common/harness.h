// The distributed test harness: one process per rank under mpirun, the same tests on the
// CPU backend (ranks over MPI) or the CUDA backend (one GPU per rank, NCCL); or, with
// --comm=callbacks, on either backend over shardmuon_comm_callbacks backed by MPI
// (MpiCallbacks), where CUDA ranks may share a GPU. It makes one
// group for every size 1..max_group_size out of the first ranks of the world, so one
// launch checks every P. Every test's outcome is agreed across the world (see
// DistributedTest), so no rank's failure goes unseen and no rank reports alone.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mpi_callbacks.h"
#include "shardmuon/shardmuon.h"

namespace shardmuon_test {

// How the groups' shardmuon communicators move data.
enum class CommKind {
  kNative,     // MPI for the CPU backend, NCCL for the CUDA backend
  kCallbacks,  // shardmuon_comm_callbacks over MPI (MpiCallbacks)
};

struct Group {
  int size = 0;
  bool member = false;  // whether this process is one of the group's ranks
  int rank = -1;
  shardmuon_comm_t comm = nullptr;
  MPI_Comm mpi = MPI_COMM_NULL;  // the same ranks, for the tests' own checks
};

// Memory in the backend's space (host for CPU, device for CUDA).
class Buffer {
 public:
  Buffer() = default;
  Buffer(size_t bytes, bool on_device);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool on_device_ = false;
};

// A context the caller owns, destroyed with the pointer.
using OwnedContext = std::unique_ptr<shardmuon_context_s, decltype(&shardmuon_context_destroy)>;

class Harness {
 public:
  static void initialize(shardmuon_backend backend, CommKind comm_kind);
  static void shutdown();
  static Harness& get();

  shardmuon_backend backend() const { return backend_; }
  bool on_gpu() const { return backend_ == SHARDMUON_BACKEND_CUDA; }
  CommKind comm_kind() const { return comm_kind_; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int max_group_size() const { return static_cast<int>(groups_.size()); }
  const Group& group(int size) const { return groups_.at(size - 1); }
  shardmuon_context_t context() const { return context_; }
  // A context of its own on the harness's backend and device; null if it could not be made
  // (shardmuon_last_error() says why). For a test that captures a step into a CUDA graph,
  // which pins its context's workspace for good.
  OwnedContext own_context() const;
  void* stream() const { return stream_; }
  // The NCCL communicator under group(size) (CUDA runs over NCCL only).
  void* nccl_comm(int size) const { return nccl_groups_.at(size - 1); }

  // Copies to and from the backend's memory, ordered after the stream's work and done on
  // return. (A plain cudaMemcpy from pageable memory can return before its transfer lands,
  // on the legacy stream, which the harness's non-blocking stream does not wait for.)
  Buffer upload(const std::vector<unsigned char>& bytes) const;
  void upload_into(void* data, const std::vector<unsigned char>& bytes) const;
  std::vector<unsigned char> download(const Buffer& buffer) const;
  std::vector<unsigned char> download(const void* data, size_t bytes) const;
  void synchronize() const;

 private:
  shardmuon_backend backend_ = SHARDMUON_BACKEND_CPU;
  CommKind comm_kind_ = CommKind::kNative;
  int world_rank_ = 0, world_size_ = 1;
  shardmuon_context_t context_ = nullptr;
  int device_ = 0;  // the CUDA device of the context (0 for the CPU backend)
  void* stream_ = nullptr;
  void* nccl_world_ = nullptr;
  std::vector<void*> nccl_groups_;
  std::vector<Group> groups_;
  std::vector<std::unique_ptr<MpiCallbacks>> callbacks_;  // outlive the groups' handles
};

// Base of every test: after the body, the world agrees on the outcome, so a failure on any
// rank fails the test on every rank (and rank 0's summary counts it).
class DistributedTest : public ::testing::Test {
 protected:
  void TearDown() override;
};

// Runs body(group) on the members of each group of size first_size..max_group_size, every
// rank visiting the sizes in step: after each size the world agrees whether any rank has
// failed fatally (an ASSERT returns from the body), and if one has, every rank stops there
// and this returns false. Without that a failed member would leave the test while a rank
// outside its group went on to the next, larger group and waited in a collective for ranks
// that were not coming: the library's call until its timeout, the test's own MPI checks
// after it for ever.
bool for_each_group(int first_size, const std::function<void(const Group&)>& body);

// sqrt(sum (x - ref)^2 / sum ref^2) over the group's shards.
double group_relative_error(const std::vector<double>& x, const std::vector<double>& reference,
                            MPI_Comm group);
// The largest value of v over the group.
double group_max(double v, MPI_Comm group);
bool group_all(bool v, MPI_Comm group);

}  // namespace shardmuon_test
