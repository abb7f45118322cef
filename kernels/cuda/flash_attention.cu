// flash_attention.cu — causal attention without the T×T matrix (FlashAttention-2's algorithm) on the tensor
// cores: bf16 operands through mma.sync.m16n8k16, fp32 accumulation, fp32 softmax statistics.
//
// Every kernel has the same shape: a block takes 64 rows of one (batch, head), four warps of 16 rows each; a
// warp keeps its rows' operand fragments, its 16×64 tile of scores and its output accumulator in REGISTERS, and
// only the 64-row tiles it walks over are staged in shared memory: two buffers each, the next tile copied in
// with cp.async under the current one's products, and read into B fragments with ldmatrix. The scores come out
// of the tensor cores in the accumulator layout, which is exactly the A-operand layout of the next product
// (FlashAttention-2's trick), so probabilities never leave registers. (A first version used WMMA, whose opaque
// fragments forced scores and outputs through shared memory: it was bound by shared-memory bandwidth at 19%
// occupancy.)
//
// Forward: walk the key tiles up to the diagonal: S = Q Kᵀ -> online softmax (running max m and sum l per
// row, the output rescaled as m grows; each probability one FMA and one ex2, the scale folded into the
// exponent's base-2 form) -> O += P V with P rounded to bf16. Saves, per row, the log-sum-exp of the scaled
// scores; the backward takes O from the output (bf16) for D = rowsum(dO∘O).
//
// Backward, deterministic (no atomics): kernel 0 computes D = rowsum(dO ∘ O); kernel 1 takes 64 keys per block and
// walks the query tiles from the diagonal down, accumulating its rows of dV = Pᵀ dO and dK = dSᵀ Q (it computes Sᵀ = K
// Qᵀ directly, so Pᵀ is in registers as an A operand); kernel 2 takes 64 queries per block and accumulates dQ = dS K
// over the key tiles. P is recomputed from the saved log-sum-exp; dS = P ∘ (dP − D) with dP = dO Vᵀ. Kernels 1 and 2
// store their rows straight into the (B,T,3C) gradient of qkv, in bf16, each element by one thread (it is overwritten:
// no read, no zeroing pass before). The attention's input and output activations and their gradients are bf16 (B,T,·)
// rows: the model's hidden form (kernels.h), which the linears on either side write and read. The kernels read their
// heads' q, k, v, O and dO in place from those rows (3C and C elements apart): nothing is permuted into head layout,
// and nothing but the log-sum-exps is saved for the backward, which reads qkv and the output again.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with bf16): g = lane / 4, t = lane % 4.
//   A (16×16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16×8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16×8):       c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kTile = 64;  // query and key rows per tile
constexpr int kWarps = 4;  // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr int kPad = 8;    // bf16 row padding of shared tiles: spreads the fragment loads over the banks

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t load_pair(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8×8 bf16 matrices from shared memory in one instruction: lanes 8i..8i+7 give the 16-byte rows of matrix i,
// and every lane gets, in r[i], its (g, 2t..2t+1) pair of matrix i — the B-fragment layout when the matrix's rows
// are B's columns. With .trans it gets (2t..2t+1, g) instead: B fragments from a matrix whose rows are B's rows.
// (Before, every B register took two 32-bit or four 16-bit shared loads.)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// 16 bytes global -> shared without passing through registers; `bytes` 0 writes zeros (rows past T).
__device__ __forceinline__ void copy_async_16(bf16* dst, const bf16* src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(in ? 16 : 0));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Starts copying rows [row0, row0 + 64) of a (T, HS) bf16 head slice whose rows are `ld` elements apart (3C in
// qkv, C in the output's gradient) into a shared tile with row stride HS + kPad (rows past T are zeros); the
// caller commits the group and waits for it. The tiles are double-buffered: the next tile's copy runs under this
// tile's products.
template <int HS>
__device__ void load_tile_async(bf16* dst, const bf16* src, int row0, int T, int ld) {
  constexpr int kVecs = HS / 8;  // 16-byte copies per row
  for (int i = threadIdx.x; i < kTile * kVecs; i += kThreads) {
    const int r = i / kVecs, c = (i % kVecs) * 8;
    const bool in = row0 + r < T;
    copy_async_16(dst + r * (HS + kPad) + c, src + static_cast<size_t>(in ? row0 + r : 0) * ld + c, in);
  }
}

// Starts copying key tile k0's K and V rows (row stride ld) into the shared tiles Kt, Vt, as one committed group.
template <int HS>
__device__ void start_kv_tile(bf16* Kt, bf16* Vt, const bf16* k, const bf16* v, int k0, int T, int ld) {
  load_tile_async<HS>(Kt, k, k0, T, ld);
  load_tile_async<HS>(Vt, v, k0, T, ld);
  copy_async_commit();
}

// The forward's and dQ's walk over key tiles 0..last of one head (k, v its slices), K and V double-buffered in
// Ks[2], Vs[2]: the caller has started tile 0 (start_kv_tile, ahead of its own loads); each next tile is copied
// into the other buffer, which the last iteration finished reading, while `tile(masked, k0, Kt, Vt)` multiplies
// the current one. Only the last tile, the diagonal, needs the causal mask, and only it can hold keys past T
// (below it, k0 + 64 <= q0 < T), so only it gets the masked instantiation. Forced inline: `tile` holds the
// caller's accumulators by reference, which a real call would put in local memory.
template <int HS, typename Fn>
__device__ __forceinline__ void walk_key_tiles(bf16 (*Ks)[kTile * (HS + kPad)], bf16 (*Vs)[kTile * (HS + kPad)],
                                               const bf16* k, const bf16* v, int ld, int last, int T, Fn& tile) {
  for (int kt = 0; kt <= last; ++kt) {
    const int cur = kt & 1;
    if (kt < last) {
      start_kv_tile<HS>(Ks[cur ^ 1], Vs[cur ^ 1], k, v, (kt + 1) * kTile, T, ld);
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();  // this tile's copies, from every thread, have landed
    if (kt == last)
      tile(std::true_type{}, kt * kTile, Ks[cur], Vs[cur]);
    else
      tile(std::false_type{}, kt * kTile, Ks[cur], Vs[cur]);
    __syncthreads();  // this tile is no longer read: the next iteration copies into it
  }
}

// The A fragments of 16 rows × HS (row r of the strip is row `row0 + r` of the (T, HS) head slice, rows `ld`
// elements apart; rows past T are zeros), straight from global memory: each warp reads its rows once per block.
template <int HS>
__device__ void load_a_strip(uint32_t (&a)[HS / 16][4], const bf16* src, int row0, int T, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const bool in0 = row0 + g < T, in1 = row0 + g + 8 < T;
  const bf16* r0 = src + static_cast<size_t>(row0 + g) * ld;
  const bf16* r1 = src + static_cast<size_t>(row0 + g + 8) * ld;
#pragma unroll
  for (int kk = 0; kk < HS / 16; ++kk) {
    const int c = 16 * kk + 2 * t;
    a[kk][0] = in0 ? load_pair(r0 + c) : 0u;
    a[kk][1] = in1 ? load_pair(r1 + c) : 0u;
    a[kk][2] = in0 ? load_pair(r0 + c + 8) : 0u;
    a[kk][3] = in1 ? load_pair(r1 + c + 8) : 0u;
  }
}

// s (16×64, accumulator layout, 8 n-tiles) = A (16×HS) · Bᵀ, B a shared 64×HS tile (row stride HS + kPad).
// The B fragments of n-tile j are rows 8j..8j+7 of the tile: one ldmatrix.x4 covers 32 of the HS columns.
template <int HS>
__device__ void strip_abt(float (&s)[8][4], const uint32_t (&a)[HS / 16][4], const bf16* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const bf16* row = b + (8 * j + lane % 8) * (HS + kPad) + 8 * (lane / 8);
#pragma unroll
    for (int kp = 0; kp < HS / 32; ++kp) {
      uint32_t f[4];
      ldmatrix_x4(f, row + 32 * kp);
      mma_bf16(s[j], a[2 * kp], f[0], f[1]);
      mma_bf16(s[j], a[2 * kp + 1], f[2], f[3]);
    }
  }
}

// acc (16×HS, accumulator layout, HS/8 n-tiles) += P (16×64, accumulator layout, rounded to bf16 here) · B, B a
// shared 64×HS tile (row stride HS + kPad) whose rows are the 64 columns of P. B's fragments for k-step kk and
// n-tiles n, n+1 are the four 8×8 blocks (rows 16kk, 16kk+8) × (columns 8n, 8n+8), transposed by ldmatrix.
template <int HS>
__device__ void strip_pb(float (&acc)[HS / 8][4], const float (&p)[8][4], const bf16* b) {
  const int lane = threadIdx.x % 32, quad = lane / 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t a[4] = {pack(p[2 * kk][0], p[2 * kk][1]), pack(p[2 * kk][2], p[2 * kk][3]),
                           pack(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    const bf16* r0 = b + (16 * kk + 8 * (quad & 1) + lane % 8) * (HS + kPad) + 8 * (quad >> 1);
#pragma unroll
    for (int n = 0; n < HS / 8; n += 2) {
      uint32_t f[4];
      ldmatrix_x4_trans(f, r0 + 8 * n);
      mma_bf16(acc[n], a, f[0], f[1]);
      mma_bf16(acc[n + 1], a, f[2], f[3]);
    }
  }
}

constexpr float kLog2e = 1.4426950408889634f;
// 2^x on the special-function unit: what __expf is built on, without its multiply by log2(e). The softmaxes
// below fold that multiply and the 1/sqrt(hs) scale into one FMA per score (FlashAttention's scale_log2):
// exp(scale·s − m) = 2^(s·scale·log2e − m·log2e). 2^-inf = +0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the four lanes (t = 0..3) that share a row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Head bh's (T, HS) slices of q, k and v in qkv (B,T,3C), rows 3C apart, and of dO in dout (B,T,C), rows C
// apart: read in place, so no pass permutes them into head layout.
template <int HS>
struct HeadSlices {
  const bf16 *q, *k, *v, *dy;
  int C;
  __device__ HeadSlices(const bf16* qkv, const bf16* dout, int bh, int T, int NH) : C(NH * HS) {
    const size_t b = static_cast<size_t>(bh / NH), col = static_cast<size_t>(bh % NH) * HS;
    q = qkv + b * T * 3 * C + col;
    k = q + C;
    v = q + 2 * C;
    dy = dout != nullptr ? dout + b * T * C + col : nullptr;
  }
};

// grid (B*NH, ceil(T/64)). lse_out: (B*NH, T), the rows' log-sum-exps of the scaled scores.
template <int HS, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    flash_fwd_kernel(bf16* out, float* lse_out, const bf16* qkv, int T, int NH, float scale) {
  __shared__ __align__(16) bf16 Ks[2][kTile * (HS + kPad)];
  __shared__ __align__(16) bf16 Vs[2][kTile * (HS + kPad)];
  // The heaviest query tiles (most key tiles below the diagonal) first, so the last wave is the light ones.
  const int qt = gridDim.y - 1 - blockIdx.y, bh = blockIdx.x, q0 = qt * kTile;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const HeadSlices<HS> x(qkv, nullptr, bh, T, NH);
  const int ld = 3 * x.C;
  const int row0 = q0 + warp * 16;  // this thread's rows: row0 + g and row0 + g + 8
  start_kv_tile<HS>(Ks[0], Vs[0], x.k, x.v, 0, T, ld);
  uint32_t qa[HS / 16][4];
  load_a_strip<HS>(qa, x.q, row0, T, ld);
  float o[HS / 8][4] = {};
  // m: the rows' running maxima of the unscaled scores (the scale is positive: the same keys attain them).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float scale_log2 = scale * kLog2e;

  // One key tile: S = Q Kᵀ, the online softmax, O += P V (masked: the diagonal tile; see walk_key_tiles).
  auto tile = [&](auto masked, int k0, const bf16* Kt, const bf16* Vt) {
    float s[8][4];
    strip_abt<HS>(s, qa, Kt);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (decltype(masked)::value) {
          const int key = k0 + 8 * j + 2 * t + (e & 1), query = row0 + g + 8 * (e >> 1);
          if (key > query || key >= T) s[j][e] = -INFINITY;
        }
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    float alpha[2], m_log2[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(mx[h]));
      alpha[h] = m_new == -INFINITY ? 1.0f : exp2_approx((m[h] - m_new) * scale_log2);
      m[h] = m_new;
      m_log2[h] = m_new * scale_log2;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        // Unmasked, every row has a finite maximum (m is -inf only for a row whose keys so far are all masked).
        if constexpr (decltype(masked)::value)
          s[j][e] = m[h] == -INFINITY ? 0.0f : exp2_approx(fmaf(s[j][e], scale_log2, -m_log2[h]));
        else
          s[j][e] = exp2_approx(fmaf(s[j][e], scale_log2, -m_log2[h]));
        sum[h] += s[j][e];
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + quad_sum(sum[h]);
#pragma unroll
    for (int n = 0; n < HS / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    strip_pb<HS>(o, s, Vt);
  };

  walk_key_tiles<HS>(Ks, Vs, x.k, x.v, ld, qt, T, tile);

  // out (B,T,C) in bf16 at column h*HS, and the rows' lse.
  const int b = bh / NH, hd = bh % NH, C = NH * HS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int query = row0 + g + 8 * h;
    if (query >= T) continue;
    const float inv = 1.0f / l[h];
    bf16* dst = out + (static_cast<size_t>(b) * T + query) * C + static_cast<size_t>(hd) * HS;
#pragma unroll
    for (int n = 0; n < HS / 8; ++n) {
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n + 2 * t) =
          __floats2bfloat162_rn(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
    if (t == 0) lse_out[static_cast<size_t>(bh) * T + query] = m[h] * scale + __logf(l[h]);
  }
}

// D (B*NH, T) = rowsum(dO ∘ O), in fp32 from dO (dout) and O (out), both bf16 in (B,T,C), as FlashAttention
// takes them. A warp per row.
template <int HS>
__global__ void flash_bwd_dot_kernel(float* D, const bf16* dout, const bf16* out, int B, int T, int NH) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= B * NH * T) return;
  const int bh = row / T, tq = row % T, b = bh / NH, h = bh % NH, C = NH * HS;
  const size_t at = (static_cast<size_t>(b) * T + tq) * C + static_cast<size_t>(h) * HS;
  float s = 0.0f;
  for (int d = 2 * lane; d < HS; d += 64) {  // a pair of columns per lane: 4-byte loads, 128 bytes a warp
    const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + at + d));
    const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out + at + d));
    s += g.x * o.x + g.y * o.y;
  }
  s = warp_sum(s);
  if (lane == 0) D[row] = s;
}

