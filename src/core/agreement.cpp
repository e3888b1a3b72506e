#include "core/agreement.h"

#include "core/error.h"

namespace shardmuon {

void agree_across_ranks(Communicator& comm, std::exception_ptr local_error, uint64_t digest,
                        const std::string& arguments, const char* peer_failure) {
  comm.check_usable();  // a handle whose exchange timed out is out of step with the others
  if (comm.size() == 1) {
    if (local_error) std::rethrow_exception(local_error);
    return;
  }
  // One element-wise maximum carries everything: whether any rank failed, the lowest
  // failed rank (as size - rank), and the largest and (negated) smallest digest, which are
  // equal exactly when all ranks agree. The digest is cut to 63 bits so it negates safely.
  const int64_t size = comm.size();
  const int64_t failed = local_error ? 1 : 0;
  const int64_t folded = static_cast<int64_t>(digest >> 1);
  int64_t values[4] = {failed, failed ? size - comm.rank() : 0, failed ? 0 : folded,
                       failed ? 0 : -folded};
  comm.agree_max(values, 4);

  if (local_error) std::rethrow_exception(local_error);
  if (values[0] != 0) {
    fail(SHARDMUON_ERROR_PEER_FAILED, "rank ", size - values[1], " of the communicator ",
         peer_failure);
  }
  if (values[2] != -values[3]) {
    fail(SHARDMUON_ERROR_RANK_MISMATCH,
         "the ranks of the communicator passed arguments that disagree; this rank (", comm.rank(),
         ") passed ", arguments, "; no rank modified anything");
  }
}

}  // namespace shardmuon
