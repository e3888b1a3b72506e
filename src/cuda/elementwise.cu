#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/elementwise.cuh"
#include "cuda/float_conversions.cuh"
#include "cuda/kernel_launch.cuh"

namespace shardmuon {
namespace {

constexpr int kThreads = 256;

unsigned int grid_for(int64_t count) {
  // Grid-stride loops: enough blocks to fill an H200 several times over, no more.
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

// 1 / max(sqrt(sum), eps), and 0 rather than inf where that maximum is 0 (a zero sum with eps
// 0): every division's scale, in the arithmetic of the CPU backend's NormScale.
__device__ __forceinline__ float norm_scale(float sum_of_squares, float eps) {
  const float norm = fmaxf(sqrtf(sum_of_squares), eps);
  return norm > 0.0f ? 1.0f / norm : 0.0f;
}

// y = x * norm_scale(sum, eps), with a zero sum giving y = 0 rather than 0 * inf; vector
// blockIdx.y of a batch, with its own sum.
template <typename T>
__global__ void divide_by_norm_kernel(const T* x, T* y, int64_t count, const float* sums_of_squares,
                                      float eps) {
  const int64_t base = blockIdx.y * count;
  const float scale = norm_scale(sums_of_squares[blockIdx.y], eps);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[base + i] = from_float<T>(to_float(x[base + i]) * scale);
  }
}

// The same, 16 bytes of each matrix at a time, where every matrix and y start 16-byte
// aligned and each matrix's count is a whole number of vectors: the scalar kernel's 2-byte
// bf16 accesses leave the copy at half the memory bandwidth. Elementwise, so the values are
// the scalar kernel's.
template <typename T>
__global__ void divide_by_norm_vector_kernel(const T* x, T* y, int64_t count,
                                             const float* sums_of_squares, float eps) {
  constexpr int kWidth = sizeof(uint4) / sizeof(T);
  const int64_t vectors = count / kWidth;
  const uint4* in = reinterpret_cast<const uint4*>(x + blockIdx.y * count);
  uint4* out = reinterpret_cast<uint4*>(y + blockIdx.y * count);
  const float scale = norm_scale(sums_of_squares[blockIdx.y], eps);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vectors;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint4 vector = in[i];
    T* values = reinterpret_cast<T*>(&vector);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) values[j] = from_float<T>(to_float(values[j]) * scale);
    out[i] = vector;
  }
}

// divide_by_norm_kernel's division into a padded copy: matrix blockIdx.y of y (padded_rows x
// padded_cols, row-major) = that of x (rows x cols) scaled, zero outside x's rows and columns.
// It stages an unaligned block into the padded one the products run on in one pass, where
// zeroing, copying and dividing took three (at 3001 x 10007 bf16 on an H200: 32 us, against
// 14, 63 and 30 us).
// A block takes a row at a time, each thread 16 bytes of it (padded_cols is a multiple of
// kWidth and y is 16-byte aligned): one vector store, and loads of single elements, since a
// row of x may start at any element.
template <typename T>
__global__ void divide_by_norm_padded_kernel(const T* x, int64_t rows, int64_t cols, T* y,
                                             int64_t padded_rows, int64_t padded_cols,
                                             const float* sums_of_squares, float eps) {
  constexpr int kWidth = sizeof(uint4) / sizeof(T);
  const int64_t row_vectors = padded_cols / kWidth;
  const T* in = x + blockIdx.y * rows * cols;
  uint4* out = reinterpret_cast<uint4*>(y + blockIdx.y * padded_rows * padded_cols);
  const float scale = norm_scale(sums_of_squares[blockIdx.y], eps);
  for (int64_t r = blockIdx.x; r < padded_rows; r += gridDim.x) {
    const T* row = in + (r < rows ? r : 0) * cols;
    for (int64_t v = threadIdx.x; v < row_vectors; v += blockDim.x) {
      uint4 vector;
      T* values = reinterpret_cast<T*>(&vector);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const int64_t c = v * kWidth + j;
        values[j] = from_float<T>(r < rows && c < cols ? to_float(row[c]) * scale : 0.0f);
      }
      out[r * row_vectors + v] = vector;
    }
  }
}

// The sums of squares of a batch of vectors in two passes, each in a fixed order (the same
// result every run): block (chunk, b) sums a chunk of vector b into partials[b][chunk], then
// one block per vector sums its partials. Several blocks per vector keep every SM busy when
// the batch is a few large matrices. A chunk's elements between its first and last 16-byte
// boundaries are loaded 16 bytes at a time, the few before and after singly (a vector of a
// batch, and a chunk, may start at any element): with 2-byte bf16 loads the pass read 3001 x
// 10007 at about 2.4 TB/s on an H200.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    chunk_sum_of_squares_kernel(const T* x, int64_t count, int64_t chunk_length, float* partials) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  constexpr int kWidth = sizeof(uint4) / sizeof(T);
  const T* vector = x + blockIdx.y * count;
  const int64_t begin = blockIdx.x * chunk_length;
  const int64_t end = begin + chunk_length < count ? begin + chunk_length : count;
  const int64_t length = end > begin ? end - begin : 0;
  // Elements before the first 16-byte boundary (x is aligned to its element), then the body.
  const uintptr_t misalignment = reinterpret_cast<uintptr_t>(vector + begin) % sizeof(uint4);
  const int64_t to_boundary = misalignment == 0 ? 0 : (sizeof(uint4) - misalignment) / sizeof(T);
  const int64_t head = to_boundary < length ? to_boundary : length;
  const int64_t vectors = (length - head) / kWidth;
  const int64_t tail_begin = begin + head + vectors * kWidth;
  const uint4* body = reinterpret_cast<const uint4*>(vector + begin + head);
  float partial = 0.0f;
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
    const uint4 loaded = body[v];
    const T* values = reinterpret_cast<const T*>(&loaded);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) {
      const float value = to_float(values[j]);
      partial += value * value;
    }
  }
  // The head and the tail, each shorter than a vector, one element per thread.
  if (threadIdx.x < head) {
    const float value = to_float(vector[begin + threadIdx.x]);
    partial += value * value;
  }
  if (tail_begin + threadIdx.x < end) {
    const float value = to_float(vector[tail_begin + threadIdx.x]);
    partial += value * value;
  }
  const float sum = Reduce(storage).Sum(partial);
  if (threadIdx.x == 0) partials[blockIdx.y * int64_t{gridDim.x} + blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const float* partials, int64_t chunks, float* sums) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  float partial = 0.0f;
  for (int64_t i = threadIdx.x; i < chunks; i += kThreads) {
    partial += partials[blockIdx.x * chunks + i];
  }
  const float sum = Reduce(storage).Sum(partial);
  if (threadIdx.x == 0) sums[blockIdx.x] = sum;
}

