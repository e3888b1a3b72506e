// The CUDA backend: cuBLASLt GEMMs, the elementwise kernels of elementwise.cu, and a
// stream-ordered workspace. All work goes on the caller's stream; nothing waits on the host.
#include "cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/cublaslt_gemm.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_handles.h"
#include "cuda/elementwise.cuh"
#include "cuda/muon_kernels.cuh"

namespace shardmuon {
namespace {

cudaStream_t as_cuda(Stream stream) {
  return static_cast<cudaStream_t>(stream);
}

// Zeros device memory and waits for it, so that no stream's later work can come first.
// cudaMemset returns before it is done, on the legacy default stream, which a caller's
// non-blocking streams do not wait for: a checkpoint's momentum copied into a new buffer on
// such a stream was then zeroed (seen under compute-sanitizer's racecheck, which slows kernels).
cudaError_t zero_and_wait(void* pointer, size_t bytes) {
  const cudaError_t zeroed = cudaMemsetAsync(pointer, 0, bytes, cudaStreamLegacy);
  return zeroed != cudaSuccess ? zeroed : cudaStreamSynchronize(cudaStreamLegacy);
}

// Workspace grows in steps of 2 MiB, so slightly larger shapes do not reallocate.
constexpr size_t kWorkspaceGranularity = 2u << 20;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    int count = 0;
    SHARDMUON_CUDA(cudaGetDeviceCount(&count));
    SHARDMUON_CHECK_ARG(device >= 0 && device < count, "cuda_device ", device,
                        " does not exist (this machine has ", count, " CUDA devices)");
    DeviceGuard guard(device_);
    gemm_ = std::make_unique<CublasLtGemm>();
    last_call_done_ = make_timing_free_event();
    ordering_ = make_timing_free_event();
    // Communication kernels on the side stream get the higher priority, so that a reduction
    // is not held back behind the GEMMs it should overlap with.
    int lowest = 0, highest = 0;
    SHARDMUON_CUDA(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    side_stream_ = make_nonblocking_stream(highest);
    status_ = make_device_memory(kStatusBytes);
    // $SHARDMUON_SYMMETRIC_BLOCK overrides the block width, for tuning (bench/).
    if (const char* text = std::getenv("SHARDMUON_SYMMETRIC_BLOCK")) {
      const long long value = std::atoll(text);
      SHARDMUON_CHECK_ARG(value > 0, "SHARDMUON_SYMMETRIC_BLOCK must be a positive integer, not '",
                          text, "'");
      symmetric_block_target_ = value;
    }
    short_side_multiple_ = symmetric_block_target_;
    // $SHARDMUON_SHORT_SIDE_MULTIPLE overrides it, for tuning (bench/); 8 only aligns the side.
    if (const char* text = std::getenv("SHARDMUON_SHORT_SIDE_MULTIPLE")) {
      const long long value = std::atoll(text);
      SHARDMUON_CHECK_ARG(value > 0, "SHARDMUON_SHORT_SIDE_MULTIPLE must be a positive integer, ",
                          "not '", text, "'");
      short_side_multiple_ = value;
    }
    SHARDMUON_CUDA(cudaDeviceGetAttribute(&device_sms_, cudaDevAttrMultiProcessorCount, device_));
    // $SHARDMUON_COMM_SMS overrides the SMs left to a collective that overlaps a GEMM.
    if (const char* text = std::getenv("SHARDMUON_COMM_SMS")) {
      const long long value = std::atoll(text);
      SHARDMUON_CHECK_ARG(value >= 0 && value < device_sms_, "SHARDMUON_COMM_SMS must be in [0, ",
                          device_sms_, "), not '", text, "'");
      communication_sms_ = static_cast<int>(value);
    }
    // $SHARDMUON_NS_GRAPHS=0 turns the recordings of run_recorded off (for comparing, bench/).
    if (const char* text = std::getenv("SHARDMUON_NS_GRAPHS")) {
      SHARDMUON_CHECK_ARG(std::string(text) == "0" || std::string(text) == "1",
                          "SHARDMUON_NS_GRAPHS must be 0 or 1, not '", text, "'");
      record_graphs_ = std::string(text) == "1";
    }
    capture_stream_ = make_nonblocking_stream();
    SHARDMUON_CUDA(zero_and_wait(status_.get(), kStatusBytes));
  }

  ~CudaBackend() override {
    DeviceGuard guard(device_);
    // The workspace may still be in use by work the caller enqueued.
    cudaEventSynchronize(last_call_done_.get());
    cudaStreamSynchronize(side_stream_.get());
    if (workspace_ != nullptr) cudaFree(workspace_);
  }

  shardmuon_backend kind() const override { return SHARDMUON_BACKEND_CUDA; }
  int device() const override { return device_; }

