// ops_test.cpp — every CPU op but matmul, forward and backward (kernels/cpu/reference.h, kernels/cpu/fast_*.cpp):
// ref<float> against ref<double> on seeded random odd shapes; ref<double> gradients against central finite
// differences; fast against ref<double> on every SIMD clone this machine runs, small and large shapes; fast
// bitwise reproducible across thread counts; "+=" semantics of every backward (overwrite for attention and
// cross-entropy) through both KernelSet tables. AdamW: adamw_test.cpp.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/fast_simd.h"
#include "kernels/cpu/reference.h"
#include "tests/kernels/cpu_op_checks.h"
#include "tests/kernels/cpu_ops_test_util.h"
#include "tests/test_util.h"

namespace strata::kernels {
namespace {

using ::strata::testing::all_close;
using namespace cpu_ops_test;
namespace ref = cpu::ref;

// ---- the cases: inputs, forward outputs and gradients of one op, at F = float or double ------------------------
// Each: params() names the shape and seed; forward/backward run a backend (backward accumulates into the
// zero-initialised gradients); loss() is the finite-difference scalar whose gradient backward computes.

template <typename F>
struct EncoderCase {
  int B, T, C, V;
  uint64_t seed;
  std::vector<int32_t> inp;
  std::vector<F> wte, wpe, dout, out, dwte, dwpe;
  EncoderCase(int B_, int T_, int C_, int V_, uint64_t seed_) : B(B_), T(T_), C(C_), V(V_), seed(seed_) {
    Rng rng(seed);
    for (int i = 0; i < B * T; ++i) inp.push_back(static_cast<int32_t>(rng.below(V)));  // V < B*T: repeats
    wte = rand_vec<F>(size_t(V) * C, rng);
    wpe = rand_vec<F>(size_t(T) * C, rng);
    dout = rand_vec<F>(size_t(B) * T * C, rng);
    out.assign(dout.size(), 0);
    dwte.assign(wte.size(), 0);
    dwpe.assign(wpe.size(), 0);
  }
  std::string params() const { return fmt::format("encoder B={} T={} C={} V={} seed={}", B, T, C, V, seed); }
  void forward(Backend k) {
    STRATA_RUN_OP(k, encoder_forward, out.data(), inp.data(), wte.data(), wpe.data(), B, T, C, 0, V);
  }
  void backward(Backend k) {
    STRATA_RUN_OP(k, encoder_backward, dwte.data(), dwpe.data(), dout.data(), inp.data(), B, T, C, 0, V);
  }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() { return {{"out", &out, false}, {"dwte", &dwte, true}, {"dwpe", &dwpe, true}}; }
  std::vector<FdInput<F>> fd_inputs() { return {{"dwte", &wte, &dwte}, {"dwpe", &wpe, &dwpe}}; }
  static constexpr bool kOverwrites = false;
};

template <typename F>
struct LayernormCase {
  int N, C;
  uint64_t seed;
  std::vector<F> inp, weight, bias, dout, out, mean, rstd, dinp, dweight, dbias;
  LayernormCase(int N_, int C_, uint64_t seed_) : N(N_), C(C_), seed(seed_) {
    Rng rng(seed);
    inp = rand_vec<F>(size_t(N) * C, rng, -2.0, 3.0);  // rows off zero: the variance pass must not cancel
    weight = rand_vec<F>(C, rng, 0.5, 1.5);
    bias = rand_vec<F>(C, rng);
    dout = rand_vec<F>(size_t(N) * C, rng);
    out.assign(inp.size(), 0);
    mean.assign(N, 0);
    rstd.assign(N, 0);
    dinp.assign(inp.size(), 0);
    dweight.assign(C, 0);
    dbias.assign(C, 0);
  }
  std::string params() const { return fmt::format("layernorm N={} C={} seed={}", N, C, seed); }
  void forward(Backend k) {
    // The slot's out is hidden, fp32 under kF32 (the reference's has no precision).
    if constexpr (std::is_same_v<F, float>)
      kernels(k).layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C,
                                   MatmulPrecision::kF32);
    else
      ref::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
  }
  void backward(Backend k) {
    STRATA_RUN_OP(k, layernorm_backward, dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                  weight.data(), mean.data(), rstd.data(), N, C);
  }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() {
    return {{"out", &out, false},  {"mean", &mean, false},      {"rstd", &rstd, false},
            {"dinp", &dinp, true}, {"dweight", &dweight, true}, {"dbias", &dbias, true}};
  }
  std::vector<FdInput<F>> fd_inputs() {
    return {{"dinp", &inp, &dinp}, {"dweight", &weight, &dweight}, {"dbias", &bias, &dbias}};
  }
  static constexpr bool kOverwrites = false;
};

// NKV key and value heads shared by the NH query heads (grouped-query attention); NKV = 0 means NH (multi-head).
template <typename F>
struct AttentionCase {
  int B, T, C, NH, NKV;
  uint64_t seed;
  std::vector<F> qkv, dout, out, att, dqkv;
  AttentionCase(int B_, int T_, int C_, int NH_, uint64_t seed_, int NKV_ = 0)
      : B(B_), T(T_), C(C_), NH(NH_), NKV(NKV_ > 0 ? NKV_ : NH_), seed(seed_) {
    Rng rng(seed);
    const size_t W = size_t(C) + 2 * size_t(NKV) * (C / NH);
    qkv = rand_vec<F>(size_t(B) * T * W, rng, -2.0, 2.0);  // wide enough that softmax rows are not flat
    dout = rand_vec<F>(size_t(B) * T * C, rng);
    out.assign(dout.size(), 0);
    att.assign(size_t(B) * NH * T * T, 0);
    dqkv.assign(qkv.size(), 0);
  }
  std::string params() const {
    return fmt::format("attention B={} T={} C={} NH={} NKV={} seed={}", B, T, C, NH, NKV, seed);
  }
  void forward(Backend k) {
    STRATA_RUN_OP(k, attention_forward, out.data(), att.data(), qkv.data(), B, T, C, NH, NKV, MatmulPrecision::kF32);
  }
  void backward(Backend k) {
    // The slot also takes the forward's output, which the reference does not read.
    if constexpr (std::is_same_v<F, float>)
      kernels(k).attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), att.data(), B, T, C, NH, NKV,
                                    MatmulPrecision::kF32);
    else
      ref::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NKV);
  }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() { return {{"out", &out, false}, {"att", &att, false}, {"dqkv", &dqkv, true}}; }
  std::vector<FdInput<F>> fd_inputs() { return {{"dqkv", &qkv, &dqkv}}; }
  static constexpr bool kOverwrites = true;
};

