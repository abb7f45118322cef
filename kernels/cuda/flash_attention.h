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
size_t flash_attention_saved_floats(int B, int T, int NH, int hs);
// out (B,T,C) in bf16 overwritten, from qkv (B,T,3C) in bf16; both 16-byte aligned.
void flash_attention_forward(uint16_t* out, const uint16_t* qkv, float* lse, int B, int T, int NH, int hs);
// dout (B,T,C) in bf16, the gradient of out. dqkv (B,T,3C) in bf16, the gradient of qkv, overwritten: every
// element stored once (no read, no atomics).
void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int hs);

}  // namespace strata::kernels::cuda