// Stores a thread's accumulator rows (row0 + g, row0 + g + 8; HS/8 n-tiles, times `scale`) as their (B,T,3C)
// gradient in bf16 at column `col0` (q: h*HS, k: C + h*HS, v: 2C + h*HS). Each element has one owner: no atomics.
template <int HS>
__device__ void store_rows(bf16* dqkv, const float (&acc)[HS / 8][4], int row0, int b, int col0, int T, int C,
                           float scale) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row >= T) continue;
    bf16* dst = dqkv + (static_cast<size_t>(b) * T + row) * 3 * C + col0 + 2 * t;
#pragma unroll
    for (int n = 0; n < HS / 8; ++n) {
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) =
          __floats2bfloat162_rn(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
    }
  }
}

// grid (B*NH, ceil(T/64)): dK (scaled) and dV of the block's 64 keys, stored into dqkv (B,T,3C).
template <int HS, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    flash_bwd_kv_kernel(bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* D, int T, int NH,
                        float scale) {
  __shared__ __align__(16) bf16 Qs[2][kTile * (HS + kPad)];
  __shared__ __align__(16) bf16 dYs[2][kTile * (HS + kPad)];
  __shared__ float lse_s[2][kTile], D_s[2][kTile];
  const int kt = blockIdx.y, bh = blockIdx.x, k0 = kt * kTile;  // the heaviest key tiles are the first
  const float scale_log2 = scale * kLog2e;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const HeadSlices<HS> x(qkv, dout, bh, T, NH);
  const int ld = 3 * x.C;
  const int row0 = k0 + warp * 16;  // this thread's keys: row0 + g and row0 + g + 8
  const int n_qt = (T + kTile - 1) / kTile;
  // The query tile q0's Q and dO (asynchronously) and its rows' lse and D into buffer `buf`.
  auto load = [&](int buf, int q0) {
    load_tile_async<HS>(Qs[buf], x.q, q0, T, ld);
    load_tile_async<HS>(dYs[buf], x.dy, q0, T, x.C);
    copy_async_commit();
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const bool in = q0 + i < T;
      lse_s[buf][i] = in ? lse[static_cast<size_t>(bh) * T + q0 + i] * kLog2e : 0.0f;  // in log2 units
      D_s[buf][i] = in ? D[static_cast<size_t>(bh) * T + q0 + i] : 0.0f;
    }
  };
  load(0, kt * kTile);
  uint32_t ka[HS / 16][4], va[HS / 16][4];
  load_a_strip<HS>(ka, x.k, row0, T, ld);
  load_a_strip<HS>(va, x.v, row0, T, ld);
  float dK[HS / 8][4] = {}, dV[HS / 8][4] = {};

  // One query tile. The diagonal tile needs the causal mask and the last one the mask of queries past T; those
  // between need neither (their keys are all below their queries).
  auto tile = [&](auto masked, int q0, int buf) {
    // Pᵀ (16 keys × 64 queries) = exp(scale · K Qᵀ − lse[query]) where query ≥ key, both in range.
    float p[8][4], dp[8][4];
    strip_abt<HS>(p, ka, Qs[buf]);
    strip_abt<HS>(dp, va, dYs[buf]);  // dPᵀ = V dOᵀ
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * t + (e & 1);
        float pe;
        if constexpr (decltype(masked)::value) {
          const int query = q0 + col, key = row0 + g + 8 * (e >> 1);
          pe = (query >= key && query < T && key < T) ? exp2_approx(fmaf(p[j][e], scale_log2, -lse_s[buf][col]))
                                                      : 0.0f;
        } else {
          pe = exp2_approx(fmaf(p[j][e], scale_log2, -lse_s[buf][col]));
        }
        p[j][e] = pe;
        dp[j][e] = pe * (dp[j][e] - D_s[buf][col]);  // dSᵀ
      }
    strip_pb<HS>(dV, p, dYs[buf]);  // dV += Pᵀ dO
    strip_pb<HS>(dK, dp, Qs[buf]);  // dK += dSᵀ Q
  };

  for (int qt = kt; qt < n_qt; ++qt) {
    const int cur = (qt - kt) & 1, q0 = qt * kTile;
    if (qt + 1 < n_qt) {
      load(cur ^ 1, q0 + kTile);
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();
    if (qt == kt || q0 + kTile > T)
      tile(std::true_type{}, q0, cur);
    else
      tile(std::false_type{}, q0, cur);
    __syncthreads();
  }
  const int b = bh / NH, C = NH * HS, col = bh % NH * HS;
  store_rows<HS>(dqkv, dK, row0, b, C + col, T, C, scale);
  store_rows<HS>(dqkv, dV, row0, b, 2 * C + col, T, C, 1.0f);
}

