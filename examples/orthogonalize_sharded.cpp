// The main job until the training example exists: orthogonalize a random matrix sharded
// over the MPI ranks, on the GPU (one per rank, NCCL) when there is one and on the CPU
// otherwise, and print the time and the error against a float64 reference of the gathered
// matrix.
//
//   mpirun -np 2 orthogonalize_sharded [--rows R] [--cols C] [--dim 0|1] [--dtype f32|bf16]
//       [--schedule NAME] [--iterations K] [--algorithm auto|duplicated|gram]
//       [--backend auto|cpu|cuda] [--repeats N] [--check 0|1]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "shardmuon/shardmuon.hpp"

#ifdef SHARDMUON_EXAMPLE_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace {

struct Options {
  int64_t rows = 1024, cols = 3000;
  int dim = 1;
  std::string dtype = "f32", schedule = "quintic", algorithm = "auto", backend = "auto";
  int iterations = 5, repeats = 5;
  bool check = true;  // compare with a float64 CPU reference (slow for large matrices)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--rows")
      o.rows = std::atoll(value.c_str());
    else if (key == "--cols")
      o.cols = std::atoll(value.c_str());
    else if (key == "--dim")
      o.dim = std::atoi(value.c_str());
    else if (key == "--dtype")
      o.dtype = value;
    else if (key == "--schedule")
      o.schedule = value;
    else if (key == "--iterations")
      o.iterations = std::atoi(value.c_str());
    else if (key == "--algorithm")
      o.algorithm = value;
    else if (key == "--backend")
      o.backend = value;
    else if (key == "--repeats")
      o.repeats = std::atoi(value.c_str());
    else if (key == "--check")
      o.check = value != "0";
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  return o;
}

float bf16_round(float value) {  // what bf16 storage keeps of a float
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&value, &bits, 4);
  return value;
}

