// hidden_form_backend.h — a CPU test backend that keeps the model's hidden activations (kernels.h: the linears'
// inputs, qkv, the attention's output, the MLP's hidden units and some of their gradients) in bf16 under kBF16
// at widths that are a multiple of 8, as the CUDA backend does: each of its slots widens its hidden inputs into
// fp32 scratch, runs the fast CPU kernel, and rounds its hidden outputs to bf16. So how GPT2 sizes, offsets,
// routes and gathers them is checked without a GPU (tests/engine/model/hidden_form_test.cpp, and under tensor and
// sequence parallelism tests/comm/hidden_form_tp_test.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/kernels.h"

namespace strata::testing::hidden_form {

using kernels::KernelSet;
using kernels::MatmulPrecision;
using kernels::Weight;

inline const KernelSet& fast() { return kernels::cpu_fast_kernels(); }

inline bool in_bf16(int width, MatmulPrecision p) { return p == MatmulPrecision::kBF16 && width % 8 == 0; }
inline size_t elems(int N, int width) { return static_cast<size_t>(N) * static_cast<size_t>(width); }

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

inline size_t hidden_bytes(int N, int width, MatmulPrecision p) {
  return elems(N, width) * (in_bf16(width, p) ? sizeof(uint16_t) : sizeof(float));
}
inline void layernorm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, MatmulPrecision p) {
  Out o(out, elems(N, C), in_bf16(C, p));
  fast().layernorm_forward(o.p, mean, rstd, inp, weight, bias, N, C, p);
}
inline void residual_layernorm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1,
                                       const float* inp2, const float* weight, const float* bias, int N, int C,
                                       MatmulPrecision p) {
  Out o(out, elems(N, C), in_bf16(C, p));
  fast().residual_layernorm_forward(res, o.p, mean, rstd, inp1, inp2, weight, bias, N, C, p);
}
inline void attention_forward(void* out, float* att, const void* qkv, int B, int T, int C, int NH, int NKV,
                              MatmulPrecision p) {
  const int W = C + 2 * NKV * (C / NH);
  const In q(qkv, elems(B * T, W), in_bf16(W, p));
  Out o(out, elems(B * T, C), in_bf16(C, p));
  fast().attention_forward(o.p, att, q.p, B, T, C, NH, NKV, p);
}
inline void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* att, int B,
                               int T, int C, int NH, int NKV, MatmulPrecision p) {
  const int W = C + 2 * NKV * (C / NH);
  const In d(dout, elems(B * T, C), in_bf16(C, p)), q(qkv, elems(B * T, W), in_bf16(W, p));
  const In o(out, elems(B * T, C), in_bf16(C, p));
  Out dq(dqkv, elems(B * T, W), in_bf16(W, p));
  fast().attention_backward(dq.p, d.p, q.p, o.p, att, B, T, C, NH, NKV, p);
}
inline void matmul_forward_to_hidden(void* out, const void* inp, Weight weight, const float* bias, int N, int C,
                                     int OC, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  Out o(out, elems(N, OC), in_bf16(OC, p));
  fast().matmul_forward_to_hidden(o.p, x.p, weight, bias, N, C, OC, p);
}
inline void matmul_backward_hidden(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                                   Weight weight, int N, int C, int OC, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  Out d(dinp, elems(N, C), in_bf16(C, p));
  fast().matmul_backward_hidden(d.p, dweight, dbias, dout, x.p, weight, N, C, OC, p);
}
inline void matmul_gelu_forward(void* out, void* pre, const void* inp, Weight weight, const float* bias, int N,
                                int C, int OC, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  Out o(out, elems(N, OC), in_bf16(OC, p)), pr(pre, elems(N, OC), in_bf16(OC, p));
  fast().matmul_gelu_forward(o.p, pr.p, x.p, weight, bias, N, C, OC, p);
}
inline void matmul_forward_hidden(float* out, const void* inp, Weight weight, const float* bias, int N, int C,
                                  int OC, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  fast().matmul_forward_hidden(out, x.p, weight, bias, N, C, OC, p);
}
inline void matmul_backward_gelu(void* dpre, float* dweight, float* dbias, const float* dout, const void* inp,
                                 const void* pre, Weight weight, void* /*scratch*/, int N, int C, int OC,
                                 MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p)), pr(pre, elems(N, C), in_bf16(C, p));
  Out d(dpre, elems(N, C), in_bf16(C, p));
  std::vector<float> scratch(elems(N, C));  // the model's scratch is hidden-sized: half of what fp32 needs
  fast().matmul_backward_gelu(d.p, dweight, dbias, dout, x.p, pr.p, weight, scratch.data(), N, C, OC, p);
}
inline void matmul_backward_set_hidden(float* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                       Weight weight, int N, int C, int OC, MatmulPrecision p) {
  const In d(dout, elems(N, OC), in_bf16(OC, p)), x(inp, elems(N, C), in_bf16(C, p));
  fast().matmul_backward_set_hidden(dinp, dweight, dbias, d.p, x.p, weight, N, C, OC, p);
}
inline void classifier_forward(void* logits, float* losses, float* lse, const void* inp, Weight weight,
                               const int32_t* targets, int N, int C, int V, int vocab_start, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  fast().classifier_forward(logits, losses, lse, x.p, weight, targets, N, C, V, vocab_start, p);
}
inline void classifier_backward(float* dinp, float* dweight, void* logits, const float* lse, const int32_t* targets,
                                const float* dlosses, const void* inp, Weight weight, int N, int C, int V,
                                int vocab_start, MatmulPrecision p) {
  const In x(inp, elems(N, C), in_bf16(C, p));
  fast().classifier_backward(dinp, dweight, logits, lse, targets, dlosses, x.p, weight, N, C, V, vocab_start, p);
}

inline const KernelSet& bf16_hidden_kernels() {
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

// The tests' batches: random tokens, and targets with every 13th one (from the 6th) left out of the loss.
inline void random_batch(Rng& rng, int vocab, std::vector<int32_t>* x, std::vector<int32_t>* y) {
  for (size_t i = 0; i < x->size(); ++i) {
    (*x)[i] = static_cast<int32_t>(rng.below(vocab));
    (*y)[i] = i % 13 == 5 ? -1 : static_cast<int32_t>(rng.below(vocab));
  }
}

}  // namespace strata::testing::hidden_form
