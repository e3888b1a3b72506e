// The compute interface that the CPU and CUDA backends implement as peers. The
// distributed algorithms in core/ are written once against it (and comm/communicator.h),
// so the same code runs on CPU ranks over MPI and on GPUs over NCCL.
//
// Memory passed to a backend lives where the backend computes (host memory for the CPU
// backend, device memory for CUDA). Work is ordered on the stream (a cudaStream_t; the CPU
// backend ignores it and computes before returning).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/symmetric_tiles.h"
#include "shardmuon/shardmuon.h"

namespace shardmuon {

using Stream = void*;

// Where one product of a GemmCall's list lies (see GemmCall::products).
struct GemmOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;
  void* d = nullptr;
};

// D = alpha * op(A) * op(B) + beta * C, all matrices column-major (BLAS convention):
// op(A) is m x k, op(B) is k x n, C and D are m x n. A and B share one element type,
// C and D another; products accumulate in float64 for float64 operands, float32 otherwise.
// beta == 0 means C is not read. D must not alias A or B; it may alias C. With batch > 1, the
// call is `batch` such products, matrix i of each operand at i * stride elements from its
// pointer (a strided batch: many small matrices in one launch).
struct GemmCall {
  bool transpose_a = false, transpose_b = false;
  int64_t m = 0, n = 0, k = 0;
  double alpha = 1.0, beta = 0.0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const void* c = nullptr;
  int64_t ldc = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  shardmuon_dtype ab_type = SHARDMUON_FLOAT32;
  shardmuon_dtype cd_type = SHARDMUON_FLOAT32;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0, stride_d = 0;
  // With a list, the call is one product per entry, all of this shape, each at its own
  // operands (a, b, c and d above are not used), each a strided batch as above: many
  // same-shaped products anywhere in memory in one launch (the tiles of a symmetric product).
  const GemmOperands* products = nullptr;
  int64_t product_count = 0;
  // Product p of the list as a call of its own.
  GemmCall product(int64_t p) const {
    GemmCall one = *this;
    one.products = nullptr;
    one.product_count = 0;
    one.a = products[p].a;
    one.b = products[p].b;
    one.c = products[p].c;
    one.d = products[p].d;
    return one;
  }
  // The product runs while a collective on another stream needs SMs: a backend may leave
  // some free for it (the CUDA backend's GEMMs can otherwise hold every SM until they end).
  bool overlaps_communication = false;
  // The number of SMs the product should plan for (0: all); set by the backend.
  int sm_count_target = 0;
};

// Steps 1-3 of a Muon step, fused into one elementwise pass (float32 arithmetic, float64
// for float64 storage): with g = grad + l2_decay * param,
//   momentum <- lerp(momentum, g, 1 - beta)
//   update    = nesterov ? lerp(g, momentum, beta) : momentum
// param is read only when l2_decay != 0. update is a separate buffer.
struct MomentumPass {
  const void* grad = nullptr;
  const void* param = nullptr;
  void* momentum = nullptr;
  void* update = nullptr;
  shardmuon_dtype dtype = SHARDMUON_FLOAT32;         // of grad, param and momentum
  shardmuon_dtype update_dtype = SHARDMUON_FLOAT32;  // of update (the Newton-Schulz dtype)
  int64_t count = 0;
  double beta = 0.0;
  bool nesterov = false;
  double l2_decay = 0.0;
  // Where the new momentum goes: momentum itself (in place) when null, else this buffer, so
  // that the step can decide later whether to keep it (commit_pass).
  void* new_momentum = nullptr;
  // If not null, *nonfinite_flag (backend memory) becomes 1 when a gradient value is NaN or
  // infinite (it is never cleared here): the check rides on the pass that reads the gradient
  // anyway, instead of a pass of its own.
  float* nonfinite_flag = nullptr;
};