template <typename F>
struct GeluCase {
  size_t N;
  uint64_t seed;
  std::vector<F> inp, dout, out, dinp;
  GeluCase(size_t N_, uint64_t seed_) : N(N_), seed(seed_) {
    Rng rng(seed);
    inp = rand_vec<F>(N, rng, -6.0, 4.0);  // both tails: gelu -> 0 and gelu -> x
    dout = rand_vec<F>(N, rng);
    out.assign(N, 0);
    dinp.assign(N, 0);
  }
  std::string params() const { return fmt::format("gelu N={} seed={}", N, seed); }
  void forward(Backend k) { STRATA_RUN_OP(k, gelu_forward, out.data(), inp.data(), N); }
  void backward(Backend k) { STRATA_RUN_OP(k, gelu_backward, dinp.data(), inp.data(), dout.data(), N); }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() { return {{"out", &out, false}, {"dinp", &dinp, true}}; }
  std::vector<FdInput<F>> fd_inputs() { return {{"dinp", &inp, &dinp}}; }
  static constexpr bool kOverwrites = false;
};

template <typename F>
struct ResidualCase {
  size_t N;
  uint64_t seed;
  std::vector<F> inp1, inp2, dout, out, dinp1, dinp2;
  ResidualCase(size_t N_, uint64_t seed_) : N(N_), seed(seed_) {
    Rng rng(seed);
    inp1 = rand_vec<F>(N, rng);
    inp2 = rand_vec<F>(N, rng);
    dout = rand_vec<F>(N, rng);
    out.assign(N, 0);
    dinp1.assign(N, 0);
    dinp2.assign(N, 0);
  }
  std::string params() const { return fmt::format("residual N={} seed={}", N, seed); }
  void forward(Backend k) { STRATA_RUN_OP(k, residual_forward, out.data(), inp1.data(), inp2.data(), N); }
  void backward(Backend k) { STRATA_RUN_OP(k, residual_backward, dinp1.data(), dinp2.data(), dout.data(), N); }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() { return {{"out", &out, false}, {"dinp1", &dinp1, true}, {"dinp2", &dinp2, true}}; }
  std::vector<FdInput<F>> fd_inputs() { return {{"dinp1", &inp1, &dinp1}, {"dinp2", &inp2, &dinp2}}; }
  static constexpr bool kOverwrites = false;
};

