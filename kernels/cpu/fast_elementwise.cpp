// fast_elementwise.cpp — the fast CPU encoder, layernorm, RMSNorm, RoPE, SwiGLU, GELU and residual (declared in
// kernels/cpu/fast.h).
//
// TBB splits rows (or blocks of elements) across cores; the hot bodies (the norms, SwiGLU, GELU) are SIMD clones
// chosen at run time (fast_simd.h). Every reduction has a fixed order that does not depend on how TBB partitions
// the work, so results repeat bit for bit. The encoder, RoPE and residual are memory-bound: plain loops, which the
// compiler vectorises for baseline x86-64, are as fast as wider code there.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "kernels/cpu/fast.h"
#include "kernels/cpu/fast_simd.h"

namespace strata::kernels::cpu::fast {
namespace {

constexpr size_t kElementsPerTask = 1 << 14;  // elementwise ops: large enough to amortise a task, 64 KiB a side
constexpr int kLayernormRowsPerChunk = 32;    // rows per partial sum of dweight/dbias (fixed: sets the order)
constexpr float kLayernormEps = 1e-5f;

// ---- layernorm bodies (one row at a time, C contiguous) -----------------------------------------------------

template <typename V>
STRATA_SIMD_INLINE float row_sum(const float* x, int C) {
  constexpr int L = simd::kLanes<V>;
  V acc{};
  int i = 0;
  for (; i + L <= C; i += L) acc += simd::load<V>(x + i);
  float sum = simd::hsum(acc);
  for (; i < C; ++i) sum += x[i];
  return sum;
}

template <int N>
struct LayernormForwardRows {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                     const float* bias, int n0, int n1, int C) {
    for (int n = n0; n < n1; ++n) {
      const float* x = inp + static_cast<size_t>(n) * C;
      float* y = out + static_cast<size_t>(n) * C;
      const float m = row_sum<V>(x, C) / C;
      // Two passes (mean, then squared deviations) rather than E[x²] - m², which cancels for rows far from 0.
      V acc{};
      int i = 0;
      for (; i + N <= C; i += N) {
        const V d = simd::load<V>(x + i) - m;
        acc += d * d;
      }
      float var = simd::hsum(acc);
      for (; i < C; ++i) var += (x[i] - m) * (x[i] - m);
      var = var / C;
      const float s = 1.0f / std::sqrt(var + kLayernormEps);
      for (i = 0; i + N <= C; i += N)
        simd::store(y + i, (simd::load<V>(x + i) - m) * s * simd::load<V>(weight + i) + simd::load<V>(bias + i));
      for (; i < C; ++i) y[i] = (x[i] - m) * s * weight[i] + bias[i];
      mean[n] = m;
      rstd[n] = s;
    }
  }
};

// Rows [n0, n1): dinp += as the reference; dweight_part / dbias_part (C) += this chunk's share, row by row.
template <int N>
struct LayernormBackwardRows {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* dinp, float* dweight_part, float* dbias_part, const float* dout,
                                     const float* inp, const float* weight, const float* mean, const float* rstd,
                                     int n0, int n1, int C) {
    for (int n = n0; n < n1; ++n) {
      const float* x = inp + static_cast<size_t>(n) * C;
      const float* dy = dout + static_cast<size_t>(n) * C;
      float* dx = dinp + static_cast<size_t>(n) * C;
      const float m = mean[n];
      const float s = rstd[n];
      V acc_dnorm{};
      V acc_dnorm_norm{};
      int i = 0;
      for (; i + N <= C; i += N) {
        const V norm = (simd::load<V>(x + i) - m) * s;
        const V dnorm = simd::load<V>(weight + i) * simd::load<V>(dy + i);
        acc_dnorm += dnorm;
        acc_dnorm_norm += dnorm * norm;
      }
      float dnorm_mean = simd::hsum(acc_dnorm);
      float dnorm_norm_mean = simd::hsum(acc_dnorm_norm);
      for (; i < C; ++i) {
        const float norm = (x[i] - m) * s;
        const float dnorm = weight[i] * dy[i];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean = dnorm_mean / C;
      dnorm_norm_mean = dnorm_norm_mean / C;
      for (i = 0; i + N <= C; i += N) {
        const V norm = (simd::load<V>(x + i) - m) * s;
        const V g = simd::load<V>(dy + i);
        const V dnorm = simd::load<V>(weight + i) * g;
        simd::store(dbias_part + i, simd::load<V>(dbias_part + i) + g);
        simd::store(dweight_part + i, simd::load<V>(dweight_part + i) + norm * g);
        simd::store(dx + i, simd::load<V>(dx + i) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
      }
      for (; i < C; ++i) {
        const float norm = (x[i] - m) * s;
        const float dnorm = weight[i] * dy[i];
        dbias_part[i] += dy[i];
        dweight_part[i] += norm * dy[i];
        dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
  }
};

// ---- RMSNorm bodies (one row at a time, C contiguous) ------------------------------------------------------

template <int N>
struct RmsnormForwardRows {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* out, float* rstd, const float* inp, const float* weight, int n0, int n1,
                                     int C, float eps) {
    for (int n = n0; n < n1; ++n) {
      const float* x = inp + static_cast<size_t>(n) * C;
      float* y = out + static_cast<size_t>(n) * C;
      V acc{};
      int i = 0;
      for (; i + N <= C; i += N) {
        const V v = simd::load<V>(x + i);
        acc += v * v;
      }
      float ss = simd::hsum(acc);
      for (; i < C; ++i) ss += x[i] * x[i];
      const float s = 1.0f / std::sqrt(ss / C + eps);
      for (i = 0; i + N <= C; i += N) simd::store(y + i, simd::load<V>(weight + i) * (simd::load<V>(x + i) * s));
      for (; i < C; ++i) y[i] = weight[i] * (x[i] * s);
      rstd[n] = s;
    }
  }
};

// Rows [n0, n1): dinp += as the reference; dweight_part (C) += this chunk's share, row by row.
template <int N>
struct RmsnormBackwardRows {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* dinp, float* dweight_part, const float* dout, const float* inp,
                                     const float* weight, const float* rstd, int n0, int n1, int C) {
    for (int n = n0; n < n1; ++n) {
      const float* x = inp + static_cast<size_t>(n) * C;
      const float* dy = dout + static_cast<size_t>(n) * C;
      float* dx = dinp + static_cast<size_t>(n) * C;
      const float s = rstd[n];
      V acc{};
      int i = 0;
      for (; i + N <= C; i += N)
        acc += simd::load<V>(dy + i) * simd::load<V>(weight + i) * (simd::load<V>(x + i) * s);
      float gn = simd::hsum(acc);
      for (; i < C; ++i) gn += dy[i] * weight[i] * (x[i] * s);
      gn = gn / C;
      for (i = 0; i + N <= C; i += N) {
        const V norm = simd::load<V>(x + i) * s;
        const V g = simd::load<V>(dy + i);
        simd::store(dweight_part + i, simd::load<V>(dweight_part + i) + g * norm);
        simd::store(dx + i, simd::load<V>(dx + i) + s * (g * simd::load<V>(weight + i) - norm * gn));
      }
      for (; i < C; ++i) {
        const float norm = x[i] * s;
        dweight_part[i] += dy[i] * norm;
        dx[i] += s * (dy[i] * weight[i] - norm * gn);
      }
    }
  }
};

// ---- SwiGLU bodies ------------------------------------------------------------------------------------------
// silu(g) = g σ(g) with σ(g) = 1 / (1 + e^-g) (simd::exp, < 1.3 ulp); silu'(g) = σ(g) (1 + g (1 − σ(g))).

template <int N>
struct SwigluForwardRow {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* out, const float* gate, const float* up, int H) {
    int i = 0;
    for (; i + N <= H; i += N) {
      const V g = simd::load<V>(gate + i);
      simd::store(out + i, g / (1.0f + simd::exp(-g)) * simd::load<V>(up + i));
    }
    if (i < H) {
      const size_t n = static_cast<size_t>(H - i);
      const V g = simd::load_n<V>(gate + i, n, 0.0f);
      simd::store_n(out + i, g / (1.0f + simd::exp(-g)) * simd::load_n<V>(up + i, n, 0.0f), n);
    }
  }
};

template <int N>
struct SwigluBackwardRow {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void grads(const V& g, const V& u, const V& dy, V* dgate, V* dup) {
    const V sig = 1.0f / (1.0f + simd::exp(-g));
    *dgate = dy * u * sig * (1.0f + g * (1.0f - sig));
    *dup = dy * g * sig;
  }
  STRATA_SIMD_INLINE static void run(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                                     int H) {
    int i = 0;
    V dg, du;
    for (; i + N <= H; i += N) {
      grads(simd::load<V>(gate + i), simd::load<V>(up + i), simd::load<V>(dout + i), &dg, &du);
      simd::store(dgate + i, dg);
      simd::store(dup + i, du);
    }
    if (i < H) {
      const size_t n = static_cast<size_t>(H - i);
      grads(simd::load_n<V>(gate + i, n, 0.0f), simd::load_n<V>(up + i, n, 0.0f), simd::load_n<V>(dout + i, n, 0.0f),
            &dg, &du);
      simd::store_n(dgate + i, dg, n);
      simd::store_n(dup + i, du, n);
    }
  }
};

// ---- GELU bodies --------------------------------------------------------------------------------------------
// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x³). We use 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u))
// = sigma: exact algebra, and unlike 1 + tanh(u) it does not cancel for negative x. With simd::exp (< 1.3 ulp)
// and one rounded division the result is within about 3 ulp of gelu in exact arithmetic. For the derivative,
// 0.5 sech²(u) = 2 sigma (1 - sigma), with 1 - sigma = e^(-2u) sigma (again no cancellation).

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

template <typename V>
STRATA_SIMD_INLINE V gelu_vec(const V& x) {
  const V u = kGeluS * (x + kGeluA * x * x * x);
  return x / (1.0f + simd::exp(-2.0f * u));
}

template <typename V>
STRATA_SIMD_INLINE V gelu_grad_vec(const V& x) {
  const V u = kGeluS * (x + kGeluA * x * x * x);
  const V e = simd::exp(-2.0f * u);
  const V sigma = 1.0f / (1.0f + e);
  const V one_minus_sigma = e * sigma;
  const V du = kGeluS * (1.0f + 3.0f * kGeluA * x * x);
  return sigma + 2.0f * x * sigma * one_minus_sigma * du;
}

template <int N>
struct GeluForwardSpan {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* out, const float* inp, size_t i0, size_t i1) {
    size_t i = i0;
    for (; i + N <= i1; i += N) simd::store(out + i, gelu_vec(simd::load<V>(inp + i)));
    if (i < i1) simd::store_n(out + i, gelu_vec(simd::load_n<V>(inp + i, i1 - i, 0.0f)), i1 - i);
  }
};

