// llama_ops_test.cpp — the ops the Llama family adds, forward and backward (kernels/cpu/reference.h,
// kernels/cpu/fast_elementwise.cpp): RMSNorm and its fused residual add, RoPE in the rotate-half layout, QK-norm,
// SwiGLU.
// The checks of ops_test.cpp (cpu_op_checks.h): ref<float> against ref<double> on seeded random odd shapes,
// ref<double> gradients against central finite differences, fast against ref<double> on every SIMD clone this
// machine runs, fast bitwise reproducible across thread counts, and each backward's "+=" (RMSNorm) or overwrite
// (RoPE, in place; SwiGLU) through both KernelSet tables.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/reference.h"
#include "tests/kernels/cpu_op_checks.h"
#include "tests/kernels/cpu_ops_test_util.h"
#include "tests/test_util.h"

namespace strata::kernels {
namespace {

using namespace cpu_ops_test;  // NOLINT(build/namespaces): the cases' vocabulary, as in ops_test.cpp
namespace ref = cpu::ref;

constexpr float kEps = 1e-6f;  // Llama 3's rms_norm_eps (Qwen's too); the test's rows are far above it

template <typename F>
struct RmsnormCase {
  int N, C;
  uint64_t seed;
  std::vector<F> inp, weight, dout, out, rstd, dinp, dweight;
  RmsnormCase(int N_, int C_, uint64_t seed_) : N(N_), C(C_), seed(seed_) {
    Rng rng(seed);
    inp = rand_vec<F>(size_t(N) * C, rng, -2.0, 3.0);
    weight = rand_vec<F>(C, rng, 0.5, 1.5);
    dout = rand_vec<F>(size_t(N) * C, rng);
    out.assign(inp.size(), 0);
    rstd.assign(N, 0);
    dinp.assign(inp.size(), 0);
    dweight.assign(C, 0);
  }
  std::string params() const { return fmt::format("rmsnorm N={} C={} seed={}", N, C, seed); }
  void forward(Backend k) {
    if constexpr (std::is_same_v<F, float>)
      kernels(k).rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps,
                                 MatmulPrecision::kF32);
    else
      ref::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
  }
  void backward(Backend k) {
    STRATA_RUN_OP(k, rmsnorm_backward, dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(),
                  rstd.data(), N, C);
  }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() {
    return {{"out", &out, false}, {"rstd", &rstd, false}, {"dinp", &dinp, true}, {"dweight", &dweight, true}};
  }
  std::vector<FdInput<F>> fd_inputs() { return {{"dinp", &inp, &dinp}, {"dweight", &weight, &dweight}}; }
  static constexpr bool kOverwrites = false;
};

// The rotation tables of a real RoPE (theta 10000, positions 0..T-1), so every angle a model meets is covered:
// near 0 for the slow frequencies, many turns for the fast ones.
template <typename F>
void rope_tables(int T, int hs, std::vector<F>* cos, std::vector<F>* sin) {
  const int half = hs / 2;
  cos->resize(static_cast<size_t>(T) * half);
  sin->resize(cos->size());
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(t) * static_cast<float>(std::pow(10000.0, -2.0 * i / hs));
      (*cos)[static_cast<size_t>(t) * half + i] = static_cast<F>(std::cos(static_cast<float>(angle)));
      (*sin)[static_cast<size_t>(t) * half + i] = static_cast<F>(std::sin(static_cast<float>(angle)));
    }
}