template <typename F>
struct CrossEntropyCase {
  int N, V;
  uint64_t seed;
  std::vector<int32_t> targets;
  std::vector<F> logits, dlosses, losses, lse, dlogits;
  CrossEntropyCase(int N_, int V_, uint64_t seed_) : N(N_), V(V_), seed(seed_) {
    Rng rng(seed);
    for (int n = 0; n < N; ++n)
      targets.push_back(n % 3 == 1 ? -1 : static_cast<int32_t>(rng.below(V)));  // some ignored
    logits = rand_vec<F>(size_t(N) * V, rng, -4.0, 4.0);
    dlosses = rand_vec<F>(N, rng, 0.5, 1.5);
    losses.assign(N, 0);
    lse.assign(N, 0);
    dlogits.assign(logits.size(), 0);
  }
  std::string params() const { return fmt::format("softmax_crossentropy N={} V={} seed={}", N, V, seed); }
  void forward(Backend k) {
    STRATA_RUN_OP(k, softmax_crossentropy_forward, losses.data(), lse.data(), logits.data(), targets.data(), N, V, 0);
  }
  void backward(Backend k) {
    STRATA_RUN_OP(k, softmax_crossentropy_backward, dlogits.data(), logits.data(), lse.data(), targets.data(),
                  dlosses.data(), N, V, 0);
  }
  double loss() const { return weighted_sum(losses, dlosses); }
  std::vector<Array<F>> arrays() {
    return {{"losses", &losses, false}, {"lse", &lse, false}, {"dlogits", &dlogits, true}};
  }
  std::vector<FdInput<F>> fd_inputs() { return {{"dlogits", &logits, &dlogits}}; }
  static constexpr bool kOverwrites = true;
};

// ---- shapes and tolerances -------------------------------------------------------------------------------------
// Small shapes are odd-sized and small enough for finite differences; large ones span several SIMD vectors,
// TBB blocks and key blocks, with T, C and hs off every multiple of 16 except hs = 64. NH divides C.
// Tolerances: float32 has eps = 1.2e-7. Each is set against what the op's float arithmetic allows and checked to
// be 2-10x above the largest error seen on these inputs, over ref<float> and all three SIMD clones (quoted as
// "seen"; all_close prints it when a check fails). A wrong index, term or sign is off by 1e-3 or more.
constexpr int kLargeT = 67;

// Encoder: out is one rounded addition (at most half an ulp: rtol eps). dwte/dwpe sum ~7 (large) rows of
// U(-1,1) per token / position, each addition rounding by half an ulp of a partial sum of a few units; seen
// 9.5e-7.
const Tols kEncoderTols{{"out", {0, 1.2e-7}}, {"dwte", {4e-6, 1e-6}}, {"dwpe", {4e-6, 1e-6}}};
// Layernorm: mean and rstd are C-term sums (C <= 768) then a division or square root; out (|out| <~ 4) and dinp
// a few roundings past them (seen 5.5e-7, 2.5e-7). dweight and dbias sum N <= 134 rows of O(1) terms, in chunks
// in fast (seen 4.1e-6).
const Tols kLayernormTols{{"out", {2e-6, 2e-6}},  {"mean", {1e-6, 1e-6}},    {"rstd", {0, 1e-6}},
                          {"dinp", {1e-6, 1e-6}}, {"dweight", {2e-5, 2e-6}}, {"dbias", {2e-5, 2e-6}}};