bool gpu_available() {
#ifdef SHARDMUON_EXAMPLE_WITH_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const Options o = parse(argc, argv);
  const bool on_gpu = o.backend == "cuda" || (o.backend == "auto" && gpu_available());
  const bool bf16 = o.dtype == "bf16";
  const shardmuon_dtype dtype = bf16 ? SHARDMUON_BFLOAT16 : SHARDMUON_FLOAT32;

  try {
    // The whole matrix from one seed on every rank (fine at example sizes), then the shards.
    std::vector<float> whole(static_cast<size_t>(o.rows * o.cols));
    std::mt19937_64 generator(42);
    std::normal_distribution<float> normal;
    for (float& v : whole) v = bf16 ? bf16_round(normal(generator)) : normal(generator);
    const int64_t extent = o.dim == 0 ? o.rows : o.cols;
    std::vector<int64_t> sizes(ranks, extent / ranks);
    for (int64_t r = 0; r < extent % ranks; ++r) ++sizes[r];
    int64_t offset = 0;
    for (int r = 0; r < rank; ++r) offset += sizes[r];
    std::vector<float> shard;
    for (int64_t i = 0; i < o.rows; ++i)
      for (int64_t j = 0; j < o.cols; ++j) {
        const bool mine = o.dim == 0 ? (i >= offset && i < offset + sizes[rank])
                                     : (j >= offset && j < offset + sizes[rank]);
        if (mine) shard.push_back(whole[static_cast<size_t>(i * o.cols + j)]);
      }

    shardmuon_ns_options options = shardmuon::default_ns_options();
    shardmuon::check(shardmuon_schedule_from_name(o.schedule.c_str(), &options.schedule));
    options.num_iterations = o.iterations;
    options.algorithm = o.algorithm == "duplicated" ? SHARDMUON_NS_DUPLICATED
                        : o.algorithm == "gram"     ? SHARDMUON_NS_GRAM_ALLREDUCE
                                                    : SHARDMUON_NS_AUTO;
    const shardmuon::Layout layout = shardmuon::Layout::sharded(o.rows, o.cols, o.dim, sizes);
    const shardmuon_layout view = layout.view(ranks);
    shardmuon_ns_algorithm plan;
    shardmuon::check(shardmuon_ns_plan(&view, ranks, &options, &plan));

    std::vector<double> times_ms;
    std::vector<float> result(shard.size());
    if (on_gpu) {
#ifdef SHARDMUON_EXAMPLE_WITH_CUDA
      int devices = 0;
      cudaGetDeviceCount(&devices);
      cudaSetDevice(rank % devices);
      ncclUniqueId id;
      if (rank == 0) ncclGetUniqueId(&id);
      MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
      ncclComm_t nccl = nullptr;
      if (ncclCommInitRank(&nccl, ranks, id, rank) != ncclSuccess)
        throw std::runtime_error("NCCL init");
      {
        shardmuon::Context context(SHARDMUON_BACKEND_CUDA, rank % devices);
        shardmuon::Comm comm = shardmuon::Comm::nccl(nccl);
        cudaStream_t stream;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        const size_t element = bf16 ? 2 : 4;
        std::vector<unsigned char> host(shard.size() * element);
        for (size_t i = 0; i < shard.size(); ++i) {
          if (bf16) {
            const __nv_bfloat16 v = __float2bfloat16(shard[i]);
            std::memcpy(&host[i * 2], &v, 2);
          } else {
            std::memcpy(&host[i * 4], &shard[i], 4);
          }
        }
        void* original = nullptr;
        void* work = nullptr;
        cudaMalloc(&original, host.size() + 1);
        cudaMalloc(&work, host.size() + 1);
        cudaMemcpy(original, host.data(), host.size(), cudaMemcpyHostToDevice);
        cudaEvent_t start, stop;
        cudaEventCreate(&start);
        cudaEventCreate(&stop);
        for (int repeat = -1; repeat < o.repeats; ++repeat) {  // -1: warm-up
          cudaMemcpyAsync(work, original, host.size(), cudaMemcpyDeviceToDevice, stream);
          cudaEventRecord(start, stream);
          shardmuon::newton_schulz(context, comm, work, dtype, layout, options, stream);
          cudaEventRecord(stop, stream);
          cudaEventSynchronize(stop);
          float ms = 0;
          cudaEventElapsedTime(&ms, start, stop);
          if (repeat >= 0) times_ms.push_back(ms);
        }
        cudaMemcpy(host.data(), work, host.size(), cudaMemcpyDeviceToHost);
        for (size_t i = 0; i < shard.size(); ++i) {
          if (bf16) {
            __nv_bfloat16 v;
            std::memcpy(&v, &host[i * 2], 2);
            result[i] = __bfloat162float(v);
          } else {
            std::memcpy(&result[i], &host[i * 4], 4);
          }
        }
        cudaFree(original);
        cudaFree(work);
        cudaStreamDestroy(stream);
      }
      ncclCommDestroy(nccl);
#endif
    } else {
      shardmuon::Context context(SHARDMUON_BACKEND_CPU);
      MPI_Comm world = MPI_COMM_WORLD;
      shardmuon::Comm comm = shardmuon::Comm::mpi(&world);
      // bf16 on the CPU backend: the shard as bf16 bit patterns.
      std::vector<uint16_t> bits(shard.size());
      for (int repeat = -1; repeat < o.repeats; ++repeat) {
        std::vector<float> work = shard;
        for (size_t i = 0; i < shard.size(); ++i) {
          uint32_t b;
          std::memcpy(&b, &shard[i], 4);
          bits[i] = static_cast<uint16_t>(b >> 16);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        const auto start = std::chrono::steady_clock::now();
        shardmuon::newton_schulz(context, comm,
                                 bf16 ? static_cast<void*>(bits.data()) : work.data(), dtype,
                                 layout, options);
        const auto stop = std::chrono::steady_clock::now();
        if (repeat >= 0)
          times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
        if (bf16) {
          for (size_t i = 0; i < shard.size(); ++i) {
            const uint32_t b = static_cast<uint32_t>(bits[i]) << 16;
            std::memcpy(&result[i], &b, 4);
          }
        } else {
          result = work;
        }
      }
    }

    // Gather the result on rank 0 and compare with a float64 run of the gathered matrix.
    std::vector<int> counts(ranks), displacements(ranks);
    for (int r = 0, at = 0; r < ranks; ++r) {
      counts[r] = static_cast<int>(o.dim == 0 ? sizes[r] * o.cols : o.rows * sizes[r]);
      displacements[r] = at;
      at += counts[r];
    }
    std::vector<float> gathered(rank == 0 ? whole.size() : 0);
    MPI_Gatherv(result.data(), static_cast<int>(result.size()), MPI_FLOAT, gathered.data(),
                counts.data(), displacements.data(), MPI_FLOAT, 0, MPI_COMM_WORLD);
    std::sort(times_ms.begin(), times_ms.end());
    const double median_ms = times_ms[times_ms.size() / 2];
    if (rank == 0) {
      // Place the blocks: with dim 1 each rank's block is rows x sizes[r].
      std::vector<double> ours(whole.size());
      for (int r = 0, first = 0; r < ranks; ++r) {
        for (int i = 0; i < counts[r]; ++i) {
          const int64_t row = o.dim == 0 ? i / o.cols : i / sizes[r];
          const int64_t col = o.dim == 0 ? i % o.cols : first + i % sizes[r];
          const int64_t base = o.dim == 0 ? displacements[r] / o.cols : 0;
          ours[static_cast<size_t>((row + base) * o.cols + col)] =
              gathered[static_cast<size_t>(displacements[r] + i)];
        }
        if (o.dim == 1) first += static_cast<int>(sizes[r]);
      }
      double diff = 0, norm = 0;
      if (o.check) {
        std::vector<double> reference(whole.begin(), whole.end());
        shardmuon::Context cpu(SHARDMUON_BACKEND_CPU);
        shardmuon::Comm self = shardmuon::Comm::self();
        shardmuon::newton_schulz(cpu, self, reference.data(), SHARDMUON_FLOAT64,
                                 shardmuon::Layout::replicated(o.rows, o.cols), options);
        for (size_t i = 0; i < ours.size(); ++i) {
          diff += (ours[i] - reference[i]) * (ours[i] - reference[i]);
          norm += reference[i] * reference[i];
        }
      }
      const double s = static_cast<double>(std::min(o.rows, o.cols));
      const double l = static_cast<double>(std::max(o.rows, o.cols));
      const double flops = o.iterations * (4 * s * s * l + 2 * s * s * s);
      const char* plan_name = plan == SHARDMUON_NS_LOCAL        ? "local"
                              : plan == SHARDMUON_NS_DUPLICATED ? "duplicated (all-gather)"
                              : plan == SHARDMUON_NS_GRAM_ALLREDUCE
                                  ? "gram all-reduce"
                                  : "all-to-all + gram all-reduce";
      std::printf(
          "shardmuon: Newton-Schulz of a %lld x %lld %s matrix sharded along dim %d over %d %s "
          "rank(s)\n",
          static_cast<long long>(o.rows), static_cast<long long>(o.cols), o.dtype.c_str(), o.dim,
          ranks, on_gpu ? "GPU" : "CPU");
      std::printf("  schedule %s, %d iterations, algorithm: %s\n", o.schedule.c_str(), o.iterations,
                  plan_name);
      std::printf(
          "  time (median of %d): %.3f ms, %.2f TFLOP/s of useful flops (K(4s^2L + 2s^3))\n",
          o.repeats, median_ms, flops / (median_ms * 1e-3) / 1e12);
      if (o.check) {
        std::printf("  relative error against the float64 reference of the gathered matrix: %.3e\n",
                    std::sqrt(diff / norm));
      } else {
        std::printf("  (no reference check: --check 0)\n");
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return 0;
}