template <int N>
struct GeluBackwardSpan {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* dinp, const float* inp, const float* dout, size_t i0, size_t i1) {
    size_t i = i0;
    for (; i + N <= i1; i += N)
      simd::store(dinp + i, simd::load<V>(dinp + i) + gelu_grad_vec(simd::load<V>(inp + i)) * simd::load<V>(dout + i));
    if (i < i1) {
      const size_t n = i1 - i;
      const V g = gelu_grad_vec(simd::load_n<V>(inp + i, n, 0.0f)) * simd::load_n<V>(dout + i, n, 0.0f);
      simd::store_n(dinp + i, simd::load_n<V>(dinp + i, n, 0.0f) + g, n);
    }
  }
};

// Runs f(i0, i1) over [0, N) in fixed blocks of kElementsPerTask. Fixed, not TBB's adaptive split, so that an
// element takes the same path (full vector or partial tail) in every run.
template <typename Fn>
void for_blocks(size_t N, Fn&& f) {
  const size_t blocks = (N + kElementsPerTask - 1) / kElementsPerTask;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t k = r.begin(); k < r.end(); ++k) f(k * kElementsPerTask, std::min(N, (k + 1) * kElementsPerTask));
  });
}

// Rows per task for row-wise ops of width C: about kElementsPerTask elements, at least one row.
int rows_grain(int C) { return std::max<int>(1, static_cast<int>(kElementsPerTask / std::max(C, 1))); }

}  // namespace

