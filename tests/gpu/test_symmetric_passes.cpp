// The CUDA backend's symmetric passes (mirror_lower, unpack_symmetric, and the column squares
// they take in parts), and the division staging X into the padded block they work on, against
// the CPU backend's, on one GPU: the passes of the multi-rank Gram (the unpacking) cannot
// otherwise be checked without two GPUs. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/symmetric_tiles.h"
#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"
#include "gpu_available.h"

namespace shardmuon {
namespace {

class SymmetricPasses : public ::testing::TestWithParam<shardmuon_dtype> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    cpu_ = make_cpu_backend();
    cuda_ = make_cuda_backend(0);
  }

  // A device copy of host bytes, freed with the test.
  void* on_device(const std::vector<char>& host) {
    void* pointer = nullptr;
    EXPECT_EQ(cudaMalloc(&pointer, host.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(pointer, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    allocations_.emplace_back(pointer, cudaFree);
    return pointer;
  }
  std::vector<char> to_host(const void* device, size_t bytes) {
    std::vector<char> host(bytes);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  static std::vector<char> random_elements(shardmuon_dtype dtype, int64_t count, uint32_t seed) {
    std::mt19937 generator(seed);
    std::normal_distribution<double> normal;
    std::vector<char> data(static_cast<size_t>(count) * element_size(dtype));
    for (int64_t i = 0; i < count; ++i) store_element(data.data(), dtype, i, normal(generator));
    return data;
  }
  // Each column's sum of squares from the backend's parts (added in order; the passes' own
  // fixed order may differ in the last bits, within the comparison's tolerance).
  static std::vector<double> column_squares(const Backend& backend, const std::vector<char>& parts,
                                            int64_t n, int64_t batch) {
    const int64_t count = backend.column_square_parts(n);
    std::vector<double> squares(static_cast<size_t>(n * batch), 0.0);
    for (int64_t m = 0; m < batch; ++m) {
      for (int64_t c = 0; c < n; ++c) {
        float sum = 0.0f;
        for (int64_t k = 0; k < count; ++k) {
          sum += static_cast<float>(
              load_element(parts.data(), SHARDMUON_FLOAT32, (m * count + k) * n + c));
        }
        squares[m * n + c] = sum;
      }
    }
    return squares;
  }
  static void expect_same_matrices(const std::vector<char>& expected, const std::vector<char>& got,
                                   shardmuon_dtype dtype, int64_t count, const char* what) {
    int64_t differing = 0;
    for (int64_t i = 0; i < count; ++i) {
      differing += load_element(expected.data(), dtype, i) != load_element(got.data(), dtype, i);
    }
    EXPECT_EQ(differing, 0) << what << ": entries differing from the CPU backend's";
  }
  static void expect_close_squares(const std::vector<double>& expected,
                                   const std::vector<double>& got) {
    ASSERT_EQ(expected.size(), got.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_NEAR(got[i], expected[i], 1e-5 * expected[i]) << "column square " << i;
    }
  }

  std::unique_ptr<Backend> cpu_, cuda_;
  std::vector<std::unique_ptr<void, cudaError_t (*)(void*)>> allocations_;
};

// Sides: one tile, a partial last tile, several tiles with a partial one; a batch of two.
constexpr int64_t kSides[] = {8, 72, 200, 1032};
constexpr int64_t kBatch = 2;

TEST_P(SymmetricPasses, MirrorMatchesTheCpuBackendWithItsColumnSquares) {
  const shardmuon_dtype dtype = GetParam();
  for (const int64_t n : kSides) {
    SCOPED_TRACE("n " + std::to_string(n));
    const int64_t elements = n * n * kBatch;
    std::vector<char> cpu_matrix = random_elements(dtype, elements, 11);
    void* device_matrix = on_device(cpu_matrix);
    std::vector<char> cpu_parts(static_cast<size_t>(cpu_->column_square_parts(n) * n * kBatch) * 4);
    const size_t cuda_parts_bytes =
        static_cast<size_t>(cuda_->column_square_parts(n) * n * kBatch) * 4;
    void* device_parts = on_device(std::vector<char>(cuda_parts_bytes));
    cpu_->mirror_lower(cpu_matrix.data(), dtype, n, kBatch, SymmetricDiagonal{}, cpu_parts.data(),
                       false, nullptr);
    cuda_->mirror_lower(device_matrix, dtype, n, kBatch, SymmetricDiagonal{}, device_parts, false,
                        nullptr);
    const std::vector<char> cuda_parts = to_host(device_parts, cuda_parts_bytes);
    expect_same_matrices(cpu_matrix, to_host(device_matrix, cpu_matrix.size()), dtype, elements,
                         "mirrored");
    expect_close_squares(column_squares(*cpu_, cpu_parts, n, kBatch),
                         column_squares(*cuda_, cuda_parts, n, kBatch));

    // A second matrix mirrored after its diagonal is set from A and the squares just taken
    // (shift + scale A_ii + square_scale |A_:i|^2), as P's is.
    std::vector<char> cpu_poly = random_elements(dtype, elements, 12);
    void* device_poly = on_device(cpu_poly);
    SymmetricDiagonal diagonal;
    diagonal.square_scale = 0.25;
    diagonal.scale = -1.5;
    diagonal.shift = 3.0;
    diagonal.addend = cpu_matrix.data();
    diagonal.squares = cpu_parts.data();
    cpu_->mirror_lower(cpu_poly.data(), dtype, n, kBatch, diagonal, nullptr, false, nullptr);
    diagonal.addend = device_matrix;
    diagonal.squares = device_parts;
    cuda_->mirror_lower(device_poly, dtype, n, kBatch, diagonal, nullptr, false, nullptr);
    const std::vector<char> got = to_host(device_poly, cpu_poly.size());
    for (int64_t m = 0; m < kBatch; ++m) {
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = m * n * n + c * n + r;
          const double expected = load_element(cpu_poly.data(), dtype, i);
          const double value = load_element(got.data(), dtype, i);
          if (r != c) {
            ASSERT_EQ(value, expected) << "entry (" << r << ", " << c << ") of matrix " << m;
          } else {  // the squares' float sums may differ in the last bit: one rounding step
            const double step =
                std::ldexp(std::fabs(expected), dtype == SHARDMUON_BFLOAT16 ? -7 : -22);
            ASSERT_NEAR(value, expected, std::max(step, 1e-5 * std::fabs(expected)))
                << "diagonal " << c << " of matrix " << m;
          }
        }
      }
    }
  }
}

// A product of one block (a plain GEMM) wrote both triangles: with upper_computed the pass
// writes only the diagonal (when set) and the squares, which are the mirrored matrix's. Here
// the matrices are not symmetric, so that a store above the diagonal would show: every entry
// but a set diagonal must come back as it went in, on both backends, and the squares and the
// diagonal must equal those of a mirroring pass over the same matrix on the same backend.
TEST_P(SymmetricPasses, AComputedUpperTriangleIsKeptAndOnlyTheDiagonalAndSquaresAreSet) {
  const shardmuon_dtype dtype = GetParam();
  for (const int64_t n : kSides) {
    SCOPED_TRACE("n " + std::to_string(n));
    const int64_t elements = n * n * kBatch;
    const std::vector<char> input = random_elements(dtype, elements, 21);
    const size_t parts_bytes = static_cast<size_t>(cuda_->column_square_parts(n) * n * kBatch) * 4;
    std::vector<char> cpu_parts[2];  // [upper_computed]
    std::vector<char> cuda_parts[2], cuda_matrix[2];
    void* device_matrix[2] = {};
    void* device_parts[2] = {};
    for (const bool upper_computed : {false, true}) {
      std::vector<char> cpu_matrix = input;
      cpu_parts[upper_computed].assign(
          static_cast<size_t>(cpu_->column_square_parts(n) * n * kBatch) * 4, 0);
      cpu_->mirror_lower(cpu_matrix.data(), dtype, n, kBatch, SymmetricDiagonal{},
                         cpu_parts[upper_computed].data(), upper_computed, nullptr);
      device_matrix[upper_computed] = on_device(input);
      device_parts[upper_computed] = on_device(std::vector<char>(parts_bytes));
      cuda_->mirror_lower(device_matrix[upper_computed], dtype, n, kBatch, SymmetricDiagonal{},
                          device_parts[upper_computed], upper_computed, nullptr);
      cuda_matrix[upper_computed] = to_host(device_matrix[upper_computed], input.size());
      cuda_parts[upper_computed] = to_host(device_parts[upper_computed], parts_bytes);
      if (upper_computed) {
        expect_same_matrices(input, cpu_matrix, dtype, elements, "CPU, upper computed");
        expect_same_matrices(input, cuda_matrix[1], dtype, elements, "CUDA, upper computed");
      }
    }
    EXPECT_TRUE(cpu_parts[0] == cpu_parts[1]) << "CPU squares differ from the mirrored matrix's";
    EXPECT_TRUE(cuda_parts[0] == cuda_parts[1]) << "CUDA squares differ from the mirrored matrix's";
    expect_close_squares(column_squares(*cpu_, cpu_parts[1], n, kBatch),
                         column_squares(*cuda_, cuda_parts[1], n, kBatch));

    // P's pass: the diagonal from A (the matrix mirrored above) and its squares, alike in both
    // modes; nothing else written with upper_computed.
    const std::vector<char> poly = random_elements(dtype, elements, 22);
    SymmetricDiagonal diagonal;
    diagonal.square_scale = 0.25;
    diagonal.scale = -1.5;
    diagonal.shift = 3.0;
    diagonal.addend = device_matrix[0];
    diagonal.squares = device_parts[0];
    std::vector<char> results[2];
    for (const bool upper_computed : {false, true}) {
      void* device_poly = on_device(poly);
      cuda_->mirror_lower(device_poly, dtype, n, kBatch, diagonal, nullptr, upper_computed,
                          nullptr);
      results[upper_computed] = to_host(device_poly, poly.size());
    }
    for (int64_t m = 0; m < kBatch; ++m) {
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = m * n * n + c * n + r;
          const double kept = load_element(results[1].data(), dtype, i);
          const double expected = r == c ? load_element(results[0].data(), dtype, i)
                                         : load_element(poly.data(), dtype, i);
          ASSERT_EQ(kept, expected) << "entry (" << r << ", " << c << ") of matrix " << m;
        }
      }
    }
  }
}

