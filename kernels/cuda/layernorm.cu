// layernorm.cu — layernorm forward (also fused with the residual add before it) and backward, one warp per row
// (torch.nn.LayerNorm: biased variance, eps 1e-5 inside the square root). The forward's output only feeds
// linears: it is hidden (kernels.h), bf16 under bf16 where C is a multiple of 8. At widths that are a multiple
// of 4 up to 2048 the forward keeps its row in registers, read once with 16-byte loads
// (layernorm_forward_vec_kernel). The weight and bias gradients are
// column sums over rows, in an order fixed by the shapes: at widths that are a multiple of 4 up to 1024 the
// backward is one pass that sums them as it goes (layernorm_backward_fused_kernel), else the dinp kernel and
// the two-pass reduction of reduce.cuh.
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block

__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// kResidual: the row is inp + inp2, written to `res` as it is summed; the two later passes read back only what
// the same thread wrote there (residual_layernorm_forward: one kernel instead of an add and a layernorm, the sum
// read once from memory instead of twice, with the same arithmetic). Out (hidden) as E: fp32, or bf16.
template <bool kResidual, typename E>
__global__ void layernorm_forward_kernel(E* out, float* mean, float* rstd, float* res, const float* inp,
                                         const float* inp2, const float* weight, const float* bias, int N, int C) {
  const int n = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const size_t row = static_cast<size_t>(n) * C;
  const float* x = (kResidual ? res : inp) + row;
  float s = 0.0f;
  if constexpr (kResidual) {
    for (int i = lane; i < C; i += 32) {
      const float v = inp[row + i] + inp2[row + i];
      res[row + i] = v;
      s += v;
    }
  } else {
    for (int i = lane; i < C; i += 32) s += x[i];
  }
  const float m = warp_sum(s) / C;
  float v = 0.0f;
  for (int i = lane; i < C; i += 32) {
    const float d = x[i] - m;
    v += d * d;
  }
  const float r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);
  E* o = out + static_cast<size_t>(n) * C;
  for (int i = lane; i < C; i += 32) store(o + i, r * (x[i] - m) * weight[i] + bias[i]);
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = packed;
}
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// The same for rows of C <= 128 * kVecs floats, C a multiple of 4 (GPT-2's widths, up to 2048): each lane holds
// 4 * kVecs columns of its warp's row (c = 4 * (lane + 32 j)) in registers, read once with 16-byte loads (and,
// with the residual, the sum written once), where the kernel above reads the row three times with 4-byte loads.
constexpr int kMaxForwardVecs = 16;
template <int kVecs, bool kResidual, typename E>
__global__ void __launch_bounds__(32 * kRowsPerBlock) layernorm_forward_vec_kernel(
    E* out, float* mean, float* rstd, float* res, const float* inp, const float* inp2, const float* weight,
    const float* bias, int N, int C) {
  const int n = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const size_t row = static_cast<size_t>(n) * C;
  float4 x[kVecs];
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = 4 * (lane + 32 * j);
    x[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c >= C) continue;
    x[j] = load4(inp + row + c);
    if constexpr (kResidual) {
      const float4 y = load4(inp2 + row + c);
      x[j] = make_float4(x[j].x + y.x, x[j].y + y.y, x[j].z + y.z, x[j].w + y.w);
      store4(res + row + c, x[j]);
    }
    s += (x[j].x + x[j].y) + (x[j].z + x[j].w);
  }
  const float m = warp_sum(s) / C;
  float v = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (4 * (lane + 32 * j) >= C) continue;
    const float4 d = make_float4(x[j].x - m, x[j].y - m, x[j].z - m, x[j].w - m);
    v += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);
  }
  const float r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = 4 * (lane + 32 * j);
    if (c >= C) continue;
    const float4 w = load4(weight + c), b = load4(bias + c);
    store4(out + row + c, make_float4(r * (x[j].x - m) * w.x + b.x, r * (x[j].y - m) * w.y + b.y,
                                      r * (x[j].z - m) * w.z + b.z, r * (x[j].w - m) * w.w + b.w));
  }
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

