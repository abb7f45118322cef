#include "engine/cli/bench_kernels.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#ifdef STRATA_HAVE_CUDA
#include <cuda_bf16.h>

#include <cstring>

#include "common/rng.h"
#include "common/timer.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cudnn_attention.h"
#endif

namespace strata::engine {

void add_bench_kernels_command(CLI::App& bench, BenchKernelsOptions& o) {
  CLI::App* cmd = bench.add_subcommand("kernels", "Time each CUDA op at a GPT-2 shape against its roofline bound");
  cmd->add_option("--layers", o.n_layer, "Transformer blocks (counts per step)")->capture_default_str();
  cmd->add_option("--heads", o.n_head, "Attention heads")->capture_default_str();
  cmd->add_option("--width", o.n_embd, "Model width (n_embd)")->capture_default_str();
  cmd->add_option("--vocab", o.vocab_size, "Vocabulary size")->capture_default_str();
  cmd->add_option("--context", o.seq_len, "Sequence length T")->capture_default_str();
  cmd->add_option("--batch", o.batch_size, "Sequences per step B")->capture_default_str();
  cmd->add_option("--precision", o.precision, "Matmul inputs: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--reps", o.reps, "Timed calls per op (the median is reported)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed for the random inputs")->capture_default_str();
  cmd->add_flag("--json", o.json, "One JSON object per op and one for the step, instead of the table");
}

#ifndef STRATA_HAVE_CUDA

double measure_gemm_tflop_per_s(bool) { return 0; }

int run_bench_kernels(const BenchKernelsOptions&) {
  std::fprintf(stderr, "strata bench kernels: this strata was built without the CUDA backend (STRATA_CUDA=OFF or no "
                       "toolkit at configure time)\n");
  return 2;
}

#else

namespace {

using kernels::MatmulPrecision;
namespace kc = kernels::cuda;

// A device allocation of n floats (or ints) filled with U(lo, hi) from the seed.
struct DevBuf {
  void* p = nullptr;
  DevBuf(size_t n, Rng& rng, float lo, float hi) {
    std::vector<float> h(n);
    for (auto& x : h) x = static_cast<float>(rng.uniform(lo, hi));
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  }
  DevBuf(const std::vector<int32_t>& h) {
    CUDA_CHECK(cudaMalloc(&p, h.size() * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  DevBuf(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
  float* f() const { return static_cast<float*>(p); }
  int32_t* i() const { return static_cast<int32_t*>(p); }
};

// Median milliseconds of `reps` calls, each between two events on the compute stream, after two warm-up calls.
double time_ms(const std::function<void()>& fn, int reps) {
  const cudaStream_t s = kc::cuda_context().compute;
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  fn();
  fn();
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return median(std::move(ms));
}

// The two ceilings, measured: device-to-device copy bandwidth (bytes read + written) and the dense GEMM rate at
// the benchmark's precision (8192³ through cuBLAS: bf16 inputs with fp32 accumulation, or fp32).
struct Ceilings {
  double gb_per_s, tflops;
};
Ceilings measure_ceilings(bool bf16, int reps) {
  const kc::CudaContext& ctx = kc::cuda_context();
  const size_t bytes = size_t{1} << 30;
  void *src, *dst;
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMemsetAsync(src, 1, bytes, ctx.compute));
  const double copy_ms = time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx.compute)); }, reps);
  CUDA_CHECK(cudaFree(src));
  CUDA_CHECK(cudaFree(dst));

