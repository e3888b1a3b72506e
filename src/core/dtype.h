// Element types: sizes, names, and the host-side bfloat16 conversions that the CPU backend
// uses to reproduce the rounding of bf16 storage exactly as the GPU does it.
#pragma once

#include <cstdint>
#include <cstring>

#include "shardmuon/shardmuon.h"

namespace shardmuon {

inline bool is_valid_dtype(int dtype) {
  return dtype == SHARDMUON_FLOAT32 || dtype == SHARDMUON_BFLOAT16 || dtype == SHARDMUON_FLOAT64;
}

inline size_t element_size(shardmuon_dtype dtype) {
  switch (dtype) {
    case SHARDMUON_FLOAT32: return 4;
    case SHARDMUON_BFLOAT16: return 2;
    case SHARDMUON_FLOAT64: return 8;
  }
  return 0;
}

inline const char* dtype_name(int dtype) {
  switch (dtype) {
    case SHARDMUON_FLOAT32: return "float32";
    case SHARDMUON_BFLOAT16: return "bfloat16";
    case SHARDMUON_FLOAT64: return "float64";
  }
  return "unknown";
}

// The type in which products and reductions of a dtype accumulate: float64 for float64,
// float32 otherwise (bf16 storage, float32 accumulation).
inline shardmuon_dtype accumulate_dtype(shardmuon_dtype dtype) {
  return dtype == SHARDMUON_FLOAT64 ? SHARDMUON_FLOAT64 : SHARDMUON_FLOAT32;
}

// bfloat16 is the upper half of a float32. Round to nearest, ties to even; NaN stays NaN.
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

// Element i of a host buffer of dtype, widened to double, and stored back (rounded once).
inline double load_element(const void* data, shardmuon_dtype dtype, int64_t i) {
  switch (dtype) {
    case SHARDMUON_FLOAT32: return static_cast<const float*>(data)[i];
    case SHARDMUON_BFLOAT16: return bf16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
    case SHARDMUON_FLOAT64: return static_cast<const double*>(data)[i];
  }
  return 0;
}

inline void store_element(void* data, shardmuon_dtype dtype, int64_t i, double value) {
  switch (dtype) {
    case SHARDMUON_FLOAT32: static_cast<float*>(data)[i] = static_cast<float>(value); return;
    case SHARDMUON_BFLOAT16:
      static_cast<uint16_t*>(data)[i] = float_to_bf16_bits(static_cast<float>(value));
      return;
    case SHARDMUON_FLOAT64: static_cast<double*>(data)[i] = value; return;
  }
}

}  // namespace shardmuon
