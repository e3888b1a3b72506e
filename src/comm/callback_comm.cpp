// A communicator over collectives the caller implements: the bridge to a framework's own
// process groups (PyTorch's gloo for CPU tensors, say).
#include "comm/factories.h"
#include "core/error.h"

namespace shardmuon {
namespace {

class CallbackCommunicator final : public Communicator {
 public:
  CallbackCommunicator(const shardmuon_comm_callbacks& callbacks, shardmuon_backend backend)
      : callbacks_(callbacks), backend_(backend) {}

  const char* kind_name() const override { return "callbacks"; }
  int rank() const override { return callbacks_.rank; }
  int size() const override { return callbacks_.size; }

  void check_compatible(const Backend& backend) const override {
    SHARDMUON_CHECK_ARG(backend.kind() == backend_, "comm's callbacks move ",
                        backend_ == SHARDMUON_BACKEND_CPU ? "host" : "GPU",
                        " memory, but the context's backend is the other one");
  }

  void all_reduce_sum(void* buffer, int64_t count, shardmuon_dtype dtype, Stream stream) override {
    check(callbacks_.all_reduce_sum(callbacks_.user_data, buffer, count, dtype, stream),
          "all_reduce_sum");
  }

  void all_gather_in_place(void* buffer, size_t block_bytes, Stream stream) override {
    check(callbacks_.all_gather(callbacks_.user_data, buffer, block_bytes, stream), "all_gather");
  }

  void all_to_all(const void* send, const std::vector<size_t>& send_bytes,
                  const std::vector<size_t>& send_offsets, void* recv,
                  const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Stream stream) override {
    check(callbacks_.all_to_all(callbacks_.user_data, send, send_bytes.data(), send_offsets.data(),
                                recv, recv_bytes.data(), recv_offsets.data(), stream),
          "all_to_all");
  }

  void agree_max(int64_t* values, int count) override {
    check(callbacks_.agree_max(callbacks_.user_data, values, count), "agree_max");
  }

 private:
  static void check(int code, const char* operation) {
    if (code != 0) {
      fail(SHARDMUON_ERROR_INTERNAL, "the caller's ", operation, " callback failed (returned ",
           code, ")");
    }
  }

  shardmuon_comm_callbacks callbacks_;
  shardmuon_backend backend_;
};

}  // namespace

std::unique_ptr<Communicator> make_callback_communicator(const shardmuon_comm_callbacks& callbacks,
                                                         shardmuon_backend backend) {
  SHARDMUON_CHECK_ARG(callbacks.size >= 1, "callbacks->size must be >= 1, got ", callbacks.size);
  SHARDMUON_CHECK_ARG(callbacks.rank >= 0 && callbacks.rank < callbacks.size,
                      "callbacks->rank must be in [0, ", callbacks.size, "), got ", callbacks.rank);
  SHARDMUON_CHECK_ARG(callbacks.all_reduce_sum && callbacks.all_gather && callbacks.all_to_all &&
                          callbacks.agree_max,
                      "every function of callbacks must be set");
  SHARDMUON_CHECK_ARG(backend == SHARDMUON_BACKEND_CPU || backend == SHARDMUON_BACKEND_CUDA,
                      "backend is unknown: ", static_cast<int>(backend));
  return std::make_unique<CallbackCommunicator>(callbacks, backend);
}

}  // namespace shardmuon
