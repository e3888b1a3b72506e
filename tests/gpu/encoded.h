// Host values as the bytes of a dtype, for copying into device memory in the GPU unit tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "shardmuon/shardmuon.h"

namespace shardmuon {

// The bytes of `values` in the dtype (float32 or bf16; bf16 by float32's upper 16 bits, which
// is exact for values bf16 holds and truncates the others).
inline std::vector<unsigned char> encoded(const std::vector<float>& values, shardmuon_dtype dtype) {
  const size_t element = dtype == SHARDMUON_BFLOAT16 ? 2 : 4;
  std::vector<unsigned char> bytes(values.size() * element);
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, &values[i], 4);
    if (dtype == SHARDMUON_BFLOAT16) {
      const uint16_t upper = static_cast<uint16_t>(bits >> 16);
      std::memcpy(bytes.data() + i * 2, &upper, 2);
    } else {
      std::memcpy(bytes.data() + i * 4, &bits, 4);
    }
  }
  return bytes;
}

}  // namespace shardmuon
