// attention.cu — causal multi-head self-attention, forward and backward.
//
// qkv, out and their gradients are hidden activations (kernels.h): bf16 under bf16 precision where C is a
// multiple of 8, else fp32.
//
// bf16 precision with a head size of 32 or 64 (and fewer than 2^31 rows of B*NH*T): flash attention
// (flash_attention.cu), or with STRATA_ATTENTION=cudnn cuDNN's fused kernels (cudnn_attention.cpp) at any head size
// they run; neither forms the T×T matrix, and `att` holds only the rows' log-sum-exps (attention_saved_floats).
// Otherwise as llm.c's CUDA version does it: permute q, k, v to (B,NH,T,hs), batched
// cuBLAS GEMMs for QKᵀ and for att·V, a warp-per-row causal softmax, and `att` holds the probabilities
// (B,NH,T,T). On that path bf16 runs the four products on the tensor cores (the permutes and softmaxes write
// bf16 copies beside their fp32 results; the GEMMs accumulate and write fp32); fp32 keeps everything fp32
// (CUBLAS_COMPUTE_32F, no TF32).
//
// Column-major view used by the GEMMs: a row-major (T,hs) head slice is a column-major (hs,T) matrix with
// ld hs; a row-major (T,T) score matrix S is the column-major Sᵀ with ld T. Full T×T products are computed and
// the softmax masks the upper triangle (the masked half is wasted work, not wrong results).
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

// Element i of a (B,NH,T,hs) tensor -> the offset of the same (b, t, h, d) in a row-major (B,T,width) tensor,
// at column h*hs + d.
__device__ __forceinline__ size_t row_offset(size_t i, int T, int NH, int hs, int width) {
  const int d = static_cast<int>(i % hs);
  const int t = static_cast<int>((i / hs) % T);
  const int h = static_cast<int>((i / (static_cast<size_t>(hs) * T)) % NH);
  const size_t b = i / (static_cast<size_t>(hs) * T * NH);
  return (b * T + t) * width + static_cast<size_t>(h) * hs + d;
}

__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// qkv (B,T,3C), as In (float or bf16: hidden) -> q, k, v each (B,NH,T,hs), as E (float or bf16).
template <typename E, typename In>
__global__ void permute_qkv_kernel(E* q, E* k, E* v, const In* qkv, int B, int T, int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t src = row_offset(i, T, NH, hs, 3 * C);
    store(q + i, load(qkv + src));
    store(k + i, load(qkv + src + C));
    store(v + i, load(qkv + src + 2 * C));
  }
}

// The same into bf16 when hs is a multiple of 8: a thread per 8 consecutive columns of a (B,T) row of q, k and v
// (from fp32: two 16-byte loads each; from bf16: one), one 16-byte store each, without the per-element index
// arithmetic.
__device__ __forceinline__ uint4 load_bf16x8(const float* src) {
  const float4 lo = *reinterpret_cast<const float4*>(src);
  const float4 hi = *reinterpret_cast<const float4*>(src + 4);
  const __nv_bfloat162 p0 = __floats2bfloat162_rn(lo.x, lo.y), p1 = __floats2bfloat162_rn(lo.z, lo.w);
  const __nv_bfloat162 p2 = __floats2bfloat162_rn(hi.x, hi.y), p3 = __floats2bfloat162_rn(hi.z, hi.w);
  uint4 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&p0);
  packed.y = *reinterpret_cast<const uint32_t*>(&p1);
  packed.z = *reinterpret_cast<const uint32_t*>(&p2);
  packed.w = *reinterpret_cast<const uint32_t*>(&p3);
  return packed;
}
__device__ __forceinline__ uint4 load_bf16x8(const __nv_bfloat16* src) { return *reinterpret_cast<const uint4*>(src); }

