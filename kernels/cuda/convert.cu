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

// Over rows × ld_out: columns past `cols` are written as zeros.
__global__ void f32_to_bf16_rows_kernel(__nv_bfloat16* out, size_t ld_out, const float* in, size_t ld_in, size_t cols,
                                        size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const size_t r = i / ld_out, c = i % ld_out;
    out[i] = c < cols ? __float2bfloat16_rn(in[r * ld_in + c]) : __float2bfloat16_rn(0.0f);
  }
}

}  // namespace

void f32_to_bf16_rows(uint16_t* out, size_t ld_out, const float* in, size_t ld_in, size_t rows, size_t cols) {
  const size_t n = rows * ld_out;
  if (n == 0) return;
  f32_to_bf16_rows_kernel<<<grid_for(n, 256), 256, 0, cuda_context().compute>>>(
      reinterpret_cast<__nv_bfloat16*>(out), ld_out, in, ld_in, cols, n);
  CUDA_CHECK_LAUNCH();
}

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
