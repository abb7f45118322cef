// mpi_test_main.cpp — main() of the tests CTest runs under mpiexec: MPI around GoogleTest, one rank's report
// (every rank's failures still fail the run through its exit code, which mpiexec passes on).
#include <cstdio>

#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (strata::Status st = strata::comm::mpi_init(&argc, &argv); !st.is_ok()) {
    std::fprintf(stderr, "%s\n", st.to_string().c_str());
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  strata::comm::mpi_finalize();
  return rc;
}
