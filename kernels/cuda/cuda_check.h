// cuda_check.h — CUDA_CHECK and CUBLAS_CHECK: one-line uses of STRATA_CHECK_CALL (common/check.h) that print the
// failed call as text with file:line and abort. For foreign calls that fail only on a broken invariant or a dead
// device; errors a user can cause (no device, out of memory) are turned into a Status before these are reached.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/check.h"

#define CUDA_CHECK(call) STRATA_CHECK_CALL("CUDA", call, _r == cudaSuccess, cudaGetErrorString(_r))
#define CUBLAS_CHECK(call) STRATA_CHECK_CALL("cuBLAS", call, _r == CUBLAS_STATUS_SUCCESS, cublasGetStatusString(_r))
// After a kernel launch: a bad launch configuration surfaces here, at the launch site, not at the next sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
