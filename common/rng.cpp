#include "common/rng.h"

#include <algorithm>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace strata {

void fill_normal(Rng& rng, float* p, size_t n, double stddev) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<double> u(2 * std::min(n, kChunk));
  for (size_t c = 0; c < n; c += kChunk) {
    const size_t len = std::min(kChunk, n - c);
    for (size_t j = 0; j < len; ++j) rng.normal_uniforms(&u[2 * j], &u[2 * j + 1]);
    tbb::parallel_for(tbb::blocked_range<size_t>(0, len, 4096), [&](const tbb::blocked_range<size_t>& r) {
      for (size_t j = r.begin(); j < r.end(); ++j)
        p[c + j] = static_cast<float>(stddev * Rng::box_muller(u[2 * j], u[2 * j + 1]));
    });
  }
}

}  // namespace strata
