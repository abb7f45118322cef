// cuda_ops_test.cpp — every op of the CUDA KernelSet (kernels/cuda) but the matmuls (cuda_matmul_test.cpp)
// against the float64 instantiation of the CPU reference (kernels/cpu/reference.h) on seeded random odd-sized
// inputs, forward and backward: gradients start from random values so "+=" is checked, forward outputs are
// poisoned with NaN so an unwritten element fails. Also: AdamW bitwise equal to the CPU reference at float, and
// bitwise reproducibility of the reductions. Skips, saying why, where no CUDA device is usable.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/reference_matmul.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/cudnn_graph.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/ops.h"
#include "tests/kernels/cuda_ops_test_util.h"
#include "tests/test_util.h"

namespace strata::kernels {
namespace {

using ::strata::testing::all_close;
using namespace cuda_test;
namespace ref = cpu::ref;

// The whole table, and a slice of its rows without wpe (tensor parallelism's vocab-parallel embedding: tokens
// outside the slice add nothing).
TEST_F(CudaOpsTest, Encoder) {
  for (auto [B, T, C, V, seed, sliced] :
       {std::tuple{3, 37, 45, 53, 1u, false}, std::tuple{4, 64, 768, 997, 2u, false},
        std::tuple{3, 37, 45, 53, 3u, true}}) {
    SCOPED_TRACE(fmt::format("encoder B={} T={} C={} V={} seed={} sliced={}", B, T, C, V, seed, sliced));
    const int v0 = sliced ? V / 3 : 0, rows = sliced ? V / 3 : V;
    Rng rng(seed);
    std::vector<int32_t> inp(size_t(B) * T);
    for (auto& t : inp) t = static_cast<int32_t>(rng.below(V));  // V < B*T on the first: repeated tokens
    auto wte = rand_vec(size_t(rows) * C, rng), wpe = rand_vec(size_t(T) * C, rng);
    auto dout = rand_vec(size_t(B) * T * C, rng);
    auto dwte0 = rand_vec(wte.size(), rng), dwpe0 = rand_vec(wpe.size(), rng);

    std::vector<double> out(dout.size()), dwte = to_double(dwte0), dwpe = to_double(dwpe0);
    const auto wte_d = to_double(wte), wpe_d = to_double(wpe), dout_d = to_double(dout);
    ref::encoder_forward(out.data(), inp.data(), wte_d.data(), sliced ? nullptr : wpe_d.data(), B, T, C, v0, rows);
    ref::encoder_backward(dwte.data(), sliced ? nullptr : dwpe.data(), dout_d.data(), inp.data(), B, T, C, v0, rows);

    Dev<int32_t> g_inp(inp);
    Dev<float> g_wte(wte), g_wpe(wpe), g_dout(dout), g_dwte(dwte0), g_dwpe(dwpe0);
    auto g_out = Dev<float>::poisoned(dout.size());
    k.encoder_forward(g_out.get(), g_inp.get(), g_wte.get(), sliced ? nullptr : g_wpe.get(), B, T, C, v0, rows);
    k.encoder_backward(g_dwte.get(), sliced ? nullptr : g_dwpe.get(), g_dout.get(), g_inp.get(), B, T, C, v0, rows);
    EXPECT_TRUE(all_close(g_out.download(), out, kElemAtol, kRtol, "out"));
    EXPECT_TRUE(all_close(g_dwte.download(), dwte, accum_atol(B * T), kRtol, "dwte"));
    EXPECT_TRUE(all_close(g_dwpe.download(), dwpe, accum_atol(B), kRtol, "dwpe"));  // untouched when sliced
  }
}

// C = 45 takes the general kernel; widths that are a multiple of 4 up to 2048 the register-row kernel, one case
// for each of its row sizes (2, 4, 6, 8, 12 and 16 float4s a lane: C = 256, 512, 768, 1024, 1536, 1600), with
// row counts that leave its last block of 8 rows part-empty; C = 2056 the general kernel with a bf16 output.
TEST_F(CudaOpsTest, Layernorm) {
  for (auto [N, C, seed] :
       {std::tuple{37, 45, 3u}, std::tuple{1031, 768, 4u}, std::tuple{5, 1600, 5u}, std::tuple{9, 256, 6u},
        std::tuple{17, 512, 7u}, std::tuple{8, 1024, 8u}, std::tuple{23, 1536, 9u}, std::tuple{5, 2056, 10u}}) {
    SCOPED_TRACE(fmt::format("layernorm N={} C={} seed={}", N, C, seed));
    Rng rng(seed);
    auto inp = rand_vec(size_t(N) * C, rng, -2.0, 3.0), weight = rand_vec(C, rng, 0.5, 1.5), bias = rand_vec(C, rng);
    auto dout = rand_vec(inp.size(), rng);
    auto dinp0 = rand_vec(inp.size(), rng), dweight0 = rand_vec(C, rng), dbias0 = rand_vec(C, rng);

    const auto inp_d = to_double(inp), w_d = to_double(weight), b_d = to_double(bias), dout_d = to_double(dout);
    std::vector<double> out(inp.size()), mean(N), rstd(N);
    std::vector<double> dinp = to_double(dinp0), dweight = to_double(dweight0), dbias = to_double(dbias0);
    ref::layernorm_forward(out.data(), mean.data(), rstd.data(), inp_d.data(), w_d.data(), b_d.data(), N, C);
    ref::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout_d.data(), inp_d.data(), w_d.data(),
                            mean.data(), rstd.data(), N, C);

    Dev<float> g_inp(inp), g_w(weight), g_b(bias), g_dout(dout), g_dinp(dinp0), g_dw(dweight0), g_db(dbias0);
    auto g_out = Dev<float>::poisoned(inp.size());
    auto g_mean = Dev<float>::poisoned(N), g_rstd = Dev<float>::poisoned(N);
    k.layernorm_forward(g_out.get(), g_mean.get(), g_rstd.get(), g_inp.get(), g_w.get(), g_b.get(), N, C,
                        MatmulPrecision::kF32);
    k.layernorm_backward(g_dinp.get(), g_dw.get(), g_db.get(), g_dout.get(), g_inp.get(), g_w.get(), g_mean.get(),
                         g_rstd.get(), N, C);
    // Normalized values are O(1) with an O(C)-term mean and variance behind them.
    EXPECT_TRUE(all_close(g_out.download(), out, accum_atol(C), kRtol, "out"));
    EXPECT_TRUE(all_close(g_mean.download(), mean, accum_atol(C), kRtol, "mean"));
    EXPECT_TRUE(all_close(g_rstd.download(), rstd, accum_atol(C), kRtol, "rstd"));
    EXPECT_TRUE(all_close(g_dinp.download(), dinp, accum_atol(C), kRtol, "dinp"));
    EXPECT_TRUE(all_close(g_dw.download(), dweight, 4 * accum_atol(N), kRtol, "dweight"));
    EXPECT_TRUE(all_close(g_db.download(), dbias, accum_atol(N), kRtol, "dbias"));
    // Under bf16 the output is hidden, the linears' input: bf16 at widths that are a multiple of 8 (one more
    // rounding, 2^-8 relative), else fp32.
    const MatmulPrecision bf16 = MatmulPrecision::kBF16;
    auto g_out16 = hidden_poisoned(k, N, C, bf16);
    k.layernorm_forward(g_out16.get(), g_mean.get(), g_rstd.get(), g_inp.get(), g_w.get(), g_b.get(), N, C, bf16);
    const double hidden_rtol = hidden_is_bf16(k, N, C, bf16) ? 1.0 / 128 : 0.0;
    EXPECT_EQ(hidden_is_bf16(k, N, C, bf16), C % 8 == 0);
    EXPECT_TRUE(all_close(hidden_to_host(k, g_out16, N, C, bf16), out, accum_atol(C), kRtol + hidden_rtol, "out bf16"));
  }
}

TEST_F(CudaOpsTest, ResidualLayernorm) {
  for (auto [N, C, seed] : {std::tuple{37, 45, 27u}, std::tuple{128, 768, 28u}, std::tuple{13, 1600, 29u}}) {
    SCOPED_TRACE(fmt::format("residual+layernorm N={} C={} seed={}", N, C, seed));
    Rng rng(seed);
    auto a = rand_vec(size_t(N) * C, rng), b = rand_vec(size_t(N) * C, rng, -2.0, 2.0);
    auto w = rand_vec(C, rng), bias = rand_vec(C, rng);
    const auto a_d = to_double(a), b_d = to_double(b), w_d = to_double(w), bias_d = to_double(bias);
    std::vector<double> res(a.size()), out(a.size()), mean(N), rstd(N);
    ref::residual_forward(res.data(), a_d.data(), b_d.data(), res.size());
    ref::layernorm_forward(out.data(), mean.data(), rstd.data(), res.data(), w_d.data(), bias_d.data(), N, C);
    Dev<float> g_a(a), g_b(b), g_w(w), g_bias(bias);
    for (MatmulPrecision precision : {MatmulPrecision::kF32, MatmulPrecision::kBF16}) {
      SCOPED_TRACE(precision == MatmulPrecision::kF32 ? "f32" : "bf16");
      auto g_res = Dev<float>::poisoned(res.size()), g_out = hidden_poisoned(k, N, C, precision);
      auto g_mean = Dev<float>::poisoned(N), g_rstd = Dev<float>::poisoned(N);
      k.residual_layernorm_forward(g_res.get(), g_out.get(), g_mean.get(), g_rstd.get(), g_a.get(), g_b.get(),
                                   g_w.get(), g_bias.get(), N, C, precision);
      EXPECT_TRUE(all_close(g_res.download(), res, kElemAtol, kRtol, "res"));
      // As the Layernorm case, over the sum rounded to fp32 (the reference's is exact); out hidden.
      const double hidden_rtol = hidden_is_bf16(k, N, C, precision) ? 1.0 / 128 : 0.0;
      EXPECT_TRUE(all_close(hidden_to_host(k, g_out, N, C, precision), out, accum_atol(C) + kElemAtol,
                            kRtol + hidden_rtol, "out"));
      EXPECT_TRUE(all_close(g_mean.download(), mean, accum_atol(C) + kElemAtol, kRtol, "mean"));
      EXPECT_TRUE(all_close(g_rstd.download(), rstd, accum_atol(C) + kElemAtol, kRtol, "rstd"));
    }
  }
}

// One attention case on the GPU and in the float64 reference. `want_lse` is each row's log-sum-exp of the scaled
// scores (B,NH,T), which flash attention saves in place of the probabilities.
struct AttentionRun {
  std::vector<double> want_out, want_att, want_dqkv, want_lse;
  std::vector<float> got_out, got_att, got_dqkv;
  // The fused paths' saved log-sum-exps: got_att without its padding to 4 floats, which nothing writes (it stays
  // NaN, and NaN != NaN: compare this, not got_att, bit for bit).
  std::vector<float> got_lse() const { return {got_att.begin(), got_att.begin() + want_lse.size()}; }
};

// Columns [which*C, (which+1)*C) of each row of a (rows, 3C) buffer: q, k or v (0, 1, 2) of qkv or dqkv.
template <typename E>
std::vector<E> third(const std::vector<E>& v, int C, int which) {
  std::vector<E> out;
  for (size_t row = 0; row < v.size() / (3 * size_t(C)); ++row)
    out.insert(out.end(), v.begin() + row * 3 * C + which * C, v.begin() + row * 3 * C + (which + 1) * C);
  return out;
}

// The checks every bf16 attention path passes (flash, cuDNN, the batched GEMMs), against the float64 reference of
// the bf16-held inputs. Sizes at range 1 (U(-1,1) inputs: scores of sd about 1/3, so a row's probabilities are
// about 1/n over its n keys): outputs about 0.6/sqrt(n), 0.05 late in a row of 200; dq about 0.2/sqrt(n) and late
// keys' dk and dv about 0.014; the log-sum-exps about ln n. The errors bf16 brings: the output stored in bf16
// (2^-9 relative) and products of bf16 probabilities (a third of that each), dS rounded to bf16, dqkv stored in
// bf16 — relative, about 1e-3, and in absolute terms 1e-4 or less; the log-sum-exps see no rounding the reference
// does not (exact products of bf16 values summed in fp32, then ex2.approx and __logf): about 1e-5. So the
// absolute tolerances sit about 10× over those errors and well under the values (at 2e-2 a backward that left
// the last tiles' dq at zero passed); outputs scale with the range, q's and k's gradients with its square, v's
// (sums of P·dO) not at all. Fused paths save only the log-sum-exps; the GEMMs the probabilities.
void check_bf16_attention(const AttentionRun& r, int C, double range, bool fused) {
  if (fused) {
    EXPECT_TRUE(all_close(r.got_lse(), r.want_lse, 1e-3 * range, 1e-4, "lse"));
  } else {
    EXPECT_TRUE(all_close(r.got_att, r.want_att, 1e-3, 2e-2, "att"));
  }
  EXPECT_TRUE(all_close(r.got_out, r.want_out, 2e-3 * range, 2e-2, "out"));
  EXPECT_TRUE(all_close(third(r.got_dqkv, C, 0), third(r.want_dqkv, C, 0), 3e-3 * range * range, 2e-2, "dq"));
  EXPECT_TRUE(all_close(third(r.got_dqkv, C, 1), third(r.want_dqkv, C, 1), 3e-3 * range * range, 2e-2, "dk"));
  EXPECT_TRUE(all_close(third(r.got_dqkv, C, 2), third(r.want_dqkv, C, 2), 3e-3, 2e-2, "dv"));
  // The products really took bf16 operands: the outputs are stored in bf16 either way, but with bf16 probabilities
  // in P·V about one in six differs from the reference rounded to bf16 (each moved by about a third of a bf16
  // ulp), against about one in 10^4 with fp32 products.
  size_t differ = 0;
  for (size_t i = 0; i < r.got_out.size(); ++i)
    differ += r.got_out[i] != bf16_to_f32(f32_to_bf16(static_cast<float>(r.want_out[i])));
  if (r.got_out.size() >= 1000) {
    EXPECT_GT(differ, r.got_out.size() / 50) << "outputs equal to the rounded reference: the bf16 products did not run";
  }
}
// qkv, out and their gradients move in the hidden form (kernels.h): the reference takes the values as the
// backend holds them. `between` runs between the forward and the backward (a switch of implementation).
AttentionRun run_attention(const KernelSet& k, int B, int T, int C, int NH, uint64_t seed, MatmulPrecision precision,
                           double range, const std::function<void()>& between = {}) {
  Rng rng(seed);
  auto qkv = rand_vec(size_t(B) * T * 3 * C, rng, -range, range), dout = rand_vec(size_t(B) * T * C, rng);
  const int N = B * T;
  const bool h16 = hidden_is_bf16(k, N, C, precision);
  EXPECT_EQ(h16, hidden_is_bf16(k, N, 3 * C, precision)) << "qkv and out in different forms";
  const auto qkv_d = held(qkv, h16), dout_d = held(dout, h16);
  AttentionRun r;
  r.want_out.resize(dout.size());
  r.want_att.resize(size_t(B) * NH * T * T);
  r.want_dqkv.resize(qkv.size());
  ref::attention_forward(r.want_out.data(), r.want_att.data(), qkv_d.data(), B, T, C, NH, NH);
  ref::attention_backward(r.want_dqkv.data(), dout_d.data(), qkv_d.data(), r.want_att.data(), B, T, C, NH, NH);
  const int hs = C / NH;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);
        double mx = -INFINITY;
        for (int t2 = 0; t2 <= t; ++t2) {
          double dot = 0;
          for (int i = 0; i < hs; ++i)
            dot += qkv_d[(size_t(b) * T + t) * 3 * C + h * hs + i] * qkv_d[(size_t(b) * T + t2) * 3 * C + C + h * hs + i];
          s[t2] = dot / std::sqrt(double(hs));
          mx = std::max(mx, s[t2]);
        }
        double sum = 0;
        for (double x : s) sum += std::exp(x - mx);
        r.want_lse.push_back(mx + std::log(sum));
      }
  const size_t saved = k.attention_saved_floats(B, T, C, NH, precision);
  Dev<float> g_qkv = hidden_on_device(k, qkv, N, 3 * C, precision);
  Dev<float> g_dout = hidden_on_device(k, dout, N, C, precision);
  // dqkv starts as NaN: the backward overwrites it, every element.
  auto g_out = hidden_poisoned(k, N, C, precision), g_att = Dev<float>::poisoned(saved);
  auto g_dqkv = hidden_poisoned(k, N, 3 * C, precision);
  k.attention_forward(g_out.get(), g_att.get(), g_qkv.get(), B, T, C, NH, NH, precision);
  if (between) between();
  k.attention_backward(g_dqkv.get(), g_dout.get(), g_qkv.get(), g_out.get(), g_att.get(), B, T, C, NH, NH,
                       precision);
  r.got_out = hidden_to_host(k, g_out, N, C, precision);
  r.got_att = g_att.download();
  r.got_dqkv = hidden_to_host(k, g_dqkv, N, 3 * C, precision);
  return r;
}

