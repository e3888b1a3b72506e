#include "core/newton_schulz.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/ns_cost_model.h"
#include "core/workspace_carver.h"

namespace shardmuon {
namespace {

char* byte_offset(void* base, int64_t bytes) {
  return static_cast<char*>(base) + bytes;
}
const char* byte_offset(const void* base, int64_t bytes) {
  return static_cast<const char*>(base) + bytes;
}

// X in the wide orientation (s x L, s <= L), restricted to a block of `length` of its L
// columns, seen as a column-major BLAS operand of the row-major data:
//  - long_side_is_cols (rows <= cols): the row-major block is s x length, which column-major
//    is X^T (length x s, leading dimension length);
//  - otherwise X = W^T: the row-major block is length x s, which column-major is
//    X itself (s x length, leading dimension s).
// Either way no data is transposed; only the GEMMs' transpose flags differ.
struct WideBlock {
  int64_t s = 0;
  int64_t length = 0;
  bool long_side_is_cols = true;

  // A block of `layout`'s shards, in its orientation: a square matrix takes the sharded dim
  // as its long side, so that (b) sums Grams of shards and never redistributes.
  static WideBlock of(const ShardLayout& layout, int64_t block_rows, int64_t block_cols) {
    return oriented(layout.long_dim() == 1, block_rows, block_cols);
  }
  // The whole matrix, as one rank iterates it alone (a replicated matrix, a group of one, or
  // (a) on its gathered copy): the long side is the columns unless rows > cols, as in
  // torch.optim.Muon, whatever the sharding, so that a square matrix's result does not depend
  // on the dim it is sharded along (bitwise: the gather is exact).
  static WideBlock whole(int64_t rows, int64_t cols) { return oriented(rows <= cols, rows, cols); }
  static WideBlock oriented(bool long_side_is_cols, int64_t block_rows, int64_t block_cols) {
    WideBlock block;
    block.long_side_is_cols = long_side_is_cols;
    block.s = long_side_is_cols ? block_rows : block_cols;
    block.length = long_side_is_cols ? block_cols : block_rows;
    return block;
  }
  int64_t elements() const { return s * length; }
  // The row-major storage of the block: rows x cols, leading dimension cols.
  int64_t storage_rows() const { return long_side_is_cols ? s : length; }
  int64_t storage_cols() const { return long_side_is_cols ? length : s; }

  // The block with both sides rounded up to a multiple of kProductAlignment elements, the
  // short side further to product_side(s, short_side_multiple). Zero rows and columns added
  // to X stay zero and change nothing else: X X^T gains zero rows and columns, P = a I + b A
  // + c A A is block-diagonal with a I on the padding, and P X keeps the padding zero (so do
  // (e)'s M X and (c)'s products). Iterating on the padded block lets the GEMMs use leading
  // dimensions whose rows are 16-byte aligned, which the tensor-core kernels need to run at
  // full rate (at 3001 x 10007 the unpadded products ran at a sixth of it), and the
  // symmetric products equal blocks.
  WideBlock padded(int64_t short_side_multiple) const {
    return WideBlock{product_side(s, short_side_multiple), padded_extent(length),
                     long_side_is_cols};
  }
  bool operator==(const WideBlock& other) const {
    return s == other.s && length == other.length && long_side_is_cols == other.long_side_is_cols;
  }
};

// Scratch buffers of one Newton-Schulz run on a block. The Gram A = X X^T and the
// polynomial P = a I + b A + c A A are symmetric: their products compute only the lower
// block columns (SymmetricTiles), written rounded to the storage dtype where they lie in full
// matrices whose upper triangles are then mirrored, as the operands of the next product. A
// Gram summed over a group is instead kept packed (in gram_sum_dtype), all-reduced, and
// unpacked.
struct IterationBuffers {
  WideBlock padded;              // what the products run on (WideBlock::padded)
  SymmetricTiles tiles;          // a summed Gram's packed tiles
  SymmetricTiles product_tiles;  // the tiles of products into full matrices
  void* x[2];                    // ping-pong iterates, storage dtype
  void* gram_packed;             // A's lower tiles, gram_sum_dtype, summed over a group
  void* gram_full;               // A, storage dtype, the operand of A A
  void* column_squares;          // |A_:i|^2 for P's diagonal, in the backend's column_square_parts
  void* poly_full;               // P, storage dtype, the operand of P X (not for (c))
  // (e) only: the accumulated polynomial M, and a spare full matrix for products.
  void* product_full;
  void* other_full;
  void* sum_of_squares;  // one per matrix of the batch
  void* reduce_scratch;
  size_t reduce_scratch_bytes;
  int64_t batch = 1;  // each buffer holds this many matrices' worth, one after another
};

struct IterationSlots {
  WideBlock padded;
  SymmetricTiles tiles, product_tiles;
  size_t x0, x1, gram_packed, gram_full, column_squares, poly_full, sum_of_squares, reduce_scratch;
  size_t product_full, other_full;
  size_t reduce_scratch_bytes;
  int64_t batch = 1;

  // The norm is taken over norm_elements values per matrix (the block's, or for (d) the
  // shard's, before it moves).
  static IterationSlots reserve(WorkspaceCarver& carver, const Backend& backend,
                                shardmuon_dtype dtype, const WideBlock& block,
                                NsPlan::Iteration iteration, bool summed_gram, int64_t batch,
                                int64_t norm_elements) {
    const bool gram_iteration = iteration == NsPlan::Iteration::kOnGram;
    const size_t storage = element_size(dtype);
    const size_t accumulate = element_size(accumulate_dtype(dtype));
    IterationSlots slots;
    slots.padded = block.padded(backend.short_side_multiple());
    const int64_t s = slots.padded.s;
    slots.tiles = SymmetricTiles::split(s, backend.symmetric_block_target());
    slots.product_tiles = backend.product_tiles(s);
    slots.batch = batch;
    const size_t packed = static_cast<size_t>(slots.tiles.packed_elements() * batch);
    const size_t full = static_cast<size_t>(s * s * batch);
    slots.x0 = carver.reserve(slots.padded.elements() * batch * storage);
    slots.x1 = carver.reserve(slots.padded.elements() * batch * storage);
    // The packed Gram, summed over a group: room for the accumulate dtype, which is at least
    // as wide as gram_sum_dtype (that depends on the communicator, which sizing does not
    // see). A Gram on one rank, like every other product, is written straight into its full
    // matrix.
    slots.gram_packed = carver.reserve(summed_gram ? packed * accumulate : 0);
    slots.gram_full = carver.reserve(full * storage);
    slots.column_squares = carver.reserve(
        static_cast<size_t>(backend.column_square_parts(s) * s * batch) * accumulate);
    // (c) has no polynomial matrix: it applies the Gram to X twice.
    slots.poly_full =
        carver.reserve(iteration == NsPlan::Iteration::kAppliedTwice ? 0 : full * storage);
    slots.product_full = carver.reserve(gram_iteration ? full * storage : 0);
    slots.other_full = carver.reserve(gram_iteration ? full * storage : 0);
    slots.sum_of_squares = carver.reserve(accumulate * batch);
    slots.reduce_scratch_bytes = backend.sum_of_squares_scratch_bytes(dtype, norm_elements, batch);
    slots.reduce_scratch = carver.reserve(slots.reduce_scratch_bytes);
    return slots;
  }

