// kernels.h — the one interface every compute backend implements: forward and backward of each GPT op.
//
// A KernelSet is a table of functions, one slot per op (ggml-style), filled by a backend: the plain CPU
// reference (kernels/cpu/reference.h), the fast CPU version (kernels/cpu/fast.h), and CUDA (kernels/cuda). The
// model calls only through this table, so dispatch happens in one place and the golden tests run on every
// backend.
//
// Conventions (llm.c's): all tensors are fp32, row-major and contiguous; shapes are in the comments; N = B*T
// rows. Gradients carry a `d` prefix. Backward functions ACCUMULATE (+=) into every gradient they write — the
// caller zeroes them — except where a slot says it OVERWRITES (softmax_crossentropy_backward, which may run in
// place on the logits; the input gradients of matmul_backward_set and matmul_backward_gelu). Functions run on
// the calling thread and may use the TBB arena for parallelism; they must not be called concurrently on
// overlapping outputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels {

// Arithmetic of matmul inputs: fp32, or inputs rounded to bf16 with fp32 accumulation (AVX-512 BF16).
enum class MatmulPrecision : uint8_t { kF32 = 0, kBF16 = 1 };

// A linear's weight: its fp32 values and, where the weight's owner keeps one, their bf16 working copy
// (docs/architecture.md, "16-bit working parameters"): bf16[i] == f32_to_bf16(f32[i]) (common/dtype.h) for every
// element, the rounding every matmul slot does under kBF16. An owner that makes the copy once per change of the
// weights saves each linear its own rounding pass, forward and backward and in every micro-batch. A backend may
// use it under kBF16 instead of rounding f32, so results are bitwise those without it; null: none kept. Implicit
// from a bare fp32 pointer, for callers that keep no copy.
struct Weight {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;

  Weight(const float* w) : f32(w) {}  // NOLINT(google-explicit-constructor): a weight without a working copy
  Weight(const float* w, const uint16_t* w16) : f32(w), bf16(w16) {}
};

struct AdamWParams {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled, applied as p -= lr * wd * p
  int step = 1;               // 1-based, for bias correction
  float grad_scale = 1.0f;    // multiplies each gradient first (loss-scale unscale × clip coefficient)
};

struct KernelSet {
  const char* name;  // "cpu-reference", "cpu-fast"

  // out (B,T,C) = wte[inp - vocab_start] + wpe[t]; inp (B,T) token ids; wte (vocab_rows,C) holds the rows of
  // ids [vocab_start, vocab_start + vocab_rows) (the whole vocabulary: 0, V); wpe (maxT,C). A token outside
  // those rows adds nothing (tensor parallelism's vocab-parallel embedding: another rank holds its row); a null
  // wpe adds nothing either.
  void (*encoder_forward)(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                          int vocab_start, int vocab_rows);
  // dwte (vocab_rows,C) += scatter of dout by token id (tokens outside the rows skipped); dwpe (maxT,C) += sum
  // over batch of dout (skipped when null).
  void (*encoder_backward)(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C,
                           int vocab_start, int vocab_rows);

  // out (N,C) = (inp - mean) * rstd * weight + bias; saves mean (N) and rstd (N). eps = 1e-5. out is hidden
  // (hidden_bytes, below: it only feeds linears), in the form `precision` gives it.
  void (*layernorm_forward)(void* out, float* mean, float* rstd, const float* inp, const float* weight,
                            const float* bias, int N, int C, MatmulPrecision precision);
  // dinp (N,C), dweight (C), dbias (C) +=.
  void (*layernorm_backward)(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                             const float* weight, const float* mean, const float* rstd, int N, int C);

  // The residual add and the layernorm after it, fused where a backend can: res (N,C) = inp1 + inp2, then
  // layernorm_forward of res into out, mean and rstd. (Its backward is layernorm_backward's: the add passes the
  // gradient through.)
  void (*residual_layernorm_forward)(float* res, void* out, float* mean, float* rstd, const float* inp1,
                                     const float* inp2, const float* weight, const float* bias, int N, int C,
                                     MatmulPrecision precision);