TEST_F(CudaOpsTest, Attention) {
  for (auto [B, T, C, NH, seed] : {std::tuple{2, 37, 48, 4, 12u}, std::tuple{3, 128, 192, 3, 13u},
                                   std::tuple{1, 257, 768, 12, 14u}}) {
    SCOPED_TRACE(fmt::format("attention fp32 B={} T={} C={} NH={} seed={}", B, T, C, NH, seed));
    ASSERT_EQ(k.attention_saved_floats(B, T, C, NH, MatmulPrecision::kF32), size_t(B) * NH * T * T);
    const AttentionRun r = run_attention(k, B, T, C, NH, seed, MatmulPrecision::kF32, 2.0);
    const int hs = C / NH;
    EXPECT_TRUE(all_close(r.got_att, r.want_att, accum_atol(hs + T), kRtol, "att"));
    EXPECT_TRUE(all_close(r.got_out, r.want_out, accum_atol(hs + T), kRtol, "out"));
    EXPECT_TRUE(all_close(r.got_dqkv, r.want_dqkv, 2 * accum_atol(hs + T), kRtol, "dqkv"));
  }
}

// bf16 products (tensor cores): the probabilities and dS are rounded to bf16 (q, k, v and dy are bf16 already,
// and the reference takes them as held), so the comparison with the float64 reference holds at the tolerances
// check_bf16_attention derives, and the outputs show the probabilities' rounding (the bf16 path really ran). Our
// implementations only (cuDNN's: AttentionCudnn). Head sizes 32 and 64 take flash attention (no T×T matrix:
// `att` holds the rows' log-sum-exps); 48 and 128 take the batched-GEMM path. T = 1, T a multiple of the 64-row
// tiles (128: a last tile without masking past T) and T past one (67: only the first 16-row warp of the last
// tile has rows; 100: three of its four) check the edges. Inputs of range 2.6 make the scores about 2.2
// standard deviations wide instead of 0.3, so each row's maximum moves between tiles and the online softmax
// rescales what it summed; outputs scale with the range and gradients with its square, and so do the
// tolerances. At hs 64 the kernels built for higher occupancy (flash_attention.h) run too and must give the same
// bits.
TEST_F(CudaOpsTest, AttentionBF16) {
  ScopedSwitch<bool> ours(cuda::cudnn_attention_chosen, cuda::set_cudnn_attention_chosen, false);
  for (auto [B, T, C, NH, seed, range] :
       {std::tuple{2, 67, 128, 2, 23u, 1.0}, std::tuple{1, 200, 256, 8, 24u, 1.0}, std::tuple{2, 130, 256, 2, 25u, 1.0},
        std::tuple{3, 1, 64, 1, 26u, 1.0}, std::tuple{2, 70, 96, 2, 27u, 1.0}, std::tuple{2, 128, 128, 2, 30u, 1.0},
        std::tuple{2, 100, 64, 2, 31u, 1.0}, std::tuple{2, 192, 256, 4, 32u, 2.6}}) {
    const int hs = C / NH;
    const bool flash = hs == 32 || hs == 64;
    SCOPED_TRACE(fmt::format("attention bf16 B={} T={} C={} NH={} seed={} range={} ({})", B, T, C, NH, seed, range,
                             flash ? "flash" : "batched GEMMs"));
    const size_t saved = k.attention_saved_floats(B, T, C, NH, MatmulPrecision::kBF16);
    // flash: only the log-sum-exps (padded to 4 floats); the backward reads qkv and the output again
    const size_t lse_floats = (size_t(B) * NH * T + 3) / 4 * 4;
    ASSERT_EQ(saved, flash ? lse_floats : size_t(B) * NH * T * T);
    const AttentionRun r = run_attention(k, B, T, C, NH, seed, MatmulPrecision::kBF16, range);
    check_bf16_attention(r, C, range, flash);
    if (hs == 64) {
      // The kernels built for more blocks a multiprocessor (fewer registers, some spilled) do the same arithmetic:
      // the same bits.
      const AttentionRun high = [&] {
        ScopedSwitch<cuda::FlashOccupancy> occupancy(cuda::flash_attention_occupancy,
                                                     cuda::set_flash_attention_occupancy, cuda::FlashOccupancy::kHigh);
        return run_attention(k, B, T, C, NH, seed, MatmulPrecision::kBF16, range);
      }();
      EXPECT_EQ(high.got_out, r.got_out) << "high occupancy: out";
      EXPECT_EQ(high.got_lse(), r.got_lse()) << "high occupancy: lse";
      EXPECT_EQ(high.got_dqkv, r.got_dqkv) << "high occupancy: dqkv";
    }
  }
}