// A learning rate read when a pass runs (a float32 in backend memory), for captured steps whose
// schedule changes it between replays: the pass's decay and step_size become
// decay - decay_per_lr * lr and step_size_per_lr * lr. With `lr` null they stay as given.
struct DeviceLearningRate {
  const float* lr = nullptr;
  double decay_per_lr = 0.0, step_size_per_lr = 0.0;
};

// Steps 1 and 6 fused, the last pass of a step that checks nothing: param <- param * decay -
// step_size * update (see DeviceLearningRate).
struct UpdatePass {
  void* param = nullptr;
  const void* update = nullptr;
  shardmuon_dtype dtype = SHARDMUON_FLOAT32;         // of param
  shardmuon_dtype update_dtype = SHARDMUON_FLOAT32;  // of update
  int64_t count = 0;
  double decay = 1.0, step_size = 0.0;
  DeviceLearningRate device_lr;
};

// *flag (backend memory) becomes 1 if any of the count values is NaN or infinite (it is never
// cleared here).
struct FiniteCheck {
  const void* values = nullptr;
  shardmuon_dtype dtype = SHARDMUON_FLOAT32;
  int64_t count = 0;
  float* flag = nullptr;
};

// The last pass of a checked step: unless a flag is set, param <- param * decay - step_size *
// update and momentum <- new_momentum. Flags are floats in backend memory (nonzero: set); a
// parameter skipped because of its own flag (not the step's) adds one to *skipped_params.
struct CommitPass {
  void* param = nullptr;
  const void* update = nullptr;
  void* momentum = nullptr;
  const void* new_momentum = nullptr;
  shardmuon_dtype dtype = SHARDMUON_FLOAT32;         // of param, momentum and new_momentum
  shardmuon_dtype update_dtype = SHARDMUON_FLOAT32;  // of update
  int64_t count = 0;
  double decay = 1.0, step_size = 0.0;
  const float* step_flag = nullptr;
  const float* param_flag = nullptr;
  int64_t* skipped_params = nullptr;
  DeviceLearningRate device_lr;
};

// What mirror_lower sets on the diagonal first (nothing when addend is null): entry (i, i)
// becomes shift + scale * addend[i, i] + square_scale * |column i of addend|^2, summed in the
// accumulate dtype and rounded once to the matrix's dtype. addend is a full matrix of the
// storage dtype (it may be the matrix itself: each diagonal entry is read before it is
// written); squares holds its column squares in parts (Backend::column_square_parts), as the
// symmetric pass that made it wrote them, or is null: no square term.
struct SymmetricDiagonal {
  const void* squares = nullptr;
  double square_scale = 0.0;
  double scale = 0.0;
  const void* addend = nullptr;
  double shift = 0.0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual shardmuon_backend kind() const = 0;
  // The CUDA device the backend computes on; -1 for the CPU backend.
  virtual int device() const { return -1; }

  // Brackets one library call: the CUDA backend makes its device current and orders this
  // call after the previous one if the caller switched streams.
  virtual void begin_call(Stream stream) = 0;
  virtual void end_call(Stream stream) = 0;
  // Whether work enqueued on `stream` now is being captured into a CUDA graph (never on the
  // CPU backend), and, once a call has been captured, keeping the workspace where the graph
  // will find it: it never moves again.
  virtual bool is_capturing(Stream /*stream*/) const { return false; }
  virtual void pin_workspace() {}

  // Enqueues on `stream` the work that enqueue(s) enqueues on the stream s it is given, which
  // the backend may do by replaying a recording of an earlier call with the same key (the CUDA
  // backend: a CUDA graph, so that the host launches it at once). The key must tell apart any
  // two calls whose work differs: its arguments, the memory it touches, the settings it reads.
  // enqueue must not synchronize or allocate. By default it just runs.
  virtual void run_recorded(const std::vector<int64_t>& /*key*/, Stream stream,
                            const std::function<void(Stream)>& enqueue) {
    enqueue(stream);
  }
  // How many calls of run_recorded replayed a recording (for tests).
  virtual int64_t replayed_recordings() const { return 0; }