TEST_P(SymmetricPasses, UnpackMatchesTheCpuBackendWithItsColumnSquares) {
  const shardmuon_dtype dtype = GetParam();
  for (const shardmuon_dtype source : {SHARDMUON_FLOAT32, SHARDMUON_BFLOAT16}) {
    for (const int64_t n : kSides) {
      SCOPED_TRACE("n " + std::to_string(n) + " source " + dtype_name(source));
      const SymmetricTiles tiles = SymmetricTiles::split(n, 32);
      const std::vector<char> packed =
          random_elements(source, tiles.packed_elements() * kBatch, 13);
      const void* device_packed = on_device(packed);
      const int64_t elements = n * n * kBatch;
      std::vector<char> cpu_matrix(static_cast<size_t>(elements) * element_size(dtype));
      void* device_matrix = on_device(cpu_matrix);
      std::vector<char> cpu_parts(static_cast<size_t>(cpu_->column_square_parts(n) * n * kBatch) *
                                  4);
      const size_t cuda_parts_bytes =
          static_cast<size_t>(cuda_->column_square_parts(n) * n * kBatch) * 4;
      void* device_parts = on_device(std::vector<char>(cuda_parts_bytes));
      cpu_->unpack_symmetric(packed.data(), source, tiles, kBatch, cpu_matrix.data(), dtype, 0.75,
                             cpu_parts.data(), nullptr);
      cuda_->unpack_symmetric(device_packed, source, tiles, kBatch, device_matrix, dtype, 0.75,
                              device_parts, nullptr);
      expect_same_matrices(cpu_matrix, to_host(device_matrix, cpu_matrix.size()), dtype, elements,
                           "unpacked");
      expect_close_squares(
          column_squares(*cpu_, cpu_parts, n, kBatch),
          column_squares(*cuda_, to_host(device_parts, cuda_parts_bytes), n, kBatch));
    }
  }
}