// Attention: hs-term dot products (hs <= 64), softmax over <= 130 keys (fast: simd::exp, < 1.3 ulp), then sums
// over keys and, for dk/dv, over the queries that see a key. Seen: out 9.2e-7, att 3.9e-7, dqkv 9.6e-7.
const Tols kAttentionTols{{"out", {2e-6, 2e-6}}, {"att", {1e-6, 2e-6}}, {"dqkv", {4e-6, 4e-6}}};
// Grouped-query: each key and value head's gradient sums over its group's query heads too (up to 4 x 130 queries
// at hs = 128), and the outputs are sums over up to 130 keys at hs = 128. Seen: out 1.4e-6, att 4.2e-7, dqkv
// 3.3e-6.
const Tols kGqaAttentionTols{{"out", {4e-6, 2e-6}}, {"att", {1e-6, 2e-6}}, {"dqkv", {1e-5, 4e-6}}};
// GELU on [-6, 4]: ref<float>'s tanhf and its 1 + tanh cancellation for negative x give absolute errors of a few
// ulp(1); fast's sigmoid form is within ~3 ulp relative. Seen: out 3.5e-7, dinp 4.5e-7.
const Tols kGeluTols{{"out", {1e-6, 1e-6}}, {"dinp", {1e-6, 2e-6}}};
// Residual: one rounded addition per element, or an exact one.
const Tols kResidualTols{{"out", {0, 1.2e-7}}, {"dinp1", {0, 1.2e-7}}, {"dinp2", {0, 1.2e-7}}};
// Cross-entropy: lse sums V exponentials (V = 50257: ~3100 terms per SIMD lane in fast), so it is off by ~1e-7
// relative of the sum, i.e. absolute on lse ~ 11 (seen 7.5e-7, ~1 ulp); losses inherit it (seen 9.9e-7).
// dlogits = e^(x - lse) dloss turns that absolute lse error into a relative one.
const Tols kCrossEntropyTols{{"losses", {1e-5, 1e-6}}, {"lse", {1e-5, 1e-6}}, {"dlogits", {1e-10, 4e-6}}};

// ---- the tests -------------------------------------------------------------------------------------------------

TEST(Encoder, RefFloatMatchesDouble) {
  expect_close_to_double<EncoderCase>(Backend::kRef, kEncoderTols, 3, 7, 20, 11, kSeed);
}
TEST(Encoder, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<EncoderCase>(3, 7, 20, 11, kSeed);
}
TEST(Encoder, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<EncoderCase>(Backend::kFast, kEncoderTols, 3, 7, 20, 11, kSeed);
    expect_close_to_double<EncoderCase>(Backend::kFast, kEncoderTols, 4, kLargeT, 96, 37, kSeed);
  });
}
// Fast groups rows by token but adds them in the reference's order: the same bits.
TEST(Encoder, FastBackwardIsBitwiseTheReference) {
  EncoderCase<float> r(4, kLargeT, 96, 37, kSeed), f(4, kLargeT, 96, 37, kSeed);
  r.backward(Backend::kRef);
  f.backward(Backend::kFast);
  EXPECT_TRUE(bitwise_equal(f.dwte, r.dwte, "dwte")) << f.params();
  EXPECT_TRUE(bitwise_equal(f.dwpe, r.dwpe, "dwpe")) << f.params();
}
TEST(Encoder, FastIsDeterministic) { expect_fast_deterministic<EncoderCase>(4, kLargeT, 96, 37, kSeed); }
TEST(Encoder, BackwardAccumulates) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<EncoderCase>(b, 3, 7, 20, 11, kSeed);
}

