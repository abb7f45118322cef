// model.h — the model runtime every family runs on, and the interface the rest of the engine sees a model by.
//
// The runtime (this class) owns the units (engine/model/unit.h) and where their parameters and gradients live:
// in the units' own device buffers, or, offloaded, in an offload::Coordinator's, some units kept on the device
// whole. It reads and writes them whole or as a tensor-parallel rank's slices, hands them to the compute
// (acquire/release) with their bf16 working copies, and keeps the settings a runner fixes before the first
// forward: activation slots, activation checkpointing, who marks the coordinator's steps. A family
// (engine/model/gpt2/) derives from it and supplies its math: forward and backward, whole or one pipeline
// stage's, its activations, its seeded initial weights and its FLOP counts. Pipeline, optimizer, offload and
// checkpoint code take a Model, and find a unit's part in it by the unit's role.
//
// Parameters, gradients and activations live in the memory of the model's Device (kernels/device.h): host
// memory on "cpu", GPU memory on "cuda", where the host must not dereference them (Unit::p() and g() are
// device pointers; use Device::copy_to_host). Token ids come in as host arrays.
//
// Offloaded (a family's create(..., offloaded = true), then set_coordinator()): the units hold no buffers; the
// coordinator places them, and the family brackets each use of a unit with acquire/release. read_params,
// write_params and zero_grads work the same either way.
//
// Pipeline stages: the model runs one stage's part (PipelineStage); the units other stages hold have no
// buffers here (holds(u) is false: their reads and writes are skipped, so init_weights gives a stage exactly
// the whole model's values for its units). Several micro-batches can be in flight at once: set_activation_slots(n)
// keeps n sets of activations, use_slot(i) picks one (a micro-batch's forward and backward use the same slot).
//
// Tensor parallelism (a group of t > 1 ranks): each rank's units hold its slices (units()[u].layout) of the
// whole units (whole_layout(u)) by the family's split rule (engine/model/unit_split.h). Every rank of the group
// runs every forward and backward together; read_params is collective over it, and read_params, write_params
// and checkpoints see whole tensors, so checkpoints do not depend on t.
//
// Threading: a model is used by one thread at a time; kernels parallelise inside each op.
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
#include "common/status.h"
#include "common/tensor.h"
#include "engine/model/unit.h"
#include "engine/model/unit_split.h"
#include "kernels/device.h"
#include "kernels/kernels.h"
#include "offload/coordinator.h"
#include "offload/pinned_pool.h"

namespace strata::engine {

// Activation checkpointing per block: keep only each block's input and recompute the block in backward
// (kDevice), with the inputs held in host memory between forward and backward (kHost). The recomputed
// activations are bitwise the forward's, so training results do not change.
enum class ActivationCheckpointing : uint8_t { kNone, kDevice, kHost };

// A family's seeded initial weights, made in the order of the model's units and of their elements, as whole
// tensors (whole_layout(u)): Model::init_weights takes them a whole unit at a time, a load through the optimizer
// (engine/checkpoint/checkpoint.h init_model) a piece at a time. Pieces come in order (a piece before the end
// of the last one given is an error); what lies between is made and dropped, so every element has the value
// init_weights gives it.
class WeightsInit {
 public:
  virtual ~WeightsInit() = default;
  // Elements [offset, offset + dst.size()) of unit `unit`.
  virtual Status fill(size_t unit, size_t offset, std::span<float> dst) = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // ---- The family's math.