  IterationBuffers resolve(const WorkspaceCarver& carver) const {
    IterationBuffers buffers;
    buffers.padded = padded;
    buffers.tiles = tiles;
    buffers.product_tiles = product_tiles;
    buffers.x[0] = carver.pointer(x0);
    buffers.x[1] = carver.pointer(x1);
    buffers.gram_packed = carver.pointer(gram_packed);
    buffers.gram_full = carver.pointer(gram_full);
    buffers.column_squares = carver.pointer(column_squares);
    buffers.poly_full = carver.pointer(poly_full);
    buffers.product_full = carver.pointer(product_full);
    buffers.other_full = carver.pointer(other_full);
    buffers.sum_of_squares = carver.pointer(sum_of_squares);
    buffers.reduce_scratch = carver.pointer(reduce_scratch);
    buffers.reduce_scratch_bytes = reduce_scratch_bytes;
    buffers.batch = batch;
    return buffers;
  }
};

// A sub-matrix of a row-major buffer.
struct Block {
  int64_t row0, col0, rows, cols;
  int64_t elements() const { return rows * cols; }
};

// Piece `piece` of a long side of `extent`: [first, last), split at multiples of
// kProductAlignment elements (aligned operands for the products); the later pieces of a
// short side may be empty.
std::pair<int64_t, int64_t> piece_range(int64_t extent, int piece) {
  const int64_t width = padded_extent((extent + kExchangePieces - 1) / kExchangePieces);
  return {std::min(extent, piece * width), std::min(extent, (piece + 1) * width)};
}

// The geometry of (d) on one rank: the shards lie along the short side; each rank's
// long-side block comes from a balanced split of the long side.
struct Redistribution {
  std::vector<Block>
      to_target;  // my shard's part that becomes rank r's block (my shard's coordinates)
  std::vector<Block> from_source;     // rank r's part of my block (my block's coordinates)
  std::vector<int64_t> target_sizes;  // every rank's block along the long side
  int rank = 0, source_dim = 0;
  int64_t source_ld = 0, target_rows = 0, target_cols = 0;

  static Redistribution of(const ShardLayout& layout, int rank, int ranks) {
    const int source_dim = layout.sharded_dim();
    const std::vector<int64_t>& source_sizes = layout.shard_sizes();
    const std::vector<int64_t>& source_offsets = layout.shard_offsets();
    const int64_t long_extent = source_dim == 0 ? layout.cols() : layout.rows();
    Redistribution r;
    r.rank = rank;
    r.source_dim = source_dim;
    r.target_sizes = balanced_split(long_extent, ranks);
    const std::vector<int64_t> target_offsets = prefix_offsets(r.target_sizes);
    r.to_target.resize(ranks);
    r.from_source.resize(ranks);
    for (int peer = 0; peer < ranks; ++peer) {
      r.to_target[peer] =
          r.block_of(0, source_sizes[rank], target_offsets[peer], r.target_sizes[peer]);
      r.from_source[peer] =
          r.block_of(source_offsets[peer], source_sizes[peer], 0, r.target_sizes[rank]);
    }
    r.source_ld = source_dim == 0 ? layout.cols() : source_sizes[rank];
    r.target_rows = source_dim == 0 ? layout.rows() : r.target_sizes[rank];
    r.target_cols = source_dim == 0 ? r.target_sizes[rank] : layout.cols();
    return r;
  }

  // A block given by its range along the source dim and along the long side.
  Block block_of(int64_t source_start, int64_t source_length, int64_t long_start,
                 int64_t long_length) const {
    return source_dim == 0 ? Block{source_start, long_start, source_length, long_length}
                           : Block{long_start, source_start, long_length, source_length};
  }
  // The part of `block` from `first` to `last` along the long side, counted from its start.
  Block part_of(const Block& block, int64_t first, int64_t last) const {
    return source_dim == 0 ? Block{block.row0, block.col0 + first, block.rows, last - first}
                           : Block{block.row0 + first, block.col0, last - first, block.cols};
  }

  // Piece `piece` of my block's long side (piece_range).
  std::pair<int64_t, int64_t> my_piece(int piece) const {
    return piece_range(target_sizes[rank], piece);
  }
  // My shard's part of every rank's piece (my shard's coordinates).
  std::vector<Block> shard_parts(int piece) const {
    std::vector<Block> parts(to_target.size());
    for (size_t r = 0; r < parts.size(); ++r) {
      const auto range = piece_range(target_sizes[r], piece);
      parts[r] = part_of(to_target[r], range.first, range.second);
    }
    return parts;
  }
  // Every rank's part of my piece (my block's coordinates).
  std::vector<Block> block_parts(int piece) const {
    const auto range = my_piece(piece);
    std::vector<Block> parts(from_source.size());
    for (size_t r = 0; r < parts.size(); ++r) {
      parts[r] = part_of(from_source[r], range.first, range.second);
    }
    return parts;
  }
  // The staging one exchange of a piece needs, sent or received (the first piece is the
  // widest; the own part is copied directly).
  int64_t staged_elements() const {
    int64_t sent = 0, received = 0;
    const std::vector<Block> out = shard_parts(0), in = block_parts(0);
    for (size_t r = 0; r < out.size(); ++r) {
      if (static_cast<int>(r) == rank) continue;
      sent += out[r].elements();
      received += in[r].elements();
    }
    return std::max(sent, received);
  }
};

// Every rank sends send_blocks[r] of its buffer `src` to rank r and receives recv_blocks[r]
// of `dst` from rank r. Blocks are packed into contiguous staging buffers around one
// all-to-all; the rank's own block is copied directly.
void exchange_blocks(Backend& backend, Communicator& comm, size_t element, const void* src,
                     int64_t src_ld, const std::vector<Block>& send_blocks, void* dst,
                     int64_t dst_ld, const std::vector<Block>& recv_blocks, char* stage_send,
                     char* stage_recv, Stream stream) {
  const int ranks = comm.size();
  std::vector<size_t> send_bytes(ranks), send_offsets(ranks), recv_bytes(ranks),
      recv_offsets(ranks);
  size_t send_total = 0, recv_total = 0;
  auto at = [element](auto* base, int64_t ld, const Block& block) {
    return byte_offset(base, (block.row0 * ld + block.col0) * element);
  };
  for (int r = 0; r < ranks; ++r) {
    const Block& out = send_blocks[r];
    send_offsets[r] = send_total;
    recv_offsets[r] = recv_total;
    if (r == comm.rank()) {
      if (out.elements() > 0) {
        backend.copy_2d(at(dst, dst_ld, recv_blocks[r]), dst_ld * element, at(src, src_ld, out),
                        src_ld * element, out.cols * element, out.rows, stream);
      }
      continue;  // zero bytes through the all-to-all
    }
    send_bytes[r] = out.elements() * element;
    if (send_bytes[r] > 0) {
      backend.copy_2d(stage_send + send_total, out.cols * element, at(src, src_ld, out),
                      src_ld * element, out.cols * element, out.rows, stream);
    }
    send_total += send_bytes[r];
    recv_bytes[r] = recv_blocks[r].elements() * element;
    recv_total += recv_bytes[r];
  }
  comm.all_to_all(stage_send, send_bytes, send_offsets, stage_recv, recv_bytes, recv_offsets,
                  stream);
  for (int r = 0; r < ranks; ++r) {
    const Block& in = recv_blocks[r];
    if (recv_bytes[r] == 0) continue;
    backend.copy_2d(at(dst, dst_ld, in), dst_ld * element, stage_recv + recv_offsets[r],
                    in.cols * element, in.cols * element, in.rows, stream);
  }
}

// (d)'s two exchanges, piece by piece of the long side, on the backend's side stream: piece
// c of every rank's block arrives while the first Gram's product over piece c - 1 runs, and
// piece c of the result leaves while the last product computes piece c + 1. Only the first
// arrival and the last departure are left in the open (a quarter of each exchange).
class PiecewiseExchange {
 public:
  // Arrivals read the normalized shard and land in `block` (the iteration's padded block,
  // leading dimension block_ld); departures read the given result (same layout) and land
  // in the caller's shard.
  PiecewiseExchange(Backend& backend, Communicator& comm, const Redistribution& geometry,
                    size_t element, const void* normalized_shard, void* block, int64_t block_ld,
                    void* local_shard, char* stage_send, char* stage_recv, Stream stream)
      : backend_(backend),
        comm_(comm),
        geometry_(geometry),
        element_(element),
        normalized_shard_(normalized_shard),
        block_(block),
        block_ld_(block_ld),
        local_shard_(local_shard),
        stage_send_(stage_send),
        stage_recv_(stage_recv),
        side_(backend.side_stream(stream)) {}

