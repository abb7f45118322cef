// fast_simd.h — private to the fast CPU kernels: float vectors of each instruction set's width, the few vector
// functions the kernels need (exp, horizontal sum and max), and the run-time choice of instruction set. Not part
// of the kernels/ interface.
//
// A kernel body is written once, as `template <int N> struct K { static void run(...); }` over Vec<N> (GCC vector
// extensions), and run with dispatch<K>(args...), which calls K<16>, K<8> or K<4> inside a function compiled
// with target attributes for AVX-512 (F/BW/VL/DQ + FMA), AVX2 + FMA, or baseline x86-64 (SSE2), chosen once by
// __builtin_cpu_supports. Why vector extensions and not intrinsics: GCC will not inline an AVX-512 intrinsic
// into a template that is not itself compiled for AVX-512, so intrinsic bodies would be written three times; a
// generic vector is lowered for the target of the clone that inlines it.
//
// Determinism: on one machine the same clone always runs, so results repeat bit for bit. Clones may differ from
// each other in the last bits: their vector widths group partial sums differently, and only the AVX2 and
// AVX-512 clones contract multiply-adds into FMAs.
// Threading: set_isa is for tests and must not race with running kernels; everything else is stateless.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

// GCC warns that returning a vector from a function not compiled for its width differs in ABI. Every such
// function here is always_inline, so no call ever uses that ABI. (Vector arguments go by const reference for
// the same reason: GCC's note about 32- and 64-byte-aligned arguments cannot be silenced.) The pragma stays on
// for the including file, where the templates are instantiated.
#pragma GCC diagnostic ignored "-Wpsabi"

#define STRATA_SIMD_INLINE [[gnu::always_inline]] inline

