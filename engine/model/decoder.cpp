// The decoder runtime (decoder.h): a family's blocks between the embedding and the head, their activations and
// slots, checkpointing, and the tensor- and sequence-parallel plumbing.
#include "engine/model/decoder.h"

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/trace.h"

namespace strata::engine {

using offload::Pass;

Status Decoder::build(const DecoderShape& shape, bool offloaded, PipelineStage stage, comm::Communicator* tp,
                      bool sequence_parallel, std::vector<UnitSpec> specs,
                      const std::function<TensorSplit(const std::string& name)>& split) {
  const int t = tp != nullptr ? tp->size() : 1;
  if (t > 1 && row_slice(shape.vocab, t - 1, t).count == 0) {  // slices of ceil(V/t) rows
    return Status::invalid_argument(
        "model.vocab_size ({}) leaves the last of parallel.tensor_parallel_size ({}) ranks no vocabulary rows",
        shape.vocab, t);
  }
  if (stage.end < 0) stage.end = shape.layers;
  if (stage.first < 0 || stage.first >= stage.end || stage.end > shape.layers)
    return Status::invalid_argument("pipeline stage: blocks [{}, {}) are not a non-empty part of the {} layers",
                                    stage.first, stage.end, shape.layers);
  STRATA_ASSERT(specs.size() >= static_cast<size_t>(shape.layers) + 2 && specs[0].role == UnitRole::kEmbedding &&
                specs[static_cast<size_t>(shape.layers) + 1].role == UnitRole::kFinalNorm);
  shape_ = shape;
  tied_ = specs[0].ties_head;
  STRATA_ASSERT(tied_ != (specs.size() == static_cast<size_t>(shape.layers) + 3 && specs.back().role == UnitRole::kHead));
  place(offloaded, stage, tp);
  sp_ = t > 1 && sequence_parallel;
  vocab_ = row_slice(shape.vocab, tp_rank_, t);
  for (UnitSpec& spec : specs) STRATA_RETURN_IF_ERROR(add_unit(std::move(spec), split));
  return Status::ok();
}

const float* Decoder::logits() const {
  STRATA_ASSERT_MSG(k_->classifier_logits_bytes(last_B_ * last_T_, static_cast<int>(vocab_.count), precision_) ==
                        static_cast<size_t>(last_B_) * last_T_ * vocab_.count * sizeof(float),
                    "this backend keeps the logits in another form than fp32");
  return acts_.logits;
}

Result<const float*> Decoder::gather_rows(const float* rows, size_t rows_floats) {
  if (!sp_) return rows;
  STRATA_RETURN_IF_ERROR(tp_->all_gather(rows, grads_.full, rows_floats, DType::kF32)
                             .with_context("sequence-parallel all-gather"));
  return static_cast<const float*>(grads_.full);
}

Result<const void*> Decoder::gather_hidden_rows(const void* rows, int Nr, int width) {
  if (!sp_) return rows;
  const size_t n = static_cast<size_t>(Nr) * static_cast<size_t>(width);
  const size_t bytes = k_->hidden_bytes(Nr, width, precision_);
  STRATA_ASSERT_MSG(bytes == n * sizeof(float) || bytes == n * sizeof(uint16_t),
                    "a hidden activation neither fp32 nor 16-bit cannot be gathered");
  const DType dtype = bytes == n * sizeof(float) ? DType::kF32 : DType::kBF16;
  STRATA_RETURN_IF_ERROR(tp_->all_gather(rows, grads_.full, n, dtype).with_context("sequence-parallel all-gather"));
  return static_cast<const void*>(grads_.full);
}

Status Decoder::reduce_rows(float* partial, float* out, size_t rows_floats) {
  if (!sp_) {
    STRATA_ASSERT(partial == out);
    return tp_all_reduce(out, rows_floats);
  }
  return tp_->reduce_scatter(partial, out, rows_floats, DType::kF32, comm::ReduceOp::kSum)
      .with_context("sequence-parallel reduce-scatter");
}

void Decoder::norm_forward(void* out, float* mean, float* rstd, const float* inp, const float* weight,
                           const float* bias, int rows) const {
  const int C = shape_.width;
  if (shape_.norm == NormKind::kLayerNorm)
    k_->layernorm_forward(out, mean, rstd, inp, weight, bias, rows, C, precision_);
  else
    k_->rmsnorm_forward(out, rstd, inp, weight, rows, C, shape_.norm_eps, precision_);
}

void Decoder::residual_norm_forward(float* res, void* out, float* mean, float* rstd, const float* inp1,
                                    const float* inp2, const float* weight, const float* bias, int rows) const {
  const int C = shape_.width;
  if (shape_.norm == NormKind::kLayerNorm)
    k_->residual_layernorm_forward(res, out, mean, rstd, inp1, inp2, weight, bias, rows, C, precision_);
  else
    k_->residual_rmsnorm_forward(res, out, rstd, inp1, inp2, weight, rows, C, shape_.norm_eps, precision_);
}

Status Decoder::norm_backward_rows(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                   const float* weight, const float* mean, const float* rstd, int rows) {
  const int C = shape_.width;
  const bool layernorm = shape_.norm == NormKind::kLayerNorm;
  auto run = [&](float* dw, float* db) {
    if (layernorm)
      k_->layernorm_backward(dinp, dw, db, dout, inp, weight, mean, rstd, rows, C);
    else
      k_->rmsnorm_backward(dinp, dw, dout, inp, weight, rstd, rows, C);
  };
  if (!sp_) {
    run(dweight, dbias);
    return Status::ok();
  }
  const size_t n = (layernorm ? 2 : 1) * static_cast<size_t>(C);
  float* g = grads_.norm_grads;
  device_->zero(g, sizeof(float) * n);
  run(g, g + C);
  STRATA_RETURN_IF_ERROR(tp_all_reduce(g, n));
  k_->residual_forward(dweight, dweight, g, C);
  if (layernorm) k_->residual_forward(dbias, dbias, g + C, C);
  return Status::ok();
}

void Decoder::select_slot(int i) {
  if (slots_acts_.empty()) return;
  acts_ = slots_acts_[static_cast<size_t>(i)].acts;
  layer_base_ = slots_acts_[static_cast<size_t>(i)].layers;
}

Status Decoder::ensure_activations(int B, int T) {
  if (B == last_B_ && T == last_T_) return Status::ok();
  const size_t C = static_cast<size_t>(shape_.width);
  // Per-layer activations: every layer's of this stage, or with checkpointing one layer's (recomputed in
  // backward).
  const size_t layers = static_cast<size_t>(stage_.end - stage_.first);
  const size_t L = checkpointing_ == ActivationCheckpointing::kNone ? layers : 1;
  // Block outputs: every layer's (they are the checkpoints), or two alternating ones when the checkpoints live
  // in host memory.
  const size_t R = checkpointing_ == ActivationCheckpointing::kHost ? std::min<size_t>(2, layers) : layers;
  const size_t BT = static_cast<size_t>(B) * T;
  if (sp_ && BT % static_cast<size_t>(tp_size_) != 0) {
    return Status::invalid_argument(
        "sequence parallelism cuts the {} x {} = {} rows of a batch over parallel.tensor_parallel_size ({}) ranks: "
        "they must divide evenly",
        B, T, BT, tp_size_);
  }
  const size_t Nr = rows_here(static_cast<int>(BT));  // rows of the residual stream here
  const bool layernorm = shape_.norm == NormKind::kLayerNorm;
  // The classifier's logits, in whatever form its backend keeps them (kernels.h).
  const size_t Vr = static_cast<size_t>(vocab_.count);
  const size_t logits_floats =
      stage_.head ? (k_->classifier_logits_bytes(static_cast<int>(BT), static_cast<int>(Vr), precision_) + 3) / 4 : 0;
  // Sizes in floats: one slot's (the runtime's in the order of Activations, then the family's per-layer arrays,
  // L layers each), then the shared scratch (the runtime's in the order of Grads, then the family's).
  std::vector<size_t> per_slot = {
      Nr * C, R * Nr * C,                                                   // encoded, block_out
      hidden_floats(static_cast<int>(Nr), shape_.width), layernorm ? Nr : 0, Nr,  // normf, normf_mean, normf_rstd
      logits_floats, BT, BT, BT,  // logits (the head's stage only), losses, lse, dlosses
      BT, BT,                     // inputs, targets (int32, same size as float)
  };
  constexpr size_t kRuntimePerSlot = 11;
  layer_floats_ = layer_activation_floats(B, T);
  for (size_t f : layer_floats_) per_slot.push_back(L * f);
  std::vector<size_t> shared = {Nr * C, BT * C, sp_ ? Nr * C : 0, sp_ ? BT * C : 0, sp_ ? 2 * C : 0};
  constexpr size_t kRuntimeShared = 5;
  for (size_t f : block_scratch_floats(B, T)) shared.push_back(f);
  auto aligned = [](size_t floats) { return (floats + 15) / 16 * 16; };  // every array 64-byte aligned
  size_t slot_floats = 0, total = 0;
  for (size_t f : per_slot) slot_floats += aligned(f);
  for (size_t f : shared) total += aligned(f);
  total += slot_floats * static_cast<size_t>(slots_);
  // Until this succeeds the pointers below are stale: a failure must not leave a later same-shape forward
  // skipping this function.
  last_B_ = last_T_ = 0;
  if (total * sizeof(float) > act_buffer_.size()) {
    act_buffer_.reset();  // before the new one, so both never count against the device budget at once
    STRATA_ASSIGN_OR_RETURN(act_buffer_, device_->allocate(total * sizeof(float), family() + ".activations"));
  }
  if (checkpointing_ == ActivationCheckpointing::kHost && layers > 1) {
    // Per slot, the inputs of the stage's blocks after its first (the outputs of all but its last); the last
    // block's output never needs recomputing from.
    const size_t bytes = static_cast<size_t>(slots_) * (layers - 1) * Nr * C * sizeof(float);
    if (host_checkpoints_.size() < bytes) {
      host_checkpoints_.reset();
      STRATA_ASSIGN_OR_RETURN(host_checkpoints_,
                              host_pool_->try_acquire(bytes, family() + ".activation_checkpoints"));
    }
  }
  float* p = act_buffer_.as<float>();
  auto take = [&p, &aligned](size_t floats) {
    float* at = p;
    p += aligned(floats);
    return at;
  };
  slots_acts_.assign(static_cast<size_t>(slots_), Slot{});
  for (Slot& slot : slots_acts_) {
    Activations& a = slot.acts;
    float** runtime[] = {&a.encoded, &a.block_out, &a.normf, &a.normf_mean, &a.normf_rstd, &a.logits, &a.losses,
                         &a.lse, &a.dlosses, reinterpret_cast<float**>(&a.inputs),
                         reinterpret_cast<float**>(&a.targets)};
    static_assert(std::size(runtime) == kRuntimePerSlot);
    for (size_t i = 0; i < kRuntimePerSlot; ++i) *runtime[i] = take(per_slot[i]);
    for (size_t i = kRuntimePerSlot; i < per_slot.size(); ++i) slot.layers.push_back(take(per_slot[i]));
  }
  float** runtime_shared[] = {&grads_.dres, &grads_.dln, &grads_.dln_rows, &grads_.full, &grads_.norm_grads};
  static_assert(std::size(runtime_shared) == kRuntimeShared);
  for (size_t i = 0; i < kRuntimeShared; ++i) *runtime_shared[i] = take(shared[i]);
  scratch_base_.clear();
  for (size_t i = kRuntimeShared; i < shared.size(); ++i) scratch_base_.push_back(take(shared[i]));
  select_slot(slot_);
  ready_for_backward_.assign(static_cast<size_t>(slots_), 0);
  num_counted_targets_.assign(static_cast<size_t>(slots_), 0);
  last_B_ = B;
  last_T_ = T;
  return Status::ok();
}

Result<float> Decoder::forward(const int32_t* inputs, const int32_t* targets, int B, int T) {
  return forward_stage(inputs, targets, nullptr, B, T);
}

const float* Decoder::stage_output() const {
  return block_output(stage_.end - 1, residual_floats(last_B_, last_T_));
}

Result<float> Decoder::forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B,
                                     int T) {
  trace::Span span("forward");
  if (B <= 0 || T <= 0) return Status::invalid_argument("forward: batch {}x{} is empty", B, T);
  if (T > shape_.context) {
    return Status::invalid_argument("sequence length {} is longer than the model's context ({} = {})", T,
                                    shape_.context_key, shape_.context);
  }
  STRATA_RETURN_IF_ERROR(ensure_activations(B, T));
  const int V = shape_.vocab;
  const int N = B * T;
  if (stage_.embedding) {
    for (int i = 0; i < N; ++i) STRATA_ASSERT(inputs[i] >= 0 && inputs[i] < V);
    device_->copy_to_device(acts_.inputs, inputs, sizeof(int32_t) * N);
  } else {
    STRATA_ASSERT_MSG(x_in != nullptr, "a pipeline stage after the first needs its input activations");
    device_->copy_on_device(acts_.encoded, x_in, sizeof(float) * residual_floats(B, T));
  }

  char& ready = ready_for_backward_[static_cast<size_t>(slot_)];
  ready = 0;  // until this forward has succeeded
  const bool with_loss = stage_.head && targets != nullptr;
  int& counted = num_counted_targets_[static_cast<size_t>(slot_)];
  counted = 0;
  if (with_loss) {  // the classifier computes the losses with the logits
    for (int i = 0; i < N; ++i) {
      STRATA_ASSERT(targets[i] < V);
      if (targets[i] >= 0) ++counted;
    }
    device_->copy_to_device(acts_.targets, targets, sizeof(int32_t) * N);
  }
  STRATA_RETURN_IF_ERROR(forward_units(B, T, with_loss));

  if (!stage_.head) {  // the next stage takes it from here; a backward may follow
    ready = 1;
    return 0.0f;
  }
  ready = with_loss;
  if (!ready) return 0.0f;
  // Summed in double and in a fixed order so the loss does not depend on the kernels' threading.
  host_scratch_.resize(N);
  device_->copy_to_host(host_scratch_.data(), acts_.losses, sizeof(float) * N);
  if (tp_ != nullptr) STRATA_RETURN_IF_ERROR(combine_vocab_parallel_losses(targets, N));
  double sum = 0.0;
  for (int i = 0; i < N; ++i) sum += host_scratch_[i];
  return counted ? static_cast<float>(sum / counted) : 0.0f;
}