  int pieces() const { return kExchangePieces; }
  // This rank's piece of its block: [first, last) along the long side.
  std::pair<int64_t, int64_t> range(int piece) const { return geometry_.my_piece(piece); }

  // Work enqueued on `stream` after this call starts once the piece has arrived. The first
  // arrival starts after the work already on `stream` (the normalization); the later ones
  // wait for nothing there, so they travel while the products run.
  void arrive(int piece, Stream stream) {
    if (piece == 0) backend_.order_after(side_, stream);
    exchange_blocks(backend_, comm_, element_, normalized_shard_, geometry_.source_ld,
                    geometry_.shard_parts(piece), block_, block_ld_, geometry_.block_parts(piece),
                    stage_send_, stage_recv_, side_);
    backend_.order_after(stream, side_);
  }
  // Sends the piece of `result` once the work already enqueued on `stream` is done.
  void depart(int piece, const void* result, Stream stream) {
    backend_.order_after(side_, stream);
    exchange_blocks(backend_, comm_, element_, result, block_ld_, geometry_.block_parts(piece),
                    local_shard_, geometry_.source_ld, geometry_.shard_parts(piece), stage_send_,
                    stage_recv_, side_);
  }
  // Work enqueued on `stream` afterwards starts once every piece has left.
  void finish(Stream stream) { backend_.order_after(stream, side_); }

 private:
  Backend& backend_;
  Communicator& comm_;
  const Redistribution& geometry_;
  size_t element_;
  const void* normalized_shard_;
  void* block_;
  int64_t block_ld_;
  void* local_shard_;
  char* stage_send_;
  char* stage_recv_;
  Stream side_;
};

// The products of the tiles (i, j), i >= j, of block columns [first, last) of `tiles`: one
// launch per tile shape (all tiles share one but those of the last block). `call` holds what every
// tile's product shares, its leading dimensions of C and D included when the tiles lie in a full
// matrix; with ldd == 0 they are packed tiles, whose leading dimension is their row count.
// operands(i, j) gives tile (i, j)'s pointers.
template <typename Operands>
void tile_products(Backend& backend, const SymmetricTiles& tiles, int first, int last,
                   GemmCall call, Operands&& operands, Stream stream) {
  struct Shape {
    int64_t m, n;
    std::vector<GemmOperands> products;
  };
  std::vector<Shape> shapes;
  for (int j = first; j < last; ++j) {
    for (int i = j; i < tiles.blocks(); ++i) {
      const int64_t m = tiles.width(i), n = tiles.width(j);
      auto shape = std::find_if(shapes.begin(), shapes.end(),
                                [&](const Shape& x) { return x.m == m && x.n == n; });
      if (shape == shapes.end()) {
        shape = shapes.insert(shapes.end(), Shape{m, n, {}});
        // Room for every tile left (hundreds at n = 4096: 528), grown once.
        shape->products.reserve((tiles.blocks() - j) * (tiles.blocks() - j + 1) / 2);
      }
      shape->products.push_back(operands(i, j));
    }
  }
  const bool packed = call.ldd == 0;
  for (const Shape& shape : shapes) {
    call.m = shape.m;
    call.n = shape.n;
    if (packed) call.ldc = call.ldd = shape.m;
    if (shape.products.size() == 1) {
      call.a = shape.products[0].a;
      call.b = shape.products[0].b;
      call.c = shape.products[0].c;
      call.d = shape.products[0].d;
    } else {
      call.products = shape.products.data();
      call.product_count = static_cast<int64_t>(shape.products.size());
    }
    backend.gemm(call, stream);
    call.products = nullptr;
    call.product_count = 0;
  }
}

// Rows of X as the operands of a Gram tile's product over the long-side columns from
// range_first on: `of` sets the call's transposes and leading dimensions, row_offset(r) is
// where row r of X starts in the block (elements).
struct GramOperand {
  int64_t row_step = 0;  // elements between rows of X
  int64_t range_offset = 0;