// cuDNN's fused attention (STRATA_ATTENTION=cudnn; kernels/cuda/cudnn_attention.h) on AttentionBF16's cases, the
// flash kernels' head sizes (32, 64) and the batched GEMMs' (48, 128), which it takes too, against the same
// reference at the same tolerances, the log-sum-exps it saves included (the flash backward reads them too), and
// saving only those. Skips, saying why, where cuDNN cannot be loaded. Where it loads, every case whose T is a
// whole number of 64-row tiles (GPT-2's shapes are) must run on it; a shorter or ragged one it declines is named
// and left to the other paths. The forward must give the same bits twice, and the backward too where its plan is
// the deterministic form.
TEST_F(CudaOpsTest, AttentionCudnn) {
  const auto loaded = cuda::cudnn::load();
  if (!loaded.is_ok()) GTEST_SKIP() << "cuDNN attention not testable here: " << loaded.status().message();
  if (loaded.value()->GetVersion() < 91600)
    GTEST_SKIP() << "cuDNN " << loaded.value()->GetVersion() << " is older than the 9.16 the attention graphs need";
  ScopedSwitch<bool> chosen(cuda::cudnn_attention_chosen, cuda::set_cudnn_attention_chosen, true);
  for (auto [B, T, C, NH, seed, range] :
       {std::tuple{2, 128, 128, 2, 30u, 1.0}, std::tuple{2, 192, 256, 4, 32u, 2.6},
        std::tuple{1, 256, 256, 8, 33u, 1.0}, std::tuple{2, 67, 128, 2, 23u, 1.0}, std::tuple{2, 100, 64, 2, 31u, 1.0},
        std::tuple{1, 128, 256, 2, 34u, 1.0}, std::tuple{2, 70, 96, 2, 27u, 1.0}}) {
    const int hs = C / NH;
    SCOPED_TRACE(fmt::format("cuDNN attention B={} T={} C={} NH={} seed={} range={}", B, T, C, NH, seed, range));
    std::string why;
    if (!cuda::cudnn_attention_runs(B, T, NH, hs, &why)) {
      if (T % 64 == 0) ADD_FAILURE() << "cuDNN cannot run it: " << why;
      else std::cout << fmt::format("cuDNN declines B={} T={} NH={} hs={}: {}\n", B, T, NH, hs, why);
      continue;
    }
    EXPECT_EQ(k.attention_saved_floats(B, T, C, NH, MatmulPrecision::kBF16), (size_t(B) * NH * T + 3) / 4 * 4)
        << "saves more than the log-sum-exps";
    const uint64_t calls = cuda::cudnn_attention_calls();
    const AttentionRun r = run_attention(k, B, T, C, NH, seed, MatmulPrecision::kBF16, range);
    EXPECT_EQ(cuda::cudnn_attention_calls(), calls + 2) << "the forward and backward did not both run on cuDNN";
    check_bf16_attention(r, C, range, /*fused=*/true);
    const AttentionRun again = run_attention(k, B, T, C, NH, seed, MatmulPrecision::kBF16, range);
    EXPECT_EQ(again.got_out, r.got_out) << "a second run: out";
    EXPECT_EQ(again.got_lse(), r.got_lse()) << "a second run: lse";
    if (cuda::cudnn_attention_reproducible(B, T, NH, hs)) {
      EXPECT_EQ(again.got_dqkv, r.got_dqkv) << "a second run of the deterministic backward: dqkv";
    }
    if (hs != 32 && hs != 64) continue;
    // Each backward reads the other's forward: the same log-sum-exps in the same layout (natural log, of the
    // scaled scores), so cuDNN's forward with the flash backward and the flash forward with cuDNN's backward
    // hold to the reference too.
    for (const bool cudnn_forward : {true, false}) {
      SCOPED_TRACE(cudnn_forward ? "cuDNN forward, flash backward" : "flash forward, cuDNN backward");
      cuda::set_cudnn_attention_chosen(cudnn_forward);
      const uint64_t before = cuda::cudnn_attention_calls();
      const AttentionRun mixed = run_attention(k, B, T, C, NH, seed, MatmulPrecision::kBF16, range,
                                               [&] { cuda::set_cudnn_attention_chosen(!cudnn_forward); });
      EXPECT_EQ(cuda::cudnn_attention_calls(), before + 1) << "one of the two passes on cuDNN";
      check_bf16_attention(mixed, C, range, /*fused=*/true);
      if (cudnn_forward) {
        EXPECT_EQ(mixed.got_out, r.got_out) << "cuDNN's forward again: out";
      }
    }
    cuda::set_cudnn_attention_chosen(true);
  }
  // The backward that accumulates dQ with atomics (STRATA_CUDNN_DETERMINISTIC=0) where cuDNN has it: the same
  // checks but the bitwise one.
  ScopedSwitch<bool> accumulating(cuda::cudnn_attention_deterministic, cuda::set_cudnn_attention_deterministic, false);
  for (auto [B, T, C, NH, seed, range] : {std::tuple{2, 192, 256, 4, 32u, 2.6}, std::tuple{1, 128, 256, 2, 34u, 1.0}}) {
    SCOPED_TRACE(fmt::format("cuDNN attention, accumulating dQ, B={} T={} C={} NH={}", B, T, C, NH));
    std::string why;
    if (!cuda::cudnn_attention_runs(B, T, NH, C / NH, &why)) {
      ADD_FAILURE() << "cuDNN cannot run it: " << why;
      continue;
    }
    const uint64_t calls = cuda::cudnn_attention_calls();
    check_bf16_attention(run_attention(k, B, T, C, NH, seed, MatmulPrecision::kBF16, range), C, range, true);
    EXPECT_EQ(cuda::cudnn_attention_calls(), calls + 2);
    if (!cuda::cudnn_attention_reproducible(B, T, NH, C / NH)) continue;
    // Reproducible here only if cuDNN had no accumulating form for the shape: say so, since the check above then
    // ran the deterministic one again.
    std::cout << fmt::format("cuDNN has no dQ-accumulating backward for B={} T={} NH={} hs={}: the deterministic "
                             "form ran\n",
                             B, T, NH, C / NH);
  }
}