// grid (B*NH, ceil(T/64)): dQ (scaled) of the block's 64 queries, stored into dqkv (B,T,3C).
template <int HS, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    flash_bwd_q_kernel(bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* D, int T, int NH,
                       float scale) {
  __shared__ __align__(16) bf16 Ks[2][kTile * (HS + kPad)];
  __shared__ __align__(16) bf16 Vs[2][kTile * (HS + kPad)];
  const int qt = gridDim.y - 1 - blockIdx.y, bh = blockIdx.x, q0 = qt * kTile;  // heaviest tiles first
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const HeadSlices<HS> x(qkv, dout, bh, T, NH);
  const int ld = 3 * x.C;
  const int row0 = q0 + warp * 16;
  const float scale_log2 = scale * kLog2e;
  start_kv_tile<HS>(Ks[0], Vs[0], x.k, x.v, 0, T, ld);
  uint32_t qa[HS / 16][4], ya[HS / 16][4];
  load_a_strip<HS>(qa, x.q, row0, T, ld);
  load_a_strip<HS>(ya, x.dy, row0, T, x.C);
  float row_lse[2], row_D[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int query = row0 + g + 8 * h;
    row_lse[h] = query < T ? lse[static_cast<size_t>(bh) * T + query] * kLog2e : 0.0f;  // in log2 units
    row_D[h] = query < T ? D[static_cast<size_t>(bh) * T + query] : 0.0f;
  }
  float dQ[HS / 8][4] = {};

  // One key tile: dS, then dQ += dS K (masked: the diagonal tile; see walk_key_tiles).
  auto tile = [&](auto masked, int k0, const bf16* Kt, const bf16* Vt) {
    float p[8][4], dp[8][4];
    strip_abt<HS>(p, qa, Kt);  // S = Q Kᵀ
    strip_abt<HS>(dp, ya, Vt);  // dP = dO Vᵀ
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        float pe;
        if constexpr (decltype(masked)::value) {
          const int key = k0 + 8 * j + 2 * t + (e & 1), query = row0 + g + 8 * h;
          pe = (key <= query && key < T && query < T) ? exp2_approx(fmaf(p[j][e], scale_log2, -row_lse[h])) : 0.0f;
        } else {
          pe = exp2_approx(fmaf(p[j][e], scale_log2, -row_lse[h]));
        }
        dp[j][e] = pe * (dp[j][e] - row_D[h]);  // dS
      }
    strip_pb<HS>(dQ, dp, Kt);  // dQ += dS K
  };

  walk_key_tiles<HS>(Ks, Vs, x.k, x.v, ld, qt, T, tile);
  store_rows<HS>(dqkv, dQ, row0, bh / NH, bh % NH * HS, T, NH * HS, scale);
}

