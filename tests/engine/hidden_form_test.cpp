// hidden_form_test.cpp — the model's handling of hidden activations (kernels.h: the linears' inputs, qkv, the
// attention's output, the MLP's hidden units and some of their gradients, kept in a form only the backend reads)
// on the CPU, where the backends keep them fp32. A test backend keeps them in bf16 under kBF16 at widths that are
// a multiple of 8, as CUDA does: each of its slots widens its hidden inputs into fp32 scratch, runs the fast CPU
// kernel, and rounds its hidden outputs to bf16. So the sizes, per-layer offsets and strides GPT2 uses for them,
// and which slot reads or writes which, are checked here without a GPU: a float offset where a hidden one belongs,
// or an fp32 read of a bf16 buffer, makes the runs below diverge or read garbage.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "engine/gpt2.h"
#include "engine/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"
#include "tests/engine/param_compare.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using kernels::KernelSet;
using kernels::MatmulPrecision;

const KernelSet& fast() { return kernels::cpu_fast_kernels(); }

bool in_bf16(int width, MatmulPrecision p) { return p == MatmulPrecision::kBF16 && width % 8 == 0; }
size_t elems(int N, int width) { return static_cast<size_t>(N) * static_cast<size_t>(width); }

// A hidden input as fp32: the buffer itself, or its bf16 values widened into scratch.
struct In {
  std::vector<float> widened;
  const float* p;
  In(const void* x, size_t n, bool bf16) : p(static_cast<const float*>(x)) {
    if (!bf16) return;
    widened.resize(n);
    const auto* h = static_cast<const uint16_t*>(x);
    for (size_t i = 0; i < n; ++i) widened[i] = bf16_to_f32(h[i]);
    p = widened.data();
  }
};

// A hidden output (every one is overwritten): written in fp32 into scratch, then rounded into the buffer.
struct Out {
  std::vector<float> scratch;
  void* dst;
  float* p;
  Out(void* d, size_t n, bool bf16) : dst(d), p(static_cast<float*>(d)) {
    if (!bf16) return;
    scratch.resize(n);
    p = scratch.data();
  }
  ~Out() {
    auto* h = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < scratch.size(); ++i) h[i] = f32_to_bf16(scratch[i]);
  }
};

size_t hidden_bytes(int N, int width, MatmulPrecision p) {
  return elems(N, width) * (in_bf16(width, p) ? sizeof(uint16_t) : sizeof(float));
}
void layernorm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, MatmulPrecision p) {
  Out o(out, elems(N, C), in_bf16(C, p));
  fast().layernorm_forward(o.p, mean, rstd, inp, weight, bias, N, C, p);
}
void residual_layernorm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1, const float* inp2,
                                const float* weight, const float* bias, int N, int C, MatmulPrecision p) {
  Out o(out, elems(N, C), in_bf16(C, p));
  fast().residual_layernorm_forward(res, o.p, mean, rstd, inp1, inp2, weight, bias, N, C, p);
}
void attention_forward(void* out, float* att, const void* qkv, int B, int T, int C, int NH, MatmulPrecision p) {
  const In q(qkv, elems(B * T, 3 * C), in_bf16(3 * C, p));
  Out o(out, elems(B * T, C), in_bf16(C, p));
  fast().attention_forward(o.p, att, q.p, B, T, C, NH, p);
}
void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* att, int B,
                        int T, int C, int NH, MatmulPrecision p) {
  const In d(dout, elems(B * T, C), in_bf16(C, p)), q(qkv, elems(B * T, 3 * C), in_bf16(3 * C, p));
  const In o(out, elems(B * T, C), in_bf16(C, p));
  Out dq(dqkv, elems(B * T, 3 * C), in_bf16(3 * C, p));
  fast().attention_backward(dq.p, d.p, q.p, o.p, att, B, T, C, NH, p);
}
void matmul_forward_to_hidden(void* out, const void* inp, const float* weight, const float* bias, int N, int C, int OC,
                              MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  Out o(out, elems(N, OC), in_bf16(OC, p));
  fast().matmul_forward_to_hidden(o.p, x.p, weight, bias, N, C, OC, p);
}
void matmul_backward_hidden(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                            const float* weight, int N, int C, int OC, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  Out d(dinp, elems(N, C), in_bf16(C, p));
  fast().matmul_backward_hidden(d.p, dweight, dbias, dout, x.p, weight, N, C, OC, p);
}
void matmul_gelu_forward(void* out, void* pre, const void* inp, const float* weight, const float* bias, int N, int C,
                         int OC, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  Out o(out, elems(N, OC), in_bf16(OC, p)), pr(pre, elems(N, OC), in_bf16(OC, p));
  fast().matmul_gelu_forward(o.p, pr.p, x.p, weight, bias, N, C, OC, p);
}
void matmul_forward_hidden(float* out, const void* inp, const float* weight, const float* bias, int N, int C, int OC,
                           MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  fast().matmul_forward_hidden(out, x.p, weight, bias, N, C, OC, p);
}
void matmul_backward_gelu(void* dpre, float* dweight, float* dbias, const float* dout, const void* inp,
                          const void* pre, const float* weight, void* /*scratch*/, int N, int C, int OC,
                          MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p)), pr(pre, elems(N, C), in_bf16(C, p));
  Out d(dpre, elems(N, C), in_bf16(C, p));
  std::vector<float> scratch(elems(N, C));  // the model's scratch is hidden-sized: half of what fp32 needs
  fast().matmul_backward_gelu(d.p, dweight, dbias, dout, x.p, pr.p, weight, scratch.data(), N, C, OC, p);
}
void matmul_backward_set_hidden(float* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                const float* weight, int N, int C, int OC, MatmulPrecision p) {
  const In d(dout, elems(N, OC), in_bf16(OC, p)), x(inp, elems(N, C), in_bf16(C, p));
  fast().matmul_backward_set_hidden(dinp, dweight, dbias, d.p, x.p, weight, N, C, OC, p);
}
void classifier_forward(void* logits, float* losses, float* lse, const void* inp, const float* weight,
                        const int32_t* targets, int N, int C, int V, int vocab_start, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  fast().classifier_forward(logits, losses, lse, x.p, weight, targets, N, C, V, vocab_start, p);
}
void classifier_backward(float* dinp, float* dweight, void* logits, const float* lse, const int32_t* targets,
                         const float* dlosses, const void* inp, const float* weight, int N, int C, int V,
                         int vocab_start, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  fast().classifier_backward(dinp, dweight, logits, lse, targets, dlosses, x.p, weight, N, C, V, vocab_start, p);
}

