// gelu.cu — GELU, tanh approximation (GPT-2's, torch's approximate='tanh'), forward and backward, over fp32 and
// (the MLP's hidden activations under bf16) over bf16.
#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__global__ void gelu_forward_kernel(float* out, const float* inp, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
  }
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    const float th = tanhf(kGeluScale * (x + cube));
    const float sech2 = 1.0f - th * th;
    const float local = 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += local * dout[i];
  }
}

__device__ __forceinline__ float from_bf16(uint16_t h) { return __uint_as_float(uint32_t{h} << 16); }
__device__ __forceinline__ uint16_t to_bf16(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

__global__ void gelu_forward_bf16_kernel(uint16_t* out, const uint16_t* inp, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float x = from_bf16(inp[i]);
    const float cube = 0.044715f * x * x * x;
    out[i] = to_bf16(0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube))));
  }
}

__global__ void gelu_backward_bf16_kernel(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float x = from_bf16(inp[i]);
    const float cube = 0.044715f * x * x * x;
    const float th = tanhf(kGeluScale * (x + cube));
    const float sech2 = 1.0f - th * th;
    const float local = 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = to_bf16(local * from_bf16(dout[i]));
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
