// The communication interface of a group of ranks. Implementations: one rank (self), MPI
// for CPU ranks, NCCL for GPUs. Buffers live in the memory of the backend the communicator
// serves; collective calls are enqueued on the stream (NCCL) or complete before returning.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.h"

namespace shardmuon {

// Paces a host-side wait for the argument exchange: yields the thread in a tight loop for the
// first 200 us (ranks that arrive together finish the exchange within tens of microseconds,
// and a sleep, however short, costs about 60 us of timer slack), then sleeps with a pause
// that doubles up to 1 ms, so that waiting for a late rank costs little CPU.
class PollPacer {
 public:
  PollPacer();
  double waited_seconds() const;
  void pause();

 private:
  std::chrono::steady_clock::time_point start_;
  std::chrono::microseconds sleep_{20};
};

class Communicator {
 public:
  Communicator();
  virtual ~Communicator() = default;

  // The deadline of agree_max (0: none); $SHARDMUON_TIMEOUT_SECONDS or 300 s by default.
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }
  double timeout_seconds() const { return timeout_seconds_; }
  // After a timeout the handle refuses every further call (throws TIMEOUT saying why).
  void check_usable() const;

  virtual const char* kind_name() const = 0;  // "self", "mpi" or "nccl"
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Throws INVALID_ARGUMENT if this communicator cannot move the given backend's memory
  // (MPI moves host memory, NCCL device memory of the context's device).
  virtual void check_compatible(const Backend& backend) const = 0;

  // In place, element-wise sum over the group of count float32 or float64 values, or
  // bfloat16 values where sums_bfloat16(). Every rank receives the same result.
  virtual void all_reduce_sum(void* buffer, int64_t count, shardmuon_dtype dtype,
                              Stream stream) = 0;
  // Whether all_reduce_sum takes bfloat16 (each addition in float32, rounded). Callback
  // communicators do not: their ABI promises float32 or float64.
  virtual bool sums_bfloat16() const { return false; }

  // buffer holds size() blocks of block_bytes; on entry block rank() holds this rank's
  // contribution, on exit every block holds its rank's contribution.
  virtual void all_gather_in_place(void* buffer, size_t block_bytes, Stream stream) = 0;

  // Sends send_bytes[r] bytes at send + send_offsets[r] to rank r, and receives
  // recv_bytes[r] bytes from rank r at recv + recv_offsets[r]. Sizes agree across ranks.
  virtual void all_to_all(const void* send, const std::vector<size_t>& send_bytes,
                          const std::vector<size_t>& send_offsets, void* recv,
                          const std::vector<size_t>& recv_bytes,
                          const std::vector<size_t>& recv_offsets, Stream stream) = 0;

  // Host-side and blocking: element-wise maximum of count values over the group, on a
  // channel separate from the caller's own communication, so it never queues behind it.
  // Used to check that the ranks agree before any collective of a call. Throws TIMEOUT (and
  // marks the communicator unusable) when the others do not join within the timeout.
  virtual void agree_max(int64_t* values, int count) = 0;

  // The digest of the last step whose arguments every rank agreed on over this
  // communicator: a step captured into a CUDA graph cannot exchange its digest (agree_max
  // waits on the host), so it must repeat that step's arguments (shardmuon_muon_step).
  void remember_agreed_step(uint64_t digest) {
    agreed_step_digest_ = digest;
    has_agreed_step_ = true;
  }
  bool agreed_on_step(uint64_t digest) const {
    return has_agreed_step_ && agreed_step_digest_ == digest;
  }

 protected:
  // Called by an implementation whose exchange timed out.
  [[noreturn]] void fail_timeout(const char* channel, double waited_seconds);

 private:
  double timeout_seconds_;
  std::string failure_;  // why the handle is unusable, or empty
  uint64_t agreed_step_digest_ = 0;
  bool has_agreed_step_ = false;
};

}  // namespace shardmuon
