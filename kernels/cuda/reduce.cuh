// reduce.cuh — warp, block and column reductions shared by the kernels. Every one sums in an order fixed by the
// shapes and launch configuration alone, so results are bitwise reproducible run to run.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"

namespace strata::kernels::cuda {

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Block-wide sum or max; every thread gets the result. blockDim.x a multiple of 32, at most 1024. `shared` holds
// 32 floats; the call ends with a barrier so `shared` may be reused by the next reduction.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = kMax ? warp_max(x) : warp_sum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float y = lane < warps ? shared[lane] : (kMax ? -INFINITY : 0.0f);
  y = kMax ? warp_max(y) : warp_sum(y);
  __syncthreads();
  return y;
}

// A running softmax denominator: (m, s) stands for s * exp(m) = the sum of exp(x) over the values seen, with
// m their maximum (-inf and 0 before the first). Merging two such pairs, and the block-wide merge, read each row
// once instead of twice (max, then sum).
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  s = (m == -INFINITY ? 0.0f : s * __expf(m - mx)) + (m2 == -INFINITY ? 0.0f : s2 * __expf(m2 - mx));
  m = mx;
}
// The pairs of all the block's threads merged; the result is valid in thread 0. `shared_m` and `shared_s` hold
// 32 floats each. blockDim.x a multiple of 32.
__device__ __forceinline__ void block_softmax_merge(float& m, float& s, float* shared_m, float* shared_s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    softmax_merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? shared_m[lane] : -INFINITY;
    s = lane < warps ? shared_s[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
      softmax_merge(m, s, m2, s2);
    }
  }
}

// Column sums in two deterministic passes. Pass 1: block (32, kColumnRows) takes 32 columns and one chunk of
// kColumnChunkRows rows; each thread sums its rows in order, then the block adds its kColumnRows partial sums in
// order and writes partials[chunk][k][c]. Pass 2 adds the chunks in order into the destinations.
// `Fn` is a device functor: `void operator()(int n, int c, float (&out)[K]) const` gives the K values of (n, c).
constexpr int kColumnRows = 8;
constexpr int kColumnChunkRows = 256;

template <int K, typename Fn>
__global__ void column_partials_kernel(float* partials, int N, int C, Fn fn) {
  __shared__ float tile[K][kColumnRows][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int row0 = blockIdx.y * kColumnChunkRows;
  const int row1 = min(N, row0 + kColumnChunkRows);
  float acc[K];
  for (int k = 0; k < K; ++k) acc[k] = 0.0f;
  if (c < C) {
    for (int n = row0 + threadIdx.y; n < row1; n += kColumnRows) {
      float v[K];
      fn(n, c, v);
      for (int k = 0; k < K; ++k) acc[k] += v[k];
    }
  }
  for (int k = 0; k < K; ++k) tile[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 0; k < K; ++k) {
      float s = 0.0f;
      for (int r = 0; r < kColumnRows; ++r) s += tile[k][r][threadIdx.x];
      partials[(static_cast<size_t>(blockIdx.y) * K + k) * C + c] = s;
    }
  }
}

template <int K>
struct ColumnDsts {
  float* dst[K];
};

template <int K>
__global__ void column_finish_kernel(ColumnDsts<K> dsts, const float* partials, int chunks, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int k = 0; k < K; ++k) {
    float s = 0.0f;
    for (int j = 0; j < chunks; ++j) s += partials[(static_cast<size_t>(j) * K + k) * C + c];
    dsts.dst[k][c] += s;
  }
}

// dsts[k][c] += sum over n of fn(n, c)[k], on the compute stream. N, C >= 0.
template <int K, typename Fn>
void launch_column_sums(ColumnDsts<K> dsts, int N, int C, Fn fn) {
  if (N <= 0 || C <= 0) return;
  const CudaContext& ctx = cuda_context();
  const int chunks = (N + kColumnChunkRows - 1) / kColumnChunkRows;
  DeviceScratch partials(sizeof(float) * static_cast<size_t>(chunks) * K * C);
  const dim3 grid((C + 31) / 32, chunks), block(32, kColumnRows);
  column_partials_kernel<K><<<grid, block, 0, ctx.compute>>>(partials.as<float>(), N, C, fn);
  CUDA_CHECK_LAUNCH();
  column_finish_kernel<K><<<(C + 255) / 256, 256, 0, ctx.compute>>>(dsts, partials.as<float>(), chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
