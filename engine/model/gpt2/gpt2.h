// gpt2.h — the GPT-2 family: its blocks' forward and backward through a KernelSet, over the decoder runtime
// (engine/model/decoder.h), its initialisation and its tensor-parallel split.
//
// Units (docs/architecture.md "Data model"): "wte" (the token embedding wte (V,C) and position embedding wpe (maxT,C)),
// "h.0" … "h.{L-1}" (one per transformer block), and "ln_f" (the final layernorm). The LM head is tied to wte,
// so the embedding unit is used twice per step. Each unit's parameters live in one flat fp32 buffer in a
// canonical order (the order of scripts/make_gpt2_fixture.py); its gradients live in a second buffer of the
// same layout. Named tensors are TensorSpecs into those buffers.
//
// Pipeline stages, the vocab-parallel embedding and head, and sequence parallelism are the decoder runtime's.
//
// Tensor parallelism (create(..., tp) with a group of t > 1 ranks): Megatron-LM's split (gpt2_tensor_split).
// Every block's QKV and first MLP linear are column-parallel, its attention output and second MLP linear
// row-parallel (two all-reduces of (B,T,C) in forward, two in backward; under sequence parallelism all-gathers
// and reduce-scatters instead), and heads are split across ranks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/check.h"
#include "common/rng.h"
#include "common/status.h"
#include "common/tensor.h"
#include "engine/model/decoder.h"
#include "engine/model/model.h"
#include "engine/model/unit.h"
#include "engine/model/unit_split.h"
#include "kernels/device.h"
#include "kernels/kernels.h"
#include "offload/coordinator.h"
#include "offload/pinned_pool.h"

namespace strata::engine {

struct GPT2Config {
  int n_layer = 6;
  int n_head = 6;
  int n_embd = 384;
  int vocab_size = 50257;
  int block_size = 256;  // longest context the position embedding covers

  // Names the offending field: sizes that are not positive, do not divide, or pass the bounds below (checked
  // before anything is allocated or looped over, so 10^6 layers is an error at once, not a hang).
  Status validate() const;
  static constexpr int kMaxLayers = DecoderShape::kMaxLayers;
  static constexpr int kMaxWidth = DecoderShape::kMaxWidth;
  static constexpr int kMaxPositions = DecoderShape::kMaxPositions;
  static constexpr int kMaxVocab = DecoderShape::kMaxVocab;
  static constexpr int64_t kMaxParams = DecoderShape::kMaxParams;
};

// The units' names, whole layouts (the tensors' canonical names, shapes and order) and roles for `config`: what
// every rank's units are slices of, checkpoints hold, and other projects' GPT-2 files are mapped onto
// (engine/checkpoint/foreign_weights.h). "wte" is the embedding and ties the head, "h.l" block l, "ln_f" the
// final norm.
std::vector<UnitSpec> gpt2_unit_specs(const GPT2Config& config);
// Forward FLOPs per token of a block and of the head, over sequences of `seq_len` tokens (the pipeline's balance).
PipelineCosts gpt2_pipeline_costs(const GPT2Config& config, int seq_len);

// How tensor parallelism cuts GPT-2's tensor `name` (a canonical name, e.g. "h.3.attn.c_attn.weight"; the
// arithmetic: engine/model/unit_split.h).
// Per tensor (Megatron-LM's column- and row-parallel linears):
//  - attn.c_attn (QKV, column-parallel): rank r takes heads [r*NH/t, (r+1)*NH/t) of each of q, k and v, weight
//    rows and bias alike, so its local QKV is an ordinary (3C/t)-wide one over NH/t heads;
//  - mlp.c_fc (column-parallel): rows [r*4C/t, (r+1)*4C/t) of weight and bias;
//  - attn.c_proj, mlp.c_proj (row-parallel): the weight's input columns of rank r's heads / hidden units; the bias
//    is replicated and added once, after the partial outputs are summed;
//  - wte (vocab-parallel embedding and LM head): rows [r*ceil(V/t), ...), the last rank's slice shorter when t does
//    not divide V;
//  - everything else (layernorms, wpe, row-parallel biases) replicated: every rank holds it whole and computes
//    the same gradient for it, so every rank applies the same update and the copies stay equal.
TensorSplit gpt2_tensor_split(const std::string& name);
// The config as a checkpoint's metadata (Model::metadata): format "strata-gpt2" and the five sizes.
std::map<std::string, std::string> gpt2_metadata(const GPT2Config& config);

class GPT2 : public Decoder {
 public:
  // Builds the units (zeroed) in `device`'s memory; the device must outlive the model. Call init_weights() or
  // load weights afterwards.
  // `tp`: the tensor-parallel group (null or a group of one: none); it must outlive the model. A model whose
  // heads do not divide over it is an error naming model.n_head and parallel.tensor_parallel_size.
  static Result<std::unique_ptr<GPT2>> create(const GPT2Config& config, kernels::Device& device,
                                              kernels::MatmulPrecision precision, bool offloaded = false,
                                              PipelineStage stage = {}, comm::Communicator* tp = nullptr,
                                              bool sequence_parallel = false);
  // The same on a "cpu" device with the given CPU KernelSet, owned by the model.
  static Result<std::unique_ptr<GPT2>> create(const GPT2Config& config, const kernels::KernelSet& cpu_kernels,
                                              kernels::MatmulPrecision precision);

  // Weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, layernorm weights 1 (SeededInit).
  std::unique_ptr<WeightsInit> initial_weights(uint64_t seed) const override;
  double flops_per_step(int B, int T) const override;
  // PaLM's N leaves out the position embedding.
  double palm_flops_per_step(int B, int T) const override;
  std::map<std::string, std::string> metadata() const override { return gpt2_metadata(config_); }

  const GPT2Config& config() const { return config_; }

 private:
  GPT2(const GPT2Config& config, kernels::Device& device, kernels::MatmulPrecision precision)
      : Decoder(device, precision, "gpt2"), config_(config) {}

  // Decoder (decoder.h). Under tensor parallelism the QKV and first MLP linear produce this rank's heads and
  // hidden units, the attention output and second MLP linear its partial sums of the (B,T,C) outputs, with the
  // bias added on rank 0 only, summed over the group.
  std::vector<size_t> layer_activation_floats(int B, int T) const override;
  std::vector<size_t> block_scratch_floats(int B, int T) const override;
  [[nodiscard]] Status block_forward(int l, const offload::UnitView& unit, const float* residual, float* out, int B,
                                     int T) override;
  [[nodiscard]] Status block_backward(int l, const offload::UnitView& unit, const float* residual, float* dres,
                                      int B, int T) override;

  // The per-layer activations (layer_act), llm.c's: (B,T,C) arrays are this rank's rows under sequence
  // parallelism, "hidden" ones in the backend's form (kernels.h).
  enum LayerAct : size_t {
    kLn1,        // (B,T,C) hidden
    kLn1Mean,    // (B,T)
    kLn1Rstd,    // (B,T)
    kQkv,        // (B,T,3C) hidden
    kAtty,       // (B,T,C) hidden
    kAtt,        // what attention saves for its backward (B,NH,T,T on the CPU)
    kAttproj,    // (B,T,C)
    kResidual2,  // (B,T,C)
    kLn2,        // (B,T,C) hidden
    kLn2Mean,    // (B,T)
    kLn2Rstd,    // (B,T)
    kFch,        // (B,T,4C) hidden
    kFchGelu,    // (B,T,4C) hidden
    kFcproj,     // (B,T,C)
    kLayerActs
  };
  // The block gradients' scratch (scratch), reused by every layer in backward.
  enum Scratch : size_t {
    kDatty,     // (B,T,C) hidden
    kDqkv,      // (B,T,3C) hidden
    kDfch,      // (B,T,4C) hidden
    kDfchGelu,  // (B,T,4C) hidden
    kScratch
  };

  // Tensor views of block l, given its unit's parameter or gradient base.
  struct BlockParams {
    float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
  };
  BlockParams block_params(int l, const float* base) const;

  GPT2Config config_;
  // This rank's widths under tensor parallelism: attention (C/t, over NH/t heads) and MLP hidden (4C/t).
  int attn_width_ = 0, heads_ = 0, mlp_width_ = 0;
};

}  // namespace strata::engine