__global__ void layernorm_dinp_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                      const float* mean, const float* rstd, int N, int C) {
  const int n = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const size_t row = static_cast<size_t>(n) * C;
  const float m = mean[n], r = rstd[n];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int i = lane; i < C; i += 32) {
    const float norm = (inp[row + i] - m) * r;
    const float dnorm = weight[i] * dout[row + i];
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  }
  const float dnorm_mean = warp_sum(dnorm_sum) / C;
  const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
  for (int i = lane; i < C; i += 32) {
    const float norm = (inp[row + i] - m) * r;
    const float dnorm = weight[i] * dout[row + i];
    dinp[row + i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
  }
}

// The backward in one pass over dout and inp for rows of C <= 128 * kVecs floats, C a multiple of 4 (GPT-2's widths): a
// warp per row, each lane holding 4 * kVecs columns (c = 4 * (lane + 32 j)) in registers — the row's dout and inp, read
// once with 16-byte loads for both of dinp's sums and its write, and the lane's own sums of dweight's and dbias's terms
// over the block's rows, which the block then adds warp by warp into partials[blockIdx.x]; launch_column_sums then adds
// the blocks' rows (hundreds of them: over many blocks, not one thread per column). Every order is fixed by the shapes,
// so runs are bitwise alike. (The general kernel above reads dout and inp twice, and the column sums read them a third
// time.)
constexpr int kFusedWarps = 4;
constexpr int kFusedRowsPerWarp = 4;
constexpr int kFusedRows = kFusedWarps * kFusedRowsPerWarp;  // rows per block

template <int kVecs>
__global__ void __launch_bounds__(32 * kFusedWarps) layernorm_backward_fused_kernel(
    float* dinp, float* partials, const float* dout, const float* inp, const float* weight, const float* mean,
    const float* rstd, int N, int C) {
  __shared__ __align__(16) float block_sums[2][128 * kVecs];  // dweight's, then dbias's, terms of its rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float4 w[kVecs], dw[kVecs], db[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = 4 * (lane + 32 * j);
    w[j] = c < C ? *reinterpret_cast<const float4*>(weight + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    dw[j] = db[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int i = 0; i < kFusedRowsPerWarp; ++i) {
    const int n = blockIdx.x * kFusedRows + i * kFusedWarps + warp;
    if (n >= N) break;
    const size_t row = static_cast<size_t>(n) * C;
    const float m = mean[n], r = rstd[n];
    float4 g[kVecs], x[kVecs];  // dout, then the normalized input
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int c = 4 * (lane + 32 * j);
      if (c < C) {
        g[j] = *reinterpret_cast<const float4*>(dout + row + c);
        x[j] = *reinterpret_cast<const float4*>(inp + row + c);
      } else {
        g[j] = x[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      x[j] = make_float4((x[j].x - m) * r, (x[j].y - m) * r, (x[j].z - m) * r, (x[j].w - m) * r);
      const float4 d = make_float4(w[j].x * g[j].x, w[j].y * g[j].y, w[j].z * g[j].z, w[j].w * g[j].w);
      dnorm_sum += d.x + d.y + d.z + d.w;
      dnorm_norm_sum += d.x * x[j].x + d.y * x[j].y + d.z * x[j].z + d.w * x[j].w;
      dw[j] = make_float4(dw[j].x + g[j].x * x[j].x, dw[j].y + g[j].y * x[j].y, dw[j].z + g[j].z * x[j].z,
                          dw[j].w + g[j].w * x[j].w);
      db[j] = make_float4(db[j].x + g[j].x, db[j].y + g[j].y, db[j].z + g[j].z, db[j].w + g[j].w);
    }
    const float dnorm_mean = warp_sum(dnorm_sum) / C, dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int c = 4 * (lane + 32 * j);
      if (c >= C) continue;
      float4* out = reinterpret_cast<float4*>(dinp + row + c);
      float4 o = *out;
      o.x += (w[j].x * g[j].x - dnorm_mean - x[j].x * dnorm_norm_mean) * r;
      o.y += (w[j].y * g[j].y - dnorm_mean - x[j].y * dnorm_norm_mean) * r;
      o.z += (w[j].z * g[j].z - dnorm_mean - x[j].z * dnorm_norm_mean) * r;
      o.w += (w[j].w * g[j].w - dnorm_mean - x[j].w * dnorm_norm_mean) * r;
      *out = o;
    }
  }
  // The block's sums, warp 0's first and then each next warp's added in turn.
  for (int turn = 0; turn < kFusedWarps; ++turn) {
    if (warp == turn) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int c = 4 * (lane + 32 * j);
        float4* sw = reinterpret_cast<float4*>(&block_sums[0][c]);
        float4* sb = reinterpret_cast<float4*>(&block_sums[1][c]);
        if (turn == 0) {
          *sw = dw[j];
          *sb = db[j];
        } else {
          float4 a = *sw, b = *sb;
          *sw = make_float4(a.x + dw[j].x, a.y + dw[j].y, a.z + dw[j].z, a.w + dw[j].w);
          *sb = make_float4(b.x + db[j].x, b.y + db[j].y, b.z + db[j].z, b.w + db[j].w);
        }
      }
    }
    __syncthreads();
  }
  float* dst = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < C; c += 32 * kFusedWarps) {
    dst[c] = block_sums[0][c];
    dst[C + c] = block_sums[1][c];
  }
}

