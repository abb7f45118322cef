// convert.h — fp32 <-> bf16 on the compute stream, round-to-nearest-even like common/dtype.h. Device pointers;
// n elements; asynchronous. convert.cu.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels::cuda {
void f32_to_bf16(uint16_t* out, const float* in, size_t n);
void bf16_to_f32(float* out, const uint16_t* in, size_t n);
}  // namespace strata::kernels::cuda
