// cuda_matmul_test.cpp — the CUDA KernelSet's linears against the float64 CPU reference: the plain matmuls at
// both precisions (bf16 against the reference on bf16-rounded operands), the linears on either side of the hidden
// activations (kernels.h) with cuBLASLt's GELU epilogues and their fallbacks, and the classifier (LM head and
// cross-entropy over bf16 logits). Skips, saying why, where no CUDA device is usable.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/reference_matmul.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/ops.h"
#include "tests/kernels/cuda_ops_test_util.h"
#include "tests/test_util.h"

namespace strata::kernels {
namespace {

using ::strata::testing::all_close;
using namespace cuda_test;
namespace ref = cpu::ref;

// Matmul at both precisions; bf16 is compared with the reference run on bf16-rounded operands, so the only
// difference left is fp32 accumulation order.
void check_matmul(const KernelSet& k, int N, int C, int OC, MatmulPrecision precision, uint64_t seed, bool with_bias) {
  SCOPED_TRACE(fmt::format("matmul N={} C={} OC={} precision={} bias={} seed={}", N, C, OC,
                           precision == MatmulPrecision::kF32 ? "f32" : "bf16", with_bias, seed));
  Rng rng(seed);
  auto inp = rand_vec(size_t(N) * C, rng), weight = rand_vec(size_t(OC) * C, rng), bias = rand_vec(OC, rng);
  auto dout = rand_vec(size_t(N) * OC, rng);
  auto dinp0 = rand_vec(inp.size(), rng), dweight0 = rand_vec(weight.size(), rng), dbias0 = rand_vec(OC, rng);
  auto rounded = [&](const std::vector<float>& v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      d[i] = precision == MatmulPrecision::kF32 ? v[i] : bf16_to_f32(f32_to_bf16(v[i]));
    return d;
  };
  const auto inp_d = rounded(inp), w_d = rounded(weight), dout_d = rounded(dout), bias_d = to_double(bias);
  std::vector<double> out(size_t(N) * OC), dinp = to_double(dinp0), dweight = to_double(dweight0);
  std::vector<double> dbias = to_double(dbias0);
  ref::matmul_forward(out.data(), inp_d.data(), w_d.data(), with_bias ? bias_d.data() : nullptr, N, C, OC,
                      MatmulPrecision::kF32);
  ref::matmul_backward(dinp.data(), dweight.data(), with_bias ? dbias.data() : nullptr, dout_d.data(), inp_d.data(),
                       w_d.data(), N, C, OC, MatmulPrecision::kF32);
  // dbias sums the unrounded dout in every precision.
  if (with_bias) {
    dbias = to_double(dbias0);
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < OC; ++o) dbias[o] += dout[size_t(n) * OC + o];
  }

  Dev<float> g_inp(inp), g_w(weight), g_b(bias), g_dout(dout), g_dinp(dinp0), g_dw(dweight0), g_db(dbias0);
  auto g_out = Dev<float>::poisoned(out.size());
  k.matmul_forward(g_out.get(), g_inp.get(), g_w.get(), with_bias ? g_b.get() : nullptr, N, C, OC, precision);
  k.matmul_backward(g_dinp.get(), g_dw.get(), with_bias ? g_db.get() : nullptr, g_dout.get(), g_inp.get(), g_w.get(),
                    N, C, OC, precision);
  EXPECT_TRUE(all_close(g_out.download(), out, accum_atol(C), kRtol, "out"));
  EXPECT_TRUE(all_close(g_dinp.download(), dinp, accum_atol(OC), kRtol, "dinp"));
  EXPECT_TRUE(all_close(g_dw.download(), dweight, accum_atol(N), kRtol, "dweight"));
  if (with_bias) {
    EXPECT_TRUE(all_close(g_db.download(), dbias, accum_atol(N), kRtol, "dbias"));
  } else {
    EXPECT_EQ(g_db.download(), dbias0) << "dbias must be untouched when null is passed";
  }

