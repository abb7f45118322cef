// convert.cu — fp32 <-> bf16 on the compute stream (round-to-nearest-even, NaN kept NaN), as common/dtype.h does
// on the CPU. The bf16 matmul path rounds its operands with it.
#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/convert.h"

namespace strata::kernels::cuda {
namespace {

__global__ void f32_to_bf16_kernel(__nv_bfloat16* out, const float* in, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void bf16_to_f32_kernel(float* out, const __nv_bfloat16* in, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

}  // namespace

void f32_to_bf16(uint16_t* out, const float* in, size_t n) {
  if (n == 0) return;
  f32_to_bf16_kernel<<<grid_for(n, 256), 256, 0, cuda_context().compute>>>(reinterpret_cast<__nv_bfloat16*>(out), in,
                                                                             n);
  CUDA_CHECK_LAUNCH();
}

void bf16_to_f32(float* out, const uint16_t* in, size_t n) {
  if (n == 0) return;
  bf16_to_f32_kernel<<<grid_for(n, 256), 256, 0, cuda_context().compute>>>(
      out, reinterpret_cast<const __nv_bfloat16*>(in), n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