const KernelSet& bf16_hidden_kernels() {
  static const KernelSet k = [] {
    KernelSet s = fast();
    s.name = "cpu-fast, hidden activations in bf16";
    s.hidden_bytes = &hidden_bytes;
    s.layernorm_forward = &layernorm_forward;
    s.residual_layernorm_forward = &residual_layernorm_forward;
    s.attention_forward = &attention_forward;
    s.attention_backward = &attention_backward;
    s.matmul_forward_to_hidden = &matmul_forward_to_hidden;
    s.matmul_backward_hidden = &matmul_backward_hidden;
    s.matmul_gelu_forward = &matmul_gelu_forward;
    s.matmul_forward_hidden = &matmul_forward_hidden;
    s.matmul_backward_gelu = &matmul_backward_gelu;
    s.matmul_backward_set_hidden = &matmul_backward_set_hidden;
    s.classifier_forward = &classifier_forward;
    s.classifier_backward = &classifier_backward;
    return s;
  }();
  return k;
}

// Widths that are multiples of 8 (C = 64, 3C, 4C), so every hidden activation is bf16 under kBF16.
const GPT2Config kConfig{.n_layer = 3, .n_head = 4, .n_embd = 64, .vocab_size = 211, .block_size = 40};
constexpr int kB = 3, kT = 37, kSteps = 6;

struct TrainRun {
  std::vector<float> losses;
  std::vector<float> init, params;  // every unit's parameters, before the first step and after the last
  uint64_t activation_bytes = 0;    // the device memory the first forward added
};


TrainRun train(const KernelSet& k, ActivationCheckpointing ckpt = ActivationCheckpointing::kNone) {
  TrainRun r;
  auto device = kernels::make_cpu_device(k);
  auto model = GPT2::create(kConfig, *device, MatmulPrecision::kBF16);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  GPT2& m = *model.value();
  m.set_activation_checkpointing(ckpt);
  EXPECT_TRUE(m.init_gpt2(7).is_ok());
  r.init = testing::host_params(m);
  auto opt = AdamW::create(m.units(), AdamWConfig{}, *device);
  EXPECT_TRUE(opt.is_ok());
  Rng rng(8);
  std::vector<int32_t> x(kB * kT), y(kB * kT);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<int32_t>(rng.below(kConfig.vocab_size));
      y[i] = i % 13 == 5 ? -1 : static_cast<int32_t>(rng.below(kConfig.vocab_size));
    }
    EXPECT_TRUE(m.zero_grads().is_ok());
    const uint64_t before = device->live_bytes();
    auto loss = m.forward(x.data(), y.data(), kB, kT);
    EXPECT_TRUE(loss.is_ok()) << loss.status().to_string();
    if (s == 0) r.activation_bytes = device->live_bytes() - before;
    r.losses.push_back(loss.is_ok() ? loss.value() : NAN);
    EXPECT_TRUE(m.backward().is_ok());
    opt->step(m.units(), 1e-3f);
  }
  r.params = testing::host_params(m);
  return r;
}

double update_distance(const TrainRun& a, const TrainRun& b) {
  return testing::update_distance(a.init, a.params, b.init, b.params);
}

// Training with every hidden activation in bf16 follows training with them in fp32 within bf16 rounding, and
// keeps less on the device; a run that read a bf16 buffer as floats (or at a float offset) would not.
TEST(HiddenFormTest, Bf16HiddenActivationsTrainLikeFp32Ones) {
  ASSERT_EQ(bf16_hidden_kernels().hidden_bytes(10, 64, MatmulPrecision::kBF16), 10u * 64 * 2);
  const TrainRun f32 = train(fast()), bf16 = train(bf16_hidden_kernels());
  EXPECT_TRUE(testing::all_close(bf16.losses, f32.losses, 1e-2, 1e-2, "losses"));
  EXPECT_NE(bf16.losses, f32.losses) << "the bf16 hidden form did not round anything";
  const double d = update_distance(bf16, f32);
  EXPECT_LT(d, 0.05) << "the bf16 run's updates are " << d << " of the fp32 run's away from them";
  // ln1, ln2, qkv, atty, fch, fch_gelu per layer, lnf, and the gradients datty, dqkv, dfch, dfch_gelu: half the
  // bytes each.
  EXPECT_LT(bf16.activation_bytes, f32.activation_bytes);
}

// Recomputing blocks from checkpoints writes their hidden activations again at the same offsets: the same
// training, step by step.
TEST(HiddenFormTest, RecomputedBlocksMatchKeptOnes) {
  const TrainRun kept = train(bf16_hidden_kernels());
  const TrainRun recomputed = train(bf16_hidden_kernels(), ActivationCheckpointing::kDevice);
  EXPECT_TRUE(testing::all_close(recomputed.losses, kept.losses, 1e-6, 1e-6, "losses"));
  EXPECT_LT(update_distance(recomputed, kept), 1e-4);
}

}  // namespace
}  // namespace strata::engine