// RoPE works in place: `x` is the input, `y` the rotated copy (forward), `dy` the gradient of y, rotated back
// into `dx` (backward). The loss is sum(y * dout) over every element, the value heads' included (they pass
// through unrotated).
template <typename F>
struct RopeCase {
  int B, T, NH, NKV, hs;
  uint64_t seed;
  std::vector<F> x, cos, sin, dout, y, dx;
  RopeCase(int B_, int T_, int NH_, int NKV_, int hs_, uint64_t seed_)
      : B(B_), T(T_), NH(NH_), NKV(NKV_), hs(hs_), seed(seed_) {
    Rng rng(seed);
    const size_t n = size_t(B) * T * (NH + 2 * NKV) * hs;
    x = rand_vec<F>(n, rng);
    dout = rand_vec<F>(n, rng);
    rope_tables(T, hs, &cos, &sin);
    y.assign(n, 0);
    dx.assign(n, 0);
  }
  std::string params() const {
    return fmt::format("rope B={} T={} NH={} NKV={} hs={} seed={}", B, T, NH, NKV, hs, seed);
  }
  void forward(Backend k) {
    y = x;
    if constexpr (std::is_same_v<F, float>)
      kernels(k).rope_forward(y.data(), cos.data(), sin.data(), B, T, NH, NKV, hs, MatmulPrecision::kF32);
    else
      ref::rope_forward(y.data(), cos.data(), sin.data(), B, T, NH, NKV, hs);
  }
  void backward(Backend k) {
    dx = dout;
    if constexpr (std::is_same_v<F, float>)
      kernels(k).rope_backward(dx.data(), cos.data(), sin.data(), B, T, NH, NKV, hs, MatmulPrecision::kF32);
    else
      ref::rope_backward(dx.data(), cos.data(), sin.data(), B, T, NH, NKV, hs);
  }
  double loss() const { return weighted_sum(y, dout); }
  std::vector<Array<F>> arrays() { return {{"y", &y, false}, {"dx", &dx, true}}; }
  std::vector<FdInput<F>> fd_inputs() { return {{"dx", &x, &dx}}; }
  static constexpr bool kOverwrites = true;
};

template <typename F>
struct SwigluCase {
  int N, H;
  uint64_t seed;
  std::vector<F> inp, dout, out, dinp;
  SwigluCase(int N_, int H_, uint64_t seed_) : N(N_), H(H_), seed(seed_) {
    Rng rng(seed);
    inp = rand_vec<F>(size_t(N) * 2 * H, rng, -6.0, 4.0);  // both tails of silu: -> 0 and -> g
    dout = rand_vec<F>(size_t(N) * H, rng);
    out.assign(dout.size(), 0);
    dinp.assign(inp.size(), 0);
  }
  std::string params() const { return fmt::format("swiglu N={} H={} seed={}", N, H, seed); }
  void forward(Backend k) {
    if constexpr (std::is_same_v<F, float>)
      kernels(k).swiglu_forward(out.data(), inp.data(), N, H, MatmulPrecision::kF32);
    else
      ref::swiglu_forward(out.data(), inp.data(), N, H);
  }
  void backward(Backend k) {
    if constexpr (std::is_same_v<F, float>)
      kernels(k).swiglu_backward(dinp.data(), dout.data(), inp.data(), N, H, MatmulPrecision::kF32);
    else
      ref::swiglu_backward(dinp.data(), dout.data(), inp.data(), N, H);
  }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() { return {{"out", &out, false}, {"dinp", &dinp, true}}; }
  std::vector<FdInput<F>> fd_inputs() { return {{"dinp", &inp, &dinp}}; }
  static constexpr bool kOverwrites = true;
};

