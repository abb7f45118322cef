// adamw_test.cpp — the CPU AdamW (kernels/cpu/reference.h, kernels/cpu/fast_adamw.cpp): ref<float> against
// ref<double>, fast against the reference in ulps on every SIMD clone, fast bitwise reproducible across thread
// counts, and the offload optimizer's fused passes (the 16-bit working copy in the same pass; into other arrays
// bitwise in place).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/reference.h"
#include "tests/kernels/cpu_ops_test_util.h"
#include "tests/test_util.h"

namespace strata::kernels {
namespace {

using ::strata::testing::all_close;
using namespace cpu_ops_test;
namespace ref = cpu::ref;

template <typename F>
struct AdamWState {
  std::vector<F> params, m, v;
  std::vector<std::vector<F>> grads;  // one per step
};
// n parameters in [-1, 1], zero moments, and `steps` gradient vectors in [-1, 1].
template <typename F>
AdamWState<F> make_adamw_state(size_t n, int steps) {
  Rng rng(kSeed);
  AdamWState<F> s{rand_vec<F>(n, rng), std::vector<F>(n, 0), std::vector<F>(n, 0), {}};
  for (int i = 0; i < steps; ++i) s.grads.push_back(rand_vec<F>(n, rng));
  return s;
}
AdamWParams adamw_hp(int step) {
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  hp.grad_scale = 0.37f;
  hp.step = step;
  return hp;
}
constexpr int kAdamWSteps = 5;
std::string adamw_params(size_t n) {
  const AdamWParams hp = adamw_hp(1);
  return fmt::format("adamw n={} steps={} lr={} b1={} b2={} eps={} wd={} grad_scale={} seed={}", n, kAdamWSteps, hp.lr,
                     hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.grad_scale, kSeed);
}
template <typename F, typename Step>
void run_adamw(AdamWState<F>& s, Step step) {
  for (int i = 0; i < kAdamWSteps; ++i)
    step(s.params.data(), s.m.data(), s.v.data(), s.grads[i].data(), s.params.size(), adamw_hp(i + 1));
}

// Distance in representable floats (ulps) between a and b.
int64_t ulp_distance(float a, float b) {
  auto ordered = [](float x) {
    int32_t i;
    std::memcpy(&i, &x, sizeof i);
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};
  };
  return std::llabs(ordered(a) - ordered(b));
}
::testing::AssertionResult within_ulps(const std::vector<float>& got, const std::vector<float>& want, int64_t max_ulps,
                                       const std::string& what) {
  int64_t worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t d = ulp_distance(got[i], want[i]);
    if (d > worst) worst = d, at = i;
  }
  if (worst <= max_ulps) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << worst << " ulps apart at [" << at << "]: got " << got[at]
                                       << " want " << want[at] << " (allowed " << max_ulps << ")";
}

// Five steps in float32 against float64 on the same inputs: each step rounds a handful of times, and the
// moments' errors stay relative; params move by ~lr per step around O(1) values.
TEST(AdamW, RefFloatMatchesDouble) {
  const size_t n = 1001;
  AdamWState<float> f = make_adamw_state<float>(n, kAdamWSteps);
  AdamWState<double> d = make_adamw_state<double>(n, kAdamWSteps);
  run_adamw(f, kernels(Backend::kRef).adamw_update);
  run_adamw(d, ref::adamw_update<double>);
  EXPECT_TRUE(all_close(f.params, d.params, 1e-6, 1e-6, "params")) << adamw_params(n);
  EXPECT_TRUE(all_close(f.m, d.m, 1e-8, 1e-6, "m")) << adamw_params(n);
  EXPECT_TRUE(all_close(f.v, d.v, 1e-9, 1e-6, "v")) << adamw_params(n);
}

// Fast performs the reference's correctly rounded operations in its order, without FMA, so today it matches bit
// for bit. The allowance of 2 ulps is for a compiler that contracts the reference's multiply-adds; it still
// catches a reordered formula, which near the cancellation of b1*m and (1-b1)*g moves m by 1e4 ulps or more.
constexpr int64_t kAdamWMaxUlps = 2;
TEST(AdamW, FastWithinFewUlpsOfReference) {
  const size_t n = 100003;  // several TBB blocks and a SIMD tail
  AdamWState<float> want = make_adamw_state<float>(n, kAdamWSteps);
  run_adamw(want, kernels(Backend::kRef).adamw_update);
  for_each_isa([&] {
    AdamWState<float> got = make_adamw_state<float>(n, kAdamWSteps);
    run_adamw(got, kernels(Backend::kFast).adamw_update);
    EXPECT_TRUE(within_ulps(got.params, want.params, kAdamWMaxUlps, "params")) << adamw_params(n);
    EXPECT_TRUE(within_ulps(got.m, want.m, kAdamWMaxUlps, "m")) << adamw_params(n);
    EXPECT_TRUE(within_ulps(got.v, want.v, kAdamWMaxUlps, "v")) << adamw_params(n);
  });
}