  // RMSNorm (the Llama family's): out (N,C) = weight * (inp * rstd), rstd (N) = 1 / sqrt(mean(inp²) + eps) saved;
  // the statistics in fp32 whatever the precision, as transformers' LlamaRMSNorm. out is hidden (hidden_bytes).
  void (*rmsnorm_forward)(void* out, float* rstd, const float* inp, const float* weight, int N, int C, float eps,
                          MatmulPrecision precision);
  // dinp (N,C) +=, dweight (C) +=.
  void (*rmsnorm_backward)(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                           const float* rstd, int N, int C);
  // res (N,C) = inp1 + inp2, then rmsnorm_forward of res (fused where a backend can; the backward is
  // rmsnorm_backward's).
  void (*residual_rmsnorm_forward)(float* res, void* out, float* rstd, const float* inp1, const float* inp2,
                                   const float* weight, int N, int C, float eps, MatmulPrecision precision);

  // out (N,OC) = inp (N,C) @ weight(OC,C)^T + bias (OC); bias may be null.
  void (*matmul_forward)(float* out, const float* inp, Weight weight, const float* bias, int N, int C,
                         int OC, MatmulPrecision precision);
  // dinp (N,C) += dout @ weight; dweight (OC,C) += dout^T @ inp; dbias (OC) += column sums of dout (if non-null).
  void (*matmul_backward)(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          Weight weight, int N, int C, int OC, MatmulPrecision precision);
  // matmul_backward with dinp OVERWRITTEN (dinp = dout @ weight), for a gradient this linear alone writes: the
  // caller need not zero it first (CUDA: the GEMM's beta 0, so dinp is neither cleared nor read). dweight and
  // dbias still +=.
  void (*matmul_backward_set)(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                              Weight weight, int N, int C, int OC, MatmulPrecision precision);

  // Activations that pass only between two of the backend's own slots — every linear's input (the layernorms'
  // outputs, the attention's output, gelu(pre)), the MLP's hidden units (pre (N,F) and its gradient) and the
  // attention's qkv (N,3C), and their gradients where a slot says so — are kept in a form only those slots
  // interpret, in buffers of hidden_bytes(N, width, precision) each: fp32 (N,width) on the CPU backends; CUDA
  // keeps them in bf16 under kBF16 where width is a multiple of 8 (as PyTorch's autocast does), so the matmuls on
  // either side write and read them without conversion passes.
  size_t (*hidden_bytes)(int N, int width, MatmulPrecision precision);

  // Causal multi-head self-attention, its key and value heads shared by groups of query heads (grouped-query
  // attention: NKV divides NH, and query head h reads key and value head h / (NH/NKV), transformers' repeat_kv;
  // NKV = NH is multi-head attention). Each row of qkv (B,T,C + 2 NKV hs) holds NH query heads, then NKV key
  // heads, then NKV value heads, of hs = C/NH elements; qkv, out (B,T,C) and their gradients are hidden
  // (hidden_bytes). att (B,NH,T,T) saves the softmax probabilities (row t only defined up to column t; the rest is
  // written as 0). Scale 1/sqrt(hs). The CUDA backend takes NKV = NH only (for now).
  // `precision` is the arithmetic of its two products (QKᵀ, att·V, and their gradients): kBF16 lets a backend
  // round their inputs to bf16 (CUDA does, for the tensor cores; the CPU backends compute in fp32 either way).
  // The softmax and att are fp32 always.
  void (*attention_forward)(void* out, float* att, const void* qkv, int B, int T, int C, int NH, int NKV,
                            MatmulPrecision precision);
  // dqkv (B,T,C + 2 NKV hs) overwritten (a key or value head's gradient summed over its group's query heads), every element (so the caller zeroes nothing; on CUDA the kernels store their
  // gradient instead of reading, adding and writing it back). qkv, out and att are the forward's.
  void (*attention_backward)(void* dqkv, const void* dout, const void* qkv, const void* out, const float* att, int B,
                             int T, int C, int NH, int NKV, MatmulPrecision precision);
  // Floats of `att`: what attention_forward saves for attention_backward at these shapes. The CPU backends save
  // the probabilities (B*NH*T*T); CUDA's flash attention (bf16) saves only the rows' log-sum-exps (its backward
  // reads qkv and out again), and then `att` holds those instead of probabilities.
  size_t (*attention_saved_floats)(int B, int T, int C, int NH, MatmulPrecision precision);