  void begin_call(Stream stream) override {
    SHARDMUON_CUDA(cudaGetDevice(&caller_device_));
    if (caller_device_ != device_) SHARDMUON_CUDA(cudaSetDevice(device_));
    capturing_call_ = is_capturing(stream);
    // The workspace is shared by calls; a call on another stream must come after the last.
    // A captured call cannot wait on an event recorded outside its capture: ordering the
    // graph's launches after other calls on the context is then the caller's (as for any
    // graph), and the workspace is pinned so that no later call moves it from under it.
    if (has_last_stream_ && last_stream_ != stream && !capturing_call_) {
      SHARDMUON_CUDA(cudaStreamWaitEvent(as_cuda(stream), last_call_done_.get(), 0));
    }
  }

  void end_call(Stream stream) override {
    if (!capturing_call_) {
      cudaEventRecord(last_call_done_.get(), as_cuda(stream));
      last_stream_ = stream;
      has_last_stream_ = true;
    }
    if (caller_device_ != device_) cudaSetDevice(caller_device_);
  }

  void pin_workspace() override { workspace_pinned_ = true; }

  // A key's first call runs as it is: it makes the GEMM plans and fills the pointer arrays
  // that a recording then only reads. Its second is captured (on a stream of the backend's own,
  // since the caller's may be the legacy default stream, which cannot be), instantiated and
  // launched; later ones launch that graph: one launch on the host where a 4096^2 call made 28.
  // A call inside the caller's own capture runs as it is, into that capture. Where recording
  // fails, the key's calls run as they are.
  void run_recorded(const std::vector<int64_t>& key, Stream stream,
                    const std::function<void(Stream)>& enqueue) override {
    if (!record_graphs_ || capturing_call_) {
      enqueue(stream);
      return;
    }
    auto found = recordings_.find(key);
    if (found == recordings_.end()) {
      if (recordings_.size() >= kMaxRecordings) forget_unrecorded_keys();
      if (recordings_.size() < kMaxRecordings) recordings_.emplace(key, Recording{});
      enqueue(stream);
      return;
    }
    Recording& recording = found->second;
    if (!recording.graph && !recording.failed) {
      recording.graph = record(enqueue);
      recording.failed = !recording.graph;
    }
    if (recording.failed) {
      enqueue(stream);
      return;
    }
    SHARDMUON_CUDA(cudaGraphLaunch(recording.graph.get(), as_cuda(stream)));
    ++replayed_recordings_;
  }

  int64_t replayed_recordings() const override { return replayed_recordings_; }

  bool is_capturing(Stream stream) const override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    SHARDMUON_CUDA(cudaStreamIsCapturing(as_cuda(stream), &status));
    return status != cudaStreamCaptureStatusNone;
  }

  void check_pointer(const void* pointer, const char* name) const override {
    cudaPointerAttributes attributes{};
    const cudaError_t code = cudaPointerGetAttributes(&attributes, pointer);
    if (code != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
      fail(SHARDMUON_ERROR_INVALID_ARGUMENT, name, " (", pointer,
           ") is not memory CUDA knows: ", cudaGetErrorString(code));
    }
    const bool on_device =
        attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
    SHARDMUON_CHECK_ARG(on_device, name, " (", pointer,
                        ") is host memory; the CUDA backend needs device memory");
    SHARDMUON_CHECK_ARG(attributes.type == cudaMemoryTypeManaged || attributes.device == device_,
                        name, " (", pointer, ") is memory of CUDA device ", attributes.device,
                        " but the context computes on device ", device_);
  }

  void check_dtype(shardmuon_dtype dtype) const override {
    if (dtype == SHARDMUON_FLOAT64) {
      fail(SHARDMUON_ERROR_UNSUPPORTED,
           "dtype float64 is computed by the CPU backend only; use float32 or bfloat16 on CUDA");
    }
  }