Status Decoder::combine_vocab_parallel_losses(const int32_t* targets, int N) {
  // Each rank's losses (nonzero only for the targets in its columns) and lse, gathered: 2N floats per rank.
  const size_t n = static_cast<size_t>(N);
  // This rank's losses and lse side by side, then every rank's, then the whole vocabulary's lse.
  tp_scratch_.resize(2 * n * static_cast<size_t>(tp_size_ + 1) + n);
  float* mine = tp_scratch_.data();
  float* all = mine + 2 * n;
  float* lse = all + 2 * n * static_cast<size_t>(tp_size_);
  std::copy_n(host_scratch_.data(), n, mine);
  device_->copy_to_host(mine + n, acts_.lse, sizeof(float) * n);
  STRATA_RETURN_IF_ERROR(tp_->all_gather(mine, all, 2 * n, DType::kF32).with_context("vocab-parallel cross-entropy"));
  const int64_t rows_per_rank = row_slice(shape_.vocab, 0, tp_size_).count;
  for (size_t i = 0; i < n; ++i) {
    auto rank_lse = [&](int r) -> double { return all[static_cast<size_t>(r) * 2 * n + n + i]; };
    double m = rank_lse(0);
    for (int r = 1; r < tp_size_; ++r) m = std::max(m, rank_lse(r));
    double sum = 0.0;
    for (int r = 0; r < tp_size_; ++r) sum += std::exp(rank_lse(r) - m);
    const double whole = m + std::log(sum);
    lse[i] = static_cast<float>(whole);
    if (targets[i] < 0) {
      host_scratch_[i] = 0.0f;
      continue;
    }
    // The owner's loss is its lse less the target's logit: the whole row's is that plus (whole lse - its lse).
    const int owner = static_cast<int>(targets[i] / rows_per_rank);
    host_scratch_[i] = static_cast<float>(all[static_cast<size_t>(owner) * 2 * n + i] + (whole - rank_lse(owner)));
  }
  device_->copy_to_device(acts_.lse, lse, sizeof(float) * n);
  return Status::ok();
}