  // matmul_backward_set overwrites dinp (poisoned: every element must be written, none read) and still adds
  // into dweight, here a second time.
  std::vector<double> dinp_set(inp.size(), 0.0);
  ref::matmul_backward(dinp_set.data(), dweight.data(), static_cast<double*>(nullptr), dout_d.data(), inp_d.data(),
                       w_d.data(), N, C, OC, MatmulPrecision::kF32);
  auto g_dinp_set = Dev<float>::poisoned(inp.size());
  k.matmul_backward_set(g_dinp_set.get(), g_dw.get(), nullptr, g_dout.get(), g_inp.get(), g_w.get(), N, C, OC,
                        precision);
  EXPECT_TRUE(all_close(g_dinp_set.download(), dinp_set, accum_atol(OC), kRtol, "dinp (set)"));
  EXPECT_TRUE(all_close(g_dw.download(), dweight, 2 * accum_atol(N), kRtol, "dweight (added twice)"));
}

TEST_F(CudaOpsTest, MatmulF32) {
  check_matmul(k, 37, 45, 61, MatmulPrecision::kF32, 6, true);
  check_matmul(k, 256, 384, 1152, MatmulPrecision::kF32, 7, true);
  check_matmul(k, 61, 64, 1001, MatmulPrecision::kF32, 8, false);  // the tied LM head: no bias
}

TEST_F(CudaOpsTest, MatmulBF16) {
  check_matmul(k, 37, 48, 64, MatmulPrecision::kBF16, 9, true);
  check_matmul(k, 256, 384, 1536, MatmulPrecision::kBF16, 10, true);
  check_matmul(k, 33, 45, 61, MatmulPrecision::kBF16, 11, false);  // odd leading dimensions
  check_matmul(k, 130, 64, 1001, MatmulPrecision::kBF16, 24, false);  // an odd vocabulary: padded rows and output
}

// The MLP's linear + GELU slots against the reference's matmul and GELU. Under bf16 the GELU may be cuBLASLt's
// epilogue's (its own tanh), so those values get 2e-3 relative on top of the accumulation's bound, and hidden
// activations kept in bf16 another bf16 rounding (2^-8 relative; 1e-2 in all); the backward's pre and inp are
// independent inputs here (the model's inp is gelu(pre)), and dpre starts as NaN: overwritten, not added to.
// `shift` 1 puts pre (both directions) 4 bytes off 16-byte alignment: the GELU's own kernels instead of
// cuBLASLt's epilogues.
void check_matmul_gelu(const KernelSet& k, int N, int C, int OC, MatmulPrecision precision, uint64_t seed,
                       int shift = 0) {
  const bool bf16 = precision == MatmulPrecision::kBF16;
  SCOPED_TRACE(fmt::format("matmul+gelu N={} C={} OC={} precision={} seed={} shift={}", N, C, OC,
                           bf16 ? "bf16" : "f32", seed, shift));
  Rng rng(seed);
  auto inp = rand_vec(size_t(N) * C, rng), weight = rand_vec(size_t(OC) * C, rng), bias = rand_vec(OC, rng);
  auto pre_b = rand_vec(size_t(N) * C, rng, -3.0, 3.0), dout = rand_vec(size_t(N) * OC, rng);
  auto dweight0 = rand_vec(weight.size(), rng), dbias0 = rand_vec(OC, rng);
  // The forward writes (N,OC) hidden; the backward reads and writes (N,C) hidden.
  const bool fwd_hidden_bf16 = hidden_is_bf16(k, N, OC, precision);
  const bool bwd_hidden_bf16 = hidden_is_bf16(k, N, C, precision);
  auto round = [&](const std::vector<float>& v, bool to_bf16) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); ++i) d[i] = to_bf16 ? bf16_to_f32(f32_to_bf16(v[i])) : v[i];
    return d;
  };
  // inp is both the forward's hidden input and the backward's (rounded to bf16 under bf16 either way: by the
  // hidden form, or by the matmul where the width keeps it fp32).
  const auto inp_d = round(inp, bf16), w_d = round(weight, bf16), dout_d = round(dout, bf16);
  // A bf16 output takes its bias in bf16 too (cuBLASLt's rule; autocast rounds it the same way).
  const auto bias_d = round(bias, fwd_hidden_bf16), pre_bd = round(pre_b, bwd_hidden_bf16);
  // forward: inp (N,C) -> (N,OC)
  std::vector<double> pre(size_t(N) * OC), out(pre.size());
  ref::matmul_forward(pre.data(), inp_d.data(), w_d.data(), bias_d.data(), N, C, OC, MatmulPrecision::kF32);
  ref::gelu_forward(out.data(), pre.data(), pre.size());
  // backward of the second linear: its input (N,C) was gelu(pre_b); here inp stands for it
  std::vector<double> dgelu(size_t(N) * C, 0.0), dpre(dgelu.size(), 0.0), dweight = to_double(dweight0);
  std::vector<double> dbias = to_double(dbias0);
  ref::matmul_backward(dgelu.data(), dweight.data(), static_cast<double*>(nullptr), dout_d.data(), inp_d.data(),
                       w_d.data(), N, C, OC, MatmulPrecision::kF32);
  ref::gelu_backward(dpre.data(), pre_bd.data(), dgelu.data(), dpre.size());
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) dbias[o] += dout[size_t(n) * OC + o];

  Dev<float> g_w(weight), g_b(bias), g_dout(dout), g_dw(dweight0), g_db(dbias0);
  Dev<float> g_inp_h = hidden_on_device(k, inp, N, C, precision);
  Dev<float> g_pre_b = hidden_on_device(k, pre_b, N, C, precision, shift);
  auto g_out = hidden_poisoned(k, N, OC, precision), g_pre = hidden_poisoned(k, N, OC, precision, shift);
  auto g_dpre = hidden_poisoned(k, N, C, precision), g_scratch = hidden_poisoned(k, N, C, precision);
  k.matmul_gelu_forward(g_out.get(), g_pre.get() + shift, g_inp_h.get(), g_w.get(), g_b.get(), N, C, OC, precision);
  k.matmul_backward_gelu(g_dpre.get(), g_dw.get(), g_db.get(), g_dout.get(), g_inp_h.get(), g_pre_b.get() + shift,
                         g_w.get(), g_scratch.get(), N, C, OC, precision);
  // bf16 hidden values: up to two roundings of 2^-8 relative each (the fallback rounds the GEMM's result, then
  // what the GELU makes of it).
  const double gelu_rtol = bf16 ? 2e-3 : kRtol, hidden_rtol = 1.0 / 128;
  const double fwd_rtol = fwd_hidden_bf16 ? hidden_rtol : 0.0, bwd_rtol = bwd_hidden_bf16 ? hidden_rtol : 0.0;
  EXPECT_TRUE(
      all_close(hidden_to_host(k, g_pre, N, OC, precision, shift), pre, accum_atol(C), kRtol + fwd_rtol, "pre"));
  {
    // out = gelu(pre): where pre was rounded to bf16 first (the fallback), its error reaches out through
    // gelu' (|gelu'| < 1.2), so the bound has a term in |pre| as well as in |out|.
    const std::vector<float> got = hidden_to_host(k, g_out, N, OC, precision);
    size_t bad = 0;
    std::string first;
    for (size_t i = 0; i < out.size(); ++i) {
      const double allowed = 1.2 * accum_atol(C) + kElemAtol + (gelu_rtol + fwd_rtol) * std::fabs(out[i]) +
                             (fwd_hidden_bf16 ? 1.2 * std::ldexp(std::fabs(pre[i]), -8) : 0.0);
      if (std::fabs(got[i] - out[i]) <= allowed) continue;
      if (++bad <= 8) first += fmt::format(" [{}] got {} want {};", i, got[i], out[i]);
    }
    EXPECT_EQ(bad, 0u) << "out: " << bad << " of " << out.size() << " elements differ; first:" << first;
  }
  {
    // dpre = gelu'(pre) * dgelu. cuBLASLt's DGELU epilogue may evaluate tanh approximately (the hardware's
    // tanh.approx is within ~2^-11 absolute); an error e in th = tanh(s(x + a x^3)) moves gelu'(x) by
    // e * |0.5 - x th s (1 + 3a x^2)| (up to ~5 at |x| = 3), an absolute error that scales with |dgelu|, not
    // with |dpre|: allowed under bf16 as 2^-10 of it.
    const std::vector<float> got = hidden_to_host(k, g_dpre, N, C, precision);
    constexpr double s = 0.7978845608028654, a = 0.044715;
    size_t bad = 0;
    std::string first;
    for (size_t i = 0; i < dpre.size(); ++i) {
      const double x = pre_bd[i], th = std::tanh(s * (x + a * x * x * x));
      const double slope_of_th = std::fabs(0.5 - x * th * s * (1 + 3 * a * x * x));
      const double allowed = 1.2 * accum_atol(OC) + kElemAtol + (gelu_rtol + bwd_rtol) * std::fabs(dpre[i]) +
                             (bf16 ? std::ldexp(slope_of_th * std::fabs(dgelu[i]), -10) : 0.0);
      if (std::fabs(got[i] - dpre[i]) <= allowed) continue;
      if (++bad <= 8) first += fmt::format(" [{}] got {} want {};", i, got[i], dpre[i]);
    }
    EXPECT_EQ(bad, 0u) << "dpre: " << bad << " of " << dpre.size() << " elements differ; first:" << first;
  }
  EXPECT_TRUE(all_close(g_dw.download(), dweight, accum_atol(N), kRtol, "dweight"));
  EXPECT_TRUE(all_close(g_db.download(), dbias, accum_atol(N), kRtol, "dbias"));
}

