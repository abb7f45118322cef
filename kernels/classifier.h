// classifier.h — the classifier slots (kernels.h) composed of a backend's own matmul and cross-entropy, over
// fp32 logits: what a backend without a fused classifier fills them with (template arguments: its slot
// functions), and what CUDA runs under kF32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace strata::kernels {

inline size_t composed_classifier_logits_bytes(int N, int V, MatmulPrecision /*precision*/) {
  return static_cast<size_t>(N) * static_cast<size_t>(V) * sizeof(float);
}

template <auto MatmulForward, auto CrossEntropyForward>
void composed_classifier_forward(void* logits, float* losses, float* lse, const float* inp, const float* weight,
                                 const int32_t* targets, int N, int C, int V, int vocab_start,
                                 MatmulPrecision precision) {
  float* out = static_cast<float*>(logits);
  MatmulForward(out, inp, weight, nullptr, N, C, V, precision);
  if (targets != nullptr) CrossEntropyForward(losses, lse, out, targets, N, V, vocab_start);
}

template <auto MatmulBackward, auto CrossEntropyBackward>
void composed_classifier_backward(float* dinp, float* dweight, void* logits, const float* lse,
                                  const int32_t* targets, const float* dlosses, const float* inp, const float* weight,
                                  int N, int C, int V, int vocab_start, MatmulPrecision precision) {
  float* dlogits = static_cast<float*>(logits);  // in place
  CrossEntropyBackward(dlogits, dlogits, lse, targets, dlosses, N, V, vocab_start);
  MatmulBackward(dinp, dweight, nullptr, dlogits, inp, weight, N, C, V, precision);
}

}  // namespace strata::kernels
