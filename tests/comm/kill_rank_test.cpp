// kill_rank_test.cpp — run by CTest under `mpiexec -np 2`, expecting the job to fail: both ranks train
// data-parallel, rank 1 kills itself (SIGKILL) two seconds in, and rank 0 must not hang — mpiexec stops it
// and names the dead rank, or, failing that, its all-reduce gives up after the communicator's 10 s timeout.
// CTest passes the test on either message (see CMakeLists.txt), within its 60 s limit.
#include <csignal>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"
#include "tests/engine/trainer_fixture.h"

namespace strata::engine {
namespace {

using KillRankTest = TrainerTest;

TEST_F(KillRankTest, TheOtherRanksStopInsteadOfHanging) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 10});
  ASSERT_TRUE(w.is_ok());
  json j = base_config("killed");
  j["training"]["max_steps"] = 1000000;  // far longer than the test
  j["training"]["val_every"] = 0;
  std::thread killer;
  if (w.value()->rank() == 1) {
    killer = std::thread([] {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      std::raise(SIGKILL);
    });
  }
  const auto r = train(j, "", "", w.value().get());
  // Only reached if mpiexec did not stop this rank first: the all-reduce timed out.
  std::fprintf(stderr, "rank %d: %s\n", w.value()->rank(), r.status().to_string().c_str());
  if (!r.is_ok()) comm::mpi_abort(r.status());
  if (killer.joinable()) killer.join();
}

}  // namespace
}  // namespace strata::engine