// The four linears on either side of a hidden activation (kernels.h), against the reference on the values as the
// backend holds them (bf16-rounded where it keeps them so): the MLP's second linear's forward from a hidden input
// and its first linear's backward from a hidden output gradient; the QKV linear's forward to a hidden output and
// the attention's output linear's backward with its input side hidden. A hidden output in bf16 is one more
// rounding (2^-8 relative, 1/128 allowed); overwritten outputs start as NaN.
void check_matmul_hidden(const KernelSet& k, int N, int F, int C, MatmulPrecision precision, uint64_t seed) {
  const bool bf16 = precision == MatmulPrecision::kBF16;
  SCOPED_TRACE(fmt::format("hidden matmuls N={} F={} C={} precision={} seed={}", N, F, C, bf16 ? "bf16" : "f32", seed));
  Rng rng(seed);
  auto h = rand_vec(size_t(N) * F, rng), w2 = rand_vec(size_t(C) * F, rng), b2 = rand_vec(C, rng);
  auto x = rand_vec(size_t(N) * C, rng), w1 = rand_vec(size_t(F) * C, rng), dh = rand_vec(size_t(N) * F, rng);
  auto dw1_0 = rand_vec(w1.size(), rng), db1_0 = rand_vec(F, rng);
  auto b1 = rand_vec(F, rng), dy = rand_vec(size_t(N) * C, rng);
  auto dw2_0 = rand_vec(w2.size(), rng), db2_0 = rand_vec(C, rng);
  const bool h16 = hidden_is_bf16(k, N, F, precision);
  const auto h_d = held(h, bf16), w2_d = held(w2, bf16), x_d = held(x, bf16), w1_d = held(w1, bf16);
  const auto dh_d = held(dh, bf16), dy_d = held(dy, bf16);
  // out (N,C) = h @ w2^T + b2
  std::vector<double> out(size_t(N) * C);
  ref::matmul_forward(out.data(), h_d.data(), w2_d.data(), to_double(b2).data(), N, F, C, MatmulPrecision::kF32);
  // dx (N,C) = dh @ w1 (overwritten); dw1 += dh^T @ x; db1 += column sums of dh (as the backend holds dh)
  std::vector<double> dx(size_t(N) * C, 0.0), dw1 = to_double(dw1_0), db1 = to_double(db1_0);
  const std::vector<double> dh_held = held(dh, h16);
  ref::matmul_backward(dx.data(), dw1.data(), static_cast<double*>(nullptr), dh_d.data(), x_d.data(), w1_d.data(), N,
                       C, F, MatmulPrecision::kF32);
  for (int n = 0; n < N; ++n)
    for (int f = 0; f < F; ++f) db1[f] += dh_held[size_t(n) * F + f];
  // out1 (N,F) hidden = x @ w1^T + b1 (a bf16 output takes its bias in bf16, as autocast rounds it)
  std::vector<double> out1(size_t(N) * F);
  ref::matmul_forward(out1.data(), x_d.data(), w1_d.data(), held(b1, h16).data(), N, C, F, MatmulPrecision::kF32);
  // dh2 (N,F) hidden = dy @ w2 (overwritten); dw2 += dy^T @ h; db2 += column sums of dy (fp32)
  std::vector<double> dh2(size_t(N) * F, 0.0), dw2 = to_double(dw2_0), db2 = to_double(db2_0);
  ref::matmul_backward(dh2.data(), dw2.data(), static_cast<double*>(nullptr), dy_d.data(), h_d.data(), w2_d.data(), N,
                       F, C, MatmulPrecision::kF32);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) db2[c] += dy[size_t(n) * C + c];

  Dev<float> g_h = hidden_on_device(k, h, N, F, precision), g_dh = hidden_on_device(k, dh, N, F, precision);
  Dev<float> g_x = hidden_on_device(k, x, N, C, precision);
  Dev<float> g_w2(w2), g_b2(b2), g_w1(w1), g_dw1(dw1_0), g_db1(db1_0);
  Dev<float> g_b1(b1), g_dy(dy), g_dw2(dw2_0), g_db2(db2_0);
  auto g_out = Dev<float>::poisoned(out.size()), g_dx = Dev<float>::poisoned(dx.size());
  auto g_out1 = hidden_poisoned(k, N, F, precision), g_dh2 = hidden_poisoned(k, N, F, precision);
  k.matmul_forward_hidden(g_out.get(), g_h.get(), g_w2.get(), g_b2.get(), N, F, C, precision);
  k.matmul_backward_set_hidden(g_dx.get(), g_dw1.get(), g_db1.get(), g_dh.get(), g_x.get(), g_w1.get(), N, C, F,
                               precision);
  k.matmul_forward_to_hidden(g_out1.get(), g_x.get(), g_w1.get(), g_b1.get(), N, C, F, precision);
  k.matmul_backward_hidden(g_dh2.get(), g_dw2.get(), g_db2.get(), g_dy.get(), g_h.get(), g_w2.get(), N, F, C,
                           precision);
  const double hidden_rtol = h16 ? 1.0 / 128 : 0.0;
  EXPECT_TRUE(all_close(g_out.download(), out, accum_atol(F), kRtol, "out"));
  EXPECT_TRUE(all_close(g_dx.download(), dx, accum_atol(F), kRtol, "dinp (set)"));
  EXPECT_TRUE(all_close(g_dw1.download(), dw1, accum_atol(N), kRtol, "dweight"));
  EXPECT_TRUE(all_close(g_db1.download(), db1, accum_atol(N), kRtol, "dbias"));
  EXPECT_TRUE(all_close(hidden_to_host(k, g_out1, N, F, precision), out1, accum_atol(C), kRtol + hidden_rtol,
                        "out (to hidden)"));
  EXPECT_TRUE(all_close(hidden_to_host(k, g_dh2, N, F, precision), dh2, accum_atol(C), kRtol + hidden_rtol,
                        "dinp (hidden)"));
  EXPECT_TRUE(all_close(g_dw2.download(), dw2, accum_atol(N), kRtol, "dweight (hidden inp)"));
  EXPECT_TRUE(all_close(g_db2.download(), db2, accum_atol(N), kRtol, "dbias (hidden inp)"));
}

