#include "cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/cuda_backend.h"

namespace shardmuon {
namespace {

constexpr size_t kAlignment = 256;

struct AlignedFree {
  void operator()(void* pointer) const { std::free(pointer); }
};

// OpenBLAS takes 32-bit dimensions (blasint) unless built for ILP64.
blasint blas_dimension(int64_t value) {
  if (value > std::numeric_limits<blasint>::max()) {
    fail(SHARDMUON_ERROR_UNSUPPORTED, "GEMM dimension ", value,
         " exceeds the CPU backend's BLAS integer range");
  }
  return static_cast<blasint>(value);
}

// 1 / max(sqrt(sum of squares of matrix b), eps), 0 where that maximum is 0 (a zero matrix
// with eps 0), and its product with a value: in float64 for float64 data, else in the CUDA
// kernels' float32 arithmetic.
struct NormScale {
  bool float64 = false;
  double scale = 0.0;

  static NormScale of(const void* sums_of_squares, shardmuon_dtype dtype, int64_t b, double eps) {
    const shardmuon_dtype accumulate = accumulate_dtype(dtype);
    NormScale result;
    result.float64 = accumulate == SHARDMUON_FLOAT64;
    if (result.float64) {
      const double norm = std::max(std::sqrt(load_element(sums_of_squares, accumulate, b)), eps);
      result.scale = norm > 0 ? 1.0 / norm : 0.0;
    } else {
      const float norm =
          std::max(std::sqrt(static_cast<float>(load_element(sums_of_squares, accumulate, b))),
                   static_cast<float>(eps));
      result.scale = norm > 0 ? 1.0f / norm : 0.0f;
    }
    return result;
  }
  double apply(double value) const {
    return float64 ? value * scale : static_cast<float>(value) * static_cast<float>(scale);
  }
};

// Elements a column-major operand of `columns` columns with leading dimension ld spans.
int64_t span(int64_t ld, int64_t columns) {
  return columns == 0 ? 0 : ld * columns;
}

// bytes rounded up to whole kAlignment blocks (aligned_alloc's rule); a size within a block of
// SIZE_MAX, which would wrap to a tiny allocation, is refused as out of memory.
size_t aligned_size(size_t bytes, const char* what) {
  if (bytes > std::numeric_limits<size_t>::max() - (kAlignment - 1)) {
    fail(SHARDMUON_ERROR_OUT_OF_MEMORY, what, " of ", bytes, " bytes");
  }
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

class CpuBackend final : public Backend {
 public:
  shardmuon_backend kind() const override { return SHARDMUON_BACKEND_CPU; }
  void begin_call(Stream) override {}
  void end_call(Stream) override {}
  // Host memory is all this backend reads; device memory given to it would be read on the host
  // (a crash) where the library has CUDA.
  void check_pointer(const void* pointer, const char* name) const override {
    SHARDMUON_CHECK_ARG(!is_device_only_memory(pointer), name, " (", pointer,
                        ") is CUDA device memory; the CPU backend needs host memory");
  }
  void check_dtype(shardmuon_dtype) const override {}

  void* workspace(size_t bytes, Stream) override {
    if (bytes > workspace_bytes_) {
      const size_t rounded = aligned_size(bytes, "workspace");
      void* pointer = std::aligned_alloc(kAlignment, rounded);
      if (pointer == nullptr)
        fail(SHARDMUON_ERROR_OUT_OF_MEMORY, "workspace of ", rounded, " bytes");
      workspace_.reset(pointer);
      workspace_bytes_ = rounded;
    }
    return workspace_.get();
  }
  size_t workspace_bytes() const override { return workspace_bytes_; }

  void* allocate_zeroed(size_t bytes) override {
    const size_t rounded = std::max<size_t>(kAlignment, aligned_size(bytes, "buffer"));
    void* pointer = std::aligned_alloc(kAlignment, rounded);
    if (pointer == nullptr) fail(SHARDMUON_ERROR_OUT_OF_MEMORY, "buffer of ", bytes, " bytes");
    std::memset(pointer, 0, rounded);
    return pointer;
  }
  void release(void* pointer) override { std::free(pointer); }

  size_t sum_of_squares_scratch_bytes(shardmuon_dtype, int64_t, int64_t) const override {
    return 0;
  }

  void sum_of_squares(const void* x, shardmuon_dtype dtype, int64_t count, int64_t batch,
                      void* result, void*, size_t, Stream) override {
    for (int64_t b = 0; b < batch; ++b) {
      double sum = 0;
      for (int64_t i = b * count; i < (b + 1) * count; ++i) {
        const double value = load_element(x, dtype, i);
        sum += value * value;
      }
      store_element(result, accumulate_dtype(dtype), b, sum);
    }
  }

  void divide_by_norm(const void* x, void* y, shardmuon_dtype dtype, int64_t count, int64_t batch,
                      const void* sum_of_squares, double eps, Stream) override {
    for (int64_t b = 0; b < batch; ++b) {
      const NormScale scale = NormScale::of(sum_of_squares, dtype, b, eps);
      for (int64_t i = b * count; i < (b + 1) * count; ++i) {
        store_element(y, dtype, i, scale.apply(load_element(x, dtype, i)));
      }
    }
  }

  void divide_by_norm_padded(const void* x, int64_t rows, int64_t cols, void* y,
                             int64_t padded_rows, int64_t padded_cols, shardmuon_dtype dtype,
                             int64_t batch, const void* sum_of_squares, double eps,
                             Stream) override {
    for (int64_t b = 0; b < batch; ++b) {
      const NormScale scale = NormScale::of(sum_of_squares, dtype, b, eps);
      for (int64_t r = 0; r < padded_rows; ++r) {
        for (int64_t c = 0; c < padded_cols; ++c) {
          const double value = r < rows && c < cols
                                   ? scale.apply(load_element(x, dtype, (b * rows + r) * cols + c))
                                   : 0.0;
          store_element(y, dtype, (b * padded_rows + r) * padded_cols + c, value);
        }
      }
    }
  }

  // A list or a strided batch runs as its products one after another.
  void gemm(const GemmCall& call, Stream stream) override {
    if (call.product_count > 0) {
      for (int64_t p = 0; p < call.product_count; ++p) gemm(call.product(p), stream);
      return;
    }
    if (call.batch == 1) {
      gemm_one(call);
      return;
    }
    const size_t ab = element_size(call.ab_type), cd = element_size(call.cd_type);
    for (int64_t i = 0; i < call.batch; ++i) {
      GemmCall one = call;
      one.batch = 1;
      one.a = static_cast<const char*>(call.a) + i * call.stride_a * ab;
      one.b = static_cast<const char*>(call.b) + i * call.stride_b * ab;
      if (call.beta != 0.0) one.c = static_cast<const char*>(call.c) + i * call.stride_c * cd;
      one.d = static_cast<char*>(call.d) + i * call.stride_d * cd;
      gemm(one, stream);
    }
  }

  void gemm_one(const GemmCall& call) {
    const CBLAS_TRANSPOSE op_a = call.transpose_a ? CblasTrans : CblasNoTrans;
    const CBLAS_TRANSPOSE op_b = call.transpose_b ? CblasTrans : CblasNoTrans;
    const int64_t a_span = span(call.lda, call.transpose_a ? call.m : call.k);
    const int64_t b_span = span(call.ldb, call.transpose_b ? call.k : call.n);
    const int64_t d_span = span(call.ldd, call.n);
    const blasint m = blas_dimension(call.m), n = blas_dimension(call.n),
                  k = blas_dimension(call.k);
    const blasint lda = blas_dimension(call.lda), ldb = blas_dimension(call.ldb),
                  ldd = blas_dimension(call.ldd);

    if (call.ab_type == SHARDMUON_FLOAT64) {
      double* d = static_cast<double*>(call.d);
      copy_c_into_d(call, d);
      cblas_dgemm(CblasColMajor, op_a, op_b, m, n, k, call.alpha,
                  static_cast<const double*>(call.a), lda, static_cast<const double*>(call.b), ldb,
                  call.beta, d, ldd);
      return;
    }
    // float32 products. bf16 operands are widened exactly; a bf16 result is computed in
    // float32 (C widened first) and rounded once, as the tensor cores do.
    const float* a = widen(call.a, call.ab_type, a_span, a_widened_);
    const float* b =
        call.b == call.a && b_span <= a_span ? a : widen(call.b, call.ab_type, b_span, b_widened_);
    float* d;
    if (call.cd_type == SHARDMUON_FLOAT32) {
      d = static_cast<float*>(call.d);
      copy_c_into_d(call, d);
    } else {
      d_widened_.assign(d_span, 0.0f);
      d = d_widened_.data();
      if (call.beta != 0.0) copy_strided(call.c, call.ldc, d, call.ldd, call);
    }
    cblas_sgemm(CblasColMajor, op_a, op_b, m, n, k, static_cast<float>(call.alpha), a, lda, b, ldb,
                static_cast<float>(call.beta), d, ldd);
    if (call.cd_type != SHARDMUON_FLOAT32) {
      for (int64_t j = 0; j < call.n; ++j) {
        for (int64_t i = 0; i < call.m; ++i) {
          store_element(call.d, call.cd_type, j * call.ldd + i, d[j * call.ldd + i]);
        }
      }
    }
  }

  void momentum_passes(const std::vector<MomentumPass>& passes, Stream) override {
    for (const MomentumPass& pass : passes) {
      if (pass.dtype == SHARDMUON_FLOAT64) {
        momentum_pass_as<double>(pass);
      } else {  // the CUDA kernel's float32 arithmetic
        momentum_pass_as<float>(pass);
      }
    }
  }

  void update_passes(const std::vector<UpdatePass>& passes, Stream) override {
    for (const UpdatePass& pass : passes) update(pass);
  }

  void commit_passes(const std::vector<CommitPass>& passes, Stream) override {
    for (const CommitPass& pass : passes) {
      const bool step_bad = *pass.step_flag != 0.0f, param_bad = *pass.param_flag != 0.0f;
      if (step_bad || param_bad) {
        if (!step_bad && pass.skipped_params != nullptr) ++*pass.skipped_params;
        continue;
      }
      update({pass.param, pass.update, pass.dtype, pass.update_dtype, pass.count, pass.decay,
              pass.step_size, pass.device_lr});
      if (pass.count > 0) {
        std::memcpy(pass.momentum, pass.new_momentum, pass.count * element_size(pass.dtype));
      }
    }
  }

  void flag_nonfinite(const std::vector<FiniteCheck>& checks, Stream) override {
    for (const FiniteCheck& check : checks) {
      for (int64_t i = 0; i < check.count; ++i) {
        if (!std::isfinite(load_element(check.values, check.dtype, i))) {
          *check.flag = 1.0f;
          break;
        }
      }
    }
  }

  void mark_if_set(const float* flag, float* mark, Stream) override {
    *mark = *flag != 0.0f ? 1.0f : 0.0f;
  }
  void count_if_flagged(const float* flag, int64_t* counter, Stream) override {
    if (*flag != 0.0f) ++*counter;
  }

  void* persistent_status() override { return status_; }

  void copy_to_host(void* host, const void* src, size_t bytes, Stream) override {
    if (bytes > 0) std::memcpy(host, src, bytes);
  }
  void copy_from_host(void* dst, const void* host, size_t bytes, Stream) override {
    if (bytes > 0) std::memcpy(dst, host, bytes);
  }
  void synchronize(Stream) override {}
  void wait_for_last_call() override {}

  // Blocks of 32 columns: the CPU backend runs the tests, which should split their small
  // matrices into several blocks.
  int64_t symmetric_block_target() const override { return 32; }
  // As on CUDA, the block width: nothing to gain here, but the tests on this backend then run
  // the padded short sides the GPU does (any side from 256 whose next multiple of 32 is close).
  int64_t short_side_multiple() const override { return 32; }

  // Every GEMM dimension and leading dimension is at most the matrix's rows or cols.
  void check_matrix_shape(int64_t rows, int64_t cols, const std::string& name) const override {
    const int64_t largest = std::numeric_limits<blasint>::max();
    if (rows > largest || cols > largest) {
      fail(SHARDMUON_ERROR_UNSUPPORTED, name, " is ", rows, " x ", cols,
           ", but the CPU backend's BLAS takes dimensions up to ", largest);
    }
  }

  // One part: each column's sum of squares whole.
  int64_t column_square_parts(int64_t) const override { return 1; }

  void unpack_symmetric(const void* packed, shardmuon_dtype src_type, const SymmetricTiles& tiles,
                        int64_t batch, void* dst, shardmuon_dtype dst_type, double shift,
                        void* square_parts, Stream) override {
    const int64_t n = tiles.n;
    for (int64_t matrix = 0; matrix < batch; ++matrix) {
      const int64_t packed_base = matrix * tiles.packed_elements(), dst_base = matrix * n * n;
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t r = c; r < n; ++r) {  // the lower triangle of column c
          double value = load_element(packed, src_type, packed_base + tiles.packed_index(r, c));
          if (r == c) {  // the CUDA kernel adds in float32 for float32 sources
            value =
                src_type == SHARDMUON_FLOAT64
                    ? value + shift
                    : static_cast<double>(static_cast<float>(value) + static_cast<float>(shift));
          }
          store_element(dst, dst_type, dst_base + c * n + r, value);
          store_element(dst, dst_type, dst_base + r * n + c, value);
        }
      }
    }
    if (square_parts != nullptr) store_column_squares(dst, dst_type, n, batch, square_parts);
  }

