// bench_comm.h — `strata bench comm`: all-reduce, all-gather and reduce-scatter over the communicator of the
// run (under `mpirun -np N`: MPI on host buffers; with `--device cuda`, GPU buffers over what
// parallel.distributed_backend would choose — NCCL, or staged through host memory over MPI), timed over
// message sizes and reported the way nccl-tests reports them: time per call, algorithm bandwidth (bytes / time)
// and bus bandwidth (algbw x 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter — what each
// link carried), rank 0 printing.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace strata::engine {

struct BenchCommOptions {
  std::string min_bytes = "4K", max_bytes = "64M";  // swept by factors of 4: bytes of the whole fp32 buffer
  std::string ops = "all_reduce,all_gather,reduce_scatter";
  int iters = 10, warmup = 2;
  bool json = false;
  std::string device = "cpu";     // "cpu": host buffers over MPI; "cuda": GPU buffers
  std::string backend = "auto";   // with cuda: "auto", "nccl" or "mpi" (parallel.distributed_backend's meaning)
  // --json: one object per op and size, with "over" saying what carried it: "mpi" (host buffers), "nccl",
  // or "mpi_staged" (GPU buffers through host memory).
};

void add_bench_comm_command(CLI::App& bench, BenchCommOptions& opts);
int run_bench_comm(const BenchCommOptions& opts);

}  // namespace strata::engine
