// bf16.cuh — bf16 held as its 16 bits (uint16_t, as the KernelSet's backend-form buffers carry it) to and from
// fp32 in device code: widening is exact, narrowing rounds to nearest even (as common/dtype.h on the CPU).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace strata::kernels::cuda {

__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float(uint32_t{h} << 16); }
__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

}  // namespace strata::kernels::cuda
