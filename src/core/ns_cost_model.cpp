#include "core/ns_cost_model.h"

#include <algorithm>

#include "core/symmetric_tiles.h"

namespace shardmuon {
namespace {

// The products of an iteration on an s x length block (both sides padded), each with its
// fixed cost; the symmetric ones computed as lower tiles.
struct ProductCosts {
  int groups = 1;
  double packed_elements = 0, last_group_elements = 0;
  double gram = 0;    // X X^T
  double square = 0;  // an s x s x s product whose result is symmetric (A A, Q M, ...)
  double apply = 0;   // P X
  // One pass completing a symmetric matrix, priced as unpacking a summed Gram moves it: the
  // float32 triangle read, the whole matrix written. A one-rank mirror moves about half as
  // many bytes but takes about as long: 16 us per pass at 4096^2 bf16 on an H200 (10 passes,
  // 161 us, in the tenth session's profile), where this price gives 19 us at 3.5 TB/s.
  double unpack = 0;
};

ProductCosts product_costs(int64_t s, int64_t length, int ranks, const MachineModel& machine) {
  s = product_side(s, machine.short_side_multiple);
  length = padded_extent(length);
  const SymmetricTiles tiles = SymmetricTiles::split(s, machine.symmetric_block_target);
  // Products into full matrices on one rank have tiles of their own.
  const double product_elements = static_cast<double>(
      SymmetricTiles::for_products(s, machine.symmetric_block_target).packed_elements());
  ProductCosts cost;
  // The Gram runs (and is all-reduced) in groups of block columns; the last group's
  // reduction is the one left in the open.
  const int groups = (tiles.blocks() + kGramColumnsPerLaunch - 1) / kGramColumnsPerLaunch;
  cost.groups = groups;
  cost.packed_elements = static_cast<double>(tiles.packed_elements());
  cost.last_group_elements = static_cast<double>(
      tiles.packed_elements() - tiles.offset((groups - 1) * kGramColumnsPerLaunch));
  const double rate = machine.gemm_flops_per_second;
  const double gemms = machine.seconds_per_gemm;
  const double sd = static_cast<double>(s), ld = static_cast<double>(length);
  // A product's tiles run as one launch, or a summed Gram's one per group of block columns.
  cost.gram = ranks > 1 ? 2 * cost.packed_elements * ld / rate + groups * gemms
                        : 2 * product_elements * ld / rate + gemms;
  cost.square = 2 * product_elements * sd / rate + gemms;
  cost.apply = 2 * sd * sd * ld / rate + gemms;
  cost.unpack = (4 * cost.packed_elements + machine.element_bytes * sd * sd) /
                machine.memory_bytes_per_second;
  return cost;
}

// What a Gram summed over a group of `ranks` leaves in the open: the groups of block columns
// are summed while later ones are computed, so at least the last group's reduction.
double exposed_all_reduce_seconds(const ProductCosts& products, int ranks,
                                  const MachineModel& machine) {
  if (ranks <= 1) return 0.0;
  const double ring = 2.0 * (ranks - 1) / ranks;
  const double bytes_per_second = machine.all_reduce_bus_bytes_per_second;
  const double element = machine.gram_sum_bytes;
  const double all_reduce = products.groups * machine.seconds_per_collective +
                            element * products.packed_elements * ring / bytes_per_second;
  const double last_group = machine.seconds_per_collective +
                            element * products.last_group_elements * ring / bytes_per_second;
  return std::max(all_reduce - products.gram, last_group);
}

// The iterations proper on an s x length block, every Gram summed over `ranks` (1: none).
// The standard iteration: per step A = X X^T (lower tiles), P = a I + b A + c A A (lower
// tiles), X <- P X, and two passes completing the symmetric matrices. (c) and (e): see
// NsCostInputs.
double iterations_seconds(int64_t s, int64_t length, int ranks, const NsCostInputs& inputs,
                          const MachineModel& machine) {
  const ProductCosts products = product_costs(s, length, ranks, machine);
  const double gram = products.gram + exposed_all_reduce_seconds(products, ranks, machine);
  if (inputs.applied_twice) {
    return inputs.iterations * (gram + 2 * products.apply + products.unpack);
  }
  if (inputs.gram_iteration_restart <= 0) {
    return inputs.iterations * (gram + products.square + products.apply + 2 * products.unpack);
  }
  // Every symmetric product is completed for the next; at a restart Q is written as M.
  const double square = products.square + products.unpack;
  const int restart = inputs.gram_iteration_restart;
  double seconds = 0.0;
  for (int k = 0; k < inputs.iterations; ++k) {
    const bool first = k % restart == 0;
    const bool last = k + 1 == inputs.iterations || (k + 1) % restart == 0;
    seconds += square;                                   // Q = a I + b R + c R R
    seconds += first ? gram + products.unpack : square;  // R from X, or M <- Q M
    seconds += last ? products.apply : 2 * square;       // X <- M X, or R <- Q (R Q)
  }
  return seconds;
}

}  // namespace

double estimate_local_seconds(const NsCostInputs& inputs, const MachineModel& machine) {
  const int64_t rows = inputs.layout.rows(), cols = inputs.layout.cols();
  return iterations_seconds(std::min(rows, cols), std::max(rows, cols), 1, inputs, machine);
}

double estimate_duplicated_seconds(const NsCostInputs& inputs, const MachineModel& machine) {
  const ShardLayout& layout = inputs.layout;
  int64_t largest = 0;
  for (int64_t size : layout.shard_sizes()) largest = std::max(largest, size);
  const int64_t other_extent = layout.is_flat()            ? 1
                               : layout.sharded_dim() == 0 ? layout.cols()
                                                           : layout.rows();
  const double gathered_bytes = static_cast<double>(largest) * static_cast<double>(other_extent) *
                                machine.element_bytes * (inputs.ranks - 1);
  return machine.seconds_per_collective + gathered_bytes / machine.all_gather_bytes_per_second +
         estimate_local_seconds(inputs, machine);
}

double estimate_gram_all_reduce_seconds(const NsCostInputs& inputs, const MachineModel& machine) {
  const ShardLayout& layout = inputs.layout;
  const int64_t s = std::min(layout.rows(), layout.cols());
  const int64_t long_extent = std::max(layout.rows(), layout.cols());
  const bool redistributes = layout.sharded_dim() != layout.long_dim();
  // The slowest rank holds the longest block: its own shard, or ceil(L / P) after (d).
  int64_t length = (long_extent + inputs.ranks - 1) / inputs.ranks;
  if (!redistributes) {
    length = 0;
    for (int64_t size : layout.shard_sizes()) length = std::max(length, size);
  }
  double seconds = machine.seconds_per_collective +  // the norm
                   iterations_seconds(s, length, inputs.ranks, inputs, machine);
  if (redistributes) {  // two exchanges, a piece of each in the open
    const double moved = static_cast<double>(s) * static_cast<double>(length) *
                         machine.element_bytes * (inputs.ranks - 1) / inputs.ranks;
    seconds += 2 * (machine.seconds_per_collective +
                    moved / kExchangePieces / machine.all_to_all_bytes_per_second);
  }
  return seconds;
}

}  // namespace shardmuon