TEST_F(CudaOpsTest, MatmulHidden) {
  for (MatmulPrecision precision : {MatmulPrecision::kF32, MatmulPrecision::kBF16}) {
    check_matmul_hidden(k, 64, 384, 96, precision, 28);  // bf16 hidden
    check_matmul_hidden(k, 37, 61, 45, precision, 29);   // an odd width: fp32 hidden
  }
}

TEST_F(CudaOpsTest, MatmulGelu) {
  for (MatmulPrecision precision : {MatmulPrecision::kF32, MatmulPrecision::kBF16}) {
    check_matmul_gelu(k, 64, 96, 384, precision, 25);  // widths that take the epilogues
    check_matmul_gelu(k, 37, 45, 61, precision, 26);   // odd widths: the unfused fallback
    check_matmul_gelu(k, 64, 96, 384, precision, 30, /*shift=*/1);  // pre misaligned: the GELU kernels
  }
  // The GPT-2-like widths must really have run cuBLASLt's epilogues under bf16 (GELU_AUX_BIAS forward, DGELU
  // backward), not the fallback the odd widths take: the comparison above passes either way. The check's
  // backward is of a linear from its input width to its output one, so the model's shapes take two calls: its
  // first linear's forward (768 -> 3072), and its second linear's backward (hidden 3072, out 768).
  const cuda::MatmulEpilogueCounts before = cuda::matmul_epilogue_counts();
  check_matmul_gelu(k, 128, 768, 3072, MatmulPrecision::kBF16, 27);
  check_matmul_gelu(k, 128, 3072, 768, MatmulPrecision::kBF16, 31);
  const cuda::MatmulEpilogueCounts after = cuda::matmul_epilogue_counts();
  EXPECT_EQ(after.fallback_plans, before.fallback_plans) << "cuBLASLt took no GELU epilogue for bf16 inputs, "
                                                            "output and aux";
  // Plans are cached for the process: planned here (4) or by an earlier run of this test (--gtest_repeat).
  EXPECT_GE(after.gelu_plans, 4) << "not every GELU epilogue was planned";
}

