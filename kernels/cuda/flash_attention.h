// flash_attention.h — causal attention on the tensor cores without the T×T matrix (flash_attention.cu), used by
// attention.cu for bf16 precision when the head size is supported. q, k, v are bf16 (as uint16_t) in head
// layout (B,NH,T,hs); `saved` holds what the backward needs: the log-sum-exp of each row's scaled scores
// (B,NH,T; padded to a multiple of 4 floats) and then the output (B,NH,T,hs), fp32.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels::cuda {

bool flash_attention_supported(int hs);  // 32, 64
size_t flash_attention_saved_floats(int B, int T, int NH, int hs);
// out (B,T,C) overwritten.
void flash_attention_forward(float* out, float* saved, const uint16_t* q, const uint16_t* k, const uint16_t* v, int B,
                             int T, int NH, int hs);
// dout (B,T,C) fp32, the gradient of out. ADDS dq, dk, dv into dqkv (B,T,3C), the gradient of the qkv the
// head-layout q, k, v were taken from.
void flash_attention_backward(float* dqkv, const float* dout, const float* saved, const uint16_t* q,
                              const uint16_t* k, const uint16_t* v, int B, int T, int NH, int hs);

}  // namespace strata::kernels::cuda
