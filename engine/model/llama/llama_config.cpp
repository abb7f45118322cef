// llama_config.cpp — what a Llama-family model's sizes decide, with nothing allocated: their bounds, its units'
// layouts, how tensor parallelism cuts its tensors, and RoPE's tables.
#include <cmath>
#include <filesystem>
#include <iterator>
#include <numbers>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/model/llama/llama.h"

namespace strata::engine {

bool llama_model_type(const std::string& t) { return t == "llama" || t == "mistral" || t == "qwen2" || t == "qwen3"; }

Status LlamaConfig::validate() const {
  auto in_range = [](const char* name, int v, int max) -> Status {
    if (v <= 0) return Status::invalid_argument("model.{} must be a positive integer, got {}", name, v);
    if (v > max) return Status::invalid_argument("model.{} is {}, past the {} Strata takes", name, v, max);
    return Status::ok();
  };
  if (!llama_model_type(model_type))
    return Status::invalid_argument("model.model_type \"{}\" is not one of llama, mistral, qwen2, qwen3", model_type);
  STRATA_RETURN_IF_ERROR(in_range("num_hidden_layers", num_hidden_layers, DecoderShape::kMaxLayers));
  STRATA_RETURN_IF_ERROR(in_range("hidden_size", hidden_size, DecoderShape::kMaxWidth));
  STRATA_RETURN_IF_ERROR(in_range("intermediate_size", intermediate_size, 8 * DecoderShape::kMaxWidth));
  STRATA_RETURN_IF_ERROR(in_range("num_attention_heads", num_attention_heads, hidden_size));
  STRATA_RETURN_IF_ERROR(in_range("num_key_value_heads", num_key_value_heads, num_attention_heads));
  STRATA_RETURN_IF_ERROR(in_range("vocab_size", vocab_size, DecoderShape::kMaxVocab));
  STRATA_RETURN_IF_ERROR(in_range("max_position_embeddings", max_position_embeddings, DecoderShape::kMaxPositions));
  if (head_dim < 0) return Status::invalid_argument("model.head_dim must be positive (or 0: hidden_size / heads), got {}", head_dim);
  if (head_dim == 0 && hidden_size % num_attention_heads != 0)
    return Status::invalid_argument("model.hidden_size ({}) must be divisible by model.num_attention_heads ({}), or "
                                    "model.head_dim set",
                                    hidden_size, num_attention_heads);
  STRATA_RETURN_IF_ERROR(in_range("head_dim", head_size(), DecoderShape::kMaxWidth));
  if (head_size() % 2 != 0)
    return Status::invalid_argument("model.head_dim ({}) must be even: RoPE rotates pairs of elements", head_size());
  if (num_attention_heads % num_key_value_heads != 0)
    return Status::invalid_argument(
        "model.num_attention_heads ({}) must be divisible by model.num_key_value_heads ({}): each key/value head "
        "serves a whole group of query heads",
        num_attention_heads, num_key_value_heads);
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps))
    return Status::invalid_argument("model.rms_norm_eps must be a positive number, got {}", rms_norm_eps);
  if (!(rope_theta > 1.0) || !std::isfinite(rope_theta))
    return Status::invalid_argument("model.rope_theta must be a number above 1, got {}", rope_theta);
  const RopeScaling& s = rope_scaling;
  if (!s.rope_type.empty()) {
    if (s.rope_type != "llama3")
      return Status::invalid_argument("model.rope_scaling.rope_type \"{}\" is not supported (only \"llama3\")",
                                      s.rope_type);
    if (!(s.factor >= 1.0))
      return Status::invalid_argument("model.rope_scaling.factor must be at least 1, got {}", s.factor);
    if (!(s.low_freq_factor > 0.0) || !(s.high_freq_factor > s.low_freq_factor))
      return Status::invalid_argument(
          "model.rope_scaling: high_freq_factor ({}) must be above low_freq_factor ({}), both positive",
          s.high_freq_factor, s.low_freq_factor);
    if (s.original_max_position_embeddings <= 0)
      return Status::invalid_argument("model.rope_scaling.original_max_position_embeddings must be positive, got {}",
                                      s.original_max_position_embeddings);
  }
  // Every factor is bounded above, so this cannot overflow.
  const int64_t C = hidden_size, F = intermediate_size, hs = head_size();
  const int64_t Q = (int64_t{num_attention_heads} + 2 * num_key_value_heads) * hs;
  const int64_t block = 2 * C + C * Q + int64_t{num_attention_heads} * hs * C + 3 * C * F + Q + C + 2 * hs;
  const int64_t params = (tie_word_embeddings ? 1 : 2) * int64_t{vocab_size} * C + num_hidden_layers * block + C;
  if (params > DecoderShape::kMaxParams) {
    return Status::invalid_argument(
        "model: num_hidden_layers {} at hidden_size {} is {:.3g} parameters, past the {:.3g} Strata takes",
        num_hidden_layers, hidden_size, static_cast<double>(params), static_cast<double>(DecoderShape::kMaxParams));
  }
  return Status::ok();
}

