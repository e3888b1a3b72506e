#include "comm/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

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

PollPacer::PollPacer() : start_(std::chrono::steady_clock::now()) {}

double PollPacer::waited_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void PollPacer::pause() {
  constexpr double kSpinSeconds = 200e-6;
  if (waited_seconds() < kSpinSeconds) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(sleep_);
  sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
}

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
