#include "core/layout.h"

#include <limits>

#include "core/error.h"

namespace shardmuon {

std::vector<int64_t> balanced_split(int64_t total, int parts) {
  std::vector<int64_t> sizes(parts, total / parts);
  for (int64_t r = 0; r < total % parts; ++r) ++sizes[r];
  return sizes;
}

std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  for (size_t r = 1; r < sizes.size(); ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
  return offsets;
}

ShardLayout ShardLayout::from_api(const shardmuon_layout& layout, int comm_size) {
  SHARDMUON_CHECK_ARG(layout.rows >= 1, "layout->rows must be >= 1, got ", layout.rows);
  SHARDMUON_CHECK_ARG(layout.cols >= 1, "layout->cols must be >= 1, got ", layout.cols);
  // Keep rows * cols * 8 bytes representable, so no size computation overflows.
  SHARDMUON_CHECK_ARG(layout.rows <= std::numeric_limits<int64_t>::max() / 8 / layout.cols,
                      "layout->rows x layout->cols is too large: ", layout.rows, " x ",
                      layout.cols);
  SHARDMUON_CHECK_ARG(
      layout.partition == SHARDMUON_REPLICATED || layout.partition == SHARDMUON_SHARDED_DIM0 ||
          layout.partition == SHARDMUON_SHARDED_DIM1 || layout.partition == SHARDMUON_SHARDED_FLAT,
      "layout->partition is unknown: ", static_cast<int>(layout.partition));

  ShardLayout result;
  result.rows_ = layout.rows;
  result.cols_ = layout.cols;
  result.partition_ = layout.partition;
  if (!result.is_sharded()) return result;

  SHARDMUON_CHECK_ARG(layout.num_shards == comm_size, "layout->num_shards (", layout.num_shards,
                      ") must equal the communicator's size (", comm_size, ")");
  const int64_t extent = result.is_flat()            ? layout.rows * layout.cols
                         : result.sharded_dim() == 0 ? layout.rows
                                                     : layout.cols;
  if (layout.shard_sizes == nullptr) {
    result.shard_sizes_ = balanced_split(extent, comm_size);
  } else {
    result.shard_sizes_.assign(layout.shard_sizes, layout.shard_sizes + comm_size);
    int64_t sum = 0;
    for (int r = 0; r < comm_size; ++r) {
      const int64_t size = result.shard_sizes_[r];
      SHARDMUON_CHECK_ARG(size >= 0 && size <= extent, "layout->shard_sizes[", r, "] = ", size,
                          " is outside [0, ", extent, "]");
      // Checked before adding: a sum past the extent could otherwise wrap around to it.
      SHARDMUON_CHECK_ARG(size <= extent - sum, "layout->shard_sizes[0..", r, "] add up to more ",
                          "than the ", extent, " elements, rows or cols that are sharded");
      sum += size;
    }
    SHARDMUON_CHECK_ARG(sum == extent, "layout->shard_sizes add up to ", sum, ", but the sharded ",
                        (result.is_flat()            ? "elements"
                         : result.sharded_dim() == 0 ? "rows"
                                                     : "cols"),
                        " number ", extent);
  }
  result.shard_offsets_ = prefix_offsets(result.shard_sizes_);
  return result;
}

int64_t ShardLayout::local_rows(int rank) const {
  if (is_flat()) return 1;
  return partition_ == SHARDMUON_SHARDED_DIM0 ? shard_sizes_[rank] : rows_;
}

int64_t ShardLayout::local_cols(int rank) const {
  if (is_flat()) return shard_sizes_[rank];
  return partition_ == SHARDMUON_SHARDED_DIM1 ? shard_sizes_[rank] : cols_;
}

int ShardLayout::long_dim() const {
  if (rows_ < cols_) return 1;
  if (rows_ > cols_) return 0;
  return sharded_dim() == 0 ? 0 : 1;
}

std::string ShardLayout::describe() const {
  std::string out = concat(rows_, " x ", cols_);
  if (!is_sharded()) return out + " replicated";
  out += is_flat() ? concat(" sharded flat (elements) as [")
                   : concat(" sharded along dim ", sharded_dim(), " as [");
  for (size_t r = 0; r < shard_sizes_.size(); ++r) out += concat(r ? ", " : "", shard_sizes_[r]);
  return out + "]";
}

}  // namespace shardmuon
