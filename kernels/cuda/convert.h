// convert.h — fp32 <-> bf16 on the compute stream, round-to-nearest-even like common/dtype.h. Device pointers;
// n elements; asynchronous. convert.cu.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels::cuda {
void f32_to_bf16(uint16_t* out, const float* in, size_t n);
void bf16_to_f32(float* out, const uint16_t* in, size_t n);
// A row-major (rows, cols) fp32 matrix with row stride ld_in into bf16 with row stride ld_out >= cols, the
// padding columns written as zeros: aligns the rows of an odd-width operand for the tensor cores.
void f32_to_bf16_rows(uint16_t* out, size_t ld_out, const float* in, size_t ld_in, size_t rows, size_t cols);
// The first `cols` columns of a row-major fp32 matrix with row stride ld_in into one with row stride ld_out:
// un-pads the rows of an aligned GEMM output (cudaMemcpy2DAsync between device buffers is slower).
void copy_rows(float* out, size_t ld_out, const float* in, size_t ld_in, size_t rows, size_t cols);
}  // namespace strata::kernels::cuda
