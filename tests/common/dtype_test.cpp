// dtype_test.cpp — f32 <-> bf16 and f32 <-> f16 conversions (common/dtype.h): exhaustive round trips over all
// 65536 16-bit patterns, ties to even, NaN, infinities, f16 subnormals and overflow, f32 -> f16 against the F16C
// hardware conversion, and f32 -> bf16 against a plainly written reference.
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"

namespace strata {
namespace {

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
std::string hex(uint32_t u) { return fmt::format("{:#010x}", u); }

// Test inputs: every 16-bit pattern placed in the top half of a float with the low halves that sit just
// below, at and just above a bf16 tie, plus the same around every f16 rounding point, plus random bit patterns
// (all exponents, NaNs included) and random magnitudes across f16's range.
std::vector<float> tricky_floats() {
  std::vector<float> v;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) v.push_back(from_bits(hi << 16 | lo));
  // f16 rounding points: each f16 value's midpoint to its upper neighbour, and the floats on either side.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double a = f16_to_f32(static_cast<uint16_t>(h));
    const double b = h + 1 == 0x7c00 ? 65536.0 : f16_to_f32(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact: f16 midpoints have few significant bits
    for (float m : {mid, -mid}) {
      v.push_back(m);
      v.push_back(std::nextafter(m, 0.0f));
      v.push_back(std::nextafter(m, 2 * m));
    }
  }
  Rng rng(20240520);
  for (int i = 0; i < 1 << 20; ++i) v.push_back(from_bits(static_cast<uint32_t>(rng.next_u64())));
  for (int i = 0; i < 1 << 20; ++i) {
    const double mag = std::ldexp(rng.uniform(1.0, 2.0), static_cast<int>(rng.below(46)) - 30);  // 2^-30..2^16
    v.push_back(static_cast<float>(rng.uniform() < 0.5 ? -mag : mag));
  }
  return v;
}

// --- bf16 -----------------------------------------------------------------------------------------------------

// Written from the definition: the two bf16 values around x (truncation and the next pattern away from zero),
// whichever is nearer, the even pattern on a tie; beyond the largest bf16, the upper neighbour is infinity,
// which counts as 2^128 for rounding (IEEE's rule for overflow under round-to-nearest).
uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return static_cast<uint16_t>((bits(x) >> 16) | 0x40);
  const uint16_t lo = static_cast<uint16_t>(bits(x) >> 16);
  if (std::isinf(x) || (bits(x) & 0xffff) == 0) return lo;
  const uint16_t hi = lo + 1;
  const double a = std::fabs(static_cast<double>(bf16_to_f32(lo)));
  const double b = (hi & 0x7fff) == 0x7f80 ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(bf16_to_f32(hi)));
  const double d = std::fabs(static_cast<double>(x));
  if (d - a < b - d) return lo;
  if (d - a > b - d) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Bf16, RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    EXPECT_EQ(bits(f), h << 16) << hex(h);
    const uint16_t back = f32_to_bf16(f);
    if (std::isnan(f)) {
      // A NaN stays a NaN with its sign and comes back quiet.
      EXPECT_EQ(back, h | 0x40) << hex(h);
    } else {
      EXPECT_EQ(back, h) << hex(h);
    }
  }
}

TEST(Bf16, MatchesReferenceRounding) {
  size_t bad = 0;
  for (float x : tricky_floats()) {
    const uint16_t got = f32_to_bf16(x), want = bf16_reference(x);
    if (got != want && ++bad <= 8)
      ADD_FAILURE() << "f32_to_bf16(" << hex(bits(x)) << ") = " << hex(got) << ", want " << hex(want);
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Bf16, TiesAndSpecials) {
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie: down to the even 1.0
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie: up to the even 1 + 2^-6
  EXPECT_EQ(f32_to_bf16(-1.0f - std::ldexp(1.0f, -8)), 0xbf80);
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // The largest float is above the midpoint between bf16's largest (0x7f7f) and 2^128: it overflows.
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7f7fff)), 0x7f7f);  // just below that midpoint
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7f8000)), 0x7f80);  // the midpoint: ties to the even infinity
  // Subnormals round like everything else.
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008000)), 0x0000);
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000)), 0x0002);
  // NaNs: quiet, sign kept; a signalling NaN whose payload sits only in the low half is still a NaN.
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(from_bits(0x7f800001)))));
  EXPECT_EQ(f32_to_bf16(from_bits(0xff800001)) & 0x8000, 0x8000);
}

// --- f16 ------------------------------------------------------------------------------------------------------