// Chunks per vector of a batched sum: at least 8192 elements each, about 2048 blocks over the
// batch at most.
int64_t chunks_per_vector(int64_t count, int64_t batch) {
  constexpr int64_t kMinChunk = 8192, kMaxBlocks = 2048;
  const int64_t wanted = (count + kMinChunk - 1) / kMinChunk;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, kMaxBlocks / batch));
}

// unpack_symmetric, one 64 x 64 tile pair per thread block: tile (I, J) of the lower triangle
// (I >= J, in tiles; the grid holds only those) is read once from the packed tiles (float32,
// or bfloat16 for a Gram summed in bfloat16), four rows per thread (one load of a run of four
// down its columns), and written to its own place and, transposed through shared memory, to
// tile (J, I), four rows per thread again. On a diagonal tile the entries above the diagonal
// come from their mirror images below it, so the result is exactly symmetric. The side n is a
// multiple of 4 (the products' sides are multiples of 8), so a run never straddles the edge,
// and every run starts at a multiple of 4 in the packed layout (its block starts are multiples
// of 32, its widths and heights of 4) and in dst.
struct PackedTriangle {
  static constexpr int kMaxBlocks = 64;
  int64_t n;
  int64_t packed_elements;
  int blocks;
  int64_t starts[kMaxBlocks + 1];
  int64_t offsets[kMaxBlocks + 1];

  // The block holding row (or column) r.
  __device__ int block_of(int64_t r) const {
    int i = 0;
    while (r >= starts[i + 1]) ++i;
    return i;
  }
};

// SymmetricTiles::packed_index of entry (r, c), r in block i and c in block j <= i, split into
// what depends on the column and what on the row: offsets[j] + (starts[i] - starts[j]) w_j +
// (c - starts[j]) w_i + (r - starts[i]) = column_base + starts[i] w_j + column_in_block w_i +
// row_in_block.
struct PackedColumn {
  int64_t base;  // offsets[j] - starts[j] w_j
  int64_t width;
  int64_t in_block;
};
struct PackedRow {
  int64_t start, width, in_block;
  __device__ int64_t index(const PackedColumn& column) const {
    return column.base + start * column.width + column.in_block * width + in_block;
  }
};

constexpr int kTile = 64;
// The kTile-wide tiles along a side of an n x n matrix. A column's squares come in as many
// parts, one per band of tiles (Backend::column_square_parts).
__host__ __device__ inline int64_t tiles_per_side(int64_t n) {
  return (n + kTile - 1) / kTile;
}
constexpr int kTileThreads = 256;  // threads of a block over a 64 x 64 tile

// Both symmetric passes move runs of kRunRows consecutive entries of a column a thread, one
// access of 8 (bf16) or 16 (float32) bytes: Run<T>::type, stored, or widened to float32 (the
// passes compute in float32) and made from it, rounded to nearest even. Their callers keep
// every run at an index that is a multiple of kRunRows, on buffers aligned to kRunRows entries.
constexpr int kRunRows = 4;
template <typename T>
struct Run;
template <>
struct Run<float> {
  using type = float4;
  __device__ static void widen(type run, float (&values)[kRunRows]) {
    values[0] = run.x;
    values[1] = run.y;
    values[2] = run.z;
    values[3] = run.w;
  }
  __device__ static type make(const float (&values)[kRunRows]) {
    return make_float4(values[0], values[1], values[2], values[3]);
  }
};
template <>
struct Run<__nv_bfloat16> {
  using type = uint2;  // two bf16 pairs, rows r, r + 1 in .x and r + 2, r + 3 in .y
  __device__ static void widen(type run, float (&values)[kRunRows]) {
    const float2 low = __bfloat1622float2(bit_cast<__nv_bfloat162>(run.x));
    const float2 high = __bfloat1622float2(bit_cast<__nv_bfloat162>(run.y));
    values[0] = low.x;
    values[1] = low.y;
    values[2] = high.x;
    values[3] = high.y;
  }
  __device__ static type make(const float (&values)[kRunRows]) {
    return make_uint2(bit_cast<unsigned int>(__floats2bfloat162_rn(values[0], values[1])),
                      bit_cast<unsigned int>(__floats2bfloat162_rn(values[2], values[3])));
  }

