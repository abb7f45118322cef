// gpt2_config.cpp — what a GPT-2's sizes decide, with nothing allocated: their bounds, its units' layouts, and
// how tensor parallelism cuts its tensors.
#include "engine/model/gpt2/gpt2.h"

namespace strata::engine {

std::vector<UnitSpec> gpt2_unit_specs(const GPT2Config& config) {
  const int64_t C = config.n_embd, V = config.vocab_size, maxT = config.block_size;
  std::vector<UnitSpec> units;
  FlatLayout emb;
  emb.add("wte", {V, C});
  emb.add("wpe", {maxT, C});
  units.push_back({.name = "wte", .layout = std::move(emb), .role = UnitRole::kEmbedding, .ties_head = true});
  for (int l = 0; l < config.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    FlatLayout b;
    b.add(h + "ln_1.weight", {C});
    b.add(h + "ln_1.bias", {C});
    b.add(h + "attn.c_attn.weight", {3 * C, C});
    b.add(h + "attn.c_attn.bias", {3 * C});
    b.add(h + "attn.c_proj.weight", {C, C});
    b.add(h + "attn.c_proj.bias", {C});
    b.add(h + "ln_2.weight", {C});
    b.add(h + "ln_2.bias", {C});
    b.add(h + "mlp.c_fc.weight", {4 * C, C});
    b.add(h + "mlp.c_fc.bias", {4 * C});
    b.add(h + "mlp.c_proj.weight", {C, 4 * C});
    b.add(h + "mlp.c_proj.bias", {C});
    units.push_back({.name = "h." + std::to_string(l), .layout = std::move(b), .role = UnitRole::kBlock, .block = l});
  }
  FlatLayout lnf;
  lnf.add("ln_f.weight", {C});
  lnf.add("ln_f.bias", {C});
  units.push_back({.name = "ln_f", .layout = std::move(lnf), .role = UnitRole::kFinalNorm});
  return units;
}

PipelineCosts gpt2_pipeline_costs(const GPT2Config& config, int seq_len) {
  // A block's linears 24C^2 and attention 2C(T+1); the tied head's 2CV (the final layernorm's is nothing beside).
  const double C = config.n_embd;
  return {.block = 24.0 * C * C + 2.0 * C * (seq_len + 1.0), .head = 2.0 * C * config.vocab_size};
}

Status GPT2Config::validate() const {
  auto in_range = [](const char* name, int v, int max) -> Status {
    if (v <= 0) return Status::invalid_argument("model.{} must be a positive integer, got {}", name, v);
    if (v > max) return Status::invalid_argument("model.{} is {}, past the {} Strata takes", name, v, max);
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(in_range("n_layer", n_layer, kMaxLayers));
  STRATA_RETURN_IF_ERROR(in_range("n_embd", n_embd, kMaxWidth));
  STRATA_RETURN_IF_ERROR(in_range("n_head", n_head, n_embd));
  STRATA_RETURN_IF_ERROR(in_range("vocab_size", vocab_size, kMaxVocab));
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

std::map<std::string, std::string> gpt2_metadata(const GPT2Config& c) {
  return {{"format", "strata-gpt2"},
          {"n_layer", std::to_string(c.n_layer)},
          {"n_head", std::to_string(c.n_head)},
          {"n_embd", std::to_string(c.n_embd)},
          {"vocab_size", std::to_string(c.vocab_size)},
          {"block_size", std::to_string(c.block_size)}};
}

TensorSplit gpt2_tensor_split(const std::string& name) {
  auto ends = [&](const char* suffix) { return name.ends_with(suffix); };
  if (name == "wte") return {TensorSplit::kRows, 1};
  if (ends("attn.c_attn.weight") || ends("attn.c_attn.bias")) return {TensorSplit::kRows, 3};
  if (ends("mlp.c_fc.weight") || ends("mlp.c_fc.bias")) return {TensorSplit::kRows, 1};
  if (ends("attn.c_proj.weight") || ends("mlp.c_proj.weight")) return {TensorSplit::kColumns, 1};
  return {};  // layernorms, wpe, the row-parallel biases
}

}  // namespace strata::engine
