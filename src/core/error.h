// Errors inside the library are C++ exceptions carrying a shardmuon_status; the C API
// catches them at the boundary (api_guard.h) and keeps the message for shardmuon_last_error().
#pragma once

#include <stdexcept>
#include <string>

#include "core/format.h"
#include "shardmuon/shardmuon.h"

namespace shardmuon {

class Failure : public std::runtime_error {
 public:
  Failure(shardmuon_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  shardmuon_status status() const { return status_; }

 private:
  shardmuon_status status_;
};

template <typename... Parts>
[[noreturn]] void fail(shardmuon_status status, const Parts&... parts) {
  throw Failure(status, concat(parts...));
}

// Throws INVALID_ARGUMENT with the message when the condition does not hold.
#define SHARDMUON_CHECK_ARG(condition, ...)                                             \
  do {                                                                                  \
    if (!(condition)) ::shardmuon::fail(SHARDMUON_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

}  // namespace shardmuon