  static GramOperand of(const WideBlock& block, int64_t range_first, GemmCall& call) {
    GramOperand operand;
    if (block.long_side_is_cols) {  // operand is X^T (length x s): (X^T)^T X^T
      call.transpose_a = true;
      call.lda = call.ldb = block.length;
      operand.row_step = block.length;
      operand.range_offset = range_first;
    } else {  // operand is X (s x length): X X^T
      call.transpose_b = true;
      call.lda = call.ldb = block.s;
      operand.row_step = 1;
      operand.range_offset = range_first * block.s;
    }
    return operand;
  }
  int64_t row_offset(int64_t row) const { return row * row_step + range_offset; }
};

// A = X X^T of a whole block on one rank: every lower tile in one launch, written rounded to
// the storage dtype where it lies in the full matrix, whose upper triangle is then mirrored
// from the lower one (a pass over half the matrix; no float32 triangle to unpack). The
// mirroring pass also takes A's column squares (for P's diagonal). With one block the
// product is one plain GEMM, which wrote the upper triangle too: it is kept (see
// Backend::mirror_lower).
void local_gram_product(Backend& backend, shardmuon_dtype dtype, const WideBlock& block,
                        const void* x, const IterationBuffers& buffers, double shift,
                        Stream stream) {
  const size_t element = element_size(dtype);
  const SymmetricTiles& tiles = buffers.product_tiles;
  const int64_t s = tiles.n;
  GemmCall call;
  call.k = block.length;
  call.ab_type = call.cd_type = dtype;
  call.ldc = call.ldd = s;
  call.batch = buffers.batch;
  call.stride_a = call.stride_b = block.elements();
  call.stride_c = call.stride_d = s * s;
  const GramOperand operand = GramOperand::of(block, 0, call);
  tile_products(
      backend, tiles, 0, tiles.blocks(), call,
      [&](int i, int j) {
        GemmOperands tile;
        tile.a = byte_offset(x, operand.row_offset(tiles.start(i)) * element);
        tile.b = byte_offset(x, operand.row_offset(tiles.start(j)) * element);
        tile.d = byte_offset(buffers.gram_full, (tiles.start(i) + tiles.start(j) * s) * element);
        tile.c = tile.d;
        return tile;
      },
      stream);
  SymmetricDiagonal shifted;  // A_ii + shift where shifted (rounded twice there)
  if (shift != 0.0) {
    shifted.addend = buffers.gram_full;
    shifted.scale = 1.0;
    shifted.shift = shift;
  }
  backend.mirror_lower(buffers.gram_full, dtype, s, buffers.batch, shifted, buffers.column_squares,
                       tiles.blocks() == 1, stream);
}

// The dtype a Gram summed over a group is written, all-reduced and unpacked in: bfloat16 for
// bfloat16 storage where the communicator sums bfloat16, else the accumulate dtype. bfloat16
// moves half the bytes, and the products that follow read the Gram rounded to bfloat16 anyway;
// it rounds each rank's partial Gram once more. On 2 H200s (docs/BENCHMARKS.md, ninth session)
// a 4096^2 call went from 2.67 to 2.29 ms and 3001 x 10007 from 2.20 to 1.95 ms, the errors
// against float64 from 5.56e-3 to 5.85e-3 and 4.49e-3 to 4.86e-3 (tolerance 3e-2).
shardmuon_dtype gram_sum_dtype(shardmuon_dtype dtype, const Communicator& comm) {
  if (dtype == SHARDMUON_BFLOAT16 && comm.sums_bfloat16()) return dtype;
  return accumulate_dtype(dtype);
}

// A = X X^T summed over the group, from this rank's block of X's columns (the partial Gram
// of a long-side block): lower tiles only, packed in gram_sum_dtype, then unpacked for the
// next product. The block columns are summed kGramColumnsPerLaunch at a time, each group
// as soon as its tiles are computed, on the backend's side stream, so that one group's
// reduction overlaps the products of the next. With arrivals, X arrives piece by piece of
// the long side and each piece's products (summed into the tiles) run while the next piece
// travels.
void summed_gram_product(Backend& backend, Communicator& comm, shardmuon_dtype dtype,
                         const WideBlock& block, const void* x, const IterationBuffers& buffers,
                         double shift, Stream stream, PiecewiseExchange* arrivals) {
  const shardmuon_dtype sum_type = gram_sum_dtype(dtype, comm);
  const size_t element = element_size(dtype), sum_element = element_size(sum_type);
  const SymmetricTiles& tiles = buffers.tiles;
  const Stream side = backend.side_stream(stream);
  const int pieces = arrivals != nullptr ? arrivals->pieces() : 1;
  // Four block columns per launch, each group reduced as soon as it is done: the launches of
  // 512-wide columns one by one cost more than the overlap gained (8192 x 28672 over 2 H200s,
  // measured when the tiles came in: 32.1 / 30.7 / 30.3 ms with one / two / four).
  bool written = false;  // whether a product has written the tiles yet
  for (int piece = 0; piece < pieces; ++piece) {
    const auto range =
        arrivals != nullptr ? arrivals->range(piece) : std::pair<int64_t, int64_t>(0, block.length);
    if (arrivals != nullptr) arrivals->arrive(piece, stream);
    const bool last_piece = piece + 1 == pieces, empty = range.second == range.first;
    if (last_piece && !written && empty) {  // an empty block contributes nothing to the sum
      backend.fill_zero(buffers.gram_packed, tiles.packed_elements() * sum_element, stream);
    }
    for (int first = 0; first < tiles.blocks(); first += kGramColumnsPerLaunch) {
      const int last = std::min(tiles.blocks(), first + kGramColumnsPerLaunch);
      if (!empty) {
        // Tile (i, j) = X[rows of block i, range] X[rows of block j, range]^T.
        GemmCall call;
        call.k = range.second - range.first;
        call.beta = written ? 1.0 : 0.0;
        call.ab_type = dtype;
        call.cd_type = sum_type;
        call.batch = buffers.batch;
        call.stride_a = call.stride_b = block.elements();
        call.stride_c = call.stride_d = tiles.packed_elements();
        // Beside the previous group's all-reduce, or the next piece's arrival.
        call.overlaps_communication = !last_piece || first > 0;
        const GramOperand operand = GramOperand::of(block, range.first, call);
        void* packed = buffers.gram_packed;
        tile_products(
            backend, tiles, first, last, call,
            [&](int i, int j) {
              GemmOperands tile;
              tile.a = byte_offset(x, operand.row_offset(tiles.start(i)) * element);
              tile.b = byte_offset(x, operand.row_offset(tiles.start(j)) * element);
              tile.d = byte_offset(packed, tiles.tile_offset(i, j) * sum_element);
              tile.c = tile.d;
              return tile;
            },
            stream);
      }
      if (last_piece) {
        backend.order_after(side, stream);
        char* column = static_cast<char*>(buffers.gram_packed) + tiles.offset(first) * sum_element;
        comm.all_reduce_sum(column, tiles.offset(last) - tiles.offset(first), sum_type, side);
      }
    }
    written = written || !empty;
  }
  backend.order_after(stream, side);
  backend.unpack_symmetric(buffers.gram_packed, sum_type, tiles, buffers.batch, buffers.gram_full,
                           dtype, shift, buffers.column_squares, stream);
}

// A = X X^T (+ shift I) into buffers.gram_full, and its column squares into
// buffers.column_squares: on one rank (no comm), or summed over the group, X arriving piece by
// piece with arrivals ((d) only, which always has a group).
void gram_product(Backend& backend, Communicator* comm, shardmuon_dtype dtype,
                  const WideBlock& block, const void* x, const IterationBuffers& buffers,
                  Stream stream, PiecewiseExchange* arrivals = nullptr, double shift = 0.0) {
  if (comm != nullptr) {
    summed_gram_product(backend, *comm, dtype, block, x, buffers, shift, stream, arrivals);
    return;
  }
  if (arrivals != nullptr) fail(SHARDMUON_ERROR_INTERNAL, "a piecewise Gram needs a group");
  local_gram_product(backend, dtype, block, x, buffers, shift, stream);
}

// d = alpha A B + beta C (full s x s, storage dtype; C is read only where beta != 0) for
// operands whose product is symmetric: A A, or products of polynomials in the same Gram matrix,
// which commute. Every lower tile in one launch, written rounded where it lies in d; then the
// pass that mirrors the lower triangle to the upper one (unless one block, a plain GEMM,
// computed both), after `diagonal` (when it has squares) has set the diagonal, and which
// takes d's column squares into square_parts unless it is null. d must not be A or B. Over
// a batch, matrix i of each is i full matrices on.
void symmetric_product(Backend& backend, shardmuon_dtype dtype, const SymmetricTiles& tiles,
                       int64_t batch, const void* a, const void* b, void* d, Stream stream,
                       double alpha = 1.0, double beta = 0.0, const void* c = nullptr,
                       const SymmetricDiagonal& diagonal = SymmetricDiagonal{},
                       void* square_parts = nullptr) {
  const size_t element = element_size(dtype);
  const int64_t s = tiles.n;
  GemmCall call;
  call.k = s;
  call.alpha = alpha;
  call.beta = beta;
  call.lda = call.ldb = call.ldc = call.ldd = s;
  call.ab_type = call.cd_type = dtype;
  call.batch = batch;
  call.stride_a = call.stride_b = call.stride_c = call.stride_d = s * s;
  tile_products(
      backend, tiles, 0, tiles.blocks(), call,
      [&](int i, int j) {  // alpha A[rows of block i, :] B[:, columns of block j] + beta C[i, j]
        GemmOperands tile;
        const int64_t offset = (tiles.start(i) + tiles.start(j) * s) * element;
        tile.a = byte_offset(a, tiles.start(i) * element);
        tile.b = byte_offset(b, tiles.start(j) * s * element);
        tile.c = beta != 0.0 ? byte_offset(c, offset) : nullptr;
        tile.d = byte_offset(d, offset);
        return tile;
      },
      stream);
  backend.mirror_lower(d, dtype, s, batch, diagonal, square_parts, tiles.blocks() == 1, stream);
}

// P = a I + b A + c A A from A (storage dtype, full; exactly symmetric where its product had
// several blocks, symmetric to rounding where one GEMM wrote it whole): every lower tile is
// c A A + b A, rounded once where it lies in P (the GEMM's beta reads A), all in one launch;
// the pass that mirrors P's lower triangle then sets the diagonal to a + b A_ii + c |A_:i|^2,
// from A's column squares (summed in the accumulate dtype by the pass that made A), rounded
// once: a is added before rounding.
//
// Folding a I into P before rounding (rather than computing a X + B X) matters for bf16:
// where a singular value is near 1, a + b s^2 + c s^4 is far smaller than its terms (the
// quintic's first step maps 1 to 0.117 from terms of size 4 to 7), so rounding B = b A + c A A
// on its own would lose up to 35x more accuracy than rounding P, whose size is the result's.
void gram_polynomial(Backend& backend, shardmuon_dtype dtype, const Coefficients& coefficients,
                     const IterationBuffers& buffers, void* poly, Stream stream) {
  const void* a = buffers.gram_full;
  SymmetricDiagonal finish;
  finish.squares = buffers.column_squares;
  finish.square_scale = coefficients.c;
  finish.scale = coefficients.b;
  finish.addend = a;
  finish.shift = coefficients.a;
  symmetric_product(backend, dtype, buffers.product_tiles, buffers.batch, a, a, poly, stream,
                    coefficients.c, coefficients.b, a, finish);
}

// What a product by X adds: x_next = alpha P X + beta addend, the addend laid out as X (read
// only where beta != 0; it may be x_next itself, not X).
struct Scaled {
  double alpha = 1.0, beta = 0.0;
  const void* addend = nullptr;
};

// x_next = P X (scaled) for this block's columns of X (P is symmetric, so in the transposed view
// X^T P = (P X)^T), over columns [first, last) of the long side.
void multiply_columns(Backend& backend, shardmuon_dtype dtype, const WideBlock& block,
                      int64_t batch, const void* poly_storage, const void* x, void* x_next,
                      int64_t first, int64_t last, bool overlaps_communication, Stream stream,
                      const Scaled& scaled = Scaled{}) {
  if (last <= first) return;
  const size_t element = element_size(dtype);
  GemmCall call;
  call.batch = batch;
  const int64_t x_stride = block.elements(), poly_stride = block.s * block.s;
  call.stride_c = call.stride_d = x_stride;
  call.alpha = scaled.alpha;
  call.beta = scaled.beta;
  const void* addend = scaled.beta != 0.0 ? scaled.addend : x_next;
  call.ab_type = call.cd_type = dtype;
  call.overlaps_communication = overlaps_communication;
  if (block.long_side_is_cols) {  // X_next^T (length x s) = X^T P, rows first..last-1
    call.m = last - first;
    call.n = call.k = block.s;
    call.a = byte_offset(x, first * element);
    call.stride_a = x_stride;
    call.lda = block.length;
    call.b = poly_storage;
    call.stride_b = poly_stride;
    call.ldb = block.s;
    call.d = byte_offset(x_next, first * element);
    call.c = byte_offset(addend, first * element);
    call.ldc = call.ldd = block.length;
  } else {  // X_next (s x length) = P X, columns first..last-1
    call.m = call.k = block.s;
    call.n = last - first;
    call.a = poly_storage;
    call.stride_a = poly_stride;
    call.lda = block.s;
    call.b = byte_offset(x, first * block.s * element);
    call.stride_b = x_stride;
    call.ldb = block.s;
    call.d = byte_offset(x_next, first * block.s * element);
    call.c = byte_offset(addend, first * block.s * element);
    call.ldc = call.ldd = block.s;
  }
  backend.gemm(call, stream);
}

// x_next = P X (scaled). With departures, piece by piece of the long side, each piece leaving
// for its ranks while the next is computed.
void apply_polynomial(Backend& backend, shardmuon_dtype dtype, const WideBlock& block,
                      int64_t batch, const void* poly_storage, const void* x, void* x_next,
                      Stream stream, PiecewiseExchange* departures = nullptr,
                      const Scaled& scaled = Scaled{}) {
  if (departures == nullptr) {
    multiply_columns(backend, dtype, block, batch, poly_storage, x, x_next, 0, block.length, false,
                     stream, scaled);
    return;
  }
  for (int piece = 0; piece < departures->pieces(); ++piece) {
    const auto range = departures->range(piece);
    multiply_columns(backend, dtype, block, batch, poly_storage, x, x_next, range.first,
                     range.second, piece > 0, stream, scaled);
    departures->depart(piece, x_next, stream);
  }
  departures->finish(stream);
}

// Newton-Schulz proper: every iteration forms the Gram of X and multiplies X by the
// polynomial. Starts from buffers.x[0]; returns where the result is. With an exchange ((d)),
// X arrives during the first Gram and the result leaves during the last product.
const void* iterate_on_x(Backend& backend, Communicator* comm, const NsProblem& problem,
                         const IterationBuffers& buffers, void* data, bool staged,
                         PiecewiseExchange* exchange, Stream stream) {
  const WideBlock& padded = buffers.padded;
  const void* x = buffers.x[0];
  const size_t iterations = problem.coefficients.size();
  for (size_t k = 0; k < iterations; ++k) {
    void* x_next = k + 1 == iterations && !staged ? data : buffers.x[(k + 1) % 2];
    gram_product(backend, comm, problem.dtype, padded, x, buffers, stream,
                 k == 0 ? exchange : nullptr);
    gram_polynomial(backend, problem.dtype, problem.coefficients[k], buffers, buffers.poly_full,
                    stream);
    apply_polynomial(backend, problem.dtype, padded, buffers.batch, buffers.poly_full, x, x_next,
                     stream, k + 1 == iterations ? exchange : nullptr);
    x = x_next;
  }
  return x;
}

// (c): per iteration the Gram, shifted (S = A + shift I, AppliedTwiceStep), then Y = first_alpha
// S X + first_beta X and X' = S Y + second_beta X. X' overwrites X (a GEMM may write over its
// addend, not its operands), Y lies in the other buffer; the last X' lands in `data` unless
// staged. Starts from buffers.x[0]; returns where the result is. An exchange is used as by
// iterate_on_x.
const void* iterate_applied_twice(Backend& backend, Communicator* comm, const NsProblem& problem,
                                  const IterationBuffers& buffers, void* data, bool staged,
                                  PiecewiseExchange* exchange, Stream stream) {
  const WideBlock& padded = buffers.padded;
  const shardmuon_dtype dtype = problem.dtype;
  void* x = buffers.x[0];
  void* y = buffers.x[1];
  const size_t iterations = problem.coefficients.size();
  for (size_t k = 0; k < iterations; ++k) {
    const AppliedTwiceStep step = AppliedTwiceStep::of(problem.coefficients[k]);
    const bool last = k + 1 == iterations;
    gram_product(backend, comm, dtype, padded, x, buffers, stream, k == 0 ? exchange : nullptr,
                 step.shift);
    const void* s = buffers.gram_full;
    PiecewiseExchange* departures = last ? exchange : nullptr;
    const Scaled first{step.first_alpha, step.first_beta, x};
    if (step.one_product) {  // X' = Y, which must not be written over X (its operand)
      void* x_next = last && !staged ? data : y;
      apply_polynomial(backend, dtype, padded, buffers.batch, s, x, x_next, stream, departures,
                       first);
      y = x;
      x = x_next;
      continue;
    }
    apply_polynomial(backend, dtype, padded, buffers.batch, s, x, y, stream, nullptr, first);
    void* x_next = last && !staged ? data : x;
    apply_polynomial(backend, dtype, padded, buffers.batch, s, y, x_next, stream, departures,
                     Scaled{1.0, step.second_beta, x});
    x = x_next;
  }
  return x;
}

// (e) Gram Newton-Schulz. With R = X X^T, one step X' = Q X (Q = a I + b R + c R^2) gives
// R' = Q R Q, so the iteration can run on R alone, collecting M = Q_k ... Q_0, and X is
// multiplied once, by M, at the end. Q, R, M and R Q are polynomials in the first R, so they
// are symmetric and commute: every product is computed as lower block columns. The
// iteration restarts (X <- M X, R recomputed from it, M <- I) every gram_iteration_restart
// steps. An exchange is used as by iterate_on_x.
const void* iterate_on_gram(Backend& backend, Communicator* comm, const NsProblem& problem,
                            const IterationBuffers& buffers, void* data, bool staged,
                            PiecewiseExchange* exchange, Stream stream) {
  const shardmuon_dtype dtype = problem.dtype;
  const WideBlock& padded = buffers.padded;
  const SymmetricTiles& tiles = buffers.product_tiles;
  const size_t iterations = problem.coefficients.size();
  const size_t restart =
      static_cast<size_t>(gram_iteration_restart(dtype, static_cast<int>(iterations)));
  const int64_t batch = buffers.batch;
  // M and a spare full matrix trade places after M <- Q M, which cannot run in place.
  void* m = buffers.product_full;
  void* spare = buffers.other_full;
  const void* x = buffers.x[0];
  int next_x = 1;
  for (size_t k = 0; k < iterations; ++k) {
    const bool first = k % restart == 0;
    const bool last = k + 1 == iterations || (k + 1) % restart == 0;
    if (first) {  // R
      gram_product(backend, comm, dtype, padded, x, buffers, stream, k == 0 ? exchange : nullptr);
    }
    // Q, at a restart straight into M (M = Q).
    void* q = first ? m : buffers.poly_full;
    gram_polynomial(backend, dtype, problem.coefficients[k], buffers, q, stream);
    if (!first) {  // M <- Q M
      symmetric_product(backend, dtype, tiles, batch, q, m, spare, stream);
      std::swap(m, spare);
    }
    if (!last) {  // R <- Q (R Q)
      symmetric_product(backend, dtype, tiles, batch, buffers.gram_full, q, spare, stream);
      symmetric_product(backend, dtype, tiles, batch, q, spare, buffers.gram_full, stream, 1.0, 0.0,
                        nullptr, SymmetricDiagonal{}, buffers.column_squares);
      continue;
    }
    // X <- M X, at a restart or at the end.
    void* x_next = k + 1 == iterations && !staged ? data : buffers.x[next_x];
    apply_polynomial(backend, dtype, padded, batch, m, x, x_next, stream,
                     k + 1 == iterations ? exchange : nullptr);
    x = x_next;
    next_x = 1 - next_x;
  }
  return x;
}

// The plan's iteration: see iterate_on_x.
const void* iterate(Backend& backend, Communicator* comm, const NsProblem& problem,
                    const IterationBuffers& buffers, void* data, bool staged,
                    PiecewiseExchange* exchange, Stream stream) {
  switch (problem.plan.iteration) {
    case NsPlan::Iteration::kStandard: break;
    case NsPlan::Iteration::kOnGram:
      return iterate_on_gram(backend, comm, problem, buffers, data, staged, exchange, stream);
    case NsPlan::Iteration::kAppliedTwice:
      return iterate_applied_twice(backend, comm, problem, buffers, data, staged, exchange, stream);
  }
  return iterate_on_x(backend, comm, problem, buffers, data, staged, exchange, stream);
}

// buffers.sum_of_squares = the sum of squares of `count` values (per matrix of the batch),
// summed over the group when there is one.
void sum_of_squares_over_group(Backend& backend, Communicator* comm, shardmuon_dtype dtype,
                               const void* data, int64_t count, const IterationBuffers& buffers,
                               Stream stream) {
  const shardmuon_dtype accumulate = accumulate_dtype(dtype);
  if (count > 0) {
    backend.sum_of_squares(data, dtype, count, buffers.batch, buffers.sum_of_squares,
                           buffers.reduce_scratch, buffers.reduce_scratch_bytes, stream);
  } else {
    backend.fill_zero(buffers.sum_of_squares, element_size(accumulate) * buffers.batch, stream);
  }
  if (comm != nullptr) comm->all_reduce_sum(buffers.sum_of_squares, 1, accumulate, stream);
}

// Normalizes and iterates on a long-side block in place. With comm, the block is one of
// the group's blocks and the norm and every Gram are summed over the group (algorithm (b));
// without, the block is the whole matrix.
void iterate_on_block(Backend& backend, Communicator* comm, const NsProblem& problem,
                      const WideBlock& block, void* data, const IterationBuffers& buffers,
                      Stream stream) {
  const shardmuon_dtype dtype = problem.dtype;
  const int64_t count = block.elements(), batch = buffers.batch;
  sum_of_squares_over_group(backend, comm, dtype, data, count, buffers, stream);
  // Unless the block is aligned already, X is staged in the padded block (zero outside
  // the data) as it is normalized, and copied back after the last product.
  const WideBlock& padded = buffers.padded;
  const bool staged = !(padded == block);
  const size_t element = element_size(dtype);
  if (staged) {
    backend.divide_by_norm_padded(data, block.storage_rows(), block.storage_cols(), buffers.x[0],
                                  padded.storage_rows(), padded.storage_cols(), dtype, batch,
                                  buffers.sum_of_squares, problem.eps, stream);
  } else if (count > 0) {
    backend.divide_by_norm(data, buffers.x[0], dtype, count, batch, buffers.sum_of_squares,
                           problem.eps, stream);
  }

  // The iterates alternate between the two scratch buffers; unstaged, the last one lands
  // in `data`, so the caller's memory is written only by the final product.
  const void* x = iterate(backend, comm, problem, buffers, data, staged, nullptr, stream);
  // Back to the caller's matrices: the whole batch in one pitched copy when only the columns
  // are padded (its rows then follow each other at both pitches), else matrix by matrix.
  if (staged && count > 0) {
    const size_t row_bytes = block.storage_cols() * element;
    const size_t pitch = padded.storage_cols() * element;
    if (padded.storage_rows() == block.storage_rows()) {
      backend.copy_2d(data, row_bytes, x, pitch, row_bytes, block.storage_rows() * batch, stream);
    } else {
      for (int64_t i = 0; i < batch; ++i) {
        backend.copy_2d(static_cast<char*>(data) + i * count * element, row_bytes,
                        static_cast<const char*>(x) + i * padded.elements() * element, pitch,
                        row_bytes, block.storage_rows(), stream);
      }
    }
  }
}

// Where a plan's scratch lies in the workspace. Laid out once before the ranks agree to go
// ahead, to grow the workspace (so that a failed allocation is reported to every rank rather
// than leaving the others in a collective), and again, identically, to run.
struct Scratch {
  WorkspaceCarver carver;
  WideBlock block;  // what the iteration runs on
  IterationSlots iteration;
  size_t gathered = 0, matrix = 0, gather_block_bytes = 0;  // (a)
  size_t normalized = 0, stage_send = 0, stage_recv = 0;    // (d)

