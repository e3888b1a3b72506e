#include "reference.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace shardmuon_test {

Matrix Matrix::transposed() const {
  Matrix t(cols, rows);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t.at(c, r) = at(r, c);
  return t;
}

std::vector<Triple> schedule_table(shardmuon_schedule schedule) {
  switch (schedule) {
    case SHARDMUON_SCHEDULE_SIMPLE: return {{3.4445, -4.7750, 2.0315}};
    case SHARDMUON_SCHEDULE_QUINTIC:
      return {{4.0848, -6.8946, 2.9270},
              {3.9505, -6.3029, 2.6377},
              {3.7418, -5.5913, 2.3037},
              {2.8769, -3.1427, 1.2046},
              {2.8366, -3.0525, 1.2012}};
    case SHARDMUON_SCHEDULE_POLAR_EXPRESS:
      return {{8.2051, -22.9019, 16.4607}, {4.0664, -2.8612, 0.5184}, {3.9096, -2.8234, 0.5250},
              {3.2856, -2.4153, 0.4853},   {2.2779, -1.6198, 0.3985}, {1.8726, -1.2307, 0.3585},
              {1.8564, -1.2132, 0.3568},   {1.8750, -1.2500, 0.3750}};
    case SHARDMUON_SCHEDULE_CANS:
      return {{8.4703, -25.1081, 18.6293},
              {4.1828, -3.1087, 0.5806},
              {3.9619, -2.9541, 0.5630},
              {3.2866, -2.4647, 0.5074},
              {2.2737, -1.6447, 0.4162}};
    case SHARDMUON_SCHEDULE_AOL:
      return {{4.0098, -7.0585, 2.4635},
              {3.4585, -5.5479, 2.5959},
              {2.7573, -3.2939, 1.4254},
              {2.7215, -3.0494, 1.3169}};
    default: throw std::invalid_argument("no table for this schedule");
  }
}

bool schedule_is_cycled(shardmuon_schedule schedule) {
  return schedule == SHARDMUON_SCHEDULE_SIMPLE || schedule == SHARDMUON_SCHEDULE_QUINTIC ||
         schedule == SHARDMUON_SCHEDULE_AOL;
}

std::vector<Triple> coefficients_for(shardmuon_schedule schedule, int iterations) {
  const std::vector<Triple> table = schedule_table(schedule);
  const int size = static_cast<int>(table.size());
  std::vector<Triple> result;
  for (int k = 0; k < iterations; ++k) {
    result.push_back(table[schedule_is_cycled(schedule) ? k % size : std::min(k, size - 1)]);
  }
  return result;
}

uint64_t Random::next_u64() {  // splitmix64
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Random::uniform() {
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

double Random::gaussian() {  // Box-Muller
  const double u1 = 1.0 - uniform(), u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

Matrix random_gaussian(int64_t rows, int64_t cols, uint64_t seed) {
  Random random(seed);
  Matrix m(rows, cols);
  for (double& v : m.values) v = random.gaussian();
  return m;
}

Matrix random_orthonormal_columns(int64_t rows, int64_t cols, uint64_t seed) {
  Matrix q = random_gaussian(rows, cols, seed);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t i = 0; i < j; ++i) {
        double dot = 0;
        for (int64_t r = 0; r < rows; ++r) dot += q.at(r, i) * q.at(r, j);
        for (int64_t r = 0; r < rows; ++r) q.at(r, j) -= dot * q.at(r, i);
      }
      double norm = 0;
      for (int64_t r = 0; r < rows; ++r) norm += q.at(r, j) * q.at(r, j);
      norm = std::sqrt(norm);
      for (int64_t r = 0; r < rows; ++r) q.at(r, j) /= norm;
    }
  }
  return q;
}

Matrix random_with_singular_values(int64_t rows, int64_t cols, double low, double high,
                                   uint64_t seed) {
  const int64_t k = std::min(rows, cols);
  const Matrix u = random_orthonormal_columns(rows, k, seed);
  const Matrix v = random_orthonormal_columns(cols, k, seed + 1);
  Random random(seed + 2);
  std::vector<double> sigma(k);
  for (double& s : sigma) s = low + (high - low) * random.uniform();
  Matrix w(rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      double sum = 0;
      for (int64_t i = 0; i < k; ++i) sum += u.at(r, i) * sigma[i] * v.at(c, i);
      w.at(r, c) = sum;
    }
  return w;
}

namespace {
// a b in float64 through OpenBLAS (a naive loop took about three minutes per oracle of the
// 2085 x 2301 GPU case); row-major, as Matrix is.
Matrix multiply(const Matrix& a, const Matrix& b) {
  if (a.cols != b.rows) throw std::invalid_argument("multiply: inner dimensions differ");
  Matrix c(a.rows, b.cols);
  if (c.rows == 0 || c.cols == 0 || a.cols == 0) return c;
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(a.rows),
              static_cast<blasint>(b.cols), static_cast<blasint>(a.cols), 1.0, a.values.data(),
              static_cast<blasint>(a.cols), b.values.data(), static_cast<blasint>(b.cols), 0.0,
              c.values.data(), static_cast<blasint>(c.cols));
  return c;
}
}  // namespace