  // Throws INVALID_ARGUMENT (naming `name`) if ptr is not memory this backend computes on.
  virtual void check_pointer(const void* ptr, const char* name) const = 0;
  // Throws UNSUPPORTED if this backend does not compute in dtype.
  virtual void check_dtype(shardmuon_dtype dtype) const = 0;
  // Throws UNSUPPORTED (naming `name`) if this backend's GEMMs cannot take a rows x cols
  // matrix. Checked while validating, so the ranks agree on it before any collective.
  virtual void check_matrix_shape(int64_t /*rows*/, int64_t /*cols*/,
                                  const std::string& /*name*/) const {}

  // Scratch memory of at least `bytes`, 256-byte aligned, reused by later calls: it grows
  // to the largest request and never shrinks. The pointer stays valid until the next call
  // of workspace().
  virtual void* workspace(size_t bytes, Stream stream) = 0;
  virtual size_t workspace_bytes() const = 0;

  // Zero-filled memory owned by the caller (through the C API's buffer functions); may
  // synchronize. release frees it after the work already enqueued.
  virtual void* allocate_zeroed(size_t bytes) = 0;
  virtual void release(void* pointer) = 0;

  // The reductions and the division below take `batch` vectors of count elements each, one
  // after another (matrices of a strided batch).
  // Scratch bytes that sum_of_squares needs.
  virtual size_t sum_of_squares_scratch_bytes(shardmuon_dtype dtype, int64_t count,
                                              int64_t batch) const = 0;
  // result[b] (values of accumulate_dtype(dtype)) = sum of x[b * count + i]^2, deterministic.
  virtual void sum_of_squares(const void* x, shardmuon_dtype dtype, int64_t count, int64_t batch,
                              void* result, void* scratch, size_t scratch_bytes, Stream stream) = 0;
  // y = x / max(sqrt(sum_of_squares[b]), eps) for vector b, reading the sums where they lie
  // (no host round trip). A zero sum gives y = 0, never NaN. x and y may alias.
  virtual void divide_by_norm(const void* x, void* y, shardmuon_dtype dtype, int64_t count,
                              int64_t batch, const void* sum_of_squares, double eps,
                              Stream stream) = 0;
  // The same into a padded copy: y (batch row-major matrices of padded_rows x padded_cols, one
  // after another) = x (rows x cols each, one after another) divided as above, zero outside
  // x's rows and columns (padded_rows >= rows, padded_cols >= cols, padded_cols a multiple of
  // kProductAlignment). x and y must not overlap.
  virtual void divide_by_norm_padded(const void* x, int64_t rows, int64_t cols, void* y,
                                     int64_t padded_rows, int64_t padded_cols,
                                     shardmuon_dtype dtype, int64_t batch,
                                     const void* sum_of_squares, double eps, Stream stream) = 0;

  virtual void gemm(const GemmCall& call, Stream stream) = 0;

  // The elementwise passes of a step, every parameter's in one call: each pass is on its own
  // buffers (none overlaps another's outputs), so the CUDA backend runs all of a kind in one
  // launch (a step of many small parameters was bound by launching one per parameter).
  virtual void momentum_passes(const std::vector<MomentumPass>& passes, Stream stream) = 0;
  virtual void update_passes(const std::vector<UpdatePass>& passes, Stream stream) = 0;
  virtual void commit_passes(const std::vector<CommitPass>& passes, Stream stream) = 0;
  virtual void flag_nonfinite(const std::vector<FiniteCheck>& checks, Stream stream) = 0;
  // *mark = 1 if *flag is set (non-zero, NaN included), else 0; mark may be flag. Flags are
  // summed across ranks as these marks, so that set flags of opposite signs cannot cancel.
  virtual void mark_if_set(const float* flag, float* mark, Stream stream) = 0;
  // *counter += 1 if *flag is set.
  virtual void count_if_flagged(const float* flag, int64_t* counter, Stream stream) = 0;
  // A few bytes of zeroed backend memory that live as long as the backend (counters).
  virtual void* persistent_status() = 0;

