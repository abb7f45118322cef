// decoder.h — the decoder-only transformer every family in engine/model/ is: an embedding, blocks on a residual
// stream, a final norm and an LM head with its cross-entropy. This class, over the model runtime (model.h), runs
// all of it but the blocks' insides: the stage's inputs and outputs, the embedding (a token table, and a
// position table where the family has one), the final norm (layernorm or RMSNorm), the head (tied to the
// embedding's token table or a unit of its own) and the loss, the activations and their slots, activation
// checkpointing, and the tensor- and sequence-parallel plumbing the blocks call. A family (gpt2/, llama/)
// supplies its blocks' forward and backward, the activations they keep, its initial weights and FLOP counts.
//
// Units, in forward order (unit.h roles): the embedding (unit 0; its token table is tensor 0, (V,C)), blocks
// 1 .. L, the final norm (L+1: weight, then bias for a layernorm), and an untied head (L+2: (V,C)) where the
// family has one.
//
// Pipeline stages: blocks [first, end) only, with the embedding on the first stage and the final norm, the head
// and the loss on the last. The stage's input and output are the residual stream (B,T,C); activation
// checkpoints are kept per slot.
//
// Tensor parallelism (a group of t > 1 ranks): the embedding and the head are vocab-parallel — each rank embeds
// only its vocabulary rows (one all-reduce) and computes only its columns of the logits; the cross-entropy
// combines the ranks' per-row log-sum-exps and target logits (2BT floats gathered), so the full logits are never
// gathered. The blocks split as their family says (Megatron-LM's column- and row-parallel linears).
//
// Sequence parallelism (with tensor parallelism): Megatron-LM's option for the norm regions. The residual stream
// (the norms, the residual adds, the stage's input and output) is cut by rows: each rank keeps B*T/t of the B*T
// rows (rows [r*B*T/t, (r+1)*B*T/t) of the flattened (B*T, C)), so those activations take 1/t of the memory. A
// column-parallel linear's input is all-gathered from the ranks' rows (gather_rows), a row-parallel linear's
// partial output reduce-scattered back to them (reduce_rows: the same bytes as the all-reduce it replaces), and
// the norms' weight gradients, partial over each rank's rows, are summed over the group. B*T must divide by t.
//
// Activations are sized for (B, T) at the first forward and re-allocated only when B*T grows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/model/model.h"
#include "engine/model/unit.h"
#include "engine/model/unit_split.h"
#include "kernels/device.h"
#include "kernels/kernels.h"
#include "offload/coordinator.h"
#include "offload/pinned_pool.h"

namespace strata::engine {

// A family's norm: GPT-2's layernorm (weight and bias; eps 1e-5, the kernels'), or the Llama family's RMSNorm
// (weight only) with its eps.
enum class NormKind : uint8_t { kLayerNorm, kRMSNorm };

// What the decoder runtime needs of a family's sizes.
struct DecoderShape {
  int width = 0;         // C, the residual stream's
  int vocab = 0;         // V
  int layers = 0;        // L
  int context = 0;       // the longest sequence the model takes
  const char* context_key = "";  // the config key of `context`, for errors ("model.block_size")
  NormKind norm = NormKind::kLayerNorm;
  float norm_eps = 1e-5f;  // kRMSNorm's (the layernorm kernels' is 1e-5)
  bool positions = false;  // the embedding's tensor 1 is a position table (maxT,C), added to the tokens'

  // The bounds every family's config is checked against before anything is allocated or looped over (so 10^6
  // layers is an error at once, not a hang).
  static constexpr int kMaxLayers = 4096;                  // the largest published models have ~130
  static constexpr int kMaxWidth = 1 << 17;                // 131072; Llama 3 405B's is 16384
  static constexpr int kMaxPositions = 1 << 22;            // 4M tokens of context
  static constexpr int kMaxVocab = 1 << 22;                // the largest published vocabularies have ~256K tokens
  static constexpr int64_t kMaxParams = int64_t{1} << 42;  // 4.4 trillion
};

class Decoder : public Model {
 public:
  // Model (model.h). forward: T <= the context, token ids < V (the data loader checks this; here it is an
  // assertion); without targets only the logits are valid. backward overwrites the logits. The residual stream
  // is (B,T,C), or this rank's rows of it under sequence parallelism.
  Status reserve_activations(int B, int T) override { return ensure_activations(B, T); }
  Result<float> forward(const int32_t* inputs, const int32_t* targets, int B, int T) override;
  [[nodiscard]] Status backward(float loss_scale = 1.0f) override;
  Result<float> forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B,
                              int T) override;
  [[nodiscard]] Status backward_stage(const float* dy, float loss_scale) override;
  const float* stage_output() const override;
  const float* stage_input_grad() const override { return grads_.dres; }
  size_t residual_floats(int B, int T) const override {
    return rows_here(B * T) * static_cast<size_t>(shape_.width);
  }

