// The cross-rank argument check that runs before any collective of a call. Each rank
// validates its own arguments locally, then all ranks exchange (on the communicator's
// private channel) whether they succeeded and a digest of what they passed. So a rank with
// bad arguments, or ranks that disagree, make every rank return an error instead of some
// ranks entering collectives that the others never join.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#include "comm/communicator.h"
#include "core/error.h"

namespace shardmuon {

// FNV-1a over the bytes of the values that must agree across ranks.
class Digest {
 public:
  template <typename T>
  Digest& add(const T& value) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    for (unsigned char byte : bytes) hash_ = (hash_ ^ byte) * 1099511628211ull;
    return *this;
  }
  Digest& add_string(const std::string& text) {
    add(text.size());
    for (unsigned char byte : text) hash_ = (hash_ ^ byte) * 1099511628211ull;
    return *this;
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 14695981039346656037ull;
};

// Runs this rank's part of a phase (validation, growing the workspace, writing a file) and
// returns its failure for agree_across_ranks instead of throwing, so that a rank that failed
// still joins the exchange, whatever it threw: running out of host memory (or asking for a
// container larger than any) counts as OUT_OF_MEMORY, any other standard exception as
// INTERNAL with its message.
template <typename Phase>
std::exception_ptr capture_local_failure(Phase&& phase) {
  try {
    phase();
  } catch (const Failure&) {
    return std::current_exception();
  } catch (const std::bad_alloc&) {
    return std::make_exception_ptr(
        Failure(SHARDMUON_ERROR_OUT_OF_MEMORY, "out of host memory on this rank"));
  } catch (const std::length_error& e) {
    return std::make_exception_ptr(
        Failure(SHARDMUON_ERROR_OUT_OF_MEMORY,
                concat("the arguments ask for more host memory than this rank can address (",
                       e.what(), ")")));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(
        Failure(SHARDMUON_ERROR_INTERNAL, concat("internal error on this rank: ", e.what())));
  }
  return nullptr;
}

// Every rank of comm calls this. local_error is the exception of this rank's validation,
// or null. Returns normally when every rank validated and the digests agree; otherwise
// throws on every rank: this rank's own error, PEER_FAILED naming the first failed rank and
// what it failed at (peer_failure), or RANK_MISMATCH with `arguments` (this rank's
// arguments, for the message). Later phases of a call (writing a file, say) use it with
// digest 0 to make one rank's failure every rank's.
void agree_across_ranks(Communicator& comm, std::exception_ptr local_error, uint64_t digest,
                        const std::string& arguments,
                        const char* peer_failure =
                            "rejected its arguments (its own error "
                            "message says why); no rank modified anything");

}  // namespace shardmuon
