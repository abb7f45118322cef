// gelu.cu — GELU, tanh approximation (GPT-2's, torch's approximate='tanh'), forward and backward, over fp32 and
// (the MLP's hidden activations under bf16) over bf16.
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ __forceinline__ float gelu(float x) {
  const float cube = 0.044715f * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}
// d gelu(x) / dx.
__device__ __forceinline__ float gelu_slope(float x) {
  const float cube = 0.044715f * x * x * x;
  const float th = tanhf(kGeluScale * (x + cube));
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

__global__ void gelu_forward_kernel(float* out, const float* inp, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = gelu(inp[i]);
  }
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    dinp[i] += gelu_slope(inp[i]) * dout[i];
  }
}

__global__ void gelu_forward_bf16_kernel(uint16_t* out, const uint16_t* inp, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = float_to_bf16_bits(gelu(bf16_bits_to_float(inp[i])));
  }
}

__global__ void gelu_backward_bf16_kernel(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    dinp[i] = float_to_bf16_bits(gelu_slope(bf16_bits_to_float(inp[i])) * bf16_bits_to_float(dout[i]));
  }
}

}  // namespace

void gelu_forward_bf16(uint16_t* out, const uint16_t* inp, size_t n) {
  if (n == 0) return;
  gelu_forward_bf16_kernel<<<grid_for(n, 256), 256, 0, cuda_context().compute>>>(out, inp, n);
  CUDA_CHECK_LAUNCH();
}

void gelu_backward_bf16(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, size_t n) {
  if (n == 0) return;
  gelu_backward_bf16_kernel<<<grid_for(n, 256), 256, 0, cuda_context().compute>>>(dinp, inp, dout, n);
  CUDA_CHECK_LAUNCH();
}

void gelu_forward(float* out, const float* inp, size_t N) {
  if (N == 0) return;
  gelu_forward_kernel<<<grid_for(N, 256), 256, 0, cuda_context().compute>>>(out, inp, N);
  CUDA_CHECK_LAUNCH();
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N) {
  if (N == 0) return;
  gelu_backward_kernel<<<grid_for(N, 256), 256, 0, cuda_context().compute>>>(dinp, inp, dout, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
