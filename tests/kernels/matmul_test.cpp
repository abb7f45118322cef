// matmul_test.cpp — the matmul kernels (kernels/cpu/reference_matmul.h, kernels/cpu/fast_matmul.cpp) against a
// float64 reference on seeded random odd shapes, with and without bias, in fp32 and bf16; gradients also by
// finite differences; "+=" semantics on prefilled gradients; bitwise determinism; the primitive cache.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/matmul_info.h"
#include "kernels/cpu/reference_matmul.h"
#include "tests/test_util.h"

namespace strata::kernels::cpu {
namespace {

using ::strata::testing::all_close;
using ::strata::testing::cast_vector;
using ::strata::testing::random_vector;

// --- tolerances -----------------------------------------------------------------------------------------------
//
// Inputs are U(-1,1), so each product is at most 1 in size and a K-term dot product is a random walk whose
// partial sums are ~sqrt(k)/3. Each fp32 addition rounds by up to half an ulp of its partial sum, so the
// error is ~0.05*K*eps rms, but heavy-tailed (it scales with how far that element's walk wandered): in trials on
// these shapes the largest error seen is 0.76*K*eps (ref<float>, K = 384; oneDNN's blocked sums do a little better).
// We allow 3*K*eps: a 4x margin over the worst seen, yet a lost term, a wrong index or an overwrite instead of
// "+=" (errors of 1e-2 and more) still fails by at least 20x. kRtol covers the last rounding of a result of
// size |prefill| + |sum| (a few units) in "+=".
//
// kBF16 against the bf16 reference: the inputs are bf16 values on both sides and a bf16 x bf16 product is exact
// in fp32 (8+8 significant bits), so the only difference left is again fp32 accumulation: the same tolerance.
double accum_atol(int K) { return 3.0 * K * static_cast<double>(FLT_EPSILON); }
constexpr double kRtol = 4 * static_cast<double>(FLT_EPSILON);
// kBF16 against the *fp32* answer (to show the rounding really happens): each input moves by at most 2^-9
// relative, so each product by at most ~2^-8 of itself, and the sum by at most 2^-8 * sum|a*b| ~ 2^-8 * K/4.
// We allow twice that bound.
double bf16_vs_f32_atol(int K) { return 2.0 * K / 4.0 * std::ldexp(1.0, -8); }
// Finite differences of the float64 reference: the loss is linear in each single input, so a central
// difference is exact up to rounding of the loss (~1e-16 * |loss| / h with h = 1e-3).
constexpr double kFdStep = 1e-3;
constexpr double kFdAtol = 1e-9;

// --- cases ----------------------------------------------------------------------------------------------------

struct Case {
  int N, C, OC;
  bool bias;
  MatmulPrecision precision;
};
const char* precision_name(MatmulPrecision p) { return p == MatmulPrecision::kBF16 ? "bf16" : "f32"; }
std::string case_name(const Case& c) {
  return fmt::format("N{}_C{}_OC{}_{}_{}", c.N, c.C, c.OC, c.bias ? "bias" : "nobias", precision_name(c.precision));
}
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }
uint64_t seed_of(const Case& c) {
  return 1000003ull * c.N + 1009ull * c.C + 17ull * c.OC + (c.bias ? 2 : 0) + static_cast<uint64_t>(c.precision);
}

// Random inputs and prefilled (non-zero) gradients in fp32; the float64 runs widen them exactly.
struct Data {
  std::vector<float> inp, weight, bias, dout;     // (N,C), (OC,C), (OC), (N,OC)
  std::vector<float> dinp0, dweight0, dbias0;     // prefills of the gradients
};
Data make_data(const Case& c) {
  Rng rng(seed_of(c));
  const size_t nc = static_cast<size_t>(c.N) * c.C, oc = static_cast<size_t>(c.OC) * c.C;
  Data d;
  d.inp = random_vector<float>(nc, rng);
  d.weight = random_vector<float>(oc, rng);
  d.bias = random_vector<float>(c.OC, rng);
  d.dout = random_vector<float>(static_cast<size_t>(c.N) * c.OC, rng);
  d.dinp0 = random_vector<float>(nc, rng);
  d.dweight0 = random_vector<float>(oc, rng);
  d.dbias0 = random_vector<float>(c.OC, rng);
  return d;
}

template <typename F>
struct Grads {
  std::vector<F> dinp, dweight, dbias;
};

template <typename F>
std::vector<F> ref_forward(const Case& c, const Data& d, MatmulPrecision p) {
  const auto inp = cast_vector<F>(d.inp), weight = cast_vector<F>(d.weight), bias = cast_vector<F>(d.bias);
  std::vector<F> out(static_cast<size_t>(c.N) * c.OC);
  ref::matmul_forward<F>(out.data(), inp.data(), weight.data(), c.bias ? bias.data() : nullptr, c.N, c.C, c.OC,
                         p);
  return out;
}
std::vector<float> fast_forward(const Case& c, const Data& d) {
  std::vector<float> out(static_cast<size_t>(c.N) * c.OC);
  fast::matmul_forward(out.data(), d.inp.data(), d.weight.data(), c.bias ? d.bias.data() : nullptr, c.N, c.C,
                       c.OC, c.precision);
  return out;
}
template <typename F>
Grads<F> ref_backward(const Case& c, const Data& d) {
  Grads<F> g{cast_vector<F>(d.dinp0), cast_vector<F>(d.dweight0), cast_vector<F>(d.dbias0)};
  const auto dout = cast_vector<F>(d.dout), inp = cast_vector<F>(d.inp), weight = cast_vector<F>(d.weight);
  ref::matmul_backward<F>(g.dinp.data(), g.dweight.data(), c.bias ? g.dbias.data() : nullptr, dout.data(),
                          inp.data(), weight.data(), c.N, c.C, c.OC, c.precision);
  return g;
}
Grads<float> fast_backward(const Case& c, const Data& d) {
  Grads<float> g{d.dinp0, d.dweight0, d.dbias0};
  fast::matmul_backward(g.dinp.data(), g.dweight.data(), c.bias ? g.dbias.data() : nullptr, d.dout.data(),
                        d.inp.data(), d.weight.data(), c.N, c.C, c.OC, c.precision);
  return g;
}

// Compares gradients; each reduction has its own length K: dinp sums over OC, dweight and dbias over N.
template <typename A>
void expect_grads_close(const Grads<A>& got, const Grads<double>& want, const Case& c, const std::string& who) {
  EXPECT_TRUE(all_close(got.dinp, want.dinp, accum_atol(c.OC), kRtol, who + " dinp"));
  EXPECT_TRUE(all_close(got.dweight, want.dweight, accum_atol(c.N), kRtol, who + " dweight"));
  EXPECT_TRUE(all_close(got.dbias, want.dbias, accum_atol(c.N), kRtol, who + " dbias"));
}

class MatmulTest : public ::testing::TestWithParam<Case> {};

TEST_P(MatmulTest, ForwardMatchesFloat64Reference) {
  const Case c = GetParam();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed_of(c)));
  const Data d = make_data(c);
  const auto want = ref_forward<double>(c, d, c.precision);
  EXPECT_TRUE(all_close(ref_forward<float>(c, d, c.precision), want, accum_atol(c.C), kRtol, "ref<float> out"));
  EXPECT_TRUE(all_close(fast_forward(c, d), want, accum_atol(c.C), kRtol, "fast out"));
}