// ---- encoder -----------------------------------------------------------------------------------------------

void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_start, int vocab_rows) {
  const int N = B * T;
  tbb::parallel_for(tbb::blocked_range<int>(0, N, rows_grain(C)), [&](const tbb::blocked_range<int>& r) {
    for (int bt = r.begin(); bt < r.end(); ++bt) {
      const int row = inp[bt] - vocab_start;
      const float* wte_ix = row >= 0 && row < vocab_rows ? wte + static_cast<size_t>(row) * C : nullptr;
      const float* wpe_t = wpe != nullptr ? wpe + static_cast<size_t>(bt % T) * C : nullptr;
      float* out_bt = out + static_cast<size_t>(bt) * C;
      if (wte_ix != nullptr && wpe_t != nullptr) {
        for (int i = 0; i < C; ++i) out_bt[i] = wte_ix[i] + wpe_t[i];
      } else if (wte_ix != nullptr || wpe_t != nullptr) {
        const float* one = wte_ix != nullptr ? wte_ix : wpe_t;
        for (int i = 0; i < C; ++i) out_bt[i] = one[i] + 0.0f;  // + 0 as the reference adds it (-0 becomes +0)
      } else {
        std::fill(out_bt, out_bt + C, 0.0f);
      }
    }
  });
}

