// fast_attention.cpp — the fast CPU causal self-attention, forward and backward (declared in kernels/cpu/fast.h).
//
// One TBB task per (batch, query head) forward, per (batch, key/value head) backward (which runs the heads of its
// group in order, its keys' and values' gradients summed across them: grouped-query attention; a group of one
// is multi-head attention). A task first copies its head's keys and values out of the strided qkv rows into
// contiguous, zero-padded scratch (K transposed to (hs, T) for the forward, V transposed for the backward), then
// walks the queries in blocks of kRows: every key or value vector loaded feeds kRows multiply-adds into register
// accumulators, which is what keeps the inner loops off the load ports. Scratch is per task, O(T * hs), never
// O(B * NH * T * T). Tasks write disjoint parts of out, att and dqkv, and each sums in a fixed order (the
// blocking is fixed too), so results repeat bit for bit whatever the scheduling.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "kernels/cpu/fast.h"
#include "kernels/cpu/fast_simd.h"

namespace strata::kernels::cpu::fast {
namespace {

constexpr int kRows = 8;                   // query rows per block: 16 score accumulators (8 rows x 2 key vectors)
constexpr int kPad = 2 * simd::kMaxLanes;  // T is padded to a multiple of every clone's score tile (2 vectors)

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// One (b, h) task's view of qkv (B,T,W), W = C + 2 NKV hs, and its padded sizes.
struct Head {
  const float* qkv;  // row (b, 0) of qkv
  int T;
  int hs;
  size_t C;
  size_t W;                 // a row of qkv
  size_t q_at, k_at, v_at;  // where query head h, and the key and value head it reads, sit in a row
  size_t t_pad;             // T rounded up to kPad: row length of transposed K/V and of score rows
  size_t hs_pad;            // hs rounded up to kMaxLanes: row length of K/V copies and of q/dout rows
  float scale;              // 1/sqrt(hs)