 private:
  template <typename To, typename From>
  __device__ static To bit_cast(From from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
    To to;
    memcpy(&to, &from, sizeof(To));
    return to;
  }
};
template <typename T>
using RunType = typename Run<T>::type;
template <typename T>
__device__ __forceinline__ RunType<T> load_run(const T* x, int64_t index) {
  return *reinterpret_cast<const RunType<T>*>(x + index);
}
// A plain assignment of a float2 or float4 run here came out of the compiler as 2 or 4
// scalar stores (in the PTX of every instantiation with a float32 destination); __stwb (a
// store with the default write-back policy) is one vector store.
template <typename T>
__device__ __forceinline__ void store_run(T* x, int64_t index, const float (&values)[kRunRows]) {
  __stwb(reinterpret_cast<RunType<T>*>(x + index), Run<T>::make(values));
}

// A block's threads over a 64 x 64 tile: kRunRows rows each down a column, kX of them to a
// tile column, kY columns at a time, kColumnsPerThread columns in all.
struct TileThreads {
  static constexpr int kX = kTile / kRunRows;
  static constexpr int kY = kTileThreads / kX;
  static constexpr int kColumnsPerThread = kTile / kY;
};

// The lower 64 x 64 tile (I, J), I >= J, of block k of the grid: the diagonal tiles first
// (k = I), then the others (k = tiles + I (I - 1) / 2 + J, J < I). A diagonal tile does the
// most work (it adds up column squares, or sums both its triangles), so it starts in the
// first wave rather than last.
__device__ void lower_tile_of(int64_t k, int64_t tiles, int64_t& tile_row, int64_t& tile_col) {
  if (k < tiles) {
    tile_row = tile_col = k;
    return;
  }
  k -= tiles;  // below the diagonal: row I >= 1 holds I tiles
  tile_row = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(k) + 1.0) + 1.0) / 2.0);
  while (tile_row * (tile_row - 1) / 2 > k) --tile_row;
  while ((tile_row + 1) * tile_row / 2 <= k) ++tile_row;
  tile_col = k - tile_row * (tile_row - 1) / 2;
}

// The unpacking's loads: this thread's runs (rows r to r + kRunRows - 1, as stored) of the
// lower 64 x 64 tile's columns col0 + y, y = threadIdx.y + k kY for k < kColumnsPerThread, all
// issued before any is used. Before f984a11 each was loaded, widened and stored into shared
// memory before the next load was issued: one load in flight per warp. Loading all first took
// an 8192^2 unpacking from 141 to 111 us (float32 source) and from 135 to 110 us (bf16), about
// 1.25x (docs/BENCHMARKS.md, twenty-ninth session). The mirroring pass did not gain that way,
// in pairs of rows (its registers went from 32 to 47, its blocks per SM from 8 to 5) or in
// runs of four (the same times within 1%, 48 registers for float32; thirty-first session), and
// loads one run at a time.
// Runs outside the matrix or wholly above the diagonal are not loaded; a run that crosses
// the diagonal is loaded whole: its entries above the diagonal of a diagonal tile, which the
// packed layout holds too (its blocks' starts are multiples of 32), are never used.
// index_of(y) is the index of entry (r, col0 + y), a multiple of kRunRows.
__device__ __forceinline__ bool run_on_or_below_diagonal(int64_t r, int64_t c, int64_t n) {
  return r < n && c < n && r + (kRunRows - 1) >= c;
}
template <typename T, typename IndexOf>
__device__ __forceinline__ void load_lower_runs(
    const T* source, int64_t r, int64_t col0, int64_t n, IndexOf index_of,
    RunType<T> (&runs)[TileThreads::kColumnsPerThread]) {
#pragma unroll
  for (int k = 0; k < TileThreads::kColumnsPerThread; ++k) {
    const int y = threadIdx.y + k * TileThreads::kY;
    runs[k] = RunType<T>{};
    if (run_on_or_below_diagonal(r, col0 + y, n)) runs[k] = load_run(source, index_of(y));
  }
}

// Column squares in parts (Backend::column_square_parts: one per 64-row band of tiles),
// from a lower tile (I, J) held in shared memory as tile[column][row] (a diagonal tile: its
// entries on and below the diagonal), already rounded as stored. Its columns' sums are part I
// of the columns of block J; below the diagonal, its rows' sums, which are the columns of the
// mirror tile (J, I), are part J of the columns of block I. So every part of every column is
// written by exactly one tile. A diagonal tile sums the columns of the symmetric tile. Every
// thread of the block takes a quarter of a column and of a row (scratch holds the quarters),
// added in a fixed order: the same bits every call. All the block's kTileThreads threads
// must call it.
constexpr int kQuarter = kTile / 4;
__device__ void write_square_parts(const float (*tile)[kTile + 1], float (*scratch)[kTile],
                                   int64_t tile_row, int64_t tile_col, int64_t n, float* parts) {
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  const int lane = thread % kTile, quarter = thread / kTile;  // 4 quarters of 64 threads
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  const int rows = n - row0 < kTile ? static_cast<int>(n - row0) : kTile;
  const int cols = n - col0 < kTile ? static_cast<int>(n - col0) : kTile;
  const bool diagonal = tile_row == tile_col;
  float column_sum = 0.0f, row_sum = 0.0f;  // of column `lane`, of row `lane`
  for (int i = quarter * kQuarter; i < (quarter + 1) * kQuarter; ++i) {
    if (lane < cols && i < rows) {  // entry (i, lane), or above a diagonal its mirror
      const float value = !diagonal || i >= lane ? tile[lane][i] : tile[i][lane];
      column_sum += value * value;
    }
    if (!diagonal && lane < rows && i < cols) row_sum += tile[i][lane] * tile[i][lane];
  }
  scratch[quarter][lane] = column_sum;
  scratch[4 + quarter][lane] = row_sum;
  __syncthreads();
  if (thread < cols) {
    parts[tile_row * n + col0 + thread] =
        ((scratch[0][thread] + scratch[1][thread]) + scratch[2][thread]) + scratch[3][thread];
  } else if (!diagonal && thread >= kTile && thread < kTile + rows) {
    const int x = thread - kTile;
    parts[tile_col * n + row0 + x] =
        ((scratch[4][x] + scratch[5][x]) + scratch[6][x]) + scratch[7][x];
  }
}

