// reduce.cu — column_sums_accumulate (matmul's bias gradient), of fp32 or bf16 matrices, on the reductions of
// reduce.cuh.
#include "kernels/cuda/bf16.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

struct MatrixElement {
  const float* src;
  int C;
  __device__ void operator()(int n, int c, float (&v)[1]) const { v[0] = src[static_cast<size_t>(n) * C + c]; }
};

struct Bf16MatrixElement {
  const uint16_t* src;
  int C;
  __device__ void operator()(int n, int c, float (&v)[1]) const {
    v[0] = bf16_bits_to_float(src[static_cast<size_t>(n) * C + c]);
  }
};

}  // namespace

void column_sums_accumulate_bf16(float* dst, const uint16_t* src, int N, int C) {
  launch_column_sums<1>(ColumnDsts<1>{{dst}}, N, C, Bf16MatrixElement{src, C});
}

void column_sums_accumulate(float* dst, const float* src, int N, int C) {
  launch_column_sums<1>(ColumnDsts<1>{{dst}}, N, C, MatrixElement{src, C});
}

}  // namespace strata::kernels::cuda
