// cpu::fast::add_sum_squares, the gradient norm's sum of squares (the "cpu" Device's and the CPU optimizer's).
#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "common/rng.h"
#include "kernels/cpu/fast.h"

namespace strata::kernels {
namespace {

// The gradient norm's sum of squares: within a few ulps of the exact sum (long double over floats that are
// exact in it), on both sides of the parallel threshold and with ragged tails, and the same bits on one thread
// as on all of them.
TEST(SumSquares, AccurateAndTheSameBitsOnAnyThreadCount) {
  Rng rng(20240601);  // ops_test.cpp's seed
  for (size_t n : {size_t{0}, size_t{7}, size_t{4096 * 64}, size_t{4096 * 64 + 1}, size_t{3'000'017}}) {
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(rng.uniform() * 2.0 - 1.0);
    long double exact = 0.25L;
    for (const float v : x) exact += static_cast<long double>(v) * v;
    double one = 0;
    tbb::task_arena single(1);
    single.execute([&] { one = cpu::fast::add_sum_squares(0.25, x.data(), n); });
    const double all = cpu::fast::add_sum_squares(0.25, x.data(), n);
    EXPECT_EQ(std::memcmp(&one, &all, sizeof(double)), 0) << "n=" << n << ": " << one << " vs " << all;
    EXPECT_NEAR(all, static_cast<double>(exact), 1e-14 * static_cast<double>(exact)) << "n=" << n;
  }
}

}  // namespace
}  // namespace strata::kernels
