// The lower triangle of a symmetric n x n matrix as square tiles, for computing only that
// triangle of X X^T and A A (about half the flops) and moving only it through all-reduces.
//
// Both sides are split at starts[0] = 0 < starts[1] < ... < starts[blocks] = n, into blocks
// of one width but the last. Tile (i, j), i >= j, holds rows starts[i].. of columns
// starts[j].. (width(i) x width(j), column-major, leading dimension width(i)); a diagonal tile
// holds both its triangles. In the packed layout the tiles of block column j, (j, j) to
// (blocks - 1, j), follow each other, and the block columns follow each other, so a block
// column is one contiguous range (one all-reduce) and every tile but those of the last block
// has one shape: the tiles of a product run as one launch of same-shaped products.
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

// The side the products run on for a short side s: padded_extent(s), and further a multiple
// of `multiple` (a backend's block width, itself rounded up to kProductAlignment so that the
// side stays aligned) where that adds at most 1/32 of the side and leaves at least two
// blocks. The tiles of the symmetric products are then equal blocks of `multiple`
// (SymmetricTiles::split), one launch of whole thread-block tiles, where the bare side split
// into a few wide blocks (3008 = 2 x 1504: 3/4 of the full product's flops, where 6 x 512 of
// 3072 compute 21/36) or into blocks of two widths, whose narrow launches run on part of the
// GPU for the whole inner dimension (5000: 8 x 544 and one of 648, three launches). Zero
// padding is exact (newton_schulz.cpp, WideBlock::padded). Measured on an H200, bf16, quintic
// 5, a whole call (docs/BENCHMARKS.md, thirty-second section): 3001 x 10007 1.12x faster,
// 5000^2 1.14x, 2000 x 7000 1.21x; 7000^2, whose own split ran well, 1.4% slower.
inline int64_t product_side(int64_t s, int64_t multiple) {
  const int64_t aligned = padded_extent(s);
  multiple = padded_extent(multiple);
  if (multiple <= kProductAlignment || aligned < 2 * multiple) return aligned;
  const int64_t rounded = (aligned + multiple - 1) / multiple * multiple;
  return (rounded - aligned) * 32 <= aligned ? rounded : aligned;
}

struct SymmetricTiles {
  int64_t n = 0;
  std::vector<int64_t> starts{0, 0};

  static constexpr int kMaxBlocks = 16;

  // Blocks of about `target` columns, at most `max_blocks` of them, split at multiples of
  // 32 (the CUDA unpacking kernel's tile) except at n. One block (no savings, a plain
  // product) when n is below 2 * target. Where fewer blocks (down to half as many, at least
  // two) would all have one width, they are taken: the tiles are then all of one shape, one
  // launch (measured on an H200, a whole 3001 x 10007 call: 3.16 ms with two blocks of 1504
  // against 3.53 ms with five of 576 and 704).
  static SymmetricTiles split(int64_t n, int64_t target, int max_blocks = kMaxBlocks) {
    SymmetricTiles tiles;
    tiles.n = n;
    int64_t blocks = target > 0 ? n / target : 1;
    blocks = std::clamp<int64_t>(blocks, 1, max_blocks);
    for (int64_t fewer = blocks; fewer >= std::max<int64_t>(2, blocks / 2); --fewer) {
      if (n % (32 * fewer) == 0) {
        blocks = fewer;
        break;
      }
    }
    const int64_t width = (n / blocks) / 32 * 32;
    if (width == 0) blocks = 1;
    tiles.starts.assign(1, 0);
    for (int64_t j = 1; j < blocks; ++j) tiles.starts.push_back(j * width);
    tiles.starts.push_back(n);
    return tiles;
  }

  // `blocks` blocks of n / blocks columns each (n a multiple of blocks).
  static SymmetricTiles equal(int64_t n, int blocks) {
    SymmetricTiles tiles;
    tiles.n = n;
    tiles.starts.clear();
    for (int j = 0; j <= blocks; ++j) tiles.starts.push_back(j * (n / blocks));
    return tiles;
  }

  // The split of the products whose results lie in full matrices on one rank (a Gram that
  // is not summed, A A, (e)'s products) for a GPU whose GEMMs cover them with 128 x 128
  // thread-block tiles on 132 SMs (an H200), at the default block target: 32 equal blocks
  // where they are multiples of 128 wide (n a multiple of 4096). That is 528 tiles in whole
  // waves of thread blocks (4 x 132 at n = 4096, 16 x 132 at 8192), and fewer flops than
  // 512-wide blocks at 4096. Measured on an H200, bf16, one launch of a product's tiles
  // (k = n): n = 4096, 105.9 / 105.4 us (X X^T / A A) against 113.2 / 118.1 us with blocks of
  // 512; n = 8192, 832.8 / 871.0 against 970.4 / 954.0 us (docs/BENCHMARKS.md, tenth
  // session). Otherwise split(n, target).
  static constexpr int64_t kDefaultBlockTarget = 512;
  static SymmetricTiles for_products(int64_t n, int64_t target) {
    constexpr int kWaveBlocks = 32;
    constexpr int64_t kThreadBlockTile = 128;
    if (target == kDefaultBlockTarget && n > 0 && n % (kWaveBlocks * kThreadBlockTile) == 0) {
      return equal(n, kWaveBlocks);
    }
    return split(n, target);
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
  // Where tile (i, j), i >= j, starts in the packed layout.
  int64_t tile_offset(int i, int j) const { return offset(j) + (start(i) - start(j)) * width(j); }
  // The block holding row (or column) r.
  int block_of(int64_t r) const {
    int i = 0;
    while (r >= starts[i + 1]) ++i;
    return i;
  }
  // Where entry (r, c) of the lower block triangle (block_of(r) >= block_of(c)) is kept.
  int64_t packed_index(int64_t r, int64_t c) const {
    const int i = block_of(r), j = block_of(c);
    return tile_offset(i, j) + (c - start(j)) * width(i) + (r - start(i));
  }
};

}  // namespace shardmuon
