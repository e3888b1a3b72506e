// Communicator over a caller's NCCL communicator for the CUDA backend (device memory).
// Collectives are enqueued on the caller's stream. The argument check runs on a private
// communicator split off at creation and on a private stream, so it never queues behind
// the caller's own NCCL work or GPU work.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "comm/factories.h"
#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_handles.h"

namespace shardmuon {
namespace {

void check_nccl(ncclResult_t code, const char* what) {
  if (code == ncclSuccess) return;
  fail(SHARDMUON_ERROR_NCCL, what, " failed: ", ncclGetErrorString(code), " (",
       ncclGetLastError(nullptr), ")");
}

#define SHARDMUON_NCCL(call) check_nccl((call), #call)

constexpr int kMaxAgreementValues = 16;

struct NcclCommDeleter {
  void operator()(ncclComm_t comm) const { ncclCommDestroy(comm); }
};
using UniqueNcclComm = std::unique_ptr<ncclComm, NcclCommDeleter>;

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(ncclComm_t comm) : comm_(comm) {
    SHARDMUON_NCCL(ncclCommUserRank(comm_, &rank_));
    SHARDMUON_NCCL(ncclCommCount(comm_, &size_));
    SHARDMUON_NCCL(ncclCommCuDevice(comm_, &device_));
    DeviceGuard guard(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t split = nullptr;
    SHARDMUON_NCCL(ncclCommSplit(comm_, 0, rank_, &split, &config));
    check_comm_.reset(split);
    check_stream_ = make_nonblocking_stream();
    check_device_ = make_device_memory(kMaxAgreementValues * sizeof(int64_t));
    check_host_ = make_pinned_memory(kMaxAgreementValues * sizeof(int64_t));
    // NCCL sets up a communicator's connections at its first collective, inside the enqueue
    // call, blocking until the peers join. Do that now, while creation has every rank here, so
    // that a later exchange only enqueues and the timeout in agree_max can take effect.
    int64_t warm_up = 0;
    const double timeout = timeout_seconds();
    set_timeout(0);
    agree_max(&warm_up, 1);
    set_timeout(timeout);
  }

  ~NcclCommunicator() override {
    // After a timeout the private all-reduce may still be waiting for a late rank. Give it
    // up to the timeout once more to finish (the late rank may be on its way, as when every
    // rank tears down after a fault); if it does, everything is released as usual. If not,
    // destroying its communicator or freeing its buffers would block on it, so they are
    // left to the process (a few bytes, one communicator).
    if (timed_out_ && !wait_for_check_stream(timeout_seconds())) {
      check_comm_.release();
      check_stream_.release();
      check_device_.release();
      check_host_.release();
    }
  }

  const char* kind_name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void check_compatible(const Backend& backend) const override {
    SHARDMUON_CHECK_ARG(backend.kind() == SHARDMUON_BACKEND_CUDA,
                        "comm is an NCCL communicator, which moves GPU memory; the context's "
                        "backend must be CUDA");
    SHARDMUON_CHECK_ARG(backend.device() == device_, "comm is an NCCL communicator of CUDA device ",
                        device_, " but the context computes on device ", backend.device());
  }

  void all_reduce_sum(void* buffer, int64_t count, shardmuon_dtype dtype, Stream stream) override {
    const ncclDataType_t type = dtype == SHARDMUON_FLOAT64    ? ncclFloat64
                                : dtype == SHARDMUON_BFLOAT16 ? ncclBfloat16
                                                              : ncclFloat32;
    SHARDMUON_NCCL(ncclAllReduce(buffer, buffer, static_cast<size_t>(count), type, ncclSum, comm_,
                                 static_cast<cudaStream_t>(stream)));
  }

  bool sums_bfloat16() const override { return true; }

  void all_gather_in_place(void* buffer, size_t block_bytes, Stream stream) override {
    const char* own_block = static_cast<const char*>(buffer) + rank_ * block_bytes;
    SHARDMUON_NCCL(ncclAllGather(own_block, buffer, block_bytes, ncclUint8, comm_,
                                 static_cast<cudaStream_t>(stream)));
  }

  void all_to_all(const void* send, const std::vector<size_t>& send_bytes,
                  const std::vector<size_t>& send_offsets, void* recv,
                  const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Stream stream) override {
    const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
    SHARDMUON_NCCL(ncclGroupStart());
    for (int peer = 0; peer < size_; ++peer) {
      // Sizes agree across ranks, so skipping empty messages skips them on both ends.
      if (send_bytes[peer] > 0) {
        SHARDMUON_NCCL(ncclSend(static_cast<const char*>(send) + send_offsets[peer],
                                send_bytes[peer], ncclUint8, peer, comm_, cuda_stream));
      }
      if (recv_bytes[peer] > 0) {
        SHARDMUON_NCCL(ncclRecv(static_cast<char*>(recv) + recv_offsets[peer], recv_bytes[peer],
                                ncclUint8, peer, comm_, cuda_stream));
      }
    }
    SHARDMUON_NCCL(ncclGroupEnd());
  }

  void agree_max(int64_t* values, int count) override {
    if (count > kMaxAgreementValues) fail(SHARDMUON_ERROR_INTERNAL, "too many agreement values");
    DeviceGuard guard(device_);
    const size_t bytes = count * sizeof(int64_t);
    int64_t* host = static_cast<int64_t*>(check_host_.get());
    void* device = check_device_.get();
    cudaStream_t stream = check_stream_.get();
    std::copy(values, values + count, host);
    SHARDMUON_CUDA(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
    SHARDMUON_NCCL(
        ncclAllReduce(device, device, count, ncclInt64, ncclMax, check_comm_.get(), stream));
    SHARDMUON_CUDA(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
    // Poll rather than block, so that a rank that never joins ends in a timeout, not a hang.
    PollPacer pacer;
    for (;;) {
      const cudaError_t state = cudaStreamQuery(stream);
      if (state == cudaSuccess) break;
      if (state != cudaErrorNotReady) check_cuda(state, "cudaStreamQuery (argument check)");
      ncclResult_t async = ncclSuccess;
      SHARDMUON_NCCL(ncclCommGetAsyncError(check_comm_.get(), &async));
      check_nccl(async, "the argument check's all-reduce");
      const double waited = pacer.waited_seconds();
      if (timeout_seconds() > 0 && waited > timeout_seconds()) {
        // Give up without calling anything that could block: the private all-reduce stays
        // pending (a late rank's exchange can still complete it) and the destructor releases
        // the private resources only if it has. The caller's communicator is untouched.
        timed_out_ = true;
        fail_timeout("NCCL", waited);
      }
      pacer.pause();
    }
    std::copy(host, host + count, values);
  }

 private:
  // Polls the private stream for up to `seconds`; true once its work has finished.
  bool wait_for_check_stream(double seconds) const {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t state = cudaStreamQuery(check_stream_.get());
      if (state != cudaErrorNotReady) return state == cudaSuccess;
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds)
        return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  ncclComm_t comm_ = nullptr;  // the caller's, borrowed
  // Private to agree_max. Declared in creation order so they are released in reverse.
  bool timed_out_ = false;
  UniqueNcclComm check_comm_;
  UniqueStream check_stream_;
  UniqueDeviceMemory check_device_;
  UniquePinnedMemory check_host_;
  int rank_ = 0, size_ = 1, device_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm) {
  SHARDMUON_CHECK_ARG(nccl_comm != nullptr, "nccl_comm is NULL");
  return std::make_unique<NcclCommunicator>(static_cast<ncclComm_t>(nccl_comm));
}

}  // namespace shardmuon