// This thread's run of column c = col0 + y, rows r to r + kRunRows - 1, of a lower tile held in
// shared memory as tile[column][row], stored: entries on and below the diagonal from
// tile[y][row], those above it (the upper triangle of a diagonal tile) from their mirror
// images tile[row][y].
template <typename T>
__device__ __forceinline__ void store_tile_run(const float (*tile)[kTile + 1], int row_in_tile,
                                               int y, int64_t r, int64_t c, int64_t n, T* matrix) {
  float values[kRunRows];
#pragma unroll
  for (int j = 0; j < kRunRows; ++j) {
    values[j] = r + j >= c ? tile[y][row_in_tile + j] : tile[row_in_tile + j][y];
  }
  store_run(matrix, c * n + r, values);
}

// The mirror of an off-diagonal lower tile (I, J), held in shared memory as tile[column][row]:
// tile (J, I). With row0 = 64 I, col0 = 64 J and R = kRunRows, its column row0 + y, rows
// col0 + R x to col0 + R x + R - 1, holds the lower entries (row0 + y, col0 + R x + j). Each
// thread stores runs, as the threads of TileThreads load them.
template <typename T>
__device__ void store_mirror_tile(const float (*tile)[kTile + 1], int64_t tile_row,
                                  int64_t tile_col, int64_t n, T* matrix) {
  const int row_in_tile = kRunRows * threadIdx.x;
  const int64_t upper_row = tile_col * kTile + row_in_tile;
  for (int y = threadIdx.y; y < kTile; y += TileThreads::kY) {
    const int64_t upper_col = tile_row * kTile + y;
    if (upper_row >= n || upper_col >= n) continue;
    float values[kRunRows];
#pragma unroll
    for (int j = 0; j < kRunRows; ++j) values[j] = tile[row_in_tile + j][y];
    store_run(matrix, upper_col * n + upper_row, values);
  }
}

// unpack_symmetric in runs of four rows a thread (TileThreads: 8-byte bf16 and 16-byte
// float32 accesses). Against f984a11's pairs of rows, 1.17-1.19x faster from float32 and
// 1.23-1.25x from bf16 sources, 1.06-1.09x to float32, at 8192^2 and 16384^2 on an H200, where
// the kernel is bound by the instructions it issues, not by its bytes (docs/BENCHMARKS.md,
// thirtieth session). The side is a multiple of 4 (the library's are multiples of 8), so the
// packed layout's block starts (multiples of 32), widths and offsets keep every run at an
// index that is a multiple of 4, and a run never straddles a block or the edge.
template <typename Source, typename Destination>
__global__ void __launch_bounds__(kTileThreads)
    unpack_symmetric_kernel(const Source* packed_batch,
                            const __grid_constant__ PackedTriangle layout, Destination* dst_batch,
                            float shift, float* parts_batch) {
  // Matrix blockIdx.y of a batch.
  const Source* packed = packed_batch + blockIdx.y * layout.packed_elements;
  Destination* dst = dst_batch + blockIdx.y * layout.n * layout.n;
  int64_t tile_row = 0, tile_col = 0;
  lower_tile_of(blockIdx.x, tiles_per_side(layout.n), tile_row, tile_col);

  __shared__ float tile[kTile][kTile + 1];  // [column][row] of the lower tile (I, J)
  __shared__ PackedColumn columns[kTile];
  const int64_t n = layout.n;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  constexpr int R = kRunRows;
  const int thread = threadIdx.y * TileThreads::kX + threadIdx.x;
  if (thread < kTile && col0 + thread < n) {
    const int64_t c = col0 + thread;
    const int j = layout.block_of(c);
    const int64_t width = layout.starts[j + 1] - layout.starts[j];
    columns[thread] = {layout.offsets[j] - layout.starts[j] * width, width, c - layout.starts[j]};
  }
  __syncthreads();

  const int row_in_tile = R * threadIdx.x;
  const int64_t r = row0 + row_in_tile;  // this thread's rows are r to r + R - 1, in one block
  PackedRow row{};
  if (r < n) {
    const int i = layout.block_of(r);
    row = {layout.starts[i], layout.starts[i + 1] - layout.starts[i], r - layout.starts[i]};
  }
  RunType<Source> runs[TileThreads::kColumnsPerThread];
  load_lower_runs(
      packed, r, col0, n, [&](int y) { return row.index(columns[y]); }, runs);
#pragma unroll
  for (int k = 0; k < TileThreads::kColumnsPerThread; ++k) {
    const int y = threadIdx.y + k * TileThreads::kY;
    const int64_t c = col0 + y;
    if (!run_on_or_below_diagonal(r, c, n)) continue;
    // Held as stored: shifted on the diagonal, rounded to the destination's dtype.
    float values[R];
    Run<Source>::widen(runs[k], values);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (r + j < c) continue;
      const float value = values[j] + (r + j == c ? shift : 0.0f);
      tile[y][row_in_tile + j] = to_float(from_float<Destination>(value));
    }
  }
  __syncthreads();

  // Tile (I, J) in place: column c, rows r to r + R - 1; above the diagonal (diagonal tiles
  // only, where row0 == col0) the mirror entry tile[row][column].
  for (int y = threadIdx.y; y < kTile; y += TileThreads::kY) {
    const int64_t c = col0 + y;
    if (r >= n || c >= n) continue;
    store_tile_run(tile, row_in_tile, y, r, c, n, dst);
  }
  if (tile_row != tile_col) store_mirror_tile(tile, tile_row, tile_col, n, dst);
  // The squares last, while the stores drain.
  if (parts_batch != nullptr) {
    __shared__ float scratch[8][kTile];
    write_square_parts(tile, scratch, tile_row, tile_col, n,
                       parts_batch + blockIdx.y * tiles_per_side(n) * n);
  }
}