TEST_P(MatmulTest, BackwardAccumulatesAndMatchesFloat64Reference) {
  const Case c = GetParam();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed_of(c)));
  const Data d = make_data(c);
  const Grads<double> want = ref_backward<double>(c, d);
  expect_grads_close(ref_backward<float>(c, d), want, c, "ref<float>");
  const Grads<float> fast = fast_backward(c, d);
  expect_grads_close(fast, want, c, "fast");
  // Without a bias the dbias argument is null and the prefill must come back untouched.
  if (!c.bias) {
    EXPECT_EQ(0, std::memcmp(fast.dbias.data(), d.dbias0.data(), d.dbias0.size() * sizeof(float)));
  }
}

TEST_P(MatmulTest, FastIsBitwiseDeterministic) {
  const Case c = GetParam();
  SCOPED_TRACE(case_name(c));
  const Data d = make_data(c);
  const auto out1 = fast_forward(c, d);
  const auto g1 = fast_backward(c, d);
  // Another shape in between, so the second run goes through the cache and through reused scratch.
  const Case other{c.N + 2, c.C + 1, c.OC + 3, !c.bias, c.precision};
  const Data od = make_data(other);
  (void)fast_forward(other, od);
  (void)fast_backward(other, od);
  const auto out2 = fast_forward(c, d);
  const auto g2 = fast_backward(c, d);
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(out1, out2)) << "out differs between runs";
  EXPECT_TRUE(same(g1.dinp, g2.dinp)) << "dinp differs between runs";
  EXPECT_TRUE(same(g1.dweight, g2.dweight)) << "dweight differs between runs";
  EXPECT_TRUE(same(g1.dbias, g2.dbias)) << "dbias differs between runs";
}