namespace strata::kernels::cpu::simd {

// N floats: 16 in the AVX-512 clone, 8 in AVX2, 4 in baseline. Each clone uses the width its registers hold: a
// 64-byte vector in an AVX2 function would live on the stack, ten times slower.
// (Spelled out per width: GCC drops vector_size from an alias template whose size depends on N.)
template <int N>
struct VecOf;
template <>
struct VecOf<16> {
  using type = float __attribute__((vector_size(64)));
};
template <>
struct VecOf<8> {
  using type = float __attribute__((vector_size(32)));
};
template <>
struct VecOf<4> {
  using type = float __attribute__((vector_size(16)));
};
template <int N>
using Vec = typename VecOf<N>::type;
template <typename V>
constexpr int kLanes = sizeof(V) / sizeof(float);
constexpr int kMaxLanes = 16;

template <typename V>
STRATA_SIMD_INLINE V splat(float x) {
  return V{} + x;
}
template <typename V>
STRATA_SIMD_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
STRATA_SIMD_INLINE void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}
// The first n (< kLanes) lanes from p, the rest `fill`.
template <typename V>
STRATA_SIMD_INLINE V load_n(const float* p, size_t n, float fill) {
  V v = splat<V>(fill);
  for (size_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
template <typename V>
STRATA_SIMD_INLINE void store_n(float* p, const V& v, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = v[i];
}
template <typename V>
STRATA_SIMD_INLINE V max(const V& a, const V& b) {
  return a > b ? a : b;
}

// v with lanes i and i ^ W exchanged.
template <int W, typename V, int... I>
STRATA_SIMD_INLINE V partner(const V& v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, (I ^ W)...);
}
template <int W, typename V>
STRATA_SIMD_INLINE V partner(const V& v) {
  return partner<W>(v, std::make_integer_sequence<int, kLanes<V>>{});
}

// Horizontal sum and max in a fixed tree (lane i with lane i ^ 8, then i ^ 4, i ^ 2, i ^ 1): the order never
// varies. Shuffles, not a round trip through memory, so the accumulators that feed them stay in registers.
template <typename V>
STRATA_SIMD_INLINE float hsum(const V& x) {
  V v = x;
  if constexpr (kLanes<V> >= 16) v += partner<8>(v);
  if constexpr (kLanes<V> >= 8) v += partner<4>(v);
  v += partner<2>(v);
  v += partner<1>(v);
  return v[0];
}
template <typename V>
STRATA_SIMD_INLINE float hmax(const V& x) {
  V v = x;
  if constexpr (kLanes<V> >= 16) v = max(v, partner<8>(v));
  if constexpr (kLanes<V> >= 8) v = max(v, partner<4>(v));
  v = max(v, partner<2>(v));
  v = max(v, partner<1>(v));
  return v[0];
}

// e^x, lane-wise. Measured against exp in double over [-87.3, 88.3]: at most 0.94 ulp with FMA (AVX2, AVX-512
// clones), 1.22 ulp without (baseline). Results that would be subnormal (x < -87.336) are flushed to 0, -inf
// gives 0, NaN stays NaN, and x > 88.376 saturates at e^88.376 (~2.2e38) instead of overflowing: the callers
// only need x <= 0 or a large finite value. Method: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two so
// n*ln2_hi is exact), e^r by its Taylor series to r^7 (truncation below 1e-8 relative), 2^n built in the
// exponent bits.
template <typename V>
STRATA_SIMD_INLINE V exp(const V& x) {
  using VI = decltype(x < x);            // int32 lanes of the same width
  constexpr float kMin = -87.33654f;     // ln(FLT_MIN)
  constexpr float kMax = 88.37626f;      // keeps n <= 127
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // 8 significant bits, so n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  V xc = x < kMin ? splat<V>(kMin) : x;
  xc = xc > kMax ? splat<V>(kMax) : xc;
  const V t = xc * kLog2e + kRound;
  const V n = t - kRound;
  V r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  V p = splat<V>(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI pow2n = ((VI)t - (VI)splat<V>(kRound) + 127) << 23;
  const V result = p * (V)pow2n;
  return x < kMin ? V{} : result;
}

// ---- run-time instruction-set choice ----------------------------------------------------------------------

enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

// The best instruction set this CPU (and OS) supports.
inline Isa detect_isa() {
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  if (fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  if (fma && __builtin_cpu_supports("avx2")) return Isa::kAvx2;
  return Isa::kBaseline;
}

inline std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{static_cast<int>(detect_isa())};
  return slot;
}
inline Isa active_isa() { return static_cast<Isa>(isa_slot().load(std::memory_order_relaxed)); }
// Makes the kernels use `want`, or the best supported set below it; returns the one now in use. For tests that
// exercise every clone on one machine.
inline Isa set_isa(Isa want) {
  const Isa best = detect_isa();
  const Isa use = static_cast<int>(want) < static_cast<int>(best) ? want : best;
  isa_slot().store(static_cast<int>(use), std::memory_order_relaxed);
  return use;
}

#define STRATA_TARGET_AVX512 gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define STRATA_TARGET_AVX2 gnu::target("avx2,fma")

template <template <int> class K, typename... Args>
[[STRATA_TARGET_AVX512, gnu::noinline]] void run_avx512(Args... args) {
  K<16>::run(args...);
}
template <template <int> class K, typename... Args>
[[STRATA_TARGET_AVX2, gnu::noinline]] void run_avx2(Args... args) {
  K<8>::run(args...);
}
template <template <int> class K, typename... Args>
[[gnu::noinline]] void run_baseline(Args... args) {
  K<4>::run(args...);
}

// Runs K<N>::run(args...) compiled for the active instruction set, N its natural width. K<N>::run must be
// STRATA_SIMD_INLINE, as must everything it calls that takes or returns a vector.
template <template <int> class K, typename... Args>
void dispatch(Args... args) {
  switch (active_isa()) {
    case Isa::kAvx512:
      return run_avx512<K>(args...);
    case Isa::kAvx2:
      return run_avx2<K>(args...);
    default:
      return run_baseline<K>(args...);
  }
}

}  // namespace strata::kernels::cpu::simd
