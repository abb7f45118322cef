// GPT-2's initialisation: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, layernorm weights 1.
#include <cmath>
#include <memory>

#include "engine/model/gpt2/gpt2.h"
#include "engine/model/seeded_init.h"

namespace strata::engine {

std::unique_ptr<WeightsInit> GPT2::initial_weights(uint64_t seed) const {
  const double residual_std = 0.02 / std::sqrt(2.0 * config_.n_layer);
  return std::make_unique<SeededInit>(
      *this, seed,
      [residual_std](const TensorSpec& s) { return s.name.ends_with("c_proj.weight") ? residual_std : 0.02; },
      [](const TensorSpec& s) {
        const bool norm_weight = s.name.find("ln_") != std::string::npos && s.name.ends_with(".weight");
        return norm_weight ? 1.0f : 0.0f;
      },
      "GPT-2");
}

}  // namespace strata::engine