template <typename In>
__global__ void permute_qkv_bf16x8_kernel(uint4* q, uint4* k, uint4* v, const In* qkv, int B, int T, int NH,
                                          int hs) {
  const int C = NH * hs, per_row = C / 8;
  const size_t total = static_cast<size_t>(B) * T * per_row;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t bt = i / per_row;
    const int c = static_cast<int>(i % per_row) * 8, h = c / hs, d = c % hs;
    const size_t b = bt / T, t = bt % T;
    const size_t dst = (((b * NH + h) * T + t) * hs + d) / 8;
    const In* src = qkv + bt * 3 * C + c;
    q[dst] = load_bf16x8(src);
    k[dst] = load_bf16x8(src + C);
    v[dst] = load_bf16x8(src + 2 * C);
  }
}

// Backward of the permute: dqkv (B,T,3C), as E (hidden) = dq, dk, dv (each (B,NH,T,hs)).
template <typename E>
__global__ void unpermute_dqkv_kernel(E* dqkv, const float* dq, const float* dk, const float* dv, int B, int T,
                                      int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t dst = row_offset(i, T, NH, hs, 3 * C);
    store(dqkv + dst, dq[i]);
    store(dqkv + dst + C, dk[i]);
    store(dqkv + dst + 2 * C, dv[i]);
  }
}

// y (B,NH,T,hs) -> out (B,T,C) as E (hidden), overwritten.
template <typename E>
__global__ void unpermute_out_kernel(E* out, const float* y, int B, int T, int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    store(out + row_offset(i, T, NH, hs, C), y[i]);
  }
}

// dout (B,T,C) as In (hidden) -> dy (B,NH,T,hs), as E.
template <typename E, typename In>
__global__ void permute_dout_kernel(E* dy, const In* dout, int B, int T, int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x)
    store(dy + i, load(dout + row_offset(i, T, NH, hs, C)));
}

// In place on att (B*NH rows of T,T), one warp per row t: softmax over columns 0..t of the (already scaled)
// scores, zeros after; also into att_bf16 when it is not null.
__global__ void causal_softmax_kernel(float* att, __nv_bfloat16* att_bf16, int rows, int T) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int t = r % T;
  float* row = att + static_cast<size_t>(r) * T;
  float mx = -INFINITY;
  for (int j = lane; j <= t; j += 32) mx = fmaxf(mx, row[j]);
  mx = warp_max(mx);
  float s = 0.0f;
  for (int j = lane; j <= t; j += 32) s += expf(row[j] - mx);
  const float inv = 1.0f / warp_sum(s);
  __nv_bfloat16* row_bf16 = att_bf16 ? att_bf16 + static_cast<size_t>(r) * T : nullptr;
  for (int j = lane; j < T; j += 32) {
    const float p = j <= t ? expf(row[j] - mx) * inv : 0.0f;
    row[j] = p;
    if (row_bf16) row_bf16[j] = __float2bfloat16_rn(p);
  }
}

// In place on datt: datt[t2] <- att[t2] * (datt[t2] - sum_{t3<=t} att[t3] datt[t3]) for t2 <= t, 0 after.
// With bf16 copies asked for, writes the result to dscores_bf16 (datt is then left as it was) and att to
// att_bf16, for the bf16 GEMMs that follow.
__global__ void causal_softmax_backward_kernel(float* datt, const float* att, __nv_bfloat16* dscores_bf16,
                                               __nv_bfloat16* att_bf16, int rows, int T) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int t = r % T;
  float* drow = datt + static_cast<size_t>(r) * T;
  const float* arow = att + static_cast<size_t>(r) * T;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += 32) dot += arow[j] * drow[j];
  dot = warp_sum(dot);
  if (dscores_bf16 == nullptr) {
    for (int j = lane; j < T; j += 32) drow[j] = j <= t ? arow[j] * (drow[j] - dot) : 0.0f;
    return;
  }
  const size_t base = static_cast<size_t>(r) * T;
  for (int j = lane; j < T; j += 32) {
    const float a = arow[j];
    dscores_bf16[base + j] = __float2bfloat16_rn(j <= t ? a * (drow[j] - dot) : 0.0f);
    att_bf16[base + j] = __float2bfloat16_rn(a);
  }
}