// Both passes move runs of four rows: a side that is not a multiple of 4 (the library's are
// multiples of 8) is refused before anything is written, not unpacked or mirrored wrongly.
TEST_P(SymmetricPasses, PassesRefuseASideThatIsNotAMultipleOfFour) {
  const int64_t n = 202;
  const SymmetricTiles tiles = SymmetricTiles::split(n, 32);
  const void* device_packed =
      on_device(random_elements(SHARDMUON_FLOAT32, tiles.packed_elements(), 5));
  const std::vector<char> before = random_elements(GetParam(), n * n, 7);
  void* device_matrix = on_device(before);
  auto expect_refused = [&](const char* pass, const std::function<void()>& call) {
    SCOPED_TRACE(pass);
    try {
      call();
      ADD_FAILURE() << "a side of 202 was taken";
    } catch (const Failure& failure) {
      EXPECT_EQ(failure.status(), SHARDMUON_ERROR_INTERNAL);
      EXPECT_NE(std::string(failure.what()).find("multiple of 4, not 202"), std::string::npos)
          << failure.what();
    }
    expect_same_matrices(before, to_host(device_matrix, before.size()), GetParam(), n * n,
                         "the matrix after the refused call");
  };
  expect_refused("unpack_symmetric", [&] {
    cuda_->unpack_symmetric(device_packed, SHARDMUON_FLOAT32, tiles, 1, device_matrix, GetParam(),
                            0.0, nullptr, nullptr);
  });
  expect_refused("mirror_lower", [&] {
    cuda_->mirror_lower(device_matrix, GetParam(), n, 1, SymmetricDiagonal{}, nullptr, false,
                        nullptr);
  });
}

