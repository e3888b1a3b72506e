#include "cuda/cublaslt_gemm.h"

#include <cstdint>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/cuda_check.h"

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

// The largest power of two (up to 256) that divides a byte offset.
int64_t alignment_of_offset(int64_t bytes) {
  return alignment_of(reinterpret_cast<const void*>(static_cast<uintptr_t>(bytes)));
}

// Whether two algorithms are one kernel configuration: the same kernel, tile, stages,
// split, reduction, swizzle and options (the workspace they were chosen for aside).
bool same_configuration(const cublasLtMatmulAlgo_t& x, const cublasLtMatmulAlgo_t& y) {
  const cublasLtMatmulAlgoConfigAttributes_t attributes[] = {CUBLASLT_ALGO_CONFIG_ID,
                                                             CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                             CUBLASLT_ALGO_CONFIG_STAGES_ID,
                                                             CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                             CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                             CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                                                             CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                                                             CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID,
                                                             CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
  for (const auto attribute : attributes) {
    uint64_t value[2] = {0, 0};  // every attribute above fits in 8 bytes
    for (int i = 0; i < 2; ++i) {
      const cublasLtMatmulAlgo_t* algorithm = i == 0 ? &x : &y;
      size_t size = 0;  // the attribute's own size, which the query must pass
      if (cublasLtMatmulAlgoConfigGetAttribute(algorithm, attribute, nullptr, 0, &size) !=
              CUBLAS_STATUS_SUCCESS ||
          size > sizeof value[i] ||
          cublasLtMatmulAlgoConfigGetAttribute(algorithm, attribute, &value[i], size, &size) !=
              CUBLAS_STATUS_SUCCESS) {
        return false;
      }
    }
    if (value[0] != value[1]) return false;
  }
  return true;
}

}  // namespace

struct CublasLtGemm::Plan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
  size_t workspace_bytes = 0;  // what the algorithm is run with: 0 or the whole workspace
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
  try {
    workspace_ = make_device_memory(kCublasWorkspaceBytes);
    workspace_bytes_ = kCublasWorkspaceBytes;
    pointer_arrays_ = make_device_memory(4 * kPointerCapacity * sizeof(void*));
    kept_arrays_ = make_device_memory(4 * kKeptCapacity * sizeof(void*));
  } catch (...) {  // no destructor runs for a constructor that throws
    cublasLtDestroy(handle_);
    throw;
  }
}

CublasLtGemm::~CublasLtGemm() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

