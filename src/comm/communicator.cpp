#include "comm/communicator.h"

#include <cstdlib>

#include "core/error.h"

namespace shardmuon {

namespace {
constexpr double kDefaultTimeoutSeconds = 300.0;

double timeout_from_environment() {
  const char* text = std::getenv("SHARDMUON_TIMEOUT_SECONDS");
  if (text == nullptr || *text == '\0') return kDefaultTimeoutSeconds;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  return end != text && seconds >= 0 ? seconds : kDefaultTimeoutSeconds;
}
}  // namespace

Communicator::Communicator() : timeout_seconds_(timeout_from_environment()) {}

void Communicator::check_usable() const {
  if (!failure_.empty()) fail(SHARDMUON_ERROR_TIMEOUT, failure_);
}

void Communicator::fail_timeout(const char* channel, double waited_seconds) {
  failure_ = concat("this communicator is unusable: an earlier argument exchange (", channel,
                    ") timed out after ", waited_seconds,
                    " s waiting for the other ranks; destroy it and create another");
  fail(SHARDMUON_ERROR_TIMEOUT, "the other ranks did not join the argument exchange (", channel,
       ") within ", waited_seconds,
       " s (shardmuon_comm_set_timeout); a rank may have skipped "
       "this call, failed before it, or be far behind; this communicator is now unusable");
}

}  // namespace shardmuon