// (chunk, c) -> the fused kernel's partial sums of block `chunk`: {dweight's, dbias's}.
struct FusedPartials {
  const float* p;
  int C;
  __device__ void operator()(int chunk, int c, float (&v)[2]) const {
    v[0] = p[(2 * static_cast<size_t>(chunk)) * C + c];
    v[1] = p[(2 * static_cast<size_t>(chunk) + 1) * C + c];
  }
};

template <int kVecs>
void launch_layernorm_backward_fused(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                     const float* weight, const float* mean, const float* rstd, int N, int C) {
  const CudaContext& ctx = cuda_context();
  const int blocks = (N + kFusedRows - 1) / kFusedRows;
  DeviceScratch partials(sizeof(float) * static_cast<size_t>(blocks) * 2 * C);
  layernorm_backward_fused_kernel<kVecs><<<blocks, 32 * kFusedWarps, 0, ctx.compute>>>(
      dinp, partials.as<float>(), dout, inp, weight, mean, rstd, N, C);
  CUDA_CHECK_LAUNCH();
  launch_column_sums<2>(ColumnDsts<2>{{dweight, dbias}}, blocks, C, FusedPartials{partials.as<float>(), C});
}

// Whether the one-pass kernels (layernorm_forward_vec_kernel, layernorm_backward_fused_kernel) take these
// buffers: C a multiple of 4 up to max_c, every row 16-byte aligned (null: not used).
bool rows_fit_vectors(int C, int max_c, std::initializer_list<const void*> rows_of_c) {
  if (C % 4 != 0 || C > max_c) return false;
  for (const void* p : rows_of_c)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// (n, c) -> {dout * norm, dout}: the terms of dweight[c] and dbias[c].
struct LayernormParamGrads {
  const float* dout;
  const float* inp;
  const float* mean;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float (&v)[2]) const {
    const size_t i = static_cast<size_t>(n) * C + c;
    const float d = dout[i];
    v[0] = d * ((inp[i] - mean[n]) * rstd[n]);
    v[1] = d;
  }
};

}  // namespace

