// convert.cu — fp32 <-> bf16 on the compute stream (round-to-nearest-even, NaN kept NaN), as common/dtype.h does
// on the CPU. The bf16 matmul path rounds its operands with it.
#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/ops.h"

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

// One block per row (grid-stride over rows): columns past `cols` are written as zeros. Four columns per thread
// step with 16-byte loads and 8-byte stores where the row strides allow it (GPT-2's widths do), else one; 32-bit
// indices within a row, so no 64-bit division per element.
__global__ void f32_to_bf16_rows_kernel(__nv_bfloat16* out, size_t ld_out, const float* in, size_t ld_in, int cols,
                                        int rows, bool vec4) {
  const int width = static_cast<int>(ld_out);
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* src = in + r * ld_in;
    __nv_bfloat16* dst = out + r * ld_out;
    if (vec4) {
      for (int c = 4 * threadIdx.x; c < width; c += 4 * blockDim.x) {
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c < cols) v = *reinterpret_cast<const float4*>(src + c);
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(dst + c) = packed;
      }
    } else {
      for (int c = threadIdx.x; c < width; c += blockDim.x)
        dst[c] = c < cols ? __float2bfloat16_rn(src[c]) : __float2bfloat16_rn(0.0f);
    }
  }
}

// One block per row (grid-stride over rows). The source rows are 16-byte aligned (the GEMM's padded output), the
// destination's generally not (an odd width): 16-byte loads, 4-byte stores, which coalesce all the same.
__global__ void copy_rows_kernel(float* out, size_t ld_out, const float* in, size_t ld_in, int cols, int rows,
                                 bool vec4) {
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* src = in + r * ld_in;
    float* dst = out + r * ld_out;
    if (vec4) {
      const int full = cols / 4 * 4;
      for (int c = 4 * threadIdx.x; c < full; c += 4 * blockDim.x) {
        const float4 v = *reinterpret_cast<const float4*>(src + c);
        dst[c] = v.x;
        dst[c + 1] = v.y;
        dst[c + 2] = v.z;
        dst[c + 3] = v.w;
      }
      for (int c = full + threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
    } else {
      for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
    }
  }
}

}  // namespace

void copy_rows(float* out, size_t ld_out, const float* in, size_t ld_in, size_t rows, size_t cols) {
  if (rows == 0 || cols == 0) return;
  const bool vec4 = ld_in % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(rows, 65535));
  copy_rows_kernel<<<blocks, 256, 0, cuda_context().compute>>>(out, ld_out, in, ld_in, static_cast<int>(cols),
                                                               static_cast<int>(rows), vec4);
  CUDA_CHECK_LAUNCH();
}

void f32_to_bf16_rows(uint16_t* out, size_t ld_out, const float* in, size_t ld_in, size_t rows, size_t cols) {
  if (rows == 0 || ld_out == 0) return;
  const bool vec4 = ld_in % 4 == 0 && cols % 4 == 0 && ld_out % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(rows, 65535));
  f32_to_bf16_rows_kernel<<<blocks, 256, 0, cuda_context().compute>>>(reinterpret_cast<__nv_bfloat16*>(out), ld_out,
                                                                       in, ld_in, static_cast<int>(cols),
                                                                       static_cast<int>(rows), vec4);
  CUDA_CHECK_LAUNCH();
}

void weights_to_bf16(uint16_t* out, const float* in, size_t n) { f32_to_bf16(out, in, n); }

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