// Heads on x, tiles on y: blocks start x-fastest, so every head's heaviest tile (the causal mask's last query
// tile, or first key tile) starts before any head's lighter ones, and the last wave holds the cheap tiles. x
// also takes B*NH beyond y's 65535.
dim3 tile_grid(int B, int T, int NH) {
  const int tiles = (T + kTile - 1) / kTile;
  STRATA_ASSERT_MSG(tiles <= 65535, "flash attention: more than 65535 tiles of a sequence");
  return dim3(static_cast<unsigned>(B) * static_cast<unsigned>(NH), static_cast<unsigned>(tiles));
}

// What the forward saves: the rows' log-sum-exps (B*NH*T floats), padded to a multiple of 4.
size_t lse_floats(int B, int T, int NH) { return (static_cast<size_t>(B) * NH * T + 3) / 4 * 4; }

// The kernels' 16-byte copies of rows of q, k, v and dO start at multiples of 16 bytes when these are 16-byte
// aligned (rows of 3C and C bf16, C a multiple of 32, heads at multiples of 32 elements).
void check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return;
  const std::string msg = std::string("flash attention: ") + what + " is not 16-byte aligned";
  STRATA_ASSERT_MSG(false, msg.c_str());
}

// Blocks of each kernel resident on a multiprocessor (__launch_bounds__'s minimum, which caps the registers at
// 64K / (128 x blocks)). kOccupancyDefault's 0 is no minimum, as without the argument: the registers are the
// compiler's choice (hs 64 on sm_90: 136, 251 and 141 for the forward, dK/dV and dQ kernels, so 3, 2 and 3
// blocks; a minimum of 1 is not the same: it lets ptxas take 163, 251 and 237). kOccupancyHigh asks for 4, 3
// and 4 blocks (128, 168 and 128 registers, at 32, 112 and 40 bytes of spill loads) — for hs 64 only, an
// experiment until a GPU measures it (flash_attention.h).
struct MinBlocks {
  int fwd, kv, q;
};
constexpr MinBlocks kOccupancyDefault{0, 0, 0}, kOccupancyHigh{4, 3, 4};
EnvSwitch high_occupancy("STRATA_FLASH_OCCUPANCY", "default", "high");

