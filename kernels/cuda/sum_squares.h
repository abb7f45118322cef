// sum_squares.h — acc + Σ x[i]² over n device floats, in double, deterministic; waits for the compute stream.
#pragma once

#include <cstddef>

namespace strata::kernels::cuda {
double add_sum_squares(double acc, const float* x, size_t n);
}  // namespace strata::kernels::cuda
