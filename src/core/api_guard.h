// The boundary between the C API and the C++ internals: runs a body, turns any exception
// into a status, and records the message for shardmuon_last_error() on this thread.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "core/error.h"

namespace shardmuon {

void set_last_error(const std::string& message);
void clear_last_error();

template <typename Body>
shardmuon_status api_guard(const char* function, Body&& body) {
  clear_last_error();
  try {
    body();
    return SHARDMUON_SUCCESS;
  } catch (const Failure& e) {
    set_last_error(std::string(function) + ": " + e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error(std::string(function) + ": out of host memory");
    return SHARDMUON_ERROR_OUT_OF_MEMORY;
  } catch (const std::length_error& e) {  // a container larger than any, as in agreement.h
    set_last_error(concat(function,
                          ": the arguments ask for more host memory than can be addressed (",
                          e.what(), ")"));
    return SHARDMUON_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(std::string(function) + ": internal error: " + e.what());
    return SHARDMUON_ERROR_INTERNAL;
  } catch (...) {
    set_last_error(std::string(function) + ": internal error: unknown exception");
    return SHARDMUON_ERROR_INTERNAL;
  }
}

}  // namespace shardmuon
