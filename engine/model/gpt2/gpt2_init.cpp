// GPT-2's initialisation (GPT2Init).
#include "engine/model/gpt2/gpt2.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/log.h"
#include "common/rng.h"

namespace strata::engine {

GPT2Init::GPT2Init(const GPT2& model, uint64_t seed)
    : model_(model), rng_(seed), residual_std_(0.02 / std::sqrt(2.0 * model.config().n_layer)) {}

namespace {
// Weights (2-D and larger) are drawn; 1-D tensors are constants (layernorm weights 1, biases 0).
bool drawn(const TensorSpec& s) { return s.shape.size() >= 2; }
}  // namespace

void GPT2Init::skip_to(size_t end) {
  for (const TensorSpec& s : model_.whole_layout(unit_).specs()) {
    const size_t lo = std::max(at_, s.offset), hi = std::min(end, s.offset + s.numel());
    if (!drawn(s) || lo >= hi) continue;
    double u1 = 0, u2 = 0;
    for (size_t j = lo; j < hi; ++j) rng_.normal_uniforms(&u1, &u2);
  }
  at_ = end;
}

Status GPT2Init::fill(size_t unit, size_t offset, std::span<float> dst) {
  if (unit >= model_.units().size() || offset > model_.whole_layout(unit).numel() ||
      dst.size() > model_.whole_layout(unit).numel() - offset)
    return Status::internal("GPT-2 init: [{}, {}) of unit {} is outside the model", offset, offset + dst.size(), unit);
  if (unit < unit_ || (unit == unit_ && offset < at_))
    return Status::internal("GPT-2 init: [{}, {}) of unit {} asked for after element {} of unit {}: pieces come in "
                            "order",
                            offset, offset + dst.size(), unit, at_, unit_);
  for (; unit_ < unit; ++unit_, at_ = 0) skip_to(model_.whole_layout(unit_).numel());
  skip_to(offset);
  const size_t end = offset + dst.size();
  for (const TensorSpec& s : model_.whole_layout(unit).specs()) {
    const size_t lo = std::max(offset, s.offset), hi = std::min(end, s.offset + s.numel());
    if (lo >= hi) continue;
    float* p = dst.data() + (lo - offset);
    if (drawn(s)) {
      fill_normal(rng_, p, hi - lo, s.name.ends_with("c_proj.weight") ? residual_std_ : 0.02);
    } else {
      const bool norm_weight = s.name.find("ln_") != std::string::npos && s.name.ends_with(".weight");
      std::fill(p, p + (hi - lo), norm_weight ? 1.0f : 0.0f);
    }
  }
  at_ = end;
  return Status::ok();
}

std::unique_ptr<WeightsInit> GPT2::initial_weights(uint64_t seed) const {
  return std::make_unique<GPT2Init>(*this, seed);
}

}  // namespace strata::engine
