// Communicator over MPI for CPU ranks (host memory). The caller's communicator is
// duplicated so that shardmuon's messages can never match the caller's.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/factories.h"
#include "core/dtype.h"
#include "core/error.h"

namespace shardmuon {
namespace {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, message, &length);
  fail(SHARDMUON_ERROR_MPI, what, " failed: ", std::string(message, length));
}

// The most bytes (or elements) one MPI call moves: its counts are int. Larger transfers go in
// pieces of this size, which every rank derives from sizes all of them agree on, so no rank
// fails or waits alone. $SHARDMUON_MPI_MESSAGE_BYTES lowers it, so that tests can take those
// paths with small matrices; it must be the same on every rank.
size_t max_message() {
  static const size_t limit = [] {
    const char* text = std::getenv("SHARDMUON_MPI_MESSAGE_BYTES");
    const long long value = text != nullptr ? std::atoll(text) : 0;
    return value > 0 && value < INT_MAX ? static_cast<size_t>(value) : static_cast<size_t>(INT_MAX);
  }();
  return limit;
}

// MPI has no bfloat16: a user-defined sum over 16-bit words, each addition in float32 and
// rounded, as NCCL sums bfloat16.
void sum_bfloat16(void* in, void* inout, int* length, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    b[i] = float_to_bf16_bits(bf16_bits_to_float(a[i]) + bf16_bits_to_float(b[i]));
  }
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm caller_comm) {
    // Errors are returned, not fatal, so they reach the caller as a status.
    check_mpi(MPI_Comm_dup(caller_comm, &comm_), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    check_mpi(MPI_Op_create(&sum_bfloat16, /*commute=*/1, &sum_bfloat16_), "MPI_Op_create");
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Op_free(&sum_bfloat16_);
    // A timed-out exchange may still be pending. MPI can neither cancel nor free an active
    // collective request, and Open MPI crashes if the communicator of a pending nonblocking
    // collective is freed (seen with 4.1), so both are then left to MPI until it finalizes.
    if (pending_ != MPI_REQUEST_NULL) {
      int done = 0;
      MPI_Test(&pending_, &done, MPI_STATUS_IGNORE);
      if (!done) {
        exchange_.release();  // MPI may still write the late result into it
        return;
      }
    }
    MPI_Comm_free(&comm_);
  }

  const char* kind_name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void check_compatible(const Backend& backend) const override {
    SHARDMUON_CHECK_ARG(backend.kind() == SHARDMUON_BACKEND_CPU,
                        "comm is an MPI communicator, which moves host memory; the context's "
                        "backend must be CPU");
  }

  void all_reduce_sum(void* buffer, int64_t count, shardmuon_dtype dtype, Stream) override {
    const bool bfloat16 = dtype == SHARDMUON_BFLOAT16;
    const MPI_Datatype type = dtype == SHARDMUON_FLOAT64 ? MPI_DOUBLE
                              : bfloat16                 ? MPI_UINT16_T
                                                         : MPI_FLOAT;
    const MPI_Op sum = bfloat16 ? sum_bfloat16_ : MPI_SUM;
    const size_t element = element_size(dtype);
    // Large buffers go in pieces: MPI counts are int.
    const int64_t most = static_cast<int64_t>(std::max<size_t>(1, max_message() / element));
    for (int64_t done = 0; done < count;) {
      const int piece = static_cast<int>(std::min<int64_t>(count - done, most));
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(buffer) + done * element, piece,
                              type, sum, comm_),
                "MPI_Allreduce");
      done += piece;
    }
  }

  bool sums_bfloat16() const override { return true; }

  void all_gather_in_place(void* buffer, size_t block_bytes, Stream) override {
    if (block_bytes <= max_message() && block_bytes * size_ <= static_cast<size_t>(INT_MAX)) {
      check_mpi(MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, buffer, static_cast<int>(block_bytes),
                              MPI_BYTE, comm_),
                "MPI_Allgather");
      return;
    }
    // Every rank has the same block_bytes: each block is broadcast from its rank in pieces.
    char* bytes = static_cast<char*>(buffer);
    for (int root = 0; root < size_; ++root) {
      for (size_t done = 0; done < block_bytes;) {
        const size_t piece = std::min(block_bytes - done, max_message());
        check_mpi(MPI_Bcast(bytes + root * block_bytes + done, static_cast<int>(piece), MPI_BYTE,
                            root, comm_),
                  "MPI_Bcast (all-gather)");
        done += piece;
      }
    }
  }

  // Point to point, each message in pieces of at most max_message() bytes: MPI_Alltoallv's
  // counts and displacements are int, and its pieces would have to be agreed on, since every
  // rank knows only its own sizes. A sender and its receiver know the same size, so they cut
  // it alike, and MPI keeps the order of messages between two ranks.
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes,
                  const std::vector<size_t>& send_offsets, void* recv,
                  const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Stream) override {
    constexpr int kTag = 0x5d;
    std::vector<MPI_Request> requests;
    auto post = [&](int peer, size_t bytes, bool sending) {
      const char* from = static_cast<const char*>(send) + send_offsets[peer];
      char* to = static_cast<char*>(recv) + recv_offsets[peer];
      for (size_t done = 0; done < bytes;) {
        const int piece = static_cast<int>(std::min(bytes - done, max_message()));
        requests.emplace_back();
        if (sending) {
          check_mpi(MPI_Isend(from + done, piece, MPI_BYTE, peer, kTag, comm_, &requests.back()),
                    "MPI_Isend (all-to-all)");
        } else {
          check_mpi(MPI_Irecv(to + done, piece, MPI_BYTE, peer, kTag, comm_, &requests.back()),
                    "MPI_Irecv (all-to-all)");
        }
        done += static_cast<size_t>(piece);
      }
    };
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) {
        if (send_bytes[peer] > 0) {
          std::memcpy(static_cast<char*>(recv) + recv_offsets[peer],
                      static_cast<const char*>(send) + send_offsets[peer], send_bytes[peer]);
        }
        continue;
      }
      post(peer, recv_bytes[peer], false);
    }
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) post(peer, send_bytes[peer], true);
    }
    check_mpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
              "MPI_Waitall (all-to-all)");
  }

  // Nonblocking, so that it can give up: the buffer is the communicator's own, because after a
  // timeout the collective stays pending (MPI cannot cancel it) and may complete later.
  void agree_max(int64_t* values, int count) override {
    if (count > kMaxAgreementValues) fail(SHARDMUON_ERROR_INTERNAL, "too many agreement values");
    std::copy(values, values + count, exchange_.get());
    MPI_Request request;
    check_mpi(
        MPI_Iallreduce(MPI_IN_PLACE, exchange_.get(), count, MPI_INT64_T, MPI_MAX, comm_, &request),
        "MPI_Iallreduce (argument check)");
    PollPacer pacer;
    for (int done = 0;;) {
      check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test (argument check)");
      if (done) break;
      const double waited = pacer.waited_seconds();
      if (timeout_seconds() > 0 && waited > timeout_seconds()) {
        pending_ = request;
        fail_timeout("MPI", waited);
      }
      pacer.pause();
    }
    std::copy(exchange_.get(), exchange_.get() + count, values);
  }

 private:
  static constexpr int kMaxAgreementValues = 16;
  // On the heap, so that it can outlive this object if a timed-out exchange is still pending.
  std::unique_ptr<int64_t[]> exchange_ = std::make_unique<int64_t[]>(kMaxAgreementValues);
  MPI_Request pending_ = MPI_REQUEST_NULL;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op sum_bfloat16_ = MPI_OP_NULL;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const void* mpi_comm) {
  SHARDMUON_CHECK_ARG(mpi_comm != nullptr, "mpi_comm is NULL (pass the address of an MPI_Comm)");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  SHARDMUON_CHECK_ARG(initialized && !finalized,
                      "MPI is not initialized (or already finalized); call MPI_Init first");
  const MPI_Comm comm = *static_cast<const MPI_Comm*>(mpi_comm);
  SHARDMUON_CHECK_ARG(comm != MPI_COMM_NULL, "*mpi_comm is MPI_COMM_NULL");
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace shardmuon
