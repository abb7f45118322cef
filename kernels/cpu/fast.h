// fast.h — the fast CPU backend: oneDNN matmuls, TBB across cores, AVX-512/AVX2 loops.
//
// Same signatures and semantics as the KernelSet slots in kernels/kernels.h (read the conventions there);
// checked against kernels/cpu/reference.h with the tolerances stated in tests/kernels/. Parallel work runs in
// the current TBB arena. Safe to call from several threads on disjoint outputs.
#pragma once

#include "common/dtype.h"
#include "kernels/kernels.h"

namespace strata::kernels::cpu::fast {

void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_start, int vocab_rows);
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C,
                      int vocab_start, int vocab_rows);
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C);
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C, float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int N, int C);
void qk_norm_forward(float* out, float* rstd, const float* inp, const float* qweight, const float* kweight, int N,
                     int NH, int NKV, int hs, float eps);
void qk_norm_backward(float* dinp, float* dqweight, float* dkweight, const float* dout, const float* inp,
                      const float* qweight, const float* kweight, const float* rstd, int N, int NH, int NKV, int hs);
void rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs);
void rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs);
void swiglu_forward(float* out, const float* inp, int N, int H);
void swiglu_backward(float* dinp, const float* dout, const float* inp, int N, int H);
void matmul_forward(float* out, const float* inp, Weight weight, const float* bias, int N, int C, int OC,
                    MatmulPrecision precision);
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     Weight weight, int N, int C, int OC, MatmulPrecision precision);
// out (n) = in rounded to bf16 (f32_to_bf16's bits) on every core: the working copies the matmuls above use.
void weights_to_bf16(uint16_t* out, const float* in, size_t n);
// fp32 arithmetic whatever the precision.
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, int NKV,
                       MatmulPrecision precision = MatmulPrecision::kF32);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                        int NH, int NKV, MatmulPrecision precision = MatmulPrecision::kF32);
void gelu_forward(float* out, const float* inp, size_t N);
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N);
void residual_forward(float* out, const float* inp1, const float* inp2, size_t N);
void residual_backward(float* dinp1, float* dinp2, const float* dout, size_t N);
void softmax_crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int N,
                                  int V, int vocab_start);
void softmax_crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                   const float* dlosses, int N, int V, int vocab_start);
void adamw_update(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp);
// acc + the sum of x[i]² over n floats in double: blocks of 4096 (in parallel above 256K floats) over 8 lanes
// each, added in block order, so the bits depend on n alone. The "cpu" Device's add_sum_squares, and the
// gradient norm of the CPU optimizer, so both give the same bits.
double add_sum_squares(double acc, const float* x, size_t n);
// The optimizer pass of CPU offload: adamw_update fused with the write of a 16-bit working copy of the new
// parameters, working[i] = params[i] rounded to nearest even as `working_dtype` (kBF16 or kF16; kF32 writes no
// copy and `working` may be null). One pass over memory: 4 fp32 reads, 3 fp32 writes and one 16-bit write per
// parameter. params, m, v are bitwise those of adamw_update; the copy is bitwise common/dtype.h's conversion
// of them (NaN stays a quiet NaN, payload aside).
void adamw_update_mixed(float* params, float* m, float* v, const float* grads, uint16_t* working,
                        DType working_dtype, size_t n, const AdamWParams& hp);
// The same pass reading the old state from params, m, v and writing the new to params_out, m_out, v_out
// (bitwise adamw_update_mixed's; either the same arrays or ones that do not overlap them): the offloaded
// optimizer's update before the step's norm is known, which must leave the old state to return to.
void adamw_update_into(const float* params, const float* m, const float* v, const float* grads, float* params_out,
                       float* m_out, float* v_out, uint16_t* working, DType working_dtype, size_t n,
                       const AdamWParams& hp);

}  // namespace strata::kernels::cpu::fast
