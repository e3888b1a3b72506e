// Lays several scratch buffers out in one workspace allocation, each 256-byte aligned
// (the alignment cuBLASLt and vectorized kernels like best).
#pragma once

#include <cstddef>
#include <vector>

namespace shardmuon {

class WorkspaceCarver {
 public:
  static constexpr size_t kAlignment = 256;

  // Reserves bytes and returns the slot's index; resolve it with pointer() after bind().
  size_t reserve(size_t bytes) {
    offsets_.push_back(total_);
    total_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    return offsets_.size() - 1;
  }
  size_t total_bytes() const { return total_; }
  void bind(void* base) { base_ = static_cast<char*>(base); }
  void* pointer(size_t slot) const { return base_ + offsets_[slot]; }

 private:
  std::vector<size_t> offsets_;
  size_t total_ = 0;
  char* base_ = nullptr;
};

}  // namespace shardmuon
