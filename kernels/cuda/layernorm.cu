// layernorm.cu — layernorm forward (also fused with the residual add before it) and backward, one warp per row
// (torch.nn.LayerNorm: biased variance, eps 1e-5 inside the square root). The weight and bias gradients are
// column sums over rows, done by the deterministic two-pass reduction of reduce.cuh.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block

// kResidual: the row is inp + inp2, written to `res` as it is summed; the two later passes read back only what
// the same thread wrote there (residual_layernorm_forward: one kernel instead of an add and a layernorm, the sum
// read once from memory instead of twice, with the same arithmetic).
template <bool kResidual>
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, float* res, const float* inp,
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
  float* o = out + static_cast<size_t>(n) * C;
  for (int i = lane; i < C; i += 32) o[i] = r * (x[i] - m) * weight[i] + bias[i];
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

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C) {
  if (N <= 0) return;
  const unsigned blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  layernorm_forward_kernel<false><<<blocks, 32 * kRowsPerBlock, 0, cuda_context().compute>>>(
      out, mean, rstd, nullptr, inp, nullptr, weight, bias, N, C);
  CUDA_CHECK_LAUNCH();
}

void residual_layernorm_forward(float* res, float* out, float* mean, float* rstd, const float* inp1,
                                const float* inp2, const float* weight, const float* bias, int N, int C) {
  if (N <= 0) return;
  const unsigned blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  layernorm_forward_kernel<true><<<blocks, 32 * kRowsPerBlock, 0, cuda_context().compute>>>(
      out, mean, rstd, res, inp1, inp2, weight, bias, N, C);
  CUDA_CHECK_LAUNCH();
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  if (N <= 0) return;
  const unsigned blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  layernorm_dinp_kernel<<<blocks, 32 * kRowsPerBlock, 0, cuda_context().compute>>>(dinp, dout, inp, weight, mean,
                                                                                    rstd, N, C);
  CUDA_CHECK_LAUNCH();
  launch_column_sums<2>(ColumnDsts<2>{{dweight, dbias}}, N, C, LayernormParamGrads{dout, inp, mean, rstd, C});
}

}  // namespace strata::kernels::cuda