  const float* q(int t) const { return qkv + static_cast<size_t>(t) * W + q_at; }
  const float* k(int t) const { return qkv + static_cast<size_t>(t) * W + k_at; }
  const float* v(int t) const { return qkv + static_cast<size_t>(t) * W + v_at; }
};

Head make_head(const float* qkv, int b, int h, int T, int C, int NH, int NKV) {
  Head hd;
  hd.T = T;
  hd.hs = C / NH;
  hd.C = C;
  hd.W = static_cast<size_t>(C) + 2 * static_cast<size_t>(NKV) * hd.hs;
  hd.qkv = qkv + static_cast<size_t>(b) * T * hd.W;
  hd.q_at = static_cast<size_t>(h) * hd.hs;
  hd.k_at = static_cast<size_t>(C) + static_cast<size_t>(h / (NH / NKV)) * hd.hs;
  hd.v_at = hd.k_at + static_cast<size_t>(NKV) * hd.hs;
  hd.t_pad = round_up(T, kPad);
  hd.hs_pad = round_up(hd.hs, simd::kMaxLanes);
  hd.scale = 1.0f / std::sqrt(static_cast<float>(hd.hs));
  return hd;
}

// rows (T, hs) at stride W -> dst (hs, t_pad), zero beyond T.
void transpose_head(float* dst, const float* src, const Head& hd) {
  std::fill(dst, dst + hd.hs * hd.t_pad, 0.0f);
  for (int t = 0; t < hd.T; ++t)
    for (int i = 0; i < hd.hs; ++i) dst[i * hd.t_pad + t] = src[static_cast<size_t>(t) * hd.W + i];
}

// `rows` rows at stride `stride` -> dst (rows, hs_pad), zero beyond hs; then zero rows up to `total`.
void copy_rows(float* dst, const float* src, size_t stride, int rows, int total, const Head& hd) {
  std::fill(dst, dst + total * hd.hs_pad, 0.0f);
  for (int t = 0; t < rows; ++t) std::copy_n(src + t * stride, hd.hs, dst + t * hd.hs_pad);
}

// s[r][j] = sum_i a[r][i] * mt[i][j] for r < kRows and j < round_up(n, 2 lanes): a (kRows, hs_pad), mt (hs, t_pad),
// s (kRows, t_pad). Every score is the same sum over i in increasing order, whatever its tile.
template <typename V>
STRATA_SIMD_INLINE void scores_block(float* s, const float* a, const float* mt, const Head& hd, int n) {
  constexpr int L = simd::kLanes<V>;
  for (int j = 0; j < n; j += 2 * L) {
    V acc[kRows][2] = {};
    for (int i = 0; i < hd.hs; ++i) {
      const float* row = mt + i * hd.t_pad + j;
      const V k0 = simd::load<V>(row);
      const V k1 = simd::load<V>(row + L);
      for (int r = 0; r < kRows; ++r) {
        const float ar = a[r * hd.hs_pad + i];
        acc[r][0] += ar * k0;
        acc[r][1] += ar * k1;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      simd::store(s + r * hd.t_pad + j, acc[r][0]);
      simd::store(s + r * hd.t_pad + j + L, acc[r][1]);
    }
  }
}

// y[r] = sum_{t2 < n} w[r][t2] * m[t2] for r < kRows: w (kRows, t_pad), m (n, hs_pad), y (kRows, hs_pad).
template <typename V>
STRATA_SIMD_INLINE void weighted_rows_block(float* y, const float* w, const float* m, const Head& hd, int n) {
  for (size_t c = 0; c < hd.hs_pad; c += simd::kLanes<V>) {
    V acc[kRows] = {};
    for (int t2 = 0; t2 < n; ++t2) {
      const V mv = simd::load<V>(m + t2 * hd.hs_pad + c);
      for (int r = 0; r < kRows; ++r) acc[r] += w[r * hd.t_pad + t2] * mv;
    }
    for (int r = 0; r < kRows; ++r) simd::store(y + r * hd.hs_pad + c, acc[r]);
  }
}

// m[t2] += w[0][t2] x[0] + ... + w[kRows-1][t2] x[kRows-1] (added in that order) for t2 < n: w (kRows, t_pad),
// x (kRows, hs_pad), m (n, hs_pad).
template <typename V>
STRATA_SIMD_INLINE void add_outer_block(float* m, const float* w, const float* x, const Head& hd, int n) {
  for (size_t c = 0; c < hd.hs_pad; c += simd::kLanes<V>) {
    V xr[kRows];
    for (int r = 0; r < kRows; ++r) xr[r] = simd::load<V>(x + r * hd.hs_pad + c);
    for (int t2 = 0; t2 < n; ++t2) {
      V acc = simd::load<V>(m + t2 * hd.hs_pad + c);
      for (int r = 0; r < kRows; ++r) acc += w[r * hd.t_pad + t2] * xr[r];
      simd::store(m + t2 * hd.hs_pad + c, acc);
    }
  }
}

// Row s[0..n) of raw q.k scores -> softmax(scale * s) in place, and zeros on [n, n_zero).
template <typename V>
STRATA_SIMD_INLINE void softmax_row(float* s, int n, int n_zero, float scale) {
  constexpr int L = simd::kLanes<V>;
  V vmax = simd::splat<V>(-INFINITY);
  int j = 0;
  for (; j + L <= n; j += L) vmax = simd::max(vmax, simd::load<V>(s + j));
  if (j < n) vmax = simd::max(vmax, simd::load_n<V>(s + j, n - j, -INFINITY));
  const float maxval = simd::hmax(vmax) * scale;  // scale > 0, so max(s) * scale rounds as max(s * scale)
  V vsum{};
  for (j = 0; j + L <= n; j += L) {
    const V e = simd::exp(simd::load<V>(s + j) * scale - maxval);
    simd::store(s + j, e);
    vsum += e;
  }
  if (j < n) {
    const V e = simd::exp(simd::load_n<V>(s + j, n - j, -INFINITY) * scale - maxval);
    simd::store_n(s + j, e, n - j);
    vsum += e;
  }
  const float inv = 1.0f / simd::hsum(vsum);
  for (j = 0; j + L <= n; j += L) simd::store(s + j, simd::load<V>(s + j) * inv);
  for (; j < n; ++j) s[j] *= inv;
  std::fill(s + n, s + n_zero, 0.0f);
}

// out (T, C) for head h of one batch row; att (T, T) of (b, h).
template <int N>
struct ForwardHead {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* out, float* att, const Head* hdp, float* scratch) {
    const Head& hd = *hdp;
    const int T = hd.T;
    float* kt = scratch;                // (hs, t_pad) K transposed
    float* vc = kt + hd.hs * hd.t_pad;  // (T, hs_pad) V
    float* s = vc + T * hd.hs_pad;      // (kRows, t_pad) scores, then probabilities, of a block of queries
    float* qb = s + kRows * hd.t_pad;   // (kRows, hs_pad) the block's queries
    float* y = qb + kRows * hd.hs_pad;  // (kRows, hs_pad) the block's outputs
    transpose_head(kt, hd.k(0), hd);
    copy_rows(vc, hd.v(0), hd.W, T, T, hd);
    for (int t0 = 0; t0 < T; t0 += kRows) {
      const int rows = std::min(kRows, T - t0);
      const int n_max = t0 + rows;  // causal: the block's last query sees keys 0..n_max-1
      copy_rows(qb, hd.q(t0), hd.W, rows, kRows, hd);
      scores_block<V>(s, qb, kt, hd, n_max);
      for (int r = 0; r < kRows; ++r) {
        float* sr = s + r * hd.t_pad;
        if (r < rows)
          softmax_row<V>(sr, t0 + r + 1, n_max, hd.scale);
        else
          std::fill(sr, sr + n_max, 0.0f);
      }
      for (int r = 0; r < rows; ++r) {
        float* att_row = att + static_cast<size_t>(t0 + r) * T;
        std::copy_n(s + r * hd.t_pad, n_max, att_row);
        std::fill(att_row + n_max, att_row + T, 0.0f);
      }
      weighted_rows_block<V>(y, s, vc, hd, n_max);
      for (int r = 0; r < rows; ++r) std::copy_n(y + r * hd.hs_pad, hd.hs, out + static_cast<size_t>(t0 + r) * hd.C);
    }
  }
};

// dqkv (T, W) for query head h of one batch row: its columns of q, written once, and of the key and value head
// it reads, summed in scratch over the heads of the group (`first` starts the sums, `last` writes them; the same
// scratch across the group); att (T, T) of (b, h); dout (T, C).
template <int N>
struct BackwardHead {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* dqkv, const float* dout, const float* att, const Head* hdp,
                                     float* scratch, bool first, bool last) {
    const Head& hd = *hdp;
    const int T = hd.T;
    const size_t hs_pad = hd.hs_pad;
    float* vt = scratch;                // (hs, t_pad) V transposed
    float* kc = vt + hd.hs * hd.t_pad;  // (T, hs_pad) K
    float* dk = kc + T * hs_pad;        // (T, hs_pad) this task's dK, added to dqkv at the end
    float* dv = dk + T * hs_pad;        // (T, hs_pad) dV, likewise
    float* p = dv + T * hs_pad;         // (kRows, t_pad) probabilities of a block of queries
    float* ds = p + kRows * hd.t_pad;   // (kRows, t_pad) d loss / d att, then d loss / d score (times scale)
    float* go = ds + kRows * hd.t_pad;  // (kRows, hs_pad) dout rows
    float* qb = go + kRows * hs_pad;    // (kRows, hs_pad) q rows
    float* dq = qb + kRows * hs_pad;    // (kRows, hs_pad)
    if (first) {  // the group's key and value head: the same for each of its query heads
      transpose_head(vt, hd.v(0), hd);
      copy_rows(kc, hd.k(0), hd.W, T, T, hd);
      std::fill(dk, dk + 2 * T * hs_pad, 0.0f);
    }
    for (int t0 = 0; t0 < T; t0 += kRows) {
      const int rows = std::min(kRows, T - t0);
      const int n_max = t0 + rows;
      for (int r = 0; r < kRows; ++r) {
        float* pr = p + r * hd.t_pad;
        const int n = r < rows ? t0 + r + 1 : 0;
        if (n > 0) std::copy_n(att + static_cast<size_t>(t0 + r) * T, n, pr);
        std::fill(pr + n, pr + n_max, 0.0f);
      }
      copy_rows(go, dout + static_cast<size_t>(t0) * hd.C, hd.C, rows, kRows, hd);
      copy_rows(qb, hd.q(t0), hd.W, rows, kRows, hd);
      // out[t] = sum_t2 p[t2] v[t2]:  datt[t2] = dout . v[t2],  dv[t2] += p[t2] dout
      scores_block<V>(ds, go, vt, hd, n_max);
      add_outer_block<V>(dv, p, go, hd, n_max);
      // softmax: dscore[t2] = p[t2] (datt[t2] - sum p datt), with the scores' 1/sqrt(hs) folded in; zero beyond t
      for (int r = 0; r < rows; ++r) {
        const int n = t0 + r + 1;
        const float* pr = p + r * hd.t_pad;
        float* dr = ds + r * hd.t_pad;
        V acc{};
        int j = 0;
        for (; j + N <= n; j += N) acc += simd::load<V>(pr + j) * simd::load<V>(dr + j);
        float dot = simd::hsum(acc);
        for (; j < n; ++j) dot += pr[j] * dr[j];
        for (j = 0; j + N <= n; j += N)
          simd::store(dr + j, simd::load<V>(pr + j) * (simd::load<V>(dr + j) - dot) * hd.scale);
        for (; j < n; ++j) dr[j] = pr[j] * (dr[j] - dot) * hd.scale;
        std::fill(dr + n, dr + n_max, 0.0f);
      }
      // score[t2] = scale q . k[t2]:  dq += dscore[t2] k[t2],  dk[t2] += dscore[t2] q
      weighted_rows_block<V>(dq, ds, kc, hd, n_max);
      add_outer_block<V>(dk, ds, qb, hd, n_max);
      for (int r = 0; r < rows; ++r) {
        float* dq_out = dqkv + static_cast<size_t>(t0 + r) * hd.W + hd.q_at;
        std::copy_n(dq + r * hs_pad, hd.hs, dq_out);
      }
    }
    if (!last) return;
    for (int t = 0; t < T; ++t) {
      float* row = dqkv + static_cast<size_t>(t) * hd.W;
      std::copy_n(dk + t * hs_pad, hd.hs, row + hd.k_at);
      std::copy_n(dv + t * hs_pad, hd.hs, row + hd.v_at);
    }
  }
};

}  // namespace

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, int NKV,
                       MatmulPrecision) {
  tbb::parallel_for(tbb::blocked_range<int>(0, B * NH, 1), [&](const tbb::blocked_range<int>& r) {
    for (int bh = r.begin(); bh < r.end(); ++bh) {
      const int b = bh / NH;
      const int h = bh % NH;
      const Head hd = make_head(qkv, b, h, T, C, NH, NKV);
      std::vector<float> scratch(hd.hs * hd.t_pad + T * hd.hs_pad + kRows * (hd.t_pad + 2 * hd.hs_pad));
      float* out_bh = out + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hd.hs;
      float* att_bh = att + static_cast<size_t>(bh) * T * T;
      simd::dispatch<ForwardHead>(out_bh, att_bh, &hd, scratch.data());
    }
  });
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                        int NH, int NKV, MatmulPrecision) {
  const int group = NH / NKV;
  tbb::parallel_for(tbb::blocked_range<int>(0, B * NKV, 1), [&](const tbb::blocked_range<int>& r) {
    for (int bg = r.begin(); bg < r.end(); ++bg) {
      const int b = bg / NKV;
      std::vector<float> scratch;
      for (int h = bg % NKV * group; h < (bg % NKV + 1) * group; ++h) {
        const Head hd = make_head(qkv, b, h, T, C, NH, NKV);
        scratch.resize(hd.hs * hd.t_pad + 3 * T * hd.hs_pad + kRows * (2 * hd.t_pad + 3 * hd.hs_pad));
        const float* dout_bh = dout + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hd.hs;
        const float* att_bh = att + (static_cast<size_t>(b) * NH + h) * T * T;
        const bool first = h % group == 0, last = h % group == group - 1;
        simd::dispatch<BackwardHead>(dqkv + static_cast<size_t>(b) * T * hd.W, dout_bh, att_bh, &hd, scratch.data(),
                                     first, last);
      }
    }
  });
}

}  // namespace strata::kernels::cpu::fast