TEST_F(CudaOpsTest, GeluAndResidual) {
  for (auto [N, seed] : {std::pair{size_t{1}, 15u}, std::pair{size_t{4097}, 16u}, std::pair{size_t{3} << 20, 17u}}) {
    SCOPED_TRACE(fmt::format("gelu/residual N={} seed={}", N, seed));
    Rng rng(seed);
    auto x = rand_vec(N, rng, -6.0, 4.0), y = rand_vec(N, rng), dout = rand_vec(N, rng);
    auto d1 = rand_vec(N, rng), d2 = rand_vec(N, rng);
    const auto x_d = to_double(x), y_d = to_double(y), dout_d = to_double(dout);
    std::vector<double> gelu(N), dgelu = to_double(d1), sum(N), dr1 = to_double(d1), dr2 = to_double(d2);
    ref::gelu_forward(gelu.data(), x_d.data(), N);
    ref::gelu_backward(dgelu.data(), x_d.data(), dout_d.data(), N);
    ref::residual_forward(sum.data(), x_d.data(), y_d.data(), N);
    ref::residual_backward(dr1.data(), dr2.data(), dout_d.data(), N);

    Dev<float> g_x(x), g_y(y), g_dout(dout), g_dgelu(d1), g_dr1(d1), g_dr2(d2);
    auto g_gelu = Dev<float>::poisoned(N), g_sum = Dev<float>::poisoned(N);
    k.gelu_forward(g_gelu.get(), g_x.get(), N);
    k.gelu_backward(g_dgelu.get(), g_x.get(), g_dout.get(), N);
    k.residual_forward(g_sum.get(), g_x.get(), g_y.get(), N);
    k.residual_backward(g_dr1.get(), g_dr2.get(), g_dout.get(), N);
    EXPECT_TRUE(all_close(g_gelu.download(), gelu, kElemAtol, kRtol, "gelu out"));
    EXPECT_TRUE(all_close(g_dgelu.download(), dgelu, kElemAtol, kRtol, "gelu dinp"));
    EXPECT_TRUE(all_close(g_sum.download(), sum, kElemAtol, kRtol, "residual out"));
    EXPECT_TRUE(all_close(g_dr1.download(), dr1, kElemAtol, kRtol, "residual dinp1"));
    EXPECT_TRUE(all_close(g_dr2.download(), dr2, kElemAtol, kRtol, "residual dinp2"));
  }
}

