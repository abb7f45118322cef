// fast_crossentropy.cpp — the fast CPU fused softmax + cross-entropy (declared in kernels/cpu/fast.h).
//
// The hot path of a GPT step's head: rows of V = 50257 logits. Forward reads each row once (an online
// log-sum-exp); backward reads it once more and writes the gradient in place. Rows are independent and go to
// TBB; within a row every sum has a fixed order, so results repeat bit for bit. exp is simd::exp (< 1.3 ulp).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/check.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/fast_simd.h"

namespace strata::kernels::cpu::fast {
namespace {

// Vectors per block of the online log-sum-exp: the block's max is found first, so the running sum is rescaled
// (one exp per lane) once per block rather than once per element. 16 vectors: at most 1 KiB, in L1 for pass two.
constexpr int kBlockVecs = 16;

// Per lane: running max M and sum S of e^(x - M). Starting M at -FLT_MAX (not -inf) keeps M - M_new finite,
// and padding with -inf then contributes e^-inf = 0.
template <typename V>
STRATA_SIMD_INLINE float row_logsumexp(const float* row, int n) {
  constexpr int L = simd::kLanes<V>;
  V run_max = simd::splat<V>(-FLT_MAX);
  V run_sum{};
  int i = 0;
  for (; i + kBlockVecs * L <= n; i += kBlockVecs * L) {
    V block_max = simd::load<V>(row + i);
    for (int j = 1; j < kBlockVecs; ++j) block_max = simd::max(block_max, simd::load<V>(row + i + j * L));
    const V new_max = simd::max(run_max, block_max);
    V sum = run_sum * simd::exp(run_max - new_max);
    for (int j = 0; j < kBlockVecs; ++j) sum += simd::exp(simd::load<V>(row + i + j * L) - new_max);
    run_max = new_max;
    run_sum = sum;
  }
  // The last partial block, one vector at a time, the final one padded with -inf.
  for (; i < n; i += L) {
    const V x = i + L <= n ? simd::load<V>(row + i) : simd::load_n<V>(row + i, n - i, -INFINITY);
    const V new_max = simd::max(run_max, x);
    run_sum = run_sum * simd::exp(run_max - new_max) + simd::exp(x - new_max);
    run_max = new_max;
  }
  const float max_all = simd::hmax(run_max);
  const float sum_all = simd::hsum(run_sum * simd::exp(run_max - max_all));
  return max_all + std::log(sum_all);
}

template <int N>
struct ForwardRows {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* losses, float* lse, const float* logits, const int32_t* targets, int n0,
                                     int n1, int Vocab, int vocab_start) {
    for (int n = n0; n < n1; ++n) {
      const float* row = logits + static_cast<size_t>(n) * Vocab;
      const float l = row_logsumexp<V>(row, Vocab);
      lse[n] = l;
      const int col = targets[n] - vocab_start;
      losses[n] = targets[n] < 0 || col < 0 || col >= Vocab ? 0.0f : l - row[col];
    }
  }
};

// Writes drow = (e^(x - lse) - onehot) * dloss, the one-hot only where the target is one of the columns. Vectors
// are loaded before they are stored, so drow may be row; the target's logit is read before the pass for the
// same reason.
template <int N>
struct BackwardRows {
  using V = simd::Vec<N>;
  STRATA_SIMD_INLINE static void run(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                     const float* dlosses, int n0, int n1, int Vocab, int vocab_start) {
    for (int n = n0; n < n1; ++n) {
      const float* row = logits + static_cast<size_t>(n) * Vocab;
      float* drow = dlogits + static_cast<size_t>(n) * Vocab;
      const int target = targets[n] - vocab_start;  // the target's column, if it is one of ours
      const bool ours = target >= 0 && target < Vocab;
      if (targets[n] < 0) {
        std::fill(drow, drow + Vocab, 0.0f);
        continue;
      }
      const float l = lse[n];
      const float dloss = dlosses[n];
      const float target_logit = ours ? row[target] : 0.0f;
      int i = 0;
      for (; i + N <= Vocab; i += N) simd::store(drow + i, simd::exp(simd::load<V>(row + i) - l) * dloss);
      if (i < Vocab)
        simd::store_n(drow + i, simd::exp(simd::load_n<V>(row + i, Vocab - i, 0.0f) - l) * dloss, Vocab - i);
      if (!ours) continue;
      const V p_target = simd::exp(simd::splat<V>(target_logit) - l);
      drow[target] = (p_target[0] - 1.0f) * dloss;
    }
  }
};

}  // namespace

// Targets beyond the columns are legal (another tensor-parallel rank's); the model checks ids against the
// whole vocabulary.
void softmax_crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int N,
                                  int V, int vocab_start) {
  tbb::parallel_for(tbb::blocked_range<int>(0, N), [&](const tbb::blocked_range<int>& r) {
    simd::dispatch<ForwardRows>(losses, lse, logits, targets, r.begin(), r.end(), V, vocab_start);
  });
}

void softmax_crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                   const float* dlosses, int N, int V, int vocab_start) {
  tbb::parallel_for(tbb::blocked_range<int>(0, N), [&](const tbb::blocked_range<int>& r) {
    simd::dispatch<BackwardRows>(dlogits, logits, lse, targets, dlosses, r.begin(), r.end(), V, vocab_start);
  });
}

}  // namespace strata::kernels::cpu::fast
