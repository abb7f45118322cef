// residual.cu — the residual add, forward and backward (elementwise, grid-stride).
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

__global__ void residual_forward_kernel(float* out, const float* inp1, const float* inp2, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = inp1[i] + inp2[i];
}

__global__ void residual_backward_kernel(float* dinp1, float* dinp2, const float* dout, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float d = dout[i];
    dinp1[i] += d;
    dinp2[i] += d;
  }
}

}  // namespace

void residual_forward(float* out, const float* inp1, const float* inp2, size_t N) {
  if (N == 0) return;
  residual_forward_kernel<<<grid_for(N, 256), 256, 0, cuda_context().compute>>>(out, inp1, inp2, N);
  CUDA_CHECK_LAUNCH();
}

void residual_backward(float* dinp1, float* dinp2, const float* dout, size_t N) {
  if (N == 0) return;
  residual_backward_kernel<<<grid_for(N, 256), 256, 0, cuda_context().compute>>>(dinp1, dinp2, dout, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