  // (B,T,V) after forward, device memory; under tensor parallelism (B,T,Vr): this rank's vocabulary columns only.
  // fp32 where the backend keeps them so (classifier_logits_bytes: the CPU backends; CUDA under fp32 matmuls).
  const float* logits() const;

 protected:
  Decoder(kernels::Device& device, kernels::MatmulPrecision precision, std::string family)
      : Model(device, precision, std::move(family)) {}

  // A family's create(config, device, precision) on a "cpu" device with the given CPU KernelSet, owned by the model.
  template <typename Family, typename Config>
  static Result<std::unique_ptr<Family>> create_on_cpu(const Config& config, const kernels::KernelSet& cpu_kernels,
                                                       kernels::MatmulPrecision precision) {
    std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(cpu_kernels);
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Family> m, Family::create(config, *device, precision));
    m->owned_device_ = std::move(device);
    return m;
  }

  // Places the model and adds the family's units (model.h place, add_unit), after checking the stage against the
  // layers and that every tensor-parallel rank has vocabulary rows.
  Status build(const DecoderShape& shape, bool offloaded, PipelineStage stage, comm::Communicator* tp,
               bool sequence_parallel, std::vector<UnitSpec> specs,
               const std::function<TensorSplit(const std::string& name)>& split);

  // ---- What the family supplies.

  // The floats of each array the family's blocks keep per layer for a backward (one set per layer of the stage,
  // or one with checkpointing, per slot), and of each scratch array its backward shares across layers, at (B,T).
  // layer_act(k, a) and scratch(k) find them.
  virtual std::vector<size_t> layer_activation_floats(int B, int T) const = 0;
  virtual std::vector<size_t> block_scratch_floats(int B, int T) const = 0;
  // Block l over `residual` (this rank's rows) into `out`, with unit view `unit`; its activations in layer slot
  // act_layer(l).
  [[nodiscard]] virtual Status block_forward(int l, const offload::UnitView& unit, const float* residual,
                                             float* out, int B, int T) = 0;
  // Its backward after block_forward: `dres`, the gradient of its output, becomes that of its input (the
  // residual adds pass it through; the branches add into it), and the unit's gradients are added into.
  [[nodiscard]] virtual Status block_backward(int l, const offload::UnitView& unit, const float* residual,
                                              float* dres, int B, int T) = 0;

  // ---- What the blocks call.

  // Array k of the family's per-layer activations for layer slot a, of the current slot; scratch array k.
  float* layer_act(size_t k, size_t a) const { return layer_base_[k] + a * layer_floats_[k]; }
  float* scratch(size_t k) const { return scratch_base_[k]; }
  // Which layer slot of the per-layer activations block l uses.
  size_t act_layer(int l) const { return checkpointing_ == ActivationCheckpointing::kNone ? l - stage_.first : 0; }
  // Floats of one (N, width) hidden activation in the backend's form (kernels.h).
  size_t hidden_floats(int N, int width) const { return (k_->hidden_bytes(N, width, precision_) + 3) / 4; }
  // Rows of the residual stream on this rank out of N = B*T (sequence parallelism: N/t).
  size_t rows_here(int N) const { return static_cast<size_t>(sp_ ? N / tp_size_ : N); }
  // The (B*T, C) input of a column-parallel linear from this rank's rows (`rows_floats` of them): the ranks' rows
  // gathered into a scratch under sequence parallelism, else the rows themselves.
  Result<const float*> gather_rows(const float* rows, size_t rows_floats);
  // The same for a hidden activation (kernels.h) of Nr rows and `width` columns (at most C), in the backend's form.
  Result<const void*> gather_hidden_rows(const void* rows, int Nr, int width);
  // Where a row-parallel linear (or the embedding) writes its partial (B*T, C) sum that belongs in `out`: a
  // scratch under sequence parallelism, else `out`.
  float* partial_for(float* out) const { return sp_ ? grads_.full : out; }
  // Completes it over the group: reduce-scattered into this rank's rows `out` (sequence parallelism), or
  // all-reduced in place (partial == out). Nothing without tensor parallelism.
  [[nodiscard]] Status reduce_rows(float* partial, float* out, size_t rows_floats);
  // The (B*T, C) scratch a column-parallel linear's input gradient is written to, and where its sum over the
  // group lands (reduce_rows(dln(), dln_rows(), ...)): this rank's rows of it.
  float* dln() const { return grads_.dln; }
  float* dln_rows() const { return sp_ ? grads_.dln_rows : grads_.dln; }
  // The family's norm over `rows` rows of width C: out hidden; mean (layernorm only) and rstd saved. `bias` is
  // the layernorm's (unused by RMSNorm).
  void norm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                    int rows) const;
  // res = inp1 + inp2, then norm_forward of res (fused where the backend can).
  void residual_norm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1, const float* inp2,
                             const float* weight, const float* bias, int rows) const;
  // The norm's backward over this rank's rows: dinp +=, dweight (and dbias, layernorm) +=; under sequence
  // parallelism the weight gradients, partial over the rows, are summed over the group before they are added.
  [[nodiscard]] Status norm_backward_rows(float* dinp, float* dweight, float* dbias, const float* dout,
                                          const float* inp, const float* weight, const float* mean,
                                          const float* rstd, int rows);
  // The linear weight at `w`, a tensor of `unit`'s parameters, with its working copy where the unit has one.
  static kernels::Weight linear_weight(const offload::UnitView& unit, const float* w) {
    if (unit.params16 == nullptr) return kernels::Weight(w);
    return kernels::Weight(w, unit.params16 + (w - unit.params));
  }

  const DecoderShape& shape() const { return shape_; }
  RowSlice vocab_;   // this rank's vocabulary rows (all of them without tensor parallelism)
  bool sp_ = false;  // sequence parallelism (with tensor parallelism only)

 private:
  void select_slot(int i) override;
  Status ensure_activations(int B, int T);
  // with_loss: the targets are on the device, and the classifier computes the losses and lse too.
  Status forward_units(int B, int T, bool with_loss);
  Status backward_blocks(int B, int T);
  // The cross-entropy over the ranks' columns (tensor parallelism): from each rank's losses and lse (this rank's
  // in host_scratch_ and acts_.lse), each row's loss over the whole vocabulary into host_scratch_, and the whole
  // vocabulary's lse into acts_.lse for backward.
  Status combine_vocab_parallel_losses(const int32_t* targets, int N);
  // The units the runtime runs: the final norm's, and the head's (the embedding's where it is tied).
  size_t final_norm_unit() const { return static_cast<size_t>(shape_.layers) + 1; }
  size_t head_unit() const { return tied_ ? 0 : static_cast<size_t>(shape_.layers) + 2; }
  // Where block l's output is: every block's kept (they are the checkpoints), or two alternating ones when the
  // checkpoints live in host memory.
  float* block_output(int l, size_t RC) const {
    return acts_.block_out + (checkpointing_ == ActivationCheckpointing::kHost ? l % 2 : l - stage_.first) * RC;
  }
  // kHost: where block l's output is kept for the current slot (blocks first .. end-2 of the stage).
  float* host_checkpoint(int l, size_t RC) const {
    const size_t per_slot = static_cast<size_t>(stage_.end - stage_.first - 1);
    return host_checkpoints_.as<float>() + (static_cast<size_t>(slot_) * per_slot + (l - stage_.first)) * RC;
  }

  DecoderShape shape_;
  bool tied_ = true;  // the head is the embedding's token table
  // The runtime's activations of one slot, llm.c-style. Under sequence parallelism the residual stream's
  // (encoded, block_out, normf) hold this rank's rows only.
  struct Activations {
    float* encoded;     // (B,T,C) the embedding's output: the first block's input
    float* block_out;   // (L or 2, B,T,C) the blocks' outputs
    float* normf;       // (B,T,C) hidden: the final norm's output
    float* normf_mean;  // (B,T) layernorm only
    float* normf_rstd;  // (B,T)
    float* logits;      // (B,T,V) in the classifier's form
    float* losses;      // (B,T)
    float* lse;         // (B,T)
    float* dlosses;     // (B,T)
    int32_t* inputs;    // (B,T) copy of the last batch
    int32_t* targets;   // (B,T)
  } acts_{};
  // The gradients' scratch every block reuses in backward.
  struct Grads {
    float* dres;       // (B,T,C) the residual stream's gradient
    float* dln;        // (B,T,C) a norm's output gradient
    // Sequence parallelism only (empty otherwise):
    float* dln_rows;   // this rank's rows of dln, reduce-scattered
    float* full;       // (B,T,C) the ranks' rows gathered, or a partial sum before its reduce-scatter
    float* norm_grads;  // (2C) a norm's weight (and bias) gradients over this rank's rows
  } grads_{};
  // Per slot: the runtime's activations and the bases of the family's per-layer arrays.
  struct Slot {
    Activations acts;
    std::vector<float*> layers;
  };
  std::vector<Slot> slots_acts_;
  std::vector<float*> layer_base_, scratch_base_;  // the current slot's, and the shared scratch
  std::vector<size_t> layer_floats_;              // one layer's floats of each per-layer array
  kernels::DeviceBuffer act_buffer_;
  offload::PinnedBuffer host_checkpoints_;  // kHost: (L-1, B, T, C) block outputs 0..L-2, per slot
  std::vector<float> host_scratch_;  // losses read back, dlosses written, on their way across
  std::vector<float> tp_scratch_;    // combine_vocab_parallel_losses's gathered losses and lse
  // Per slot: whether a backward may follow its last forward (the head's stage: it had targets), and how many
  // targets it counted.
  std::vector<char> ready_for_backward_ = std::vector<char>(1, 0);
  std::vector<int> num_counted_targets_ = std::vector<int>(1, 0);
};

}  // namespace strata::engine