Status read_llama_keys(JsonSection* m, LlamaConfig* c) {
  STRATA_RETURN_IF_ERROR(m->get_string("model_type", &c->model_type));
  STRATA_RETURN_IF_ERROR(m->get_int("hidden_size", &c->hidden_size));
  STRATA_RETURN_IF_ERROR(m->get_int("intermediate_size", &c->intermediate_size));
  STRATA_RETURN_IF_ERROR(m->get_int("num_hidden_layers", &c->num_hidden_layers));
  STRATA_RETURN_IF_ERROR(m->get_int("num_attention_heads", &c->num_attention_heads));
  STRATA_RETURN_IF_ERROR(m->get_int("num_key_value_heads", &c->num_key_value_heads));
  STRATA_RETURN_IF_ERROR(m->get_int("head_dim", &c->head_dim));
  STRATA_RETURN_IF_ERROR(m->get_int("vocab_size", &c->vocab_size));
  STRATA_RETURN_IF_ERROR(m->get_int("max_position_embeddings", &c->max_position_embeddings));
  STRATA_RETURN_IF_ERROR(m->get_double("rms_norm_eps", &c->rms_norm_eps));
  STRATA_RETURN_IF_ERROR(m->get_double("rope_theta", &c->rope_theta));
  STRATA_RETURN_IF_ERROR(m->get_bool("tie_word_embeddings", &c->tie_word_embeddings));
  STRATA_RETURN_IF_ERROR(m->get_bool("attention_bias", &c->attention_bias));
  JsonSection r = m->section("rope_scaling");
  if (r.present()) {
    LlamaConfig::RopeScaling& s = c->rope_scaling;
    STRATA_RETURN_IF_ERROR(r.get_string("rope_type", &s.rope_type));
    if (s.rope_type.empty()) STRATA_RETURN_IF_ERROR(r.get_string("type", &s.rope_type));  // transformers' older key
    STRATA_RETURN_IF_ERROR(r.get_double("factor", &s.factor));
    STRATA_RETURN_IF_ERROR(r.get_double("low_freq_factor", &s.low_freq_factor));
    STRATA_RETURN_IF_ERROR(r.get_double("high_freq_factor", &s.high_freq_factor));
    STRATA_RETURN_IF_ERROR(r.get_int("original_max_position_embeddings", &s.original_max_position_embeddings));
    STRATA_RETURN_IF_ERROR(r.finish());
  }
  return Status::ok();
}

