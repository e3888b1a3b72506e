// The layout of one logical matrix over the ranks of a group, validated and resolved:
// shard sizes filled in (balanced split for NULL) and their offsets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardmuon/shardmuon.h"

namespace shardmuon {

// Splits total into parts pieces that differ by at most one, the larger ones first.
std::vector<int64_t> balanced_split(int64_t total, int parts);

// Exclusive prefix sums: offsets[r] = sizes[0] + ... + sizes[r-1].
std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& sizes);

class ShardLayout {
 public:
  // Validates a caller's layout for a group of comm_size ranks; throws INVALID_ARGUMENT
  // naming the field at fault.
  static ShardLayout from_api(const shardmuon_layout& layout, int comm_size);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  shardmuon_partition partition() const { return partition_; }
  bool is_sharded() const { return partition_ != SHARDMUON_REPLICATED; }
  // Shards that are ranges of the row-major elements (SHARDMUON_SHARDED_FLAT), not rows or
  // columns: their sizes and offsets count elements.
  bool is_flat() const { return partition_ == SHARDMUON_SHARDED_FLAT; }
  // 0 or 1 for layouts sharded along a dim; -1 for flat and replicated ones.
  int sharded_dim() const {
    return partition_ == SHARDMUON_SHARDED_DIM0 ? 0 : partition_ == SHARDMUON_SHARDED_DIM1 ? 1 : -1;
  }
  const std::vector<int64_t>& shard_sizes() const { return shard_sizes_; }
  const std::vector<int64_t>& shard_offsets() const { return shard_offsets_; }

  // Whether each shard is one contiguous range of the row-major matrix (DIM0 and FLAT), and
  // where rank's range starts (elements).
  bool shards_are_contiguous() const { return sharded_dim() == 0 || is_flat(); }
  int64_t element_offset(int rank) const {
    return is_flat() ? shard_offsets_[rank] : shard_offsets_[rank] * cols_;
  }

  // The local shard's extents; for a flat shard, which need not be a rectangle, local_rows
  // is 1 and local_cols its element count.
  int64_t local_rows(int rank) const;
  int64_t local_cols(int rank) const;
  int64_t local_elements(int rank) const { return local_rows(rank) * local_cols(rank); }

  // The smaller and larger logical extents: the Gram matrix is s x s.
  int64_t short_extent() const { return rows_ <= cols_ ? rows_ : cols_; }
  int64_t long_extent() const { return rows_ <= cols_ ? cols_ : rows_; }
  // The dim along which (b)'s blocks lie (the long side). For a square matrix, the sharded
  // dim, so that its shards need no redistribution. A matrix iterated whole on one rank takes
  // its columns as the long side unless rows > cols, however it is sharded.
  int long_dim() const;

  std::string describe() const;

 private:
  int64_t rows_ = 0, cols_ = 0;
  shardmuon_partition partition_ = SHARDMUON_REPLICATED;
  std::vector<int64_t> shard_sizes_, shard_offsets_;
};

}  // namespace shardmuon