  static Scratch lay_out(const Backend& backend, const NsProblem& problem, int rank, int ranks) {
    const ShardLayout& layout = problem.layout;
    const size_t element = element_size(problem.dtype);
    Scratch scratch;
    switch (problem.plan.algorithm) {
      case NsPlan::Algorithm::kLocal:
        scratch.block = WideBlock::whole(layout.rows(), layout.cols());
        break;
      case NsPlan::Algorithm::kDuplicated: {
        // Uneven shards are gathered as equal blocks padded to the largest shard.
        int64_t largest = 0;
        for (int r = 0; r < ranks; ++r) largest = std::max(largest, layout.local_elements(r));
        scratch.gather_block_bytes = largest * element;
        scratch.gathered = scratch.carver.reserve(scratch.gather_block_bytes * ranks);
        scratch.matrix = scratch.carver.reserve(layout.rows() * layout.cols() * element);
        scratch.block = WideBlock::whole(layout.rows(), layout.cols());
        break;
      }
      case NsPlan::Algorithm::kGramAllReduce:
        if (!problem.plan.redistributes) {
          scratch.block = WideBlock::of(layout, layout.local_rows(rank), layout.local_cols(rank));
        } else {
          const Redistribution r = Redistribution::of(layout, rank, ranks);
          scratch.normalized = scratch.carver.reserve(layout.local_elements(rank) * element);
          const int64_t staged = r.staged_elements();
          scratch.stage_send = scratch.carver.reserve(staged * element);
          scratch.stage_recv = scratch.carver.reserve(staged * element);
          scratch.block = WideBlock::of(layout, r.target_rows, r.target_cols);
        }
        break;
    }
    // The norm is taken where X lies when it starts: (d) takes it on the shard, before it moves.
    const bool moves =
        problem.plan.algorithm == NsPlan::Algorithm::kGramAllReduce && problem.plan.redistributes;
    const int64_t norm_elements = moves ? layout.local_elements(rank) : scratch.block.elements();
    const bool summed_gram = problem.plan.algorithm == NsPlan::Algorithm::kGramAllReduce;
    scratch.iteration =
        IterationSlots::reserve(scratch.carver, backend, problem.dtype, scratch.block,
                                problem.plan.iteration, summed_gram, problem.batch, norm_elements);
    return scratch;
  }

