// storage/checksum.h against libxxhash's XXH3_64bits_withSeed: every path, every length class XXH3 treats
// differently (0, 1-3, 4-8, 9-16, 17-128, 129-240, and long inputs across stripe and block edges), seeds,
// and unaligned starts. The swap files' format depends on these values being XXH3's.
#include "storage/checksum.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "common/rng.h"

namespace strata {
namespace {

std::vector<size_t> lengths() {
  std::vector<size_t> n;
  for (size_t i = 0; i <= 300; ++i) n.push_back(i);
  // XXH3 long inputs: 64-byte stripes, 1024-byte blocks (with the default secret), the last partial stripe.
  for (size_t base : {size_t{1024}, size_t{4096}, size_t{65536}, size_t{1} << 20})
    for (size_t d : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}}) {
      n.push_back(base + d);
      n.push_back(base - d);
    }
  n.push_back((size_t{3} << 20) + 4097);
  return n;
}

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<unsigned char> b(n);
  for (auto& c : b) c = static_cast<unsigned char>(rng.next_u64());
  return b;
}

TEST(ChecksumTest, EveryPathIsXxh3) {
  const std::vector<unsigned char> bytes = random_bytes((size_t{3} << 20) + 4097 + 64, 5);
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2");
#else
  const bool avx2 = false;
#endif
  for (const size_t n : lengths()) {
    for (const size_t misalign : {size_t{0}, size_t{1}, size_t{13}}) {
      for (const uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{0x9e3779b97f4a7c15ull}}) {
        SCOPED_TRACE(testing::Message() << n << " bytes at +" << misalign << ", seed " << seed);
        const void* p = bytes.data() + misalign;
        const uint64_t want = XXH3_64bits_withSeed(p, n, seed);
        EXPECT_EQ(xxh3_64(p, n, seed), want);
        EXPECT_EQ(detail::xxh3_64_sse2(p, n, seed), want);
#if defined(__x86_64__)
        if (avx2) {
          EXPECT_EQ(detail::xxh3_64_avx2(p, n, seed), want);
        }
#endif
      }
    }
  }
  if (!avx2) std::printf("this CPU has no AVX2: its path was not checked here\n");
}

TEST(ChecksumTest, TakesTheVectorPathTheCpuHas) {
#if defined(__x86_64__)
  EXPECT_STREQ(xxh3_path(), __builtin_cpu_supports("avx2") ? "avx2" : "sse2");
#else
  EXPECT_STREQ(xxh3_path(), "sse2");
#endif
}

TEST(ChecksumTest, SeesEveryByte) {
  std::vector<unsigned char> b = random_bytes(1 << 20, 9);
  const uint64_t before = xxh3_64(b.data(), b.size(), 3);
  for (const size_t at : {size_t{0}, size_t{4095}, size_t{777777}, b.size() - 1}) {
    b[at] ^= 1;
    EXPECT_NE(xxh3_64(b.data(), b.size(), 3), before) << "a flipped bit at byte " << at;
    b[at] ^= 1;
  }
  EXPECT_EQ(xxh3_64(b.data(), b.size(), 3), before);
}

}  // namespace
}  // namespace strata
