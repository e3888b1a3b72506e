// The lower triangle of a symmetric n x n matrix as block columns, for computing only that
// triangle of X X^T and A A (about half the flops) and moving only it through all-reduces.
//
// The columns are split at starts[0] = 0 < starts[1] < ... < starts[blocks] = n. Block
// column j keeps rows starts[j]..n-1 of columns starts[j]..starts[j+1]-1: its diagonal block
// (whole, both triangles) and everything below it. In the packed layout the block columns
// follow each other, each column-major with its own leading dimension n - starts[j], so a
// block column is one contiguous range (one GEMM output, one all-reduce).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardmuon {

// The products run on blocks whose sides are rounded up to a multiple of 8 elements (zero
// padding, exact; see newton_schulz.cpp's WideBlock::padded): 16-byte rows for the tensor cores.
constexpr int64_t kProductAlignment = 8;
inline int64_t padded_extent(int64_t x) {
  return (x + kProductAlignment - 1) / kProductAlignment * kProductAlignment;
}

struct SymmetricTiles {
  int64_t n = 0;
  std::vector<int64_t> starts{0, 0};

  static constexpr int kMaxBlocks = 16;

  // Blocks of about `target` columns, at most `max_blocks` of them, split at multiples of
  // 32 (the CUDA unpacking kernel's tile) except at n. One block (no savings, a plain
  // product) when n is below 2 * target.
  static SymmetricTiles split(int64_t n, int64_t target, int max_blocks = kMaxBlocks) {
    SymmetricTiles tiles;
    tiles.n = n;
    int64_t blocks = target > 0 ? n / target : 1;
    blocks = std::clamp<int64_t>(blocks, 1, max_blocks);
    const int64_t width = (n / blocks) / 32 * 32;
    if (width == 0) blocks = 1;
    tiles.starts.assign(1, 0);
    for (int64_t j = 1; j < blocks; ++j) tiles.starts.push_back(j * width);
    tiles.starts.push_back(n);
    return tiles;
  }

  int blocks() const { return static_cast<int>(starts.size()) - 1; }
  int64_t start(int j) const { return starts[j]; }
  int64_t width(int j) const { return starts[j + 1] - starts[j]; }
  // Rows kept in block column j, which is also its leading dimension.
  int64_t rows(int j) const { return n - starts[j]; }
  int64_t elements(int j) const { return rows(j) * width(j); }
  int64_t offset(int j) const {
    int64_t total = 0;
    for (int i = 0; i < j; ++i) total += elements(i);
    return total;
  }
  int64_t packed_elements() const { return offset(blocks()); }
};

}  // namespace shardmuon
