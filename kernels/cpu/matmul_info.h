// matmul_info.h — what the fast CPU matmul (kernels/cpu/fast_matmul.cpp) runs on, for bench output and tests.
//
// The matmuls themselves are declared in kernels/cpu/fast.h; this header only reports on them. Thread-safe.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/kernels.h"

namespace strata::kernels::cpu {

// The instruction set oneDNN dispatches to on this machine (dnnl::get_effective_cpu_isa), e.g.
// "avx512_core_bf16". Honours ONEDNN_MAX_CPU_ISA.
const char* matmul_cpu_isa();

// oneDNN's CPU threading runtime as the installed library was built: "OpenMP", "TBB", "threadpool" or
// "sequential". With OpenMP, the thread count comes from OMP_NUM_THREADS (default: all cores), not from TBB.
const char* matmul_cpu_runtime();

// With the OpenMP runtime: at most `n` threads for the matmuls this thread calls from now on (OpenMP's
// nthreads ICV is the calling thread's; TBB's limit does not reach them), and the limit they run under now
// (omp_get_max_threads). 0 from both where the runtime is another, or OpenMP is not loaded.
int set_matmul_threads(int n);
int matmul_threads();

// oneDNN's name for the implementation the forward matmul uses at these shapes, e.g. "brg:avx512_core_bf16"
// (creates and caches the primitive if needed).
std::string matmul_forward_impl(int N, int C, int OC, MatmulPrecision precision);

// Whether kBF16 runs on a native bf16 x bf16 -> f32 oneDNN kernel. If not (no AVX-512), kBF16 rounds the inputs
// to bf16 and multiplies them in fp32: the same numbers within fp32 accumulation order, without the speed-up.
bool matmul_bf16_native();

// Matmul primitives created by this process so far (misses of the primitive cache); repeated calls with the
// same shapes leave it unchanged.
size_t matmul_primitives_created();

}  // namespace strata::kernels::cpu
