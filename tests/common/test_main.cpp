// main() of the distributed test binaries: MPI, the backend from --backend=cpu|cuda, the
// communicators from --comm=native|callbacks (native: MPI on the CPU backend, NCCL on the CUDA
// backend), and output from rank 0 only, except that every other rank prints its own failures.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "harness.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  shardmuon_backend backend = SHARDMUON_BACKEND_CPU;
  shardmuon_test::CommKind comm_kind = shardmuon_test::CommKind::kNative;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--backend=cuda") {
      backend = SHARDMUON_BACKEND_CUDA;
    } else if (argument == "--backend=cpu" || argument == "--comm=native") {
      // the defaults
    } else if (argument == "--comm=callbacks") {
      comm_kind = shardmuon_test::CommKind::kCallbacks;
    } else {
      // gtest has taken its own flags out of argv: anything left is a typo.
      if (rank == 0) {
        std::fprintf(stderr,
                     "unknown argument %s (expected --backend=cpu|cuda, "
                     "--comm=native|callbacks, gtest flags)\n",
                     argument.c_str());
      }
      MPI_Finalize();
      return 2;
    }
  }
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }

  int result = 1;
  try {
    shardmuon_test::Harness::initialize(backend, comm_kind);
    if (rank == 0) {
      std::printf("shardmuon tests: backend %s, comm %s, %d ranks, groups of 1..%d\n",
                  backend == SHARDMUON_BACKEND_CUDA ? "cuda" : "cpu",
                  comm_kind == shardmuon_test::CommKind::kCallbacks ? "callbacks" : "native",
                  shardmuon_test::Harness::get().world_size(),
                  shardmuon_test::Harness::get().max_group_size());
    }
    result = RUN_ALL_TESTS();
    shardmuon_test::Harness::shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Allreduce(MPI_IN_PLACE, &result, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return result;
}