  // How wide SymmetricTiles' blocks should be on this backend: narrower blocks save more
  // flops (the triangle), wider ones run the GEMMs faster.
  virtual int64_t symmetric_block_target() const = 0;
  // The multiple a Newton-Schulz block's short side is padded up to where that is cheap
  // (product_side in symmetric_tiles.h): the block width, so that the tiles are equal blocks.
  virtual int64_t short_side_multiple() const = 0;
  // The tiles of the symmetric products whose n x n results lie in full matrices on one rank
  // (a Gram that is not summed, A A, (e)'s products). A summed Gram's packed tiles stay
  // SymmetricTiles::split(n, symmetric_block_target()), the layout its all-reduces move.
  virtual SymmetricTiles product_tiles(int64_t n) const {
    return SymmetricTiles::split(n, symmetric_block_target());
  }
  // How many partial sums the symmetric passes below split a column's sum of squares into
  // (the CUDA passes work on square tiles, each summing its own part). For a batch, matrix
  // b's parts are at b * parts * n; part k of column i is at k * n + i, and the column's sum
  // is its parts added in a fixed order (the same bits on every call).
  virtual int64_t column_square_parts(int64_t n) const = 0;
  // dst (n x n, column-major, dst_type) = the symmetric matrix whose lower block columns
  // `packed` (src_type) holds in the layout of `tiles`, plus shift * I, rounded once to
  // nearest even. The lower triangle is the truth: dst is exactly symmetric. dst must not
  // overlap packed. For a batch, matrix b is at b * tiles.packed_elements() in packed and at
  // b * n * n in dst. Unless square_parts is null, it receives dst's column squares (as
  // stored), in the accumulate dtype, in column_square_parts(n) parts.
  virtual void unpack_symmetric(const void* packed, shardmuon_dtype src_type,
                                const SymmetricTiles& tiles, int64_t batch, void* dst,
                                shardmuon_dtype dst_type, double shift, void* square_parts,
                                Stream stream) = 0;
  // The n x n matrix (column-major, dtype) becomes exactly symmetric: its upper triangle is
  // overwritten with its lower one, after `diagonal` (if given) has set its diagonal. For a
  // batch, matrix b is at b * n * n. Unless square_parts is null, it receives the result's
  // column squares as unpack_symmetric's do, taken from the lower triangle (and the diagonal
  // set). With upper_computed (the product wrote both triangles: one plain GEMM), the upper
  // triangle is left as it is, symmetric to rounding, and only the diagonal and the squares
  // are written: the stores of half the matrix saved.
  virtual void mirror_lower(void* matrix, shardmuon_dtype dtype, int64_t n, int64_t batch,
                            const SymmetricDiagonal& diagonal, void* square_parts,
                            bool upper_computed, Stream stream) = 0;
  // A stream for communication that overlaps computation on `stream` (the CUDA backend's
  // own, created once; the CPU backend, which computes before returning, gives `stream`).
  virtual Stream side_stream(Stream stream) = 0;
  // Work enqueued on `waiter` from now on starts after the work already enqueued on
  // `signaller` (an event; no host synchronization).
  virtual void order_after(Stream waiter, Stream signaller) = 0;
  // Copies `rows` rows of row_bytes each between pitched buffers.
  virtual void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                       size_t row_bytes, size_t rows, Stream stream) = 0;
  virtual void fill_zero(void* dst, size_t bytes, Stream stream) = 0;

  // Copies between the backend's memory and the host, ordered on the stream; synchronize
  // waits for the stream (the CPU backend computes before returning and waits for nothing).
  virtual void copy_to_host(void* host, const void* src, size_t bytes, Stream stream) = 0;
  virtual void copy_from_host(void* dst, const void* host, size_t bytes, Stream stream) = 0;
  virtual void synchronize(Stream stream) = 0;
  // Waits for the last call's work, whatever stream it ran on.
  virtual void wait_for_last_call() = 0;
};

}  // namespace shardmuon
