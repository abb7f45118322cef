// ops.h — the CUDA implementations behind cuda_kernels(): one function per KernelSet slot, with the slot's
// signature (kernels/kernels.h; every pointer is device memory), each enqueued on cuda_context().compute.
// One file per op: encoder.cu, layernorm.cu, matmul.cpp, attention.cu, gelu.cu, residual.cu, crossentropy.cu,
// adamw.cu. The helpers at the end are shared between them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace strata::kernels::cuda {

void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_start, int vocab_rows);
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C,
                      int vocab_start, int vocab_rows);
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C);
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC,
                    MatmulPrecision precision);
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int C, int OC, MatmulPrecision precision);
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       MatmulPrecision precision);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                        int NH, MatmulPrecision precision);
size_t attention_saved_floats(int B, int T, int C, int NH, MatmulPrecision precision);
void gelu_forward(float* out, const float* inp, size_t N);
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N);
void residual_forward(float* out, const float* inp1, const float* inp2, size_t N);
void residual_backward(float* dinp1, float* dinp2, const float* dout, size_t N);
void softmax_crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int N,
                                  int V, int vocab_start);
void softmax_crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                   const float* dlosses, int N, int V, int vocab_start);
void adamw_update(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp);

// n floats of device memory set to zero, on the compute stream. cuda_context.cpp.
void zero_floats(float* p, size_t n);

// dst (C) += column sums of src (N,C), summed in a fixed order (deterministic). reduce.cu.
void column_sums_accumulate(float* dst, const float* src, int N, int C);

}  // namespace strata::kernels::cuda
