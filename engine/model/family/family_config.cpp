// The model section (family.h): reading it, and what its family decides with nothing allocated.
#include "engine/model/family/family.h"

#include <filesystem>
#include <map>
#include <string>

#include <fmt/format.h>

namespace strata::engine {

const char* model_family_name(ModelFamily f) { return f == ModelFamily::kLlama ? "llama" : "gpt2"; }

const char* ModelConfig::context_key() const {
  return llama_family() ? "model.max_position_embeddings" : "model.block_size";
}

Status ModelConfig::validate() const { return llama_family() ? llama.validate() : gpt2.validate(); }

Status ModelConfig::check_tensor_parallel(int t) const {
  auto divides = [t](const char* key, int v) -> Status {
    if (v % t == 0) return Status::ok();
    return Status::invalid_argument("model.{} ({}) must be divisible by parallel.tensor_parallel_size ({})", key, v,
                                    t);
  };
  if (!llama_family()) return divides("n_head", gpt2.n_head);  // each tensor-parallel rank takes whole heads
  STRATA_RETURN_IF_ERROR(divides("num_attention_heads", llama.num_attention_heads));
  STRATA_RETURN_IF_ERROR(divides("num_key_value_heads", llama.num_key_value_heads));
  return divides("intermediate_size", llama.intermediate_size);
}

std::vector<UnitSpec> ModelConfig::unit_specs() const {
  return llama_family() ? llama_unit_specs(llama) : gpt2_unit_specs(gpt2);
}

PipelineCosts ModelConfig::pipeline_costs(int seq_len) const {
  return llama_family() ? llama_pipeline_costs(llama, seq_len) : gpt2_pipeline_costs(gpt2, seq_len);
}

std::string ModelConfig::describe() const {
  if (!llama_family()) {
    return fmt::format("gpt2 n_layer={} n_head={} n_embd={} vocab={} block_size={}", gpt2.n_layer, gpt2.n_head,
                       gpt2.n_embd, gpt2.vocab_size, gpt2.block_size);
  }
  const LlamaConfig& c = llama;
  return fmt::format("{} layers={} hidden={} intermediate={} heads={}/{} head_dim={} vocab={} context={}{}",
                     c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
                     c.num_key_value_heads, c.head_size(), c.vocab_size, c.max_position_embeddings,
                     c.tie_word_embeddings ? " tied" : "");
}

Status read_model_section(JsonSection* m, ModelConfig* c) {
  std::string family = model_family_name(c->family);
  STRATA_RETURN_IF_ERROR(m->get_string("family", &family));
  if (family == "gpt2") {
    c->family = ModelFamily::kGPT2;
    STRATA_RETURN_IF_ERROR(m->get_int("n_layer", &c->gpt2.n_layer));
    STRATA_RETURN_IF_ERROR(m->get_int("n_head", &c->gpt2.n_head));
    STRATA_RETURN_IF_ERROR(m->get_int("n_embd", &c->gpt2.n_embd));
    STRATA_RETURN_IF_ERROR(m->get_int("vocab_size", &c->gpt2.vocab_size));
    return m->get_int("block_size", &c->gpt2.block_size);
  }
  if (family == "llama") {
    c->family = ModelFamily::kLlama;
    return read_llama_keys(m, &c->llama);
  }
  return Status::invalid_argument("{}: \"{}\" is not a model family Strata trains (gpt2, llama)", m->qualified("family"),
                                  family);
}

Status read_model_section(JsonSection* m, const std::string& init_from, ModelConfig* c) {
  std::error_code ec;
  const std::filesystem::path config_json = std::filesystem::path(init_from) / "config.json";
  if (init_from.empty() || !std::filesystem::is_directory(init_from, ec) || !std::filesystem::exists(config_json, ec))
    return read_model_section(m, c);
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json hf_json, read_json_file(config_json.string()));
  const std::string type = hf_json.is_object() ? hf_json.value("model_type", "") : "";
  if (!llama_model_type(type)) return read_model_section(m, c);
  STRATA_ASSIGN_OR_RETURN(const LlamaConfig hf, read_hf_llama_config(config_json.string()));
  ModelConfig from_file;
  from_file.family = ModelFamily::kLlama;
  from_file.llama = hf;
  *c = from_file;
  STRATA_RETURN_IF_ERROR(read_model_section(m, c));
  if (!c->llama_family()) {
    return Status::invalid_argument("{} is {}, but training.init_from {} holds a {} model (its config.json)",
                                    m->qualified("family"), model_family_name(c->family), init_from, type);
  }
  const std::map<std::string, std::string> want = llama_metadata(hf), have = llama_metadata(c->llama);
  for (const auto& [key, value] : have) {
    auto it = want.find(key);
    const std::string theirs = it == want.end() ? "(unset)" : it->second;
    if (theirs != value) {
      return Status::invalid_argument("{} is {}, but {} says {}: the model section must agree with the weights it "
                                      "starts from (leave the key out to take the file's)",
                                      m->qualified(key.c_str()), value, config_json.string(), theirs);
    }
  }
  return Status::ok();
}

}  // namespace strata::engine