// QK-norm over the query and key heads of a qkv row, in place backward (the model's use: dqkv becomes its own
// pre-norm gradient); the value heads pass through.
template <typename F>
struct QkNormCase {
  int N, NH, NKV, hs;
  uint64_t seed;
  std::vector<F> inp, qweight, kweight, dout, out, rstd, dinp, dqweight, dkweight;
  QkNormCase(int N_, int NH_, int NKV_, int hs_, uint64_t seed_) : N(N_), NH(NH_), NKV(NKV_), hs(hs_), seed(seed_) {
    Rng rng(seed);
    const size_t n = size_t(N) * (NH + 2 * NKV) * hs;
    inp = rand_vec<F>(n, rng, -2.0, 3.0);
    qweight = rand_vec<F>(hs, rng, 0.5, 1.5);
    kweight = rand_vec<F>(hs, rng, 0.5, 1.5);
    dout = rand_vec<F>(n, rng);
    out.assign(n, 0);
    rstd.assign(size_t(N) * (NH + NKV), 0);
    dinp.assign(n, 0);
    dqweight.assign(hs, 0);
    dkweight.assign(hs, 0);
  }
  std::string params() const { return fmt::format("qk_norm N={} NH={} NKV={} hs={} seed={}", N, NH, NKV, hs, seed); }
  void forward(Backend k) {
    if constexpr (std::is_same_v<F, float>)
      kernels(k).qk_norm_forward(out.data(), rstd.data(), inp.data(), qweight.data(), kweight.data(), N, NH, NKV, hs,
                                 kEps, MatmulPrecision::kF32);
    else
      ref::qk_norm_forward(out.data(), rstd.data(), inp.data(), qweight.data(), kweight.data(), N, NH, NKV, hs, kEps);
  }
  void backward(Backend k) {
    dinp = dout;  // in place
    if constexpr (std::is_same_v<F, float>)
      kernels(k).qk_norm_backward(dinp.data(), dqweight.data(), dkweight.data(), dinp.data(), inp.data(),
                                  qweight.data(), kweight.data(), rstd.data(), N, NH, NKV, hs, MatmulPrecision::kF32);
    else
      ref::qk_norm_backward(dinp.data(), dqweight.data(), dkweight.data(), dinp.data(), inp.data(), qweight.data(),
                            kweight.data(), rstd.data(), N, NH, NKV, hs);
  }
  double loss() const { return weighted_sum(out, dout); }
  std::vector<Array<F>> arrays() {
    return {{"out", &out, false},
            {"rstd", &rstd, false},
            {"dinp", &dinp, true},
            {"dqweight", &dqweight, true},
            {"dkweight", &dkweight, true}};
  }
  std::vector<FdInput<F>> fd_inputs() {
    return {{"dinp", &inp, &dinp}, {"dqweight", &qweight, &dqweight}, {"dkweight", &kweight, &dkweight}};
  }
};

// ---- shapes and tolerances -------------------------------------------------------------------------------------
// As in ops_test.cpp: odd small shapes for finite differences, large ones across SIMD vectors and TBB blocks;
// each tolerance 2-10x above the largest error seen over ref<float> and the SIMD clones ("seen").
constexpr int kLargeN = 134;

// RMSNorm: a C-term sum of squares (C <= 768), a square root and a division for rstd; out and dinp a few
// roundings past it; dweight sums N <= 134 rows, in chunks in fast. Seen (absolute): out 5.7e-7, rstd 2.1e-7,
// dinp 5.4e-7, dweight 3.7e-6.
const Tols kRmsnormTols{{"out", {2e-6, 2e-6}}, {"rstd", {0, 1e-6}}, {"dinp", {2e-6, 2e-6}}, {"dweight", {2e-5, 2e-6}}};
// RoPE: two products and a sum per element, on |x| <= 1 and tables in [-1, 1]: an ulp or two of 1. Seen
// (absolute): y 1.1e-7, dx 1.2e-7.
const Tols kRopeTols{{"y", {4e-7, 4e-7}}, {"dx", {4e-7, 4e-7}}};
// QK-norm: RMSNorm over hs <= 128 elements per head; dqweight and dkweight sum over N x heads rows. Seen
// (absolute): as RMSNorm's.
const Tols kQkNormTols{{"out", {2e-6, 2e-6}},
                       {"rstd", {0, 1e-6}},
                       {"dinp", {2e-6, 2e-6}},
                       {"dqweight", {2e-5, 2e-6}},
                       {"dkweight", {2e-5, 2e-6}}};
// SwiGLU on gate in [-6, 4]: an exponential (fast: simd::exp, < 1.3 ulp), a division and two products, on
// outputs up to ~4. Seen (absolute): out 2.6e-6 (~5 ulp of the output), dinp 1.5e-6.
const Tols kSwigluTols{{"out", {1e-6, 2e-6}}, {"dinp", {1e-6, 2e-6}}};

// ---- the tests -------------------------------------------------------------------------------------------------

