// flash_attention.h — causal attention on the tensor cores without the T×T matrix (flash_attention.cu), used by
// attention.cu for bf16 precision when the head size is supported. `saved` holds everything the backward needs:
// the log-sum-exp of each row's scaled scores (B,NH,T; padded to a multiple of 4 floats), the output (B,NH,T,hs)
// in fp32, and the products' operands q, k, v in bf16 (as uint16_t) in head layout (B,NH,T,hs), which the
// forward's caller writes (flash_attention_saved_qkv) and the backward reads again instead of permuting and
// rounding qkv a second time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels::cuda {

bool flash_attention_supported(int hs);  // 32, 64
size_t flash_attention_saved_floats(int B, int T, int NH, int hs);
// Where q, k and v lie in `saved` (each 16-byte aligned).
struct FlashQkv {
  uint16_t *q, *k, *v;
};
FlashQkv flash_attention_saved_qkv(float* saved, int B, int T, int NH, int hs);
// out (B,T,C) in bf16 overwritten; saved's q, k, v already written.
void flash_attention_forward(uint16_t* out, float* saved, int B, int T, int NH, int hs);
// dout (B,T,C) in bf16, the gradient of out. dqkv (B,T,3C) in bf16, the gradient of the qkv that saved's q, k, v
// were taken from, overwritten: every element stored once (no read, no atomics).
void flash_attention_backward(uint16_t* dqkv, const uint16_t* dout, const float* saved, int B, int T, int NH,
                              int hs);

}  // namespace strata::kernels::cuda