Result<LlamaConfig> read_hf_llama_config(const std::string& path) {
  const std::string file = std::filesystem::is_directory(path) ? path + "/config.json" : path;
  STRATA_ASSIGN_OR_RETURN(nlohmann::json j, read_json_file(file));
  if (!j.is_object()) return Status::invalid_argument("{}: a model's config.json is a JSON object", file);
  if (!j.contains("model_type"))
    return Status::invalid_argument("{}: no model_type (a Hugging Face config.json names one: llama, qwen2, ...)",
                                    file);
  // What would change the math in a way this family does not compute.
  auto refuse = [&](const char* key, auto is_fine, const char* what) -> Status {
    if (j.contains(key) && !j[key].is_null() && !is_fine(j[key]))
      return Status::unimplemented("{}: {} = {} is not supported ({})", file, key, j[key].dump(), what);
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(refuse("hidden_act", [](const nlohmann::json& v) { return v == "silu"; },
                                "the MLP is SwiGLU, silu(gate) * up"));
  STRATA_RETURN_IF_ERROR(refuse("mlp_bias", [](const nlohmann::json& v) { return v == false; },
                                "the MLP's projections have no biases"));
  STRATA_RETURN_IF_ERROR(refuse("use_sliding_window", [](const nlohmann::json& v) { return v == false; },
                                "attention is over the whole causal context"));
  if (j.value("model_type", "") == "mistral")  // Mistral's sliding_window applies whenever it is set
    STRATA_RETURN_IF_ERROR(refuse("sliding_window", [](const nlohmann::json&) { return false; },
                                  "attention is over the whole causal context"));
  // read_llama_keys reads its keys and this section is never finished: the rest of a config.json is transformers'
  // business. rope_scaling's own section is, so other rope types' keys leave it first (the type is refused by name).
  nlohmann::json model = j;
  if (model.contains("rope_scaling") && model["rope_scaling"].is_object()) {
    nlohmann::json& r = model["rope_scaling"];
    for (auto it = r.begin(); it != r.end();) {  // keys of other rope types than llama3's
      const std::string k = it.key();
      const bool known = k == "rope_type" || k == "type" || k == "factor" || k == "low_freq_factor" ||
                         k == "high_freq_factor" || k == "original_max_position_embeddings";
      it = known ? std::next(it) : r.erase(it);
    }
  }
  LlamaConfig c;
  // transformers' defaults where a config.json leaves a key out (LlamaConfig's __init__).
  c.num_key_value_heads = 0;
  c.rms_norm_eps = 1e-6f;
  c.tie_word_embeddings = false;
  JsonSection m(&model, file, "");
  STRATA_RETURN_IF_ERROR(read_llama_keys(&m, &c));
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;  // transformers: MHA
  STRATA_RETURN_IF_ERROR(c.validate().with_context(file));
  return c;
}

std::vector<UnitSpec> llama_unit_specs(const LlamaConfig& c) {
  const int64_t C = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, hs = c.head_size();
  const int64_t NH = c.num_attention_heads, NKV = c.num_key_value_heads;
  std::vector<UnitSpec> units;
  FlatLayout emb;
  emb.add("model.embed_tokens.weight", {V, C});
  units.push_back({.name = "embed_tokens",
                   .layout = std::move(emb),
                   .role = UnitRole::kEmbedding,
                   .ties_head = c.tie_word_embeddings});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    FlatLayout b;
    b.add(p + "input_layernorm.weight", {C});
    b.add(p + "self_attn.q_proj.weight", {NH * hs, C});  // q, k, v adjacent: one linear
    b.add(p + "self_attn.k_proj.weight", {NKV * hs, C});
    b.add(p + "self_attn.v_proj.weight", {NKV * hs, C});
    if (c.qkv_bias()) {
      b.add(p + "self_attn.q_proj.bias", {NH * hs});
      b.add(p + "self_attn.k_proj.bias", {NKV * hs});
      b.add(p + "self_attn.v_proj.bias", {NKV * hs});
    }
    if (c.qk_norm()) {
      b.add(p + "self_attn.q_norm.weight", {hs});
      b.add(p + "self_attn.k_norm.weight", {hs});
    }
    b.add(p + "self_attn.o_proj.weight", {C, NH * hs});
    if (c.o_bias()) b.add(p + "self_attn.o_proj.bias", {C});
    b.add(p + "post_attention_layernorm.weight", {C});
    b.add(p + "mlp.gate_proj.weight", {F, C});  // gate and up adjacent: one linear
    b.add(p + "mlp.up_proj.weight", {F, C});
    b.add(p + "mlp.down_proj.weight", {C, F});
    units.push_back(
        {.name = "layers." + std::to_string(l), .layout = std::move(b), .role = UnitRole::kBlock, .block = l});
  }
  FlatLayout norm;
  norm.add("model.norm.weight", {C});
  units.push_back({.name = "norm", .layout = std::move(norm), .role = UnitRole::kFinalNorm});
  if (!c.tie_word_embeddings) {
    FlatLayout head;
    head.add("lm_head.weight", {V, C});
    units.push_back({.name = "lm_head", .layout = std::move(head), .role = UnitRole::kHead});
  }
  return units;
}