Matrix reference_newton_schulz(const Matrix& w, const std::vector<Triple>& coefficients,
                               double eps) {
  double sum = 0;
  for (double v : w.values) sum += v * v;
  const double norm = std::max(std::sqrt(sum), eps);
  Matrix x = w;
  for (double& v : x.values) v = norm > 0 ? v / norm : 0.0;
  for (const Triple& k : coefficients) {
    const Matrix a = multiply(x, x.transposed());  // rows x rows
    const Matrix ax = multiply(a, x);
    const Matrix aax = multiply(a, ax);
    for (size_t i = 0; i < x.values.size(); ++i) {
      x.values[i] = k.a * x.values[i] + k.b * ax.values[i] + k.c * aax.values[i];
    }
  }
  return x;
}

void reference_muon_step(Matrix& w, const Matrix& g, Matrix& m, const ReferenceGroup& group) {
  const double lr = group.lr, wd = group.weight_decay, beta = group.momentum;
  Matrix grad = g;
  if (group.weight_decay_mode == SHARDMUON_WEIGHT_DECAY_L2) {
    for (size_t i = 0; i < grad.values.size(); ++i) grad.values[i] += wd * w.values[i];
  }
  Matrix update(w.rows, w.cols);
  for (size_t i = 0; i < m.values.size(); ++i) {
    m.values[i] = beta * m.values[i] + (1 - beta) * grad.values[i];
    update.values[i] =
        group.nesterov ? (1 - beta) * grad.values[i] + beta * m.values[i] : m.values[i];
  }
  const Matrix o = reference_newton_schulz(update, group.coefficients, group.eps);
  const double rows = static_cast<double>(w.rows), cols = static_cast<double>(w.cols);
  double scale = 1.0;
  switch (group.scale_mode) {
    case SHARDMUON_SCALE_SPECTRAL: scale = std::sqrt(std::max(rows, cols)); break;
    case SHARDMUON_SCALE_SHAPE_SCALING: scale = std::sqrt(std::max(1.0, rows / cols)); break;
    case SHARDMUON_SCALE_UNIT_RMS_NORM: scale = std::sqrt(rows / cols); break;
    case SHARDMUON_SCALE_NONE: scale = 1.0; break;
  }
  double decay = 1.0;
  if (group.weight_decay_mode == SHARDMUON_WEIGHT_DECAY_DECOUPLED) decay = 1 - lr * wd;
  if (group.weight_decay_mode == SHARDMUON_WEIGHT_DECAY_INDEPENDENT) decay = 1 - wd;
  for (size_t i = 0; i < w.values.size(); ++i) {
    w.values[i] = w.values[i] * decay - lr * group.extra_scale_factor * scale * o.values[i];
  }
}

Matrix torch_form_bf16_newton_schulz(const Matrix& w, const std::vector<Triple>& coefficients,
                                     double eps) {
  auto round_all = [](Matrix m) {
    for (double& v : m.values) v = round_to_bf16(v);
    return m;
  };
  auto combine = [&](double alpha, const Matrix& p, double beta, const Matrix& q) {
    Matrix r(p.rows, p.cols);
    for (size_t i = 0; i < r.values.size(); ++i) {
      r.values[i] =
          round_to_bf16(round_to_bf16(alpha * p.values[i]) + round_to_bf16(beta * q.values[i]));
    }
    return r;
  };
  const bool tall = w.rows > w.cols;
  Matrix x = round_all(tall ? w.transposed() : w);
  double sum = 0;
  for (double v : x.values) sum += v * v;
  const double norm = std::max(std::sqrt(sum), eps);
  for (double& v : x.values) v = round_to_bf16(v / norm);
  for (const Triple& k : coefficients) {
    const Matrix a = round_all(multiply(x, x.transposed()));
    const Matrix b = combine(k.b, a, k.c, round_all(multiply(a, a)));
    x = combine(k.a, x, 1.0, round_all(multiply(b, x)));
  }
  return tall ? x.transposed() : x;
}

double round_to_bf16(double value) {
  const float f = static_cast<float>(value);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float rounded;
  std::memcpy(&rounded, &bits, 4);
  return rounded;
}

Matrix rounded_to(const Matrix& m, shardmuon_dtype dtype) {
  Matrix r = m;
  for (double& v : r.values) {
    if (dtype == SHARDMUON_FLOAT32) v = static_cast<float>(v);
    if (dtype == SHARDMUON_BFLOAT16) v = round_to_bf16(v);
  }
  return r;
}

size_t dtype_size(shardmuon_dtype dtype) {
  return dtype == SHARDMUON_FLOAT64 ? 8 : dtype == SHARDMUON_FLOAT32 ? 4 : 2;
}

