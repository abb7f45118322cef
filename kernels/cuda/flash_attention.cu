// flash_attention.cu — causal attention without the T×T matrix (FlashAttention-2's algorithm) on the tensor
// cores through WMMA: bf16 operands, fp32 accumulation, fp32 softmax statistics.
//
// Forward: a block takes 64 query rows of one (batch, head), four warps of 16 rows each, and walks the key
// tiles up to the diagonal: S = Q Kᵀ (tensor cores) -> online softmax in fp32 (running max m and sum l per row,
// the output rescaled as m grows) -> O += P V with P rounded to bf16. It saves, per row, the log-sum-exp of the
// scaled scores and the output O itself (head layout, fp32), which the backward needs for D = rowsum(dO ∘ O).
//
// Backward, deterministic (no atomics): kernel 1 takes 64 keys per block, each warp 16 of them, and walks the
// query tiles from the diagonal down, accumulating its own rows of dV = Pᵀ dO and dK = dSᵀ Q; kernel 2 takes 64
// queries per block and accumulates dQ = dS K over the key tiles. P is recomputed from the saved log-sum-exp;
// dS = P ∘ (dP − D) with dP = dO Vᵀ. Every sum runs in an order fixed by the shapes.
#include <mma.h>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;     // query and key rows per tile
constexpr int kWarps = 4;     // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr int kPadH = 8;      // bf16 row padding (16 bytes): keeps WMMA pointers 32-byte aligned, spreads banks
constexpr int kPadF = 4;      // fp32 row padding

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;  // a row-major tile, transposed
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Rows [row0, row0 + 64) of a (T, HS) bf16 head slice into a shared tile with row stride HS + kPadH; rows past
// T are zeros. 16-byte loads.
template <int HS>
__device__ void load_tile(bf16* dst, const bf16* src, int row0, int T) {
  constexpr int kVecs = HS / 8;  // uint4 per row
  for (int i = threadIdx.x; i < kTile * kVecs; i += kThreads) {
    const int r = i / kVecs, c = (i % kVecs) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < T) v = *reinterpret_cast<const uint4*>(src + static_cast<size_t>(row0 + r) * HS + c);
    *reinterpret_cast<uint4*>(dst + r * (HS + kPadH) + c) = v;
  }
}

// The 16×64 product of a warp's 16 rows of `a` (row-major, stride lda) with the 64 rows of `b` transposed
// (row-major tile, stride ldb) over HS, stored row-major into `out` (stride kTile + kPadF).
template <int HS>
__device__ void warp_abt(float* out, const bf16* a, int lda, const bf16* b, int ldb) {
  for (int j = 0; j < kTile / 16; ++j) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < HS / 16; ++kk) {
      FragA fa;
      FragBT fb;
      wmma::load_matrix_sync(fa, a + kk * 16, lda);
      wmma::load_matrix_sync(fb, b + j * 16 * ldb + kk * 16, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + j * 16, acc, kTile + kPadF, wmma::mem_row_major);
  }
}

// acc (16×HS, fp32, row-major in shared memory, stride HS + kPadF) += p (16×64 bf16, stride kTile + kPadH) ·
// b (64×HS bf16 row-major, stride HS + kPadH).
template <int HS>
__device__ void warp_acc_pb(float* acc, const bf16* p, const bf16* b) {
  for (int n = 0; n < HS / 16; ++n) {
    FragC c;
    wmma::load_matrix_sync(c, acc + n * 16, HS + kPadF, wmma::mem_row_major);
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragA fa;
      FragB fb;
      wmma::load_matrix_sync(fa, p + kk * 16, kTile + kPadH);
      wmma::load_matrix_sync(fb, b + kk * 16 * (HS + kPadH) + n * 16, HS + kPadH);
      wmma::mma_sync(c, fa, fb, c);
    }
    wmma::store_matrix_sync(acc + n * 16, c, HS + kPadF, wmma::mem_row_major);
  }
}

// Shared memory of the forward, in bytes, for head size HS.
template <int HS>
constexpr size_t fwd_smem() {
  return 3 * kTile * (HS + kPadH) * sizeof(bf16)          // Q, K, V tiles
         + kTile * (kTile + kPadF) * sizeof(float)        // S
         + kTile * (kTile + kPadH) * sizeof(bf16)         // P
         + kTile * (HS + kPadF) * sizeof(float);          // O
}

