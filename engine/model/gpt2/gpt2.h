// gpt2.h — the GPT-2 family: its blocks' forward and backward through a KernelSet, over the model runtime
// (engine/model/model.h), its initialisation and its tensor-parallel split.
//
// Units (docs/architecture.md "Data model"): "wte" (the token embedding wte (V,C) and position embedding wpe (maxT,C)),
// "h.0" … "h.{L-1}" (one per transformer block), and "ln_f" (the final layernorm). The LM head is tied to wte,
// so the embedding unit is used twice per step. Each unit's parameters live in one flat fp32 buffer in a
// canonical order (the order of scripts/make_gpt2_fixture.py); its gradients live in a second buffer of the
// same layout. Named tensors are TensorSpecs into those buffers.
//
// Pipeline stages (create(..., stage)): the model runs blocks [first, end) only, with the embedding when
// `embedding` (the first stage) and the final layernorm and tied LM head when `head` (the last stage). The
// stage's input and output are the residual stream (B,T,C); activation checkpoints are kept per slot.
//
// Tensor parallelism (create(..., tp) with a group of t > 1 ranks): Megatron-LM's split (gpt2_tensor_split).
// Every block's QKV and first MLP linear are column-parallel, its attention output and second MLP linear
// row-parallel (two all-reduces of (B,T,C) in forward, two in backward), heads are split across ranks, and the
// embedding and the tied LM head are vocab-parallel: each rank embeds only its vocabulary rows (one all-reduce)
// and computes only its columns of the logits; the cross-entropy combines the ranks' per-row log-sum-exps and
// target logits (2BT floats gathered), so the full logits are never gathered.
//
// Sequence parallelism (create(..., sequence_parallel = true), with tensor parallelism): Megatron-LM's option
// for the layernorm regions. The residual stream (the layernorms, the residual adds, the stage's input and output)
// is cut by rows: each rank keeps B*T/t of the B*T rows (rows [r*B*T/t, (r+1)*B*T/t) of the flattened (B*T, C)),
// so those activations take 1/t of the memory. A column-parallel linear's input is all-gathered from the ranks'
// rows, a row-parallel linear's partial output reduce-scattered back to them (the same bytes as the all-reduce
// it replaces), and the layernorms' weight and bias gradients, partial over each rank's rows, are summed over
// the group. B*T must divide by t.
//
// Activations are sized for (B, T) at the first forward and re-allocated only when B*T grows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/check.h"
#include "common/rng.h"
#include "common/status.h"
#include "common/tensor.h"
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
  static constexpr int kMaxLayers = 4096;           // the largest published models have ~130
  static constexpr int kMaxWidth = 1 << 17;         // 131072; Llama 3 405B's is 16384
  static constexpr int kMaxPositions = 1 << 22;     // 4M tokens of context
  static constexpr int kMaxVocab = 1 << 22;         // the largest published vocabularies have ~256K tokens
  static constexpr int64_t kMaxParams = int64_t{1} << 42;  // 4.4 trillion
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

class GPT2;

// GPT-2's initial weights: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, layernorm
// weights 1, drawn in the order of the units and their elements (a WeightsInit, model.h).
class GPT2Init : public WeightsInit {
 public:
  GPT2Init(const GPT2& model, uint64_t seed);
  Status fill(size_t unit, size_t offset, std::span<float> dst) override;

 private:
  // Draws and drops the random numbers of unit unit_'s elements [at_, end) (what fill skips).
  void skip_to(size_t end);

  const GPT2& model_;
  Rng rng_;
  double residual_std_;
  size_t unit_ = 0, at_ = 0;  // the next element to make
};

class GPT2 : public Model {
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