const char* dtype_label(shardmuon_dtype dtype) {
  return dtype == SHARDMUON_FLOAT64 ? "f64" : dtype == SHARDMUON_FLOAT32 ? "f32" : "bf16";
}

std::vector<unsigned char> to_bytes(const std::vector<double>& values, shardmuon_dtype dtype) {
  std::vector<unsigned char> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    unsigned char* out = bytes.data() + i * dtype_size(dtype);
    if (dtype == SHARDMUON_FLOAT64) {
      std::memcpy(out, &values[i], 8);
    } else {
      const float f =
          static_cast<float>(dtype == SHARDMUON_BFLOAT16 ? round_to_bf16(values[i]) : values[i]);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      if (dtype == SHARDMUON_FLOAT32) {
        std::memcpy(out, &bits, 4);
      } else {
        const uint16_t high = static_cast<uint16_t>(bits >> 16);
        std::memcpy(out, &high, 2);
      }
    }
  }
  return bytes;
}

std::vector<double> from_bytes(const std::vector<unsigned char>& bytes, shardmuon_dtype dtype) {
  const size_t size = dtype_size(dtype);
  std::vector<double> values(bytes.size() / size);
  for (size_t i = 0; i < values.size(); ++i) {
    const unsigned char* in = bytes.data() + i * size;
    if (dtype == SHARDMUON_FLOAT64) {
      std::memcpy(&values[i], in, 8);
    } else if (dtype == SHARDMUON_FLOAT32) {
      float f;
      std::memcpy(&f, in, 4);
      values[i] = f;
    } else {
      uint16_t high;
      std::memcpy(&high, in, 2);
      const uint32_t bits = static_cast<uint32_t>(high) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      values[i] = f;
    }
  }
  return values;
}

std::vector<int64_t> balanced_sizes(int64_t extent, int parts) {
  std::vector<int64_t> sizes(parts, extent / parts);
  for (int64_t r = 0; r < extent % parts; ++r) ++sizes[r];
  return sizes;
}

std::vector<int64_t> uneven_sizes(int64_t extent, int parts) {
  // Weights 3, 0, 1, 5, 2, ...: the second rank is empty whenever there are three or more.
  static const int weights[] = {3, 0, 1, 5, 2, 4, 1, 3};
  std::vector<int64_t> sizes(parts, 0);
  if (parts == 1) return {extent};
  if (parts == 2) return {extent - extent / 3, extent / 3};
  int total = 0;
  for (int r = 0; r < parts; ++r) total += weights[r % 8];
  int64_t assigned = 0;
  for (int r = 0; r < parts; ++r) {
    sizes[r] = extent * weights[r % 8] / total;
    assigned += sizes[r];
  }
  sizes[parts - 1] += extent - assigned;
  return sizes;
}

std::vector<int64_t> last_holds_all(int64_t extent, int parts) {
  std::vector<int64_t> sizes(parts, 0);
  sizes[parts - 1] = extent;
  return sizes;
}

int64_t sharded_extent(int64_t rows, int64_t cols, shardmuon_partition partition) {
  return partition == SHARDMUON_SHARDED_DIM0   ? rows
         : partition == SHARDMUON_SHARDED_FLAT ? rows * cols
                                               : cols;
}

std::vector<double> extract_shard(const Matrix& m, shardmuon_partition partition,
                                  const std::vector<int64_t>& sizes, int rank) {
  if (partition == SHARDMUON_REPLICATED) return m.values;
  if (rank < 0 || rank >= static_cast<int>(sizes.size()))  // e.g. a process outside the group
    throw std::out_of_range("extract_shard: rank " + std::to_string(rank) + " of " +
                            std::to_string(sizes.size()) + " shards");
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += sizes[r];
  std::vector<double> shard;
  if (partition == SHARDMUON_SHARDED_FLAT) {
    shard.assign(m.values.begin() + offset, m.values.begin() + offset + sizes[rank]);
  } else if (partition == SHARDMUON_SHARDED_DIM0) {
    for (int64_t r = offset; r < offset + sizes[rank]; ++r)
      for (int64_t c = 0; c < m.cols; ++c) shard.push_back(m.at(r, c));
  } else {
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t c = offset; c < offset + sizes[rank]; ++c) shard.push_back(m.at(r, c));
  }
  return shard;
}

double max_abs_deviation_from_identity_of_gram(const Matrix& x) {
  const Matrix wide = x.rows <= x.cols ? x : x.transposed();
  const Matrix gram = multiply(wide, wide.transposed());
  double worst = 0;
  for (int64_t i = 0; i < gram.rows; ++i)
    for (int64_t j = 0; j < gram.cols; ++j)
      worst = std::max(worst, std::fabs(gram.at(i, j) - (i == j ? 1.0 : 0.0)));
  return worst;
}

}  // namespace shardmuon_test
