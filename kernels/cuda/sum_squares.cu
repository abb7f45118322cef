// sum_squares.cu — Σ x² in double for the gradient norm. A fixed grid (kBlocks × kThreads, whatever n is) and
// fixed reduction trees make the order depend on n alone; the host adds the per-block partials in order.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/sum_squares.h"

namespace strata::kernels::cuda {
namespace {

constexpr int kBlocks = 1024, kThreads = 256;

__global__ void sum_squares_kernel(double* partials, const float* x, size_t n) {
  __shared__ double shared[kThreads];
  double s = 0.0;
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{kBlocks} * kThreads) {
    const double v = x[i];
    s += v * v;
  }
  shared[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = shared[0];
}

}  // namespace

double add_sum_squares(double acc, const float* x, size_t n) {
  if (n == 0) return acc;
  const CudaContext& ctx = cuda_context();
  DeviceScratch partials(sizeof(double) * kBlocks);
  sum_squares_kernel<<<kBlocks, kThreads, 0, ctx.compute>>>(partials.as<double>(), x, n);
  CUDA_CHECK_LAUNCH();
  double host[kBlocks];
  CUDA_CHECK(cudaMemcpyAsync(host, partials.as<double>(), sizeof(host), cudaMemcpyDeviceToHost, ctx.compute));
  CUDA_CHECK(cudaStreamSynchronize(ctx.compute));
  for (double p : host) acc += p;
  return acc;
}

}  // namespace strata::kernels::cuda