// Rows that share a token id must be added to the same dwte row. Grouping rows by token (a stable sort keeps
// each group in increasing row order) lets tokens run in parallel while every dwte row receives exactly the
// additions of the sequential reference in its order: the result equals ref::encoder_backward<float> bit for
// bit. dwpe is parallel over t, summing over b in order, likewise exact.
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C,
                      int vocab_start, int vocab_rows) {
  std::vector<int32_t> rows;  // the positions whose token has a row here
  rows.reserve(static_cast<size_t>(B) * T);
  for (int32_t bt = 0; bt < B * T; ++bt)
    if (inp[bt] >= vocab_start && inp[bt] - vocab_start < vocab_rows) rows.push_back(bt);
  const int N = static_cast<int>(rows.size());
  std::stable_sort(rows.begin(), rows.end(), [&](int32_t a, int32_t b) { return inp[a] < inp[b]; });
  std::vector<int32_t> group_start;  // indices into rows where a new token begins, then N
  for (int i = 0; i < N; ++i)
    if (i == 0 || inp[rows[i]] != inp[rows[i - 1]]) group_start.push_back(i);
  group_start.push_back(N);
  const int groups = static_cast<int>(group_start.size()) - 1;

  tbb::parallel_for(tbb::blocked_range<int>(0, groups), [&](const tbb::blocked_range<int>& r) {
    for (int g = r.begin(); g < r.end(); ++g) {
      float* dwte_ix = dwte + static_cast<size_t>(inp[rows[group_start[g]]] - vocab_start) * C;
      for (int k = group_start[g]; k < group_start[g + 1]; ++k) {
        const float* dout_bt = dout + static_cast<size_t>(rows[k]) * C;
        for (int i = 0; i < C; ++i) dwte_ix[i] += dout_bt[i];
      }
    }
  });
  if (dwpe == nullptr) return;
  tbb::parallel_for(tbb::blocked_range<int>(0, T), [&](const tbb::blocked_range<int>& r) {
    for (int t = r.begin(); t < r.end(); ++t) {
      float* dwpe_t = dwpe + static_cast<size_t>(t) * C;
      for (int b = 0; b < B; ++b) {
        const float* dout_bt = dout + (static_cast<size_t>(b) * T + t) * C;
        for (int i = 0; i < C; ++i) dwpe_t[i] += dout_bt[i];
      }
    }
  });
}

// ---- layernorm ---------------------------------------------------------------------------------------------

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C) {
  tbb::parallel_for(tbb::blocked_range<int>(0, N, rows_grain(C)), [&](const tbb::blocked_range<int>& r) {
    simd::dispatch<LayernormForwardRows>(out, mean, rstd, inp, weight, bias, r.begin(), r.end(), C);
  });
}

// dweight and dbias sum over all N rows. Each fixed chunk of kLayernormRowsPerChunk rows sums into its own
// partial (C), and the partials are then added in chunk order: the same order whatever the thread count.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  const int chunks = (N + kLayernormRowsPerChunk - 1) / kLayernormRowsPerChunk;
  std::vector<float> partial(static_cast<size_t>(chunks) * 2 * C, 0.0f);  // (chunks, 2, C): dweight, dbias
  tbb::parallel_for(tbb::blocked_range<int>(0, chunks), [&](const tbb::blocked_range<int>& r) {
    for (int k = r.begin(); k < r.end(); ++k) {
      float* dweight_part = partial.data() + static_cast<size_t>(k) * 2 * C;
      const int n0 = k * kLayernormRowsPerChunk;
      const int n1 = std::min(N, n0 + kLayernormRowsPerChunk);
      simd::dispatch<LayernormBackwardRows>(dinp, dweight_part, dweight_part + C, dout, inp, weight, mean, rstd, n0, n1,
                                            C);
    }
  });
  // Columns are independent: split them across cores; each sums its chunks in order 0..chunks-1.
  tbb::parallel_for(tbb::blocked_range<int>(0, C, 256), [&](const tbb::blocked_range<int>& r) {
    for (int i = r.begin(); i < r.end(); ++i) {
      float w = 0.0f;
      float b = 0.0f;
      for (int k = 0; k < chunks; ++k) {
        w += partial[static_cast<size_t>(k) * 2 * C + i];
        b += partial[static_cast<size_t>(k) * 2 * C + C + i];
      }
      dweight[i] += w;
      dbias[i] += b;
    }
  });
}

