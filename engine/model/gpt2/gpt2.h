// gpt2.h — the GPT-2 model as units over flat buffers, with forward and backward through a KernelSet.
//
// Units (docs/architecture.md "Data model"): "wte" (the token embedding wte (V,C) and position embedding wpe (maxT,C)),
// "h.0" … "h.{L-1}" (one per transformer block), and "ln_f" (the final layernorm). The LM head is tied to wte,
// so the embedding unit is used twice per step. Each unit's parameters live in one flat fp32 buffer in a
// canonical order (the order of scripts/make_gpt2_fixture.py); its gradients live in a second buffer of the
// same layout. Named tensors are TensorSpecs into those buffers.
//
// Parameters, gradients and activations live in the memory of the model's Device (kernels/device.h): host
// memory on "cpu", GPU memory on "cuda", where the host must not dereference them (p(), g() and logits() are
// device pointers; use Device::copy_to_host). Token ids come in as host arrays and are copied over.
//
// Offloaded (create(..., offloaded = true) then set_coordinator()): the units hold no buffers; an
// offload::Coordinator places their parameters and gradients, and the model brackets each use of a unit with
// its acquire/release. read_params/write_params and zero_grads work the same either way.
//
// Pipeline stages (create(..., stage)): the model runs blocks [first, end) only, with the embedding when
// `embedding` (the first stage) and the final layernorm and tied LM head when `head` (the last stage); the
// units of other stages hold no buffers (holds(u) is false: their reads and writes are skipped, so
// init_gpt2 gives a stage exactly the full model's values for its units). forward_stage takes the stage's
// input activations (B,T,C) from the previous stage and leaves stage_output(); backward_stage takes the
// output's gradient from the next stage and leaves stage_input_grad(). Several micro-batches can be in flight
// at once: set_activation_slots(n) keeps n sets of activations, use_slot(i) picks one (a micro-batch's
// forward and backward use the same slot); activation checkpoints are kept per slot too.
//
// Tensor parallelism (create(..., tp) with a group of t > 1 ranks): Megatron-LM's split (engine/model/unit_split.h).
// Each rank's units hold its slices (units()[u].layout); every block's QKV and first MLP linear are
// column-parallel, its attention output and second MLP linear row-parallel (two all-reduces of (B,T,C) in
// forward, two in backward), heads are split across ranks, and the embedding and the tied LM head are
// vocab-parallel: each rank embeds only its vocabulary rows (one all-reduce) and computes only its columns of
// the logits; the cross-entropy combines the ranks' per-row log-sum-exps and target logits (2BT floats
// gathered), so the full logits are never gathered. Every rank of the group runs every forward and backward
// together; read_params is collective over it, and read_params/write_params and checkpoints see whole tensors
// (whole_layout), so checkpoints do not depend on t.
//
// Sequence parallelism (create(..., sequence_parallel = true), with tensor parallelism): Megatron-LM's option
// for the layernorm regions. The residual stream (the layernorms, the residual adds, the stage's input and output)
// is cut by rows: each rank keeps B*T/t of the B*T rows (rows [r*B*T/t, (r+1)*B*T/t) of the flattened (B*T, C)),
// so those activations take 1/t of the memory. A column-parallel linear's input is all-gathered from the ranks'
// rows, a row-parallel linear's partial output reduce-scattered back to them (the same bytes as the all-reduce
// it replaces), and the layernorms' weight and bias gradients, partial over each rank's rows, are summed over
// the group. B*T must divide by t.
//
// Threading: a GPT2 is used by one thread at a time; kernels parallelise inside each op. Activations are sized
// for (B, T) at the first forward and re-allocated only when B*T grows.
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

// Activation checkpointing per block: keep only each block's input and recompute the block in backward
// (kDevice), with the inputs held in host memory between forward and backward (kHost). The recomputed
// activations are bitwise the forward's, so training results do not change.
enum class ActivationCheckpointing : uint8_t { kNone, kDevice, kHost };

class GPT2;

// GPT-2's initial weights (init_gpt2's), made in the order of the model's units and of their elements: init_gpt2
// takes them a whole unit at a time, a load through the optimizer (engine/checkpoint/checkpoint.h init_model) a
// piece at a time. Pieces come in order (a piece before the end of the last one given is an error); what lies
// between is drawn and dropped, so every element has the value init_gpt2 gives it. Whole tensors, as
// whole_layout(u).
class GPT2Init {
 public:
  GPT2Init(const GPT2& model, uint64_t seed);
  // Elements [offset, offset + dst.size()) of unit `unit`.
  Status fill(size_t unit, size_t offset, std::span<float> dst);

