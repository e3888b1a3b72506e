// The test oracle, written independently of the library: a plain float64 Newton-Schulz on
// the whole matrix (always in the X X^T orientation, so it also checks the library's
// orientation choice), the schedule tables as DESIGN.md lists them, random inputs, and
// shard extraction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardmuon/shardmuon.h"

namespace shardmuon_test {

struct Triple {
  double a, b, c;
};

// A dense row-major matrix of doubles.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> values;

  Matrix() = default;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), values(static_cast<size_t>(r * c), 0.0) {}
  double& at(int64_t r, int64_t c) { return values[static_cast<size_t>(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return values[static_cast<size_t>(r * cols + c)]; }
  Matrix transposed() const;
};

// The schedule tables of DESIGN.md section 1 and their cycle / repeat-last rules.
std::vector<Triple> schedule_table(shardmuon_schedule schedule);
bool schedule_is_cycled(shardmuon_schedule schedule);
std::vector<Triple> coefficients_for(shardmuon_schedule schedule, int iterations);

// Deterministic random numbers (same on every rank for the same seed).
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next_u64();
  double uniform();   // [0, 1)
  double gaussian();  // standard normal

 private:
  uint64_t state_;
};

Matrix random_gaussian(int64_t rows, int64_t cols, uint64_t seed);
// rows x cols with orthonormal columns (rows >= cols), by modified Gram-Schmidt twice.
Matrix random_orthonormal_columns(int64_t rows, int64_t cols, uint64_t seed);
// U diag(sigma) V^T with singular values drawn uniformly from [low, high].
Matrix random_with_singular_values(int64_t rows, int64_t cols, double low, double high,
                                   uint64_t seed);

// X = W / max(||W||_F, eps); X <- a X + b (X X^T) X + c (X X^T)^2 X for each triple.
Matrix reference_newton_schulz(const Matrix& w, const std::vector<Triple>& coefficients,
                               double eps);

// A Muon group's hyperparameters for the oracle (the enums are the library's, the arithmetic
// is the oracle's own).
struct ReferenceGroup {
  double lr = 0.02, momentum = 0.9;
  bool nesterov = true;
  double weight_decay = 0.1;
  shardmuon_weight_decay weight_decay_mode = SHARDMUON_WEIGHT_DECAY_DECOUPLED;
  shardmuon_scale_mode scale_mode = SHARDMUON_SCALE_SPECTRAL;
  double extra_scale_factor = 1.0;
  std::vector<Triple> coefficients;
  double eps = 1e-7;
};

// One Muon step on whole matrices in float64 (DESIGN.md section 1), in place on w and m.
void reference_muon_step(Matrix& w, const Matrix& g, Matrix& m, const ReferenceGroup& group);

// torch.optim.Muon's Newton-Schulz in bf16, emulated: every product and sum rounded to bf16
// (A = XX^T, B = b A + c A@A, X = a X + B@X), in the smaller Gram orientation. The accuracy
// baseline a single-GPU Muon user has today.
Matrix torch_form_bf16_newton_schulz(const Matrix& w, const std::vector<Triple>& coefficients,
                                     double eps);

// Storage conversions of the test's own (bf16: round to nearest, ties to even).
double round_to_bf16(double value);
Matrix rounded_to(const Matrix& m, shardmuon_dtype dtype);
std::vector<unsigned char> to_bytes(const std::vector<double>& values, shardmuon_dtype dtype);
std::vector<double> from_bytes(const std::vector<unsigned char>& bytes, shardmuon_dtype dtype);
size_t dtype_size(shardmuon_dtype dtype);
const char* dtype_label(shardmuon_dtype dtype);

// Shard sizes that sum to extent over parts ranks.
std::vector<int64_t> balanced_sizes(int64_t extent, int parts);
std::vector<int64_t> uneven_sizes(int64_t extent,
                                  int parts);  // includes an empty shard for parts >= 3
std::vector<int64_t> last_holds_all(int64_t extent, int parts);  // every shard empty but the last

// The row-major local shard of rank `rank` (partition as in shardmuon_layout).
// The extent the shard sizes of a partition count: rows (DIM0), cols (DIM1), or elements
// (FLAT).
int64_t sharded_extent(int64_t rows, int64_t cols, shardmuon_partition partition);

std::vector<double> extract_shard(const Matrix& m, shardmuon_partition partition,
                                  const std::vector<int64_t>& sizes, int rank);

double max_abs_deviation_from_identity_of_gram(const Matrix& x);  // of X X^T or X^T X, the smaller

}  // namespace shardmuon_test