// STRATA_MATMUL_AUTOTUNE's plans (ops.h): each times the heuristic's candidates on scratch and keeps the fastest.
// Shapes no other case plans, so their plans are made here with it on: the plain GEMMs at both precisions, and
// the GELU epilogues (GELU_AUX writes its aux into scratch while timing; DGELU reads the real one).
TEST_F(CudaOpsTest, MatmulAutotune) {
  ScopedSwitch<bool> autotune(cuda::matmul_autotune, cuda::set_matmul_autotune, true);
  check_matmul(k, 192, 320, 704, MatmulPrecision::kBF16, 41, true);
  check_matmul(k, 96, 160, 224, MatmulPrecision::kF32, 42, true);
  check_matmul_gelu(k, 128, 160, 640, MatmulPrecision::kBF16, 43);
  // Candidates were timed (only this test turns autotuning on; plans are kept for the process, so under
  // --gtest_repeat they were timed in its first run).
  EXPECT_GE(cuda::matmul_epilogue_counts().autotuned_plans, 1) << "no plan timed its candidates";
}

// The weights' working copies (kernels.h Weight): a linear gives bitwise the same results from the copy
// weights_to_bf16 makes as from its fp32 weights, and really takes the copy (a copy holding other numbers changes
// them). The three ways it is taken: in place (OC a multiple of 8, a 16-byte aligned start), copied with zero rows
// after it (an odd OC: the padded GEMM of the LM head and of every bf16 backward), and copied from a start 8 bytes
// past alignment.
TEST_F(CudaOpsTest, MatmulWorkingCopies) {
  constexpr int N = 37, C = 64;
  Rng rng(61);
  const auto w = rand_vec(size_t(211) * C + 8, rng);  // room for the largest OC from 4 elements in
  const auto inp = rand_vec(size_t(N) * C, rng), dout = rand_vec(size_t(N) * 211, rng), bias = rand_vec(211, rng);
  Dev<float> g_w(w), g_inp(inp), g_dout(dout), g_bias(bias);
  auto g_w16 = Dev<uint16_t>::poisoned(w.size());
  ASSERT_NE(k.weights_to_bf16, nullptr);
  k.weights_to_bf16(g_w16.get(), g_w.get(), w.size());
  std::vector<uint16_t> doubled = g_w16.download();
  for (uint16_t& h : doubled) h = f32_to_bf16(2.0f * bf16_to_f32(h));
  Dev<uint16_t> g_wrong(doubled);

  struct Case {
    int OC;
    size_t offset;  // elements into the weights
    bool bias;
  };
  for (const Case& c : {Case{192, 0, true}, Case{211, 0, false}, Case{192, 4, true}}) {
    SCOPED_TRACE(fmt::format("OC={} offset={} bias={}", c.OC, c.offset, c.bias));
    const float* b = c.bias ? g_bias.get() : nullptr;
    auto run = [&](Weight weight) {
      auto out = Dev<float>::poisoned(size_t(N) * c.OC);
      Dev<float> dinp(std::vector<float>(inp.size(), 0.0f)), dw(std::vector<float>(size_t(c.OC) * C, 0.0f));
      k.matmul_forward(out.get(), g_inp.get(), weight, b, N, C, c.OC, MatmulPrecision::kBF16);
      k.matmul_backward(dinp.get(), dw.get(), nullptr, g_dout.get(), g_inp.get(), weight, N, C, c.OC,
                        MatmulPrecision::kBF16);
      std::vector<float> all = out.download(), d = dinp.download();
      all.insert(all.end(), d.begin(), d.end());
      return all;
    };
    const float* w32 = g_w.get() + c.offset;
    const auto before = cuda::matmul_epilogue_counts().working_copy_operands;
    const std::vector<float> rounded = run(Weight(w32)), copied = run(Weight(w32, g_w16.get() + c.offset));
    EXPECT_EQ(cuda::matmul_epilogue_counts().working_copy_operands - before, 2) << "the copy was not taken";
    ASSERT_EQ(rounded.size(), copied.size());
    EXPECT_EQ(std::memcmp(rounded.data(), copied.data(), rounded.size() * sizeof(float)), 0)
        << "the working copy gave other numbers than rounding the fp32 weights";
    const std::vector<float> wrong = run(Weight(w32, g_wrong.get() + c.offset));
    EXPECT_NE(std::memcmp(rounded.data(), wrong.data(), rounded.size() * sizeof(float)), 0)
        << "a copy of doubled weights changed nothing: the linears did not read it";
  }
}