std::map<std::string, std::string> llama_metadata(const LlamaConfig& c) {
  auto num = [](double v) { return fmt::format("{}", v); };  // the shortest text that reads back as v
  std::map<std::string, std::string> m = {
      {"format", "strata-llama"},
      {"model_type", c.model_type},
      {"hidden_size", std::to_string(c.hidden_size)},
      {"intermediate_size", std::to_string(c.intermediate_size)},
      {"num_hidden_layers", std::to_string(c.num_hidden_layers)},
      {"num_attention_heads", std::to_string(c.num_attention_heads)},
      {"num_key_value_heads", std::to_string(c.num_key_value_heads)},
      {"head_dim", std::to_string(c.head_size())},
      {"vocab_size", std::to_string(c.vocab_size)},
      {"max_position_embeddings", std::to_string(c.max_position_embeddings)},
      {"rms_norm_eps", fmt::format("{}", c.rms_norm_eps)},
      {"rope_theta", num(c.rope_theta)},
      {"tie_word_embeddings", c.tie_word_embeddings ? "true" : "false"},
      {"attention_bias", c.attention_bias ? "true" : "false"},
  };
  if (!c.rope_scaling.rope_type.empty()) {
    m["rope_scaling.rope_type"] = c.rope_scaling.rope_type;
    m["rope_scaling.factor"] = num(c.rope_scaling.factor);
    m["rope_scaling.low_freq_factor"] = num(c.rope_scaling.low_freq_factor);
    m["rope_scaling.high_freq_factor"] = num(c.rope_scaling.high_freq_factor);
    m["rope_scaling.original_max_position_embeddings"] = std::to_string(c.rope_scaling.original_max_position_embeddings);
  }
  return m;
}

Result<LlamaConfig> llama_config_from_metadata(const std::map<std::string, std::string>& md, const std::string& what) {
  // The metadata as the JSON model section it was written from, read by read_llama_keys.
  nlohmann::json m = nlohmann::json::object(), rope = nlohmann::json::object();
  const std::map<std::string, std::string> keys = llama_metadata(LlamaConfig{.rope_scaling = {.rope_type = "llama3"}});
  for (const auto& [key, value] : md) {
    if (key == "format" || keys.count(key) == 0) continue;  // the file's other metadata (its checksums)
    nlohmann::json& to = key.starts_with("rope_scaling.") ? rope[key.substr(13)] : m[key];
    if (key == "model_type" || key == "rope_scaling.rope_type") {
      to = value;
    } else if (value == "true" || value == "false") {
      to = value == "true";
    } else {
      const nlohmann::json number = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
      if (!number.is_number())
        return Status::corruption("{}: __metadata__ {} is '{:.40}', not a number", what, key, value);
      to = number;
    }
  }
  if (!rope.empty()) m["rope_scaling"] = rope;
  LlamaConfig c;
  JsonSection section(&m, what + " (__metadata__)", "");
  STRATA_RETURN_IF_ERROR(read_llama_keys(&section, &c));
  STRATA_RETURN_IF_ERROR(section.finish());
  STRATA_RETURN_IF_ERROR(c.validate().with_context(what));
  return c;
}