template <int HS, int kMinBlocks>
void launch_forward(bf16* out, const bf16* qkv, float* lse, int B, int T, int NH) {
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  flash_fwd_kernel<HS, kMinBlocks>
      <<<tile_grid(B, T, NH), kThreads, 0, cuda_context().compute>>>(out, lse, qkv, T, NH, scale);
  CUDA_CHECK_LAUNCH();
}

template <int HS>
void forward(bf16* out, const bf16* qkv, float* lse, int B, int T, int NH) {
  check_aligned(qkv, "qkv");
  if constexpr (HS == 64) {
    if (flash_attention_occupancy() == FlashOccupancy::kHigh)
      return launch_forward<HS, kOccupancyHigh.fwd>(out, qkv, lse, B, T, NH);
  }
  launch_forward<HS, kOccupancyDefault.fwd>(out, qkv, lse, B, T, NH);
}

template <int HS, int kKvBlocks, int kQBlocks>
void launch_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D, int B, int T,
                     int NH) {
  const CudaContext& ctx = cuda_context();
  const dim3 grid = tile_grid(B, T, NH);
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  flash_bwd_kv_kernel<HS, kKvBlocks><<<grid, kThreads, 0, ctx.compute>>>(dqkv, qkv, dout, lse, D, T, NH, scale);
  CUDA_CHECK_LAUNCH();
  flash_bwd_q_kernel<HS, kQBlocks><<<grid, kThreads, 0, ctx.compute>>>(dqkv, qkv, dout, lse, D, T, NH, scale);
  CUDA_CHECK_LAUNCH();
}