  void mirror_lower(void* matrix, shardmuon_dtype dtype, int64_t n, int64_t batch,
                    const SymmetricDiagonal& diagonal, void* square_parts, bool upper_computed,
                    Stream) override {
    const shardmuon_dtype accumulate = accumulate_dtype(dtype);
    const bool wide = dtype == SHARDMUON_FLOAT64;  // else float32 arithmetic, as on CUDA
    for (int64_t m = 0; m < batch; ++m) {
      const int64_t base = m * n * n;
      for (int64_t c = 0; c < n; ++c) {
        if (diagonal.addend != nullptr) {
          const int64_t at = base + c * n + c;
          const double square = diagonal.squares == nullptr
                                    ? 0.0
                                    : load_element(diagonal.squares, accumulate, m * n + c);
          const double addend = load_element(diagonal.addend, dtype, at);
          const double value =
              wide ? diagonal.shift + diagonal.scale * addend + diagonal.square_scale * square
                   : static_cast<double>(
                         static_cast<float>(diagonal.shift) +
                         static_cast<float>(diagonal.scale) * static_cast<float>(addend) +
                         static_cast<float>(diagonal.square_scale) * static_cast<float>(square));
          store_element(matrix, dtype, at, value);
        }
        if (upper_computed) continue;
        for (int64_t r = c + 1; r < n; ++r) {
          store_element(matrix, dtype, base + r * n + c,
                        load_element(matrix, dtype, base + c * n + r));
        }
      }
    }
    if (square_parts != nullptr) store_column_squares(matrix, dtype, n, batch, square_parts);
  }