TEST(Layernorm, RefFloatMatchesDouble) {
  expect_close_to_double<LayernormCase>(Backend::kRef, kLayernormTols, 21, 20, kSeed);
}
TEST(Layernorm, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<LayernormCase>(21, 20, kSeed);
}
TEST(Layernorm, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<LayernormCase>(Backend::kFast, kLayernormTols, 5, 3, kSeed);  // rows shorter than a vector
    expect_close_to_double<LayernormCase>(Backend::kFast, kLayernormTols, 21, 20, kSeed);
    expect_close_to_double<LayernormCase>(Backend::kFast, kLayernormTols, 33, 100, kSeed);
    expect_close_to_double<LayernormCase>(Backend::kFast, kLayernormTols, 2 * kLargeT, 768, kSeed);
  });
}
TEST(Layernorm, FastIsDeterministic) { expect_fast_deterministic<LayernormCase>(2 * kLargeT, 768, kSeed); }
TEST(Layernorm, BackwardAccumulates) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<LayernormCase>(b, 21, 20, kSeed);
}

TEST(Attention, RefFloatMatchesDouble) {
  expect_close_to_double<AttentionCase>(Backend::kRef, kAttentionTols, 3, 7, 20, 4, kSeed);
}
TEST(Attention, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<AttentionCase>(3, 7, 20, 4, kSeed);
}
TEST(Attention, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<AttentionCase>(Backend::kFast, kAttentionTols, 2, 1, 4, 4, kSeed);  // T = 1, hs = 1
    expect_close_to_double<AttentionCase>(Backend::kFast, kAttentionTols, 3, 7, 20, 4, kSeed);
    expect_close_to_double<AttentionCase>(Backend::kFast, kAttentionTols, 2, kLargeT, 96, 4, kSeed);
    expect_close_to_double<AttentionCase>(Backend::kFast, kAttentionTols, 1, 130, 128, 2, kSeed);
  });
}
TEST(Attention, FastIsDeterministic) { expect_fast_deterministic<AttentionCase>(2, kLargeT, 96, 4, kSeed); }
TEST(Attention, BackwardOverwrites) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<AttentionCase>(b, 3, 7, 20, 4, kSeed);
}
// Grouped-query attention (the Llama family's num_key_value_heads): 6 query heads over 2 key/value heads, 8 over
// 2, and one shared head (multi-query) at head size 128.
TEST(Attention, GroupedQueryRefMatchesDoubleAndFiniteDifferences) {
  expect_close_to_double<AttentionCase>(Backend::kRef, kGqaAttentionTols, 3, 7, 24, 6, kSeed, 2);
  expect_gradients_match_finite_differences<AttentionCase>(3, 7, 24, 6, kSeed, 2);
}
TEST(Attention, GroupedQueryFastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<AttentionCase>(Backend::kFast, kGqaAttentionTols, 3, 7, 24, 6, kSeed, 2);
    expect_close_to_double<AttentionCase>(Backend::kFast, kGqaAttentionTols, 2, kLargeT, 96, 8, kSeed, 2);
    expect_close_to_double<AttentionCase>(Backend::kFast, kGqaAttentionTols, 1, 130, 512, 4, kSeed, 1);
  });
}
TEST(Attention, GroupedQueryFastIsDeterministicAndOverwrites) {
  expect_fast_deterministic<AttentionCase>(2, kLargeT, 96, 8, kSeed, 2);
  for (Backend b : {Backend::kRef, Backend::kFast})
    expect_backward_accumulates<AttentionCase>(b, 3, 7, 24, 6, kSeed, 2);
}
// The sharing is transformers' repeat_kv (repeat_interleave over heads): query head h reads key/value head
// h / (NH/NKV). So grouped-query attention is multi-head attention over the key and value heads repeated that
// way: the same out and att bit for bit (each head's arithmetic is the same), and each shared head's gradient
// the sum of its copies'.
TEST(Attention, GroupedQueryIsMultiHeadOverRepeatedKeysAndValues) {
  constexpr int B = 2, T = 11, NH = 6, NKV = 2, hs = 4, C = NH * hs, group = NH / NKV;
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    AttentionCase<float> gqa(B, T, C, NH, kSeed, NKV), mha(B, T, C, NH, kSeed);
    const size_t Wg = size_t(C) + 2 * NKV * hs, Wm = 3 * size_t(C);
    for (int row = 0; row < B * T; ++row) {
      const float* g = gqa.qkv.data() + row * Wg;
      float* m = mha.qkv.data() + row * Wm;
      std::copy_n(g, C, m);  // the queries
      for (int h = 0; h < NH; ++h) {
        std::copy_n(g + C + (h / group) * hs, hs, m + C + h * hs);              // key head h / group
        std::copy_n(g + C + (NKV + h / group) * hs, hs, m + 2 * C + h * hs);  // value head h / group
      }
    }
    mha.dout = gqa.dout;
    gqa.forward(b);
    mha.forward(b);
    EXPECT_TRUE(bitwise_equal(gqa.out, mha.out, "out")) << backend_name(b);
    EXPECT_TRUE(bitwise_equal(gqa.att, mha.att, "att")) << backend_name(b);
    gqa.backward(b);
    mha.backward(b);
    std::vector<double> want(gqa.dqkv.size(), 0.0);
    for (int row = 0; row < B * T; ++row) {
      const float* m = mha.dqkv.data() + row * Wm;
      double* w = want.data() + row * Wg;
      for (int i = 0; i < C; ++i) w[i] = m[i];
      for (int h = 0; h < NH; ++h)
        for (int i = 0; i < hs; ++i) {
          w[C + (h / group) * hs + i] += m[C + h * hs + i];
          w[C + (NKV + h / group) * hs + i] += m[2 * C + h * hs + i];
        }
    }
    EXPECT_TRUE(all_close(gqa.dqkv, want, 1e-6, 1e-6, "dqkv")) << backend_name(b);
  }
}
// Entries above the diagonal are written 0 whatever att held; each row is a distribution.
TEST(Attention, ProbabilitiesAreCausalRows) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    AttentionCase<float> c(2, 19, 12, 3, kSeed);
    std::fill(c.att.begin(), c.att.end(), NAN);
    c.forward(b);
    for (size_t row = 0; row < c.att.size() / c.T; ++row) {
      const int t = static_cast<int>(row % c.T);
      double sum = 0;
      for (int t2 = 0; t2 < c.T; ++t2) {
        const float a = c.att[row * c.T + t2];
        if (t2 > t) {
          ASSERT_EQ(a, 0.0f) << c.params() << " " << backend_name(b) << " row " << row << " col " << t2;
        }
        sum += a;
      }
      ASSERT_NEAR(sum, 1.0, 1e-6) << c.params() << " " << backend_name(b) << " row " << row;
    }
  }
}