nlohmann::json hf_llama_config_json(const LlamaConfig& c, const std::string& torch_dtype) {
  const char* architecture = c.model_type == "qwen3"     ? "Qwen3ForCausalLM"
                             : c.model_type == "qwen2"   ? "Qwen2ForCausalLM"
                             : c.model_type == "mistral" ? "MistralForCausalLM"
                                                         : "LlamaForCausalLM";
  nlohmann::json j = {{"architectures", {architecture}},
                      {"model_type", c.model_type},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"head_dim", c.head_size()},
                      {"vocab_size", c.vocab_size},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", nullptr},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"attention_bias", c.attention_bias},
                      {"attention_dropout", 0.0},
                      {"hidden_act", "silu"},
                      {"initializer_range", 0.02},
                      {"use_cache", true},
                      {"torch_dtype", torch_dtype}};
  if (c.model_type == "llama") j["mlp_bias"] = false;
  if (c.model_type == "qwen2" || c.model_type == "qwen3" || c.model_type == "mistral") j["sliding_window"] = nullptr;
  if (c.model_type == "qwen2" || c.model_type == "qwen3") j["use_sliding_window"] = false;
  if (!c.rope_scaling.rope_type.empty()) {
    j["rope_scaling"] = {{"rope_type", c.rope_scaling.rope_type},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  }
  return j;
}

PipelineCosts llama_pipeline_costs(const LlamaConfig& c, int seq_len) {
  const double C = c.hidden_size, F = c.intermediate_size, hs = c.head_size();
  const double A = c.num_attention_heads * hs, Q = (c.num_attention_heads + 2.0 * c.num_key_value_heads) * hs;
  return {.block = 2.0 * (C * Q + A * C + 3.0 * C * F) + 2.0 * A * (seq_len + 1.0),
          .head = 2.0 * C * c.vocab_size};
}

TensorSplit llama_tensor_split(const std::string& name) {
  auto ends = [&](const char* suffix) { return name.ends_with(suffix); };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {TensorSplit::kRows, 1};
  for (const char* column : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                             "v_proj.bias", "gate_proj.weight", "up_proj.weight"})
    if (ends(column)) return {TensorSplit::kRows, 1};
  if (ends("o_proj.weight") || ends("down_proj.weight")) return {TensorSplit::kColumns, 1};
  return {};  // the norms, q_norm and k_norm, o_proj's bias
}

void llama_rope_tables(const LlamaConfig& c, int maxT, std::vector<float>* cos, std::vector<float>* sin) {
  // In fp32, op for op as transformers' _compute_default_rope_parameters and _compute_llama3_parameters.
  const int d = c.head_size(), half = d / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(d);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(c.rope_theta), e);
  }
  const LlamaConfig::RopeScaling& s = c.rope_scaling;
  if (s.rope_type == "llama3") {
    const float factor = static_cast<float>(s.factor), low = static_cast<float>(s.low_freq_factor);
    const float high = static_cast<float>(s.high_freq_factor);
    const float old = static_cast<float>(s.original_max_position_embeddings);
    const float low_freq_wavelen = old / low, high_freq_wavelen = old / high;
    for (float& f : inv) {
      const float wavelen = static_cast<float>(2.0 * std::numbers::pi) / f;
      const float scaled = wavelen > low_freq_wavelen ? f / factor : f;
      const float smooth = (old / wavelen - low) / (high - low);
      const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      f = medium ? smoothed : scaled;
    }
  }
  cos->resize(static_cast<size_t>(maxT) * half);
  sin->resize(cos->size());
  for (int t = 0; t < maxT; ++t)
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(t) * inv[static_cast<size_t>(i)];
      (*cos)[static_cast<size_t>(t) * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      (*sin)[static_cast<size_t>(t) * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
}

}  // namespace strata::engine
