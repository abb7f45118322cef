// fast_adamw.cpp — the fast CPU AdamW update (declared in kernels/cpu/fast.h), and the same pass fused with the
// write of a 16-bit working copy (adamw_update_mixed: the optimizer step of ZeRO-Offload, where the fp32 master,
// m and v live in host memory and the device gets bf16/f16 weights).
//
// Memory-bound: 4 reads and 3 writes per parameter (+ one 16-bit write), so the aim is one pass at full
// bandwidth on all cores.
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
#include <cstdint>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/check.h"
#include "common/dtype.h"
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

// What the pass writes besides fp32 params, m, v: nothing, or a bf16 / f16 rounding of each new parameter.
enum class Working { kNone, kBF16, kF16 };

// Where the pass reads the old state and writes the new: the same arrays (in place), or others.
struct Arrays {
  const float *p_in, *m_in, *v_in, *g;
  float *p, *m, *v;
  uint16_t* w;
};

// Elements [i0, i1), one at a time: the tails of the SIMD versions, and the whole baseline version.
template <Working W>
[[STRATA_NO_FP_CONTRACT]] void adamw_scalar(const Arrays& a, size_t i0, size_t i1, const AdamWScalars& s) {
  for (size_t i = i0; i < i1; ++i) {
    const float gi = a.g[i] * s.grad_scale;
    const float mi = s.b1 * a.m_in[i] + s.one_minus_b1 * gi;
    const float vi = s.b2 * a.v_in[i] + s.one_minus_b2 * gi * gi;
    a.m[i] = mi;
    a.v[i] = vi;
    const float pi = a.p_in[i] * s.decay;
    const float pn = pi - s.step_size * (mi / (std::sqrt(vi) / s.bc2_sqrt + s.eps));
    a.p[i] = pn;
    if constexpr (W == Working::kBF16) a.w[i] = f32_to_bf16(pn);
    if constexpr (W == Working::kF16) a.w[i] = f32_to_f16(pn);
  }
}

// bf16 round-to-nearest-even of 16 floats, NaN kept quiet: common/dtype.h's f32_to_bf16, vectorized. (The
// zero-masking forms with a full mask are the plain instructions; the unmasked intrinsics trip GCC 12's
// -Wmaybe-uninitialized, as in adamw_avx512's square root.)
constexpr __mmask16 kAll16 = 0xFFFF;
[[STRATA_TARGET_AVX512]] inline __m256i bf16_avx512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i hi = _mm512_maskz_srli_epi32(kAll16, bits, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i h = _mm512_maskz_srli_epi32(kAll16, _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)),
                                      16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  h = _mm512_mask_mov_epi32(h, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_maskz_cvtepi32_epi16(kAll16, h);
}

