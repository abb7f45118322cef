#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels {

const KernelSet& cuda_kernels() {
  namespace c = cuda;
  static const KernelSet k{
      "cuda",
      &c::encoder_forward,
      &c::encoder_backward,
      &c::layernorm_forward,
      &c::layernorm_backward,
      &c::residual_layernorm_forward,
      nullptr,  // rmsnorm_forward, rmsnorm_backward, residual_rmsnorm_forward: the Llama family's ops, not yet
      nullptr,  // on CUDA (docs/gpu.md); a model that needs them refuses this KernelSet by name
      nullptr,
      &c::matmul_forward,
      &c::matmul_backward,
      &c::matmul_backward_set,
      &c::hidden_bytes,
      &c::attention_forward,
      &c::attention_backward,
      &c::attention_saved_floats,
      nullptr,  // rope_forward, rope_backward: not yet on CUDA
      nullptr,
      nullptr,  // qk_norm_forward, qk_norm_backward: not yet on CUDA
      nullptr,
      &c::matmul_forward_to_hidden,
      &c::matmul_backward_hidden,
      &c::matmul_gelu_forward,
      &c::matmul_forward_hidden,
      &c::matmul_backward_gelu,
      &c::matmul_backward_set_hidden,
      &c::gelu_forward,
      &c::gelu_backward,
      nullptr,  // swiglu_forward, swiglu_backward: not yet on CUDA
      nullptr,
      &c::residual_forward,
      &c::residual_backward,
      &c::softmax_crossentropy_forward,
      &c::softmax_crossentropy_backward,
      &c::classifier_forward,
      &c::classifier_backward,
      &c::classifier_logits_bytes,
      &c::adamw_update,
      &c::weights_to_bf16,
  };
  return k;
}

}  // namespace strata::kernels
