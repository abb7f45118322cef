// bench_kernels.h — `strata bench kernels`: times every op of the CUDA KernelSet at a GPT-2 shape (default
// 124M: 12 layers, width 768, context 1024, batch 8) and sets each against its roofline bound — its fewest bytes
// over the device's measured copy bandwidth, or its FLOPs over the measured GEMM rate, whichever is larger —
// so the table says where the time goes and how far each kernel is from the hardware. The per-step line sums
// the op times (it is not a measured training step). Needs the CUDA backend and a GPU.
#pragma once

#include <cstdint>
#include <string>

namespace CLI {
class App;
}

namespace strata::engine {

struct BenchKernelsOptions {
  int n_layer = 12, n_head = 12, n_embd = 768, vocab_size = 50257;
  int batch_size = 8, seq_len = 1024;
  std::string precision = "bf16";  // matmul inputs: fp32 | bf16
  int reps = 20;
  uint64_t seed = 1;
  bool json = false;
};

void add_bench_kernels_command(CLI::App& bench, BenchKernelsOptions& opts);
int run_bench_kernels(const BenchKernelsOptions& opts);

// The GPU's dense GEMM rate in TFLOP/s, measured as bench kernels' ceiling (8192³ through cuBLAS, bf16 inputs
// with fp32 accumulation, or fp32): what model FLOPs utilisation is taken against. 0 without a usable GPU.
double measure_gemm_tflop_per_s(bool bf16);

}  // namespace strata::engine