// The split of one rank's products on CUDA: 32 equal blocks at multiples of 4096 (whole waves
// of 128 x 128 thread-block tiles on an H200, SymmetricTiles::for_products), else the packed
// Gram's split.
TEST_P(SymmetricPasses, ProductTilesAreThirtyTwoEqualBlocksAtMultiplesOf4096) {
  for (const int64_t n : {4096, 8192, 16384}) {
    const SymmetricTiles tiles = cuda_->product_tiles(n);
    ASSERT_EQ(tiles.blocks(), 32) << n;
    EXPECT_EQ(tiles.width(31), n / 32) << n;
  }
  for (const int64_t n : {1032, 3008, 6144}) {
    const SymmetricTiles tiles = cuda_->product_tiles(n);
    const SymmetricTiles packed = SymmetricTiles::split(n, cuda_->symmetric_block_target());
    EXPECT_EQ(tiles.starts, packed.starts) << n;
  }
}

// The division that stages an unaligned block into the padded one the products run on
// (Backend::divide_by_norm_padded): the CPU backend's values bit for bit, zero in the padding,
// for a batch of two (the second with a zero norm and eps 0: zeros, not NaN), where the padding
// adds columns only, rows only, both, or none.
TEST_P(SymmetricPasses, DivisionIntoAPaddedBlockMatchesTheCpuBackend) {
  const shardmuon_dtype dtype = GetParam();
  struct Case {
    int64_t rows, cols, padded_rows, padded_cols;
  };
  for (const Case& c : {Case{3, 5, 3, 8}, Case{37, 104, 40, 104}, Case{301, 97, 320, 104},
                        Case{16, 24, 16, 24}, Case{1, 1, 8, 8}}) {
    SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.cols) + " into " +
                 std::to_string(c.padded_rows) + " x " + std::to_string(c.padded_cols));
    const std::vector<char> source = random_elements(dtype, c.rows * c.cols * kBatch, 13);
    std::vector<char> sums(2 * sizeof(float));
    store_element(sums.data(), SHARDMUON_FLOAT32, 0, 37.5);
    store_element(sums.data(), SHARDMUON_FLOAT32, 1, 0.0);
    const int64_t padded = c.padded_rows * c.padded_cols * kBatch;
    std::vector<char> expected(static_cast<size_t>(padded) * element_size(dtype), 1);
    cpu_->divide_by_norm_padded(source.data(), c.rows, c.cols, expected.data(), c.padded_rows,
                                c.padded_cols, dtype, kBatch, sums.data(), 0.0, nullptr);
    // The device buffer starts non-zero, so the padding must be written.
    void* device = on_device(std::vector<char>(expected.size(), 1));
    cuda_->divide_by_norm_padded(on_device(source), c.rows, c.cols, device, c.padded_rows,
                                 c.padded_cols, dtype, kBatch, on_device(sums), 0.0, nullptr);
    const std::vector<char> got = to_host(device, expected.size());
    expect_same_matrices(expected, got, dtype, padded, "divided into the padded block");
    int64_t nonzero_padding = 0, second_nonzero = 0;
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t r = 0; r < c.padded_rows; ++r) {
        for (int64_t col = 0; col < c.padded_cols; ++col) {
          const double value =
              load_element(got.data(), dtype, (b * c.padded_rows + r) * c.padded_cols + col);
          nonzero_padding += (r >= c.rows || col >= c.cols) && value != 0.0;
          second_nonzero += b == 1 && value != 0.0;
        }
      }
    }
    EXPECT_EQ(nonzero_padding, 0);
    EXPECT_EQ(second_nonzero, 0);
    // The first matrix's entries are the source's over sqrt(37.5), rounded.
    EXPECT_NEAR(load_element(got.data(), dtype, 0),
                load_element(source.data(), dtype, 0) / std::sqrt(37.5), 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SymmetricPasses,
                         ::testing::Values(SHARDMUON_FLOAT32, SHARDMUON_BFLOAT16),
                         [](const auto& param_info) {
                           return std::string(dtype_name(param_info.param));
                         });

}  // namespace
}  // namespace shardmuon
