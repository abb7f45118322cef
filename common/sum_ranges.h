// sum_ranges.h — a sum over part of a flat buffer, leaving out given ranges of it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace strata {

// Sorted, disjoint [offset, offset + length) ranges of a flat buffer.
using Ranges = std::vector<std::pair<size_t, size_t>>;

// The sum of squares of `x`, which is n floats at `offset` of a buffer, less the parts of it in `excluded` (ranges
// of the buffer); `sum_squares(p, n)` sums n floats from p from zero. The pieces are added in order.
template <typename SumSquares>
double sum_squares_excluding(const float* x, size_t offset, size_t n,
                             const Ranges& excluded, SumSquares&& sum_squares) {
  double total = 0.0;
  size_t at = offset;
  const size_t end = offset + n;
  for (const auto& [ex_off, ex_len] : excluded) {
    if (at >= end) break;
    const size_t ex_end = ex_off + ex_len;
    if (ex_end <= at) continue;
    if (ex_off > at) {
      const size_t stop = std::min(ex_off, end);
      total += sum_squares(x + (at - offset), stop - at);
    }
    at = std::max(at, std::min(ex_end, end));
  }
  if (at < end) total += sum_squares(x + (at - offset), end - at);
  return total;
}

}  // namespace strata