// mirror_lower, one 64 x 64 tile pair per thread block as in unpack_symmetric_kernel: the lower
// tile (I, J) is read into shared memory, then written transposed to tile (J, I), or, on a
// diagonal tile, to its own upper triangle, whose diagonal is set first when there is an
// addend (and its column squares, their parts added in a fixed order, when there are some,
// else none). Without kStoreUpper (a product that wrote both triangles) nothing above the
// diagonal is written, and a tile is read only for the squares. In runs of four rows a thread,
// as the unpacking: against a52e10d's pairs, 1.17-1.20x faster at 8192^2 and 16384^2 bf16 on
// an H200 (docs/BENCHMARKS.md, thirty-first session).
template <typename T, bool kStoreUpper>
__global__ void __launch_bounds__(kTileThreads)
    mirror_lower_kernel(T* matrix_batch, int64_t n, const float* squares_batch, float square_scale,
                        float scale, const T* addend_batch, float shift, float* parts_batch) {
  T* matrix = matrix_batch + blockIdx.y * n * n;
  int64_t tile_row = 0, tile_col = 0;
  const int64_t parts = tiles_per_side(n);  // the column squares' parts
  lower_tile_of(blockIdx.x, parts, tile_row, tile_col);

  __shared__ float tile[kTile][kTile + 1];  // [column][row] of the lower tile (I, J)
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  constexpr int R = kRunRows;
  const int row_in_tile = R * threadIdx.x;
  const int64_t r = row0 + row_in_tile;  // this thread's rows are r to r + R - 1 (n % R == 0)
  constexpr int kY = TileThreads::kY;
  for (int y = threadIdx.y; y < kTile && (kStoreUpper || parts_batch != nullptr); y += kY) {
    const int64_t c = col0 + y;
    if (!run_on_or_below_diagonal(r, c, n)) continue;
    float values[R];
    Run<T>::widen(load_run(matrix, c * n + r), values);
#pragma unroll
    for (int j = 0; j < R; ++j) tile[y][row_in_tile + j] = values[j];  // above the diagonal: unread
  }
  // A diagonal tile whose diagonal is set: the addend's column squares (when there are some),
  // each from its parts, a quarter of them per thread (loads issued beside the tile's), the
  // quarters then added.
  __shared__ float scratch[8][kTile];
  const int thread = threadIdx.y * TileThreads::kX + threadIdx.x;
  const bool sets_diagonal = tile_row == tile_col && addend_batch != nullptr;
  if (sets_diagonal && squares_batch != nullptr) {
    const int lane = thread % kTile, quarter = thread / kTile;
    float sum = 0.0f;
    if (col0 + lane < n) {
      const float* squares = squares_batch + blockIdx.y * parts * n + col0 + lane;
#pragma unroll 8
      for (int64_t k = quarter; k < parts; k += 4) sum += squares[k * n];
    }
    scratch[quarter][lane] = sum;
  }
  __syncthreads();
  if (sets_diagonal) {
    const int64_t c = col0 + thread;
    if (thread < kTile && c < n) {
      const float square = squares_batch == nullptr
                               ? 0.0f
                               : ((scratch[0][thread] + scratch[1][thread]) + scratch[2][thread]) +
                                     scratch[3][thread];
      const float addend = to_float(addend_batch[blockIdx.y * n * n + c * n + c]);
      const T value = from_float<T>(shift + scale * addend + square_scale * square);
      matrix[c * n + c] = value;
      tile[thread][thread] = to_float(value);
    }
    __syncthreads();
  }

  if constexpr (kStoreUpper) {
    if (tile_row == tile_col) {
      // The upper triangle of this tile: column c, the runs holding a row r + j < c, each
      // stored whole, its entries on and below the diagonal as they were read or set (the
      // same values again, from this block only).
      for (int y = threadIdx.y; y < kTile; y += kY) {
        const int64_t c = col0 + y;
        if (r >= n || c >= n || r >= c) continue;
        store_tile_run(tile, row_in_tile, y, r, c, n, matrix);
      }
    } else {
      store_mirror_tile(tile, tile_row, tile_col, n, matrix);
    }
  }
  // The squares last, while the stores drain.
  if (parts_batch != nullptr) {
    write_square_parts(tile, scratch, tile_row, tile_col, n, parts_batch + blockIdx.y * parts * n);
  }
}

PackedTriangle packed_triangle_of(const SymmetricTiles& tiles) {
  if (tiles.blocks() > PackedTriangle::kMaxBlocks) {
    fail(SHARDMUON_ERROR_INTERNAL, "the symmetric passes take at most ", PackedTriangle::kMaxBlocks,
         " blocks, not ", tiles.blocks());
  }
  if (tiles.n % kRunRows != 0) {
    fail(SHARDMUON_ERROR_INTERNAL, "unpack_symmetric_cuda takes a side that is a multiple of ",
         kRunRows, ", not ", tiles.n);
  }
  PackedTriangle layout{};
  layout.n = tiles.n;
  layout.packed_elements = tiles.packed_elements();
  layout.blocks = tiles.blocks();
  for (int j = 0; j <= tiles.blocks(); ++j) {
    layout.starts[j] = tiles.starts[j];
    layout.offsets[j] = tiles.offset(j);
  }
  return layout;
}