TEST_F(CudaOpsTest, SoftmaxCrossEntropy) {
  // The last case is a slice of columns [1000, 1000 + V) of a 4000-id vocabulary (vocab-parallel cross-entropy):
  // targets outside it get no one-hot and no loss.
  for (auto [N, V, seed, v0] :
       {std::tuple{37, 61, 18u, 0}, std::tuple{67, 50257, 19u, 0}, std::tuple{41, 1500, 20u, 1000}}) {
    SCOPED_TRACE(fmt::format("crossentropy N={} V={} seed={} vocab_start={}", N, V, seed, v0));
    Rng rng(seed);
    auto logits = rand_vec(size_t(N) * V, rng, -4.0, 4.0), dlosses = rand_vec(N, rng, 0.1, 1.0);
    std::vector<int32_t> targets(N);
    for (int n = 0; n < N; ++n)  // some ignored
      targets[n] = n % 7 == 3 ? -1 : static_cast<int32_t>(rng.below(v0 > 0 ? 4000 : V));
    const auto logits_d = to_double(logits), dlosses_d = to_double(dlosses);
    std::vector<double> losses(N), lse(N), dlogits(logits.size());
    ref::softmax_crossentropy_forward(losses.data(), lse.data(), logits_d.data(), targets.data(), N, V, v0);
    ref::softmax_crossentropy_backward(dlogits.data(), logits_d.data(), lse.data(), targets.data(), dlosses_d.data(),
                                       N, V, v0);

    Dev<float> g_logits(logits), g_dlosses(dlosses);
    Dev<int32_t> g_targets(targets);
    auto g_losses = Dev<float>::poisoned(N), g_lse = Dev<float>::poisoned(N);
    k.softmax_crossentropy_forward(g_losses.get(), g_lse.get(), g_logits.get(), g_targets.get(), N, V, v0);
    // In place, as the model runs it: dlogits overwrite the logits.
    k.softmax_crossentropy_backward(g_logits.get(), g_logits.get(), g_lse.get(), g_targets.get(), g_dlosses.get(), N,
                                    V, v0);
    // lse is log of a V-term sum: relative error of the sum ~ (terms per thread + tree depth) * eps.
    EXPECT_TRUE(all_close(g_lse.download(), lse, 1e-5, 1e-5, "lse"));
    EXPECT_TRUE(all_close(g_losses.download(), losses, 1e-5, 1e-5, "losses"));
    EXPECT_TRUE(all_close(g_logits.download(), dlogits, 1e-7, 1e-5, "dlogits"));
  }
}