  // Allocates the activations for (B, T) now rather than at the first forward, so a device budget too small
  // for them fails before anything else is written (the session calls it before writing the weights).
  virtual Status reserve_activations(int B, int T) = 0;
  // Forward over inputs (B,T) token ids. With targets (B,T) (entries < 0 ignored) it computes the mean loss
  // over the counted targets and returns it; without, it returns 0. T is at most the family's context.
  virtual Result<float> forward(const int32_t* inputs, const int32_t* targets, int B, int T) = 0;
  // Backward of the last forward (which must have had targets). Adds this batch's gradients, scaled by
  // `loss_scale` (1/grad_accum_steps for gradient accumulation), into every unit's grads. Fails only when
  // offloaded state cannot be brought in (an I/O error, a device budget below the working set).
  [[nodiscard]] virtual Status backward(float loss_scale = 1.0f) = 0;
  // Pipeline stages. forward_stage: `inputs` (B,T) token ids for the embedding's stage (else unused), `x_in`
  // (the residual stream, residual_floats(B, T)) in device memory for the others, `targets` for the head's
  // stage (whose loss it returns; 0 elsewhere). backward_stage: `dy`, the gradient of stage_output() in device
  // memory, for stages without the head (ignored with it), in the current slot, after its forward_stage. Both
  // copy what they take.
  virtual Result<float> forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B,
                                      int T) = 0;
  [[nodiscard]] virtual Status backward_stage(const float* dy, float loss_scale) = 0;
  virtual const float* stage_output() const = 0;      // device memory, of the current slot's forward
  virtual const float* stage_input_grad() const = 0;  // device memory, of the last backward_stage
  // Floats of the residual stream a stage passes on for (B,T): the stage's input and output, and their gradients.
  virtual size_t residual_floats(int B, int T) const = 0;
  // The family's initialisation with `seed` (init_weights writes it).
  virtual std::unique_ptr<WeightsInit> initial_weights(uint64_t seed) const = 0;
  // FLOPs of one forward+backward over B*T tokens (matmuls and attention; the rest is memory-bound), counting
  // causal attention's products as executed (each query against (T+1)/2 keys on average).
  virtual double flops_per_step(int B, int T) const = 0;
  // The same by PaLM's count (appendix B), which nanoGPT and Megatron-LM report utilisation by: 6N + 12·L·C·T a
  // token, N the parameters but a position embedding, attention counted as if every query saw all T keys.
  virtual double palm_flops_per_step(int B, int T) const = 0;
  // The family's config as a checkpoint's metadata, every value a string: "format" ("strata-<family>") and the
  // model section's keys. A file written with it is read back into a model only when they are all the same.
  virtual std::map<std::string, std::string> metadata() const = 0;

  // ---- The runtime.

  // For an offloaded model: the coordinator of its units (built from units(), same order; it must outlive
  // the model's use).
  void set_coordinator(offload::Coordinator* c) {
    coordinator_ = c;
    tell_coordinator_working_copies();
  }
  offload::Coordinator* coordinator() const { return coordinator_; }
  // Called in backward as soon as a unit's gradient is complete for this backward (after its last release), in
  // backward's order; a unit used twice (an embedding tied to the head) when its second use is done. The
  // offloaded optimizer starts the unit's update from it in the step's last micro-batch.
  void set_on_grads_done(std::function<void(size_t unit)> fn) { on_grads_done_ = std::move(fn); }
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
  // Under kBF16, whether each unit with linears keeps a bf16 working copy of its parameters in device memory (2
  // bytes a parameter, allocated at the unit's first use, named "<family>.params16 <unit>"), which its linears
  // take as their bf16 weights (kernels.h Weight): made once after each change of the parameters (an optimizer
  // step, a load) where each linear would otherwise round its weight in every forward, backward and recompute
  // of every micro-batch. The results are bitwise the same either way. On by default; kept only where the
  // backend uses them (KernelSet::weights_to_bf16), for the units the model holds and, with a coordinator, for
  // the units on the device for good (Coordinator::set_working_copies: the optimizer offloaded, the parameters
  // not). Once a copy does not fit the device budget, no more are made (one warning), and the linears of the
  // units without one round as before.
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

  // The family's initial weights for `seed` (initial_weights), written into every unit.
  Status init_weights(uint64_t seed);
  // Unit u's parameters to or from host memory (whole_layout(u)), wherever they live. Under tensor parallelism
  // read_params gathers the ranks' slices (collective over the group: every rank reads the same units in the
  // same order) and write_params takes this rank's slices of the whole tensors.
  Status read_params(size_t u, float* host) const;
  Status write_params(size_t u, const float* host);
  // The whole unit's layout (the checkpoints' tensors); units()[u].layout under tensor parallelism is this
  // rank's slices of it.
  const FlatLayout& whole_layout(size_t u) const { return tp_ != nullptr ? splits_[u].whole() : units_[u].layout; }
  // Tensor parallelism: this rank's slices of unit u (units()[u].layout) to the whole unit, gathered over the
  // group (collective), and the whole unit to this rank's slices. Without it, copies.
  Status gather_whole(size_t u, const float* local, float* whole) const;
  void slice_whole(size_t u, const float* whole, float* local) const;
  bool tensor_parallel() const { return tp_ != nullptr; }
  // This rank's shares of the units' gradient norm (engine/model/unit_split.h); inactive without tensor
  // parallelism.
  const NormShares& norm_shares() const { return norm_shares_; }

