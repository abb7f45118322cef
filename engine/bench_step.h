// bench_step.h — `strata bench step`: times full training steps (forward, backward, AdamW) of a GPT-2 config on
// random tokens and reports tokens/s and achieved GFLOP/s. Compare with PyTorch via scripts/bench_step_vs_torch.sh.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace strata::engine {

struct BenchStepOptions {
  int n_layer = 6, n_head = 6, n_embd = 384, vocab_size = 50257, block_size = 256;
  int batch_size = 4, seq_len = 256;
  int steps = 5, warmup = 1;
  std::string precision = "fp32";  // fp32 | bf16
  std::string kernels = "fast";
  std::string device = "cpu";  // cpu | cuda | auto
  int threads = 0;
  uint64_t seed = 1;
  bool json = false;
};

void add_bench_step_command(CLI::App& bench, BenchStepOptions& opts);
int run_bench_step(const BenchStepOptions& opts);

}  // namespace strata::engine
