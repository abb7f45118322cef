// composed.h — the fused slots of kernels.h composed of a backend's own simpler slots (template arguments):
// what a backend without the fused form fills them with, and what CUDA falls back on where its fused form does
// not apply (fp32; shapes or alignments cuBLASLt's epilogues do not take).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace strata::kernels {

// A matmul that takes its weights as fp32 only, as the Weight slots take them: the working copy is not used (the
// reference rounds the fp32 values itself, to the same bits).
template <auto MatmulForward>
void f32_weight_matmul_forward(float* out, const float* inp, Weight weight, const float* bias, int N, int C, int OC,
                               MatmulPrecision precision) {
  MatmulForward(out, inp, weight.f32, bias, N, C, OC, precision);
}
template <auto MatmulBackward>
void f32_weight_matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  MatmulBackward(dinp, dweight, dbias, dout, inp, weight.f32, N, C, OC, precision);
}

// The classifier over fp32 logits: the backend's matmul and cross-entropy.
inline size_t composed_classifier_logits_bytes(int N, int V, MatmulPrecision /*precision*/) {
  return static_cast<size_t>(N) * static_cast<size_t>(V) * sizeof(float);
}

template <auto MatmulForward, auto CrossEntropyForward>
void composed_classifier_forward(void* logits, float* losses, float* lse, const void* inp, Weight weight,
                                 const int32_t* targets, int N, int C, int V, int vocab_start,
                                 MatmulPrecision precision) {
  float* out = static_cast<float*>(logits);
  MatmulForward(out, static_cast<const float*>(inp), weight, nullptr, N, C, V, precision);
  if (targets != nullptr) CrossEntropyForward(losses, lse, out, targets, N, V, vocab_start);
}

template <auto MatmulBackward, auto CrossEntropyBackward>
void composed_classifier_backward(float* dinp, float* dweight, void* logits, const float* lse,
                                  const int32_t* targets, const float* dlosses, const void* inp, Weight weight,
                                  int N, int C, int V, int vocab_start, MatmulPrecision precision) {
  float* dlogits = static_cast<float*>(logits);  // in place
  CrossEntropyBackward(dlogits, dlogits, lse, targets, dlosses, N, V, vocab_start);
  MatmulBackward(dinp, dweight, nullptr, dlogits, static_cast<const float*>(inp), weight, N, C, V, precision);
}

// The layernorm into an fp32 hidden out (the backend's own fp32 layernorm).
template <auto LayernormForward>
void composed_layernorm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight,
                                const float* bias, int N, int C, MatmulPrecision /*precision*/) {
  LayernormForward(static_cast<float*>(out), mean, rstd, inp, weight, bias, N, C);
}

// The residual add, then the backend's own fp32 layernorm.
template <auto ResidualForward, auto LayernormForward>
void composed_residual_layernorm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1,
                                         const float* inp2, const float* weight, const float* bias, int N, int C,
                                         MatmulPrecision /*precision*/) {
  ResidualForward(res, inp1, inp2, static_cast<size_t>(N) * static_cast<size_t>(C));
  LayernormForward(static_cast<float*>(out), mean, rstd, res, weight, bias, N, C);
}

// The RMSNorm into an fp32 hidden out, and after the residual add (the backend's own fp32 RMSNorm).
template <auto RmsnormForward>
void composed_rmsnorm_forward(void* out, float* rstd, const float* inp, const float* weight, int N, int C, float eps,
                              MatmulPrecision /*precision*/) {
  RmsnormForward(static_cast<float*>(out), rstd, inp, weight, N, C, eps);
}
template <auto ResidualForward, auto RmsnormForward>
void composed_residual_rmsnorm_forward(float* res, void* out, float* rstd, const float* inp1, const float* inp2,
                                       const float* weight, int N, int C, float eps, MatmulPrecision /*precision*/) {
  ResidualForward(res, inp1, inp2, static_cast<size_t>(N) * static_cast<size_t>(C));
  RmsnormForward(static_cast<float*>(out), rstd, res, weight, N, C, eps);
}

// RoPE and SwiGLU over fp32 hidden activations: the backend's own fp32 forms.
template <auto Rope>
void composed_rope(void* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs,
                   MatmulPrecision /*precision*/) {
  Rope(static_cast<float*>(qkv), cos, sin, B, T, NH, NKV, hs);
}
template <auto QkNormForward>
void composed_qk_norm_forward(void* out, float* rstd, const void* inp, const float* qweight, const float* kweight,
                              int N, int NH, int NKV, int hs, float eps, MatmulPrecision /*precision*/) {
  QkNormForward(static_cast<float*>(out), rstd, static_cast<const float*>(inp), qweight, kweight, N, NH, NKV, hs, eps);
}
template <auto QkNormBackward>
void composed_qk_norm_backward(void* dinp, float* dqweight, float* dkweight, const void* dout, const void* inp,
                               const float* qweight, const float* kweight, const float* rstd, int N, int NH, int NKV,
                               int hs, MatmulPrecision /*precision*/) {
  QkNormBackward(static_cast<float*>(dinp), dqweight, dkweight, static_cast<const float*>(dout),
                 static_cast<const float*>(inp), qweight, kweight, rstd, N, NH, NKV, hs);
}
template <auto SwigluForward>
void composed_swiglu_forward(void* out, const void* inp, int N, int H, MatmulPrecision /*precision*/) {
  SwigluForward(static_cast<float*>(out), static_cast<const float*>(inp), N, H);
}
template <auto SwigluBackward>
void composed_swiglu_backward(void* dinp, const void* dout, const void* inp, int N, int H,
                              MatmulPrecision /*precision*/) {
  SwigluBackward(static_cast<float*>(dinp), static_cast<const float*>(dout), static_cast<const float*>(inp), N, H);
}

