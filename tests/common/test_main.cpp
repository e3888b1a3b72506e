// main() of the distributed test binaries: MPI, the backend from --backend=cpu|cuda, and
// output from rank 0 only, except that every other rank prints its own failures.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
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
  shardmuon_backend backend = SHARDMUON_BACKEND_CPU;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--backend=cuda") == 0) backend = SHARDMUON_BACKEND_CUDA;
  }

  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }

  int result = 1;
  try {
    shardmuon_test::Harness::initialize(backend);
    if (rank == 0) {
      std::printf("shardmuon tests: backend %s, %d ranks, groups of 1..%d\n",
                  backend == SHARDMUON_BACKEND_CUDA ? "cuda" : "cpu",
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