  void* workspace(size_t bytes, Stream stream) override {
    if (bytes <= workspace_bytes_) return workspace_;
    if (capturing_call_) {
      fail(SHARDMUON_ERROR_INVALID_ARGUMENT,
           "a call captured into a CUDA graph cannot allocate "
           "its workspace (",
           bytes, " bytes; the context has ", workspace_bytes_,
           "): run the same call once before capturing it");
    }
    if (workspace_pinned_) {
      fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "this call needs ", bytes,
           " bytes of workspace, but the context's ", workspace_bytes_,
           " bytes are used by a captured CUDA graph and cannot move: capture after running "
           "the context's largest call, or use another context");
    }
    const size_t grown =
        (bytes + kWorkspaceGranularity - 1) / kWorkspaceGranularity * kWorkspaceGranularity;
    // Stream-ordered: the old buffer is released after the work already on this stream
    // (which begin_call ordered after any other stream's use of it).
    if (workspace_ != nullptr) {
      SHARDMUON_CUDA(cudaFreeAsync(workspace_, as_cuda(stream)));
      workspace_ = nullptr;
      workspace_bytes_ = 0;
    }
    SHARDMUON_CUDA(cudaMallocAsync(&workspace_, grown, as_cuda(stream)));
    workspace_bytes_ = grown;
    return workspace_;
  }

  size_t workspace_bytes() const override { return workspace_bytes_; }

  void* allocate_zeroed(size_t bytes) override {
    DeviceGuard guard(device_);
    void* pointer = nullptr;
    SHARDMUON_CUDA(cudaMalloc(&pointer, bytes > 0 ? bytes : 1));
    const cudaError_t zeroed = zero_and_wait(pointer, bytes);
    if (zeroed != cudaSuccess) {
      cudaFree(pointer);
      check_cuda(zeroed, "zeroing a buffer");
    }
    return pointer;
  }

  void release(void* pointer) override {
    DeviceGuard guard(device_);
    SHARDMUON_CUDA(cudaFree(pointer));  // waits for the work using it
  }

  size_t sum_of_squares_scratch_bytes(shardmuon_dtype dtype, int64_t count,
                                      int64_t batch) const override {
    return sum_of_squares_scratch_bytes_cuda(dtype, count, batch);
  }

  void sum_of_squares(const void* x, shardmuon_dtype dtype, int64_t count, int64_t batch,
                      void* result, void* scratch, size_t scratch_bytes, Stream stream) override {
    sum_of_squares_cuda(x, dtype, count, batch, result, scratch, scratch_bytes, as_cuda(stream));
  }

  void divide_by_norm(const void* x, void* y, shardmuon_dtype dtype, int64_t count, int64_t batch,
                      const void* sum_of_squares, double eps, Stream stream) override {
    divide_by_norm_cuda(x, y, dtype, count, batch, sum_of_squares, eps, as_cuda(stream));
  }

  void divide_by_norm_padded(const void* x, int64_t rows, int64_t cols, void* y,
                             int64_t padded_rows, int64_t padded_cols, shardmuon_dtype dtype,
                             int64_t batch, const void* sum_of_squares, double eps,
                             Stream stream) override {
    divide_by_norm_padded_cuda(x, rows, cols, y, padded_rows, padded_cols, dtype, batch,
                               sum_of_squares, eps, as_cuda(stream));
  }

  void gemm(const GemmCall& call, Stream stream) override {
    if (!call.overlaps_communication || communication_sms_ == 0) {
      gemm_->run(call, as_cuda(stream));
      return;
    }
    GemmCall leaving_room = call;
    leaving_room.sm_count_target = std::max(1, device_sms_ - communication_sms_);
    gemm_->run(leaving_room, as_cuda(stream));
  }

  void momentum_passes(const std::vector<MomentumPass>& passes, Stream stream) override {
    momentum_passes_cuda(passes, as_cuda(stream));
  }

  void update_passes(const std::vector<UpdatePass>& passes, Stream stream) override {
    update_passes_cuda(passes, as_cuda(stream));
  }

  void commit_passes(const std::vector<CommitPass>& passes, Stream stream) override {
    commit_passes_cuda(passes, as_cuda(stream));
  }

  void flag_nonfinite(const std::vector<FiniteCheck>& checks, Stream stream) override {
    flag_nonfinite_cuda(checks, as_cuda(stream));
  }

  void mark_if_set(const float* flag, float* mark, Stream stream) override {
    mark_if_set_cuda(flag, mark, as_cuda(stream));
  }
  void count_if_flagged(const float* flag, int64_t* counter, Stream stream) override {
    count_if_flagged_cuda(flag, counter, as_cuda(stream));
  }

  void* persistent_status() override { return status_.get(); }

  void copy_to_host(void* host, const void* src, size_t bytes, Stream stream) override {
    if (bytes == 0) return;
    SHARDMUON_CUDA(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, as_cuda(stream)));
  }

  void copy_from_host(void* dst, const void* host, size_t bytes, Stream stream) override {
    if (bytes == 0) return;
    SHARDMUON_CUDA(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, as_cuda(stream)));
  }

  void synchronize(Stream stream) override {
    SHARDMUON_CUDA(cudaStreamSynchronize(as_cuda(stream)));
  }

  void wait_for_last_call() override {
    if (has_last_stream_) SHARDMUON_CUDA(cudaEventSynchronize(last_call_done_.get()));
  }

  int64_t symmetric_block_target() const override { return symmetric_block_target_; }
  int64_t short_side_multiple() const override { return short_side_multiple_; }

  // Whole waves of thread blocks where the side allows (SymmetricTiles::for_products).
  SymmetricTiles product_tiles(int64_t n) const override {
    return SymmetricTiles::for_products(n, symmetric_block_target_);
  }

  int64_t column_square_parts(int64_t n) const override { return column_square_parts_cuda(n); }

  void unpack_symmetric(const void* packed, shardmuon_dtype src_type, const SymmetricTiles& tiles,
                        int64_t batch, void* dst, shardmuon_dtype dst_type, double shift,
                        void* square_parts, Stream stream) override {
    unpack_symmetric_cuda(packed, src_type, tiles, batch, dst, dst_type, shift, square_parts,
                          as_cuda(stream));
  }

  void mirror_lower(void* matrix, shardmuon_dtype dtype, int64_t n, int64_t batch,
                    const SymmetricDiagonal& diagonal, void* square_parts, bool upper_computed,
                    Stream stream) override {
    mirror_lower_cuda(matrix, dtype, n, batch, diagonal, square_parts, upper_computed,
                      as_cuda(stream));
  }

  Stream side_stream(Stream) override { return side_stream_.get(); }

  void order_after(Stream waiter, Stream signaller) override {
    if (waiter == signaller) return;
    SHARDMUON_CUDA(cudaEventRecord(ordering_.get(), as_cuda(signaller)));
    SHARDMUON_CUDA(cudaStreamWaitEvent(as_cuda(waiter), ordering_.get(), 0));
  }

  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
               size_t rows, Stream stream) override {
    copy_2d_cuda(dst, dst_pitch, src, src_pitch, row_bytes, rows, as_cuda(stream));
  }

  void fill_zero(void* dst, size_t bytes, Stream stream) override {
    SHARDMUON_CUDA(cudaMemsetAsync(dst, 0, bytes, as_cuda(stream)));
  }

 private:
  struct Recording {
    UniqueGraphExec graph;  // null until the key's second call
    bool failed = false;    // the capture or the instantiation failed: run as it is
  };
  // Keys seen once or recorded; past kMaxRecordings, keys seen once are forgotten first, then
  // new keys run as they are.
  static constexpr size_t kMaxRecordings = 1024;

  // The work of enqueue as an instantiated graph, or null where it could not be captured.
  UniqueGraphExec record(const std::function<void(Stream)>& enqueue) {
    cudaStream_t capture = capture_stream_.get();
    SHARDMUON_CUDA(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal));
    bool enqueued = true;
    try {
      enqueue(capture);
    } catch (...) {  // the call then runs as it is, and reports its error itself
      enqueued = false;
    }
    cudaGraph_t captured = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(capture, &captured);
    const UniqueGraph graph(captured);
    cudaGraphExec_t exec = nullptr;
    if (!enqueued || ended != cudaSuccess || captured == nullptr ||
        cudaGraphInstantiate(&exec, captured, 0) != cudaSuccess) {
      cudaGetLastError();  // a capture's errors are not the call's
      return nullptr;
    }
    return UniqueGraphExec(exec);
  }

  void forget_unrecorded_keys() {
    for (auto it = recordings_.begin(); it != recordings_.end();) {
      it = !it->second.graph && !it->second.failed ? recordings_.erase(it) : std::next(it);
    }
  }

  int device_ = 0;
  int caller_device_ = 0;
  std::unique_ptr<CublasLtGemm> gemm_;
  UniqueEvent last_call_done_;
  // Tiles of about 512 columns: a product's tiles run as one launch, which fills the GPU
  // where 1024-wide block columns did not (a whole 4096^2 call on an H200, measured when the
  // tiles came in: 2.48 ms at 512 against 2.55 at 1024); a summed Gram of side 4096 then
  // computes 36/64 of the full product (products on one rank: product_tiles).
  int64_t symmetric_block_target_ = SymmetricTiles::kDefaultBlockTarget;
  int64_t short_side_multiple_ = SymmetricTiles::kDefaultBlockTarget;
  int device_sms_ = 0;
  // SMs that GEMMs overlapping a collective leave free for it (cuBLASLt's SM count target).
  // 32 measured best of 0, 16 and 32 on 2 H200s (docs/BENCHMARKS.md): up to 7% faster at
  // 4096 x 14336 over 2 GPUs, within noise at 8192 x 28672.
  int communication_sms_ = 32;
  UniqueEvent ordering_;      // order_after's
  UniqueStream side_stream_;  // side_stream's
  static constexpr size_t kStatusBytes = 64;
  UniqueDeviceMemory status_;
  Stream last_stream_ = nullptr;
  bool has_last_stream_ = false;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool capturing_call_ = false;    // the current call is being captured into a CUDA graph
  bool workspace_pinned_ = false;  // a captured graph uses the workspace: it never moves
  bool record_graphs_ = true;
  UniqueStream capture_stream_;
  std::map<std::vector<int64_t>, Recording> recordings_;
  int64_t replayed_recordings_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace shardmuon
