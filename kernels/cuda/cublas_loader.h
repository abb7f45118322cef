// cublas_loader.h — whether cuBLAS and cuBLASLt could be loaded (kernels/cuda/cublas_loader.cpp loads them on
// first use, not at start-up).
#pragma once

#include "common/status.h"

namespace strata::kernels::cuda {

// Loads both libraries (once) and checks their entry points: ok, or NotFound naming the library and why.
Status cublas_load_status();

}  // namespace strata::kernels::cuda
