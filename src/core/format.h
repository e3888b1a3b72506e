// Building messages without iostreams. The library formats with std::string, std::to_string
// and snprintf only: iostreams depend on locale facets whose bookkeeping differs between
// libstdc++ builds, and a library loaded into a host process (PyTorch's, say) does not choose
// which libstdc++ that process runs; an ostringstream crashed there (docs/GPU_RUNS.md).
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace shardmuon {

inline void append(std::string& out, const std::string& text) {
  out += text;
}
inline void append(std::string& out, const char* text) {
  out += text ? text : "(null)";
}
inline void append(std::string& out, char c) {
  out += c;
}
inline void append(std::string& out, bool value) {
  out += value ? "true" : "false";
}
inline void append(std::string& out, double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  out += text;
}
inline void append(std::string& out, float value) {
  append(out, static_cast<double>(value));
}
inline void append(std::string& out, const void* pointer) {
  char text[32];
  std::snprintf(text, sizeof text, "%p", pointer);
  out += text;
}

// Integers and enums as decimal numbers.
template <typename T>
std::enable_if_t<std::is_integral_v<T> || std::is_enum_v<T>> append(std::string& out, T value) {
  if constexpr (std::is_enum_v<T>) {
    out += std::to_string(static_cast<long long>(value));
  } else {
    out += std::to_string(value);
  }
}

// Concatenates any of the above.
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

}  // namespace shardmuon
