#include "engine/gpt2.h"

namespace strata::engine {

Status GPT2Config::validate() const {
  auto in_range = [](const char* name, int v, int max) -> Status {
    if (v <= 0) return Status::invalid_argument("model.{} must be a positive integer, got {}", name, v);
    if (v > max) return Status::invalid_argument("model.{} is {}, past the {} Strata takes", name, v, max);
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(in_range("n_layer", n_layer, kMaxLayers));
  STRATA_RETURN_IF_ERROR(in_range("n_embd", n_embd, kMaxWidth));
  STRATA_RETURN_IF_ERROR(in_range("n_head", n_head, n_embd));
  STRATA_RETURN_IF_ERROR(in_range("vocab_size", vocab_size, 65536).with_context("token shards store uint16 ids"));
  STRATA_RETURN_IF_ERROR(in_range("block_size", block_size, kMaxPositions));
  if (n_embd % n_head != 0)
    return Status::invalid_argument("model.n_embd ({}) must be divisible by model.n_head ({})", n_embd, n_head);
  // Every factor is bounded above, so this cannot overflow: (V + maxT) C + L (12 C^2 + 13 C) + 2 C.
  const int64_t C = n_embd, L = n_layer;
  const int64_t params = (int64_t{vocab_size} + block_size) * C + L * (12 * C * C + 13 * C) + 2 * C;
  if (params > kMaxParams) {
    return Status::invalid_argument("model: n_layer {} at n_embd {} is {:.3g} parameters, past the {:.3g} Strata takes",
                                    n_layer, n_embd, static_cast<double>(params), static_cast<double>(kMaxParams));
  }
  return Status::ok();
}

}  // namespace strata::engine