TEST(Rmsnorm, RefFloatMatchesDouble) {
  expect_close_to_double<RmsnormCase>(Backend::kRef, kRmsnormTols, 21, 20, kSeed);
}
TEST(Rmsnorm, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<RmsnormCase>(21, 20, kSeed);
}
TEST(Rmsnorm, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<RmsnormCase>(Backend::kFast, kRmsnormTols, 5, 3, kSeed);  // rows shorter than a vector
    expect_close_to_double<RmsnormCase>(Backend::kFast, kRmsnormTols, 21, 20, kSeed);
    expect_close_to_double<RmsnormCase>(Backend::kFast, kRmsnormTols, 33, 100, kSeed);
    expect_close_to_double<RmsnormCase>(Backend::kFast, kRmsnormTols, kLargeN, 768, kSeed);
  });
}
TEST(Rmsnorm, FastIsDeterministic) { expect_fast_deterministic<RmsnormCase>(kLargeN, 768, kSeed); }
TEST(Rmsnorm, BackwardAccumulates) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<RmsnormCase>(b, 21, 20, kSeed);
}
// The fused residual add is the add, then the RMSNorm of its sum: bitwise, on both tables.
TEST(Rmsnorm, ResidualFormIsTheAddThenTheNorm) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    const int N = 33, C = 100;
    Rng rng(kSeed);
    const std::vector<float> a = rand_vec<float>(size_t(N) * C, rng), c = rand_vec<float>(size_t(N) * C, rng);
    const std::vector<float> w = rand_vec<float>(C, rng, 0.5, 1.5);
    std::vector<float> res(a.size()), out(a.size()), rstd(N), sum(a.size()), want(a.size()), want_rstd(N);
    kernels(b).residual_rmsnorm_forward(res.data(), out.data(), rstd.data(), a.data(), c.data(), w.data(), N, C, kEps,
                                        MatmulPrecision::kF32);
    kernels(b).residual_forward(sum.data(), a.data(), c.data(), sum.size());
    kernels(b).rmsnorm_forward(want.data(), want_rstd.data(), sum.data(), w.data(), N, C, kEps, MatmulPrecision::kF32);
    EXPECT_TRUE(bitwise_equal(res, sum, "res")) << backend_name(b);
    EXPECT_TRUE(bitwise_equal(out, want, "out")) << backend_name(b);
    EXPECT_TRUE(bitwise_equal(rstd, want_rstd, "rstd")) << backend_name(b);
  }
}

TEST(Rope, RefFloatMatchesDouble) { expect_close_to_double<RopeCase>(Backend::kRef, kRopeTols, 2, 7, 4, 2, 6, kSeed); }
TEST(Rope, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<RopeCase>(2, 7, 4, 2, 6, kSeed);  // GQA: 4 query heads over 2
}
TEST(Rope, FastMatchesDouble) {
  expect_close_to_double<RopeCase>(Backend::kFast, kRopeTols, 2, 7, 4, 2, 6, kSeed);
  expect_close_to_double<RopeCase>(Backend::kFast, kRopeTols, 2, 67, 3, 3, 64, kSeed);  // no GQA, hs 64
  expect_close_to_double<RopeCase>(Backend::kFast, kRopeTols, 1, 130, 8, 2, 128, kSeed);
}
TEST(Rope, FastIsDeterministic) { expect_fast_deterministic<RopeCase>(2, 67, 8, 2, 64, kSeed); }
// The value heads pass through untouched, forward and backward; the rotation keeps each pair's length.
TEST(Rope, RotatesOnlyQueriesAndKeysAndKeepsTheirNorm) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    RopeCase<float> c(2, 9, 4, 2, 8, kSeed);
    c.forward(b);
    c.backward(b);
    const int W = (c.NH + 2 * c.NKV) * c.hs, half = c.hs / 2;
    for (int row = 0; row < c.B * c.T; ++row) {
      for (int i = (c.NH + c.NKV) * c.hs; i < W; ++i) {
        ASSERT_EQ(c.y[size_t(row) * W + i], c.x[size_t(row) * W + i]) << backend_name(b) << " row " << row;
        ASSERT_EQ(c.dx[size_t(row) * W + i], c.dout[size_t(row) * W + i]) << backend_name(b) << " row " << row;
      }
      for (int h = 0; h < c.NH + c.NKV; ++h)
        for (int i = 0; i < half; ++i) {
          const size_t j = size_t(row) * W + size_t(h) * c.hs + i;
          const double before = std::hypot(double(c.x[j]), double(c.x[j + half]));
          const double after = std::hypot(double(c.y[j]), double(c.y[j + half]));
          ASSERT_NEAR(after, before, 4e-7) << backend_name(b) << " row " << row << " head " << h << " pair " << i;
        }
    }
  }
}

