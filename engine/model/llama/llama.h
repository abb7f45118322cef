// llama.h — the Llama family (Llama 3.x, Qwen2.5/3, Mistral): its blocks' forward and backward through a
// KernelSet, over the decoder runtime (engine/model/decoder.h), its initialisation and its tensor-parallel split.
// It follows transformers' modeling_llama.py, modeling_qwen2.py, modeling_qwen3.py and modeling_mistral.py, as
// scripts/llama_torch.py (the golden tests' model) does op for op:
//  - pre-norm blocks, x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)), RMSNorm with its
//    statistics in fp32;
//  - attention: q, k, v projections (biased with attention_bias, and Qwen2's always), QK-norm (Qwen3's per-head
//    RMSNorm of q and k) before RoPE in the rotate-half layout (llama3 frequency scaling with rope_scaling),
//    key/value heads shared by groups of query heads (GQA), causal softmax at scale head_dim^-0.5, o_proj
//    (biased with attention_bias);
//  - MLP: down(silu(gate(x)) * up(x)), no biases;
//  - the head: lm_head, or the embedding's matrix with tie_word_embeddings.
//
// Units, named by transformers' checkpoints so a Hugging Face folder maps onto them tensor for tensor:
// "embed_tokens" (model.embed_tokens.weight (V,C)), "layers.0" … "layers.{L-1}" (model.layers.l.*), "norm"
// (model.norm.weight) and, untied, "lm_head" (lm_head.weight (V,C)). In a block the q, k and v projections are
// adjacent (weights, then biases), so they are one (NH + 2 NKV) hs-wide linear, and so are gate and up (one
// 2F-wide linear whose output SwiGLU takes).
//
// Tensor parallelism (a group of t > 1 ranks): Megatron-LM's split, as GPT-2's — q, k, v, gate and up
// column-parallel (rank r takes its heads' rows, its key/value heads' and its hidden units'), o_proj and
// down_proj row-parallel; the norms (q_norm and k_norm too) and o_proj's bias replicated. The heads and the
// key/value heads must divide over the ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include <nlohmann/json.hpp>

#include "common/json_config.h"
#include "common/status.h"
#include "engine/model/decoder.h"
#include "engine/model/model.h"
#include "engine/model/unit.h"
#include "engine/model/unit_split.h"
#include "kernels/device.h"
#include "kernels/kernels.h"

namespace strata::engine {

// Whether transformers' model_type `t` is one of this family's: llama, mistral, qwen2, qwen3.
bool llama_model_type(const std::string& t);

// A Llama-family model's sizes, by the names of transformers' config.json.
struct LlamaConfig {
  std::string model_type = "llama";  // "llama", "mistral", "qwen2" (q/k/v biases) or "qwen3" (QK-norm)
  int hidden_size = 576;
  int intermediate_size = 1536;
  int num_hidden_layers = 6;
  int num_attention_heads = 9;
  int num_key_value_heads = 3;
  int head_dim = 0;  // 0: hidden_size / num_attention_heads (Qwen3 sets it apart from them)
  int vocab_size = 50257;
  int max_position_embeddings = 512;
  float rms_norm_eps = 1e-5f;
  double rope_theta = 10000.0;
  // rope_scaling with rope_type "llama3" (Llama 3.1/3.2's): the frequency bands past original_max_position_embeddings
  // / low_freq_factor are divided by `factor`, those under .../high_freq_factor kept, those between smoothed.
  struct RopeScaling {
    std::string rope_type;  // "" (none) or "llama3"
    double factor = 0, low_freq_factor = 0, high_freq_factor = 0;
    int original_max_position_embeddings = 0;
  } rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q, k, v and o_proj biases (Llama's and Qwen3's key)

  int head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  bool qkv_bias() const { return attention_bias || model_type == "qwen2"; }  // Qwen2 biases q, k, v always
  bool o_bias() const { return attention_bias; }
  bool qk_norm() const { return model_type == "qwen3"; }

