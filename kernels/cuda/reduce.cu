// reduce.cu — column_sums_accumulate (matmul's bias gradient), on the reductions of reduce.cuh.
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::kernels::cuda {
namespace {

struct MatrixElement {
  const float* src;
  int C;
  __device__ void operator()(int n, int c, float (&v)[1]) const { v[0] = src[static_cast<size_t>(n) * C + c]; }
};

}  // namespace

void column_sums_accumulate(float* dst, const float* src, int N, int C) {
  launch_column_sums<1>(ColumnDsts<1>{{dst}}, N, C, MatrixElement{src, C});
}

}  // namespace strata::kernels::cuda