// Batched column-major GEMM over B*NH heads: inputs of type `ab` (fp32 or bf16), fp32 accumulation and output.
void batched_gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha, const void* a,
                  int lda, long long stride_a, const void* b, int ldb, long long stride_b, float* c, int ldc,
                  long long stride_c, int batch, cudaDataType_t ab) {
  const float beta = 0.0f;
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(cuda_context().blas, op_a, op_b, m, n, k, &alpha, a, ab, lda, stride_a, b,
                                          ab, ldb, stride_b, &beta, c, CUDA_R_32F, ldc, stride_c, batch,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

constexpr int kThreads = 256;

// qkv (B,T,3C; bf16 where `qkv_bf16`, the hidden form, else fp32) -> q, k, v (B,NH,T,hs each, n elements),
// rounded to bf16 or copied as fp32, for the batched GEMMs. q, k and v are 16-byte aligned (scratch is).
void permute_qkv(void* q, void* k, void* v, bool bf16, const void* qkv, bool qkv_bf16, int B, int T, int NH, int hs,
                 size_t n) {
  using bf = __nv_bfloat16;
  const cudaStream_t s = cuda_context().compute;
  const bool x8 = bf16 && hs % 8 == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
  auto* q8 = static_cast<uint4*>(q);
  auto* k8 = static_cast<uint4*>(k);
  auto* v8 = static_cast<uint4*>(v);
  if (x8 && qkv_bf16)
    permute_qkv_bf16x8_kernel<<<grid_for(n / 8, kThreads), kThreads, 0, s>>>(q8, k8, v8, static_cast<const bf*>(qkv),
                                                                             B, T, NH, hs);
  else if (x8)
    permute_qkv_bf16x8_kernel<<<grid_for(n / 8, kThreads), kThreads, 0, s>>>(
        q8, k8, v8, static_cast<const float*>(qkv), B, T, NH, hs);
  else if (bf16 && qkv_bf16)
    permute_qkv_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<bf*>(q), static_cast<bf*>(k),
                                                                  static_cast<bf*>(v), static_cast<const bf*>(qkv), B,
                                                                  T, NH, hs);
  else if (bf16)
    permute_qkv_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<bf*>(q), static_cast<bf*>(k),
                                                                  static_cast<bf*>(v), static_cast<const float*>(qkv),
                                                                  B, T, NH, hs);
  else  // fp32 products take fp32 activations (kF32: nothing is hidden in bf16)
    permute_qkv_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<float*>(q), static_cast<float*>(k),
                                                                  static_cast<float*>(v),
                                                                  static_cast<const float*>(qkv), B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

// The operands of the batched-GEMM path's products: fp32, or bf16 copies, sized for one (B,NH,T,hs) tensor each.
struct HeadTensors {
  bool bf16;
  size_t elem;
  DeviceScratch q, k, v;
  HeadTensors(bool bf16_, size_t n) : bf16(bf16_), elem(bf16_ ? 2 : 4), q(n * elem), k(n * elem), v(n * elem) {}
  void permute(const void* qkv, bool qkv_bf16, int B, int T, int NH, int hs, size_t n) {
    permute_qkv(q.as<void>(), k.as<void>(), v.as<void>(), bf16, qkv, qkv_bf16, B, T, NH, hs, n);
  }
  cudaDataType_t type() const { return bf16 ? CUDA_R_16BF : CUDA_R_32F; }
};

// The sizes both directions derive from (B, T, C, NH): head size, B*NH heads, B*T*C elements, and the batched
// GEMMs' strides between heads for a (T,hs) slice and a (T,T) score matrix.
struct Dims {
  int hs, batch;
  size_t n;
  long long head, square;
  static Dims of(int B, int T, int C, int NH) {
    const int hs = C / NH;
    return {hs, B * NH, static_cast<size_t>(B) * T * C, static_cast<long long>(T) * hs, static_cast<long long>(T) * T};
  }
};

// What runs a shape. The fused ones (flash, cuDNN) save only the rows' log-sum-exps, the batched GEMMs the
// probabilities.
enum class Path { kFlash, kCudnn, kGemms };

// bf16 with fewer than 2^31 rows of B*NH*T (indexed with an int): cuDNN's fused kernels where they are chosen
// (cudnn_attention.h) and run the shape, at any head size that keeps rows 16-byte aligned; else the flash kernels
// at head sizes 32 and 64 while their grid holds the sequence's tiles of 64 (y: at most 65535 blocks); else the
// batched GEMMs (which would need T*T floats a head anyway). The same answer every time for a shape (cuDNN's is
// kept), so the forward, the backward and what is saved between them agree.
Path path_for(int B, int T, int C, int NH, MatmulPrecision precision) {
  if (precision != MatmulPrecision::kBF16 || static_cast<long long>(B) * NH * T >= (1ll << 31)) return Path::kGemms;
  const int hs = C / NH;
  if (hs % 8 == 0 && cudnn_attention_chosen() && cudnn_attention_runs(B, T, NH, hs)) return Path::kCudnn;
  if (flash_attention_supported(hs) && T <= 65535ll * 64) return Path::kFlash;
  return Path::kGemms;
}

}  // namespace

