#include "mpi_callbacks.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef SHARDMUON_TEST_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardmuon_test {
namespace {

void mpi_ok(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, message, &length);
  throw std::runtime_error(std::string(what) + ": " + std::string(message, length));
}

int mpi_count(size_t count, const char* what) {
  // The tests' collectives are far below this; larger ones would need derived datatypes.
  if (count > static_cast<size_t>(INT_MAX)) {
    throw std::runtime_error(std::string(what) + ": " + std::to_string(count) +
                             " exceeds one MPI message");
  }
  return static_cast<int>(count);
}

// Runs a callback's body; an exception becomes the nonzero status that shardmuon reports as
// the callback's failure, and its message goes to stderr so the test log says why.
template <typename Body>
int guarded(const char* name, Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "MpiCallbacks::%s: %s\n", name, e.what());
    return 1;
  }
}

// Where MPI reads and writes the caller's `bytes` bytes at `data`: the memory itself for host
// buffers; for device buffers a host copy, taken once every earlier operation of the call's
// stream has finished (the stream may still be computing what it is about to send).
class HostView {
 public:
  HostView(void* data, size_t bytes, bool on_device, void* stream)
      : data_(static_cast<unsigned char*>(data)), on_device_(on_device), stream_(stream) {
    if (!on_device_ || bytes == 0) return;
#ifdef SHARDMUON_TEST_WITH_CUDA
    cuda_ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
    copy_.resize(bytes);
    cuda_ok(cudaMemcpy(copy_.data(), data_, bytes, cudaMemcpyDeviceToHost), "copy to host");
#else
    throw std::runtime_error("device memory, but the tests were built without CUDA");
#endif
  }

  unsigned char* host() {
    return on_device_ ? copy_.data() : data_;
  }

  // Writes `bytes` at `offset` of the host copy back to the device buffer, done on return.
  // (Without CUDA there are no device buffers: the constructor refused them.)
  void write_back([[maybe_unused]] size_t offset, size_t bytes) {
    if (!on_device_ || bytes == 0) return;
#ifdef SHARDMUON_TEST_WITH_CUDA
    cudaStream_t stream = static_cast<cudaStream_t>(stream_);
    cuda_ok(cudaMemcpyAsync(data_ + offset, copy_.data() + offset, bytes, cudaMemcpyHostToDevice,
                            stream),
            "copy to device");
    cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
#endif
  }

 private:
#ifdef SHARDMUON_TEST_WITH_CUDA
  static void cuda_ok(cudaError_t code, const char* what) {
    if (code != cudaSuccess)
      throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(code));
  }
#endif

  unsigned char* data_;
  bool on_device_;
  void* stream_;
  std::vector<unsigned char> copy_;
};

}  // namespace