TEST(Gelu, RefFloatMatchesDouble) { expect_close_to_double<GeluCase>(Backend::kRef, kGeluTols, size_t{1001}, kSeed); }
TEST(Gelu, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<GeluCase>(size_t{53}, kSeed);
}
TEST(Gelu, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<GeluCase>(Backend::kFast, kGeluTols, size_t{5}, kSeed);
    expect_close_to_double<GeluCase>(Backend::kFast, kGeluTols, size_t{53}, kSeed);
    expect_close_to_double<GeluCase>(Backend::kFast, kGeluTols, size_t{100003}, kSeed);
  });
}
TEST(Gelu, FastIsDeterministic) { expect_fast_deterministic<GeluCase>(size_t{100003}, kSeed); }
TEST(Gelu, BackwardAccumulates) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<GeluCase>(b, size_t{53}, kSeed);
}

TEST(Residual, RefFloatMatchesDouble) {
  expect_close_to_double<ResidualCase>(Backend::kRef, kResidualTols, size_t{53}, kSeed);
}
TEST(Residual, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<ResidualCase>(size_t{53}, kSeed);
}
TEST(Residual, FastMatchesDouble) {
  expect_close_to_double<ResidualCase>(Backend::kFast, kResidualTols, size_t{53}, kSeed);
  expect_close_to_double<ResidualCase>(Backend::kFast, kResidualTols, size_t{100003}, kSeed);
}
TEST(Residual, FastIsDeterministic) { expect_fast_deterministic<ResidualCase>(size_t{100003}, kSeed); }
TEST(Residual, BackwardAccumulates) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<ResidualCase>(b, size_t{53}, kSeed);
}