// The classifier slots (the LM head and its cross-entropy) against the reference's matmul and cross-entropy.
// Under bf16 the reference rounds what the fused kernels keep in bf16 too — the operands, the logits and their
// gradient, as PyTorch's autocast does — so what is left is fp32 accumulation and the odd rounding it flips.
// A logit within fp32 accumulation error of a bf16 rounding boundary may round the other way: one bf16 ulp of
// these logits (|x| < 2) is at most 2^-7, and it reaches a loss only through its own target. (Padding columns
// counted in the softmax would be caught by V = 61: three more exp(0) terms move its lse by ~0.05.)
double flip_of(bool bf16) { return bf16 ? 1.0 / 128 : 0.0; }

void check_classifier(const KernelSet& k, int N, int C, int V, int v0, MatmulPrecision precision, uint64_t seed) {
  const bool bf16 = precision == MatmulPrecision::kBF16;
  SCOPED_TRACE(fmt::format("classifier N={} C={} V={} vocab_start={} precision={} seed={}", N, C, V, v0,
                           bf16 ? "bf16" : "f32", seed));
  Rng rng(seed);
  auto inp = rand_vec(size_t(N) * C, rng), weight = rand_vec(size_t(V) * C, rng, -0.1, 0.1);
  auto dlosses = rand_vec(N, rng, 0.1, 1.0);
  auto dinp0 = rand_vec(inp.size(), rng), dweight0 = rand_vec(weight.size(), rng);
  std::vector<int32_t> targets(N);
  for (int n = 0; n < N; ++n)  // some ignored; with a slice, some another rank's
    targets[n] = n % 7 == 3 ? -1 : static_cast<int32_t>(rng.below(v0 > 0 ? 4000 : V));
  targets[1] = v0 + V - 1;  // the last column, next to the padding
  targets[2] = v0;          // and the first
  auto round = [&](double x) {
    return bf16 ? static_cast<double>(bf16_to_f32(f32_to_bf16(static_cast<float>(x)))) : x;
  };
  std::vector<double> inp_d(inp.size()), w_d(weight.size());
  std::transform(inp.begin(), inp.end(), inp_d.begin(), round);
  std::transform(weight.begin(), weight.end(), w_d.begin(), round);
  std::vector<double> logits(size_t(N) * V), losses(N), lse(N), dlogits(logits.size());
  ref::matmul_forward(logits.data(), inp_d.data(), w_d.data(), static_cast<const double*>(nullptr), N, C, V,
                      MatmulPrecision::kF32);
  for (double& x : logits) x = round(x);
  const auto dlosses_d = to_double(dlosses);
  ref::softmax_crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, v0);
  ref::softmax_crossentropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), dlosses_d.data(), N,
                                     V, v0);
  for (double& x : dlogits) x = round(x);
  std::vector<double> dinp = to_double(dinp0), dweight = to_double(dweight0);
  ref::matmul_backward(dinp.data(), dweight.data(), static_cast<double*>(nullptr), dlogits.data(), inp_d.data(),
                       w_d.data(), N, C, V, MatmulPrecision::kF32);

  Dev<float> g_inp = hidden_on_device(k, inp, N, C, precision);  // a layernorm's output: hidden
  Dev<float> g_w(weight), g_dlosses(dlosses), g_dinp(dinp0), g_dw(dweight0);
  Dev<int32_t> g_targets(targets);
  auto g_logits = Dev<float>::poisoned((k.classifier_logits_bytes(N, V, precision) + 3) / 4);
  auto g_losses = Dev<float>::poisoned(N), g_lse = Dev<float>::poisoned(N);
  k.classifier_forward(g_logits.get(), g_losses.get(), g_lse.get(), g_inp.get(), g_w.get(), g_targets.get(), N, C, V,
                       v0, precision);
  // The logits as stored, in the CUDA backend's form: fp32 (N, V), or under bf16 (N, ld) with ld = V rounded up
  // to 8 and the padding columns 0. Read whole after the forward and again after the backward has overwritten
  // them with their gradient: at V = 50257 the losses and input gradients see the softmax only faintly (one
  // probability is ~2e-5), so a wrong probability in some chunk of the row shows here first.
  const int ld = bf16 ? (V + 7) / 8 * 8 : V;
  auto stored = [&] {
    const std::vector<float> raw = g_logits.download();
    std::vector<double> values(size_t(N) * V);
    size_t nonzero_padding = 0;
    for (size_t n = 0; n < size_t(N); ++n) {
      for (int c = 0; c < ld; ++c) {
        double x;
        if (bf16) {
          uint16_t h;
          std::memcpy(&h, reinterpret_cast<const char*>(raw.data()) + (n * ld + c) * sizeof(uint16_t), sizeof h);
          x = bf16_to_f32(h);
        } else {
          x = raw[n * ld + c];
        }
        if (c < V)
          values[n * V + c] = x;
        else if (x != 0.0)
          ++nonzero_padding;
      }
    }
    EXPECT_EQ(nonzero_padding, 0u) << "padding columns must hold 0";
    return values;
  };
  EXPECT_TRUE(all_close(stored(), logits, accum_atol(C) + flip_of(bf16), kRtol, "stored logits"));
  k.classifier_backward(g_dinp.get(), g_dw.get(), g_logits.get(), g_lse.get(), g_targets.get(), g_dlosses.get(),
                        g_inp.get(), g_w.get(), N, C, V, v0, precision);
  // The gradient, element by element: under bf16 one rounding of its own (2^-8 relative) and, where the logit's
  // own rounding flipped, its probability off by up to exp(2^-7); fp32 as the plain cross-entropy. A systematic
  // error (a probability scaled by a wrong sum) would hide under the bf16 bound, so the mean relative error over
  // the row's entries must also stay at the level of rounding alone (about 2^-10 on average; 2^-8 allowed).
  const auto got_dlogits = stored();
  // (fp32: the logits' accumulation error moves a probability by up to twice as much, relatively.)
  const double dlogit_rtol = bf16 ? 1.0 / 32 : 2 * accum_atol(C) + 1e-5;
  EXPECT_TRUE(all_close(got_dlogits, dlogits, bf16 ? 1e-9 : 1e-7, dlogit_rtol, "stored dlogits"));
  double rel_sum = 0;
  size_t rel_n = 0;
  for (size_t i = 0; i < dlogits.size(); ++i) {
    if (dlogits[i] == 0.0) continue;
    rel_sum += std::abs(got_dlogits[i] - dlogits[i]) / std::abs(dlogits[i]);
    ++rel_n;
  }
  if (rel_n > 0) {
    EXPECT_LE(rel_sum / static_cast<double>(rel_n), bf16 ? 1.0 / 256 : accum_atol(C)) << "mean relative error";
  }
  const double logit_atol = accum_atol(C) + flip_of(bf16);
  EXPECT_TRUE(all_close(g_lse.download(), lse, logit_atol + 1e-5, 1e-5, "lse"));
  EXPECT_TRUE(all_close(g_losses.download(), losses, 2 * logit_atol + 1e-5, 1e-5, "losses"));
  EXPECT_TRUE(all_close(g_dinp.download(), dinp, accum_atol(V) + (bf16 ? 1e-3 : 0.0), kRtol, "dinp"));
  EXPECT_TRUE(all_close(g_dw.download(), dweight, accum_atol(N) + (bf16 ? 1e-3 : 0.0), kRtol, "dweight"));
}

TEST_F(CudaOpsTest, Classifier) {
  for (MatmulPrecision precision : {MatmulPrecision::kF32, MatmulPrecision::kBF16}) {
    check_classifier(k, 37, 64, 61, 0, precision, 22);
    check_classifier(k, 67, 64, 50257, 0, precision, 23);    // GPT-2's vocabulary: not a multiple of 8
    check_classifier(k, 41, 96, 1500, 1000, precision, 24);  // a slice [1000, 2500) of a 4000-id vocabulary
    check_classifier(k, 5, 45, 64, 0, precision, 25);        // a width not a multiple of 8; no padding columns
  }
}

}  // namespace
}  // namespace strata::kernels