// grid (ceil(T/64), B*NH). saved: lse (B*NH, T), then O (B*NH, T, HS) fp32.
template <int HS>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(float* out, float* lse_out, float* o_out, const bf16* q,
                                                             const bf16* k, const bf16* v, int T, int NH,
                                                             float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + kTile * (HS + kPadH);
  bf16* Vs = Ks + kTile * (HS + kPadH);
  float* Ss = reinterpret_cast<float*>(Vs + kTile * (HS + kPadH));
  bf16* Ps = reinterpret_cast<bf16*>(Ss + kTile * (kTile + kPadF));
  float* Os = reinterpret_cast<float*>(Ps + kTile * (kTile + kPadH));

  // The heaviest query tiles (most key tiles below the diagonal) first, so the last wave is the light ones.
  const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, q0 = qt * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t head = static_cast<size_t>(bh) * T * HS;
  load_tile<HS>(Qs, q + head, q0, T);
  for (int i = threadIdx.x; i < kTile * (HS + kPadF); i += kThreads) Os[i] = 0.0f;
  // Lanes 2r and 2r+1 own the warp's row r: columns [32*half, 32*half + 32) of S and P, and half of O's row.
  // Both keep the row's running max m and sum l, so a row needs one shuffle per reduction, not a warp's five.
  const int r = lane / 2, half = lane % 2;
  const int qi = q0 + warp * 16 + r;
  float m_run = -INFINITY, l_run = 0.0f;

  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous tile's K, V are no longer read
    load_tile<HS>(Ks, k + head, k0, T);
    load_tile<HS>(Vs, v + head, k0, T);
    __syncthreads();
    float* S = Ss + warp * 16 * (kTile + kPadF);
    bf16* P = Ps + warp * 16 * (kTile + kPadH);
    float* O = Os + warp * 16 * (HS + kPadF);
    warp_abt<HS>(S, Qs + warp * 16 * (HS + kPadH), HS + kPadH, Ks, HS + kPadH);
    __syncwarp();
    const float* srow = S + r * (kTile + kPadF) + 32 * half;
    float sv[32];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int kj = k0 + 32 * half + c;
      sv[c] = (kj <= qi && kj < T) ? srow[c] * scale : -INFINITY;
      mx = fmaxf(mx, sv[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m_run, mx);
    float sum = 0.0f;
    __nv_bfloat162* prow = reinterpret_cast<__nv_bfloat162*>(P + r * (kTile + kPadH) + 32 * half);
#pragma unroll
    for (int c = 0; c < 32; c += 2) {
      const float p0 = m_new == -INFINITY ? 0.0f : __expf(sv[c] - m_new);
      const float p1 = m_new == -INFINITY ? 0.0f : __expf(sv[c + 1] - m_new);
      sum += p0 + p1;
      prow[c / 2] = __floats2bfloat162_rn(p0, p1);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float alpha = m_new == -INFINITY ? 1.0f : __expf(m_run - m_new);
    l_run = l_run * alpha + sum;
    m_run = m_new;
    float* orow = O + r * (HS + kPadF) + (HS / 2) * half;
#pragma unroll
    for (int d = 0; d < HS / 2; ++d) orow[d] *= alpha;
    __syncwarp();
    warp_acc_pb<HS>(O, P, Vs);
    __syncwarp();
  }

  // out (B,T,C) at column h*HS; the saved lse and O (head layout).
  if (qi < T) {
    const int b = bh / NH, h = bh % NH, C = NH * HS;
    const float* orow = Os + (warp * 16 + r) * (HS + kPadF) + (HS / 2) * half;
    const float inv = 1.0f / l_run;
    float* dst = out + (static_cast<size_t>(b) * T + qi) * C + static_cast<size_t>(h) * HS + (HS / 2) * half;
    float* saved = o_out + head + static_cast<size_t>(qi) * HS + (HS / 2) * half;
#pragma unroll 4
    for (int d = 0; d < HS / 2; ++d) {
      const float o = orow[d] * inv;
      dst[d] = o;
      saved[d] = o;
    }
    if (half == 0) lse_out[static_cast<size_t>(bh) * T + qi] = m_run + __logf(l_run);
  }
}

// D (B*NH, T) = rowsum(dO ∘ O), in fp32 from the unrounded dO (dout in (B,T,C)) and the saved O. A warp per row.
template <int HS>
__global__ void flash_bwd_dot_kernel(float* D, const float* dout, const float* o, int B, int T, int NH) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= B * NH * T) return;
  const int bh = row / T, t = row % T, b = bh / NH, h = bh % NH, C = NH * HS;
  const float* dy = dout + (static_cast<size_t>(b) * T + t) * C + static_cast<size_t>(h) * HS;
  const float* oy = o + static_cast<size_t>(row) * HS;
  float s = 0.0f;
  for (int d = lane; d < HS; d += 32) s += dy[d] * oy[d];
  s = warp_sum(s);
  if (lane == 0) D[row] = s;
}