TEST_F(CudaOpsTest, AdamWIsBitwiseTheCpuReference) {
  const size_t n = 1000003;
  Rng rng(20);
  auto p = rand_vec(n, rng), m = rand_vec(n, rng, -0.1, 0.1), v = rand_vec(n, rng, 0.0, 0.01);
  auto g = rand_vec(n, rng);
  AdamWParams hp{.lr = 6e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .step = 1,
                 .grad_scale = 0.37f};
  Dev<float> gp(p), gm(m), gv(v), gg(g);
  for (int step = 1; step <= 3; ++step) {
    hp.step = step;
    ref::adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp);
    k.adamw_update(gp.get(), gm.get(), gv.get(), gg.get(), n, hp);
  }
  EXPECT_TRUE(all_close(gp.download(), p, 0.0, 0.0, "params"));
  EXPECT_TRUE(all_close(gm.download(), m, 0.0, 0.0, "m"));
  EXPECT_TRUE(all_close(gv.download(), v, 0.0, 0.0, "v"));
}

TEST_F(CudaOpsTest, ConversionsRoundToNearestEven) {
  Rng rng(21);
  auto x = rand_vec(100003, rng, -1e4, 1e4);
  x[0] = NAN;
  x[1] = INFINITY;
  x[2] = -0.0f;
  x[3] = std::bit_cast<float>(0x3F808000u);  // exactly halfway between two bf16 values: ties to even
  x[4] = 1e-40f;                             // subnormal
  Dev<float> g_x(x);
  Dev<uint16_t> g_h(std::vector<uint16_t>(x.size(), 0));
  auto g_back = Dev<float>::poisoned(x.size());
  cuda::f32_to_bf16(g_h.get(), g_x.get(), x.size());
  cuda::bf16_to_f32(g_back.get(), g_h.get(), x.size());
  const auto h = g_h.download();
  const auto back = g_back.download();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(back[i])) << "NaN must stay NaN";
      continue;
    }
    ASSERT_EQ(h[i], f32_to_bf16(x[i])) << "at [" << i << "] x=" << x[i];
    ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(bf16_to_f32(h[i]))) << "at [" << i << "]";
  }
}