// Whether a buffer of `element`-byte entries is aligned to a run of kRunRows entries.
bool aligned_to_runs(const void* buffer, size_t element) {
  return reinterpret_cast<uintptr_t>(buffer) % (kRunRows * element) == 0;
}

// One block per lower 64 x 64 tile, the batch along y.
dim3 lower_tile_grid(int64_t n, int64_t batch) {
  const int64_t tiles = tiles_per_side(n);
  const int64_t lower_tiles = tiles * (tiles + 1) / 2;
  if (lower_tiles > int64_t{0x7fffffff})
    fail(SHARDMUON_ERROR_UNSUPPORTED, "matrix side ", n, " too large");
  if (batch > 65535) fail(SHARDMUON_ERROR_UNSUPPORTED, "batch ", batch, " above 65535");
  return dim3(static_cast<unsigned int>(lower_tiles), static_cast<unsigned int>(batch));
}

__global__ void fill_pointer_arrays_kernel(const PointerArraySource source, void** a, void** b,
                                           void** c, void** d) {
  void** arrays[4] = {a, b, c, d};
  const int64_t total = source.products * source.batch;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t product = t / source.batch, matrix = t % source.batch;
    for (int operand = 0; operand < 4; ++operand) {
      arrays[operand][t] = const_cast<char*>(source.operands[operand][product]) +
                           matrix * source.stride_bytes[operand];
    }
  }
}

template <typename T>
void launch_divide_by_norm(const T* x, T* y, int64_t count, dim3 grid, bool vectors,
                           const float* sums, float eps, cudaStream_t stream) {
  launch_kernel("divide_by_norm_kernel",
                vectors ? divide_by_norm_vector_kernel<T> : divide_by_norm_kernel<T>, grid,
                dim3(kThreads), stream, x, y, count, sums, eps);
}

// Rows of row_bytes bytes, every address and size a multiple of sizeof(Unit), one thread block
// per row at a time. A row's bytes between its destination's first and last 16-byte boundaries
// (its body) are stored as 16-byte vectors, each gathered from the source Unit by Unit (a row of
// the source may lie at any Unit offset from one of the destination); the bytes before and after
// the body (its edges, under 16 each) go Unit by Unit. On an H200 a 3001 x 10007 bf16 matrix
// (rows of 20014 bytes) takes 34 us (3.5 TB/s), where Unit-sized stores throughout took 61.
template <typename Unit>
__global__ void copy_rows_kernel(char* dst, size_t dst_pitch, const char* src, size_t src_pitch,
                                 size_t row_bytes, size_t rows) {
  constexpr int kUnitsPerVector = sizeof(uint4) / sizeof(Unit);
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    char* out = dst + row * dst_pitch;
    const char* in = src + row * src_pitch;
    const size_t misalignment = reinterpret_cast<uintptr_t>(out) % sizeof(uint4);
    const size_t head = misalignment == 0 ? 0 : min(row_bytes, sizeof(uint4) - misalignment);
    const size_t vectors = (row_bytes - head) / sizeof(uint4);
    const size_t body_end = head + vectors * sizeof(uint4);
    const size_t edge_units = (head + row_bytes - body_end) / sizeof(Unit);
    for (size_t i = threadIdx.x; i < edge_units; i += blockDim.x) {
      const size_t offset =
          i * sizeof(Unit) < head ? i * sizeof(Unit) : body_end + i * sizeof(Unit) - head;
      *reinterpret_cast<Unit*>(out + offset) = *reinterpret_cast<const Unit*>(in + offset);
    }
    for (size_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      const Unit* from = reinterpret_cast<const Unit*>(in + head + v * sizeof(uint4));
      uint4 vector;
      Unit* units = reinterpret_cast<Unit*>(&vector);
#pragma unroll
      for (int j = 0; j < kUnitsPerVector; ++j) units[j] = from[j];
      *reinterpret_cast<uint4*>(out + head + v * sizeof(uint4)) = vector;
    }
  }
}

template <typename Unit>
void launch_copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                      size_t row_bytes, size_t rows, cudaStream_t stream) {
  const unsigned int blocks = static_cast<unsigned int>(std::min<size_t>(rows, 16384));
  launch_kernel("copy_rows_kernel", copy_rows_kernel<Unit>, dim3(blocks), dim3(kThreads), stream,
                static_cast<char*>(dst), dst_pitch, static_cast<const char*>(src), src_pitch,
                row_bytes, rows);
}

}  // namespace