TEST(AdamW, FastIsDeterministic) {
  const size_t n = 100003;
  AdamWState<float> one = make_adamw_state<float>(n, kAdamWSteps), all = make_adamw_state<float>(n, kAdamWSteps);
  tbb::task_arena single(1);
  single.execute([&] { run_adamw(one, kernels(Backend::kFast).adamw_update); });
  run_adamw(all, kernels(Backend::kFast).adamw_update);
  EXPECT_TRUE(bitwise_equal(one.params, all.params, "params")) << adamw_params(n) << ", 1 thread vs all threads";
  EXPECT_TRUE(bitwise_equal(one.m, all.m, "m")) << adamw_params(n);
  EXPECT_TRUE(bitwise_equal(one.v, all.v, "v")) << adamw_params(n);
}

// The offload optimizer's fused pass: params, m, v as adamw_update's (within the same ulps), and the 16-bit
// working copy bitwise common/dtype.h's rounding of the new params, on every clone, with the SIMD tails and a
// value past f16's range (which must become infinity, as the scalar conversion says).
TEST(AdamW, MixedWritesTheWorkingCopyInTheSamePass) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{17}, size_t{100003}}) {
    AdamWState<float> want = make_adamw_state<float>(n, kAdamWSteps);
    run_adamw(want, kernels(Backend::kRef).adamw_update);
    for (DType dt : {DType::kBF16, DType::kF16}) {
      for_each_isa([&] {
        SCOPED_TRACE(fmt::format("n={} working={}", n, dtype_name(dt)));
        AdamWState<float> got = make_adamw_state<float>(n, kAdamWSteps);
        if (n > 3) got.params[3] = 7e4f;  // the first step's update is lr-sized: still far past f16's 65504
        std::vector<uint16_t> working(n, 0xABCD);
        for (int i = 0; i < kAdamWSteps; ++i)
          cpu::fast::adamw_update_mixed(got.params.data(), got.m.data(), got.v.data(), got.grads[i].data(),
                                        working.data(), dt, n, adamw_hp(i + 1));
        if (n > 3) got.params[3] = want.params[3];  // compared elementwise below; only the copy is the point
        EXPECT_TRUE(within_ulps(got.params, want.params, kAdamWMaxUlps, "params")) << adamw_params(n);
        EXPECT_TRUE(within_ulps(got.m, want.m, kAdamWMaxUlps, "m")) << adamw_params(n);
        EXPECT_TRUE(within_ulps(got.v, want.v, kAdamWMaxUlps, "v")) << adamw_params(n);
        for (size_t i = 0; i < n; ++i) {
          const float p = i == 3 ? 7e4f : got.params[i];
          const uint16_t expect = dt == DType::kBF16 ? f32_to_bf16(p) : f32_to_f16(p);
          if (i != 3) {
            ASSERT_EQ(working[i], expect) << "working copy at [" << i << "] of params " << p;
          } else if (dt == DType::kF16) {
            ASSERT_EQ(working[i] & 0x7fff, 0x7c00) << "f16 overflow is infinity";
          }
        }
      });
    }
  }
}

// The pass the offloaded optimizer runs before a step's norm is known: reading the old state and writing the new
// elsewhere gives bitwise the in-place pass on every clone and working dtype (SIMD bodies and tails), and leaves
// the old state as it was.
TEST(AdamW, IntoOtherArraysIsBitwiseInPlace) {
  for (size_t n : {size_t{1}, size_t{15}, size_t{17}, size_t{100003}}) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for_each_isa([&] {
        SCOPED_TRACE(fmt::format("n={} working={}", n, dtype_name(dt)));
        AdamWState<float> in_place = make_adamw_state<float>(n, kAdamWSteps);
        AdamWState<float> old = make_adamw_state<float>(n, kAdamWSteps);
        std::vector<uint16_t> w_in_place(n), w_into(n);
        std::vector<float> p(n), m(n), v(n);
        for (int i = 0; i < kAdamWSteps; ++i) {
          const AdamWState<float> before = old;
          cpu::fast::adamw_update_mixed(in_place.params.data(), in_place.m.data(), in_place.v.data(),
                                        in_place.grads[i].data(), w_in_place.data(), dt, n, adamw_hp(i + 1));
          cpu::fast::adamw_update_into(old.params.data(), old.m.data(), old.v.data(), old.grads[i].data(), p.data(),
                                       m.data(), v.data(), w_into.data(), dt, n, adamw_hp(i + 1));
          ASSERT_TRUE(bitwise_equal(old.params, before.params, "old params")) << "the old state was written";
          ASSERT_TRUE(bitwise_equal(old.m, before.m, "old m"));
          ASSERT_TRUE(bitwise_equal(old.v, before.v, "old v"));
          ASSERT_TRUE(bitwise_equal(p, in_place.params, "params")) << "step " << i + 1;
          ASSERT_TRUE(bitwise_equal(m, in_place.m, "m")) << "step " << i + 1;
          ASSERT_TRUE(bitwise_equal(v, in_place.v, "v")) << "step " << i + 1;
          if (dt != DType::kF32) {
            ASSERT_TRUE(w_into == w_in_place) << "working copy, step " << i + 1;
          }
          old.params = p;
          old.m = m;
          old.v = v;
        }
      });
    }
  }
}

}  // namespace
}  // namespace strata::kernels
