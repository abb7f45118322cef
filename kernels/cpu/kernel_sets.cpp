#include <cstring>

#include "kernels/composed.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/matmul_info.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/reference_matmul.h"

namespace strata::kernels {

const KernelSet& cpu_reference_kernels() {
  namespace r = cpu::ref;
  constexpr auto matmul_forward = &f32_weight_matmul_forward<&r::matmul_forward<float>>;
  constexpr auto matmul_backward = &f32_weight_matmul_backward<&r::matmul_backward<float>>;
  static const KernelSet k{
      "cpu-reference",
      &r::encoder_forward<float>,
      &r::encoder_backward<float>,
      &composed_layernorm_forward<&r::layernorm_forward<float>>,
      &r::layernorm_backward<float>,
      &composed_residual_layernorm_forward<&r::residual_forward<float>, &r::layernorm_forward<float>>,
      &composed_rmsnorm_forward<&r::rmsnorm_forward<float>>,
      &r::rmsnorm_backward<float>,
      &composed_residual_rmsnorm_forward<&r::residual_forward<float>, &r::rmsnorm_forward<float>>,
      matmul_forward,
      matmul_backward,
      &composed_matmul_backward_set<matmul_backward, &host_zero>,
      &composed_hidden_bytes,
      &composed_attention_forward<&r::attention_forward<float>>,
      &composed_attention_backward<&r::attention_backward<float>>,
      &r::attention_saved_floats,
      &composed_rope<&r::rope_forward<float>>,
      &composed_rope<&r::rope_backward<float>>,
      &composed_qk_norm_forward<&r::qk_norm_forward<float>>,
      &composed_qk_norm_backward<&r::qk_norm_backward<float>>,
      &composed_matmul_forward_to_hidden<matmul_forward>,
      &composed_matmul_backward_hidden<&composed_matmul_backward_set<matmul_backward, &host_zero>>,
      &composed_matmul_gelu_forward<matmul_forward, &r::gelu_forward<float>>,
      &composed_matmul_forward_hidden<matmul_forward>,
      &composed_matmul_backward_gelu<matmul_backward, &r::gelu_backward<float>, &host_zero>,
      &composed_matmul_backward_set_hidden<&composed_matmul_backward_set<matmul_backward, &host_zero>>,
      &r::gelu_forward<float>,
      &r::gelu_backward<float>,
      &composed_swiglu_forward<&r::swiglu_forward<float>>,
      &composed_swiglu_backward<&r::swiglu_backward<float>>,
      &r::residual_forward<float>,
      &r::residual_backward<float>,
      &r::softmax_crossentropy_forward<float>,
      &r::softmax_crossentropy_backward<float>,
      &composed_classifier_forward<matmul_forward, &r::softmax_crossentropy_forward<float>>,
      &composed_classifier_backward<matmul_backward, &r::softmax_crossentropy_backward<float>>,
      &composed_classifier_logits_bytes,
      &r::adamw_update<float>,
      nullptr,  // weights_to_bf16: the reference keeps no working copies
  };
  return k;
}

const KernelSet& cpu_fast_kernels() {
  namespace f = cpu::fast;
  static const KernelSet k{
      "cpu-fast",
      &f::encoder_forward,
      &f::encoder_backward,
      &composed_layernorm_forward<&f::layernorm_forward>,
      &f::layernorm_backward,
      &composed_residual_layernorm_forward<&f::residual_forward, &f::layernorm_forward>,
      &composed_rmsnorm_forward<&f::rmsnorm_forward>,
      &f::rmsnorm_backward,
      &composed_residual_rmsnorm_forward<&f::residual_forward, &f::rmsnorm_forward>,
      &f::matmul_forward,
      &f::matmul_backward,
      &composed_matmul_backward_set<&f::matmul_backward, &host_zero>,
      &composed_hidden_bytes,
      &composed_attention_forward<&f::attention_forward>,
      &composed_attention_backward<&f::attention_backward>,
      &cpu::ref::attention_saved_floats,
      &composed_rope<&f::rope_forward>,
      &composed_rope<&f::rope_backward>,
      &composed_qk_norm_forward<&f::qk_norm_forward>,
      &composed_qk_norm_backward<&f::qk_norm_backward>,
      &composed_matmul_forward_to_hidden<&f::matmul_forward>,
      &composed_matmul_backward_hidden<&composed_matmul_backward_set<&f::matmul_backward, &host_zero>>,
      &composed_matmul_gelu_forward<&f::matmul_forward, &f::gelu_forward>,
      &composed_matmul_forward_hidden<&f::matmul_forward>,
      &composed_matmul_backward_gelu<&f::matmul_backward, &f::gelu_backward, &host_zero>,
      &composed_matmul_backward_set_hidden<&composed_matmul_backward_set<&f::matmul_backward, &host_zero>>,
      &f::gelu_forward,
      &f::gelu_backward,
      &composed_swiglu_forward<&f::swiglu_forward>,
      &composed_swiglu_backward<&f::swiglu_backward>,
      &f::residual_forward,
      &f::residual_backward,
      &f::softmax_crossentropy_forward,
      &f::softmax_crossentropy_backward,
      &composed_classifier_forward<&f::matmul_forward, &f::softmax_crossentropy_forward>,
      &composed_classifier_backward<&f::matmul_backward, &f::softmax_crossentropy_backward>,
      &composed_classifier_logits_bytes,
      &f::adamw_update,
      // Working copies only where the matmuls read them: oneDNN's native bf16 (else they round to fp32 values).
      cpu::matmul_bf16_native() ? &f::weights_to_bf16 : nullptr,
  };
  return k;
}

const KernelSet* find_kernel_set(const char* name) {
  if (!std::strcmp(name, "reference") || !std::strcmp(name, "cpu-reference")) return &cpu_reference_kernels();
  if (!std::strcmp(name, "fast") || !std::strcmp(name, "cpu-fast")) return &cpu_fast_kernels();
  return nullptr;
}

}  // namespace strata::kernels