  // Rotary position embedding in transformers' rotate-half layout, in place on the query and key heads of qkv
  // (B,T,(NH + 2 NKV) hs; hidden): each row holds NH query heads, NKV key heads and NKV value heads of hs
  // elements, and for a row at position t and i < hs/2, (x_i, x_{i+hs/2}) becomes (x_i c − x_{i+hs/2} s,
  // x_{i+hs/2} c + x_i s) with c, s = cos, sin (T, hs/2; fp32) at [t][i]. Tables from a later position: offset
  // them. rope_backward is its transpose, in place on dqkv's query and key heads (the value heads untouched).
  void (*rope_forward)(void* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs,
                       MatmulPrecision precision);
  void (*rope_backward)(void* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV, int hs,
                        MatmulPrecision precision);

  // QK-norm (Qwen3's q_norm and k_norm): RMSNorm over each head of the query and key heads of qkv (B*T = N rows of
  // (NH + 2 NKV) hs, as rope_forward's; hidden), the query heads' with qweight (hs), the key heads' with kweight
  // (hs), the statistics in fp32 as rmsnorm_forward's: out (N, (NH + 2 NKV) hs; hidden) holds them and the value
  // heads copied, rstd (N, NH + NKV) is saved. qk_norm_backward: dinp (hidden) OVERWRITTEN, and may be dout
  // itself; the value heads' gradient passes through; dqweight, dkweight (hs) +=.
  void (*qk_norm_forward)(void* out, float* rstd, const void* inp, const float* qweight, const float* kweight, int N,
                          int NH, int NKV, int hs, float eps, MatmulPrecision precision);
  void (*qk_norm_backward)(void* dinp, float* dqweight, float* dkweight, const void* dout, const void* inp,
                           const float* qweight, const float* kweight, const float* rstd, int N, int NH, int NKV,
                           int hs, MatmulPrecision precision);

  // The linears, whose inputs are hidden: matmul_forward or matmul_backward_set with inp and the other sides
  // named below in the hidden form; weights, biases and their gradients fp32, shapes as there ((N,C) -> (N,OC)),
  // dinp OVERWRITTEN, dweight and dbias +=.
  //
  // out hidden (N,OC) too: the QKV linear.
  void (*matmul_forward_to_hidden)(void* out, const void* inp, Weight weight, const float* bias, int N, int C,
                                   int OC, MatmulPrecision precision);
  // inp and dinp hidden (N,C): the attention's output linear's backward (its forward is matmul_forward_hidden).
  void (*matmul_backward_hidden)(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                                 Weight weight, int N, int C, int OC, MatmulPrecision precision);
  // The MLP's first linear and its GELU, fused where a backend can (CUDA under kBF16: cuBLASLt's GELU epilogue):
  // pre (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC; may be null), out (N,OC) = gelu(pre), pre kept for the
  // backward; inp, out and pre hidden (OC = F).
  void (*matmul_gelu_forward)(void* out, void* pre, const void* inp, Weight weight, const float* bias,
                              int N, int C, int OC, MatmulPrecision precision);
  // The MLP's second linear and the attention's output linear: out (N,OC) fp32 (a partial sum of the residual
  // stream).
  void (*matmul_forward_hidden)(float* out, const void* inp, Weight weight, const float* bias, int N, int C,
                                int OC, MatmulPrecision precision);
  // The backward of a linear whose input was gelu(pre) (the MLP's second linear), through the GELU:
  // dpre (N,C) = gelu'(pre) * (dout @ weight) — OVERWRITTEN, not added to; dweight (OC,C) += dout^T @ inp with
  // inp = gelu(pre); dbias (OC) += column sums of dout (if non-null). dpre, inp, pre and `scratch` (which the
  // backend may use) are hidden (C = F).
  void (*matmul_backward_gelu)(void* dpre, float* dweight, float* dbias, const float* dout, const void* inp,
                               const void* pre, Weight weight, void* scratch, int N, int C, int OC,
                               MatmulPrecision precision);
  // The MLP's first linear's and the QKV linear's backward: dout (N,OC) hidden too, dinp (N,C) fp32 (the
  // layernorm's output gradient).
  void (*matmul_backward_set_hidden)(float* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                     Weight weight, int N, int C, int OC, MatmulPrecision precision);

