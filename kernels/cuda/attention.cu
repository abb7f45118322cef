// attention.cu — causal multi-head self-attention, forward and backward, as llm.c's CUDA version does it:
// permute q, k, v to (B,NH,T,hs), batched cuBLAS GEMMs for QKᵀ and for att·V, and a warp-per-row causal
// softmax. The saved probabilities att (B,NH,T,T) are the KernelSet's contract (kernels.h); a flash-style kernel
// that never materializes them needs a different slot and is the next step for long contexts.
//
// Column-major view used by the GEMMs: a row-major (T,hs) head slice is a column-major (hs,T) matrix with
// ld hs; a row-major (T,T) score matrix S is the column-major Sᵀ with ld T. Full T×T products are computed and
// the softmax masks the upper triangle (the masked half is wasted work, not wrong results).
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
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

// qkv (B,T,3C) -> q, k, v each (B,NH,T,hs).
__global__ void permute_qkv_kernel(float* q, float* k, float* v, const float* qkv, int B, int T, int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t src = row_offset(i, T, NH, hs, 3 * C);
    q[i] = qkv[src];
    k[i] = qkv[src + C];
    v[i] = qkv[src + 2 * C];
  }
}

// Backward of the permute: dqkv (B,T,3C) += dq, dk, dv (each (B,NH,T,hs)).
__global__ void unpermute_dqkv_kernel(float* dqkv, const float* dq, const float* dk, const float* dv, int B, int T,
                                      int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t dst = row_offset(i, T, NH, hs, 3 * C);
    dqkv[dst] += dq[i];
    dqkv[dst + C] += dk[i];
    dqkv[dst + 2 * C] += dv[i];
  }
}

// y (B,NH,T,hs) -> out (B,T,C) (overwrite), or dout (B,T,C) -> dy (B,NH,T,hs) when kToHeads.
template <bool kToHeads>
__global__ void permute_heads_kernel(float* dst, const float* src, int B, int T, int NH, int hs) {
  const size_t total = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t flat = row_offset(i, T, NH, hs, C);
    if (kToHeads)
      dst[i] = src[flat];
    else
      dst[flat] = src[i];
  }
}

// In place on att (B*NH rows of T,T), one warp per row t: softmax over columns 0..t of the (already scaled)
// scores, zeros after.
__global__ void causal_softmax_kernel(float* att, int rows, int T) {
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
  for (int j = lane; j < T; j += 32) row[j] = j <= t ? expf(row[j] - mx) * inv : 0.0f;
}

// In place on datt: datt[t2] <- att[t2] * (datt[t2] - sum_{t3<=t} att[t3] datt[t3]) for t2 <= t, 0 after.
__global__ void causal_softmax_backward_kernel(float* datt, const float* att, int rows, int T) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int t = r % T;
  float* drow = datt + static_cast<size_t>(r) * T;
  const float* arow = att + static_cast<size_t>(r) * T;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += 32) dot += arow[j] * drow[j];
  dot = warp_sum(dot);
  for (int j = lane; j < T; j += 32) drow[j] = j <= t ? arow[j] * (drow[j] - dot) : 0.0f;
}

// Batched column-major GEMM over B*NH heads with fp32 arithmetic.
void batched_gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha, const float* a,
                  int lda, long long stride_a, const float* b, int ldb, long long stride_b, float* c, int ldc,
                  long long stride_c, int batch) {
  const float beta = 0.0f;
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(cuda_context().blas, op_a, op_b, m, n, k, &alpha, a, CUDA_R_32F, lda,
                                          stride_a, b, CUDA_R_32F, ldb, stride_b, &beta, c, CUDA_R_32F, ldc, stride_c,
                                          batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

constexpr int kThreads = 256;

}  // namespace

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0) return;
  const CudaContext& ctx = cuda_context();
  const int hs = C / NH, batch = B * NH;
  const size_t n = static_cast<size_t>(B) * T * C;
  const long long head = static_cast<long long>(T) * hs, square = static_cast<long long>(T) * T;
  DeviceScratch q(n * sizeof(float)), k(n * sizeof(float)), v(n * sizeof(float)), y(n * sizeof(float));
  permute_qkv_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(q.as<float>(), k.as<float>(),
                                                                          v.as<float>(), qkv, B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
  // scores Sᵀ (T,T) = K (hs,T)ᵀ · Q (hs,T), scaled by 1/sqrt(hs)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  batched_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, k.as<float>(), hs, head, q.as<float>(), hs, head, att, T,
               square, batch);
  const int rows = batch * T, warps = kThreads / 32;
  causal_softmax_kernel<<<(rows + warps - 1) / warps, kThreads, 0, ctx.compute>>>(att, rows, T);
  CUDA_CHECK_LAUNCH();
  // yᵀ (hs,T) = Vᵀ (hs,T) · attᵀ (T,T)
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, v.as<float>(), hs, head, att, T, square, y.as<float>(), hs,
               head, batch);
  permute_heads_kernel<false><<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(out, y.as<float>(), B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                        int NH) {
  if (B <= 0 || T <= 0) return;
  const CudaContext& ctx = cuda_context();
  const int hs = C / NH, batch = B * NH;
  const size_t n = static_cast<size_t>(B) * T * C;
  const long long head = static_cast<long long>(T) * hs, square = static_cast<long long>(T) * T;
  DeviceScratch q(n * sizeof(float)), k(n * sizeof(float)), v(n * sizeof(float)), dy(n * sizeof(float));
  DeviceScratch dq(n * sizeof(float)), dk(n * sizeof(float)), dv(n * sizeof(float));
  DeviceScratch datt(static_cast<size_t>(batch) * square * sizeof(float));
  permute_qkv_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(q.as<float>(), k.as<float>(),
                                                                          v.as<float>(), qkv, B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
  permute_heads_kernel<true><<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(dy.as<float>(), dout, B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
  // datt[t][t2] = dy[t] · v[t2]: the same form as the scores.
  batched_gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, v.as<float>(), hs, head, dy.as<float>(), hs, head,
               datt.as<float>(), T, square, batch);
  // dv[t2] = sum_t att[t][t2] dy[t]:  dvᵀ (hs,T) = dyᵀ (hs,T) · att (T,T)
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, dy.as<float>(), hs, head, att, T, square, dv.as<float>(), hs,
               head, batch);
  const int rows = batch * T, warps = kThreads / 32;
  causal_softmax_backward_kernel<<<(rows + warps - 1) / warps, kThreads, 0, ctx.compute>>>(datt.as<float>(), att,
                                                                                           rows, T);
  CUDA_CHECK_LAUNCH();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // dq[t] = scale * sum_t2 dpre[t][t2] k[t2]: the form of y = att · v.
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, scale, k.as<float>(), hs, head, datt.as<float>(), T, square,
               dq.as<float>(), hs, head, batch);
  // dk[t2] = scale * sum_t dpre[t][t2] q[t]: the form of dv.
  batched_gemm(CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, scale, q.as<float>(), hs, head, datt.as<float>(), T, square,
               dk.as<float>(), hs, head, batch);
  unpermute_dqkv_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.compute>>>(dqkv, dq.as<float>(), dk.as<float>(),
                                                                             dv.as<float>(), B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