TEST(QkNorm, RefFloatMatchesDouble) {
  expect_close_to_double<QkNormCase>(Backend::kRef, kQkNormTols, 7, 4, 2, 6, kSeed);
}
TEST(QkNorm, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<QkNormCase>(5, 4, 2, 6, kSeed);  // GQA: 4 query heads over 2
}
TEST(QkNorm, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<QkNormCase>(Backend::kFast, kQkNormTols, 7, 4, 2, 6, kSeed);  // heads shorter than a vector
    expect_close_to_double<QkNormCase>(Backend::kFast, kQkNormTols, 67, 4, 4, 24, kSeed);
    expect_close_to_double<QkNormCase>(Backend::kFast, kQkNormTols, kLargeN, 8, 2, 128, kSeed);
  });
}
TEST(QkNorm, FastIsDeterministic) { expect_fast_deterministic<QkNormCase>(kLargeN, 8, 2, 128, kSeed); }
// Out of place as in place: dinp overwritten (a NaN prefill leaves no trace), the value heads' gradient passed
// through, and the weights' gradients added to what they held.
TEST(QkNorm, BackwardOverwritesTheInputGradientAndAddsTheWeights) {
  for (Backend b : {Backend::kRef, Backend::kFast}) {
    QkNormCase<float> c(33, 4, 2, 24, kSeed);
    c.forward(b);
    c.backward(b);  // in place, from zero weight gradients
    std::vector<float> dinp(c.dinp.size(), NAN), dq(c.hs, 0.25f), dk(c.hs, -0.5f);
    kernels(b).qk_norm_backward(dinp.data(), dq.data(), dk.data(), c.dout.data(), c.inp.data(), c.qweight.data(),
                                c.kweight.data(), c.rstd.data(), c.N, c.NH, c.NKV, c.hs, MatmulPrecision::kF32);
    EXPECT_TRUE(bitwise_equal(dinp, c.dinp, "dinp")) << backend_name(b);
    const int W = (c.NH + 2 * c.NKV) * c.hs;
    for (int row = 0; row < c.N; ++row)
      for (int i = (c.NH + c.NKV) * c.hs; i < W; ++i) {
        ASSERT_EQ(c.dinp[size_t(row) * W + i], c.dout[size_t(row) * W + i]) << backend_name(b) << " row " << row;
        ASSERT_EQ(c.out[size_t(row) * W + i], c.inp[size_t(row) * W + i]) << backend_name(b) << " row " << row;
      }
    for (int i = 0; i < c.hs; ++i) {
      EXPECT_NEAR(dq[i], 0.25f + c.dqweight[i], 4e-6) << backend_name(b) << " dqweight " << i;
      EXPECT_NEAR(dk[i], -0.5f + c.dkweight[i], 4e-6) << backend_name(b) << " dkweight " << i;
    }
  }
}

TEST(Swiglu, RefFloatMatchesDouble) { expect_close_to_double<SwigluCase>(Backend::kRef, kSwigluTols, 7, 19, kSeed); }
TEST(Swiglu, RefGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences<SwigluCase>(7, 19, kSeed);
}
TEST(Swiglu, FastMatchesDouble) {
  for_each_isa([] {
    expect_close_to_double<SwigluCase>(Backend::kFast, kSwigluTols, 3, 5, kSeed);  // rows shorter than a vector
    expect_close_to_double<SwigluCase>(Backend::kFast, kSwigluTols, 7, 19, kSeed);
    expect_close_to_double<SwigluCase>(Backend::kFast, kSwigluTols, kLargeN, 1000, kSeed);
  });
}
TEST(Swiglu, FastIsDeterministic) { expect_fast_deterministic<SwigluCase>(kLargeN, 1000, kSeed); }
TEST(Swiglu, BackwardOverwrites) {
  for (Backend b : {Backend::kRef, Backend::kFast}) expect_backward_accumulates<SwigluCase>(b, 7, 19, kSeed);
}

}  // namespace
}  // namespace strata::kernels