  // squares[b * n + c] = the sum of squares of column c of the symmetric matrix whose lower
  // triangle matrix b holds (accumulate dtype): entry (r, c) is read at (max(r, c), min(r, c)),
  // so an upper triangle left as a GEMM wrote it (mirror_lower's upper_computed) is not read.
  static void store_column_squares(const void* matrix, shardmuon_dtype dtype, int64_t n,
                                   int64_t batch, void* squares) {
    for (int64_t m = 0; m < batch; ++m) {
      for (int64_t c = 0; c < n; ++c) {
        double sum = 0.0;
        for (int64_t r = 0; r < n; ++r) {
          const int64_t at = r >= c ? c * n + r : r * n + c;  // column-major (max, min)
          const double value = load_element(matrix, dtype, m * n * n + at);
          sum += value * value;
        }
        store_element(squares, accumulate_dtype(dtype), m * n + c, sum);
      }
    }
  }

  Stream side_stream(Stream stream) override { return stream; }
  void order_after(Stream, Stream) override {}

  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
               size_t rows, Stream) override {
    for (size_t r = 0; r < rows; ++r) {
      std::memmove(static_cast<char*>(dst) + r * dst_pitch,
                   static_cast<const char*>(src) + r * src_pitch, row_bytes);
    }
  }

