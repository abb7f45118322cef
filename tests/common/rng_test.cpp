// fill_normal: bitwise the sequential loop of normal() it replaces (model initialisation depends on it), across
// its chunk boundary, on one thread or all of them; and the generator continues where that loop leaves it.
#include "common/rng.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

namespace strata {
namespace {

TEST(RngTest, FillNormalIsBitwiseTheSequentialLoop) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{4097}, (size_t{1} << 20) + 3}) {
    Rng want_rng(11), one_rng(11), all_rng(11);
    std::vector<float> want(n), one(n), all(n);
    for (size_t i = 0; i < n; ++i) want[i] = static_cast<float>(0.02 * want_rng.normal());
    tbb::task_arena single(1);
    single.execute([&] { fill_normal(one_rng, one.data(), n, 0.02); });
    fill_normal(all_rng, all.data(), n, 0.02);
    // memcmp takes no null pointer, not even for 0 bytes (UBSan), and an empty vector's data() may be one.
    const auto same_bits = [n](const std::vector<float>& a, const std::vector<float>& b) {
      return n == 0 || std::memcmp(a.data(), b.data(), n * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same_bits(want, one)) << "n=" << n << ", one thread";
    EXPECT_TRUE(same_bits(want, all)) << "n=" << n << ", all threads";
    const uint64_t next = want_rng.next_u64();
    EXPECT_EQ(one_rng.next_u64(), next);
    EXPECT_EQ(all_rng.next_u64(), next);
  }
}

}  // namespace
}  // namespace strata