template <int HS>
void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B, int T,
              int NH) {
  check_aligned(qkv, "qkv");
  check_aligned(dout, "the output's gradient");
  const CudaContext& ctx = cuda_context();
  const size_t rows = static_cast<size_t>(B) * NH * T;
  DeviceScratch D(rows * sizeof(float));
  flash_bwd_dot_kernel<HS><<<(rows + kWarps - 1) / kWarps, kThreads, 0, ctx.compute>>>(D.as<float>(), dout, out, B,
                                                                                       T, NH);
  CUDA_CHECK_LAUNCH();
  if constexpr (HS == 64) {
    if (flash_attention_occupancy() == FlashOccupancy::kHigh)
      return launch_backward<HS, kOccupancyHigh.kv, kOccupancyHigh.q>(dqkv, dout, qkv, lse, D.as<float>(), B, T, NH);
  }
  launch_backward<HS, kOccupancyDefault.kv, kOccupancyDefault.q>(dqkv, dout, qkv, lse, D.as<float>(), B, T, NH);
}

}  // namespace

FlashOccupancy flash_attention_occupancy() {
  return high_occupancy.on() ? FlashOccupancy::kHigh : FlashOccupancy::kDefault;
}

void set_flash_attention_occupancy(FlashOccupancy o) { high_occupancy.set(o == FlashOccupancy::kHigh); }