TEST(CrossEntropy, RefFloatMatchesDouble) {
  expect_close_to_double<CrossEntropyCase>(Backend::kRef, kCrossEntropyTols, 5, 53, kSeed);
}
TEST(CrossEntropy, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<CrossEntropyCase>(5, 53, kSeed);
}
TEST(CrossEntropy, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<CrossEntropyCase>(Backend::kFast, kCrossEntropyTols, 3, 7, kSeed);
    expect_close_to_double<CrossEntropyCase>(Backend::kFast, kCrossEntropyTols, 5, 53, kSeed);
    expect_close_to_double<CrossEntropyCase>(Backend::kFast, kCrossEntropyTols, 4, 50257, kSeed);
  });
}
TEST(CrossEntropy, FastIsDeterministic) { expect_fast_deterministic<CrossEntropyCase>(4, 50257, kSeed); }
TEST(CrossEntropy, BackwardOverwrites) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<CrossEntropyCase>(b, 5, 53, kSeed);
}
// In place (dlogits == logits) gives the same bits as out of place; ignored rows (target < 0) give exactly 0.
TEST(CrossEntropy, BackwardInPlaceAndIgnoredRows) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    CrossEntropyCase<float> c(4, 50257, kSeed);
    c.forward(b);
    c.backward(b);
    std::vector<float> inplace = c.logits;
    kernels(b).softmax_crossentropy_backward(inplace.data(), inplace.data(), c.lse.data(), c.targets.data(),
                                             c.dlosses.data(), c.N, c.V, 0);
    EXPECT_TRUE(bitwise_equal(inplace, c.dlogits, "in-place dlogits")) << c.params() << " " << backend_name(b);
    for (int n = 0; n < c.N; ++n) {
      if (c.targets[n] >= 0) continue;
      EXPECT_EQ(c.losses[n], 0.0f) << c.params() << " " << backend_name(b) << " row " << n;
      const auto row = c.dlogits.begin() + size_t(n) * c.V;
      EXPECT_TRUE(std::all_of(row, row + c.V, [](float x) { return x == 0.0f; }))
          << c.params() << " " << backend_name(b) << " row " << n;
    }
  }
}

// Tensor parallelism's vocab-parallel embedding: each of 3 uneven row slices of wte adds only its tokens' rows
// (the first slice also wpe), and the slices' outputs add up to the whole embedding's, bitwise (one of the
// summands is always zero). Backward: each slice's dwte is its rows of the whole dwte, bitwise; a null dwpe is
// left alone.
TEST(Encoder, VocabSlicesAddUpToTheWholeTable) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    EncoderCase<float> whole(3, 7, 16, 29, kSeed);
    whole.forward(b);
    whole.backward(b);
    const int starts[] = {0, 10, 20, 29};
    std::vector<float> sum(whole.out.size(), 0.0f);
    for (int r = 0; r < 3; ++r) {
      const int v0 = starts[r], rows = starts[r + 1] - v0;
      const float* wte = whole.wte.data() + size_t(v0) * whole.C;
      std::vector<float> out(whole.out.size(), -1.0f), dwte(size_t(rows) * whole.C, 0.0f);
      kernels(b).encoder_forward(out.data(), whole.inp.data(), wte, r == 0 ? whole.wpe.data() : nullptr, whole.B,
                                 whole.T, whole.C, v0, rows);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += out[i];
      kernels(b).encoder_backward(dwte.data(), nullptr, whole.dout.data(), whole.inp.data(), whole.B, whole.T,
                                  whole.C, v0, rows);
      const std::vector<float> expect(whole.dwte.begin() + size_t(v0) * whole.C,
                                      whole.dwte.begin() + size_t(v0 + rows) * whole.C);
      EXPECT_TRUE(bitwise_equal(dwte, expect, "slice dwte")) << whole.params() << " slice " << r << " "
                                                             << backend_name(b);
    }
    EXPECT_TRUE(bitwise_equal(sum, whole.out, "summed slices")) << whole.params() << " " << backend_name(b);
  }
}

