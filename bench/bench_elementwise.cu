// The fused elementwise passes of a Muon step against the device's copy bandwidth, measured
// in the same run on the same buffers.
//
// Bytes moved per element (each input read once, each output written once):
//   copy (cudaMemcpyAsync device to device):        read 1, write 1
//   momentum pass (Nesterov, decoupled decay):      read grad, momentum; write momentum, update
//   momentum pass (L2 decay, which reads param too): read 3, write 2
//   update pass:                                    read param, update; write param
//   finite check of the update (checked steps):     read 1
// Time: CUDA events around each launch, 5 warm-up runs, the median of 30; buffers of
// 8192 x 28672 elements (470 MB each in bf16), far larger than the 60 MB L2. Then the passes
// over GPT-2's 48 matrices in one call against a call per matrix (run_many); there the time
// between the events includes any wait of the GPU for the host's launches. Last, the
// symmetric passes of a Newton-Schulz iteration on n x n Grams (n = 8192 and 16384), with a
// copy of the same run:
//   unpacking (a Gram summed over ranks): read the packed lower block columns (float32, or
//     bf16 where NCCL sums bf16), write the whole matrix and its column squares in parts
//   mirroring (a Gram or A A computed on one rank, lower tiles only): read the lower
//     triangle, write the upper one (and the squares in parts, or the diagonal from them)
//
//   bench_elementwise [rows cols]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/dtype.h"
#include "core/symmetric_tiles.h"
#include "cuda/elementwise.cuh"
#include "cuda/muon_kernels.cuh"

namespace {

void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(code));
    std::exit(1);
  }
}

// Fills with a deterministic pseudo-random pattern in [-1, 1) (never zeros: zeros can run
// faster than real data).
template <typename T>
__global__ void fill(T* data, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    data[i] = static_cast<T>(static_cast<float>(x) * (2.0f / 4294967296.0f) - 1.0f);
  }
}

