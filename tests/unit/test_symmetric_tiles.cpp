// The packed layout of the symmetric products' lower tiles (src/core/symmetric_tiles.h):
// the splits the products run on and the index every backend's unpacking reads through.
#include <gtest/gtest.h>

#include <vector>

#include "core/symmetric_tiles.h"

namespace shardmuon {
namespace {

TEST(SymmetricTiles, SplitsAtMultiplesOf32WithOneWidthButTheLast) {
  for (int64_t n : {8, 64, 104, 512, 1000, 3008, 4096, 8192, 16384, 20000}) {
    for (int64_t target : {32, 512, 1024}) {
      const SymmetricTiles tiles = SymmetricTiles::split(n, target);
      ASSERT_GE(tiles.blocks(), 1);
      ASSERT_LE(tiles.blocks(), SymmetricTiles::kMaxBlocks);
      EXPECT_EQ(tiles.start(0), 0);
      EXPECT_EQ(tiles.starts.back(), n);
      for (int j = 0; j + 1 < tiles.blocks(); ++j) {
        EXPECT_EQ(tiles.start(j + 1) % 32, 0) << "n " << n << " target " << target;
        EXPECT_EQ(tiles.width(j), tiles.width(0)) << "n " << n << " target " << target;
      }
      EXPECT_GE(tiles.width(tiles.blocks() - 1), tiles.width(0));
    }
  }
  // Fewer blocks of one width are preferred (3008 = 2 x 1504, not 5 uneven blocks of 512);
  // where no such split exists the last block is wider.
  EXPECT_EQ(SymmetricTiles::split(3008, 512).blocks(), 2);
  EXPECT_EQ(SymmetricTiles::split(4096, 512).blocks(), 8);
  EXPECT_EQ(SymmetricTiles::split(104, 32).blocks(), 3);
  EXPECT_EQ(SymmetricTiles::split(104, 32).width(2), 40);
  EXPECT_EQ(SymmetricTiles::split(60, 32).blocks(), 1);
}

TEST(SymmetricTiles, EqualBlocksSplitTheSideEvenly) {
  const SymmetricTiles tiles = SymmetricTiles::equal(4096, 32);
  ASSERT_EQ(tiles.blocks(), 32);
  for (int j = 0; j < tiles.blocks(); ++j) EXPECT_EQ(tiles.width(j), 128);
  EXPECT_EQ(tiles.starts.back(), 4096);
  // 528 tiles of 128 x 128: 32 * 33 / 2 of them.
  EXPECT_EQ(tiles.packed_elements(), 528 * 128 * 128);
}

TEST(SymmetricTiles, ProductsRunInThirtyTwoBlocksOnlyAtMultiplesOf4096AndTheDefaultTarget) {
  EXPECT_EQ(SymmetricTiles::for_products(4096, 512).blocks(), 32);
  EXPECT_EQ(SymmetricTiles::for_products(16384, 512).width(0), 512);
  EXPECT_EQ(SymmetricTiles::for_products(6144, 512).starts,
            SymmetricTiles::split(6144, 512).starts);
  EXPECT_EQ(SymmetricTiles::for_products(4096, 96).starts, SymmetricTiles::split(4096, 96).starts);
  EXPECT_EQ(SymmetricTiles::for_products(3008, 512).starts,
            SymmetricTiles::split(3008, 512).starts);
}

TEST(SymmetricTiles, ShortSidesArePaddedToTheBlockWidthWhereThatIsCheap) {
  // Within 1/32 of the side and at least two blocks: to the next multiple.
  EXPECT_EQ(product_side(3001, 512), 3072);
  EXPECT_EQ(product_side(5000, 512), 5120);
  EXPECT_EQ(product_side(2000, 512), 2048);
  EXPECT_EQ(product_side(12000, 512), 12288);
  EXPECT_EQ(product_side(309, 32), 320);
  // The short sides of NewtonSchulzPaddedSides (tests/distributed/test_newton_schulz.cpp).
  EXPECT_EQ(product_side(1510, 512), 1536);
  // 1600 -> 2048 and 4104 -> 4608 would add more than 1/32; 1000 is one block.
  EXPECT_EQ(product_side(1600, 512), 1600);
  EXPECT_EQ(product_side(4100, 512), 4104);
  EXPECT_EQ(product_side(1000, 512), 1000);
  EXPECT_EQ(product_side(300, 32), 304);
  // Multiples stay; a multiple of 8 or less only aligns.
  EXPECT_EQ(product_side(4096, 512), 4096);
  EXPECT_EQ(product_side(3001, 8), 3008);
  EXPECT_EQ(product_side(3001, 0), 3008);
  EXPECT_EQ(product_side(0, 512), 0);
  // A multiple that is not one of 8 (a tuning setting) is rounded up to one: 100 -> 104.
  EXPECT_EQ(product_side(3001, 100), 3016);
  // Every padded side splits into equal blocks of the multiple.
  for (int64_t s = 1; s <= 20000; s += 7) {
    const int64_t side = product_side(s, 512);
    ASSERT_GE(side, padded_extent(s));
    ASSERT_LE((side - padded_extent(s)) * 32, padded_extent(s)) << "s " << s;
    if (side != padded_extent(s)) {
      ASSERT_EQ(side % 512, 0) << "s " << s;
      const SymmetricTiles tiles = SymmetricTiles::split(side, 512);
      EXPECT_EQ(tiles.width(tiles.blocks() - 1), tiles.width(0)) << "s " << s;
    }
  }
}

TEST(SymmetricTiles, PackedIndexCoversTheLowerTilesOnce) {
  for (int64_t n : {64, 104, 136, 200}) {
    const SymmetricTiles tiles = SymmetricTiles::split(n, 32);
    std::vector<int> seen(static_cast<size_t>(tiles.packed_elements()), 0);
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t r = 0; r < n; ++r) {
        if (tiles.block_of(r) < tiles.block_of(c)) continue;  // above the block diagonal
        const int64_t index = tiles.packed_index(r, c);
        ASSERT_GE(index, 0);
        ASSERT_LT(index, tiles.packed_elements());
        ++seen[static_cast<size_t>(index)];
        // Tile (i, j) is column-major with its own height as leading dimension.
        const int i = tiles.block_of(r), j = tiles.block_of(c);
        EXPECT_EQ(index, tiles.tile_offset(i, j) + (c - tiles.start(j)) * tiles.width(i) +
                             (r - tiles.start(i)));
      }
    }
    for (size_t k = 0; k < seen.size(); ++k) ASSERT_EQ(seen[k], 1) << "n " << n << " index " << k;
    // Each block column is one contiguous range: its tiles follow each other.
    for (int j = 0; j < tiles.blocks(); ++j) {
      EXPECT_EQ(tiles.tile_offset(j, j), tiles.offset(j));
      if (j + 1 < tiles.blocks()) {
        EXPECT_EQ(tiles.tile_offset(tiles.blocks() - 1, j) +
                      tiles.width(tiles.blocks() - 1) * tiles.width(j),
                  tiles.offset(j + 1));
      }
    }
  }
}

}  // namespace
}  // namespace shardmuon