template <int HS>
constexpr size_t bwd_kv_smem() {
  return 4 * kTile * (HS + kPadH) * sizeof(bf16)          // K, V, Q, dO tiles
         + kTile * (kTile + kPadF) * sizeof(float)        // Sᵀ / dPᵀ scratch, 16 rows per warp
         + 2 * kTile * (kTile + kPadH) * sizeof(bf16)     // Pᵀ and dSᵀ
         + 2 * kTile * (HS + kPadF) * sizeof(float)       // dK, dV accumulators
         + 2 * kTile * sizeof(float);                     // lse and D of the query tile
}

// grid (ceil(T/64), B*NH): dk, dv (B*NH, T, HS) fp32 for the 64 keys of the block, scaled.
template <int HS>
__global__ void __launch_bounds__(kThreads) flash_bwd_kv_kernel(float* dk, float* dv, const bf16* q, const bf16* k,
                                                                const bf16* v, const bf16* dy, const float* lse,
                                                                const float* D, int T, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = Ks + kTile * (HS + kPadH);
  bf16* Qs = Vs + kTile * (HS + kPadH);
  bf16* dYs = Qs + kTile * (HS + kPadH);
  float* Ss = reinterpret_cast<float*>(dYs + kTile * (HS + kPadH));
  bf16* Pt = reinterpret_cast<bf16*>(Ss + kTile * (kTile + kPadF));
  bf16* dSt = Pt + kTile * (kTile + kPadH);
  float* dKs = reinterpret_cast<float*>(dSt + kTile * (kTile + kPadH));
  float* dVs = dKs + kTile * (HS + kPadF);
  float* lse_s = dVs + kTile * (HS + kPadF);
  float* D_s = lse_s + kTile;

  const int kt = blockIdx.x, bh = blockIdx.y, k0 = kt * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t head = static_cast<size_t>(bh) * T * HS;
  load_tile<HS>(Ks, k + head, k0, T);
  load_tile<HS>(Vs, v + head, k0, T);
  for (int i = threadIdx.x; i < kTile * (HS + kPadF); i += kThreads) dKs[i] = dVs[i] = 0.0f;
  float* S = Ss + warp * 16 * (kTile + kPadF);
  bf16* P = Pt + warp * 16 * (kTile + kPadH);
  bf16* dS = dSt + warp * 16 * (kTile + kPadH);
  float* dK = dKs + warp * 16 * (HS + kPadF);
  float* dV = dVs + warp * 16 * (HS + kPadF);
  const bf16* Kw = Ks + warp * 16 * (HS + kPadH);
  const bf16* Vw = Vs + warp * 16 * (HS + kPadH);
  const int n_qt = (T + kTile - 1) / kTile;

  for (int qt = kt; qt < n_qt; ++qt) {
    const int q0 = qt * kTile;
    __syncthreads();
    load_tile<HS>(Qs, q + head, q0, T);
    load_tile<HS>(dYs, dy + head, q0, T);
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const bool in = q0 + i < T;
      lse_s[i] = in ? lse[static_cast<size_t>(bh) * T + q0 + i] : 0.0f;
      D_s[i] = in ? D[static_cast<size_t>(bh) * T + q0 + i] : 0.0f;
    }
    __syncthreads();
    // Pᵀ (16 keys × 64 queries) = exp(scale · K_w Qᵀ − lse[q]), causal (q ≥ key) and in range.
    warp_abt<HS>(S, Kw, HS + kPadH, Qs, HS + kPadH);
    __syncwarp();
    float pt[16][2];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int kj = k0 + warp * 16 + r;
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h, qi = q0 + c;
        const float p = (qi >= kj && qi < T && kj < T) ? __expf(S[r * (kTile + kPadF) + c] * scale - lse_s[c]) : 0.0f;
        pt[r][h] = p;
        P[r * (kTile + kPadH) + c] = __float2bfloat16_rn(p);
      }
    }
    __syncwarp();
    // dPᵀ (16 × 64) = V_w dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ − D[q]).
    warp_abt<HS>(S, Vw, HS + kPadH, dYs, HS + kPadH);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;
        dS[r * (kTile + kPadH) + c] = __float2bfloat16_rn(pt[r][h] * (S[r * (kTile + kPadF) + c] - D_s[c]));
      }
    }
    __syncwarp();
    warp_acc_pb<HS>(dV, P, dYs);  // dV_w += Pᵀ dO
    warp_acc_pb<HS>(dK, dS, Qs);  // dK_w += dSᵀ Q
    __syncwarp();
  }
  for (int r = 0; r < 16; ++r) {
    const int kj = k0 + warp * 16 + r;
    if (kj >= T) continue;
    for (int d = lane; d < HS; d += 32) {
      dk[head + static_cast<size_t>(kj) * HS + d] = dK[r * (HS + kPadF) + d] * scale;
      dv[head + static_cast<size_t>(kj) * HS + d] = dV[r * (HS + kPadF) + d];
    }
  }
}

