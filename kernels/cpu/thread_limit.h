// thread_limit.h — compute.threads (--threads) for the CPU kernels: one limit for both thread pools they use.
#pragma once

#include <optional>

#include <tbb/global_control.h>

#include "kernels/cpu/matmul_info.h"

namespace strata::kernels::cpu {

// At most `n` threads (n > 0; otherwise no limit) for the CPU kernels this thread runs: TBB's, while the
// object lives, and the oneDNN matmuls' OpenMP team (set_matmul_threads: the calling thread's count).
class CpuThreadLimit {
 public:
  explicit CpuThreadLimit(int n) {
    if (n <= 0) return;
    tbb_.emplace(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(n));
    set_matmul_threads(n);
  }
  CpuThreadLimit(const CpuThreadLimit&) = delete;
  CpuThreadLimit& operator=(const CpuThreadLimit&) = delete;

 private:
  std::optional<tbb::global_control> tbb_;
};

}  // namespace strata::kernels::cpu