struct Shape {
  int N, C, OC;
};
constexpr Shape kShapes[] = {{7, 13, 5}, {33, 65, 130}, {256, 384, 1152}};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const Shape& s : kShapes)
    for (bool bias : {true, false})
      for (MatmulPrecision p : {MatmulPrecision::kF32, MatmulPrecision::kBF16})
        cases.push_back(Case{s.N, s.C, s.OC, bias, p});
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Shapes, MatmulTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return case_name(i.param); });

TEST(MatmulFast, DbiasIsBitIdenticalToFloatReference) {
  // Both sum each column in row order into an fp32 partial sum and add it once; the TBB split must not matter.
  for (const Shape& s : kShapes) {
    const Case c{s.N, s.C, s.OC, true, MatmulPrecision::kF32};
    SCOPED_TRACE(case_name(c));
    const Data d = make_data(c);
    const auto want = ref_backward<float>(c, d).dbias;
    const auto got = fast_backward(c, d).dbias;
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
        << all_close(got, want, 0.0, 0.0, "dbias");
  }
}

TEST(MatmulFast, Bf16RoundsInputs) {
  // kBF16 must differ from the exact fp32 answer by more than fp32 rounding could explain, and by no more than
  // bf16 input rounding allows.
  for (const Shape& s : kShapes) {
    const Case c{s.N, s.C, s.OC, true, MatmulPrecision::kBF16};
    SCOPED_TRACE(case_name(c));
    const Data d = make_data(c);
    const auto exact = ref_forward<double>(c, d, MatmulPrecision::kF32);
    const auto got = fast_forward(c, d);
    EXPECT_TRUE(all_close(got, exact, bf16_vs_f32_atol(c.C), 0.0, "bf16 out vs fp32 answer"));
    EXPECT_FALSE(all_close(got, exact, accum_atol(c.C), kRtol, "bf16 out vs fp32 answer"))
        << "kBF16 gave fp32-accurate results: were the inputs rounded?";
  }
}