  char* at(size_t slot) const { return static_cast<char*>(carver.pointer(slot)); }
};

// What the work of iterate_on_block without a group depends on (Backend::run_recorded): the
// problem, the block widths and padding the backend chooses, and where the matrix and the
// iteration's buffers lie (IterationSlots::reserve lays them out from x[0] on, by the rest).
std::vector<int64_t> local_iteration_key(const Backend& backend, const NsProblem& problem,
                                         const void* data, const IterationBuffers& buffers) {
  const auto bits = [](double value) {
    int64_t integer = 0;
    std::memcpy(&integer, &value, sizeof integer);
    return integer;
  };
  const auto address = [](const void* pointer) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(pointer));
  };
  const ShardLayout& layout = problem.layout;
  std::vector<int64_t> key = {problem.dtype,
                              layout.rows(),
                              layout.cols(),
                              buffers.padded.long_side_is_cols,
                              static_cast<int64_t>(problem.plan.algorithm),
                              static_cast<int64_t>(problem.plan.iteration),
                              problem.batch,
                              bits(problem.eps),
                              backend.symmetric_block_target(),
                              backend.short_side_multiple(),
                              address(data),
                              address(buffers.x[0])};
  for (const Coefficients& step : problem.coefficients) {
    key.insert(key.end(), {bits(step.a), bits(step.b), bits(step.c)});
  }
  return key;
}