  // Before the first forward: n >= 1 activation sets (micro-batches in flight).
  void set_activation_slots(int n) {
    STRATA_ASSERT(last_B_ == 0 && n >= 1);
    slots_ = n;
  }
  void use_slot(int i) {
    STRATA_ASSERT(i >= 0 && i < slots_);
    slot_ = i;
    select_slot(i);
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

  std::vector<Unit>& units() { return units_; }
  const std::vector<Unit>& units() const { return units_; }
  size_t num_params() const;        // this rank's (its tensor-parallel slices of its stage's units)
  size_t whole_num_params() const;  // the whole model's
  const kernels::KernelSet& kernels() const { return *k_; }
  kernels::Device& device() const { return *device_; }

 protected:
  // `family` prefixes the names of the model's device buffers ("gpt2.params h.3"), which the memory reports
  // and the budgets' errors show.
  Model(kernels::Device& device, kernels::MatmulPrecision precision, std::string family)
      : device_(&device), k_(&device.kernels()), precision_(precision), family_(std::move(family)) {}

  // Before the units are added: where they live, the pipeline stage this model runs (end resolved), and the
  // tensor-parallel group (null or a group of one: none).
  void place(bool offloaded, const PipelineStage& stage, comm::Communicator* tp);
  // Appends a unit: this rank's slices of it under tensor parallelism, each tensor cut by `split` (by its
  // canonical name), and, not offloaded and held here, its parameter and gradient buffers (zeroed).
  Status add_unit(UnitSpec spec, const std::function<TensorSplit(const std::string& name)>& split);

  // The family's activations for slot i become the current ones (use_slot).
  virtual void select_slot(int i) = 0;

  // Unit u's parameters and gradients on the device for one use (the resident buffers, or the coordinator's).
  Result<offload::UnitView> acquire(size_t u, offload::Pass pass);
  void release(size_t u, offload::Pass pass);
  // Completes a gradient the backward finished: tells set_on_grads_done's callback.
  void grads_done(size_t u) {
    if (on_grads_done_) on_grads_done_(u);
  }
  // Sums n floats of device memory over the tensor-parallel group, in place (nothing without one).
  [[nodiscard]] Status tp_all_reduce(float* x, size_t n);
  const std::string& family() const { return family_; }
  bool wants_working_copies() const {
    return working_copies_ && precision_ == kernels::MatmulPrecision::kBF16 && k_->weights_to_bf16 != nullptr;
  }

  // The runtime's state, which the family's math reads.
  std::unique_ptr<kernels::Device> owned_device_;  // a family's create() over a CPU KernelSet owns its device
  kernels::Device* device_;
  const kernels::KernelSet* k_;
  kernels::MatmulPrecision precision_;
  std::vector<Unit> units_;
  bool offloaded_ = false;
  PipelineStage stage_;
  // Tensor parallelism: the group (null: none), this rank and the units' splits.
  comm::Communicator* tp_ = nullptr;
  int tp_rank_ = 0, tp_size_ = 1;
  std::vector<UnitSplit> splits_;
  NormShares norm_shares_;
  bool marks_steps_ = true;
  offload::Coordinator* coordinator_ = nullptr;
  int slots_ = 1, slot_ = 0;
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::kNone;
  offload::PinnedPool* host_pool_ = nullptr;
  int last_B_ = 0, last_T_ = 0;  // the batch the activations are sized for (0: none yet)

 private:
  // Whether unit u's parameters and gradients are the coordinator's (else in the unit's own buffers).
  bool coordinated(size_t u) const { return coordinator_ != nullptr && !on_device(u); }
  // Unit u's parameters (this rank's slices) to host memory, wherever they live.
  Status read_local_params(size_t u, float* host) const;
  // Whether this rank's linears read unit u's weights: the blocks' and an untied head's, and an embedding
  // that ties the head where this stage has the head.
  bool has_linears(size_t u) const {
    const Unit& unit = units_[u];
    return unit.role == UnitRole::kBlock || unit.role == UnitRole::kHead || (unit.ties_head && stage_.head);
  }
  // The coordinator keeps working copies of the units with linears, where this model wants them.
  void tell_coordinator_working_copies();
  // Makes unit u's working copy current if it keeps one (set_working_copies).
  void refresh_working_copy(size_t u);

  std::string family_;
  std::function<Status(size_t, float*)> params_source_;
  std::vector<bool> on_device_;  // keep_on_device's
  std::function<void(size_t)> on_grads_done_;
  bool working_copies_ = true;
  bool working_copies_refused_ = false;  // an allocation of one failed (set_working_copies)
  uint64_t working_copies_made_ = 0;
};

}  // namespace strata::engine