// Hidden activations (kernels.h: the linears' inputs, the MLP's hidden units, the attention's qkv) kept as fp32
// (N,width).
inline size_t composed_hidden_bytes(int N, int width, MatmulPrecision /*precision*/) {
  return static_cast<size_t>(N) * static_cast<size_t>(width) * sizeof(float);
}

// The attention slots over fp32 hidden activations: the backend's own fp32 attention.
template <auto AttentionForward>
void composed_attention_forward(void* out, float* att, const void* qkv, int B, int T, int C, int NH, int NKV,
                                MatmulPrecision precision) {
  AttentionForward(static_cast<float*>(out), att, static_cast<const float*>(qkv), B, T, C, NH, NKV, precision);
}
template <auto AttentionBackward>
void composed_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* /*out*/, const float* att,
                                 int B, int T, int C, int NH, int NKV, MatmulPrecision precision) {
  AttentionBackward(static_cast<float*>(dqkv), static_cast<const float*>(dout), static_cast<const float*>(qkv), att,
                    B, T, C, NH, NKV, precision);
}

template <auto MatmulForward>
void composed_matmul_forward_to_hidden(void* out, const void* inp, Weight weight, const float* bias, int N,
                                       int C, int OC, MatmulPrecision precision) {
  MatmulForward(static_cast<float*>(out), static_cast<const float*>(inp), weight, bias, N, C, OC, precision);
}

// The MLP's first linear, then its GELU.
template <auto MatmulForward, auto GeluForward>
void composed_matmul_gelu_forward(void* out, void* pre, const void* inp, Weight weight, const float* bias,
                                  int N, int C, int OC, MatmulPrecision precision) {
  MatmulForward(static_cast<float*>(pre), static_cast<const float*>(inp), weight, bias, N, C, OC, precision);
  GeluForward(static_cast<float*>(out), static_cast<const float*>(pre),
              static_cast<size_t>(N) * static_cast<size_t>(OC));
}

template <auto MatmulForward>
void composed_matmul_forward_hidden(float* out, const void* inp, Weight weight, const float* bias, int N,
                                    int C, int OC, MatmulPrecision precision) {
  MatmulForward(out, static_cast<const float*>(inp), weight, bias, N, C, OC, precision);
}

// The second linear's backward into `scratch` (the gradient of gelu(pre)), then the GELU's into dpre; `Zero`
// (float* p, size_t n) clears n floats of the backend's memory, for the two "+=" to start from.
template <auto MatmulBackward, auto GeluBackward, auto Zero>
void composed_matmul_backward_gelu(void* dpre_hidden, float* dweight, float* dbias, const float* dout,
                                   const void* inp, const void* pre, Weight weight, void* scratch_hidden,
                                   int N, int C, int OC, MatmulPrecision precision) {
  const size_t n = static_cast<size_t>(N) * static_cast<size_t>(C);
  auto* dpre = static_cast<float*>(dpre_hidden);
  auto* scratch = static_cast<float*>(scratch_hidden);
  Zero(scratch, n);
  Zero(dpre, n);
  MatmulBackward(scratch, dweight, dbias, dout, static_cast<const float*>(inp), weight, N, C, OC, precision);
  GeluBackward(dpre, static_cast<const float*>(pre), scratch, n);
}

// matmul_backward into a cleared dinp.
template <auto MatmulBackward, auto Zero>
void composed_matmul_backward_set(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                  Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  Zero(dinp, static_cast<size_t>(N) * static_cast<size_t>(C));
  MatmulBackward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, precision);
}

template <auto MatmulBackwardSet>
void composed_matmul_backward_set_hidden(float* dinp, float* dweight, float* dbias, const void* dout,
                                         const void* inp, Weight weight, int N, int C, int OC,
                                         MatmulPrecision precision) {
  MatmulBackwardSet(dinp, dweight, dbias, static_cast<const float*>(dout), static_cast<const float*>(inp), weight, N,
                    C, OC, precision);
}

template <auto MatmulBackwardSet>
void composed_matmul_backward_hidden(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                                     Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  MatmulBackwardSet(static_cast<float*>(dinp), dweight, dbias, dout, static_cast<const float*>(inp), weight, N, C, OC,
                    precision);
}

// Zero for backends whose memory the host addresses (the CPU ones).
inline void host_zero(float* p, size_t n) { std::fill_n(p, n, 0.0f); }

}  // namespace strata::kernels
