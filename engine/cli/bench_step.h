// bench_step.h — `strata bench step`: times full training steps (forward, backward, AdamW) of a GPT-2 config on
// random tokens and reports tokens/s and achieved GFLOP/s. Compare with PyTorch via scripts/bench_step_torch.py.
// With --offload-param / --offload-optimizer it times the offloaded step against its bound instead; with
// --pipeline (under mpirun) the pipeline schedules' bubble.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/train/config.h"

namespace CLI {
class App;
}

namespace strata::engine {

struct BenchStepOptions {
  int n_layer = 6, n_head = 6, n_embd = 384, vocab_size = 50257, block_size = 256;
  // --family llama: a tied Llama of the same layers, heads and width, with these key/value heads and MLP width.
  std::string family = "gpt2";
  int kv_heads = 2, intermediate = 1024;
  int batch_size = 4, seq_len = 256;
  int steps = 5, warmup = 1;
  int grad_accum = 1;  // micro-batches of B×T per optimizer step
  std::string precision = "fp32";  // fp32 | bf16
  std::string kernels = "fast";
  std::string device = "cpu";  // cpu | cuda | auto
  int threads = 0;
  uint64_t seed = 1;
  bool json = false;
  bool no_working_copies = false;  // bf16: the linears round their fp32 weights at each use (Model::set_working_copies)
  // Offload (engine/cli/bench_step_offload.cpp): any of these set runs the offloaded step against its bound.
  std::string offload_param = "none";      // none | cpu | nvme
  std::string offload_optimizer = "none";  // none | cpu | nvme
  std::string nvme_path;                   // default: a temporary folder under $TMPDIR, removed afterwards
  std::string host_limit = "0";            // memory.host_memory_limit ("4G"); 0: automatic
  int64_t sub_group_size = 100'000'000;
  int64_t buffer_count = 4;                // offload_optimizer.buffer_count: swap staging slots
  int64_t max_live = 1'000'000'000;        // zero_optimization.stage3_max_live_parameters (elements)
  std::string checkpointing = "none";      // none | device | host
  float grad_clip = 1.0f;                  // global-norm clip (0: none); clipping steps redo early updates
  bool no_overlap_backward = false;        // offload_optimizer.overlap_backward = false
  int64_t speculative_sub_groups = 0;      // offload_optimizer.speculative_sub_groups (optimizer on cpu)
  double offload_ratio = 1.0;              // offload_optimizer.ratio: the share of the optimizer state offloaded
  int rounds = 1;  // >1: plain and offloaded steps alternate in this many blocks (both models kept)
  std::string trace_path;                  // the offloaded steps' timeline, Chrome trace JSON (common/trace.h)
  // Pipeline (engine/cli/bench_pipeline.cpp, under mpirun -np P): each rank one stage; the bubble of both
  // schedules for each micro-batch count (comma-separated; --batch is the micro-batch size).
  bool pipeline = false;
  std::string micro_batches = "1,2,4,8";
};

// A (B,T) batch of inputs and targets drawn uniformly from the vocabulary, seeded: what both step benchmarks
// train on.
void random_batch(int B, int T, int vocab_size, uint64_t seed, std::vector<int32_t>* x, std::vector<int32_t>* y);

// The folder a bench's files go in: `given` (--nvme-path), or a new temporary one, removed with this object.
class BenchFolder {
 public:
  explicit BenchFolder(const std::string& given);
  ~BenchFolder();
  BenchFolder(const BenchFolder&) = delete;
  BenchFolder& operator=(const BenchFolder&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool temporary_;
};

// The run the step benches time, as the config `strata train` would read (so checked the same way): the model,
// batch, compute and, with `offloaded`, the offload options as its sections; a constant learning rate of 1e-4;
// the swap files and the (never written) checkpoint folder under `dir`.
Result<RunConfig> bench_run_config(const BenchStepOptions& o, bool offloaded, const std::string& dir);

// The offloaded step (any offload option set): the same model plain and offloaded in one run, the offloaded
// step's breakdown, and its ratio to max(compute, disk time for its NVMe bytes, CPU optimizer time).
int run_bench_step_offload(const BenchStepOptions& opts);

// The pipeline schedules' bubble (--pipeline, under mpirun -np P): per stage, 1 - its compute / the schedule's
// time, against (p - 1) / (m + p - 1). Forward and backward only (the optimizer is not in the schedule).
int run_bench_pipeline(const BenchStepOptions& opts);

void add_bench_step_command(CLI::App& bench, BenchStepOptions& opts);
int run_bench_step(const BenchStepOptions& opts);

}  // namespace strata::engine