Status Decoder::forward_units(int B, int T, bool with_loss) {
  const int C = shape_.width;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = residual_floats(B, T);
  if (coordinator_ != nullptr) {
    coordinator_->set_step_is_one_pass(marks_steps_);
    if (marks_steps_) coordinator_->begin_step();
  }
  if (stage_.embedding) {
    // Vocab-parallel: each rank embeds the tokens of its rows (rank 0 adds the positions), summed over the group.
    STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kForward));
    const float* positions =
        shape_.positions && tp_rank_ == 0 ? emb.params + units_[0].layout.specs()[1].offset : nullptr;
    float* partial = partial_for(acts_.encoded);
    k_->encoder_forward(partial, acts_.inputs, emb.params, positions, B, T, C, static_cast<int>(vocab_.start),
                        static_cast<int>(vocab_.count));
    release(0, Pass::kForward);
    STRATA_RETURN_IF_ERROR(reduce_rows(partial, acts_.encoded, RC));
  }
  const float* residual = acts_.encoded;
  for (int l = stage_.first; l < stage_.end; ++l) {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView block, acquire(1 + l, Pass::kForward));
    const Status ran = block_forward(l, block, residual, block_output(l, RC), B, T);
    release(1 + l, Pass::kForward);  // also after a failure: an acquired unit can be neither evicted nor written
    STRATA_RETURN_IF_ERROR(ran);
    residual = block_output(l, RC);
    if (checkpointing_ == ActivationCheckpointing::kHost && l + 1 < stage_.end)
      device_->copy_to_host(host_checkpoint(l, RC), residual, RC * sizeof(float));
  }
  if (!stage_.head) return Status::ok();
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView norm, acquire(final_norm_unit(), Pass::kForward));
    norm_forward(acts_.normf, acts_.normf_mean, acts_.normf_rstd, residual, norm.params, norm.params + C, Nr);
    release(final_norm_unit(), Pass::kForward);
  }
  // The LM head: an untied one's unit, or the token embedding's second use (this rank's vocabulary columns).
  STRATA_ASSIGN_OR_RETURN(const void* normf_in, gather_hidden_rows(acts_.normf, Nr, C));
  STRATA_ASSIGN_OR_RETURN(offload::UnitView head, acquire(head_unit(), Pass::kForward));
  k_->classifier_forward(acts_.logits, acts_.losses, acts_.lse, normf_in, linear_weight(head, head.params),
                         with_loss ? acts_.targets : nullptr, N, C, static_cast<int>(vocab_.count),
                         static_cast<int>(vocab_.start), precision_);
  release(head_unit(), Pass::kForward);
  return Status::ok();
}

