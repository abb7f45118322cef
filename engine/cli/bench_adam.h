// bench_adam.h — `strata bench adam`: the CPU optimizer pass of offloaded training (AdamW fused with the 16-bit
// working-copy write, kernels/cpu/fast.h adamw_update_mixed) in parameters per second and GB/s at its bytes per
// parameter, next to a bandwidth probe that moves the same bytes (reads params, m, v, grads; writes params, m,
// v and the copy) with trivial arithmetic, run alternately in the same process. The ratio says how close the
// optimizer is to what the memory system gives that access pattern.
//
// With --nvme DIR it also runs the optimizer swap pipeline (offload/optimizer_swap.h) with master weights and
// moments in swap files under DIR, and sets its step time against max(the in-memory pass, the NVMe traffic at
// the disk's measured read and write speeds): how much of the smaller cost the pipeline hides.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace strata::engine {

struct BenchAdamOptions {
  std::string params = "100M";   // parameters per step: a count, or with k / M / G (decimal)
  std::string dtype = "all";     // the working copy: f32 (none), bf16, f16, or all
  int threads = 0;               // 0: every core the process may use
  int steps = 5;                 // timed steps of each (the median is reported)
  std::string nvme_dir;          // also time the optimizer swap pipeline with the states in this folder
  std::string sub_group = "10M"; // elements per sub-group of the swap pipeline
  bool json = false;
};

void add_bench_adam_command(CLI::App& bench, BenchAdamOptions& opts);
int run_bench_adam(const BenchAdamOptions& opts);

}  // namespace strata::engine