// The reductions (encoder and layernorm backward, bias gradients) run in an order fixed by the shapes alone.
TEST_F(CudaOpsTest, BackwardIsBitwiseReproducible) {
  const int B = 4, T = 96, C = 384, V = 50, N = B * T;
  Rng rng(22);
  std::vector<int32_t> inp(N);
  for (auto& t : inp) t = static_cast<int32_t>(rng.below(V));
  auto dout = rand_vec(size_t(N) * C, rng), x = rand_vec(size_t(N) * C, rng), w = rand_vec(C, rng);
  auto mean = rand_vec(N, rng), rstd = rand_vec(N, rng, 0.5, 2.0);
  Dev<int32_t> g_inp(inp);
  Dev<float> g_dout(dout), g_x(x), g_w(w), g_mean(mean), g_rstd(rstd);
  auto run = [&] {
    Dev<float> dwte(std::vector<float>(size_t(V) * C, 0.0f)), dwpe(std::vector<float>(size_t(T) * C, 0.0f));
    Dev<float> dinp(std::vector<float>(x.size(), 0.0f)), dw(std::vector<float>(C, 0.0f)), db(std::vector<float>(C, 0.0f));
    k.encoder_backward(dwte.get(), dwpe.get(), g_dout.get(), g_inp.get(), B, T, C, 0, V);
    k.layernorm_backward(dinp.get(), dw.get(), db.get(), g_dout.get(), g_x.get(), g_w.get(), g_mean.get(),
                         g_rstd.get(), N, C);
    return std::vector<std::vector<float>>{dwte.download(), dwpe.download(), dinp.download(), dw.download(),
                                           db.download()};
  };
  const auto first = run();
  for (int i = 0; i < 3; ++i) {
    const auto again = run();
    for (size_t a = 0; a < first.size(); ++a)
      ASSERT_EQ(0, std::memcmp(first[a].data(), again[a].data(), first[a].size() * sizeof(float)))
          << "output " << a << " differs on run " << i + 2;
  }
}

}  // namespace
}  // namespace strata::kernels

