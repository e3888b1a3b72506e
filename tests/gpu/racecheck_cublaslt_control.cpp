// A control for compute-sanitizer racecheck: cuBLASLt alone, no shardmuon code.
//
// Racecheck over the CUDA suite on an H100 with cuBLASLt 13.1.0.3 (forty-ninth session,
// docs/GPU_RUNS.md) reported shared-memory hazards inside cuBLASLt's own kernels
// (nvjet_sm90_tst_*), in the replicated bf16 Gram runs of side 1510 x 1523. cuBLASLt's API log
// recorded the GEMMs those runs make; this program makes the same GEMMs, from the same
// descriptors, and nothing else. Run under racecheck, its reports are what cuBLASLt's kernels
// draw on their own (with that version, the same kernels at the same offsets), so that reports
// in nvjet_* kernels in the suite can be told apart from reports in shardmuon's kernels.
//
// The products (column-major, bf16 in and out, float32 compute, leading dimension 1536, no
// workspace): the padded 1536 x 1528 = 1536 x 1536 . 1536 x 1528 product, and the six lower
// tiles of a 3 x 3 grid of 512 x 512 blocks of a symmetric product, batched through pointer
// arrays, as X X^T (k 1528) and as A A (k 1536). Exit status 0 when every GEMM ran.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

constexpr int64_t kLeading = 1536;  // every operand's leading dimension
constexpr int64_t kTile = 512;

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "racecheck_cublaslt_control: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "racecheck_cublaslt_control: %s: cuBLAS status %d\n", what,
                 static_cast<int>(status));
    std::exit(1);
  }
}

// D = A . op(B), m x n, with A m x k and B k x n (or n x k, transposed), in bf16; batch > 1
// takes a, b and d as device arrays of `batch` pointers each.
void run_gemm(cublasLtHandle_t handle, int64_t m, int64_t n, int64_t k, bool transpose_b,
              int32_t batch, const void* a, const void* b, void* d) {
  cublasLtMatmulDesc_t operation = nullptr;
  check_cublas(cublasLtMatmulDescCreate(&operation, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_cublas(
      cublasLtMatmulDescSetAttribute(operation, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
      "transb");
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_d = nullptr;
  check_cublas(cublasLtMatrixLayoutCreate(&layout_a, CUDA_R_16BF, m, k, kLeading), "layout A");
  check_cublas(cublasLtMatrixLayoutCreate(&layout_b, CUDA_R_16BF, transpose_b ? n : k,
                                          transpose_b ? k : n, kLeading),
               "layout B");
  check_cublas(cublasLtMatrixLayoutCreate(&layout_d, CUDA_R_16BF, m, n, kLeading), "layout D");
  if (batch > 1) {
    const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    for (cublasLtMatrixLayout_t layout : {layout_a, layout_b, layout_d}) {
      check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                    &batch, sizeof batch),
                   "batch count");
      check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE,
                                                    &mode, sizeof mode),
                   "batch mode");
    }
  }
  cublasLtMatmulPreference_t preference = nullptr;
  check_cublas(cublasLtMatmulPreferenceCreate(&preference), "preference");
  const size_t no_workspace = 0;
  check_cublas(
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &no_workspace, sizeof no_workspace),
      "workspace limit");
  cublasLtMatmulHeuristicResult_t choice{};
  int found = 0;
  check_cublas(cublasLtMatmulAlgoGetHeuristic(handle, operation, layout_a, layout_b, layout_d,
                                              layout_d, preference, 1, &choice, &found),
               "heuristic");
  if (found == 0) {
    std::fprintf(stderr, "racecheck_cublaslt_control: no algorithm for m=%lld n=%lld k=%lld\n",
                 static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
    std::exit(1);
  }
  const float alpha = 1.0f, beta = 0.0f;
  check_cublas(cublasLtMatmul(handle, operation, &alpha, a, layout_a, b, layout_b, &beta, d,
                              layout_d, d, layout_d, &choice.algo, nullptr, 0, nullptr),
               "matmul");
  check_cuda(cudaDeviceSynchronize(), "GEMM");
  std::printf("GEMM m=%lld n=%lld k=%lld %s batch=%d: ran\n", static_cast<long long>(m),
              static_cast<long long>(n), static_cast<long long>(k), transpose_b ? "NT" : "NN",
              static_cast<int>(batch));
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(layout_d);
  cublasLtMatrixLayoutDestroy(layout_b);
  cublasLtMatrixLayoutDestroy(layout_a);
  cublasLtMatmulDescDestroy(operation);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("racecheck_cublaslt_control: no GPU, nothing run\n");
    return 0;
  }
  cublasLtHandle_t handle = nullptr;
  check_cublas(cublasLtCreate(&handle), "handle");

  const size_t elements = static_cast<size_t>(kLeading * kLeading);
  std::vector<__nv_bfloat16> host(elements);
  std::mt19937 generator(49);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (__nv_bfloat16& value : host) value = __float2bfloat16(uniform(generator));
  __nv_bfloat16* matrices[3] = {};  // x, y and the output z, each 1536 x 1536
  for (__nv_bfloat16*& matrix : matrices) {
    check_cuda(cudaMalloc(&matrix, elements * sizeof(__nv_bfloat16)), "cudaMalloc");
    check_cuda(
        cudaMemcpy(matrix, host.data(), elements * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  }
  __nv_bfloat16 *x = matrices[0], *y = matrices[1], *z = matrices[2];

  run_gemm(handle, kLeading, kLeading - 8, kLeading, false, 1, x, y, z);

  // Tile (i, j) of the lower triangle: row block i of x; row block j of y (X X^T, B
  // transposed) or column block j of y (A A); block (i, j) of z.
  constexpr int kTiles = 6;
  const int64_t blocks[kTiles][2] = {{0, 0}, {1, 0}, {1, 1}, {2, 0}, {2, 1}, {2, 2}};
  void* pointers[4][kTiles];
  for (int t = 0; t < kTiles; ++t) {
    const int64_t i = blocks[t][0], j = blocks[t][1];
    pointers[0][t] = x + i * kTile;
    pointers[1][t] = y + j * kTile;
    pointers[2][t] = y + j * kTile * kLeading;
    pointers[3][t] = z + i * kTile + j * kTile * kLeading;
  }
  void** device_pointers = nullptr;
  check_cuda(cudaMalloc(&device_pointers, sizeof pointers), "cudaMalloc");
  check_cuda(cudaMemcpy(device_pointers, pointers, sizeof pointers, cudaMemcpyHostToDevice),
             "cudaMemcpy");
  void** const x_rows = device_pointers;
  void** const y_rows = device_pointers + kTiles;
  void** const y_columns = device_pointers + 2 * kTiles;
  void** const z_blocks = device_pointers + 3 * kTiles;
  run_gemm(handle, kTile, kTile, kLeading - 8, true, kTiles, x_rows, y_rows, z_blocks);
  run_gemm(handle, kTile, kTile, kLeading, false, kTiles, x_rows, y_columns, z_blocks);

  check_cuda(cudaFree(device_pointers), "cudaFree");
  for (__nv_bfloat16* matrix : matrices) check_cuda(cudaFree(matrix), "cudaFree");
  check_cublas(cublasLtDestroy(handle), "destroy");
  return 0;
}