Status Decoder::backward(float loss_scale) { return backward_stage(nullptr, loss_scale); }

Status Decoder::backward_stage(const float* dy, float loss_scale) {
  trace::Span span("backward");
  char& ready = ready_for_backward_[static_cast<size_t>(slot_)];
  STRATA_ASSERT_MSG(ready, "backward() needs a forward() with targets (of this slot)");
  ready = 0;  // the logits are overwritten below; a second backward would be wrong
  const int B = last_B_, T = last_T_;
  const int C = shape_.width;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t BTC = static_cast<size_t>(N) * C, RC = residual_floats(B, T);
  if (!stage_.head) {
    STRATA_ASSERT_MSG(dy != nullptr, "a pipeline stage before the last needs its output's gradient");
    device_->copy_on_device(grads_.dres, dy, sizeof(float) * RC);
    return backward_blocks(B, T);
  }
  const int counted = num_counted_targets_[static_cast<size_t>(slot_)];
  const float dloss = counted ? loss_scale / static_cast<float>(counted) : 0.0f;
  host_scratch_.assign(N, dloss);
  device_->copy_to_device(acts_.dlosses, host_scratch_.data(), sizeof(float) * N);
  const int Vr = static_cast<int>(vocab_.count);

  device_->zero(grads_.dln, sizeof(float) * BTC);
  device_->zero(grads_.dres, sizeof(float) * RC);
  {
    STRATA_ASSIGN_OR_RETURN(const void* normf_in, gather_hidden_rows(acts_.normf, Nr, C));
    STRATA_ASSIGN_OR_RETURN(offload::UnitView head, acquire(head_unit(), Pass::kBackward));
    // In place: the logits become their gradient.
    k_->classifier_backward(grads_.dln, head.grads, acts_.logits, acts_.lse, acts_.targets, acts_.dlosses, normf_in,
                            linear_weight(head, head.params), N, C, Vr, static_cast<int>(vocab_.start), precision_);
    release(head_unit(), Pass::kBackward);
    if (!tied_) grads_done(head_unit());
    STRATA_RETURN_IF_ERROR(reduce_rows(grads_.dln, dln_rows(), RC));  // each rank's columns' part of dnormf
  }
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView norm, acquire(final_norm_unit(), Pass::kBackward));
    const float* last_residual = block_output(stage_.end - 1, RC);
    const Status done = norm_backward_rows(grads_.dres, norm.grads, norm.grads + C, dln_rows(), last_residual,
                                           norm.params, acts_.normf_mean, acts_.normf_rstd, Nr);
    release(final_norm_unit(), Pass::kBackward);
    STRATA_RETURN_IF_ERROR(done);
    grads_done(final_norm_unit());
  }
  return backward_blocks(B, T);
}