// Stream: the new state goes elsewhere (adamw_update_into), so its stores bypass the cache (no read for
// ownership of lines the pass will not read) from the first element whose p_out is 64-byte aligned (the caller
// checks that m_out and v_out are aligned alike).
template <Working W, bool Stream>
[[STRATA_TARGET_AVX512, STRATA_NO_FP_CONTRACT]] void adamw_avx512(const Arrays& a, size_t i0, size_t i1,
                                                                  const AdamWScalars& s) {
  const __m512 grad_scale = _mm512_set1_ps(s.grad_scale), b1 = _mm512_set1_ps(s.b1),
               omb1 = _mm512_set1_ps(s.one_minus_b1), b2 = _mm512_set1_ps(s.b2), omb2 = _mm512_set1_ps(s.one_minus_b2),
               decay = _mm512_set1_ps(s.decay), step_size = _mm512_set1_ps(s.step_size),
               bc2_sqrt = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps);
  // Locals, not a's fields: a vector store may alias anything, the struct too, which would reload each pointer.
  const float *p = a.p_in, *m = a.m_in, *v = a.v_in, *g = a.g;
  float *p_out = a.p, *m_out = a.m, *v_out = a.v;
  uint16_t* w = a.w;
  size_t i = i0;
  if constexpr (Stream) {
    while (i < i1 && (reinterpret_cast<uintptr_t>(p_out + i) & 63) != 0) ++i;
    adamw_scalar<W>(a, i0, i, s);
  }
  auto store = [](float* dst, __m512 x) {
    if constexpr (Stream) {
      _mm512_stream_ps(dst, x);
    } else {
      _mm512_storeu_ps(dst, x);
    }
  };
  for (; i + 16 <= i1; i += 16) {
    const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), grad_scale);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_loadu_ps(m + i)), _mm512_mul_ps(omb1, gi));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(v + i)), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    store(m_out + i, mi);
    store(v_out + i, vi);
    // maskz with a full mask is plain vsqrtps; _mm512_sqrt_ps trips GCC 12's -Wmaybe-uninitialized.
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(0xFFFF, vi), bc2_sqrt), eps);
    const __m512 pi = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
    const __m512 pn = _mm512_sub_ps(pi, _mm512_mul_ps(step_size, _mm512_div_ps(mi, denom)));
    store(p_out + i, pn);
    if constexpr (W == Working::kBF16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), bf16_avx512(pn));
    if constexpr (W == Working::kF16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i),
                          _mm512_maskz_cvtps_ph(kAll16, pn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  if constexpr (Stream) _mm_sfence();  // the streamed stores before any later one (the task's end, a publication)
  adamw_scalar<W>(a, i, i1, s);
}

#define STRATA_TARGET_AVX2_F16C gnu::target("avx2,fma,f16c")

// The AVX2 version of bf16_avx512: 8 floats to 8 bf16 in the low 128 bits.
[[STRATA_TARGET_AVX2_F16C]] inline __m128i bf16_avx2(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  h = _mm256_blendv_epi8(h, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)), nan);
  // Every lane is <= 0xffff, so the unsigned saturating pack is exact; it packs within 128-bit halves.
  const __m256i packed = _mm256_packus_epi32(h, h);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <Working W>
[[STRATA_TARGET_AVX2_F16C, STRATA_NO_FP_CONTRACT]] void adamw_avx2(const Arrays& a, size_t i0, size_t i1,
                                                                   const AdamWScalars& s) {
  const __m256 grad_scale = _mm256_set1_ps(s.grad_scale), b1 = _mm256_set1_ps(s.b1),
               omb1 = _mm256_set1_ps(s.one_minus_b1), b2 = _mm256_set1_ps(s.b2), omb2 = _mm256_set1_ps(s.one_minus_b2),
               decay = _mm256_set1_ps(s.decay), step_size = _mm256_set1_ps(s.step_size),
               bc2_sqrt = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps);
  // Locals, not a's fields: a vector store may alias anything, the struct too, which would reload each pointer.
  const float *p = a.p_in, *m = a.m_in, *v = a.v_in, *g = a.g;
  float *p_out = a.p, *m_out = a.m, *v_out = a.v;
  uint16_t* w = a.w;
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), grad_scale);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(omb1, gi));
    const __m256 vi =
        _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    _mm256_storeu_ps(m_out + i, mi);
    _mm256_storeu_ps(v_out + i, vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2_sqrt), eps);
    const __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    const __m256 pn = _mm256_sub_ps(pi, _mm256_mul_ps(step_size, _mm256_div_ps(mi, denom)));
    _mm256_storeu_ps(p_out + i, pn);
    if constexpr (W == Working::kBF16) _mm_storeu_si128(reinterpret_cast<__m128i*>(w + i), bf16_avx2(pn));
    if constexpr (W == Working::kF16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + i),
                       _mm256_cvtps_ph(pn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  adamw_scalar<W>(a, i, i1, s);
}