// ---- RMSNorm -----------------------------------------------------------------------------------------------

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C, float eps) {
  tbb::parallel_for(tbb::blocked_range<int>(0, N, rows_grain(C)), [&](const tbb::blocked_range<int>& r) {
    simd::dispatch<RmsnormForwardRows>(out, rstd, inp, weight, r.begin(), r.end(), C, eps);
  });
}

// dweight sums over all N rows in fixed chunks, added in chunk order (as layernorm_backward).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int N, int C) {
  const int chunks = (N + kLayernormRowsPerChunk - 1) / kLayernormRowsPerChunk;
  std::vector<float> partial(static_cast<size_t>(chunks) * C, 0.0f);  // (chunks, C)
  tbb::parallel_for(tbb::blocked_range<int>(0, chunks), [&](const tbb::blocked_range<int>& r) {
    for (int k = r.begin(); k < r.end(); ++k) {
      const int n0 = k * kLayernormRowsPerChunk;
      const int n1 = std::min(N, n0 + kLayernormRowsPerChunk);
      simd::dispatch<RmsnormBackwardRows>(dinp, partial.data() + static_cast<size_t>(k) * C, dout, inp, weight, rstd,
                                          n0, n1, C);
    }
  });
  tbb::parallel_for(tbb::blocked_range<int>(0, C, 256), [&](const tbb::blocked_range<int>& r) {
    for (int i = r.begin(); i < r.end(); ++i) {
      float w = 0.0f;
      for (int k = 0; k < chunks; ++k) w += partial[static_cast<size_t>(k) * C + i];
      dweight[i] += w;
    }
  });
}

// ---- QK-norm ------------------------------------------------------------------------------------------------
// Rows across cores, each head through the RMSNorm rows above (C = hs); the weights' gradients in fixed chunks
// of rows, added in chunk order, so the result does not depend on the threading.

void qk_norm_forward(float* out, float* rstd, const float* inp, const float* qweight, const float* kweight, int N,
                     int NH, int NKV, int hs, float eps) {
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs, heads = static_cast<size_t>(NH + NKV);
  tbb::parallel_for(tbb::blocked_range<int>(0, N, rows_grain(static_cast<int>(W))), [&](const tbb::blocked_range<int>& r) {
    for (int n = r.begin(); n < r.end(); ++n) {
      const size_t row = static_cast<size_t>(n) * W;
      for (size_t h = 0; h < heads; ++h) {
        const size_t at = row + h * hs;
        simd::dispatch<RmsnormForwardRows>(out + at, rstd + n * heads + h, inp + at,
                                           h < static_cast<size_t>(NH) ? qweight : kweight, 0, 1, hs, eps);
      }
      std::memcpy(out + row + heads * hs, inp + row + heads * hs, sizeof(float) * NKV * hs);
    }
  });
}

void qk_norm_backward(float* dinp, float* dqweight, float* dkweight, const float* dout, const float* inp,
                      const float* qweight, const float* kweight, const float* rstd, int N, int NH, int NKV, int hs) {
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs, heads = static_cast<size_t>(NH + NKV);
  const int chunks = (N + kLayernormRowsPerChunk - 1) / kLayernormRowsPerChunk;
  std::vector<float> partial(static_cast<size_t>(chunks) * 2 * hs, 0.0f);  // (chunks, [dq | dk])
  tbb::parallel_for(tbb::blocked_range<int>(0, chunks), [&](const tbb::blocked_range<int>& r) {
    std::vector<float> dy(static_cast<size_t>(hs));
    for (int k = r.begin(); k < r.end(); ++k) {
      float* part = partial.data() + static_cast<size_t>(k) * 2 * hs;
      const int n1 = std::min(N, (k + 1) * kLayernormRowsPerChunk);
      for (int n = k * kLayernormRowsPerChunk; n < n1; ++n) {
        const size_t row = static_cast<size_t>(n) * W;
        for (size_t h = 0; h < heads; ++h) {
          const size_t at = row + h * hs;
          const bool q = h < static_cast<size_t>(NH);
          std::memcpy(dy.data(), dout + at, sizeof(float) * hs);  // dinp may be dout
          std::fill(dinp + at, dinp + at + hs, 0.0f);
          simd::dispatch<RmsnormBackwardRows>(dinp + at, part + (q ? 0 : hs), dy.data(), inp + at,
                                              q ? qweight : kweight, rstd + n * heads + h, 0, 1, hs);
        }
        if (dinp != dout) std::memcpy(dinp + row + heads * hs, dout + row + heads * hs, sizeof(float) * NKV * hs);
      }
    }
  });
  for (int i = 0; i < 2 * hs; ++i) {
    float w = 0.0f;
    for (int k = 0; k < chunks; ++k) w += partial[static_cast<size_t>(k) * 2 * hs + i];
    (i < hs ? dqweight[i] : dkweight[i - hs]) += w;
  }
}