 private:
  // Draws and drops the random numbers of unit unit_'s elements [at_, end) (what fill skips).
  void skip_to(size_t end);

  const GPT2& model_;
  Rng rng_;
  double residual_std_;
  size_t unit_ = 0, at_ = 0;  // the next element to make
};

class GPT2 {
 public:
  // Builds the units (zeroed) in `device`'s memory; the device must outlive the model. Call init_gpt2() or
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

  // For an offloaded model: the coordinator of its units (built from units(), same order; it must outlive
  // the model's use).
  void set_coordinator(offload::Coordinator* c) {
    coordinator_ = c;
    tell_coordinator_working_copies();
  }
  // Called in backward as soon as a unit's gradient is complete for this backward (after its last release):
  // units L+1, L, ..., 1, then 0 (the tied embedding is added to last). The offloaded optimizer starts the
  // unit's update from it in the step's last micro-batch.
  void set_on_grads_done(std::function<void(size_t unit)> fn) { on_grads_done_ = std::move(fn); }
  offload::Coordinator* coordinator() const { return coordinator_; }
  // An offloaded model, before set_coordinator(): the units marked stay on the device whole, their parameters
  // and gradients in device buffers of their own (named as a model's that is not offloaded; zeros until
  // written), outside the coordinator, which must then be told they are not present; their optimizer state
  // stays on the device too (offload_optimizer.ratio, OffloadedAdamW). Once.
  Status keep_on_device(const std::vector<bool>& units);
  // Whether unit u is one keep_on_device() kept, and whether any is.
  bool on_device(size_t u) const { return u < on_device_.size() && on_device_[u]; }
  bool any_on_device() const { return std::find(on_device_.begin(), on_device_.end(), true) != on_device_.end(); }

  // Before the first forward. kHost takes the checkpoints' host memory from `host_pool` (which must outlive
  // the model).
  void set_activation_checkpointing(ActivationCheckpointing mode, offload::PinnedPool* host_pool = nullptr) {
    STRATA_ASSERT(last_B_ == 0 && (mode != ActivationCheckpointing::kHost || host_pool != nullptr));
    checkpointing_ = mode;
    host_pool_ = host_pool;
  }

  // Under kBF16, whether each unit keeps a bf16 working copy of its parameters in device memory (2 bytes a
  // parameter, allocated at the unit's first use, named "gpt2.params16 <unit>"), which its linears take as their
  // bf16 weights (kernels.h Weight): made once after each change of the parameters (an optimizer step, a load)
  // where each linear would otherwise round its weight in every forward, backward and recompute of every
  // micro-batch. The results are bitwise the same either way. On by default; kept only where the backend uses
  // them (KernelSet::weights_to_bf16), for the units the model holds and, with a coordinator, for the units on
  // the device for good (Coordinator::set_working_copies: the optimizer offloaded, the parameters not). Once a
  // copy does not fit the device budget, no more are made (one warning), and the linears of the units without
  // one round as before.
  void set_working_copies(bool on) {
    working_copies_ = on;
    tell_coordinator_working_copies();
  }
  bool keeps_working_copies() const {
    if (!wants_working_copies()) return false;
    if (coordinator_ == nullptr) return !offloaded_;
    return coordinator_->working_copies() || any_on_device();
  }
  // How many working copies the model made since it was created, not counting the coordinator's (tests: that
  // they are remade after each change, and only then).
  uint64_t working_copies_made() const { return working_copies_made_; }

  // Allocates the activations for (B, T) now rather than at the first forward, so a device budget too small
  // for them fails before anything else is written (the trainer calls it before initialising the weights).
  Status reserve_activations(int B, int T) { return ensure_activations(B, T); }

  // GPT-2 initialisation, seeded: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0,
  // layernorm weights 1.
  Status init_gpt2(uint64_t seed);

  // Unit u's parameters to or from host memory (whole_layout(u)), wherever they live. Under tensor parallelism
  // read_params gathers the ranks' slices (collective over the group: every rank reads the same units in the
  // same order) and write_params takes this rank's slices of the whole tensors.
  Status read_params(size_t u, float* host) const;
  Status write_params(size_t u, const float* host);
  // The whole unit's layout (the checkpoints' tensors); units()[u].layout under tensor parallelism is this
  // rank's slices of it.
  const FlatLayout& whole_layout(size_t u) const {
    return tp_ != nullptr ? splits_[u].whole() : units_[u].layout;
  }
  // Tensor parallelism: this rank's slices of unit u (units()[u].layout) to the whole unit, gathered over the
  // group (collective), and the whole unit to this rank's slices. Without it, copies.
  Status gather_whole(size_t u, const float* local, float* whole) const;
  void slice_whole(size_t u, const float* whole, float* local) const;
  bool tensor_parallel() const { return tp_ != nullptr; }
  // This rank's shares of the units' gradient norm (engine/model/unit_split.h); inactive without tensor
  // parallelism.
  const NormShares& norm_shares() const { return norm_shares_; }