const CublasLtGemm::Plan& CublasLtGemm::plan_for(const GemmCall& call, bool pointer_arrays,
                                                 int64_t alignment_a, int64_t alignment_b,
                                                 int64_t alignment_cd) {
  const bool strided = !pointer_arrays && call.batch > 1;
  const PlanKey key = {call.transpose_a, call.transpose_b, call.m, call.n, call.k, call.lda,
                       call.ldb, call.ldc, call.ldd, call.ab_type, call.cd_type, alignment_a,
                       alignment_b, alignment_cd, call.sm_count_target, call.batch,
                       strided ? call.stride_a : 0, strided ? call.stride_b : 0,
                       // beta == 0: C is D (run's pointer), with D's strides
                       strided ? (call.beta == 0.0 ? call.stride_d : call.stride_c) : 0,
                       strided ? call.stride_d : 0, pointer_arrays};
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
  if (call.batch > 1) {  // the same count on every operand, each its stride or its pointers
    const int32_t count = static_cast<int32_t>(call.batch);
    const cublasLtMatrixLayout_t layouts[4] = {plan->a, plan->b, plan->c, plan->d};
    const int64_t strides[4] = {key[16], key[17], key[18], key[19]};
    const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    for (int i = 0; i < 4; ++i) {
      SHARDMUON_CUBLAS(cublasLtMatrixLayoutSetAttribute(
          layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      if (pointer_arrays) {
        SHARDMUON_CUBLAS(cublasLtMatrixLayoutSetAttribute(
            layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof mode));
      } else {
        SHARDMUON_CUBLAS(cublasLtMatrixLayoutSetAttribute(
            layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
            sizeof strides[i]));
      }
    }
  }

  const uint32_t alignments[4] = {static_cast<uint32_t>(key[11]), static_cast<uint32_t>(key[12]),
                                  static_cast<uint32_t>(key[13]), static_cast<uint32_t>(key[13])};
  // The heuristic's first choice with the whole workspace, and with none. Where both are one
  // kernel configuration, the one without runs: with a workspace, Hopper's kernels for these
  // shapes ask for 4 bytes (a counter) that cuBLASLt clears with a memset before every launch,
  // a launch of its own. Measured on an H200 (bf16, 4096^2 Newton-Schulz products), the same
  // configuration without workspace took 116.0 against 118.4 us (36 tiles of 512 x 512 x 4096)
  // and 183.2 against 188.5 us (4096^3).
  cublasLtMatmulAlgo_t with_workspace{}, without_workspace{};
  if (!heuristic_choice(*plan, workspace_bytes_, alignments, with_workspace)) {
    fail(SHARDMUON_ERROR_CUBLAS, "cuBLASLt has no algorithm for the GEMM m=", call.m, " n=", call.n,
         " k=", call.k, " lda=", call.lda, " ldb=", call.ldb, " ldd=", call.ldd);
  }
  plan->algorithm = with_workspace;
  plan->workspace_bytes = workspace_bytes_;
  if (heuristic_choice(*plan, 0, alignments, without_workspace) &&
      same_configuration(with_workspace, without_workspace)) {
    plan->algorithm = without_workspace;
    plan->workspace_bytes = 0;
  }
  return *plans_.emplace(key, std::move(plan)).first->second;
}

bool CublasLtGemm::heuristic_choice(const Plan& plan, size_t workspace_limit,
                                    const uint32_t (&alignments)[4],
                                    cublasLtMatmulAlgo_t& algorithm) const {
  cublasLtMatmulPreference_t preference = nullptr;
  SHARDMUON_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      preference_owner(preference, cublasLtMatmulPreferenceDestroy);
  SHARDMUON_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference,
                                                        CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &workspace_limit, sizeof workspace_limit));
  const cublasLtMatmulPreferenceAttributes_t alignment_attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    SHARDMUON_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, alignment_attributes[i],
                                                          &alignments[i], sizeof alignments[i]));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  SHARDMUON_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle_, plan.operation, plan.a, plan.b, plan.c,
                                                  plan.d, preference, 1, &result, &found_count));
  if (found_count == 0) return false;
  algorithm = result.algo;
  return true;
}

void CublasLtGemm::run(const GemmCall& call, cudaStream_t stream) {
  if (call.product_count > 0) {
    run_list(call, stream);
    return;
  }
  const Plan& plan = plan_for(call, false, alignment_of(call.a), alignment_of(call.b),
                              std::min(alignment_of(call.c), alignment_of(call.d)));
  // beta == 0 must not read C; point it at D, which has C's type and shape.
  run_plan(plan, call, call.a, call.b, call.beta == 0.0 ? call.d : call.c, call.d, stream);
}

void CublasLtGemm::run_plan(const Plan& plan, const GemmCall& call, const void* a, const void* b,
                            const void* c, void* d, cudaStream_t stream) {
  if (plan.double_scale) {
    const double alpha = call.alpha, beta = call.beta;
    SHARDMUON_CUBLAS(cublasLtMatmul(handle_, plan.operation, &alpha, a, plan.a, b, plan.b, &beta, c,
                                    plan.c, d, plan.d, &plan.algorithm, workspace_.get(),
                                    plan.workspace_bytes, stream));
  } else {
    const float alpha = static_cast<float>(call.alpha), beta = static_cast<float>(call.beta);
    SHARDMUON_CUBLAS(cublasLtMatmul(handle_, plan.operation, &alpha, a, plan.a, b, plan.b, &beta, c,
                                    plan.c, d, plan.d, &plan.algorithm, workspace_.get(),
                                    plan.workspace_bytes, stream));
  }
}