  const int n = 8192;
  const size_t elems = size_t{n} * n, in_bytes = elems * (bf16 ? 2 : 4);
  Rng rng(7);
  void *a, *b, *c;
  CUDA_CHECK(cudaMalloc(&a, in_bytes));
  CUDA_CHECK(cudaMalloc(&b, in_bytes));
  CUDA_CHECK(cudaMalloc(&c, elems * 4));
  {
    DevBuf r(elems, rng, -1.0f, 1.0f);  // random data, not zeros: zeros run faster than real data
    if (bf16) {
      kc::f32_to_bf16(static_cast<uint16_t*>(a), r.f(), elems);
      kc::f32_to_bf16(static_cast<uint16_t*>(b), r.f(), elems);
    } else {
      CUDA_CHECK(cudaMemcpyAsync(a, r.f(), in_bytes, cudaMemcpyDeviceToDevice, ctx.compute));
      CUDA_CHECK(cudaMemcpyAsync(b, r.f(), in_bytes, cudaMemcpyDeviceToDevice, ctx.compute));
    }
    CUDA_CHECK(cudaStreamSynchronize(ctx.compute));
  }
  const float alpha = 1.0f, beta = 0.0f;
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const double gemm_ms = time_ms(
      [&] {
        CUBLAS_CHECK(cublasGemmEx(ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, t, n, b, t, n, &beta, c,
                                  CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      std::max(5, reps / 2));
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  CUDA_CHECK(cudaFree(c));
  return {2.0 * bytes / (copy_ms * 1e-3) / 1e9, 2.0 * n * double(n) * n / (gemm_ms * 1e-3) / 1e12};
}

// Host <-> device copies of 256 MiB, wall time from the call to the bytes having arrived (median of `reps`):
// a plain cudaMemcpyAsync between cudaMallocHost memory and the device, against Strata's path, the "cuda"
// Device's upload/download from a pinned-pool buffer registered the way the offload runtime registers its pool.
struct HostCopies {
  double plain_h2d = 0, plain_d2h = 0, strata_h2d = 0, strata_d2h = 0;  // GB/s
};
Result<HostCopies> measure_host_copies(int reps) {
  const size_t bytes = size_t{256} << 20;
  auto wall_gb_per_s = [&](const std::function<void()>& fn) {
    fn();
    std::vector<double> s;
    for (int r = 0; r < reps; ++r) {
      Timer t;
      fn();
      s.push_back(t.seconds());
    }
    return bytes / median(std::move(s)) / 1e9;
  };
  HostCopies hc;
  void *dev = nullptr, *host = nullptr;
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaMalloc(&dev, bytes));
  CUDA_CHECK(cudaMallocHost(&host, bytes));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::memset(host, 1, bytes);
  hc.plain_h2d = wall_gb_per_s([&] {
    CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  });
  hc.plain_d2h = wall_gb_per_s([&] {
    CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  });
  CUDA_CHECK(cudaStreamDestroy(stream));
  CUDA_CHECK(cudaFreeHost(host));
  {
    STRATA_ASSIGN_OR_RETURN(auto device, kernels::make_device("cuda", kernels::cpu_fast_kernels()));
    STRATA_ASSIGN_OR_RETURN(auto pool, offload::PinnedPool::create(
                                           offload::PinnedPoolOptions{.budget_bytes = bytes + 4096, .lock = false}));
    register_pool_buffers(*pool, *device);
    STRATA_ASSIGN_OR_RETURN(offload::PinnedBuffer buf, pool->acquire(bytes, "offload.params bench"));
    std::memset(buf.data(), 1, bytes);
    hc.strata_h2d = wall_gb_per_s([&] { device->upload(dev, buf.data(), bytes); });
    hc.strata_d2h = wall_gb_per_s([&] { device->download(buf.data(), dev, bytes); });
  }
  CUDA_CHECK(cudaFree(dev));
  return hc;
}

struct OpRow {
  std::string name;
  int per_step;  // calls in one training step
  double bytes, flops;
  std::function<void()> run;
  double ms = 0;
};

// The exit code for options or a machine the bench cannot run with (said on stderr), else 0.
int refuse(const BenchKernelsOptions& o) {
  if (const Status s = kernels::cuda_available(); !s.is_ok()) {
    std::fprintf(stderr, "strata bench kernels: %s\n", s.to_string().c_str());
    return 1;
  }
  if (o.n_layer <= 0 || o.n_head <= 0 || o.n_embd <= 0 || o.n_embd % o.n_head != 0 || o.vocab_size <= 0 ||
      o.batch_size <= 0 || o.seq_len <= 0 || o.reps <= 0) {
    std::fprintf(stderr, "strata bench kernels: --layers, --heads, --width, --vocab, --batch, --context and --reps "
                         "must be positive, and --heads must divide --width\n");
    return 2;
  }
  return 0;
}

void print_header(const BenchKernelsOptions& o, const Ceilings& ceil, double params) {
  std::printf("strata bench kernels on %s\n", kernels::cuda_device_description().c_str());
  std::printf("GPT-2 %d layers, width %d, %d heads, vocab %d, B=%d T=%d, matmuls %s; %.1fM parameters\n", o.n_layer,
              o.n_embd, o.n_head, o.vocab_size, o.batch_size, o.seq_len, o.precision.c_str(), params / 1e6);
  std::printf("ceilings (measured): copy %.0f GB/s (read + write), %s GEMM %.0f TFLOP/s\n", ceil.gb_per_s,
              o.precision.c_str(), ceil.tflops);
}

// The host-to-device and device-to-host copy rates, plain CUDA's and Strata's (a failure is reported, and the ops
// are still timed).
void print_host_copies(const BenchKernelsOptions& o) {
  auto copies = measure_host_copies(std::max(5, o.reps / 2));
  const HostCopies hc = copies.is_ok() ? copies.value() : HostCopies{};
  if (!copies.is_ok()) {  // the ops are still worth timing
    std::fprintf(stderr, "strata bench kernels: host copies not measured: %s\n", copies.status().to_string().c_str());
  } else if (o.json) {
    std::printf("%s\n", nlohmann::json{{"bench", "kernels"},
                                       {"op", "host copies (256 MiB)"},
                                       {"plain_h2d_gb_per_s", hc.plain_h2d},
                                       {"plain_d2h_gb_per_s", hc.plain_d2h},
                                       {"strata_h2d_gb_per_s", hc.strata_h2d},
                                       {"strata_d2h_gb_per_s", hc.strata_d2h}}
                            .dump()
                            .c_str());
  } else {
    std::printf("host copies, 256 MiB: cudaMemcpyAsync from cudaMallocHost h2d %.1f GB/s, d2h %.1f; Strata's "
                "upload/download from its registered pool h2d %.1f GB/s (%.0f%%), d2h %.1f (%.0f%%)\n\n",
                hc.plain_h2d, hc.plain_d2h, hc.strata_h2d, 100.0 * hc.strata_h2d / hc.plain_h2d, hc.strata_d2h,
                100.0 * hc.strata_d2h / hc.plain_d2h);
  }
}

// Times each op, prints its row against its bound, and the step as the sum of its ops (N tokens).
void report_ops(const BenchKernelsOptions& o, const Ceilings& ceil, int N, std::vector<OpRow>& ops) {
  double step_ms = 0, step_flops = 0;
  if (!o.json)
    std::printf("%-20s %5s %9s %8s %8s %9s %7s\n", "op", "x/step", "ms", "GB/s", "TFLOP/s", "bound ms", "of bound");
  for (OpRow& op : ops) {
    op.ms = time_ms(op.run, o.reps);
    const double bound = std::max(op.bytes / (ceil.gb_per_s * 1e9), op.flops / (ceil.tflops * 1e12)) * 1e3;
    const double gbs = op.bytes / (op.ms * 1e-3) / 1e9, tfs = op.flops / (op.ms * 1e-3) / 1e12;
    step_ms += op.per_step * op.ms;
    step_flops += op.per_step * op.flops;
    if (o.json) {
      std::printf("%s\n", nlohmann::json{{"bench", "kernels"},
                                         {"op", op.name},
                                         {"per_step", op.per_step},
                                         {"ms", op.ms},
                                         {"bytes", op.bytes},
                                         {"flops", op.flops},
                                         {"gb_per_s", gbs},
                                         {"tflop_per_s", tfs},
                                         {"bound_ms", bound},
                                         {"of_bound", bound / op.ms}}
                              .dump()
                              .c_str());
    } else {
      std::printf("%-20s %5d %9.3f %8.0f %8.1f %9.3f %6.0f%%\n", op.name.c_str(), op.per_step, op.ms, gbs, tfs, bound,
                  100.0 * bound / op.ms);
    }
  }
  const double tokens_per_s = N / (step_ms * 1e-3);
  const double mfu = step_flops / (step_ms * 1e-3) / (ceil.tflops * 1e12);
  if (o.json) {
    std::printf("%s\n", nlohmann::json{{"bench", "kernels"},
                                       {"op", "step (sum of ops)"},
                                       {"device", kernels::cuda_device_description()},
                                       {"precision", o.precision},
                                       {"step_ms", step_ms},
                                       {"tokens_per_s", tokens_per_s},
                                       {"step_flops", step_flops},
                                       {"copy_gb_per_s", ceil.gb_per_s},
                                       {"gemm_tflop_per_s", ceil.tflops},
                                       {"mfu", mfu}}
                            .dump()
                            .c_str());
  } else {
    std::printf("\none step as the sum of its ops (not a measured step): %.1f ms, %.0f tokens/s, %.1f TFLOP/s of "
                "model FLOPs = %.0f%% of the measured GEMM rate\n",
                step_ms, tokens_per_s, step_flops / (step_ms * 1e-3) / 1e12, 100.0 * mfu);
  }
}

}  // namespace

double measure_gemm_tflop_per_s(bool bf16) {
  if (!kernels::cuda_available().is_ok()) return 0;
  return measure_ceilings(bf16, 10).tflops;
}

int run_bench_kernels(const BenchKernelsOptions& o) {
  if (const int refused = refuse(o); refused != 0) return refused;
  const kernels::KernelSet& k = kernels::cuda_kernels();
  const bool bf16 = o.precision == "bf16";
  const MatmulPrecision prec = bf16 ? MatmulPrecision::kBF16 : MatmulPrecision::kF32;
  const int B = o.batch_size, T = o.seq_len, C = o.n_embd, NH = o.n_head, V = o.vocab_size, L = o.n_layer;
  const int N = B * T;
  const double NC = double(N) * C, att = double(B) * NH * T * T, f = 4.0;  // f: bytes per fp32 element
  const double params = double(V) * C + double(T) * C + L * (12.0 * C * C + 13.0 * C) + 2.0 * C;

  const Ceilings ceil = measure_ceilings(bf16, o.reps);
  if (!o.json) print_header(o, ceil, params);
  print_host_copies(o);

  Rng rng(o.seed);
  std::vector<int32_t> tokens(N), targets(N);
  for (int i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>(rng.below(V));
    targets[i] = static_cast<int32_t>(rng.below(V));
  }
  DevBuf d_tokens(tokens), d_targets(targets);
  DevBuf wte(size_t(V) * C, rng, -0.02f, 0.02f), wpe(size_t(T) * C, rng, -0.02f, 0.02f);
  DevBuf x(NC, rng, -1, 1), y(NC, rng, -1, 1), dx(NC, rng, -1, 1), mean(N, rng, -0.1f, 0.1f), rstd(N, rng, 0.9f, 1.1f);
  DevBuf lnw(C, rng, 0.9f, 1.1f), lnb(C, rng, -0.1f, 0.1f), dlnw(C, rng, -1, 1), dlnb(C, rng, -1, 1);
  DevBuf w4(size_t(4) * C * C, rng, -0.02f, 0.02f), dw4(size_t(4) * C * C, rng, -1, 1), b4(4 * C, rng, -0.1f, 0.1f);
  DevBuf db4(4 * C, rng, -1, 1), h4(4 * NC, rng, -1, 1), dh4(4 * NC, rng, -1, 1), g4(4 * NC, rng, -1, 1);
  DevBuf s4(4 * NC, rng, -1, 1);  // the GELU backward's scratch
  // The attention's hidden activations (the backend's form, sized here for fp32): qkv, its output and their
  // gradients.
  DevBuf qkv(3 * NC, rng, -1, 1), dqkv(3 * NC, rng, -1, 1), attn(att, rng, 0, 1.0f / T);
  DevBuf atty(NC, rng, -1, 1), datty(NC, rng, -1, 1);
  DevBuf xh(NC, rng, -1, 1);  // a layernorm's output, hidden: the linears' input
  // The classifier's logits, in the form its backend keeps them (fp32, or bf16: kernels.h).
  const double logits_bytes = static_cast<double>(k.classifier_logits_bytes(N, V, prec));
  DevBuf logits((static_cast<size_t>(logits_bytes) + 3) / 4, rng, -4, 4), lse(N, rng, 10, 11), losses(N, rng, 0, 1);
  DevBuf dlosses(N, rng, 0, 1e-4f);
  DevBuf dwte(size_t(V) * C, rng, -1, 1), dwpe(size_t(T) * C, rng, -1, 1);
  // The optimizer runs over every parameter: one flat buffer each for p, m, v, g.
  const size_t np = static_cast<size_t>(params);
  DevBuf p(np, rng, -0.02f, 0.02f), m(np, rng, -1e-3f, 1e-3f), v(np, rng, 0, 1e-6f), g(np, rng, -1e-3f, 1e-3f);
  {
    // A real qkv, and real probabilities (or flash statistics) in att for the backward, as forward would leave
    // them; the output's gradient, as the attention's output linear's backward would leave it.
    k.layernorm_forward(xh.f(), mean.f(), rstd.f(), x.f(), lnw.f(), lnb.f(), N, C, prec);
    k.matmul_forward_to_hidden(qkv.f(), xh.f(), w4.f(), b4.f(), N, C, 3 * C, prec);
    k.attention_forward(atty.f(), attn.f(), qkv.f(), B, T, C, NH, NH, prec);
    k.matmul_backward_hidden(datty.f(), dw4.f(), db4.f(), y.f(), atty.f(), w4.f(), N, C, C, prec);
    // real hidden activations (the backend's form) for the MLP's backward: gelu(pre) in g4, pre in h4,
    k.matmul_gelu_forward(g4.f(), h4.f(), xh.f(), w4.f(), b4.f(), N, C, 4 * C, prec);
    // and real logits and lse for the classifier's.
    k.classifier_forward(logits.f(), losses.f(), lse.f(), xh.f(), wte.f(), d_targets.i(), N, C, V, 0, prec);
    kernels::cuda_synchronize();
  }

  // Bytes: the fewest an op must move (each input read once, each output written once, "+=" read and written).
  // The block's linears overwrite their input gradients (as the model runs them): dinp is written, not read and
  // written.
  // Bytes per element of the hidden activations in the backend's form (4, or 2 in bf16): the MLP's, and the
  // layernorms' outputs and the attention's (qkv and its output; widths C and 3C: one form).
  const double hf = static_cast<double>(k.hidden_bytes(N, 4 * C, prec)) / (4 * NC);
  const double ha = static_cast<double>(k.hidden_bytes(N, C, prec)) / NC;
  // What attention saves for its backward: the probabilities, or flash attention's log-sum-exps. The backward
  // reads dout, qkv and what was saved, and overwrites dqkv; flash attention (what it saves is not the B*NH*T*T
  // probabilities every other form saves) reads the forward's output too.
  const size_t saved_floats = k.attention_saved_floats(B, T, C, NH, prec);
  const double saved_att = static_cast<double>(saved_floats);
  const bool att_reads_out = saved_floats != static_cast<size_t>(B) * NH * T * T;
  const double att_bwd_bytes = ha * (att_reads_out ? 8 : 7) * NC + f * saved_att;
  kernels::AdamWParams hp;
  std::vector<OpRow> ops = {
      {"encoder fwd", 1, f * 3 * NC, 0,
       [&] { k.encoder_forward(x.f(), d_tokens.i(), wte.f(), wpe.f(), B, T, C, 0, V); }},
      // out written hidden.
      {"layernorm fwd", L + 1, f * (NC + 2.0 * N) + ha * NC,
       0, [&] { k.layernorm_forward(xh.f(), mean.f(), rstd.f(), x.f(), lnw.f(), lnb.f(), N, C, prec); }},
      // inp read and qkv written hidden.
      {"matmul fwd qkv", L, f * (3.0 * C * C + 3 * C) + ha * 4 * NC, 2 * NC * 3 * C,
       [&] { k.matmul_forward_to_hidden(qkv.f(), xh.f(), w4.f(), b4.f(), N, C, 3 * C, prec); }},
      {"attention fwd", L, ha * 4 * NC + f * saved_att, 2 * att * (C / NH),
       [&] { k.attention_forward(atty.f(), attn.f(), qkv.f(), B, T, C, NH, NH, prec); }},
      {"matmul fwd attproj", L, ha * NC + f * (1.0 * C * C + NC + C), 2 * NC * C,
       [&] { k.matmul_forward_hidden(y.f(), atty.f(), w4.f(), b4.f(), N, C, C, prec); }},
      {"residual+layernorm fwd", L, f * (3 * NC + 2.0 * N) + ha * NC, 0,
       [&] {
         k.residual_layernorm_forward(h4.f(), xh.f(), mean.f(), rstd.f(), x.f(), dx.f(), lnw.f(), lnb.f(), N, C,
                                      prec);
       }},
      {"residual fwd", L, f * 3 * NC, 0, [&] { k.residual_forward(y.f(), x.f(), dx.f(), size_t(NC)); }},
      {"matmul+gelu fwd fc", L, ha * NC + f * (4.0 * C * C + 4 * C) + 2 * hf * 4 * NC, 2 * NC * 4 * C,
       [&] { k.matmul_gelu_forward(dh4.f(), h4.f(), xh.f(), w4.f(), b4.f(), N, C, 4 * C, prec); }},
      {"matmul fwd fcproj", L, hf * 4 * NC + f * (4.0 * C * C + NC + C), 2 * NC * 4 * C,
       [&] { k.matmul_forward_hidden(y.f(), h4.f(), w4.f(), b4.f(), N, 4 * C, C, prec); }},
      {"classifier fwd", 1, ha * NC + f * double(V) * C + logits_bytes + 12.0 * N, 2 * NC * V,
       [&] {
         k.classifier_forward(logits.f(), losses.f(), lse.f(), xh.f(), wte.f(), d_targets.i(), N, C, V, 0, prec);
       }},
      {"classifier bwd", 1, ha * NC + f * (2 * NC + 3.0 * V * C) + 2 * logits_bytes + 8.0 * N, 4 * NC * V,
       [&] {
         k.classifier_backward(dx.f(), dwte.f(), logits.f(), lse.f(), d_targets.i(), dlosses.f(), xh.f(), wte.f(), N,
                               C, V, 0, prec);
       }},
      {"layernorm bwd", 2 * L + 1, f * 5 * NC, 0,
       [&] { k.layernorm_backward(dx.f(), dlnw.f(), dlnb.f(), y.f(), x.f(), lnw.f(), mean.f(), rstd.f(), N, C); }},
      // dout read; inp and pre read, dpre written (hidden); the weight and its gradient.
      {"matmul+gelu bwd fcproj", L, f * (NC + 12.0 * C * C + 2 * C) + 3 * hf * 4 * NC, 4 * NC * 4 * C,
       [&] {
         k.matmul_backward_gelu(dh4.f(), dw4.f(), db4.f(), y.f(), g4.f(), h4.f(), w4.f(), s4.f(), N, 4 * C, C, prec);
       }},
      // dout and inp read hidden.
      {"matmul bwd fc", L, hf * 4 * NC + ha * NC + f * (NC + 12.0 * C * C + 8 * C), 4 * NC * 4 * C,
       [&] { k.matmul_backward_set_hidden(dx.f(), dw4.f(), db4.f(), h4.f(), xh.f(), w4.f(), N, C, 4 * C, prec); }},
      // dout read; inp read and dinp written, hidden.
      {"matmul bwd attproj", L, f * (NC + 3.0 * C * C + 2 * C) + ha * 2 * NC, 4 * NC * C,
       [&] { k.matmul_backward_hidden(datty.f(), dw4.f(), db4.f(), y.f(), atty.f(), w4.f(), N, C, C, prec); }},
      {"attention bwd", L, att_bwd_bytes, 4 * att * (C / NH),
       [&] { k.attention_backward(dqkv.f(), datty.f(), qkv.f(), atty.f(), attn.f(), B, T, C, NH, NH, prec); }},
      // dout (dqkv) and inp read hidden.
      {"matmul bwd qkv", L, ha * 4 * NC + f * (NC + 9.0 * C * C + 6 * C), 4 * NC * 3 * C,
       [&] { k.matmul_backward_set_hidden(dx.f(), dw4.f(), db4.f(), dqkv.f(), xh.f(), w4.f(), N, C, 3 * C, prec); }},
      {"encoder bwd", 1, f * 5 * NC, 0,
       [&] { k.encoder_backward(dwte.f(), dwpe.f(), dx.f(), d_tokens.i(), B, T, C, 0, V); }},
      {"adamw", 1, 28.0 * np, 0, [&] { k.adamw_update(p.f(), m.f(), v.f(), g.f(), np, hp); }},
  };
  // The attention's other implementation side by side, where both run the shape and save the same floats (the
  // flash kernels and cuDNN's: kernels/cuda/cudnn_attention.h), timed with STRATA_ATTENTION flipped for the call:
  // rows with 0 calls a step, outside the step's sum.
  namespace kc = kernels::cuda;
  const bool cudnn_chosen = kc::cudnn_attention_chosen();
  if (bf16 && kc::cudnn_attention_runs(B, T, NH, C / NH)) {
    kc::set_cudnn_attention_chosen(!cudnn_chosen);
    const bool same_floats = k.attention_saved_floats(B, T, C, NH, prec) == saved_floats;
    kc::set_cudnn_attention_chosen(cudnn_chosen);
    const std::string other = cudnn_chosen ? "flash" : "cuDNN";
    auto flipped = [&](const std::function<void()>& run) {
      return [&, run] {
        kc::set_cudnn_attention_chosen(!cudnn_chosen);
        run();
        kc::set_cudnn_attention_chosen(cudnn_chosen);
      };
    };
    if (same_floats) {
      ops.push_back({"attention fwd (" + other + ")", 0, ha * 4 * NC + f * saved_att, 2 * att * (C / NH),
                     flipped([&] { k.attention_forward(atty.f(), attn.f(), qkv.f(), B, T, C, NH, NH, prec); })});
      ops.push_back({"attention bwd (" + other + ")", 0, ha * 8 * NC + f * saved_att, 4 * att * (C / NH),
                     flipped([&] {
                       k.attention_backward(dqkv.f(), datty.f(), qkv.f(), atty.f(), attn.f(), B, T, C, NH, NH, prec);
                     })});
    }
  }

  report_ops(o, ceil, N, ops);
  return 0;
}

#endif  // STRATA_HAVE_CUDA

}  // namespace strata::engine