  // Forward over inputs (B,T) token ids. With targets (B,T) (entries < 0 ignored) it computes the mean loss
  // over the counted targets and returns it; without, it returns 0 and only logits are valid. T <= block_size.
  // Token ids must be < vocab_size (the data loader checks this; here it is an assertion).
  Result<float> forward(const int32_t* inputs, const int32_t* targets, int B, int T);

  // Backward of the last forward (which must have had targets). Adds this batch's gradients, scaled by
  // `loss_scale` (1/grad_accum_steps for gradient accumulation), into every unit's grads. Overwrites the logits.
  // Fails only when offloaded state cannot be brought in (an I/O error, a device budget below the working set).
  [[nodiscard]] Status backward(float loss_scale = 1.0f);

  // Pipeline stages. forward_stage: `inputs` (B,T) token ids for the embedding stage (else unused), `x_in`
  // (B,T,C) activations in device memory for the others, `targets` for the head stage (whose loss it returns;
  // 0 elsewhere). backward_stage: `dy` (B,T,C) gradient of stage_output() in device memory for stages without
  // the head (ignored with it), in the current slot, after its forward_stage. Both copy what they take.
  Result<float> forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B, int T);
  [[nodiscard]] Status backward_stage(const float* dy, float loss_scale);
  const float* stage_output() const;      // (B,T,C) device memory, of the current slot's forward
  const float* stage_input_grad() const;  // (B,T,C) device memory, of the last backward_stage
  // Floats of the residual stream here for (B,T): B*T*C, or this rank's rows of it under sequence parallelism
  // (the stage's input and output, and their gradients).
  size_t residual_floats(int B, int T) const { return rows_here(B * T) * static_cast<size_t>(config_.n_embd); }
  // Before the first forward: n >= 1 activation sets (micro-batches in flight).
  void set_activation_slots(int n) {
    STRATA_ASSERT(last_B_ == 0 && n >= 1);
    slots_ = n;
  }
  void use_slot(int i) {
    STRATA_ASSERT(i >= 0 && i < slots_);
    slot_ = i;
    if (!slot_acts_.empty()) acts_ = slot_acts_[i];
  }
  const PipelineStage& stage() const { return stage_; }
  // Each forward starts a step of the coordinator's access trace, unless the caller marks steps itself (a
  // pipeline's step interleaves several micro-batches' forwards and backwards: the step is the schedule).
  void set_marks_steps(bool on) { marks_steps_ = on; }
  void begin_step() {
    if (coordinator_ != nullptr) coordinator_->begin_step();
  }
  // Where read_params gets the units this stage does not hold (the first stage receives them from theirs
  // while it writes a checkpoint: engine/parallel/pipeline.h). Unset: reading one is an error.
  void set_params_source(std::function<Status(size_t unit, float* host)> fn) { params_source_ = std::move(fn); }
  bool holds(size_t u) const { return stage_.holds(units_[u]); }  // whether this stage runs (and stores) unit u

  [[nodiscard]] Status zero_grads();

  const GPT2Config& config() const { return config_; }
  std::vector<Unit>& units() { return units_; }
  const std::vector<Unit>& units() const { return units_; }
  size_t num_params() const;        // this rank's (its tensor-parallel slices of its stage's units)
  size_t whole_num_params() const;  // the whole model's
  // (B,T,V) after forward, device memory; under tensor parallelism (B,T,Vr): this rank's vocabulary columns only.
  // fp32 where the backend keeps them so (classifier_logits_bytes: the CPU backends; CUDA under fp32 matmuls).
  const float* logits() const {
    STRATA_ASSERT_MSG(k_->classifier_logits_bytes(last_B_ * last_T_, static_cast<int>(vocab_.count), precision_) ==
                          static_cast<size_t>(last_B_) * last_T_ * vocab_.count * sizeof(float),
                      "this backend keeps the logits in another form than fp32");
    return acts_.logits;
  }
  const kernels::KernelSet& kernels() const { return *k_; }
  kernels::Device& device() const { return *device_; }
  // FLOPs of one forward+backward over B*T tokens (matmuls and attention; the rest is memory-bound), counting
  // causal attention's products as executed (each query against (T+1)/2 keys on average).
  double flops_per_step(int B, int T) const;
  // The same by PaLM's count (appendix B), which nanoGPT and Megatron-LM report utilisation by: 6N + 12·L·C·T a
  // token, N the parameters but the position embedding, attention counted as if every query saw all T keys.
  double palm_flops_per_step(int B, int T) const;

 private:
  GPT2(const GPT2Config& config, kernels::Device& device, kernels::MatmulPrecision precision)
      : config_(config), device_(&device), k_(&device.kernels()), precision_(precision) {}
  Status ensure_activations(int B, int T);
  // Unit u's parameters and gradients on the device for one use (the resident buffers, or the coordinator's).
  Result<offload::UnitView> acquire(size_t u, offload::Pass pass);
  void release(size_t u, offload::Pass pass);
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
  // Sums n floats of device memory over the tensor-parallel group, in place (nothing without one).
  [[nodiscard]] Status tp_all_reduce(float* x, size_t n);
  // Unit u's parameters (this rank's slices) to host memory, wherever they live.
  Status read_local_params(size_t u, float* host) const;
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
  bool wants_working_copies() const {
    return working_copies_ && precision_ == kernels::MatmulPrecision::kBF16 && k_->weights_to_bf16 != nullptr;
  }
  // Whether this rank's linears read unit u's weights: the blocks', and the embedding's where this stage has the
  // tied LM head (the final layernorm has none).
  bool has_linears(size_t u) const {
    const Unit& unit = units_[u];
    return unit.role == UnitRole::kBlock || unit.role == UnitRole::kHead || (unit.ties_head && stage_.head);
  }
  // The coordinator keeps working copies of the units with linears, where this model wants them.
  void tell_coordinator_working_copies();
  // Makes unit u's working copy current if it keeps one (set_working_copies).
  void refresh_working_copy(size_t u);

  GPT2Config config_;
  std::unique_ptr<kernels::Device> owned_device_;  // set by the KernelSet overload of create()
  kernels::Device* device_;
  const kernels::KernelSet* k_;
  kernels::MatmulPrecision precision_;
  std::vector<Unit> units_;  // wte, h.0 .. h.{L-1}, ln_f
  bool offloaded_ = false;
  PipelineStage stage_;
  // Tensor parallelism: the group (null: none), this rank, the units' splits, and this rank's widths: attention
  // (C/t, over NH/t heads), MLP hidden (4C/t) and vocabulary rows.
  comm::Communicator* tp_ = nullptr;
  int tp_rank_ = 0, tp_size_ = 1;
  std::vector<UnitSplit> splits_;
  NormShares norm_shares_;
  int attn_width_ = 0, heads_ = 0, mlp_width_ = 0;
  RowSlice vocab_;
  bool sp_ = false;  // sequence parallelism (with tensor parallelism only)
  bool marks_steps_ = true;
  std::function<Status(size_t, float*)> params_source_;
  offload::Coordinator* coordinator_ = nullptr;
  std::vector<bool> on_device_;  // keep_on_device's
  // Whether unit u's parameters and gradients are the coordinator's (else in the unit's own buffers).
  bool coordinated(size_t u) const { return coordinator_ != nullptr && !on_device(u); }
  std::function<void(size_t)> on_grads_done_;

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
  int slots_ = 1, slot_ = 0;
  std::vector<Activations> slot_acts_;  // one set per slot; acts_ is the current one
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::kNone;
  bool working_copies_ = true;
  bool working_copies_refused_ = false;  // an allocation of one failed (set_working_copies)
  uint64_t working_copies_made_ = 0;
  offload::PinnedPool* host_pool_ = nullptr;
  offload::PinnedBuffer host_checkpoints_;  // kHost: (L-1, B, T, C) block outputs 0..L-2
  std::vector<float> host_scratch_;  // losses read back, dlosses written, on their way across
  std::vector<float> tp_scratch_;    // combine_vocab_parallel_losses's gathered losses and lse
  size_t act_capacity_bt_ = 0;  // B*T the buffer was sized for
  int last_B_ = 0, last_T_ = 0;
  // Per slot: whether a backward may follow its last forward (the head's stage: it had targets), and how many
  // targets it counted.
  std::vector<char> ready_for_backward_ = std::vector<char>(1, 0);
  std::vector<int> num_counted_targets_ = std::vector<int>(1, 0);
};

}  // namespace strata::engine
