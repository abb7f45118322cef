// ops.h — the CUDA implementations behind cuda_kernels(): one function per KernelSet slot, with the slot's
// signature (kernels/kernels.h; every pointer is device memory), each enqueued on cuda_context().compute.
// One file per op: encoder.cu, layernorm.cu, matmul.cpp, attention.cu, gelu.cu, residual.cu, crossentropy.cu,
// classifier.cu, adamw.cu. The helpers at the end are shared between them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace strata::kernels::cuda {

void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_start, int vocab_rows);
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C,
                      int vocab_start, int vocab_rows);
void layernorm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, MatmulPrecision precision);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C);
void residual_layernorm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1,
                                const float* inp2, const float* weight, const float* bias, int N, int C,
                                MatmulPrecision precision);
void matmul_forward(float* out, const float* inp, Weight weight, const float* bias, int N, int C, int OC,
                    MatmulPrecision precision);
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     Weight weight, int N, int C, int OC, MatmulPrecision precision);
void matmul_backward_set(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                         Weight weight, int N, int C, int OC, MatmulPrecision precision);
// Hidden activations (kernels.h) are bf16 under kBF16 where their width is a multiple of 8 (whole 16-byte rows
// for the tensor cores and for cuBLASLt's GELU aux matrix); fp32 otherwise. matmul.cpp.
bool hidden_bf16(int width, MatmulPrecision precision);
size_t hidden_bytes(int N, int width, MatmulPrecision precision);
void matmul_forward_to_hidden(void* out, const void* inp, Weight weight, const float* bias, int N, int C,
                              int OC, MatmulPrecision precision);
void matmul_backward_hidden(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                            Weight weight, int N, int C, int OC, MatmulPrecision precision);
void matmul_gelu_forward(void* out, void* pre, const void* inp, Weight weight, const float* bias, int N, int C,
                         int OC, MatmulPrecision precision);
void matmul_forward_hidden(float* out, const void* inp, Weight weight, const float* bias, int N, int C, int OC,
                           MatmulPrecision precision);
void matmul_backward_gelu(void* dpre, float* dweight, float* dbias, const float* dout, const void* inp,
                          const void* pre, Weight weight, void* scratch, int N, int C, int OC,
                          MatmulPrecision precision);
void matmul_backward_set_hidden(float* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                Weight weight, int N, int C, int OC, MatmulPrecision precision);
// The classifier's GEMMs over bf16 logits (classifier.cu), inp hidden and the operands bf16 as under kBF16:
// out (N,ld_out) = inp (N,C) @ weight (OC,C)^T in bf16, rows padded with zeros to ld_out (OC rounded up to a
// multiple of 8); and its backward from such a bf16 gradient (padding columns zero): dinp (N,C) += dout @ weight,
// dweight (OC,C) += dout^T @ inp.
void matmul_forward_bf16_out(uint16_t* out, int ld_out, const void* inp, Weight weight, int N, int C, int OC);
void matmul_backward_bf16_dout(float* dinp, float* dweight, const uint16_t* dout, int ld_dout, const void* inp,
                               Weight weight, int N, int C, int OC);
// How many distinct GEMM problems were planned with a GELU epilogue of cuBLASLt's (GELU_AUX[_BIAS], DGELU), and
// how many of those cuBLASLt did not take (run as a GEMM and the GELU kernel instead): for tests, to tell the
// two apart. matmul.cpp.
struct MatmulEpilogueCounts {
  int gelu_plans = 0;
  int fallback_plans = 0;
  int autotuned_plans = 0;  // plans whose candidates were timed (STRATA_MATMUL_AUTOTUNE, below)
  int64_t working_copy_operands = 0;  // bf16 weight operands taken from a Weight's working copy (not rounded)
};
MatmulEpilogueCounts matmul_epilogue_counts();
// Whether each GEMM problem's plan times the cuBLASLt heuristic's candidates (up to 4) on its first call and keeps
// the fastest, instead of taking the heuristic's first: STRATA_MATMUL_AUTOTUNE=1 (read at the first plan;
// anything but 0 or 1 stops the process naming it), off by default, because the choice then depends on timings
// and two runs may pick algorithms that sum in another order (GPU runs stop being bitwise reproducible). It waits
// for the GPU once per problem, in the first step, and logs each choice. An experiment until a GPU measures it.
// set_ overrides it for the plans made after (tests). matmul.cpp.
bool matmul_autotune();
void set_matmul_autotune(bool on);
void attention_forward(void* out, float* att, const void* qkv, int B, int T, int C, int NH, int NKV,
                       MatmulPrecision precision);
void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* att, int B,
                        int T, int C, int NH, int NKV, MatmulPrecision precision);
size_t attention_saved_floats(int B, int T, int C, int NH, MatmulPrecision precision);
void gelu_forward(float* out, const float* inp, size_t N);
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N);
void residual_forward(float* out, const float* inp1, const float* inp2, size_t N);
void residual_backward(float* dinp1, float* dinp2, const float* dout, size_t N);
void softmax_crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int N,
                                  int V, int vocab_start);
void softmax_crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                   const float* dlosses, int N, int V, int vocab_start);
void classifier_forward(void* logits, float* losses, float* lse, const void* inp, Weight weight,
                        const int32_t* targets, int N, int C, int V, int vocab_start, MatmulPrecision precision);
void classifier_backward(float* dinp, float* dweight, void* logits, const float* lse, const int32_t* targets,
                         const float* dlosses, const void* inp, Weight weight, int N, int C, int V,
                         int vocab_start, MatmulPrecision precision);
size_t classifier_logits_bytes(int N, int V, MatmulPrecision precision);
void adamw_update(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp);
// The weights' bf16 working copies (kernels.h Weight), rounded as the matmuls round their operands. convert.cu.
void weights_to_bf16(uint16_t* out, const float* in, size_t n);

// n floats of device memory set to zero, on the compute stream. cuda_context.cpp.
void zero_floats(float* p, size_t n);

// dst (C) += column sums of src (N,C), summed in a fixed order (deterministic). reduce.cu.
void column_sums_accumulate(float* dst, const float* src, int N, int C);
void column_sums_accumulate_bf16(float* dst, const uint16_t* src, int N, int C);

// The GELU over bf16 (the MLP's hidden activations under kBF16), computed in fp32 and rounded to nearest even:
// out = gelu(inp); dinp = gelu'(inp) * dout, OVERWRITTEN. gelu.cu.
void gelu_forward_bf16(uint16_t* out, const uint16_t* inp, size_t n);
void gelu_backward_bf16(uint16_t* dinp, const uint16_t* inp, const uint16_t* dout, size_t n);

}  // namespace strata::kernels::cuda
