// encoder.cu — token + position embedding, forward and backward.
//
// Backward is deterministic without atomics: the B*T positions are sorted by token id (a stable radix sort, so
// each token's positions stay in ascending order), and one block per distinct token sums its rows of dout in
// that order before adding them to dwte. dwpe sums over the batch in order b = 0..B-1.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

// A token outside [vocab_start, vocab_start + vocab_rows) adds nothing (another tensor-parallel rank holds its
// row), nor does a null wpe.
__global__ void encoder_forward_kernel(float* out, const int32_t* inp, const float* wte, const float* wpe, int T,
                                       int C, size_t total, int vocab_start, int vocab_rows) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < total; i += size_t{gridDim.x} * blockDim.x) {
    const size_t bt = i / C;
    const int c = static_cast<int>(i % C);
    const int t = static_cast<int>(bt % T);
    const int row = inp[bt] - vocab_start;
    const float e = row >= 0 && row < vocab_rows ? wte[static_cast<size_t>(row) * C + c] : 0.0f;
    out[i] = e + (wpe != nullptr ? wpe[static_cast<size_t>(t) * C + c] : 0.0f);
  }
}

__global__ void encoder_dwpe_kernel(float* dwpe, const float* dout, int B, int T, int C) {
  const size_t TC = static_cast<size_t>(T) * C;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < TC; i += size_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int b = 0; b < B; ++b) s += dout[b * TC + i];
    dwpe[i] += s;
  }
}

__global__ void iota_kernel(int32_t* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = i;
}

// Block i handles sorted position i if it starts a run of equal tokens with a row here; the others return at
// once.
__global__ void encoder_dwte_kernel(float* dwte, const float* dout, const int32_t* sorted_tokens,
                                    const int32_t* sorted_positions, int N, int C, int vocab_start, int vocab_rows) {
  const int i = blockIdx.x;
  const int token = sorted_tokens[i];
  if (i > 0 && sorted_tokens[i - 1] == token) return;
  if (token < vocab_start || token - vocab_start >= vocab_rows) return;
  int end = i + 1;
  while (end < N && sorted_tokens[end] == token) ++end;
  float* row = dwte + static_cast<size_t>(token - vocab_start) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0.0f;
    for (int j = i; j < end; ++j) s += dout[static_cast<size_t>(sorted_positions[j]) * C + c];
    row[c] += s;
  }
}

}  // namespace

void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_start, int vocab_rows) {
  const size_t total = static_cast<size_t>(B) * T * C;
  if (total == 0) return;
  encoder_forward_kernel<<<grid_for(total, 256), 256, 0, cuda_context().compute>>>(out, inp, wte, wpe, T, C, total,
                                                                                   vocab_start, vocab_rows);
  CUDA_CHECK_LAUNCH();
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C,
                      int vocab_start, int vocab_rows) {
  const int N = B * T;
  if (N == 0 || C == 0) return;
  const CudaContext& ctx = cuda_context();
  if (dwpe != nullptr) {
    encoder_dwpe_kernel<<<grid_for(static_cast<size_t>(T) * C, 256), 256, 0, ctx.compute>>>(dwpe, dout, B, T, C);
    CUDA_CHECK_LAUNCH();
  }

  DeviceScratch keys(sizeof(int32_t) * N), positions(sizeof(int32_t) * N), sorted_positions(sizeof(int32_t) * N);
  iota_kernel<<<grid_for(N, 256), 256, 0, ctx.compute>>>(positions.as<int32_t>(), N);
  CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, inp, keys.as<int32_t>(), positions.as<int32_t>(),
                                             sorted_positions.as<int32_t>(), N, 0, 32, ctx.compute));
  DeviceScratch temp(temp_bytes);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, inp, keys.as<int32_t>(),
                                             positions.as<int32_t>(), sorted_positions.as<int32_t>(), N, 0, 32,
                                             ctx.compute));
  encoder_dwte_kernel<<<N, 256, 0, ctx.compute>>>(dwte, dout, keys.as<int32_t>(), sorted_positions.as<int32_t>(), N,
                                                  C, vocab_start, vocab_rows);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
