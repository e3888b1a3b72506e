// How the library turns exceptions into statuses: at the C API's boundary (api_guard) and in a
// rank's phase before the agreement (capture_local_failure). The standard library's exceptions
// are mapped by kind: no argument reaches them since row_blocks is bounded, so they are thrown
// here directly.

#include <gtest/gtest.h>

#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#include "core/agreement.h"
#include "core/api_guard.h"
#include "core/error.h"

namespace shardmuon {
namespace {

template <typename Exception>
void expect_mapped(const Exception& thrown, shardmuon_status status, const std::string& message) {
  EXPECT_EQ(api_guard("call", [&] { throw thrown; }), status);
  EXPECT_NE(std::string(shardmuon_last_error()).find("call: " + message), std::string::npos)
      << shardmuon_last_error();
  const std::exception_ptr failure = capture_local_failure([&] { throw thrown; });
  ASSERT_TRUE(failure);
  try {
    std::rethrow_exception(failure);
  } catch (const Failure& e) {
    EXPECT_EQ(e.status(), status) << e.what();
  }
}

TEST(FailureMapping, EachKindOfExceptionGetsItsStatus) {
  expect_mapped(Failure(SHARDMUON_ERROR_INVALID_ARGUMENT, "x must be 1"),
                SHARDMUON_ERROR_INVALID_ARGUMENT, "x must be 1");
  expect_mapped(std::bad_alloc(), SHARDMUON_ERROR_OUT_OF_MEMORY, "out of host memory");
  expect_mapped(std::length_error("vector::reserve"), SHARDMUON_ERROR_OUT_OF_MEMORY,
                "the arguments ask for more host memory than can be addressed (vector::reserve)");
  expect_mapped(std::runtime_error("broken"), SHARDMUON_ERROR_INTERNAL, "internal error: broken");
  EXPECT_EQ(api_guard("call", [] {}), SHARDMUON_SUCCESS);
  EXPECT_FALSE(capture_local_failure([] {}));
}

}  // namespace
}  // namespace shardmuon