TEST(F16, RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    const uint16_t back = f32_to_f16(f);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) {
      EXPECT_TRUE(std::isnan(f)) << hex(h);
      EXPECT_EQ(back & 0x8000, h & 0x8000) << hex(h);
      EXPECT_EQ(back & 0x7e00, 0x7e00) << hex(h);  // quiet NaN
    } else {
      EXPECT_EQ(back, h) << hex(h) << " -> " << f;
    }
  }
}

TEST(F16, ValuesOfPatterns) {
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits(f16_to_f32(0x8000)), 0x80000000u);
}

TEST(F16, OverflowAndSubnormalBoundaries) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);  // just below the midpoint to 2^16
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // the midpoint: ties to the even pattern, which is infinity
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xfc00);
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half the smallest subnormal: ties to even zero
  EXPECT_EQ(f32_to_f16(-std::ldexp(1.0f, -25)), 0x8000);
  EXPECT_EQ(f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 units: tie, up to the even 2
  EXPECT_EQ(f32_to_f16(1023.5f * std::ldexp(1.0f, -24)), 0x0400);  // tie between 0x3ff and the smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(f32_to_f16(from_bits(0x00000001)), 0x0000);  // f32 subnormals underflow to zero
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie: down to the even 1.0
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie: up to the even neighbour
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::quiet_NaN()) & 0x7e00, 0x7e00);
  EXPECT_EQ(f32_to_f16(from_bits(0x7f800001)) & 0x7e00, 0x7e00);  // signalling NaN: still NaN, now quiet
}

// The F16C instructions, used only when the CPU has them (checked at run time).
__attribute__((target("f16c"))) uint16_t f16c_from_f32(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float f16c_to_f32(uint16_t h) { return _cvtsh_ss(h); }

bool is_f16_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

TEST(F16, MatchesF16cHardware) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C instructions to compare with";
  size_t bad = 0;
  for (float x : tricky_floats()) {
    const uint16_t got = f32_to_f16(x), want = f16c_from_f32(x);
    // NaN payloads differ by design (we return the canonical quiet NaN); NaN-ness and sign must agree.
    const bool ok = std::isnan(x) ? is_f16_nan(got) && is_f16_nan(want) && (got & 0x8000) == (want & 0x8000)
                                  : got == want;
    if (!ok && ++bad <= 8)
      ADD_FAILURE() << "f32_to_f16(" << hex(bits(x)) << ") = " << hex(got) << ", F16C " << hex(want);
  }
  EXPECT_EQ(bad, 0u);
  for (uint32_t h = 0; h < 65536; ++h) {
    if (is_f16_nan(static_cast<uint16_t>(h))) continue;  // F16C quiets signalling NaNs; we keep the payload
    EXPECT_EQ(bits(f16_to_f32(static_cast<uint16_t>(h))), bits(f16c_to_f32(static_cast<uint16_t>(h)))) << hex(h);
  }
}

// --- names and bulk conversions ---------------------------------------------------------------------------------

TEST(DType, NamesSizesAndParsing) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    DType parsed;
    ASSERT_TRUE(parse_dtype(dtype_name(t), &parsed)) << dtype_name(t);
    EXPECT_EQ(parsed, t);
  }
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  DType t = DType::kF32;
  EXPECT_TRUE(parse_dtype("bfloat16", &t));
  EXPECT_EQ(t, DType::kBF16);
  EXPECT_TRUE(parse_dtype("fp16", &t));
  EXPECT_EQ(t, DType::kF16);
  EXPECT_FALSE(parse_dtype("f64", &t));
  EXPECT_FALSE(parse_dtype("BF16", &t));  // names are lowercase
  EXPECT_EQ(t, DType::kF16);              // unchanged on failure
}

TEST(DType, BulkConversionsMatchScalar) {
  Rng rng(7);
  const size_t n = 1001;  // odd, so any vectorised tail is exercised
  std::vector<float> x(n);
  for (float& f : x) f = static_cast<float>(rng.normal() * 100);
  std::vector<uint16_t> b(n), h(n);
  std::vector<float> bx(n), hx(n);
  f32_to_bf16_n(x.data(), b.data(), n);
  f32_to_f16_n(x.data(), h.data(), n);
  bf16_to_f32_n(b.data(), bx.data(), n);
  f16_to_f32_n(h.data(), hx.data(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(b[i], f32_to_bf16(x[i])) << i;
    ASSERT_EQ(h[i], f32_to_f16(x[i])) << i;
    ASSERT_EQ(bits(bx[i]), bits(bf16_to_f32(b[i]))) << i;
    ASSERT_EQ(bits(hx[i]), bits(f16_to_f32(h[i]))) << i;
  }
}

}  // namespace
}  // namespace strata
