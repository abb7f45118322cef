// rng.h — a small, portable, seeded random generator (splitmix64 seeding, xoshiro256** stream).
//
// std::normal_distribution differs between standard libraries, so initialisation and tests use this instead:
// the same seed gives the same numbers on every machine. Not thread-safe; give each thread its own.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace strata {

// SplitMix64 of the k-th value after `seed` (k >= 1): a well-mixed 64-bit hash of seed + k * golden ratio, with
// no state, so any element of a sequence can be made on any thread.
inline uint64_t splitmix64(uint64_t seed, uint64_t k) {
  uint64_t z = seed + k * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t k = 0; k < 4; ++k) s_[k] = splitmix64(seed, k + 1);
  }
  uint64_t next_u64() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return next_u64() % n; }
  // Standard normal (Box-Muller, one value per call).
  double normal() {
    double u1 = 0, u2 = 0;
    normal_uniforms(&u1, &u2);
    return box_muller(u1, u2);
  }
  // normal() in two halves: the uniforms it draws (u1 > 0, then u2), and the value they make. The draws are
  // cheap and sequential, the transform costly and independent per value, so fill_normal() runs it in parallel
  // and still gives normal()'s numbers.
  void normal_uniforms(double* u1, double* u2) {
    *u1 = uniform();
    while (*u1 <= 0.0) *u1 = uniform();
    *u2 = uniform();
  }
  static double box_muller(double u1, double u2) {
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// p[i] = float(stddev * rng.normal()) for i in [0, n), in order: bitwise what that loop gives, with the transform
// spread over the cores (initialising a model of billions of parameters took minutes on one).
void fill_normal(Rng& rng, float* p, size_t n, double stddev);

}  // namespace strata