  // Names the offending key: sizes that are not positive, heads that do not divide, an odd head size (RoPE
  // rotates pairs), an unknown model_type or rope_type, bounds past GPT2Config's (checked before anything is
  // allocated).
  Status validate() const;
};

// Reads a model section's keys (transformers' config.json names, and model_type) into `config`, leaving the
// defaults where a key is absent; a key of the wrong type is an error naming it. The caller's finish() refuses keys
// it did not read.
Status read_llama_keys(JsonSection* section, LlamaConfig* config);
// A Hugging Face model's config.json (a folder holding one, or the file): its keys as read_llama_keys reads them,
// with model_type one of the family's. Keys Strata has no use for (torch_dtype, bos_token_id, use_cache, …) are
// ignored; ones that would change the math in a way Strata does not compute are errors naming the key and value
// (hidden_act other than silu, mlp_bias, a sliding window in use, rope types other than llama3).
Result<LlamaConfig> read_hf_llama_config(const std::string& path);

// The units' names, whole layouts and roles for `config` (the order of the header above).
std::vector<UnitSpec> llama_unit_specs(const LlamaConfig& config);
// Forward FLOPs per token of a block and of the head, over sequences of `seq_len` tokens (the pipeline's balance).
PipelineCosts llama_pipeline_costs(const LlamaConfig& config, int seq_len);
// How tensor parallelism cuts tensor `name` (a transformers name; the header above).
TensorSplit llama_tensor_split(const std::string& name);
// The config as a checkpoint's metadata (Model::metadata): format "strata-llama" and every key of the model
// section (rope_scaling's as "rope_scaling.factor" ...), numbers written so they read back exactly.
std::map<std::string, std::string> llama_metadata(const LlamaConfig& config);
// Back: the config a file's metadata records (Corruption naming `what` and the key for a missing or malformed one).
Result<LlamaConfig> llama_config_from_metadata(const std::map<std::string, std::string>& metadata,
                                               const std::string& what);
// transformers' config.json for `config` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
// Qwen3ForCausalLM by model_type), its weights stored as `torch_dtype` ("float32", "bfloat16").
nlohmann::json hf_llama_config_json(const LlamaConfig& config, const std::string& torch_dtype);
// RoPE's tables (maxT, head_size/2) for positions 0 .. maxT-1, fp32, as transformers' LlamaRotaryEmbedding makes
// them: inv_freq = 1 / theta^(2i/d) in fp32 with the llama3 scaling where set, cos and sin of position * inv_freq.
void llama_rope_tables(const LlamaConfig& config, int maxT, std::vector<float>* cos, std::vector<float>* sin);

class Llama : public Decoder {
 public:
  // As GPT2::create (engine/model/gpt2/gpt2.h). A backend without the family's ops (CUDA, for now) is an error
  // naming it; heads or key/value heads that do not divide over `tp` are an error naming the keys.
  static Result<std::unique_ptr<Llama>> create(const LlamaConfig& config, kernels::Device& device,
                                               kernels::MatmulPrecision precision, bool offloaded = false,
                                               PipelineStage stage = {}, comm::Communicator* tp = nullptr,
                                               bool sequence_parallel = false);
  static Result<std::unique_ptr<Llama>> create(const LlamaConfig& config, const kernels::KernelSet& cpu_kernels,
                                               kernels::MatmulPrecision precision);

  // Weights N(0, 0.02) (transformers' initializer_range), biases 0, norm weights 1 (SeededInit).
  std::unique_ptr<WeightsInit> initial_weights(uint64_t seed) const override;
  double flops_per_step(int B, int T) const override;
  double palm_flops_per_step(int B, int T) const override;
  std::map<std::string, std::string> metadata() const override { return llama_metadata(config_); }

  const LlamaConfig& config() const { return config_; }

 private:
  Llama(const LlamaConfig& config, kernels::Device& device, kernels::MatmulPrecision precision)
      : Decoder(device, precision, "llama"), config_(config) {}

  std::vector<size_t> layer_activation_floats(int B, int T) const override;
  std::vector<size_t> block_scratch_floats(int B, int T) const override;
  [[nodiscard]] Status block_forward(int l, const offload::UnitView& unit, const float* residual, float* out, int B,
                                     int T) override;
  [[nodiscard]] Status block_backward(int l, const offload::UnitView& unit, const float* residual, float* dres,
                                      int B, int T) override;

  // The per-layer activations (layer_act): (B,T,C) arrays are this rank's rows under sequence parallelism,
  // "hidden" ones in the backend's form (kernels.h).
  enum LayerAct : size_t {
    kLn1,        // (B,T,C) hidden: input_layernorm's output
    kLn1Rstd,    // (B,T)
    kQkvRaw,     // (B,T,Q) hidden: the projections' output before QK-norm (QK-norm only; Q = (NH + 2 NKV) hs)
    kQkRstd,     // (B,T,NH+NKV) QK-norm's statistics (QK-norm only)
    kQkv,        // (B,T,Q) hidden: q and k normed and rotated, v; what attention reads
    kAtty,       // (B,T,NH hs) hidden
    kAtt,        // what attention saves for its backward
    kAttproj,    // (B,T,C)
    kResidual2,  // (B,T,C)
    kLn2,        // (B,T,C) hidden
    kLn2Rstd,    // (B,T)
    kGateUp,     // (B,T,2F) hidden: [gate | up]
    kSwiglu,     // (B,T,F) hidden: silu(gate) * up
    kMlpOut,     // (B,T,C)
    kLayerActs
  };
  enum Scratch : size_t {
    kDatty,    // (B,T,NH hs) hidden
    kDqkv,     // (B,T,Q) hidden
    kDswiglu,  // (B,T,F) hidden
    kDgateUp,  // (B,T,2F) hidden
    kDqkNorm,  // (2 hs) q_norm's and k_norm's gradients of this rank's heads (tensor parallelism)
    kScratch
  };

  // Tensor views of block l, given its unit's parameter or gradient base; biases and QK-norm weights null where
  // the config has none.
  struct BlockParams {
    float *ln1w, *qkvw, *qkvb, *qnormw, *knormw, *ow, *ob, *ln2w, *gateupw, *downw;
  };
  BlockParams block_params(const float* base) const;
  // Where each of BlockParams' tensors is in a block's layout (every block's is the same but for the names), found
  // once at create; kNone where the config has none.
  static constexpr size_t kNone = ~size_t{0};
  size_t block_offsets_[10] = {};

  LlamaConfig config_;
  // This rank's heads and widths under tensor parallelism: query and key/value heads, the attention's output
  // width (NH hs / t), qkv's (Q / t) and the MLP's hidden (F / t).
  int heads_ = 0, kv_heads_ = 0, attn_width_ = 0, qkv_width_ = 0, mlp_width_ = 0;
  kernels::DeviceBuffer rope_cos_, rope_sin_;  // (maxT, hs/2) fp32
};

}  // namespace strata::engine