// The stage's blocks in reverse, from the residual stream's gradient in grads_.dres (left there as the
// stage input's gradient), then the embedding on the first stage.
Status Decoder::backward_blocks(int B, int T) {
  const int C = shape_.width;
  const size_t RC = residual_floats(B, T);
  for (int l = stage_.end - 1; l >= stage_.first; --l) {
    const float* residual = l == stage_.first ? acts_.encoded : block_output(l - 1, RC);
    STRATA_ASSIGN_OR_RETURN(offload::UnitView block, acquire(1 + l, Pass::kBackward));
    Status ran;
    if (checkpointing_ != ActivationCheckpointing::kNone && l + 1 < stage_.end) {
      // Recompute the block from its checkpoint (the last block's activations are still those of forward).
      if (checkpointing_ == ActivationCheckpointing::kHost && l > stage_.first)
        device_->copy_to_device(const_cast<float*>(residual), host_checkpoint(l - 1, RC), RC * sizeof(float));
      ran = block_forward(l, block, residual, block_output(l, RC), B, T);
    }
    if (ran.is_ok()) ran = block_backward(l, block, residual, grads_.dres, B, T);
    release(1 + l, Pass::kBackward);  // as in forward
    STRATA_RETURN_IF_ERROR(ran);
    grads_done(1 + l);
  }
  if (!stage_.embedding) return Status::ok();
  // Every rank adds the same position gradient (the table is replicated) and its own vocabulary rows', from
  // every row.
  STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(grads_.dres, RC));
  STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kGradients));
  float* dpositions = shape_.positions ? emb.grads + units_[0].layout.specs()[1].offset : nullptr;
  k_->encoder_backward(emb.grads, dpositions, dout, acts_.inputs, B, T, C, static_cast<int>(vocab_.start),
                       static_cast<int>(vocab_.count));
  release(0, Pass::kGradients);
  grads_done(0);
  return Status::ok();
}

}  // namespace strata::engine