  // GELU, tanh approximation (GPT-2's). out (N) = gelu(inp).
  void (*gelu_forward)(float* out, const float* inp, size_t N);
  // dinp (N) += gelu'(inp) * dout.
  void (*gelu_backward)(float* dinp, const float* inp, const float* dout, size_t N);

  // SwiGLU: out (N,H) = silu(gate) * up, each row of inp (N,2H) being [gate (H) | up (H)] (the gate and up
  // projections as one linear); inp and out hidden. swiglu_backward: dinp (N,2H; hidden) OVERWRITTEN with
  // dgate = dout * up * silu'(gate) and dup = dout * silu(gate), dout (N,H) hidden.
  void (*swiglu_forward)(void* out, const void* inp, int N, int H, MatmulPrecision precision);
  void (*swiglu_backward)(void* dinp, const void* dout, const void* inp, int N, int H, MatmulPrecision precision);

  // out (N) = inp1 + inp2.
  void (*residual_forward)(float* out, const float* inp1, const float* inp2, size_t N);
  // dinp1 += dout; dinp2 += dout.
  void (*residual_backward)(float* dinp1, float* dinp2, const float* dout, size_t N);

  // Fused softmax + cross-entropy over rows of logits (N,V), whose columns are the vocabulary ids
  // [vocab_start, vocab_start + V) (the whole vocabulary: 0; a slice of it under tensor parallelism's
  // vocab-parallel cross-entropy). lse (N) = logsumexp(row), saved for every row. losses (N) =
  // lse - row[target - vocab_start] where the target is one of the columns; 0 where it is not (a target < 0 is
  // ignored; one >= vocab_start + V or < vocab_start is another rank's).
  void (*softmax_crossentropy_forward)(float* losses, float* lse, const float* logits, const int32_t* targets,
                                       int N, int V, int vocab_start);
  // dlogits (N,V) = (exp(row - lse) - onehot(target - vocab_start)) * dlosses[row]: the one-hot only where the
  // target is one of the columns, and lse may be the whole vocabulary's (all ranks'). OVERWRITES dlogits, which
  // may alias logits. Rows with target < 0 get 0.
  void (*softmax_crossentropy_backward)(float* dlogits, const float* logits, const float* lse,
                                        const int32_t* targets, const float* dlosses, int N, int V, int vocab_start);

  // The LM head and its loss, the classifier: logits (N,V) = inp (N,C; hidden) @ weight (V,C)^T, kept in `logits`, a
  // buffer of classifier_logits_bytes(N, V, precision) that only these slots interpret — fp32 (N,V) on the CPU
  // backends; CUDA keeps them in bf16 under kBF16, as PyTorch's autocast does, so the fp32 logits never exist —
  // then, where targets is non-null, softmax_crossentropy_forward's losses and lse over them (V and vocab_start
  // as there: a slice of the vocabulary under tensor parallelism).
  void (*classifier_forward)(void* logits, float* losses, float* lse, const void* inp, Weight weight,
                             const int32_t* targets, int N, int C, int V, int vocab_start, MatmulPrecision precision);
  // softmax_crossentropy_backward with this lse into the logits, which it OVERWRITES, then matmul_backward's
  // dinp (N,C) += and dweight (V,C) +=.
  void (*classifier_backward)(float* dinp, float* dweight, void* logits, const float* lse, const int32_t* targets,
                              const float* dlosses, const void* inp, Weight weight, int N, int C, int V,
                              int vocab_start, MatmulPrecision precision);
  size_t (*classifier_logits_bytes)(int N, int V, MatmulPrecision precision);

  // AdamW over n elements: g = grads*grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²;
  // params -= lr * (m̂ / (sqrt(v̂) + eps) + wd * params), with m̂, v̂ bias-corrected.
  void (*adamw_update)(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp);

  // out (n) = the bf16 working copy of n weights (Weight): bitwise what the matmul slots round them to under
  // kBF16. Null where a backend makes no use of working copies (the reference), so owners keep none for it.
  void (*weights_to_bf16)(uint16_t* out, const float* in, size_t n);
};

}  // namespace strata::kernels