void copy_2d_cuda(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                  size_t rows, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  // cudaMemcpy2DAsync stages a 3001 x 10007 bf16 matrix into a 3008 x 10008 one (rows of
  // 20014 bytes at pitches 20014 and 20016) in 91 us on an H200 (1.3 TB/s); copy_rows_kernel
  // copies such rows back in 34 us (3.5 TB/s).
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         dst_pitch | src_pitch | row_bytes;
  if (rows == 1 || bits % 16 == 0) {
    check_cuda(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                 cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpy2DAsync");
  } else if (bits % 8 == 0) {
    launch_copy_rows<uint2>(dst, dst_pitch, src, src_pitch, row_bytes, rows, stream);
  } else if (bits % 4 == 0) {
    launch_copy_rows<uint32_t>(dst, dst_pitch, src, src_pitch, row_bytes, rows, stream);
  } else if (bits % 2 == 0) {
    launch_copy_rows<uint16_t>(dst, dst_pitch, src, src_pitch, row_bytes, rows, stream);
  } else {
    launch_copy_rows<uint8_t>(dst, dst_pitch, src, src_pitch, row_bytes, rows, stream);
  }
}

void fill_pointer_arrays_cuda(const PointerArraySource& source, void** arrays[4],
                              cudaStream_t stream) {
  const int64_t total = source.products * source.batch;
  const unsigned int blocks = static_cast<unsigned int>(std::min<int64_t>((total + 255) / 256, 64));
  launch_kernel("fill_pointer_arrays_kernel", fill_pointer_arrays_kernel, dim3(blocks), dim3(256),
                stream, source, arrays[0], arrays[1], arrays[2], arrays[3]);
}

// One chunked two-pass reduction for every batch, one matrix included: a library reduction
// (cub::DeviceReduce) would query the device's occupancy on the host at every call, about
// 30 us before the first kernel of a call.
size_t sum_of_squares_scratch_bytes_cuda(shardmuon_dtype, int64_t count, int64_t batch) {
  return static_cast<size_t>(batch * chunks_per_vector(count, batch)) * sizeof(float);
}

void sum_of_squares_cuda(const void* x, shardmuon_dtype dtype, int64_t count, int64_t batch,
                         void* result, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  if (batch == 0) return;
  if (batch > 65535) fail(SHARDMUON_ERROR_UNSUPPORTED, "batch ", batch, " above 65535");
  const int64_t chunks = chunks_per_vector(count, batch);
  if (scratch_bytes < static_cast<size_t>(batch * chunks) * sizeof(float)) {
    fail(SHARDMUON_ERROR_INTERNAL, "sum_of_squares_cuda: scratch of ", scratch_bytes,
         " bytes for a batch of ", batch);
  }
  const int64_t chunk_length = (count + chunks - 1) / chunks;
  float* partials = static_cast<float*>(scratch);
  const dim3 grid(static_cast<unsigned int>(chunks), static_cast<unsigned int>(batch));
  if (dtype == SHARDMUON_BFLOAT16) {
    launch_kernel("chunk_sum_of_squares_kernel", chunk_sum_of_squares_kernel<__nv_bfloat16>, grid,
                  dim3(kThreads), stream, static_cast<const __nv_bfloat16*>(x), count, chunk_length,
                  partials);
  } else {
    launch_kernel("chunk_sum_of_squares_kernel", chunk_sum_of_squares_kernel<float>, grid,
                  dim3(kThreads), stream, static_cast<const float*>(x), count, chunk_length,
                  partials);
  }
  launch_kernel("sum_partials_kernel", sum_partials_kernel, dim3(static_cast<unsigned int>(batch)),
                dim3(kThreads), stream, partials, chunks, static_cast<float*>(result));
}

void divide_by_norm_cuda(const void* x, void* y, shardmuon_dtype dtype, int64_t count,
                         int64_t batch, const void* sum_of_squares, double eps,
                         cudaStream_t stream) {
  if (batch > 65535) fail(SHARDMUON_ERROR_UNSUPPORTED, "batch ", batch, " above 65535");
  const float* sums = static_cast<const float*>(sum_of_squares);
  const size_t element = dtype == SHARDMUON_BFLOAT16 ? sizeof(__nv_bfloat16) : sizeof(float);
  const int64_t width = static_cast<int64_t>(sizeof(uint4) / element);
  const bool vectors = count % width == 0 && reinterpret_cast<uintptr_t>(x) % sizeof(uint4) == 0 &&
                       reinterpret_cast<uintptr_t>(y) % sizeof(uint4) == 0;
  // Blocks per vector: together about grid_for's cap over the batch.
  const int64_t per_vector = std::max<int64_t>(
      1, std::min<int64_t>(grid_for(vectors ? count / width : count), 4096 / batch));
  const dim3 grid(static_cast<unsigned int>(per_vector), static_cast<unsigned int>(batch));
  const float epsilon = static_cast<float>(eps);
  if (dtype == SHARDMUON_BFLOAT16) {
    launch_divide_by_norm(static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y),
                          count, grid, vectors, sums, epsilon, stream);
  } else {
    launch_divide_by_norm(static_cast<const float*>(x), static_cast<float*>(y), count, grid,
                          vectors, sums, epsilon, stream);
  }
}

void divide_by_norm_padded_cuda(const void* x, int64_t rows, int64_t cols, void* y,
                                int64_t padded_rows, int64_t padded_cols, shardmuon_dtype dtype,
                                int64_t batch, const void* sum_of_squares, double eps,
                                cudaStream_t stream) {
  if (batch == 0 || padded_rows == 0 || padded_cols == 0) return;
  if (batch > 65535) fail(SHARDMUON_ERROR_UNSUPPORTED, "batch ", batch, " above 65535");
  const size_t element = element_size(dtype);
  const int64_t width = static_cast<int64_t>(sizeof(uint4) / element);
  if (rows > padded_rows || cols > padded_cols || padded_cols % width != 0 ||
      reinterpret_cast<uintptr_t>(y) % sizeof(uint4) != 0) {
    fail(SHARDMUON_ERROR_INTERNAL, "divide_by_norm_padded_cuda: ", rows, " x ", cols, " into ",
         padded_rows, " x ", padded_cols, " at ", y, " (rows of whole 16-byte vectors needed)");
  }
  // Rows per matrix: together about grid_for's cap over the batch.
  const int64_t per_matrix = std::max<int64_t>(1, std::min<int64_t>(padded_rows, 4096 / batch));
  const dim3 grid(static_cast<unsigned int>(per_matrix), static_cast<unsigned int>(batch));
  const float* sums = static_cast<const float*>(sum_of_squares);
  const float epsilon = static_cast<float>(eps);
  if (dtype == SHARDMUON_BFLOAT16) {
    launch_kernel("divide_by_norm_padded_kernel", divide_by_norm_padded_kernel<__nv_bfloat16>, grid,
                  dim3(kThreads), stream, static_cast<const __nv_bfloat16*>(x), rows, cols,
                  static_cast<__nv_bfloat16*>(y), padded_rows, padded_cols, sums, epsilon);
  } else {
    launch_kernel("divide_by_norm_padded_kernel", divide_by_norm_padded_kernel<float>, grid,
                  dim3(kThreads), stream, static_cast<const float*>(x), rows, cols,
                  static_cast<float*>(y), padded_rows, padded_cols, sums, epsilon);
  }
}

