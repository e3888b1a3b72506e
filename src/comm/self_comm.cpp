#include "comm/factories.h"
#include "core/error.h"

namespace shardmuon {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  const char* kind_name() const override { return "self"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void check_compatible(const Backend&) const override {}
  void all_reduce_sum(void*, int64_t, shardmuon_dtype, Stream) override {}
  bool sums_bfloat16() const override { return true; }
  void all_gather_in_place(void*, size_t, Stream) override {}
  void all_to_all(const void*, const std::vector<size_t>&, const std::vector<size_t>&, void*,
                  const std::vector<size_t>&, const std::vector<size_t>&, Stream) override {
    // With one rank every plan is local; reaching this is a bug in a plan.
    fail(SHARDMUON_ERROR_INTERNAL, "all_to_all on a one-rank communicator");
  }
  void agree_max(int64_t*, int) override {}
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() {
  return std::make_unique<SelfCommunicator>();
}

}  // namespace shardmuon