void CublasLtGemm::run_list(const GemmCall& call, cudaStream_t stream) {
  const size_t ab = element_size(call.ab_type), cd = element_size(call.cd_type);
  if (call.batch > kPointerCapacity) {  // too many matrices for the arrays: product by product
    for (int64_t p = 0; p < call.product_count; ++p) run(call.product(p), stream);
    return;
  }
  const int64_t per_launch =
      std::min<int64_t>(PointerArraySource::kMaxProducts, kPointerCapacity / call.batch);
  // beta == 0 must not read C: its pointers are D's.
  const bool c_is_d = call.beta == 0.0;
  const int64_t stride_c = c_is_d ? call.stride_d : call.stride_c;
  const int64_t strides[4] = {
      call.stride_a * static_cast<int64_t>(ab), call.stride_b * static_cast<int64_t>(ab),
      stride_c * static_cast<int64_t>(cd), call.stride_d * static_cast<int64_t>(cd)};
  for (int64_t first = 0; first < call.product_count; first += per_launch) {
    const int64_t count = std::min(per_launch, call.product_count - first);
    const GemmOperands* products = call.products + first;
    // Each operand's alignment, the lowest over the launch's matrices: that of the OR of their
    // addresses (its lowest set bit is the lowest of theirs), the strides included when the
    // matrices are strided. One pass of ORs, since a list may hold hundreds of products (528
    // tiles at n = 4096) whose host-side bookkeeping is paid at every launch.
    uint64_t bits[4] = {0, 0, 0, 0};
    for (int64_t p = 0; p < count; ++p) {
      bits[0] |= reinterpret_cast<uintptr_t>(products[p].a);
      bits[1] |= reinterpret_cast<uintptr_t>(products[p].b);
      bits[2] |= reinterpret_cast<uintptr_t>(c_is_d ? products[p].d : products[p].c);
      bits[3] |= reinterpret_cast<uintptr_t>(products[p].d);
    }
    int64_t alignment[4];
    for (int i = 0; i < 4; ++i) {
      if (call.batch > 1) bits[i] |= static_cast<uint64_t>(strides[i]);
      alignment[i] = alignment_of_offset(static_cast<int64_t>(bits[i]));
    }
    GemmCall launch = call;
    launch.batch = count * call.batch;
    const Plan& plan =
        plan_for(launch, true, alignment[0], alignment[1], std::min(alignment[2], alignment[3]));
    void** arrays[4];
    pointer_arrays_for(products, count, call.batch, strides, c_is_d, stream, arrays);
    run_plan(plan, launch, arrays[0], arrays[1], arrays[2], arrays[3], stream);
  }
}

void CublasLtGemm::pointer_arrays_for(const GemmOperands* products, int64_t count, int64_t batch,
                                      const int64_t (&strides)[4], bool c_is_d, cudaStream_t stream,
                                      void** arrays[4]) {
  const int64_t entries = count * batch;
  // The key in a buffer kept between launches: no allocation once it has grown.
  std::vector<int64_t>& key = key_scratch_;
  key.assign({batch, strides[0], strides[1], strides[2], strides[3]});
  const auto address = [](const void* pointer) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(pointer));
  };
  for (int64_t p = 0; p < count; ++p) key.push_back(address(products[p].a));
  for (int64_t p = 0; p < count; ++p) key.push_back(address(products[p].b));
  for (int64_t p = 0; p < count; ++p) {
    key.push_back(address(c_is_d ? products[p].d : products[p].c));
  }
  for (int64_t p = 0; p < count; ++p) key.push_back(address(products[p].d));
  void** const kept_base = static_cast<void**>(kept_arrays_.get());
  const auto kept = kept_offsets_.find(key);
  if (kept != kept_offsets_.end()) {  // filled by an earlier call
    for (int i = 0; i < 4; ++i) arrays[i] = kept_base + i * kKeptCapacity + kept->second;
    return;
  }
  bool keep = false;
  if (kept_used_ + entries <= kKeptCapacity) {
    // Kept only if filled now: under capture the fill would run only when the graph does.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    SHARDMUON_CUDA(cudaStreamIsCapturing(stream, &capture));
    keep = capture == cudaStreamCaptureStatusNone;
  }
  void** const base = keep ? kept_base : static_cast<void**>(pointer_arrays_.get());
  const int64_t capacity = keep ? kKeptCapacity : kPointerCapacity, offset = keep ? kept_used_ : 0;
  for (int i = 0; i < 4; ++i) arrays[i] = base + i * capacity + offset;
  PointerArraySource source{};
  source.products = static_cast<int>(count);
  source.batch = batch;
  for (int64_t p = 0; p < count; ++p) {
    const void* operands[4] = {products[p].a, products[p].b, c_is_d ? products[p].d : products[p].c,
                               products[p].d};
    for (int i = 0; i < 4; ++i) source.operands[i][p] = static_cast<const char*>(operands[i]);
  }
  for (int i = 0; i < 4; ++i) source.stride_bytes[i] = strides[i];
  fill_pointer_arrays_cuda(source, arrays, stream);
  // Registered only once the fill is enqueued: a launch that failed must not be reused.
  if (keep) {
    kept_offsets_.emplace(key, kept_used_);
    kept_used_ += entries;
  }
}

}  // namespace shardmuon