float median_ms(const std::function<void(cudaStream_t)>& work, cudaStream_t stream) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 5; ++i) work(stream);
  std::vector<float> times;
  for (int i = 0; i < 30; ++i) {
    check(cudaEventRecord(start, stream), "record");
    work(stream);
    check(cudaEventRecord(stop, stream), "record");
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

template <typename T>
void run(const char* dtype_name, shardmuon_dtype dtype, int64_t rows, int64_t cols) {
  const int64_t count = rows * cols;
  const size_t bytes = count * sizeof(T);
  T *grad, *momentum, *param, *update, *copy;
  for (T** buffer : {&grad, &momentum, &param, &update, &copy}) {
    check(cudaMalloc(buffer, bytes), "cudaMalloc");
  }
  uint32_t seed = 1;
  for (T* buffer : {grad, momentum, param, update, copy}) {
    fill<<<4096, 256>>>(buffer, count, seed++);
  }
  check(cudaDeviceSynchronize(), "fill");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  struct Row {
    std::string name;
    double bytes_moved;
    float ms;
  };
  std::vector<Row> rows_out;
  rows_out.push_back({"copy (device to device)", 2.0 * bytes,
                      median_ms(
                          [&](cudaStream_t s) {
                            check(cudaMemcpyAsync(copy, param, bytes, cudaMemcpyDeviceToDevice, s),
                                  "copy");
                          },
                          stream)});
  // Timed passes over these buffers, with the update in update_dtype (ns_storage).
  auto time_momentum = [&](const char* name, double bytes_moved, shardmuon_dtype update_dtype,
                           bool l2) {
    shardmuon::MomentumPass pass;
    pass.grad = grad;
    pass.param = l2 ? param : nullptr;
    pass.momentum = momentum;
    pass.update = update;
    pass.dtype = dtype;
    pass.update_dtype = update_dtype;
    pass.count = count;
    pass.beta = 0.95;
    pass.nesterov = true;
    pass.l2_decay = l2 ? 0.01 : 0.0;
    rows_out.push_back(
        {name, bytes_moved,
         median_ms([&](cudaStream_t s) { shardmuon::momentum_passes_cuda({pass}, s); }, stream)});
  };
  auto time_update = [&](const char* name, double bytes_moved, shardmuon_dtype update_dtype) {
    rows_out.push_back({name, bytes_moved,
                        median_ms(
                            [&](cudaStream_t s) {
                              shardmuon::update_passes_cuda(
                                  {{param, update, dtype, update_dtype, count, 0.999997, 1e-4,
                                    shardmuon::DeviceLearningRate{}}},
                                  s);
                            },
                            stream)});
  };
  time_momentum("momentum pass (Nesterov)", 4.0 * bytes, dtype, false);
  time_momentum("momentum pass, L2 decay", 5.0 * bytes, dtype, true);
  time_update("update pass", 3.0 * bytes, dtype);
  float* flag = nullptr;
  check(cudaMalloc(&flag, sizeof(float)), "cudaMalloc");
  rows_out.push_back({"finite check", 1.0 * bytes,
                      median_ms(
                          [&](cudaStream_t s) {
                            shardmuon::flag_nonfinite_cuda({{update, dtype, count, flag}}, s);
                          },
                          stream)});
  cudaFree(flag);
  if (dtype == SHARDMUON_FLOAT32) {
    // ns_storage BFLOAT16: float32 state, the update in bf16 (half of the buffer's bytes).
    time_momentum("momentum pass, bf16 update", 3.5 * bytes, SHARDMUON_BFLOAT16, false);
    time_update("update pass, bf16 update", 2.5 * bytes, SHARDMUON_BFLOAT16);
  }

  const double copy_rate = rows_out[0].bytes_moved / (rows_out[0].ms * 1e-3) / 1e9;
  std::printf("\n%s, %lld x %lld (%.0f MB per buffer)\n", dtype_name, static_cast<long long>(rows),
              static_cast<long long>(cols), bytes / 1e6);
  std::printf("%-28s %10s %12s %10s %14s\n", "pass", "time (ms)", "GB moved", "GB/s",
              "of copy GB/s");
  for (const Row& row : rows_out) {
    const double rate = row.bytes_moved / (row.ms * 1e-3) / 1e9;
    std::printf("%-28s %10.3f %12.2f %10.0f %13.1f%%\n", row.name.c_str(), row.ms,
                row.bytes_moved / 1e9, rate, 100.0 * rate / copy_rate);
  }
  for (T* buffer : {grad, momentum, param, update, copy}) cudaFree(buffer);
  cudaStreamDestroy(stream);
}

// The passes of a step of many small parameters: GPT-2's 48 matrices (12 layers of 768 x 2304,
// 768 x 768, 768 x 3072 and 3072 x 768; 85 M elements, 170 MB per array in bf16), each in its
// own 256-byte aligned slot as in the step's workspace, in one call against one call per
// parameter (a launch each, as before the passes took lists), and a copy of as many bytes.
template <typename T>
void run_many(const char* dtype_name, shardmuon_dtype dtype) {
  std::vector<int64_t> counts;
  for (int layer = 0; layer < 12; ++layer) {
    for (const int64_t count : {768 * 2304, 768 * 768, 768 * 3072, 3072 * 768}) {
      counts.push_back(count);
    }
  }
  std::vector<int64_t> offsets;  // in elements
  int64_t total = 0, slots = 0;
  for (const int64_t count : counts) {
    offsets.push_back(slots);
    total += count;
    slots += (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256 / sizeof(T);
  }
  const size_t bytes = slots * sizeof(T);
  T *grad, *momentum, *param, *update, *copy;
  for (T** buffer : {&grad, &momentum, &param, &update, &copy}) {
    check(cudaMalloc(buffer, bytes), "cudaMalloc");
  }
  uint32_t seed = 11;
  for (T* buffer : {grad, momentum, param, update, copy})
    fill<<<4096, 256>>>(buffer, slots, seed++);
  float* flags = nullptr;
  check(cudaMalloc(&flags, counts.size() * sizeof(float)), "cudaMalloc");
  check(cudaMemset(flags, 0, counts.size() * sizeof(float)), "cudaMemset");
  check(cudaDeviceSynchronize(), "fill");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  std::vector<shardmuon::MomentumPass> momentum_passes;
  std::vector<shardmuon::UpdatePass> update_passes;
  std::vector<shardmuon::FiniteCheck> checks;
  for (size_t p = 0; p < counts.size(); ++p) {
    shardmuon::MomentumPass pass;
    pass.grad = grad + offsets[p];
    pass.momentum = momentum + offsets[p];
    pass.update = update + offsets[p];
    pass.dtype = pass.update_dtype = dtype;
    pass.count = counts[p];
    pass.beta = 0.95;
    pass.nesterov = true;
    pass.nonfinite_flag = flags;
    momentum_passes.push_back(pass);
    update_passes.push_back({param + offsets[p], update + offsets[p], dtype, dtype, counts[p],
                             0.999997, 1e-4, shardmuon::DeviceLearningRate{}});
    checks.push_back({update + offsets[p], dtype, counts[p], flags + p});
  }
  // A list, or each of its entries as a list of one.
  auto together_and_apart = [&](const auto& list, auto run) {
    using List = std::decay_t<decltype(list)>;
    const float together = median_ms([&](cudaStream_t s) { run(list, s); }, stream);
    const float apart = median_ms(
        [&](cudaStream_t s) {
          for (const auto& one : list) run(List{one}, s);
        },
        stream);
    return std::pair<float, float>{together, apart};
  };
  struct Row {
    const char* name;
    double bytes_moved;
    std::pair<float, float> ms;
  };
  const double element_bytes = static_cast<double>(total) * sizeof(T);
  const std::vector<Row> rows = {
      {"momentum pass (Nesterov)", 4.0 * element_bytes,
       together_and_apart(
           momentum_passes,
           [](const auto& l, cudaStream_t s) { shardmuon::momentum_passes_cuda(l, s); })},
      {"update pass", 3.0 * element_bytes,
       together_and_apart(
           update_passes,
           [](const auto& l, cudaStream_t s) { shardmuon::update_passes_cuda(l, s); })},
      {"finite check", element_bytes,
       together_and_apart(
           checks, [](const auto& l, cudaStream_t s) { shardmuon::flag_nonfinite_cuda(l, s); })},
  };
  const float copy_ms = median_ms(
      [&](cudaStream_t s) {
        check(cudaMemcpyAsync(copy, param, total * sizeof(T), cudaMemcpyDeviceToDevice, s), "copy");
      },
      stream);
  const double copy_rate = 2.0 * element_bytes / (copy_ms * 1e-3) / 1e9;
  std::printf(
      "\n%s, GPT-2's %zu matrices (%.0f MB per array); copy of as many bytes: %.3f ms, "
      "%.0f GB/s\n",
      dtype_name, counts.size(), element_bytes / 1e6, copy_ms, copy_rate);
  std::printf("%-28s %12s %14s %12s %14s %12s\n", "pass", "one call (ms)", "of copy GB/s",
              "a call each", "of copy GB/s", "speedup");
  for (const Row& row : rows) {
    const double together = row.bytes_moved / (row.ms.first * 1e-3) / 1e9;
    const double apart = row.bytes_moved / (row.ms.second * 1e-3) / 1e9;
    std::printf("%-28s %12.3f %13.1f%% %12.3f %13.1f%% %11.2fx\n", row.name, row.ms.first,
                100.0 * together / copy_rate, row.ms.second, 100.0 * apart / copy_rate,
                row.ms.second / row.ms.first);
  }
  for (T* buffer : {grad, momentum, param, update, copy}) cudaFree(buffer);
  cudaFree(flags);
  cudaStreamDestroy(stream);
}

// The symmetric passes on an n x n matrix: the unpacking from each source dtype of the packed Gram
// (split as the library splits it: SymmetricTiles::split at the CUDA backend's default block
// target, 16 blocks at 8192 and at 16384) and the two mirroring passes of an iteration on one rank
// (the Gram's, which writes the column squares; P's, which sets the diagonal from them). Bytes
// moved: the packed elements read (the diagonal tiles whole), n^2 elements written or (mirroring)
// read and written, and the column squares' parts (float32, one row of n per 64-row band).
void run_symmetric(int64_t n) {
  const shardmuon::SymmetricTiles tiles =
      shardmuon::SymmetricTiles::split(n, shardmuon::SymmetricTiles::kDefaultBlockTarget);
  const int64_t packed_elements = tiles.packed_elements();
  const int64_t parts = shardmuon::column_square_parts_cuda(n);
  const double parts_bytes = static_cast<double>(parts * n) * sizeof(float);
  float *packed32, *full32, *square_parts, *copy;
  __nv_bfloat16 *packed16, *full16;
  check(cudaMalloc(&packed32, packed_elements * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&packed16, packed_elements * sizeof(__nv_bfloat16)), "cudaMalloc");
  check(cudaMalloc(&full32, n * n * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&full16, n * n * sizeof(__nv_bfloat16)), "cudaMalloc");
  check(cudaMalloc(&copy, n * n * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&square_parts, parts * n * sizeof(float)), "cudaMalloc");
  fill<<<4096, 256>>>(packed32, packed_elements, 21);
  fill<<<4096, 256>>>(packed16, packed_elements, 22);
  fill<<<4096, 256>>>(full32, n * n, 23);
  fill<<<4096, 256>>>(full16, n * n, 24);
  check(cudaDeviceSynchronize(), "fill");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  struct Row {
    const char* name;
    double bytes_moved;
    float ms;
  };
  std::vector<Row> rows;
  const double matrix32 = static_cast<double>(n * n) * sizeof(float);
  rows.push_back({"copy (device to device)", 2.0 * matrix32,
                  median_ms(
                      [&](cudaStream_t s) {
                        check(cudaMemcpyAsync(copy, full32, matrix32, cudaMemcpyDeviceToDevice, s),
                              "copy");
                      },
                      stream)});
  auto time_unpack = [&](const char* name, const void* packed, shardmuon_dtype source, void* dst,
                         shardmuon_dtype dst_type) {
    const double bytes = static_cast<double>(packed_elements) * shardmuon::element_size(source) +
                         static_cast<double>(n * n) * shardmuon::element_size(dst_type) +
                         parts_bytes;
    rows.push_back({name, bytes,
                    median_ms(
                        [&](cudaStream_t s) {
                          shardmuon::unpack_symmetric_cuda(packed, source, tiles, 1, dst, dst_type,
                                                           0.5, square_parts, s);
                        },
                        stream)});
  };
  time_unpack("unpack float32 -> bf16", packed32, SHARDMUON_FLOAT32, full16, SHARDMUON_BFLOAT16);
  time_unpack("unpack bf16 -> bf16", packed16, SHARDMUON_BFLOAT16, full16, SHARDMUON_BFLOAT16);
  time_unpack("unpack float32 -> float32", packed32, SHARDMUON_FLOAT32, full32, SHARDMUON_FLOAT32);
  const double matrix16 = static_cast<double>(n * n) * sizeof(__nv_bfloat16);
  rows.push_back({"mirror bf16, squares out", matrix16 + parts_bytes,
                  median_ms(
                      [&](cudaStream_t s) {
                        shardmuon::mirror_lower_cuda(full16, SHARDMUON_BFLOAT16, n, 1,
                                                     shardmuon::SymmetricDiagonal{}, square_parts,
                                                     false, s);
                      },
                      stream)});
  // P's pass: diagonal = shift + scale A_ii + square_scale |A_:i|^2 (contracting, so that the
  // repeated calls keep the values finite), its squares read from their parts.
  shardmuon::SymmetricDiagonal diagonal;
  diagonal.squares = square_parts;
  diagonal.square_scale = 1e-6;
  diagonal.scale = 0.5;
  diagonal.addend = full16;
  diagonal.shift = 1.0;
  rows.push_back({"mirror bf16, diagonal set", matrix16 + parts_bytes,
                  median_ms(
                      [&](cudaStream_t s) {
                        shardmuon::mirror_lower_cuda(full16, SHARDMUON_BFLOAT16, n, 1, diagonal,
                                                     nullptr, false, s);
                      },
                      stream)});

  const double copy_rate = rows[0].bytes_moved / (rows[0].ms * 1e-3) / 1e9;
  std::printf("\nsymmetric passes, n = %lld (%d blocks of the packed Gram)\n",
              static_cast<long long>(n), tiles.blocks());
  std::printf("%-28s %10s %12s %10s %14s\n", "pass", "time (ms)", "GB moved", "GB/s",
              "of copy GB/s");
  for (const Row& row : rows) {
    const double rate = row.bytes_moved / (row.ms * 1e-3) / 1e9;
    std::printf("%-28s %10.3f %12.2f %10.0f %13.1f%%\n", row.name, row.ms, row.bytes_moved / 1e9,
                rate, 100.0 * rate / copy_rate);
  }
  for (void* buffer :
       std::initializer_list<void*>{packed32, packed16, full32, full16, copy, square_parts}) {
    cudaFree(buffer);
  }
  cudaStreamDestroy(stream);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = argc > 2 ? std::atoll(argv[1]) : 8192;
  const int64_t cols = argc > 2 ? std::atoll(argv[2]) : 28672;
  cudaDeviceProp properties;
  check(cudaGetDeviceProperties(&properties, 0), "properties");
  std::printf("device: %s, L2 %d MB\n", properties.name, properties.l2CacheSize >> 20);
  run<__nv_bfloat16>("bf16", SHARDMUON_BFLOAT16, rows, cols);
  run<float>("float32", SHARDMUON_FLOAT32, rows, cols);
  run_many<__nv_bfloat16>("bf16", SHARDMUON_BFLOAT16);
  run_many<float>("float32", SHARDMUON_FLOAT32);
  for (const int64_t n : {8192, 16384}) run_symmetric(n);
  return 0;
}
