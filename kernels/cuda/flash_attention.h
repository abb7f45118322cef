// flash_attention.h — causal attention on the tensor cores without the T×T matrix (flash_attention.cu), used by
// attention.cu for bf16 precision when the head size is supported. The kernels read q, k and v in place from
// qkv (B,T,3C) in bf16, and the output's gradient from (B,T,C) in bf16 (the hidden form, kernels.h): no pass
// permutes them into head layout. The forward saves the log-sum-exp of each row's scaled scores (`lse`: B,NH,T,
// padded to a multiple of 4 floats), the backward's only input besides qkv, the output and its gradient.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels::cuda {

bool flash_attention_supported(int hs);  // 32, 64
// How many blocks of each hs-64 kernel a multiprocessor is to hold: kDefault leaves the registers to the compiler
// (on sm_90 3, 2 and 3 blocks of the forward, dK/dV and dQ kernels); kHigh caps them for 4, 3 and 4 (32 to 112
// bytes of spill loads each). The kernels look latency-bound (about a fifth of their roofline), so more resident warps
// may pay; until a GPU says which is faster, both are built and STRATA_FLASH_OCCUPANCY=default|high (read at the
// first call; anything else stops the process naming it) chooses. The same arithmetic either way: bitwise the
// same results. set_ overrides it (tests).
enum class FlashOccupancy { kDefault = 0, kHigh = 1 };
FlashOccupancy flash_attention_occupancy();
void set_flash_attention_occupancy(FlashOccupancy occupancy);
size_t flash_attention_saved_floats(int B, int T, int NH, int hs);
// out (B,T,C) in bf16 overwritten, from qkv (B,T,3C) in bf16; both 16-byte aligned.
void flash_attention_forward(uint16_t* out, const uint16_t* qkv, float* lse, int B, int T, int NH, int hs);
// dout (B,T,C) in bf16, the gradient of out. dqkv (B,T,3C) in bf16, the gradient of qkv, overwritten: every
// element stored once (no read, no atomics).
void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int hs);

}  // namespace strata::kernels::cuda