TEST(MatmulKernelSets, BackwardSetOverwritesTheInputGradient) {
  // Both CPU sets: dinp starts as NaN and must come out as matmul_backward into zeros, bit for bit; dweight and
  // dbias are still added into.
  for (const KernelSet* k : {&cpu_reference_kernels(), &cpu_fast_kernels()}) {
    const Case c{kShapes[1].N, kShapes[1].C, kShapes[1].OC, true, MatmulPrecision::kF32};
    SCOPED_TRACE(fmt::format("{} {}", k->name, case_name(c)));
    const Data d = make_data(c);
    std::vector<float> want_dinp(d.dinp0.size(), 0.0f), want_dw = d.dweight0, want_db = d.dbias0;
    k->matmul_backward(want_dinp.data(), want_dw.data(), want_db.data(), d.dout.data(), d.inp.data(),
                       d.weight.data(), c.N, c.C, c.OC, c.precision);
    std::vector<float> dinp(d.dinp0.size(), std::nanf("")), dw = d.dweight0, db = d.dbias0;
    k->matmul_backward_set(dinp.data(), dw.data(), db.data(), d.dout.data(), d.inp.data(), d.weight.data(), c.N,
                           c.C, c.OC, c.precision);
    EXPECT_EQ(0, std::memcmp(dinp.data(), want_dinp.data(), dinp.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(dw.data(), want_dw.data(), dw.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(db.data(), want_db.data(), db.size() * sizeof(float)));
  }
}

// --- the reference itself, by finite differences ---------------------------------------------------------------

TEST(MatmulReference, GradientsMatchFiniteDifferences) {
  const int N = 5, C = 7, OC = 3;
  Rng rng(42);
  auto inp = random_vector<double>(N * C, rng), weight = random_vector<double>(OC * C, rng);
  auto bias = random_vector<double>(OC, rng);
  const auto dout = random_vector<double>(N * OC, rng);  // loss = sum(out * dout), so dloss/dout = dout
  auto loss = [&] {
    std::vector<double> out(N * OC);
    ref::matmul_forward<double>(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC,
                                MatmulPrecision::kF32);
    double l = 0;
    for (int i = 0; i < N * OC; ++i) l += out[i] * dout[i];
    return l;
  };
  std::vector<double> dinp(N * C, 0.0), dweight(OC * C, 0.0), dbias(OC, 0.0);
  ref::matmul_backward<double>(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N,
                               C, OC, MatmulPrecision::kF32);
  auto check = [&](std::vector<double>& x, const std::vector<double>& dx, const char* what) {
    std::vector<double> fd(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i];
      x[i] = x0 + kFdStep;
      const double lp = loss();
      x[i] = x0 - kFdStep;
      const double lm = loss();
      x[i] = x0;
      fd[i] = (lp - lm) / (2 * kFdStep);
    }
    EXPECT_TRUE(all_close(dx, fd, kFdAtol, 0.0, what));
  };
  check(inp, dinp, "dinp vs finite differences");
  check(weight, dweight, "dweight vs finite differences");
  check(bias, dbias, "dbias vs finite differences");
}

TEST(MatmulReference, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: it must round to 1 (even), so 1x1 gives 1.
  const float x = 1.0f + std::ldexp(1.0f, -8), w = 1.0f;
  float out = 0;
  ref::matmul_forward<float>(&out, &x, &w, nullptr, 1, 1, 1, MatmulPrecision::kBF16);
  EXPECT_EQ(out, 1.0f);
  fast::matmul_forward(&out, &x, &w, nullptr, 1, 1, 1, MatmulPrecision::kBF16);
  EXPECT_EQ(out, 1.0f);
}

// --- edges and the cache ----------------------------------------------------------------------------------------

TEST(MatmulFast, EmptySums) {
  // C = 0: out is the bias (or 0); N = 0: dbias gets nothing added.
  const float bias[3] = {0.5f, -1.0f, 2.0f};
  std::vector<float> out(2 * 3, 9.0f);
  fast::matmul_forward(out.data(), nullptr, nullptr, bias, 2, 0, 3, MatmulPrecision::kF32);
  EXPECT_EQ(out, (std::vector<float>{0.5f, -1.0f, 2.0f, 0.5f, -1.0f, 2.0f}));
  fast::matmul_forward(out.data(), nullptr, nullptr, nullptr, 2, 0, 3, MatmulPrecision::kBF16);
  EXPECT_EQ(out, std::vector<float>(6, 0.0f));
  std::vector<float> dbias = {1.0f, 2.0f, 3.0f};
  fast::matmul_backward(nullptr, nullptr, dbias.data(), nullptr, nullptr, nullptr, 0, 4, 3, MatmulPrecision::kF32);
  EXPECT_EQ(dbias, (std::vector<float>{1.0f, 2.0f, 3.0f}));
}

TEST(MatmulFast, RepeatedShapesCreateNoPrimitives) {
  for (MatmulPrecision p : {MatmulPrecision::kF32, MatmulPrecision::kBF16}) {
    const Case c{19, 23, 29, true, p};
    SCOPED_TRACE(case_name(c));
    const Data d = make_data(c);
    (void)fast_forward(c, d);
    (void)fast_backward(c, d);
    const size_t created = matmul_primitives_created();
    for (int i = 0; i < 3; ++i) {
      (void)fast_forward(c, d);
      (void)fast_backward(c, d);
    }
    EXPECT_EQ(matmul_primitives_created(), created);
  }
}

TEST(MatmulFast, ReportsIsaAndRuntime) {
  const std::string isa = matmul_cpu_isa(), runtime = matmul_cpu_runtime();
  EXPECT_NE(isa, "unknown");
  std::cout << "oneDNN ISA " << isa << ", runtime " << runtime << ", bf16 native " << matmul_bf16_native()
            << ", impl f32 " << matmul_forward_impl(64, 96, 128, MatmulPrecision::kF32) << ", impl bf16 "
            << matmul_forward_impl(64, 96, 128, MatmulPrecision::kBF16) << "\n";
}

// compute.threads (--threads) limits the matmuls too: with oneDNN on OpenMP, TBB's limit does not reach them.
// The limit is the calling thread's (OpenMP's nthreads ICV), so it is set on a thread of its own here.
TEST(MatmulFast, AThreadsLimitReachesTheMatmulsOfItsThread) {
  if (std::string(matmul_cpu_runtime()) != "OpenMP") GTEST_SKIP() << "oneDNN runs on " << matmul_cpu_runtime();
  ASSERT_GT(matmul_threads(), 0) << "libgomp is loaded with libdnnl";
  const int before = matmul_threads();
  int limited = 0;
  std::thread([&] { limited = set_matmul_threads(1); }).join();
  EXPECT_EQ(limited, 1);
  EXPECT_EQ(matmul_threads(), before) << "another thread's limit";
  EXPECT_EQ(set_matmul_threads(0), 0) << "0 leaves it";
}

}  // namespace
}  // namespace strata::kernels::cpu