// 128 would need twice the accumulator registers of 64 and spill: it takes the batched-GEMM path instead.
bool flash_attention_supported(int hs) { return hs == 32 || hs == 64; }

size_t flash_attention_saved_floats(int B, int T, int NH, int /*hs*/) { return lse_floats(B, T, NH); }

void flash_attention_forward(uint16_t* out16, const uint16_t* qkv16, float* lse, int B, int T, int NH, int hs) {
  auto* out = reinterpret_cast<bf16*>(out16);
  const auto* qkv = reinterpret_cast<const bf16*>(qkv16);
  switch (hs) {
    case 32: return forward<32>(out, qkv, lse, B, T, NH);
    case 64: return forward<64>(out, qkv, lse, B, T, NH);
  }
  STRATA_ASSERT_MSG(false, "flash attention: unsupported head size (ask flash_attention_supported first)");
}

void flash_attention_backward(uint16_t* dqkv16, const uint16_t* dout16, const uint16_t* qkv16,
                              const uint16_t* out16, const float* lse, int B, int T, int NH, int hs) {
  auto* dqkv = reinterpret_cast<bf16*>(dqkv16);
  const auto* dout = reinterpret_cast<const bf16*>(dout16);
  const auto* qkv = reinterpret_cast<const bf16*>(qkv16);
  const auto* out = reinterpret_cast<const bf16*>(out16);
  switch (hs) {
    case 32: return backward<32>(dqkv, dout, qkv, out, lse, B, T, NH);
    case 64: return backward<64>(dqkv, dout, qkv, out, lse, B, T, NH);
  }
  STRATA_ASSERT_MSG(false, "flash attention: unsupported head size (ask flash_attention_supported first)");
}

}  // namespace strata::kernels::cuda