MpiCallbacks::MpiCallbacks(MPI_Comm group, bool device_memory) : device_memory_(device_memory) {
  mpi_ok(MPI_Comm_dup(group, &comm_), "MPI_Comm_dup");
  mpi_ok(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiCallbacks::~MpiCallbacks() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

shardmuon_comm_callbacks MpiCallbacks::table() {
  shardmuon_comm_callbacks callbacks{};
  callbacks.user_data = this;
  callbacks.rank = rank_;
  callbacks.size = size_;
  callbacks.all_reduce_sum = &MpiCallbacks::all_reduce_sum;
  callbacks.all_gather = &MpiCallbacks::all_gather;
  callbacks.all_to_all = &MpiCallbacks::all_to_all;
  callbacks.agree_max = &MpiCallbacks::agree_max;
  return callbacks;
}

int MpiCallbacks::all_reduce_sum(void* self, void* buffer, int64_t count, shardmuon_dtype dtype,
                                 void* stream) {
  return guarded("all_reduce_sum", [&] {
    const MpiCallbacks& me = *static_cast<MpiCallbacks*>(self);
    if (dtype != SHARDMUON_FLOAT32 && dtype != SHARDMUON_FLOAT64) {
      throw std::runtime_error("dtype " + std::to_string(dtype) +
                               " (the header promises FLOAT32 or FLOAT64)");
    }
    const size_t element = dtype == SHARDMUON_FLOAT32 ? 4 : 8;
    const size_t bytes = static_cast<size_t>(count) * element;
    HostView view(buffer, bytes, me.device_memory_, stream);
    mpi_ok(MPI_Allreduce(MPI_IN_PLACE, view.host(), mpi_count(static_cast<size_t>(count), "count"),
                         dtype == SHARDMUON_FLOAT32 ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, me.comm_),
           "MPI_Allreduce");
    view.write_back(0, bytes);
  });
}

int MpiCallbacks::all_gather(void* self, void* buffer, size_t block_bytes, void* stream) {
  return guarded("all_gather", [&] {
    const MpiCallbacks& me = *static_cast<MpiCallbacks*>(self);
    HostView view(buffer, block_bytes * me.size_, me.device_memory_, stream);
    mpi_ok(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, view.host(),
                         mpi_count(block_bytes, "block_bytes"), MPI_BYTE, me.comm_),
           "MPI_Allgather");
    // Only the other ranks' blocks are new; this rank's may be read by the stream meanwhile.
    for (int r = 0; r < me.size_; ++r) {
      if (r != me.rank_) view.write_back(block_bytes * r, block_bytes);
    }
  });
}

int MpiCallbacks::all_to_all(void* self, const void* send, const size_t* send_bytes,
                             const size_t* send_offsets, void* recv, const size_t* recv_bytes,
                             const size_t* recv_offsets, void* stream) {
  return guarded("all_to_all", [&] {
    const MpiCallbacks& me = *static_cast<MpiCallbacks*>(self);
    const int n = me.size_;
    std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
    size_t send_extent = 0, recv_extent = 0;
    for (int r = 0; r < n; ++r) {
      send_counts[r] = mpi_count(send_bytes[r], "send_bytes");
      send_displs[r] = mpi_count(send_offsets[r], "send_offsets");
      recv_counts[r] = mpi_count(recv_bytes[r], "recv_bytes");
      recv_displs[r] = mpi_count(recv_offsets[r], "recv_offsets");
      send_extent = std::max(send_extent, send_offsets[r] + send_bytes[r]);
      recv_extent = std::max(recv_extent, recv_offsets[r] + recv_bytes[r]);
    }
    // MPI only reads the send view; the cast is for HostView's one pointer type.
    HostView send_view(const_cast<void*>(send), send_extent, me.device_memory_, stream);
    HostView recv_view(recv, recv_extent, me.device_memory_, stream);
    mpi_ok(
        MPI_Alltoallv(send_view.host(), send_counts.data(), send_displs.data(), MPI_BYTE,
                      recv_view.host(), recv_counts.data(), recv_displs.data(), MPI_BYTE, me.comm_),
        "MPI_Alltoallv");
    // Only the received ranges: what lies between them is the caller's.
    for (int r = 0; r < n; ++r) recv_view.write_back(recv_offsets[r], recv_bytes[r]);
  });
}

// agree_max is the first collective of every call (the library's argument exchange). A rank
// left waiting in it this long has been left alone: the others returned from a test early
// after a failure that this rank did not see (their output says which), while it went on.
// (for_each_group keeps ranks in step across groups; a failure on some of a group's ranks,
// in the middle of its calls, can still leave them apart.) The job is aborted with that
// message, where a blocking MPI_Allreduce would hang silently.
constexpr double kAloneSeconds = 120;

int MpiCallbacks::agree_max(void* self, int64_t* values, int count) {
  return guarded("agree_max", [&] {
    const MpiCallbacks& me = *static_cast<MpiCallbacks*>(self);
    MPI_Request request = MPI_REQUEST_NULL;
    mpi_ok(MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_INT64_T, MPI_MAX, me.comm_, &request),
           "MPI_Iallreduce");
    const auto start = std::chrono::steady_clock::now();
    for (int done = 0;;) {
      mpi_ok(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
          kAloneSeconds) {
        int world_rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
        std::fprintf(stderr,
                     "[rank %d] MpiCallbacks: a call's argument exchange did not complete within "
                     "%.0f s: a rank of the group has most likely left the test after a failure "
                     "(see its output). Aborting the job.\n",
                     world_rank, kAloneSeconds);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
      // The ranks may share few cores (oversubscribed CPU runs): poll without hogging one.
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
}

}  // namespace shardmuon_test
