// reference.h — the plain CPU reference of every op but matmul (reference_matmul.h has that one).
//
// Single-threaded loops written to be obviously correct, in the manner of llm.c's train_gpt2.c; the fast CPU
// and CUDA kernels are tested against them. Templates on the element type F: instantiated at float for the
// "cpu-reference" KernelSet and at double by the tests as the float64 oracle. All arithmetic is in F; the only
// exception is AdamW's per-step scalars (bias corrections, step size), computed in double as PyTorch does.
// Names, arguments and semantics are the KernelSet slots' (kernels/kernels.h) with float replaced by F:
// backward functions accumulate (+=) into gradients, except softmax_crossentropy_backward, which overwrites.
// Stateless; safe to call from any thread on disjoint outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <vector>

#include "kernels/kernels.h"

namespace strata::kernels::cpu::ref {

// ---- encoder -----------------------------------------------------------------------------------------------

// out (B,T,C) = wte[inp[b,t] - vocab_start] + wpe[t]; a token outside the rows, or a null wpe, adds nothing.
template <typename F>
void encoder_forward(F* out, const int32_t* inp, const F* wte, const F* wpe, int B, int T, int C, int vocab_start,
                     int vocab_rows) {
  for (size_t bt = 0; bt < static_cast<size_t>(B) * T; ++bt) {
    const int row = inp[bt] - vocab_start;
    const F* wte_ix = row >= 0 && row < vocab_rows ? wte + static_cast<size_t>(row) * C : nullptr;
    const F* wpe_t = wpe != nullptr ? wpe + (bt % T) * C : nullptr;
    F* out_bt = out + bt * C;
    for (int i = 0; i < C; ++i) out_bt[i] = (wte_ix ? wte_ix[i] : F(0)) + (wpe_t ? wpe_t[i] : F(0));
  }
}

template <typename F>
void encoder_backward(F* dwte, F* dwpe, const F* dout, const int32_t* inp, int B, int T, int C, int vocab_start,
                      int vocab_rows) {
  for (size_t bt = 0; bt < static_cast<size_t>(B) * T; ++bt) {
    const F* dout_bt = dout + bt * C;
    const int row = inp[bt] - vocab_start;
    if (row >= 0 && row < vocab_rows) {
      F* dwte_ix = dwte + static_cast<size_t>(row) * C;
      for (int i = 0; i < C; ++i) dwte_ix[i] += dout_bt[i];
    }
    if (dwpe != nullptr) {
      F* dwpe_t = dwpe + (bt % T) * C;
      for (int i = 0; i < C; ++i) dwpe_t[i] += dout_bt[i];
    }
  }
}

// ---- layernorm ---------------------------------------------------------------------------------------------

// Biased variance and eps inside the square root, as torch.nn.LayerNorm.
template <typename F>
void layernorm_forward(F* out, F* mean, F* rstd, const F* inp, const F* weight, const F* bias, int N, int C) {
  const F eps = F(1e-5);
  for (int n = 0; n < N; ++n) {
    const F* x = inp + static_cast<size_t>(n) * C;
    F m = 0;
    for (int i = 0; i < C; ++i) m += x[i];
    m = m / C;
    F var = 0;
    for (int i = 0; i < C; ++i) {
      const F d = x[i] - m;
      var += d * d;
    }
    var = var / C;
    const F s = F(1) / std::sqrt(var + eps);
    F* out_n = out + static_cast<size_t>(n) * C;
    for (int i = 0; i < C; ++i) out_n[i] = s * (x[i] - m) * weight[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

template <typename F>
void layernorm_backward(F* dinp, F* dweight, F* dbias, const F* dout, const F* inp, const F* weight, const F* mean,
                        const F* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const F* x = inp + static_cast<size_t>(n) * C;
    const F* dout_n = dout + static_cast<size_t>(n) * C;
    F* dinp_n = dinp + static_cast<size_t>(n) * C;
    const F m = mean[n];
    const F s = rstd[n];
    // The two reductions the input gradient needs: mean of dnorm and of dnorm * norm.
    F dnorm_mean = 0;
    F dnorm_norm_mean = 0;
    for (int i = 0; i < C; ++i) {
      const F norm = (x[i] - m) * s;
      const F dnorm = weight[i] * dout_n[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = dnorm_mean / C;
    dnorm_norm_mean = dnorm_norm_mean / C;
    for (int i = 0; i < C; ++i) {
      const F norm = (x[i] - m) * s;
      const F dnorm = weight[i] * dout_n[i];
      dbias[i] += dout_n[i];
      dweight[i] += norm * dout_n[i];
      dinp_n[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

// ---- RMSNorm (the Llama family's) --------------------------------------------------------------------------

// out (N,C) = weight * (inp * rstd), rstd (N) = 1 / sqrt(mean(inp²) + eps): transformers' LlamaRMSNorm in fp32.
template <typename F>
void rmsnorm_forward(F* out, F* rstd, const F* inp, const F* weight, int N, int C, float eps) {
  for (int n = 0; n < N; ++n) {
    const F* x = inp + static_cast<size_t>(n) * C;
    F* y = out + static_cast<size_t>(n) * C;
    F ss = 0;
    for (int i = 0; i < C; ++i) ss += x[i] * x[i];
    const F s = F(1) / std::sqrt(ss / C + F(eps));
    for (int i = 0; i < C; ++i) y[i] = weight[i] * (x[i] * s);
    rstd[n] = s;
  }
}

// With n = inp * rstd: dweight += dout * n; dinp += rstd * (g - n * mean(g * n)), g = dout * weight.
template <typename F>
void rmsnorm_backward(F* dinp, F* dweight, const F* dout, const F* inp, const F* weight, const F* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const F* x = inp + static_cast<size_t>(n) * C;
    const F* dy = dout + static_cast<size_t>(n) * C;
    F* dx = dinp + static_cast<size_t>(n) * C;
    const F s = rstd[n];
    F gn = 0;
    for (int i = 0; i < C; ++i) gn += dy[i] * weight[i] * (x[i] * s);
    gn = gn / C;
    for (int i = 0; i < C; ++i) {
      const F norm = x[i] * s;
      dweight[i] += dy[i] * norm;
      dx[i] += s * (dy[i] * weight[i] - norm * gn);
    }
  }
}

// QK-norm: rmsnorm_forward over each query head (qweight) and key head (kweight) of the rows of qkv
// (N, (NH + 2 NKV) hs), the value heads copied; rstd (N, NH + NKV).
template <typename F>
void qk_norm_forward(F* out, F* rstd, const F* inp, const F* qweight, const F* kweight, int N, int NH, int NKV,
                     int hs, float eps) {
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs;
  for (int n = 0; n < N; ++n) {
    const size_t row = static_cast<size_t>(n) * W;
    for (int h = 0; h < NH + NKV; ++h) {
      const size_t at = row + static_cast<size_t>(h) * hs;
      rmsnorm_forward(out + at, rstd + static_cast<size_t>(n) * (NH + NKV) + h, inp + at, h < NH ? qweight : kweight,
                      1, hs, eps);
    }
    const size_t v = row + static_cast<size_t>(NH + NKV) * hs;
    std::copy(inp + v, inp + row + W, out + v);
  }
}

// Its backward, dinp overwritten (dout may be dinp): each head through rmsnorm_backward, the value heads'
// gradient passed through.
template <typename F>
void qk_norm_backward(F* dinp, F* dqweight, F* dkweight, const F* dout, const F* inp, const F* qweight,
                      const F* kweight, const F* rstd, int N, int NH, int NKV, int hs) {
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs;
  std::vector<F> dy(static_cast<size_t>(hs));
  for (int n = 0; n < N; ++n) {
    const size_t row = static_cast<size_t>(n) * W;
    for (int h = 0; h < NH + NKV; ++h) {
      const size_t at = row + static_cast<size_t>(h) * hs;
      std::copy(dout + at, dout + at + hs, dy.begin());
      std::fill(dinp + at, dinp + at + hs, F(0));
      rmsnorm_backward(dinp + at, h < NH ? dqweight : dkweight, dy.data(), inp + at, h < NH ? qweight : kweight,
                       rstd + static_cast<size_t>(n) * (NH + NKV) + h, 1, hs);
    }
    const size_t v = row + static_cast<size_t>(NH + NKV) * hs;
    if (dinp != dout) std::copy(dout + v, dout + row + W, dinp + v);
  }
}

// ---- attention ---------------------------------------------------------------------------------------------

// Row (b,t) of qkv (B,T,W), W = C + 2 NKV hs, holds NH query heads, then NKV key heads, then NKV value heads, of
// hs = C/NH; query head h reads key and value head h / (NH/NKV). att (B,NH,T,T).
template <typename F>
void attention_forward(F* out, F* att, const F* qkv, int B, int T, int C, int NH, int NKV,
                       MatmulPrecision = MatmulPrecision::kF32) {  // fp32 arithmetic whatever the precision
  const int hs = C / NH, group = NH / NKV;
  const size_t W = static_cast<size_t>(C) + 2 * static_cast<size_t>(NKV) * hs;
  const F scale = F(1) / std::sqrt(F(hs));
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < NH; ++h) {
        const size_t k_at = C + static_cast<size_t>(h / group) * hs, v_at = k_at + static_cast<size_t>(NKV) * hs;
        const F* q = qkv + (static_cast<size_t>(b) * T + t) * W + h * hs;
        F* att_row = att + ((static_cast<size_t>(b) * NH + h) * T + t) * T;
        // Scores, kept in the att row until they become probabilities.
        F maxval = std::numeric_limits<F>::lowest();
        for (int t2 = 0; t2 <= t; ++t2) {
          const F* k = qkv + (static_cast<size_t>(b) * T + t2) * W + k_at;
          F dot = 0;
          for (int i = 0; i < hs; ++i) dot += q[i] * k[i];
          dot *= scale;
          if (dot > maxval) maxval = dot;
          att_row[t2] = dot;
        }
        F expsum = 0;
        for (int t2 = 0; t2 <= t; ++t2) {
          const F e = std::exp(att_row[t2] - maxval);
          expsum += e;
          att_row[t2] = e;
        }
        const F expsum_inv = F(1) / expsum;
        for (int t2 = 0; t2 < T; ++t2) att_row[t2] = t2 <= t ? att_row[t2] * expsum_inv : F(0);

        F* out_bth = out + (static_cast<size_t>(b) * T + t) * C + h * hs;
        for (int i = 0; i < hs; ++i) out_bth[i] = 0;
        for (int t2 = 0; t2 <= t; ++t2) {
          const F* v = qkv + (static_cast<size_t>(b) * T + t2) * W + v_at;
          for (int i = 0; i < hs; ++i) out_bth[i] += att_row[t2] * v[i];
        }
      }
    }
  }
}

template <typename F>
void attention_backward(F* dqkv, const F* dout, const F* qkv, const F* att, int B, int T, int C, int NH, int NKV,
                        MatmulPrecision = MatmulPrecision::kF32) {
  const int hs = C / NH, group = NH / NKV;
  const size_t W = static_cast<size_t>(C) + 2 * static_cast<size_t>(NKV) * hs;
  const F scale = F(1) / std::sqrt(F(hs));
  std::fill(dqkv, dqkv + static_cast<size_t>(B) * T * W, F(0));  // overwritten: the sums below start at zero
  std::vector<F> datt(T);     // d loss / d att[t2] for the current row
  std::vector<F> dpreatt(T);  // d loss / d score[t2]
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < NH; ++h) {
        const size_t k_at = C + static_cast<size_t>(h / group) * hs, v_at = k_at + static_cast<size_t>(NKV) * hs;
        const size_t row = (static_cast<size_t>(b) * T + t) * W + h * hs;
        const F* q = qkv + row;
        F* dq = dqkv + row;
        const F* att_row = att + ((static_cast<size_t>(b) * NH + h) * T + t) * T;
        const F* dout_bth = dout + (static_cast<size_t>(b) * T + t) * C + h * hs;

        // out = sum_t2 att[t2] v[t2]
        for (int t2 = 0; t2 <= t; ++t2) {
          const size_t row2 = (static_cast<size_t>(b) * T + t2) * W + v_at;
          const F* v = qkv + row2;
          F* dv = dqkv + row2;
          F d = 0;
          for (int i = 0; i < hs; ++i) {
            d += v[i] * dout_bth[i];
            dv[i] += att_row[t2] * dout_bth[i];
          }
          datt[t2] = d;
        }
        // softmax: dscore[t2] = att[t2] * (datt[t2] - sum_t3 att[t3] datt[t3])
        F dot = 0;
        for (int t2 = 0; t2 <= t; ++t2) dot += att_row[t2] * datt[t2];
        for (int t2 = 0; t2 <= t; ++t2) dpreatt[t2] = att_row[t2] * (datt[t2] - dot);
        // score[t2] = scale * q . k[t2]
        for (int t2 = 0; t2 <= t; ++t2) {
          const size_t row2 = (static_cast<size_t>(b) * T + t2) * W + k_at;
          const F* k = qkv + row2;
          F* dk = dqkv + row2;
          const F g = dpreatt[t2] * scale;
          for (int i = 0; i < hs; ++i) {
            dq[i] += k[i] * g;
            dk[i] += q[i] * g;
          }
        }
      }
    }
  }
}

inline size_t attention_saved_floats(int B, int T, int /*C*/, int NH, MatmulPrecision) {
  return static_cast<size_t>(B) * NH * T * T;
}

// ---- GELU (tanh approximation, as torch.nn.functional.gelu(approximate='tanh')) -------------------------

template <typename F>
void gelu_forward(F* out, const F* inp, size_t N) {
  const F s = std::sqrt(F(2) / std::numbers::pi_v<F>);
  for (size_t i = 0; i < N; ++i) {
    const F x = inp[i];
    const F cube = F(0.044715) * x * x * x;
    out[i] = F(0.5) * x * (F(1) + std::tanh(s * (x + cube)));
  }
}

template <typename F>
void gelu_backward(F* dinp, const F* inp, const F* dout, size_t N) {
  const F s = std::sqrt(F(2) / std::numbers::pi_v<F>);
  for (size_t i = 0; i < N; ++i) {
    const F x = inp[i];
    const F cube = F(0.044715) * x * x * x;
    const F th = std::tanh(s * (x + cube));
    const F sech2 = F(1) - th * th;
    const F local_grad = F(0.5) * (F(1) + th) + x * F(0.5) * sech2 * s * (F(1) + F(3) * F(0.044715) * x * x);
    dinp[i] += local_grad * dout[i];
  }
}

// ---- RoPE (rotary position embedding, in transformers' rotate-half layout) ---------------------------------

// In place on the q and k heads of qkv (B,T,W), W = (NH + 2 NKV) hs: each row holds NH query heads, NKV key
// heads and NKV value heads of hs elements; the first NH + NKV are rotated. For a row at position t and i < hs/2,
// (x_i, x_{i+hs/2}) becomes (x_i c − x_{i+hs/2} s, x_{i+hs/2} c + x_i s), c = cos[t][i], s = sin[t][i] (tables of
// (T, hs/2)): q·cos + rotate_half(q)·sin of apply_rotary_pos_emb. `inverse`: by the opposite angle (s = −sin).
template <typename F>
void rope_rotate(F* qkv, const F* cos, const F* sin, int B, int T, int NH, int NKV, int hs, bool inverse) {
  const int half = hs / 2;
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const F* c = cos + static_cast<size_t>(t) * half;
      const F* sn = sin + static_cast<size_t>(t) * half;
      for (int h = 0; h < NH + NKV; ++h) {
        F* x = qkv + (static_cast<size_t>(b) * T + t) * W + static_cast<size_t>(h) * hs;
        for (int i = 0; i < half; ++i) {
          const F s = inverse ? -sn[i] : sn[i];
          const F x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s;
          x[i + half] = x2 * c[i] + x1 * s;
        }
      }
    }
}

template <typename F>
void rope_forward(F* qkv, const F* cos, const F* sin, int B, int T, int NH, int NKV, int hs) {
  rope_rotate(qkv, cos, sin, B, T, NH, NKV, hs, /*inverse=*/false);
}

// The transpose, in place on dqkv's q and k heads: the rotation by the opposite angle, (g_i c + g_{i+hs/2} s,
// g_{i+hs/2} c − g_i s). The value heads are left as they are.
template <typename F>
void rope_backward(F* dqkv, const F* cos, const F* sin, int B, int T, int NH, int NKV, int hs) {
  rope_rotate(dqkv, cos, sin, B, T, NH, NKV, hs, /*inverse=*/true);
}

// ---- SwiGLU ------------------------------------------------------------------------------------------------

// out (N,H) = silu(gate) * up, where each row of inp (N,2H) is [gate (H) | up (H)]: transformers' LlamaMLP
// act_fn(gate_proj(x)) * up_proj(x) with the two projections as one, silu(g) = g / (1 + e^-g).
template <typename F>
void swiglu_forward(F* out, const F* inp, int N, int H) {
  for (int n = 0; n < N; ++n) {
    const F* gate = inp + static_cast<size_t>(n) * 2 * H;
    const F* up = gate + H;
    F* y = out + static_cast<size_t>(n) * H;
    for (int i = 0; i < H; ++i) y[i] = gate[i] / (F(1) + std::exp(-gate[i])) * up[i];
  }
}

// dinp (N,2H) OVERWRITTEN: dgate = dout * up * silu'(gate), silu'(g) = σ(g) (1 + g (1 − σ(g))); dup = dout *
// silu(gate).
template <typename F>
void swiglu_backward(F* dinp, const F* dout, const F* inp, int N, int H) {
  for (int n = 0; n < N; ++n) {
    const F* gate = inp + static_cast<size_t>(n) * 2 * H;
    const F* up = gate + H;
    const F* dy = dout + static_cast<size_t>(n) * H;
    F* dgate = dinp + static_cast<size_t>(n) * 2 * H;
    F* dup = dgate + H;
    for (int i = 0; i < H; ++i) {
      const F sig = F(1) / (F(1) + std::exp(-gate[i]));
      dgate[i] = dy[i] * up[i] * sig * (F(1) + gate[i] * (F(1) - sig));
      dup[i] = dy[i] * gate[i] * sig;
    }
  }
}

// ---- residual ----------------------------------------------------------------------------------------------

template <typename F>
void residual_forward(F* out, const F* inp1, const F* inp2, size_t N) {
  for (size_t i = 0; i < N; ++i) out[i] = inp1[i] + inp2[i];
}

template <typename F>
void residual_backward(F* dinp1, F* dinp2, const F* dout, size_t N) {
  for (size_t i = 0; i < N; ++i) {
    dinp1[i] += dout[i];
    dinp2[i] += dout[i];
  }
}

// ---- fused softmax + cross-entropy -------------------------------------------------------------------------

// losses (N) = lse - logits[target - vocab_start] (0 for a target not among the columns); lse (N) = log sum exp
// of the row, saved for every row (ignored ones too).
template <typename F>
void softmax_crossentropy_forward(F* losses, F* lse, const F* logits, const int32_t* targets, int N, int V,
                                  int vocab_start) {
  for (int n = 0; n < N; ++n) {
    const F* row = logits + static_cast<size_t>(n) * V;
    F maxval = std::numeric_limits<F>::lowest();
    for (int v = 0; v < V; ++v)
      if (row[v] > maxval) maxval = row[v];
    F sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(row[v] - maxval);
    const F l = maxval + std::log(sum);
    lse[n] = l;
    const int col = targets[n] - vocab_start;
    losses[n] = targets[n] < 0 || col < 0 || col >= V ? F(0) : l - row[col];
  }
}

// dlogits (N,V) = (softmax - onehot(target)) * dlosses; overwrites. Each element is read before it is written,
// so dlogits may be logits.
template <typename F>
void softmax_crossentropy_backward(F* dlogits, const F* logits, const F* lse, const int32_t* targets, const F* dlosses,
                                   int N, int V, int vocab_start) {
  for (int n = 0; n < N; ++n) {
    const F* row = logits + static_cast<size_t>(n) * V;
    F* drow = dlogits + static_cast<size_t>(n) * V;
    const int target = targets[n] < 0 ? -1 : targets[n] - vocab_start;  // a column, or out of [0, V)
    for (int v = 0; v < V; ++v) {
      if (targets[n] < 0) {
        drow[v] = 0;
        continue;
      }
      const F p = std::exp(row[v] - lse[n]);
      const F indicator = v == target ? F(1) : F(0);
      drow[v] = (p - indicator) * dlosses[n];
    }
  }
}

// ---- AdamW -------------------------------------------------------------------------------------------------

// The operations of torch.optim.AdamW (PyTorch 1.13, single-tensor path), in its order:
//   p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g g;
//   p -= lr/bc1 * (m / (sqrt(v)/sqrt(bc2) + eps)),  with g = grad * grad_scale.
template <typename F>
void adamw_update(F* params, F* m, F* v, const F* grads, size_t n, const AdamWParams& hp) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(hp.beta1), hp.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(hp.beta2), hp.step);
  const F step_size = static_cast<F>(hp.lr / bc1);
  const F bc2_sqrt = static_cast<F>(std::sqrt(bc2));
  const F decay = static_cast<F>(1.0 - static_cast<double>(hp.lr) * hp.weight_decay);
  const F b1 = hp.beta1;
  const F b2 = hp.beta2;
  const F eps = hp.eps;
  const F grad_scale = hp.grad_scale;
  for (size_t i = 0; i < n; ++i) {
    const F g = grads[i] * grad_scale;
    const F mi = b1 * m[i] + (F(1) - b1) * g;
    const F vi = b2 * v[i] + (F(1) - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const F p = params[i] * decay;
    params[i] = p - step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
  }
}

}  // namespace strata::kernels::cpu::ref