// iterate_on_block on one rank without a group (a local plan, or (a) on its gathered matrix),
// its launches recorded and replayed by the backend (Backend::run_recorded).
void iterate_on_block_alone(Backend& backend, const NsProblem& problem, const Scratch& scratch,
                            void* data, Stream stream) {
  const IterationBuffers buffers = scratch.iteration.resolve(scratch.carver);
  backend.run_recorded(
      local_iteration_key(backend, problem, data, buffers), stream, [&](Stream recorded) {
        iterate_on_block(backend, nullptr, problem, scratch.block, data, buffers, recorded);
      });
}

// (a): gather the whole matrix on every rank, iterate, keep the own shard.
void run_duplicated(Backend& backend, Communicator& comm, const NsProblem& problem,
                    const Scratch& scratch, void* local_shard, Stream stream) {
  const ShardLayout& layout = problem.layout;
  const int rank = comm.rank();
  const size_t element = element_size(problem.dtype);
  const int64_t rows = layout.rows(), cols = layout.cols();
  const std::vector<int64_t>& sizes = layout.shard_sizes();
  const std::vector<int64_t>& offsets = layout.shard_offsets();
  const size_t block_bytes = scratch.gather_block_bytes;
  char* gathered = scratch.at(scratch.gathered);
  char* matrix = scratch.at(scratch.matrix);

  const size_t own_bytes = layout.local_elements(rank) * element;
  if (own_bytes > 0) {
    backend.copy_2d(gathered + rank * block_bytes, own_bytes, local_shard, own_bytes, own_bytes, 1,
                    stream);
  }
  comm.all_gather_in_place(gathered, block_bytes, stream);

  // Block r of the gathered buffer is rank r's row-major shard; place it in the matrix.
  const bool contiguous = layout.shards_are_contiguous();
  for (int r = 0; r < comm.size(); ++r) {
    if (sizes[r] == 0) continue;
    if (contiguous) {
      const size_t bytes = layout.local_elements(r) * element;
      backend.copy_2d(matrix + layout.element_offset(r) * element, bytes,
                      gathered + r * block_bytes, bytes, bytes, 1, stream);
    } else {
      backend.copy_2d(matrix + offsets[r] * element, cols * element, gathered + r * block_bytes,
                      sizes[r] * element, sizes[r] * element, rows, stream);
    }
  }

  iterate_on_block_alone(backend, problem, scratch, matrix, stream);

  if (sizes[rank] == 0) return;
  if (contiguous) {
    backend.copy_2d(local_shard, own_bytes, matrix + layout.element_offset(rank) * element,
                    own_bytes, own_bytes, 1, stream);
  } else {
    backend.copy_2d(local_shard, sizes[rank] * element, matrix + offsets[rank] * element,
                    cols * element, sizes[rank] * element, rows, stream);
  }
}

// (d): the shards lie along the short side. Normalize them where they lie (the norm of the
// matrix is the sum of its shards' squares), move them to a balanced split along the long
// side while the first Gram is computed, run (b) there, and move the result back while the
// last product is computed (PiecewiseExchange).
void run_redistributed(Backend& backend, Communicator& comm, const NsProblem& problem,
                       const Scratch& scratch, void* local_shard, Stream stream) {
  const Redistribution r = Redistribution::of(problem.layout, comm.rank(), comm.size());
  const shardmuon_dtype dtype = problem.dtype;
  const size_t element = element_size(dtype);
  const IterationBuffers buffers = scratch.iteration.resolve(scratch.carver);
  const int64_t count = problem.layout.local_elements(comm.rank());
  char* normalized = scratch.at(scratch.normalized);
  sum_of_squares_over_group(backend, &comm, dtype, local_shard, count, buffers, stream);
  if (count > 0) {
    backend.divide_by_norm(local_shard, normalized, dtype, count, 1, buffers.sum_of_squares,
                           problem.eps, stream);
  }
  const WideBlock& padded = buffers.padded;
  if (!(padded == scratch.block)) {  // the padding stays zero; the pieces land around it
    backend.fill_zero(buffers.x[0], padded.elements() * element, stream);
  }
  PiecewiseExchange exchange(backend, comm, r, element, normalized, buffers.x[0],
                             padded.storage_cols(), local_shard, scratch.at(scratch.stage_send),
                             scratch.at(scratch.stage_recv), stream);
  iterate(backend, &comm, problem, buffers, nullptr, true, &exchange, stream);
}

}  // namespace

AppliedTwiceStep AppliedTwiceStep::of(const Coefficients& coefficients) {
  const double a = coefficients.a, b = coefficients.b, c = coefficients.c;
  AppliedTwiceStep step;
  if (c == 0.0) {  // X' = b A X + a X
    step.first_alpha = b;
    step.first_beta = a;
    step.one_product = true;
    return step;
  }
  const double delta = a - b * b / (4.0 * c);
  if (c * delta > 0.0) {  // p(t) = c (t - m)^2 + delta, m = -b / (2 c): S = A - m I
    step.shift = b / (2.0 * c);
    step.first_alpha = c;
    step.second_beta = delta;
  } else {
    step.first_alpha = c;
    step.first_beta = b;
    step.second_beta = a;
  }
  return step;
}