template <int HS>
constexpr size_t bwd_q_smem() {
  return 4 * kTile * (HS + kPadH) * sizeof(bf16)          // Q, dO, K, V tiles
         + kTile * (kTile + kPadF) * sizeof(float)        // S / dP scratch
         + kTile * (kTile + kPadH) * sizeof(bf16)         // dS
         + kTile * (HS + kPadF) * sizeof(float);          // dQ accumulator
}

// grid (ceil(T/64), B*NH): dq (B*NH, T, HS) fp32 for the block's 64 queries, scaled.
template <int HS>
__global__ void __launch_bounds__(kThreads) flash_bwd_q_kernel(float* dq, const bf16* q, const bf16* k, const bf16* v,
                                                               const bf16* dy, const float* lse, const float* D,
                                                               int T, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* dYs = Qs + kTile * (HS + kPadH);
  bf16* Ks = dYs + kTile * (HS + kPadH);
  bf16* Vs = Ks + kTile * (HS + kPadH);
  float* Ss = reinterpret_cast<float*>(Vs + kTile * (HS + kPadH));
  bf16* dSs = reinterpret_cast<bf16*>(Ss + kTile * (kTile + kPadF));
  float* dQs = reinterpret_cast<float*>(dSs + kTile * (kTile + kPadH));

  const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, q0 = qt * kTile;  // heaviest tiles first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t head = static_cast<size_t>(bh) * T * HS;
  load_tile<HS>(Qs, q + head, q0, T);
  load_tile<HS>(dYs, dy + head, q0, T);
  for (int i = threadIdx.x; i < kTile * (HS + kPadF); i += kThreads) dQs[i] = 0.0f;
  float* S = Ss + warp * 16 * (kTile + kPadF);
  bf16* dS = dSs + warp * 16 * (kTile + kPadH);
  float* dQ = dQs + warp * 16 * (HS + kPadF);
  // The warp's rows' lse and D: lane r < 16 holds row r's.
  float my_lse = 0.0f, my_D = 0.0f;
  if (lane < 16 && q0 + warp * 16 + lane < T) {
    my_lse = lse[static_cast<size_t>(bh) * T + q0 + warp * 16 + lane];
    my_D = D[static_cast<size_t>(bh) * T + q0 + warp * 16 + lane];
  }

  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();
    load_tile<HS>(Ks, k + head, k0, T);
    load_tile<HS>(Vs, v + head, k0, T);
    __syncthreads();
    warp_abt<HS>(S, Qs + warp * 16 * (HS + kPadH), HS + kPadH, Ks, HS + kPadH);  // S = Q_w Kᵀ
    __syncwarp();
    float p[16][2];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int qi = q0 + warp * 16 + r;
      const float l = __shfl_sync(0xffffffffu, my_lse, r);
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h, kj = k0 + c;
        p[r][h] = (kj <= qi && kj < T && qi < T) ? __expf(S[r * (kTile + kPadF) + c] * scale - l) : 0.0f;
      }
    }
    __syncwarp();
    warp_abt<HS>(S, dYs + warp * 16 * (HS + kPadH), HS + kPadH, Vs, HS + kPadH);  // dP = dO_w Vᵀ
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float d = __shfl_sync(0xffffffffu, my_D, r);
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;
        dS[r * (kTile + kPadH) + c] = __float2bfloat16_rn(p[r][h] * (S[r * (kTile + kPadF) + c] - d));
      }
    }
    __syncwarp();
    warp_acc_pb<HS>(dQ, dS, Ks);  // dQ_w += dS K
    __syncwarp();
  }
  for (int r = 0; r < 16; ++r) {
    const int qi = q0 + warp * 16 + r;
    if (qi >= T) continue;
    for (int d = lane; d < HS; d += 32) dq[head + static_cast<size_t>(qi) * HS + d] = dQ[r * (HS + kPadF) + d] * scale;
  }
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int HS>
void forward(float* out, float* saved, const uint16_t* q, const uint16_t* k, const uint16_t* v, int B, int T,
             int NH) {
  static bool configured = false;  // one driving thread (cuda_context.h)
  if (!configured) {
    allow_smem(flash_fwd_kernel<HS>, fwd_smem<HS>());
    configured = true;
  }
  const dim3 grid((T + kTile - 1) / kTile, B * NH);
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  float* lse = saved;
  float* o = saved + static_cast<size_t>(B) * NH * T;
  flash_fwd_kernel<HS><<<grid, kThreads, fwd_smem<HS>(), cuda_context().compute>>>(
      out, lse, o, reinterpret_cast<const bf16*>(q), reinterpret_cast<const bf16*>(k),
      reinterpret_cast<const bf16*>(v), T, NH, scale);
  CUDA_CHECK_LAUNCH();
}

