// cpu_ops_test_util.h — what the CPU op tests (ops_test.cpp, adamw_test.cpp) share: the two KernelSet tables
// by name, seeded inputs that float and double instances hold alike, every SIMD clone in turn, and bitwise
// comparison.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_simd.h"

namespace strata::kernels::cpu_ops_test {

namespace simd = cpu::simd;

constexpr uint64_t kSeed = 20240601;

enum class Backend { kRef, kFast };  // at float: cpu_reference_kernels() / cpu_fast_kernels(); at double: ref
inline const char* backend_name(Backend b) { return b == Backend::kRef ? "reference" : "fast"; }
inline const KernelSet& kernels(Backend b) { return b == Backend::kRef ? cpu_reference_kernels() : cpu_fast_kernels(); }

// Uniform values rounded to float first, so that the float and double instances of a case hold the same inputs.
template <typename F>
std::vector<F> rand_vec(size_t n, Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<F> v(n);
  for (auto& x : v) x = static_cast<F>(static_cast<float>(rng.uniform(lo, hi)));
  return v;
}

// Every SIMD clone the machine can run, in turn; the best one again afterwards.
template <typename Fn>
void for_each_isa(Fn&& fn) {
  for (simd::Isa isa : {simd::Isa::kAvx512, simd::Isa::kAvx2, simd::Isa::kBaseline}) {
    if (simd::set_isa(isa) != isa) {
      std::printf("  [ skipped ] the %s clone: this CPU lacks it\n", simd::isa_name(isa));
      continue;
    }
    SCOPED_TRACE(fmt::format("SIMD clone {}", simd::isa_name(isa)));
    fn();
  }
  simd::set_isa(simd::detect_isa());
}

template <typename F>
::testing::AssertionResult bitwise_equal(const std::vector<F>& a, const std::vector<F>& b, const std::string& what) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(F)) != 0)
      return ::testing::AssertionFailure() << what << " differs first at [" << i << "]: " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

}  // namespace strata::kernels::cpu_ops_test