template <typename Source>
void launch_unpack_symmetric(const Source* packed, const PackedTriangle& layout, dim3 grid,
                             void* dst, shardmuon_dtype dst_type, float shift, float* parts,
                             cudaStream_t stream) {
  const dim3 block(TileThreads::kX, TileThreads::kY);
  if (!aligned_to_runs(packed, sizeof(Source)) || !aligned_to_runs(dst, element_size(dst_type))) {
    fail(SHARDMUON_ERROR_INTERNAL, "unpack_symmetric_cuda takes buffers aligned to ", kRunRows,
         " entries");
  }
  if (dst_type == SHARDMUON_FLOAT32) {
    launch_kernel("unpack_symmetric_kernel", unpack_symmetric_kernel<Source, float>, grid, block,
                  stream, packed, layout, static_cast<float*>(dst), shift, parts);
  } else {
    launch_kernel("unpack_symmetric_kernel", unpack_symmetric_kernel<Source, __nv_bfloat16>, grid,
                  block, stream, packed, layout, static_cast<__nv_bfloat16*>(dst), shift, parts);
  }
}

int64_t column_square_parts_cuda(int64_t n) {
  return tiles_per_side(n);
}

void unpack_symmetric_cuda(const void* packed, shardmuon_dtype src_type,
                           const SymmetricTiles& tiles, int64_t batch, void* dst,
                           shardmuon_dtype dst_type, double shift, void* square_parts,
                           cudaStream_t stream) {
  if (src_type != SHARDMUON_FLOAT32 && src_type != SHARDMUON_BFLOAT16) {
    fail(SHARDMUON_ERROR_INTERNAL, "unpack_symmetric_cuda takes float32 or bfloat16 sources");
  }
  if (tiles.n == 0 || batch == 0) return;
  const PackedTriangle layout = packed_triangle_of(tiles);
  const dim3 grid = lower_tile_grid(tiles.n, batch);
  float* parts = static_cast<float*>(square_parts);
  if (src_type == SHARDMUON_FLOAT32) {
    launch_unpack_symmetric(static_cast<const float*>(packed), layout, grid, dst, dst_type,
                            static_cast<float>(shift), parts, stream);
  } else {
    launch_unpack_symmetric(static_cast<const __nv_bfloat16*>(packed), layout, grid, dst, dst_type,
                            static_cast<float>(shift), parts, stream);
  }
}

void mirror_lower_cuda(void* matrix, shardmuon_dtype dtype, int64_t n, int64_t batch,
                       const SymmetricDiagonal& diagonal, void* square_parts, bool upper_computed,
                       cudaStream_t stream) {
  if (n == 0 || batch == 0) return;
  if (upper_computed && diagonal.addend == nullptr && square_parts == nullptr) return;
  if (n % kRunRows != 0) {
    fail(SHARDMUON_ERROR_INTERNAL, "mirror_lower_cuda takes a side that is a multiple of ",
         kRunRows, ", not ", n);
  }
  if (!aligned_to_runs(matrix, element_size(dtype))) {
    fail(SHARDMUON_ERROR_INTERNAL, "mirror_lower_cuda takes a matrix aligned to ", kRunRows,
         " entries");
  }
  dim3 grid = lower_tile_grid(n, batch);
  // With nothing to store above the diagonal and no squares, only the diagonal tiles have
  // work: they come first in the grid (lower_tile_of).
  if (upper_computed && square_parts == nullptr)
    grid.x = static_cast<unsigned int>(tiles_per_side(n));
  const dim3 block(TileThreads::kX, TileThreads::kY);
  const float* squares = static_cast<const float*>(diagonal.squares);
  const float square_scale = static_cast<float>(diagonal.square_scale),
              scale = static_cast<float>(diagonal.scale),
              shift = static_cast<float>(diagonal.shift);
  float* parts = static_cast<float*>(square_parts);
  auto launch = [&](auto element, auto store_upper) {
    using T = decltype(element);
    launch_kernel("mirror_lower_kernel", mirror_lower_kernel<T, decltype(store_upper)::value>, grid,
                  block, stream, static_cast<T*>(matrix), n, squares, square_scale, scale,
                  static_cast<const T*>(diagonal.addend), shift, parts);
  };
  auto with_element = [&](auto store_upper) {
    if (dtype == SHARDMUON_FLOAT32) {
      launch(float{}, store_upper);
    } else {
      launch(__nv_bfloat16{}, store_upper);
    }
  };
  if (upper_computed) {
    with_element(std::false_type{});
  } else {
    with_element(std::true_type{});
  }
}

}  // namespace shardmuon