NsPlan plan_newton_schulz(const ShardLayout& layout, int comm_size,
                          const shardmuon_ns_options& options) {
  const shardmuon_ns_algorithm requested = options.algorithm;
  const int iterations = options.num_iterations;
  // The distributions the request allows, each with the iterations it allows; the cheapest
  // by the cost model (the first of equals), the same on every rank.
  std::vector<NsPlan> distributions(1);  // local: nothing to communicate
  if (layout.is_sharded() && comm_size > 1) {
    NsPlan duplicated;
    duplicated.algorithm = NsPlan::Algorithm::kDuplicated;
    NsPlan gram;
    gram.algorithm = NsPlan::Algorithm::kGramAllReduce;
    gram.redistributes = layout.sharded_dim() != layout.long_dim();
    // Flat shards are not blocks of the long side; the callers reject GRAM_ALLREDUCE for them.
    if (layout.is_flat() || requested == SHARDMUON_NS_DUPLICATED) {
      distributions = {duplicated};
    } else if (requested == SHARDMUON_NS_GRAM_ALLREDUCE ||
               requested == SHARDMUON_NS_GRAM_APPLIED_TWICE) {
      distributions = {gram};
    } else {
      // (b) wins for large matrices (it splits the long side's products and moves s^2 per
      // iteration); (a) for small ones, whose time goes to the fixed costs of (b)'s collectives.
      distributions = {gram, duplicated};
    }
  }
  // DUPLICATED and GRAM_ALLREDUCE name the standard iteration, GRAM_NEWTON_SCHULZ (e),
  // GRAM_APPLIED_TWICE (c) (on one rank too, where nothing is communicated). AUTO takes (e)
  // where it is cheaper (a long side well above the short one), and (c) where it is cheaper on
  // a Gram summed over a group (a short side above twice the block's length). With the
  // restarts (gram_iteration_restart) (e) is as accurate as the standard iteration
  // (docs/BENCHMARKS.md: bench/ns_accuracy.py and the GPU tables). (c) is not considered on one
  // rank: there it takes more flops than the standard iteration at every shape (5 s^2 L against
  // 3 s^2 L + s^3), though one pass fewer, which the model would let win at small sizes.
  using Iteration = NsPlan::Iteration;
  std::vector<Iteration> iteration_kinds{Iteration::kStandard, Iteration::kOnGram,
                                         Iteration::kAppliedTwice};
  if (requested == SHARDMUON_NS_GRAM_NEWTON_SCHULZ) iteration_kinds = {Iteration::kOnGram};
  if (requested == SHARDMUON_NS_GRAM_APPLIED_TWICE) iteration_kinds = {Iteration::kAppliedTwice};
  if (requested == SHARDMUON_NS_DUPLICATED || requested == SHARDMUON_NS_GRAM_ALLREDUCE) {
    iteration_kinds = {Iteration::kStandard};
  }
  // Not CANS under AUTO: its second and third steps (4.18, -3.11, 0.58), (3.96, -2.95, 0.56)
  // have near double roots (delta / a = 0.005, 0.022), where the shifted Gram's rounding in bf16,
  // amplified by the schedule's sensitivity there, took (c)'s error on 67 x 131 to 0.17-0.57 of
  // the result's norm against the standard iteration's 0.024 (docs/DESIGN_NOTES.md). The dtype
  // is not known here, and a plan must not depend on it, so float32 is left out too; a request
  // for (c) with CANS is refused (validate_ns_options).
  if (requested == SHARDMUON_NS_AUTO && options.schedule == SHARDMUON_SCHEDULE_CANS) {
    iteration_kinds = {Iteration::kStandard, Iteration::kOnGram};
  }
  const MachineModel machine;
  const NsCostInputs inputs{layout, comm_size, iterations};
  NsPlan best;
  double best_seconds = std::numeric_limits<double>::infinity();
  for (Iteration iteration : iteration_kinds) {
    for (NsPlan plan : distributions) {
      const bool summed_gram = plan.algorithm == NsPlan::Algorithm::kGramAllReduce;
      if (iteration == Iteration::kAppliedTwice && !summed_gram &&
          requested != SHARDMUON_NS_GRAM_APPLIED_TWICE) {
        continue;
      }
      plan.iteration = iteration;
      const double seconds = estimate_plan_seconds(plan, inputs, machine);
      if (seconds < best_seconds) {
        best = plan;
        best_seconds = seconds;
      }
    }
  }
  return best;
}

void check_algorithm_fits_layout(shardmuon_ns_algorithm requested, const ShardLayout& layout,
                                 const std::string& where) {
  const bool gram =
      requested == SHARDMUON_NS_GRAM_ALLREDUCE || requested == SHARDMUON_NS_GRAM_APPLIED_TWICE;
  SHARDMUON_CHECK_ARG(
      !(gram && layout.is_flat()), where, ": algorithm ",
      requested == SHARDMUON_NS_GRAM_ALLREDUCE ? "GRAM_ALLREDUCE" : "GRAM_APPLIED_TWICE",
      " needs shards along dim 0 or 1, and the layout is flat (", layout.describe(),
      "); use AUTO, DUPLICATED or, in a step, OWNER");
}

shardmuon_ns_algorithm reported_algorithm(const NsPlan& plan) {
  switch (plan.algorithm) {
    case NsPlan::Algorithm::kLocal: return SHARDMUON_NS_LOCAL;
    case NsPlan::Algorithm::kDuplicated: return SHARDMUON_NS_DUPLICATED;
    case NsPlan::Algorithm::kGramAllReduce:
      return plan.redistributes ? SHARDMUON_NS_GRAM_ALLREDUCE_REDISTRIBUTED
                                : SHARDMUON_NS_GRAM_ALLREDUCE;
  }
  return SHARDMUON_NS_LOCAL;
}

double estimate_plan_seconds(const NsPlan& plan, const NsCostInputs& inputs,
                             const MachineModel& machine) {
  NsCostInputs priced = inputs;
  // The model is of bf16, so (e) restarts as bf16 does.
  priced.gram_iteration_restart =
      plan.gram_iteration() ? gram_iteration_restart(SHARDMUON_BFLOAT16, inputs.iterations) : 0;
  priced.applied_twice = plan.applied_twice();
  switch (plan.algorithm) {
    case NsPlan::Algorithm::kLocal: return estimate_local_seconds(priced, machine);
    case NsPlan::Algorithm::kDuplicated: return estimate_duplicated_seconds(priced, machine);
    case NsPlan::Algorithm::kGramAllReduce:
      return estimate_gram_all_reduce_seconds(priced, machine);
  }
  return 0.0;
}

size_t newton_schulz_workspace_bytes(const Backend& backend, const NsProblem& problem, int rank,
                                     int ranks) {
  return Scratch::lay_out(backend, problem, rank, ranks).carver.total_bytes();
}

void run_newton_schulz(Backend& backend, Communicator& comm, const NsProblem& problem,
                       void* local_shard, Stream stream, size_t workspace_offset) {
  if (problem.batch < 1 || problem.batch > kMaxNsBatch ||
      (problem.batch > 1 && problem.plan.algorithm != NsPlan::Algorithm::kLocal)) {
    fail(SHARDMUON_ERROR_INTERNAL, "a batch of ", problem.batch, " matrices (batches are of 1 to ",
         kMaxNsBatch, " matrices, on one rank)");
  }
  Scratch scratch = Scratch::lay_out(backend, problem, comm.rank(), comm.size());
  char* base = static_cast<char*>(
      backend.workspace(workspace_offset + scratch.carver.total_bytes(), stream));
  scratch.carver.bind(base + workspace_offset);
  switch (problem.plan.algorithm) {
    case NsPlan::Algorithm::kLocal:
      iterate_on_block_alone(backend, problem, scratch, local_shard, stream);
      return;
    case NsPlan::Algorithm::kDuplicated:
      run_duplicated(backend, comm, problem, scratch, local_shard, stream);
      return;
    case NsPlan::Algorithm::kGramAllReduce:
      if (problem.plan.redistributes) {
        run_redistributed(backend, comm, problem, scratch, local_shard, stream);
      } else {  // (b): the shards already lie along the long side
        iterate_on_block(backend, &comm, problem, scratch.block, local_shard,
                         scratch.iteration.resolve(scratch.carver), stream);
      }
      return;
  }
  fail(SHARDMUON_ERROR_INTERNAL, "unknown Newton-Schulz plan");
}

}  // namespace shardmuon
