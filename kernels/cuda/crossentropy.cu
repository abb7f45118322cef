// crossentropy.cu — fused softmax + cross-entropy over rows of fp32 logits, one block per row, each read once
// (a running max and sum: reduce.cuh's softmax_merge). Forward saves the log of the row's softmax denominator
// (lse); backward recomputes each probability from it and overwrites, element by element (read, then write, by
// the same thread), so dlogits may alias logits. The bf16 logits of the classifier have their own kernels
// (classifier.cu).
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void crossentropy_forward_kernel(float* losses, float* lse, const float* logits, const int32_t* targets,
                                            int V, int vocab_start) {
  __shared__ float shared_m[32], shared_s[32];
  const int n = blockIdx.x;
  const float* row = logits + static_cast<size_t>(n) * V;
  float m = -INFINITY, s = 0.0f;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float x = row[v];
    if (x > m) {
      s = (m == -INFINITY ? 0.0f : s * __expf(m - x)) + 1.0f;
      m = x;
    } else {
      s += __expf(x - m);
    }
  }
  block_softmax_merge(m, s, shared_m, shared_s);
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    lse[n] = l;
    const int t = targets[n] - vocab_start;  // the target's column, if it is one of ours
    losses[n] = targets[n] < 0 || t < 0 || t >= V ? 0.0f : l - row[t];
  }
}

__global__ void crossentropy_backward_kernel(float* dlogits, const float* logits, const float* lse,
                                             const int32_t* targets, const float* dlosses, int V, int vocab_start) {
  const int n = blockIdx.x;
  const size_t base = static_cast<size_t>(n) * V;
  const int t = targets[n] - vocab_start;  // no column matches one outside [0, V): another rank's target
  if (targets[n] < 0) {
    for (int v = threadIdx.x; v < V; v += blockDim.x) dlogits[base + v] = 0.0f;
    return;
  }
  const float l = lse[n], d = dlosses[n];
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(logits[base + v] - l);
    dlogits[base + v] = (p - (v == t ? 1.0f : 0.0f)) * d;
  }
}

}  // namespace

void softmax_crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int N,
                                  int V, int vocab_start) {
  if (N <= 0) return;
  crossentropy_forward_kernel<<<N, kThreads, 0, cuda_context().compute>>>(losses, lse, logits, targets, V,
                                                                          vocab_start);
  CUDA_CHECK_LAUNCH();
}

void softmax_crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                   const float* dlosses, int N, int V, int vocab_start) {
  if (N <= 0) return;
  crossentropy_backward_kernel<<<N, kThreads, 0, cuda_context().compute>>>(dlogits, logits, lse, targets, dlosses,
                                                                           V, vocab_start);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