  void fill_zero(void* dst, size_t bytes, Stream) override { std::memset(dst, 0, bytes); }

 private:
  void update(const UpdatePass& pass) {
    double decay = pass.decay, step_size = pass.step_size;
    if (pass.device_lr.lr != nullptr) {  // the CUDA kernels' float32 arithmetic
      const float lr = *pass.device_lr.lr;
      decay = static_cast<float>(decay) - static_cast<float>(pass.device_lr.decay_per_lr) * lr;
      step_size = static_cast<float>(pass.device_lr.step_size_per_lr) * lr;
    }
    for (int64_t i = 0; i < pass.count; ++i) {
      if (pass.dtype == SHARDMUON_FLOAT64) {
        store_element(pass.param, pass.dtype, i,
                      load_element(pass.param, pass.dtype, i) * decay -
                          step_size * load_element(pass.update, pass.update_dtype, i));
      } else {
        const float value = static_cast<float>(load_element(pass.param, pass.dtype, i)) *
                                static_cast<float>(decay) -
                            static_cast<float>(step_size) *
                                static_cast<float>(load_element(pass.update, pass.update_dtype, i));
        store_element(pass.param, pass.dtype, i, value);
      }
    }
  }

  template <typename T>
  void momentum_pass_as(const MomentumPass& pass) {
    const T beta = static_cast<T>(pass.beta), weight = static_cast<T>(1.0 - pass.beta);
    const T l2 = static_cast<T>(pass.l2_decay);
    for (int64_t i = 0; i < pass.count; ++i) {
      T g = static_cast<T>(load_element(pass.grad, pass.dtype, i));
      if (pass.nonfinite_flag != nullptr && !std::isfinite(g)) *pass.nonfinite_flag = 1.0f;
      if (pass.l2_decay != 0.0) g += l2 * static_cast<T>(load_element(pass.param, pass.dtype, i));
      T m = static_cast<T>(load_element(pass.momentum, pass.dtype, i));
      m += weight * (g - m);  // lerp(m, g, 1 - beta)
      store_element(pass.new_momentum ? pass.new_momentum : pass.momentum, pass.dtype, i, m);
      // Nesterov uses m before it is rounded to the storage dtype, as the GPU kernel does.
      store_element(pass.update, pass.update_dtype, i, pass.nesterov ? g + beta * (m - g) : m);
    }
  }

