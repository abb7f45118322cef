// family.h — the model families Strata trains, as the rest of the engine sees them: a run's model section names
// one (model.family: "gpt2", the default, or "llama"), and this reads its keys, builds the model, and answers
// what the session, the pipeline plan and the data loader ask of it without knowing which family it is.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/json_config.h"
#include "common/status.h"
#include "engine/model/decoder.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/model/llama/llama.h"
#include "engine/model/unit.h"
#include "kernels/device.h"
#include "kernels/kernels.h"

namespace strata::engine {

enum class ModelFamily : uint8_t { kGPT2, kLlama };

// "gpt2", "llama"; and back (InvalidArgument naming the key and the families).
const char* model_family_name(ModelFamily f);

// A run's model section: the family and its config (the other family's is unused).
struct ModelConfig {
  ModelFamily family = ModelFamily::kGPT2;
  GPT2Config gpt2;
  LlamaConfig llama;

  bool llama_family() const { return family == ModelFamily::kLlama; }
  int layers() const { return llama_family() ? llama.num_hidden_layers : gpt2.n_layer; }
  int context() const { return llama_family() ? llama.max_position_embeddings : gpt2.block_size; }
  int vocab_size() const { return llama_family() ? llama.vocab_size : gpt2.vocab_size; }
  // The model section's key of the context ("model.block_size", "model.max_position_embeddings").
  const char* context_key() const;
  Status validate() const;
  // That the model's heads, key/value heads and widths divide over `t` tensor-parallel ranks, naming the key.
  Status check_tensor_parallel(int t) const;
  std::vector<UnitSpec> unit_specs() const;
  PipelineCosts pipeline_costs(int seq_len) const;
  // One line for the log: the family and its sizes.
  std::string describe() const;
};

// Reads a model section: "family", then that family's keys (GPT-2's n_layer, n_head, n_embd, vocab_size,
// block_size; the Llama family's transformers names, llama.h read_llama_keys). The caller's finish() refuses the
// rest, so another family's key is an error naming it.
Status read_model_section(JsonSection* section, ModelConfig* config);
// The same for a run whose training.init_from is `init_from`: where that names a Hugging Face model folder whose
// config.json is the Llama family's (model_type llama, mistral, qwen2, qwen3), that config.json fills the model
// section (family llama; read_hf_llama_config), and a key the section sets that disagrees with it is an error
// naming the key, both values and the file. Anything else: read_model_section.
Status read_model_section(JsonSection* section, const std::string& init_from, ModelConfig* config);

// Builds the family's model (GPT2::create, Llama::create; the arguments as there).
Result<std::unique_ptr<Decoder>> create_model(const ModelConfig& config, kernels::Device& device,
                                              kernels::MatmulPrecision precision, bool offloaded = false,
                                              PipelineStage stage = {}, comm::Communicator* tp = nullptr,
                                              bool sequence_parallel = false);

}  // namespace strata::engine