namespace {

// The forward into out as E: the one-pass kernel where the rows fit it, else the general one.
template <bool kResidual, typename E>
void launch_forward_as(E* out, float* mean, float* rstd, float* res, const float* inp, const float* inp2,
                       const float* weight, const float* bias, int N, int C) {
  const unsigned blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock, threads = 32 * kRowsPerBlock;
  const cudaStream_t s = cuda_context().compute;
  // The register rows come in 6 sizes (each lane's columns are guarded by c < C, so a larger one serves any
  // narrower row): GPT-2's widths 768, 1024, 1600 and 2048 take 6, 8, 16 and 16.
  auto vec = [&](auto vecs) {
    layernorm_forward_vec_kernel<decltype(vecs)::value, kResidual><<<blocks, threads, 0, s>>>(
        out, mean, rstd, res, inp, inp2, weight, bias, N, C);
    CUDA_CHECK_LAUNCH();
  };
  if (rows_fit_vectors(C, 128 * kMaxForwardVecs, {out, inp, weight, bias, inp2, res})) {
    const int need = (C + 127) / 128;
    if (need <= 2) return vec(std::integral_constant<int, 2>{});
    if (need <= 4) return vec(std::integral_constant<int, 4>{});
    if (need <= 6) return vec(std::integral_constant<int, 6>{});
    if (need <= 8) return vec(std::integral_constant<int, 8>{});
    if (need <= 12) return vec(std::integral_constant<int, 12>{});
    return vec(std::integral_constant<int, 16>{});
  }
  layernorm_forward_kernel<kResidual><<<blocks, threads, 0, s>>>(out, mean, rstd, res, inp, inp2, weight, bias, N, C);
  CUDA_CHECK_LAUNCH();
}

// The layernorm's out (hidden) in its form: bf16 where hidden_bf16 says, else fp32.
template <bool kResidual>
void launch_layernorm_forward(void* out, float* mean, float* rstd, float* res, const float* inp, const float* inp2,
                              const float* weight, const float* bias, int N, int C, MatmulPrecision precision) {
  if (N <= 0) return;
  if (hidden_bf16(C, precision))
    launch_forward_as<kResidual>(static_cast<__nv_bfloat16*>(out), mean, rstd, res, inp, inp2, weight, bias, N, C);
  else
    launch_forward_as<kResidual>(static_cast<float*>(out), mean, rstd, res, inp, inp2, weight, bias, N, C);
}

}  // namespace

void layernorm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, MatmulPrecision precision) {
  launch_layernorm_forward<false>(out, mean, rstd, nullptr, inp, nullptr, weight, bias, N, C, precision);
}

void residual_layernorm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1,
                                const float* inp2, const float* weight, const float* bias, int N, int C,
                                MatmulPrecision precision) {
  launch_layernorm_forward<true>(out, mean, rstd, res, inp1, inp2, weight, bias, N, C, precision);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  if (N <= 0) return;
  if (rows_fit_vectors(C, 1024, {dinp, dout, inp, weight})) {
    switch ((C + 127) / 128) {
      case 1: return launch_layernorm_backward_fused<1>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 2: return launch_layernorm_backward_fused<2>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 3: return launch_layernorm_backward_fused<3>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 4: return launch_layernorm_backward_fused<4>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 5: return launch_layernorm_backward_fused<5>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 6: return launch_layernorm_backward_fused<6>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 7: return launch_layernorm_backward_fused<7>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
      case 8: return launch_layernorm_backward_fused<8>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    }
  }
  const unsigned blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  layernorm_dinp_kernel<<<blocks, 32 * kRowsPerBlock, 0, cuda_context().compute>>>(dinp, dout, inp, weight, mean,
                                                                                    rstd, N, C);
  CUDA_CHECK_LAUNCH();
  launch_column_sums<2>(ColumnDsts<2>{{dweight, dbias}}, N, C, LayernormParamGrads{dout, inp, mean, rstd, C});
}

}  // namespace strata::kernels::cuda
