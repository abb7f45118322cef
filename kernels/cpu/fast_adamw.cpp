// fast_adamw.cpp — the fast CPU AdamW update (declared in kernels/cpu/fast.h).
//
// Memory-bound: 4 reads and 3 writes per parameter, so the aim is one pass at full bandwidth on all cores.
// The per-element operations are those of ref::adamw_update in the same order (see reference.h), each correctly
// rounded, and deliberately without fused multiply-adds: FMA would buy nothing in a memory-bound loop and would
// make m and v drift from the reference by many ulps wherever b1*m and (1-b1)*g nearly cancel. So on every clone
// the result is the reference's, bit for bit, as long as the reference is not compiled with FMA contraction.
// GCC contracts even intrinsic multiplies and adds (AVX-512F implies FMA), hence fp-contract=off on each version.
// Elements are independent: blocks go to TBB and the partition does not affect any result.
// Written with intrinsics rather than fast_simd.h's generic vectors because it needs a vector square root.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/check.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/fast_simd.h"

namespace strata::kernels::cpu::fast {
namespace {

constexpr size_t kElementsPerTask = 1 << 15;  // 128 KiB per array per task

// The per-step scalars, computed as ref::adamw_update computes them.
struct AdamWScalars {
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float decay;      // 1 - lr * wd
  float b1, one_minus_b1, b2, one_minus_b2, eps, grad_scale;
};

AdamWScalars make_scalars(const AdamWParams& hp) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(hp.beta1), hp.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(hp.beta2), hp.step);
  AdamWScalars s;
  s.step_size = static_cast<float>(hp.lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.decay = static_cast<float>(1.0 - static_cast<double>(hp.lr) * hp.weight_decay);
  s.b1 = hp.beta1;
  s.one_minus_b1 = 1.0f - hp.beta1;
  s.b2 = hp.beta2;
  s.one_minus_b2 = 1.0f - hp.beta2;
  s.eps = hp.eps;
  s.grad_scale = hp.grad_scale;
  return s;
}

#define STRATA_NO_FP_CONTRACT gnu::optimize("fp-contract=off")

// Elements [i0, i1), one at a time: the tails of the SIMD versions, and the whole baseline version.
[[STRATA_NO_FP_CONTRACT]] void adamw_scalar(float* p, float* m, float* v, const float* g, size_t i0, size_t i1,
                                            const AdamWScalars& s) {
  for (size_t i = i0; i < i1; ++i) {
    const float gi = g[i] * s.grad_scale;
    const float mi = s.b1 * m[i] + s.one_minus_b1 * gi;
    const float vi = s.b2 * v[i] + s.one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i] * s.decay;
    p[i] = pi - s.step_size * (mi / (std::sqrt(vi) / s.bc2_sqrt + s.eps));
  }
}

[[STRATA_TARGET_AVX512, STRATA_NO_FP_CONTRACT]] void adamw_avx512(float* p, float* m, float* v, const float* g,
                                                                  size_t i0, size_t i1, const AdamWScalars& s) {
  const __m512 grad_scale = _mm512_set1_ps(s.grad_scale), b1 = _mm512_set1_ps(s.b1),
               omb1 = _mm512_set1_ps(s.one_minus_b1), b2 = _mm512_set1_ps(s.b2), omb2 = _mm512_set1_ps(s.one_minus_b2),
               decay = _mm512_set1_ps(s.decay), step_size = _mm512_set1_ps(s.step_size),
               bc2_sqrt = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps);
  size_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), grad_scale);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_loadu_ps(m + i)), _mm512_mul_ps(omb1, gi));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(v + i)), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    // maskz with a full mask is plain vsqrtps; _mm512_sqrt_ps trips GCC 12's -Wmaybe-uninitialized.
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(0xFFFF, vi), bc2_sqrt), eps);
    const __m512 pi = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
    _mm512_storeu_ps(p + i, _mm512_sub_ps(pi, _mm512_mul_ps(step_size, _mm512_div_ps(mi, denom))));
  }
  adamw_scalar(p, m, v, g, i, i1, s);
}

[[STRATA_TARGET_AVX2, STRATA_NO_FP_CONTRACT]] void adamw_avx2(float* p, float* m, float* v, const float* g, size_t i0,
                                                              size_t i1, const AdamWScalars& s) {
  const __m256 grad_scale = _mm256_set1_ps(s.grad_scale), b1 = _mm256_set1_ps(s.b1),
               omb1 = _mm256_set1_ps(s.one_minus_b1), b2 = _mm256_set1_ps(s.b2), omb2 = _mm256_set1_ps(s.one_minus_b2),
               decay = _mm256_set1_ps(s.decay), step_size = _mm256_set1_ps(s.step_size),
               bc2_sqrt = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps);
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), grad_scale);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(omb1, gi));
    const __m256 vi =
        _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2_sqrt), eps);
    const __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    _mm256_storeu_ps(p + i, _mm256_sub_ps(pi, _mm256_mul_ps(step_size, _mm256_div_ps(mi, denom))));
  }
  adamw_scalar(p, m, v, g, i, i1, s);
}

}  // namespace

void adamw_update(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp) {
  STRATA_ASSERT_MSG(hp.step >= 1, "AdamW step is 1-based");
  const AdamWScalars s = make_scalars(hp);
  const simd::Isa isa = simd::active_isa();
  // Fixed blocks rather than TBB's adaptive split: the same elements take the SIMD loop or the scalar tail in
  // every run (identical arithmetic today, but determinism should not rest on that).
  const size_t blocks = (n + kElementsPerTask - 1) / kElementsPerTask;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t k = r.begin(); k < r.end(); ++k) {
      const size_t i0 = k * kElementsPerTask;
      const size_t i1 = std::min(n, i0 + kElementsPerTask);
      switch (isa) {
        case simd::Isa::kAvx512:
          adamw_avx512(params, m, v, grads, i0, i1, s);
          break;
        case simd::Isa::kAvx2:
          adamw_avx2(params, m, v, grads, i0, i1, s);
          break;
        default:
          adamw_scalar(params, m, v, grads, i0, i1, s);
          break;
      }
    }
  });
}

}  // namespace strata::kernels::cpu::fast
