// adamw.cu — AdamW on the GPU, for runs that keep the optimizer on the device.
//
// The operations and their order are the CPU reference's (kernels/cpu/reference.h, torch.optim.AdamW 1.13), and
// every one is written with a round-to-nearest intrinsic so nvcc cannot contract a multiply-add into an FMA:
// with the same per-step scalars (computed on the host in double, as the reference does) the update is bitwise
// the CPU reference's, so a run can move its optimizer between CPU and GPU without changing a bit.
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

struct AdamWScalars {
  float step_size, bc2_sqrt, decay, b1, b2, one_minus_b1, one_minus_b2, eps, grad_scale;
};

__global__ void adamw_kernel(float* params, float* m, float* v, const float* grads, size_t n, AdamWScalars s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float g = __fmul_rn(grads[i], s.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(s.b1, m[i]), __fmul_rn(s.one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(s.b2, v[i]), __fmul_rn(__fmul_rn(s.one_minus_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float p = __fmul_rn(params[i], s.decay);
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    params[i] = __fsub_rn(p, __fmul_rn(s.step_size, __fdiv_rn(mi, denom)));
  }
}

}  // namespace

void adamw_update(float* params, float* m, float* v, const float* grads, size_t n, const AdamWParams& hp) {
  if (n == 0) return;
  const double bc1 = 1.0 - std::pow(static_cast<double>(hp.beta1), hp.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(hp.beta2), hp.step);
  const AdamWScalars s{static_cast<float>(hp.lr / bc1),
                       static_cast<float>(std::sqrt(bc2)),
                       static_cast<float>(1.0 - static_cast<double>(hp.lr) * hp.weight_decay),
                       hp.beta1,
                       hp.beta2,
                       1.0f - hp.beta1,
                       1.0f - hp.beta2,
                       hp.eps,
                       hp.grad_scale};
  adamw_kernel<<<grid_for(n, 256), 256, 0, cuda_context().compute>>>(params, m, v, grads, n, s);
  CUDA_CHECK_LAUNCH();
}

}  // namespace strata::kernels::cuda
