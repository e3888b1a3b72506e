#include "cuda/cublaslt_gemm.h"

#include <cstdint>

#include "core/error.h"

namespace shardmuon {
namespace {

void check_cublas(cublasStatus_t code, const char* what) {
  if (code == CUBLAS_STATUS_SUCCESS) return;
  fail(code == CUBLAS_STATUS_ALLOC_FAILED ? SHARDMUON_ERROR_OUT_OF_MEMORY : SHARDMUON_ERROR_CUBLAS,
       what, " failed: ", cublasLtGetStatusName(code), " (", cublasLtGetStatusString(code), ")");
}

#define SHARDMUON_CUBLAS(call) check_cublas((call), #call)

// cuBLASLt's heuristics may choose kernels that need larger workspaces for large shapes;
// 32 MiB is what cuBLAS itself reserves on Hopper.
constexpr size_t kCublasWorkspaceBytes = 32u << 20;

cudaDataType_t cuda_type(shardmuon_dtype dtype) {
  switch (dtype) {
    case SHARDMUON_FLOAT32: return CUDA_R_32F;
    case SHARDMUON_BFLOAT16: return CUDA_R_16BF;
    case SHARDMUON_FLOAT64: return CUDA_R_64F;
  }
  fail(SHARDMUON_ERROR_INTERNAL, "no CUDA type for dtype ", static_cast<int>(dtype));
}

// The largest power of two (up to 256) that divides the address.
int64_t alignment_of(const void* pointer) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  int64_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

}  // namespace

struct CublasLtGemm::Plan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
  bool double_scale = false;

  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (operation) cublasLtMatmulDescDestroy(operation);
  }
};

CublasLtGemm::CublasLtGemm() {
  SHARDMUON_CUBLAS(cublasLtCreate(&handle_));
  workspace_ = make_device_memory(kCublasWorkspaceBytes);
  workspace_bytes_ = kCublasWorkspaceBytes;
}

CublasLtGemm::~CublasLtGemm() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

const CublasLtGemm::Plan& CublasLtGemm::plan_for(const GemmCall& call) {
  const PlanKey key = {call.transpose_a, call.transpose_b, call.m, call.n, call.k, call.lda,
                       call.ldb, call.ldc, call.ldd, call.ab_type, call.cd_type,
                       alignment_of(call.a), alignment_of(call.b),
                       std::min(alignment_of(call.c), alignment_of(call.d)), call.sm_count_target,
                       call.batch, call.stride_a, call.stride_b,
                       // beta == 0: C is D (run's pointer), with D's strides
                       call.beta == 0.0 ? call.stride_d : call.stride_c, call.stride_d};
  auto found = plans_.find(key);
  if (found != plans_.end()) return *found->second;

  auto plan = std::make_unique<Plan>();
  const bool fp64 = call.ab_type == SHARDMUON_FLOAT64;
  plan->double_scale = fp64;
  // Plain float32 compute: no TF32, so float32 results keep float32 accuracy.
  const cublasComputeType_t compute = fp64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const cudaDataType_t scale = fp64 ? CUDA_R_64F : CUDA_R_32F;
  SHARDMUON_CUBLAS(cublasLtMatmulDescCreate(&plan->operation, compute, scale));
  const cublasOperation_t op_a = call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  SHARDMUON_CUBLAS(cublasLtMatmulDescSetAttribute(plan->operation, CUBLASLT_MATMUL_DESC_TRANSA,
                                                  &op_a, sizeof op_a));
  SHARDMUON_CUBLAS(cublasLtMatmulDescSetAttribute(plan->operation, CUBLASLT_MATMUL_DESC_TRANSB,
                                                  &op_b, sizeof op_b));
  if (call.sm_count_target > 0) {
    const int32_t sms = call.sm_count_target;
    SHARDMUON_CUBLAS(cublasLtMatmulDescSetAttribute(
        plan->operation, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof sms));
  }

  const cudaDataType_t ab = cuda_type(call.ab_type), cd = cuda_type(call.cd_type);
  // Stored shapes (column-major): A is m x k, or k x m when transposed; likewise B.
  SHARDMUON_CUBLAS(cublasLtMatrixLayoutCreate(&plan->a, ab, call.transpose_a ? call.k : call.m,
                                              call.transpose_a ? call.m : call.k, call.lda));
  SHARDMUON_CUBLAS(cublasLtMatrixLayoutCreate(&plan->b, ab, call.transpose_b ? call.n : call.k,
                                              call.transpose_b ? call.k : call.n, call.ldb));
  SHARDMUON_CUBLAS(cublasLtMatrixLayoutCreate(&plan->c, cd, call.m, call.n, call.ldc));
  SHARDMUON_CUBLAS(cublasLtMatrixLayoutCreate(&plan->d, cd, call.m, call.n, call.ldd));
  if (call.batch > 1) {  // a strided batch: the same count on every operand, each its stride
    const int32_t count = static_cast<int32_t>(call.batch);
    const cublasLtMatrixLayout_t layouts[4] = {plan->a, plan->b, plan->c, plan->d};
    const int64_t strides[4] = {key[16], key[17], key[18], key[19]};
    for (int i = 0; i < 4; ++i) {
      SHARDMUON_CUBLAS(cublasLtMatrixLayoutSetAttribute(
          layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      SHARDMUON_CUBLAS(cublasLtMatrixLayoutSetAttribute(
          layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i], sizeof strides[i]));
    }
  }

  cublasLtMatmulPreference_t preference = nullptr;
  SHARDMUON_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      preference_owner(preference, cublasLtMatmulPreferenceDestroy);
  SHARDMUON_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes_, sizeof workspace_bytes_));
  const uint32_t alignments[4] = {static_cast<uint32_t>(key[11]), static_cast<uint32_t>(key[12]),
                                  static_cast<uint32_t>(key[13]), static_cast<uint32_t>(key[13])};
  const cublasLtMatmulPreferenceAttributes_t alignment_attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    SHARDMUON_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, alignment_attributes[i],
                                                          &alignments[i], sizeof alignments[i]));
  }

  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  SHARDMUON_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle_, plan->operation, plan->a, plan->b,
                                                  plan->c, plan->d, preference, 1, &result,
                                                  &found_count));
  if (found_count == 0) {
    fail(SHARDMUON_ERROR_CUBLAS, "cuBLASLt has no algorithm for the GEMM m=", call.m, " n=", call.n,
         " k=", call.k, " lda=", call.lda, " ldb=", call.ldb, " ldd=", call.ldd);
  }
  plan->algorithm = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void CublasLtGemm::run(const GemmCall& call, cudaStream_t stream) {
  const Plan& plan = plan_for(call);
  // beta == 0 must not read C; point it at D, which has C's type and shape.
  const void* c = call.beta == 0.0 ? call.d : call.c;
  if (plan.double_scale) {
    const double alpha = call.alpha, beta = call.beta;
    SHARDMUON_CUBLAS(cublasLtMatmul(handle_, plan.operation, &alpha, call.a, plan.a, call.b, plan.b,
                                    &beta, c, plan.c, call.d, plan.d, &plan.algorithm,
                                    workspace_.get(), workspace_bytes_, stream));
  } else {
    const float alpha = static_cast<float>(call.alpha), beta = static_cast<float>(call.beta);
    SHARDMUON_CUBLAS(cublasLtMatmul(handle_, plan.operation, &alpha, call.a, plan.a, call.b, plan.b,
                                    &beta, c, plan.c, call.d, plan.d, &plan.algorithm,
                                    workspace_.get(), workspace_bytes_, stream));
  }
}

}  // namespace shardmuon