template <int HS>
void backward(float* dq, float* dk, float* dv, const float* dout, const float* saved, const uint16_t* q,
              const uint16_t* k, const uint16_t* v, const uint16_t* dy, int B, int T, int NH) {
  static bool configured = false;
  if (!configured) {
    allow_smem(flash_bwd_kv_kernel<HS>, bwd_kv_smem<HS>());
    allow_smem(flash_bwd_q_kernel<HS>, bwd_q_smem<HS>());
    configured = true;
  }
  const CudaContext& ctx = cuda_context();
  const size_t rows = static_cast<size_t>(B) * NH * T;
  const float* lse = saved;
  const float* o = saved + rows;
  DeviceScratch D(rows * sizeof(float));
  flash_bwd_dot_kernel<HS><<<(rows + kWarps - 1) / kWarps, kThreads, 0, ctx.compute>>>(D.as<float>(), dout, o, B, T,
                                                                                       NH);
  CUDA_CHECK_LAUNCH();
  const dim3 grid((T + kTile - 1) / kTile, B * NH);
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  const auto* qb = reinterpret_cast<const bf16*>(q);
  const auto* kb = reinterpret_cast<const bf16*>(k);
  const auto* vb = reinterpret_cast<const bf16*>(v);
  const auto* dyb = reinterpret_cast<const bf16*>(dy);
  flash_bwd_kv_kernel<HS><<<grid, kThreads, bwd_kv_smem<HS>(), ctx.compute>>>(dk, dv, qb, kb, vb, dyb, lse,
                                                                             D.as<float>(), T, scale);
  CUDA_CHECK_LAUNCH();
  flash_bwd_q_kernel<HS><<<grid, kThreads, bwd_q_smem<HS>(), ctx.compute>>>(dq, qb, kb, vb, dyb, lse, D.as<float>(),
                                                                           T, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool flash_attention_supported(int hs) { return hs == 32 || hs == 64 || hs == 128; }

size_t flash_attention_saved_floats(int B, int T, int NH, int hs) {
  return static_cast<size_t>(B) * NH * T * (1 + static_cast<size_t>(hs));
}

void flash_attention_forward(float* out, float* saved, const uint16_t* q, const uint16_t* k, const uint16_t* v, int B,
                             int T, int NH, int hs) {
  switch (hs) {
    case 32: return forward<32>(out, saved, q, k, v, B, T, NH);
    case 64: return forward<64>(out, saved, q, k, v, B, T, NH);
    case 128: return forward<128>(out, saved, q, k, v, B, T, NH);
  }
  STRATA_ASSERT_MSG(false, "flash attention: unsupported head size (ask flash_attention_supported first)");
}

void flash_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* saved,
                              const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dy, int B,
                              int T, int NH, int hs) {
  switch (hs) {
    case 32: return backward<32>(dq, dk, dv, dout, saved, q, k, v, dy, B, T, NH);
    case 64: return backward<64>(dq, dk, dv, dout, saved, q, k, v, dy, B, T, NH);
    case 128: return backward<128>(dq, dk, dv, dout, saved, q, k, v, dy, B, T, NH);
  }
  STRATA_ASSERT_MSG(false, "flash attention: unsupported head size (ask flash_attention_supported first)");
}

}  // namespace strata::kernels::cuda
