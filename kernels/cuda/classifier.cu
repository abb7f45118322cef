// classifier.cu — the LM head and its cross-entropy together (the KernelSet's classifier slots).
//
// fp32: the head's matmul and the fp32 cross-entropy (kernels/composed.h). bf16 (kBF16): the head's GEMM writes
// the logits in bf16, as PyTorch's autocast does, rows padded to a multiple of 8 (zero weight rows make the
// padding 0), so the fp32 logits (N*V*4 bytes: 1.6 GB for GPT-2 at B*T = 8192) never exist. The cross-entropy
// reads 8 logits per 16-byte load with the padding left out of the softmax, and its backward overwrites them in
// place with their bf16 gradient (the padding written 0), which the backward GEMMs take as it is.
#include <cstdint>

#include "kernels/composed.h"
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kVec = 8;  // bf16 per 16-byte load; the row stride is a multiple of it

int padded_width(int V) { return (V + kVec - 1) / kVec * kVec; }

// One block per row of `ld` bf16 logits, of which the first V are the vocabulary's columns: lse and loss as
// crossentropy.cu's, over the values as stored.
__global__ void classifier_loss_kernel(float* losses, float* lse, const uint16_t* logits, int ld,
                                       const int32_t* targets, int V, int vocab_start) {
  __shared__ float shared_m[32], shared_s[32];
  const int n = blockIdx.x;
  const uint16_t* row = logits + static_cast<size_t>(n) * ld;
  float m = -INFINITY, s = 0.0f;
  for (int c = threadIdx.x; c * kVec < V; c += blockDim.x) {
    const uint4 packed = reinterpret_cast<const uint4*>(row)[c];
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&packed);
    const int valid = min(kVec, V - c * kVec);
    float x[kVec];
    float cm = -INFINITY;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      x[j] = j < valid ? bf16_bits_to_float(h[j]) : -INFINITY;
      cm = fmaxf(cm, x[j]);
    }
    if (cm == -INFINITY) continue;  // adds nothing (and exp(-inf - -inf) would be NaN)
    if (cm > m) {  // rescale once per load, not per element
      s = m == -INFINITY ? 0.0f : s * __expf(m - cm);
      m = cm;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) s += j < valid ? __expf(x[j] - m) : 0.0f;
  }
  block_softmax_merge(m, s, shared_m, shared_s);
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    lse[n] = l;
    const int t = targets[n] - vocab_start;  // the target's column, if it is one of ours
    losses[n] = targets[n] < 0 || t < 0 || t >= V ? 0.0f : l - bf16_bits_to_float(row[t]);
  }
}

// In place: each logit becomes (exp(x - lse) - onehot) * dloss in bf16; ignored rows and the padding become 0.
__global__ void classifier_dlogits_kernel(uint16_t* logits, int ld, const float* lse, const int32_t* targets,
                                          const float* dlosses, int V, int vocab_start) {
  const int n = blockIdx.x;
  uint4* row = reinterpret_cast<uint4*>(logits + static_cast<size_t>(n) * ld);
  const bool ignored = targets[n] < 0;
  const int t = targets[n] - vocab_start;  // no column matches one outside [0, V): another rank's target
  const float l = lse[n], d = dlosses[n];
  for (int c = threadIdx.x; c * kVec < ld; c += blockDim.x) {
    uint4 packed = row[c];
    uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int v = c * kVec + j;
      float g = 0.0f;
      if (!ignored && v < V) g = (__expf(bf16_bits_to_float(h[j]) - l) - (v == t ? 1.0f : 0.0f)) * d;
      h[j] = float_to_bf16_bits(g);
    }
    row[c] = packed;
  }
}

void check_aligned(const void* logits) {
  STRATA_ASSERT_MSG(reinterpret_cast<uintptr_t>(logits) % 16 == 0, "bf16 logits must be 16-byte aligned");
}

}  // namespace

size_t classifier_logits_bytes(int N, int V, MatmulPrecision precision) {
  if (precision == MatmulPrecision::kF32) return composed_classifier_logits_bytes(N, V, precision);
  return static_cast<size_t>(N) * static_cast<size_t>(padded_width(V)) * sizeof(uint16_t);
}

void classifier_forward(void* logits, float* losses, float* lse, const void* inp, Weight weight,
                        const int32_t* targets, int N, int C, int V, int vocab_start, MatmulPrecision precision) {
  if (precision == MatmulPrecision::kF32) {
    composed_classifier_forward<&matmul_forward, &softmax_crossentropy_forward>(logits, losses, lse, inp, weight,
                                                                                targets, N, C, V, vocab_start,
                                                                                precision);
    return;
  }
  check_aligned(logits);
  const int ld = padded_width(V);
  auto* out = static_cast<uint16_t*>(logits);
  matmul_forward_bf16_out(out, ld, inp, weight, N, C, V);
  if (targets == nullptr || N <= 0) return;
  classifier_loss_kernel<<<N, kThreads, 0, cuda_context().compute>>>(losses, lse, out, ld, targets, V,
                                                                       vocab_start);
  CUDA_CHECK_LAUNCH();
}

void classifier_backward(float* dinp, float* dweight, void* logits, const float* lse, const int32_t* targets,
                         const float* dlosses, const void* inp, Weight weight, int N, int C, int V,
                         int vocab_start, MatmulPrecision precision) {
  if (precision == MatmulPrecision::kF32) {
    composed_classifier_backward<&matmul_backward, &softmax_crossentropy_backward>(
        dinp, dweight, logits, lse, targets, dlosses, inp, weight, N, C, V, vocab_start, precision);
    return;
  }
  if (N <= 0) return;
  check_aligned(logits);
  const int ld = padded_width(V);
  auto* dlogits = static_cast<uint16_t*>(logits);
  classifier_dlogits_kernel<<<N, kThreads, 0, cuda_context().compute>>>(dlogits, ld, lse, targets, dlosses, V,
                                                                          vocab_start);
  CUDA_CHECK_LAUNCH();
  matmul_backward_bf16_dout(dinp, dweight, dlogits, ld, inp, weight, N, C, V);
}

}  // namespace strata::kernels::cuda