  const float* widen(const void* data, shardmuon_dtype dtype, int64_t count,
                     std::vector<float>& buffer) {
    if (dtype == SHARDMUON_FLOAT32) return static_cast<const float*>(data);
    buffer.resize(count);
    for (int64_t i = 0; i < count; ++i)
      buffer[i] = static_cast<float>(load_element(data, dtype, i));
    return buffer.data();
  }

  // Copies the m x n matrix C (cd_type) into D (float32 or float64) when beta reads it.
  template <typename T>
  void copy_c_into_d(const GemmCall& call, T* d) {
    if (call.beta == 0.0 || call.c == call.d) return;
    copy_strided(call.c, call.ldc, d, call.ldd, call);
  }

  template <typename T>
  void copy_strided(const void* c, int64_t ldc, T* d, int64_t ldd, const GemmCall& call) {
    for (int64_t j = 0; j < call.n; ++j) {
      for (int64_t i = 0; i < call.m; ++i) {
        d[j * ldd + i] = static_cast<T>(load_element(c, call.cd_type, j * ldc + i));
      }
    }
  }

  alignas(16) unsigned char status_[64] = {};
  std::unique_ptr<void, AlignedFree> workspace_;
  size_t workspace_bytes_ = 0;
  std::vector<float> a_widened_, b_widened_, d_widened_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

}  // namespace shardmuon