template <Working W>
void adamw_blocks(const Arrays& a, size_t n, const AdamWScalars& s) {
  const simd::Isa isa = simd::active_isa();
  auto misalignment = [](const float* x) { return reinterpret_cast<uintptr_t>(x) & 63; };
  // Streaming stores only where all three go elsewhere: into lines just read they would evict what is reused.
  const bool stream = a.p != a.p_in && a.m != a.m_in && a.v != a.v_in && misalignment(a.p) == misalignment(a.m) &&
                      misalignment(a.p) == misalignment(a.v);
  // Fixed blocks rather than TBB's adaptive split: the same elements take the SIMD loop or the scalar tail in
  // every run (identical arithmetic today, but determinism should not rest on that).
  const size_t blocks = (n + kElementsPerTask - 1) / kElementsPerTask;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t k = r.begin(); k < r.end(); ++k) {
      const size_t i0 = k * kElementsPerTask;
      const size_t i1 = std::min(n, i0 + kElementsPerTask);
      switch (isa) {
        case simd::Isa::kAvx512:
          if (stream) {
            adamw_avx512<W, true>(a, i0, i1, s);
          } else {
            adamw_avx512<W, false>(a, i0, i1, s);
          }
          break;
        case simd::Isa::kAvx2:
          adamw_avx2<W>(a, i0, i1, s);
          break;
        default:
          adamw_scalar<W>(a, i0, i1, s);
          break;
      }
    }
  });
}

}  // namespace

void adamw_update(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp) {
  adamw_update_mixed(params, m, v, grads, nullptr, DType::kF32, n, hp);
}

void adamw_update_mixed(float* params, float* m, float* v, const float* grads, uint16_t* working,
                        DType working_dtype, size_t n, const AdamWParams& hp) {
  adamw_update_into(params, m, v, grads, params, m, v, working, working_dtype, n, hp);
}

void adamw_update_into(const float* params, const float* m, const float* v, const float* grads, float* params_out,
                       float* m_out, float* v_out, uint16_t* working, DType working_dtype, size_t n,
                       const AdamWParams& hp) {
  STRATA_ASSERT_MSG(hp.step >= 1, "AdamW step is 1-based");
  STRATA_ASSERT_MSG(working_dtype == DType::kF32 || working != nullptr || n == 0,
                    "a 16-bit working copy needs its buffer");
  const AdamWScalars s = make_scalars(hp);
  const Arrays a{params, m, v, grads, params_out, m_out, v_out, working};
  switch (working_dtype) {
    case DType::kBF16:
      return adamw_blocks<Working::kBF16>(a, n, s);
    case DType::kF16:
      return adamw_blocks<Working::kF16>(a, n, s);
    case DType::kF32:
      return adamw_blocks<Working::kNone>(a, n, s);
  }
}

double add_sum_squares(double sum, const float* x, size_t n) {
  // Blocks of 4096, each summed in float64 over 8 interleaved lanes (independent chains the compiler vectorizes),
  // the blocks in parallel, and their sums added to `sum` in block order: the order depends on n alone, so the
  // result repeats bit for bit whatever the threads.
  static constexpr size_t kBlock = 4096, kLanes = 8;
  auto block_sum = [x, n](size_t b) {
    const float* p = x + b * kBlock;
    const size_t len = std::min(kBlock, n - b * kBlock);
    double lane[kLanes] = {};
    size_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
      for (size_t k = 0; k < kLanes; ++k) lane[k] += static_cast<double>(p[j + k]) * p[j + k];
    }
    for (; j < len; ++j) lane[j % kLanes] += static_cast<double>(p[j]) * p[j];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  };
  const size_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks <= 64) {  // 256K floats: not worth the threads
    for (size_t b = 0; b < blocks; ++b) sum += block_sum(b);
    return sum;
  }
  std::vector<double> partial(blocks);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 16), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t b = r.begin(); b < r.end(); ++b) partial[b] = block_sum(b);
  });
  for (const double p : partial) sum += p;
  return sum;
}

}  // namespace strata::kernels::cpu::fast