  // Model (model.h). forward: T <= block_size, token ids < vocab_size (the data loader checks this; here it is
  // an assertion); without targets only the logits are valid. backward overwrites the logits. The residual
  // stream is (B,T,C), or this rank's rows of it under sequence parallelism.
  Status reserve_activations(int B, int T) override { return ensure_activations(B, T); }
  Result<float> forward(const int32_t* inputs, const int32_t* targets, int B, int T) override;
  [[nodiscard]] Status backward(float loss_scale = 1.0f) override;
  Result<float> forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B,
                              int T) override;
  [[nodiscard]] Status backward_stage(const float* dy, float loss_scale) override;
  const float* stage_output() const override;
  const float* stage_input_grad() const override;
  size_t residual_floats(int B, int T) const override {
    return rows_here(B * T) * static_cast<size_t>(config_.n_embd);
  }
  std::unique_ptr<WeightsInit> initial_weights(uint64_t seed) const override;  // GPT2Init
  double flops_per_step(int B, int T) const override;
  // PaLM's N leaves out the position embedding.
  double palm_flops_per_step(int B, int T) const override;

  const GPT2Config& config() const { return config_; }
  // (B,T,V) after forward, device memory; under tensor parallelism (B,T,Vr): this rank's vocabulary columns only.
  // fp32 where the backend keeps them so (classifier_logits_bytes: the CPU backends; CUDA under fp32 matmuls).
  const float* logits() const {
    STRATA_ASSERT_MSG(k_->classifier_logits_bytes(last_B_ * last_T_, static_cast<int>(vocab_.count), precision_) ==
                          static_cast<size_t>(last_B_) * last_T_ * vocab_.count * sizeof(float),
                      "this backend keeps the logits in another form than fp32");
    return acts_.logits;
  }

 private:
  GPT2(const GPT2Config& config, kernels::Device& device, kernels::MatmulPrecision precision)
      : Model(device, precision, "gpt2"), config_(config) {}
  void select_slot(int i) override {
    if (!slot_acts_.empty()) acts_ = slot_acts_[i];
  }
  Status ensure_activations(int B, int T);
  // with_loss: the targets are on the device, and the classifier computes the losses and lse too.
  Status forward_units(int B, int T, bool with_loss);
  Status backward_blocks(int B, int T);
  [[nodiscard]] Status block_forward(int l, const offload::UnitView& unit, const float* residual, int B, int T);
  [[nodiscard]] Status block_backward(int l, const offload::UnitView& unit, const float* residual, float* dres, int B,
                                      int T);
  // Rows of the residual stream on this rank out of N = B*T (sequence parallelism: N/t).
  size_t rows_here(int N) const { return static_cast<size_t>(sp_ ? N / tp_size_ : N); }
  // The (B*T, C) input of a column-parallel linear from this rank's rows (`rows_floats` of them): the ranks'
  // rows gathered into the scratch grads_.full under sequence parallelism, else the rows themselves.
  Result<const float*> gather_rows(const float* rows, size_t rows_floats);
  // The same for a hidden activation (kernels.h) of Nr rows and `width` columns, in the backend's form.
  Result<const void*> gather_hidden_rows(const void* rows, int Nr, int width);
  // Where a row-parallel linear (or the embedding) writes its partial (B*T, C) sum that belongs in `out`:
  // grads_.full under sequence parallelism, else `out`.
  float* partial_for(float* out) const { return sp_ ? grads_.full : out; }
  // Completes it over the group: reduce-scattered into this rank's rows `out` (sequence parallelism), or
  // all-reduced in place (partial == out). Nothing without tensor parallelism.
  [[nodiscard]] Status reduce_rows(float* partial, float* out, size_t rows_floats);
  // layernorm_backward over this rank's `rows`; under sequence parallelism its weight and bias gradients are
  // partial sums over them, summed over the group before they are added to dweight and dbias.
  [[nodiscard]] Status layernorm_backward_rows(float* dinp, float* dweight, float* dbias, const float* dout,
                                               const float* inp, const float* weight, const float* mean,
                                               const float* rstd, int rows);
  // The cross-entropy over the ranks' columns (tensor parallelism): from each rank's losses and lse (this rank's
  // in host_scratch_ and acts_.lse), each row's loss over the whole vocabulary into host_scratch_, and the whole
  // vocabulary's lse into acts_.lse for backward.
  Status combine_vocab_parallel_losses(const int32_t* targets, int N);

  // Which layer slot of the per-layer activations block l uses, and where its output (the next block's
  // input) is, given B*T*C.
  size_t act_layer(int l) const { return checkpointing_ == ActivationCheckpointing::kNone ? l - stage_.first : 0; }
  // Bytes of one (N, width) hidden activation in the backend's form (kernels.h), and layer `a`'s in an array of
  // them; by default of the MLP's width.
  size_t hidden_bytes(int N, int width) const { return k_->hidden_bytes(N, width, precision_); }
  void* hidden_layer(float* array, size_t a, int N, int width) const {
    return reinterpret_cast<std::byte*>(array) + a * hidden_bytes(N, width);
  }
  void* hidden_layer(float* array, size_t a, int N) const { return hidden_layer(array, a, N, mlp_width_); }
  float* block_output(int l, size_t BTC) const {
    return acts_.residual3 + (checkpointing_ == ActivationCheckpointing::kHost ? l % 2 : l - stage_.first) * BTC;
  }
  // kHost: where block l's output is kept for the current slot (blocks first .. end-2 of the stage).
  float* host_checkpoint(int l, size_t BTC) const {
    const size_t per_slot = static_cast<size_t>(stage_.end - stage_.first - 1);
    return host_checkpoints_.as<float>() + (static_cast<size_t>(slot_) * per_slot + (l - stage_.first)) * BTC;
  }

  // Tensor views of block l, given its unit's parameter or gradient base.
  struct BlockParams {
    float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
  };
  BlockParams block_params(int l, const float* base) const;

  GPT2Config config_;
  // This rank's widths under tensor parallelism: attention (C/t, over NH/t heads), MLP hidden (4C/t) and
  // vocabulary rows.
  int attn_width_ = 0, heads_ = 0, mlp_width_ = 0;
  RowSlice vocab_;
  bool sp_ = false;  // sequence parallelism (with tensor parallelism only)

  // Activations of the last forward, llm.c-style, per layer l where marked (L, ...). Under sequence
  // parallelism the arrays of the residual stream (encoded, ln*, attproj, residual*, fcproj, lnf) hold this
  // rank's rows only.
  struct Activations {
    float* encoded;    // (B,T,C)
    float* ln1;        // (L,B,T,C) hidden
    float* ln1_mean;   // (L,B,T)
    float* ln1_rstd;   // (L,B,T)
    float* qkv;        // (L,B,T,3C) hidden
    float* atty;       // (L,B,T,C) hidden
    float* att;        // (L,B,NH,T,T)
    float* attproj;    // (L,B,T,C)
    float* residual2;  // (L,B,T,C)
    float* ln2;        // (L,B,T,C) hidden
    float* ln2_mean;   // (L,B,T)
    float* ln2_rstd;   // (L,B,T)
    float* fch;        // (L,B,T,4C) hidden (kernels.h: the backend's form; hidden_layer() finds a layer's)
    float* fch_gelu;   // (L,B,T,4C) hidden
    float* fcproj;     // (L,B,T,C)
    float* residual3;  // (L,B,T,C)
    float* lnf;        // (B,T,C) hidden
    float* lnf_mean;   // (B,T)
    float* lnf_rstd;   // (B,T)
    float* logits;     // (B,T,V)
    float* losses;     // (B,T)
    float* lse;        // (B,T)
    float* dlosses;    // (B,T)
    int32_t* inputs;   // (B,T) copy of the last batch
    int32_t* targets;  // (B,T)
  } acts_{};
  // Gradients of one block's intermediate activations, reused by every layer in backward.
  struct BlockGrads {
    float* dres;       // (B,T,C) the residual stream's gradient
    float* dln;        // (B,T,C) dln1 / dln2 / dlnf
    float* datty;      // (B,T,C) hidden
    float* dqkv;       // (B,T,3C) hidden
    float* dfch;       // (B,T,4C) hidden
    float* dfch_gelu;  // (B,T,4C) hidden
    // Sequence parallelism only (empty otherwise):
    float* dln_rows;   // this rank's rows of dln, reduce-scattered
    float* full;       // (B,T,C) the ranks' rows gathered, or a partial sum before its reduce-scatter
    float* ln_grads;   // (2C) a layernorm's weight and bias gradients over this rank's rows
  } grads_{};
  kernels::DeviceBuffer act_buffer_;
  std::vector<Activations> slot_acts_;  // one set per slot; acts_ is the current one
  offload::PinnedBuffer host_checkpoints_;  // kHost: (L-1, B, T, C) block outputs 0..L-2
  std::vector<float> host_scratch_;  // losses read back, dlosses written, on their way across
  std::vector<float> tp_scratch_;    // combine_vocab_parallel_losses's gathered losses and lse
  size_t act_capacity_bt_ = 0;  // B*T the buffer was sized for
  // Per slot: whether a backward may follow its last forward (the head's stage: it had targets), and how many
  // targets it counted.
  std::vector<char> ready_for_backward_ = std::vector<char>(1, 0);
  std::vector<int> num_counted_targets_ = std::vector<int>(1, 0);
};

}  // namespace strata::engine