size_t attention_saved_floats(int B, int T, int C, int NH, MatmulPrecision precision) {
  if (path_for(B, T, C, NH, precision) != Path::kGemms) return flash_attention_saved_floats(B, T, NH, C / NH);
  return static_cast<size_t>(B) * NH * T * T;
}

void attention_forward(void* out, float* att, const void* qkv, int B, int T, int C, int NH, int NKV,
                       MatmulPrecision precision) {
  STRATA_ASSERT_MSG(NKV == NH, "the CUDA attention has no grouped-query form yet (num_key_value_heads < heads)");
  if (B <= 0 || T <= 0) return;
  const CudaContext& ctx = cuda_context();
  const bool bf16 = precision == MatmulPrecision::kBF16, hidden16 = hidden_bf16(C, precision);
  const auto [hs, batch, n, head, square] = Dims::of(B, T, C, NH);
  if (const Path path = path_for(B, T, C, NH, precision); path != Path::kGemms) {  // q, k, v read in place
    STRATA_ASSERT_MSG(hidden16, "fused attention takes bf16 activations (a head size that is a multiple of 8 makes "
                                "C % 8 == 0)");
    auto* out16 = static_cast<uint16_t*>(out);
    const auto* qkv16 = static_cast<const uint16_t*>(qkv);
    if (path == Path::kCudnn)
      cudnn_attention_forward(out16, qkv16, att, B, T, NH, hs);
    else
      flash_attention_forward(out16, qkv16, att, B, T, NH, hs);
    return;
  }
  HeadTensors h(bf16, n);
  h.permute(qkv, hidden16, B, T, NH, hs, n);
  DeviceScratch y(n * sizeof(float)), att_bf16(bf16 ? batch * square * 2 : 0);
  // scores Sᵀ (T,T) = K (hs,T)ᵀ · Q (hs,T), scaled by 1/sqrt(hs)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  batched_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, h.k.as<void>(), hs, head, h.q.as<void>(), hs, head, att, T,
               square, batch, h.type());
  const int rows = batch * T, warps = kThreads / 32;
  causal_softmax_kernel<<<(rows + warps - 1) / warps, kThreads, 0, ctx.compute>>>(
      att, bf16 ? att_bf16.as<__nv_bfloat16>() : nullptr, rows, T);
  CUDA_CHECK_LAUNCH();
  // yᵀ (hs,T) = Vᵀ (hs,T) · attᵀ (T,T)
  const void* probs = bf16 ? att_bf16.as<void>() : static_cast<const void*>(att);
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, h.v.as<void>(), hs, head, probs, T, square, y.as<float>(), hs,
               head, batch, h.type());
  if (hidden16)
    unpermute_out_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(static_cast<__nv_bfloat16*>(out),
                                                                              y.as<float>(), B, T, NH, hs);
  else
    unpermute_out_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(static_cast<float*>(out), y.as<float>(),
                                                                              B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* att, int B,
                        int T, int C, int NH, int NKV, MatmulPrecision precision) {
  STRATA_ASSERT_MSG(NKV == NH, "the CUDA attention has no grouped-query form yet (num_key_value_heads < heads)");
  if (B <= 0 || T <= 0) return;
  using bf = __nv_bfloat16;
  const CudaContext& ctx = cuda_context();
  const bool bf16 = precision == MatmulPrecision::kBF16, hidden16 = hidden_bf16(C, precision);
  const auto [hs, batch, n, head, square] = Dims::of(B, T, C, NH);
  if (const Path path = path_for(B, T, C, NH, precision); path != Path::kGemms) {  // writes dqkv itself
    auto* dqkv16 = static_cast<uint16_t*>(dqkv);
    const auto *dout16 = static_cast<const uint16_t*>(dout), *qkv16 = static_cast<const uint16_t*>(qkv),
               *out16 = static_cast<const uint16_t*>(out);
    if (path == Path::kCudnn)
      cudnn_attention_backward(dqkv16, dout16, qkv16, out16, att, B, T, NH, hs);
    else
      flash_attention_backward(dqkv16, dout16, qkv16, out16, att, B, T, NH, hs);
    return;
  }
  HeadTensors h(bf16, n);
  h.permute(qkv, hidden16, B, T, NH, hs, n);
  DeviceScratch dy(n * h.elem), dq(n * sizeof(float)), dk(n * sizeof(float)), dv(n * sizeof(float));
  DeviceScratch datt(static_cast<size_t>(batch) * square * sizeof(float));
  const size_t probs_bf16_bytes = bf16 ? static_cast<size_t>(batch) * square * 2 : 0;
  DeviceScratch dscores_bf16(probs_bf16_bytes), att_bf16(probs_bf16_bytes);
  const dim3 elems = grid_for(n, kThreads);
  if (bf16 && hidden16)
    permute_dout_kernel<<<elems, kThreads, 0, ctx.compute>>>(dy.as<bf>(), static_cast<const bf*>(dout), B, T, NH, hs);
  else if (bf16)
    permute_dout_kernel<<<elems, kThreads, 0, ctx.compute>>>(dy.as<bf>(), static_cast<const float*>(dout), B, T, NH,
                                                            hs);
  else
    permute_dout_kernel<<<elems, kThreads, 0, ctx.compute>>>(dy.as<float>(), static_cast<const float*>(dout), B, T,
                                                            NH, hs);
  CUDA_CHECK_LAUNCH();
  // datt[t][t2] = dy[t] · v[t2]: the same form as the scores.
  batched_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, h.v.as<void>(), hs, head, dy.as<void>(), hs, head,
               datt.as<float>(), T, square, batch, h.type());
  const int rows = batch * T, warps = kThreads / 32;
  causal_softmax_backward_kernel<<<(rows + warps - 1) / warps, kThreads, 0, ctx.compute>>>(
      datt.as<float>(), att, bf16 ? dscores_bf16.as<bf>() : nullptr, bf16 ? att_bf16.as<bf>() : nullptr, rows, T);
  CUDA_CHECK_LAUNCH();
  const void* probs = bf16 ? att_bf16.as<void>() : static_cast<const void*>(att);
  const void* dscores = bf16 ? dscores_bf16.as<void>() : datt.as<void>();
  // dv[t2] = sum_t att[t][t2] dy[t]:  dvᵀ (hs,T) = dyᵀ (hs,T) · att (T,T)
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, dy.as<void>(), hs, head, probs, T, square, dv.as<float>(), hs,
               head, batch, h.type());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // dq[t] = scale * sum_t2 dscores[t][t2] k[t2]: the form of y = att · v.
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, scale, h.k.as<void>(), hs, head, dscores, T, square,
               dq.as<float>(), hs, head, batch, h.type());
  // dk[t2] = scale * sum_t dscores[t][t2] q[t]: the form of dv.
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, scale, h.q.as<void>(), hs, head, dscores, T, square,
               dk.as<float>(), hs, head, batch, h.type());
  if (hidden16)
    unpermute_dqkv_kernel<<<elems, kThreads, 0, ctx.compute>>>(static_cast<bf*>(dqkv), dq.as<float>(), dk.as<float>(),
                                                               dv.as<float>(), B, T, NH, hs);
  else
    unpermute_dqkv_kernel<<<elems, kThreads, 0, ctx.compute>>>(static_cast<float*>(dqkv), dq.as<float>(),
                                                               dk.as<float>(), dv.as<float>(), B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
