// reference_matmul.h — the plain reference matmul (forward and backward), the yardstick for the fast and CUDA
// versions.
//
// Templates on the element type F: instantiated at float for the "cpu-reference" KernelSet and at double by
// the tests. Semantics are the KernelSet's (kernels/kernels.h): out = inp @ weight^T + bias, and backward
// ACCUMULATES into dinp, dweight and dbias. Single-threaded, no SIMD intrinsics; loop orders keep the inner loop
// contiguous (llm.c's) so float64 tests on a few hundred rows stay quick. Pure functions, thread-safe.
//
// Precision kBF16 rounds the matmul inputs to bf16 (round to nearest even, common/dtype.h) and then computes in
// F, which models a bf16 x bf16 -> f32 GEMM up to the accumulation order. Rounding goes through float, so F
// values must be representable as float (they are: the tensors are fp32; the tests' doubles are widened floats).
// dbias is always the sum of the unrounded dout, as mixed-precision training keeps bias gradients in fp32.
#pragma once

#include <cstddef>
#include <vector>

#include "common/dtype.h"
#include "kernels/kernels.h"

namespace strata::kernels::cpu::ref {

namespace detail {

// Copy of x (n) with every element rounded to bf16 and widened back to F.
template <typename F>
std::vector<F> round_to_bf16(const F* x, size_t n) {
  std::vector<F> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = static_cast<F>(bf16_to_f32(f32_to_bf16(static_cast<float>(x[i]))));
  return r;
}

}  // namespace detail

// out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC); bias may be null. Each output is one dot product summed
// in F in order c = 0..C-1, then the bias is added (oneDNN's order: bias after the sum).
template <typename F>
void matmul_forward(F* out, const F* inp, const F* weight, const F* bias, int N, int C, int OC,
                    MatmulPrecision precision) {
  std::vector<F> inp_r, weight_r;
  if (precision == MatmulPrecision::kBF16) {
    inp_r = detail::round_to_bf16(inp, static_cast<size_t>(N) * C);
    weight_r = detail::round_to_bf16(weight, static_cast<size_t>(OC) * C);
    inp = inp_r.data();
    weight = weight_r.data();
  }
  for (int n = 0; n < N; ++n) {
    const F* x = inp + static_cast<size_t>(n) * C;
    F* y = out + static_cast<size_t>(n) * OC;
    for (int o = 0; o < OC; ++o) {
      const F* w = weight + static_cast<size_t>(o) * C;
      F sum = 0;
      for (int c = 0; c < C; ++c) sum += x[c] * w[c];
      y[o] = bias != nullptr ? sum + bias[o] : sum;
    }
  }
}

// dinp (N,C) += dout (N,OC) @ weight (OC,C); dweight (OC,C) += dout^T @ inp (N,C); dbias (OC) += column sums of
// dout, if dbias is non-null. Accumulation goes straight into the gradients (their old value takes part in
// every addition), which is the simplest correct form of "+=".
template <typename F>
void matmul_backward(F* dinp, F* dweight, F* dbias, const F* dout, const F* inp, const F* weight, int N, int C,
                     int OC, MatmulPrecision precision) {
  if (dbias != nullptr) {
    // Per column: a partial sum over rows in order n = 0..N-1, then one addition into dbias (llm.c's order;
    // the fast version sums in the same order so fp32 results agree bit for bit).
    for (int o = 0; o < OC; ++o) {
      F sum = 0;
      for (int n = 0; n < N; ++n) sum += dout[static_cast<size_t>(n) * OC + o];
      dbias[o] += sum;
    }
  }
  std::vector<F> dout_r, inp_r, weight_r;
  if (precision == MatmulPrecision::kBF16) {
    dout_r = detail::round_to_bf16(dout, static_cast<size_t>(N) * OC);
    inp_r = detail::round_to_bf16(inp, static_cast<size_t>(N) * C);
    weight_r = detail::round_to_bf16(weight, static_cast<size_t>(OC) * C);
    dout = dout_r.data();
    inp = inp_r.data();
    weight = weight_r.data();
  }
  for (int n = 0; n < N; ++n) {
    const F* g = dout + static_cast<size_t>(n) * OC;
    F* dx = dinp + static_cast<size_t>(n) * C;
    for (int o = 0; o < OC; ++o) {
      const F d = g[o];
      const F* w = weight + static_cast<size_t>(o) * C;
      for (int c = 0; c < C; ++c) dx[c] += d * w[c];
    }
  }
  for (int o = 0; o < OC; ++o) {
    F* dw = dweight + static_cast<size_t>(o) * C;
    for (int n = 0; n < N; ++n) {
      const F d = dout[static_cast<size_t>(n) * OC + o];
      const F* x = inp + static_cast<size_t>(n) * C;
      for (int c = 0; c < C; ++c) dw[c] += d * x[c];
    }
  }
}

}  // namespace strata::kernels::cpu::ref