// ---- RoPE --------------------------------------------------------------------------------------------------
// Memory-bound: rows across cores, plain loops the compiler vectorises; each element's arithmetic is the
// reference's.

namespace {

template <bool kInverse>
void rope(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs) {
  const int half = hs / 2;
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs;
  const auto rows = [&](const tbb::blocked_range<int>& r) {
    for (int bt = r.begin(); bt < r.end(); ++bt) {
      const float* c = cos + static_cast<size_t>(bt % T) * half;
      const float* sn = sin + static_cast<size_t>(bt % T) * half;
      for (int h = 0; h < NH + NKV; ++h) {
        float* x = qkv + static_cast<size_t>(bt) * W + static_cast<size_t>(h) * hs;
        for (int i = 0; i < half; ++i) {
          const float s = kInverse ? -sn[i] : sn[i];  // the backward: the rotation by the opposite angle
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s;
          x[i + half] = x2 * c[i] + x1 * s;
        }
      }
    }
  };
  tbb::parallel_for(tbb::blocked_range<int>(0, B * T, rows_grain(static_cast<int>(W))), rows);
}

}  // namespace

void rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs) {
  rope<false>(qkv, cos, sin, B, T, NH, NKV, hs);
}

void rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs) {
  rope<true>(dqkv, cos, sin, B, T, NH, NKV, hs);
}

// ---- SwiGLU ------------------------------------------------------------------------------------------------

void swiglu_forward(float* out, const float* inp, int N, int H) {
  tbb::parallel_for(tbb::blocked_range<int>(0, N, rows_grain(2 * H)), [&](const tbb::blocked_range<int>& r) {
    for (int n = r.begin(); n < r.end(); ++n) {
      const float* gate = inp + static_cast<size_t>(n) * 2 * H;
      simd::dispatch<SwigluForwardRow>(out + static_cast<size_t>(n) * H, gate, gate + H, H);
    }
  });
}

void swiglu_backward(float* dinp, const float* dout, const float* inp, int N, int H) {
  tbb::parallel_for(tbb::blocked_range<int>(0, N, rows_grain(2 * H)), [&](const tbb::blocked_range<int>& r) {
    for (int n = r.begin(); n < r.end(); ++n) {
      const float* gate = inp + static_cast<size_t>(n) * 2 * H;
      float* dgate = dinp + static_cast<size_t>(n) * 2 * H;
      simd::dispatch<SwigluBackwardRow>(dgate, dgate + H, dout + static_cast<size_t>(n) * H, gate, gate + H, H);
    }
  });
}

// ---- GELU --------------------------------------------------------------------------------------------------

void gelu_forward(float* out, const float* inp, size_t N) {
  for_blocks(N, [&](size_t i0, size_t i1) { simd::dispatch<GeluForwardSpan>(out, inp, i0, i1); });
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N) {
  for_blocks(N, [&](size_t i0, size_t i1) { simd::dispatch<GeluBackwardSpan>(dinp, inp, dout, i0, i1); });
}

// ---- residual ----------------------------------------------------------------------------------------------

void residual_forward(float* out, const float* inp1, const float* inp2, size_t N) {
  for_blocks(N, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) out[i] = inp1[i] + inp2[i];
  });
}

void residual_backward(float* dinp1, float* dinp2, const float* dout, size_t N) {
  for_blocks(N, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) {
      dinp1[i] += dout[i];
      dinp2[i] += dout[i];
    }
  });
}

}  // namespace strata::kernels::cpu::fast