// Vocab-parallel cross-entropy: the logits' columns cut into 3 uneven slices. Combining the slices' lse and
// losses on the host (lse = log sum exp of the slices' lse; the loss from the slice holding the target, plus
// lse - its lse) gives the whole row's loss, and each slice's backward with the combined lse gives its columns
// of the whole backward (fp32 rounding only).
TEST(CrossEntropy, VocabSlicesCombineToTheWholeRow) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    CrossEntropyCase<float> whole(6, 1001, kSeed);
    whole.forward(b);
    whole.backward(b);
    const int starts[] = {0, 334, 700, 1001};
    const int N = whole.N, V = whole.V;
    std::vector<std::vector<float>> lse(3, std::vector<float>(N)), loss(3, std::vector<float>(N));
    std::vector<std::vector<float>> cols(3);
    for (int r = 0; r < 3; ++r) {
      const int v0 = starts[r], w = starts[r + 1] - v0;
      cols[r].resize(size_t(N) * w);
      for (int n = 0; n < N; ++n)
        std::copy_n(whole.logits.begin() + size_t(n) * V + v0, w, cols[r].begin() + size_t(n) * w);
      kernels(b).softmax_crossentropy_forward(loss[r].data(), lse[r].data(), cols[r].data(), whole.targets.data(), N,
                                              w, v0);
    }
    std::vector<float> global_lse(N);
    for (int n = 0; n < N; ++n) {
      double m = -INFINITY;
      for (int r = 0; r < 3; ++r) m = std::max<double>(m, lse[r][n]);
      double s = 0.0;
      for (int r = 0; r < 3; ++r) s += std::exp(lse[r][n] - m);
      global_lse[n] = static_cast<float>(m + std::log(s));
      EXPECT_NEAR(global_lse[n], whole.lse[n], 1e-5 * std::abs(whole.lse[n])) << "row " << n << " " << backend_name(b);
      const int t = whole.targets[n];
      if (t < 0) {
        for (int r = 0; r < 3; ++r) EXPECT_EQ(loss[r][n], 0.0f);
        continue;
      }
      const int owner = t < starts[1] ? 0 : t < starts[2] ? 1 : 2;
      for (int r = 0; r < 3; ++r) {
        if (r != owner) {
          EXPECT_EQ(loss[r][n], 0.0f) << "row " << n << " slice " << r;
        }
      }
      const double combined = loss[owner][n] + (static_cast<double>(global_lse[n]) - lse[owner][n]);
      EXPECT_NEAR(combined, whole.losses[n], 1e-5 * std::max(1.0f, whole.losses[n])) << "row " << n;
    }
    for (int r = 0; r < 3; ++r) {
      const int v0 = starts[r], w = starts[r + 1] - v0;
      kernels(b).softmax_crossentropy_backward(cols[r].data(), cols[r].data(), global_lse.data(), whole.targets.data(),
                                               whole.dlosses.data(), N, w, v0);
      for (int n = 0; n < N; ++n)
        for (int v = 0; v < w; ++v)
          ASSERT_NEAR(cols[r][size_t(n) * w + v], whole.dlogits[size_t(n) * V + v0 + v], 1e-6)
              << "row " << n << " column " << v0 + v << " " << backend_name(b);
    }
  }
}

}  // namespace
}  // namespace strata::kernels
