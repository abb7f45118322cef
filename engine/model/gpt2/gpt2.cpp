#include "engine/model/gpt2/gpt2.h"

#include <algorithm>

#include "common/check.h"
#include "common/trace.h"

namespace strata::engine {

using kernels::MatmulPrecision;

Result<std::unique_ptr<GPT2>> GPT2::create(const GPT2Config& config, const kernels::KernelSet& cpu_kernels,
                                           MatmulPrecision precision) {
  std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(cpu_kernels);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> m, create(config, *device, precision));
  m->owned_device_ = std::move(device);
  return m;
}

Result<std::unique_ptr<GPT2>> GPT2::create(const GPT2Config& config, kernels::Device& device,
                                           MatmulPrecision precision, bool offloaded, PipelineStage stage,
                                           comm::Communicator* tp, bool sequence_parallel) {
  STRATA_RETURN_IF_ERROR(config.validate());
  const int t = tp != nullptr ? tp->size() : 1;
  if (t > 1 && config.n_head % t != 0) {
    return Status::invalid_argument(
        "model.n_head ({}) must be divisible by parallel.tensor_parallel_size ({}): each rank takes whole heads",
        config.n_head, t);
  }
  if (t > 1 && row_slice(config.vocab_size, t - 1, t).count == 0) {  // slices of ceil(V/t) rows
    return Status::invalid_argument(
        "model.vocab_size ({}) leaves the last of parallel.tensor_parallel_size ({}) ranks no vocabulary rows",
        config.vocab_size, t);
  }
  if (stage.end < 0) stage.end = config.n_layer;
  if (stage.first < 0 || stage.first >= stage.end || stage.end > config.n_layer)
    return Status::invalid_argument("pipeline stage: blocks [{}, {}) are not a non-empty part of the {} layers",
                                    stage.first, stage.end, config.n_layer);
  std::unique_ptr<GPT2> m(new GPT2(config, device, precision));
  m->place(offloaded, stage, tp);
  m->sp_ = t > 1 && sequence_parallel;
  m->attn_width_ = config.n_embd / t;
  m->heads_ = config.n_head / t;
  m->mlp_width_ = 4 * config.n_embd / t;
  m->vocab_ = row_slice(config.vocab_size, m->tp_rank_, t);
  for (UnitSpec& spec : gpt2_unit_specs(config))
    STRATA_RETURN_IF_ERROR(m->add_unit(std::move(spec), gpt2_tensor_split));
  return m;
}

Result<const float*> GPT2::gather_rows(const float* rows, size_t rows_floats) {
  if (!sp_) return rows;
  STRATA_RETURN_IF_ERROR(tp_->all_gather(rows, grads_.full, rows_floats, DType::kF32)
                             .with_context("sequence-parallel all-gather"));
  return static_cast<const float*>(grads_.full);
}

Result<const void*> GPT2::gather_hidden_rows(const void* rows, int Nr, int width) {
  if (!sp_) return rows;
  const size_t n = static_cast<size_t>(Nr) * static_cast<size_t>(width), bytes = hidden_bytes(Nr, width);
  STRATA_ASSERT_MSG(bytes == n * sizeof(float) || bytes == n * sizeof(uint16_t),
                    "a hidden activation neither fp32 nor 16-bit cannot be gathered");
  const DType dtype = bytes == n * sizeof(float) ? DType::kF32 : DType::kBF16;
  STRATA_RETURN_IF_ERROR(tp_->all_gather(rows, grads_.full, n, dtype).with_context("sequence-parallel all-gather"));
  return static_cast<const void*>(grads_.full);
}

Status GPT2::reduce_rows(float* partial, float* out, size_t rows_floats) {
  if (!sp_) {
    STRATA_ASSERT(partial == out);
    return tp_all_reduce(out, rows_floats);
  }
  return tp_->reduce_scatter(partial, out, rows_floats, DType::kF32, comm::ReduceOp::kSum)
      .with_context("sequence-parallel reduce-scatter");
}

Status GPT2::layernorm_backward_rows(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                     const float* weight, const float* mean, const float* rstd, int rows) {
  const int C = config_.n_embd;
  if (!sp_) {
    k_->layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, C);
    return Status::ok();
  }
  float* g = grads_.ln_grads;
  device_->zero(g, sizeof(float) * 2 * C);
  k_->layernorm_backward(dinp, g, g + C, dout, inp, weight, mean, rstd, rows, C);
  STRATA_RETURN_IF_ERROR(tp_all_reduce(g, 2 * static_cast<size_t>(C)));
  k_->residual_forward(dweight, dweight, g, C);
  k_->residual_forward(dbias, dbias, g + C, C);
  return Status::ok();
}

namespace {

// The linear weight at `w`, a tensor of `unit`'s parameters, with its working copy where the unit has one.
kernels::Weight linear_weight(const offload::UnitView& unit, const float* w) {
  if (unit.params16 == nullptr) return kernels::Weight(w);
  return kernels::Weight(w, unit.params16 + (w - unit.params));
}

}  // namespace

GPT2::BlockParams GPT2::block_params(int l, const float* cbase) const {
  const Unit& u = units_[1 + l];
  float* base = const_cast<float*>(cbase);
  const auto& s = u.layout.specs();  // in the canonical order of create()
  return BlockParams{base + s[0].offset, base + s[1].offset, base + s[2].offset,  base + s[3].offset,
                     base + s[4].offset, base + s[5].offset, base + s[6].offset,  base + s[7].offset,
                     base + s[8].offset, base + s[9].offset, base + s[10].offset, base + s[11].offset};
}

Status GPT2::ensure_activations(int B, int T) {
  if (B == last_B_ && T == last_T_) return Status::ok();
  const size_t C = config_.n_embd;
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
  // Rows of the residual stream here (sequence parallelism: this rank's share).
  const size_t Nr = rows_here(static_cast<int>(BT));
  // This rank's widths: attention (A = C/t), vocabulary columns (Vr) and the MLP hidden (4C/t, sized below): all
  // of them without tensor parallelism.
  const size_t A = attn_width_, Vr = static_cast<size_t>(vocab_.count);
  const size_t att_floats = k_->attention_saved_floats(B, T, attn_width_, heads_, precision_);
  // The hidden activations and their gradients, in whatever form the backend keeps them (kernels.h): the MLP's,
  // the attention's qkv and output (B*T rows), and the layernorms' outputs, which feed only linears (this rank's
  // rows).
  auto hidden_floats_of = [&](size_t rows, size_t width) {
    return (hidden_bytes(static_cast<int>(rows), static_cast<int>(width)) + 3) / 4;
  };
  const size_t hidden_floats = hidden_floats_of(BT, mlp_width_), atty_floats = hidden_floats_of(BT, A);
  const size_t qkv_floats = hidden_floats_of(BT, 3 * A), ln_floats = hidden_floats_of(Nr, C);
  // The classifier's logits, in whatever form its backend keeps them (kernels.h).
  const size_t logits_floats =
      stage_.head ? (k_->classifier_logits_bytes(static_cast<int>(BT), static_cast<int>(Vr), precision_) + 3) / 4 : 0;
  // Sizes in floats, in the order of the Activations struct, then the per-block gradient scratch.
  const size_t sizes[] = {
      Nr * C,                                  // encoded
      L * ln_floats, L * Nr, L * Nr,           // ln1, ln1_mean, ln1_rstd
      L * qkv_floats,                          // qkv
      L * atty_floats,                         // atty
      L * att_floats,                          // att: what attention saves for backward
      L * Nr * C, L * Nr * C,                  // attproj, residual2
      L * ln_floats, L * Nr, L * Nr,           // ln2, ln2_mean, ln2_rstd
      L * hidden_floats, L * hidden_floats,    // fch, fch_gelu
      L * Nr * C, R * Nr * C,                  // fcproj, residual3
      ln_floats, Nr, Nr,                       // lnf, lnf_mean, lnf_rstd
      logits_floats, BT, BT, BT,               // logits (the head's stage only), losses, lse, dlosses
      BT, BT,                                  // inputs, targets (int32, same size as float)
      Nr * C, BT * C, atty_floats, qkv_floats, hidden_floats, hidden_floats,  // dres, dln, datty, dqkv, dfch, dfch_gelu
      sp_ ? Nr * C : 0, sp_ ? BT * C : 0, sp_ ? 2 * C : 0,  // dln_rows, full, ln_grads
  };
  // The first kPerSlot arrays are one micro-batch's activations (one set per slot); the block gradients after
  // them are shared.
  constexpr size_t kPerSlot = 25;
  size_t per_slot = 0, total = 0;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    const size_t floats = (sizes[i] + 15) / 16 * 16;  // keep every array 64-byte aligned
    (i < kPerSlot ? per_slot : total) += floats;
  }
  total += per_slot * static_cast<size_t>(slots_);
  // Until this succeeds the pointers below are stale: a failure must not leave a later same-shape forward
  // skipping this function.
  last_B_ = last_T_ = 0;
  if (total * sizeof(float) > act_buffer_.size()) {
    act_buffer_.reset();  // before the new one, so both never count against the device budget at once
    STRATA_ASSIGN_OR_RETURN(act_buffer_, device_->allocate(total * sizeof(float), "gpt2.activations"));
  }
  if (checkpointing_ == ActivationCheckpointing::kHost && layers > 1) {
    // Per slot, the inputs of the stage's blocks after its first (the outputs of all but its last); the last
    // block's output never needs recomputing from.
    const size_t bytes = static_cast<size_t>(slots_) * (layers - 1) * Nr * C * sizeof(float);
    if (host_checkpoints_.size() < bytes) {
      host_checkpoints_.reset();
      STRATA_ASSIGN_OR_RETURN(host_checkpoints_, host_pool_->try_acquire(bytes, "gpt2.activation_checkpoints"));
    }
  }
  float* p = act_buffer_.as<float>();
  float** slots[] = {&acts_.encoded, &acts_.ln1, &acts_.ln1_mean, &acts_.ln1_rstd, &acts_.qkv, &acts_.atty,
                     &acts_.att, &acts_.attproj, &acts_.residual2, &acts_.ln2, &acts_.ln2_mean, &acts_.ln2_rstd,
                     &acts_.fch, &acts_.fch_gelu, &acts_.fcproj, &acts_.residual3, &acts_.lnf, &acts_.lnf_mean,
                     &acts_.lnf_rstd, &acts_.logits, &acts_.losses, &acts_.lse, &acts_.dlosses,
                     reinterpret_cast<float**>(&acts_.inputs), reinterpret_cast<float**>(&acts_.targets),
                     &grads_.dres, &grads_.dln, &grads_.datty, &grads_.dqkv, &grads_.dfch, &grads_.dfch_gelu,
                     &grads_.dln_rows, &grads_.full, &grads_.ln_grads};
  static_assert(sizeof(slots) / sizeof(slots[0]) == sizeof(sizes) / sizeof(sizes[0]));
  slot_acts_.assign(static_cast<size_t>(slots_), Activations{});
  for (int k = 0; k < slots_; ++k) {
    for (size_t i = 0; i < kPerSlot; ++i) {
      *slots[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
    }
    slot_acts_[k] = acts_;
  }
  for (size_t i = kPerSlot; i < std::size(sizes); ++i) {
    *slots[i] = p;
    p += (sizes[i] + 15) / 16 * 16;
  }
  acts_ = slot_acts_[static_cast<size_t>(slot_)];
  ready_for_backward_.assign(static_cast<size_t>(slots_), 0);
  num_counted_targets_.assign(static_cast<size_t>(slots_), 0);
  last_B_ = B;
  last_T_ = T;
  return Status::ok();
}

// Under tensor parallelism the QKV and first MLP linear produce this rank's heads and hidden units (A = C/t,
// F = 4C/t wide), and the attention output and second MLP linear its partial sums of the (B,T,C) outputs, with
// the bias added on rank 0 only, summed over the group (sequence parallelism: the linears' inputs gathered from
// the ranks' rows, their outputs reduce-scattered to them).
Status GPT2::block_forward(int l, const offload::UnitView& unit, const float* residual, int B, int T) {
  const int C = config_.n_embd, A = attn_width_, NH = heads_, F = mlp_width_;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = static_cast<size_t>(Nr) * C;
  const BlockParams w = block_params(l, unit.params);
  auto weight = [&unit](const float* t) { return linear_weight(unit, t); };
  const size_t a = act_layer(l);
  void* ln1 = hidden_layer(acts_.ln1, a, Nr, C);
  float* ln1_mean = acts_.ln1_mean + a * Nr;
  float* ln1_rstd = acts_.ln1_rstd + a * Nr;
  void* qkv = hidden_layer(acts_.qkv, a, N, 3 * A);
  void* atty = hidden_layer(acts_.atty, a, N, A);
  float* att = acts_.att + a * k_->attention_saved_floats(B, T, A, NH, precision_);
  float* attproj = acts_.attproj + a * RC;
  float* residual2 = acts_.residual2 + a * RC;
  void* ln2 = hidden_layer(acts_.ln2, a, Nr, C);
  float* ln2_mean = acts_.ln2_mean + a * Nr;
  float* ln2_rstd = acts_.ln2_rstd + a * Nr;
  void* fch = hidden_layer(acts_.fch, a, N);
  void* fch_gelu = hidden_layer(acts_.fch_gelu, a, N);
  float* fcproj = acts_.fcproj + a * RC;
  float* residual3 = block_output(l, RC);
  const bool adds_bias = tp_rank_ == 0;  // of the row-parallel linears

  k_->layernorm_forward(ln1, ln1_mean, ln1_rstd, residual, w.ln1w, w.ln1b, Nr, C, precision_);
  STRATA_ASSIGN_OR_RETURN(const void* ln1_in, gather_hidden_rows(ln1, Nr, C));
  k_->matmul_forward_to_hidden(qkv, ln1_in, weight(w.qkvw), w.qkvb, N, C, 3 * A, precision_);
  k_->attention_forward(atty, att, qkv, B, T, A, NH, NH, precision_);
  float* partial = partial_for(attproj);
  k_->matmul_forward_hidden(partial, atty, weight(w.attprojw), adds_bias ? w.attprojb : nullptr, N, A, C,
                            precision_);
  STRATA_RETURN_IF_ERROR(reduce_rows(partial, attproj, RC));
  k_->residual_layernorm_forward(residual2, ln2, ln2_mean, ln2_rstd, residual, attproj, w.ln2w, w.ln2b, Nr, C,
                                 precision_);
  STRATA_ASSIGN_OR_RETURN(const void* ln2_in, gather_hidden_rows(ln2, Nr, C));
  k_->matmul_gelu_forward(fch_gelu, fch, ln2_in, weight(w.fcw), w.fcb, N, C, F, precision_);
  partial = partial_for(fcproj);
  k_->matmul_forward_hidden(partial, fch_gelu, weight(w.fcprojw), adds_bias ? w.fcprojb : nullptr, N, F, C,
                            precision_);
  STRATA_RETURN_IF_ERROR(reduce_rows(partial, fcproj, RC));
  k_->residual_forward(residual3, residual2, fcproj, RC);
  return Status::ok();
}

Result<float> GPT2::forward(const int32_t* inputs, const int32_t* targets, int B, int T) {
  return forward_stage(inputs, targets, nullptr, B, T);
}

const float* GPT2::stage_output() const {
  return block_output(stage_.end - 1, residual_floats(last_B_, last_T_));
}

const float* GPT2::stage_input_grad() const { return grads_.dres; }

Result<float> GPT2::forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B, int T) {
  trace::Span span("forward");
  if (B <= 0 || T <= 0) return Status::invalid_argument("forward: batch {}x{} is empty", B, T);
  if (T > config_.block_size) {
    return Status::invalid_argument("sequence length {} is longer than the model's context (model.block_size = {})",
                                    T, config_.block_size);
  }
  STRATA_RETURN_IF_ERROR(ensure_activations(B, T));
  const int V = config_.vocab_size;
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

Status GPT2::combine_vocab_parallel_losses(const int32_t* targets, int N) {
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
  const int64_t rows_per_rank = row_slice(config_.vocab_size, 0, tp_size_).count;
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

Status GPT2::forward_units(int B, int T, bool with_loss) {
  using offload::Pass;
  const int C = config_.n_embd, L = config_.n_layer;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = residual_floats(B, T);
  if (coordinator_ != nullptr) {
    coordinator_->set_step_is_one_pass(marks_steps_);
    if (marks_steps_) coordinator_->begin_step();
  }
  const size_t wpe_offset = units_[0].layout.specs()[1].offset;
  if (stage_.embedding) {
    // Vocab-parallel: each rank embeds the tokens of its rows (rank 0 adds the positions), summed over the group.
    STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kForward));
    float* partial = partial_for(acts_.encoded);
    k_->encoder_forward(partial, acts_.inputs, emb.params, tp_rank_ == 0 ? emb.params + wpe_offset : nullptr, B, T,
                        C, static_cast<int>(vocab_.start), static_cast<int>(vocab_.count));
    release(0, Pass::kForward);
    STRATA_RETURN_IF_ERROR(reduce_rows(partial, acts_.encoded, RC));
  }
  const float* residual = acts_.encoded;
  for (int l = stage_.first; l < stage_.end; ++l) {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView block, acquire(1 + l, Pass::kForward));
    const Status ran = block_forward(l, block, residual, B, T);
    release(1 + l, Pass::kForward);  // also after a failure: an acquired unit can be neither evicted nor written
    STRATA_RETURN_IF_ERROR(ran);
    residual = block_output(l, RC);
    if (checkpointing_ == ActivationCheckpointing::kHost && l + 1 < stage_.end)
      device_->copy_to_host(host_checkpoint(l, RC), residual, RC * sizeof(float));
  }
  if (!stage_.head) return Status::ok();
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView lnf, acquire(L + 1, Pass::kForward));
    k_->layernorm_forward(acts_.lnf, acts_.lnf_mean, acts_.lnf_rstd, residual, lnf.params, lnf.params + C, Nr, C,
                          precision_);
    release(L + 1, Pass::kForward);
  }
  // The LM head is tied to the token embedding: the embedding unit's second use (this rank's vocabulary columns).
  STRATA_ASSIGN_OR_RETURN(const void* lnf_in, gather_hidden_rows(acts_.lnf, Nr, C));
  STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kForward));
  k_->classifier_forward(acts_.logits, acts_.losses, acts_.lse, lnf_in, linear_weight(emb, emb.params),
                         with_loss ? acts_.targets : nullptr, N, C, static_cast<int>(vocab_.count),
                         static_cast<int>(vocab_.start), precision_);
  release(0, Pass::kForward);
  return Status::ok();
}

// The mirror of block_forward: each column-parallel linear's input gradient is this rank's part of the
// (B,T,C) sum, completed over the group before its layernorm's backward; the row-parallel linears' input
// gradients are this rank's slices already, and their biases' gradients the same on every rank. Under sequence
// parallelism `dres` is this rank's rows: gathered for the row-parallel linears' backward, and the input
// gradients reduce-scattered back to the rows; the linears' inputs are gathered again from the saved rows.
Status GPT2::block_backward(int l, const offload::UnitView& unit, const float* residual, float* dres, int B, int T) {
  const int C = config_.n_embd, A = attn_width_, NH = heads_, F = mlp_width_;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = static_cast<size_t>(Nr) * C;
  const BlockParams w = block_params(l, unit.params);
  const BlockParams dw = block_params(l, unit.grads);
  auto weight = [&unit](const float* t) { return linear_weight(unit, t); };
  const size_t a = act_layer(l);
  const void* ln1 = hidden_layer(acts_.ln1, a, Nr, C);
  const float* ln1_mean = acts_.ln1_mean + a * Nr;
  const float* ln1_rstd = acts_.ln1_rstd + a * Nr;
  const void* qkv = hidden_layer(acts_.qkv, a, N, 3 * A);
  const void* atty = hidden_layer(acts_.atty, a, N, A);
  const float* att = acts_.att + a * k_->attention_saved_floats(B, T, A, NH, precision_);
  const float* residual2 = acts_.residual2 + a * RC;
  const void* ln2 = hidden_layer(acts_.ln2, a, Nr, C);
  const float* ln2_mean = acts_.ln2_mean + a * Nr;
  const float* ln2_rstd = acts_.ln2_rstd + a * Nr;
  const void* fch = hidden_layer(acts_.fch, a, N);
  const void* fch_gelu = hidden_layer(acts_.fch_gelu, a, N);
  float* dln_rows = sp_ ? grads_.dln_rows : grads_.dln;

  // The residual adds pass dres through unchanged, so dres is used directly as the gradient of fcproj and of
  // attproj, and the layernorm backwards accumulate into it: no residual_backward copies are needed. dfch,
  // dln, datty and dqkv are each written by one op's backward, which overwrites them: nothing is zeroed.
  {
    // dfch is overwritten (dfch_gelu: the kernels' scratch).
    STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(dres, RC));
    k_->matmul_backward_gelu(grads_.dfch, dw.fcprojw, dw.fcprojb, dout, fch_gelu, fch, weight(w.fcprojw),
                             grads_.dfch_gelu, N, F, C, precision_);
  }
  {
    STRATA_ASSIGN_OR_RETURN(const void* ln2_in, gather_hidden_rows(ln2, Nr, C));
    k_->matmul_backward_set_hidden(grads_.dln, dw.fcw, dw.fcb, grads_.dfch, ln2_in, weight(w.fcw), N, C, F,
                                   precision_);
  }
  STRATA_RETURN_IF_ERROR(reduce_rows(grads_.dln, dln_rows, RC));
  STRATA_RETURN_IF_ERROR(
      layernorm_backward_rows(dres, dw.ln2w, dw.ln2b, dln_rows, residual2, w.ln2w, ln2_mean, ln2_rstd, Nr));

  {
    STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(dres, RC));
    k_->matmul_backward_hidden(grads_.datty, dw.attprojw, dw.attprojb, dout, atty, weight(w.attprojw), N, A, C,
                               precision_);
  }
  k_->attention_backward(grads_.dqkv, grads_.datty, qkv, atty, att, B, T, A, NH, NH, precision_);
  {
    STRATA_ASSIGN_OR_RETURN(const void* ln1_in, gather_hidden_rows(ln1, Nr, C));
    k_->matmul_backward_set_hidden(grads_.dln, dw.qkvw, dw.qkvb, grads_.dqkv, ln1_in, weight(w.qkvw), N, C, 3 * A,
                                   precision_);
  }
  STRATA_RETURN_IF_ERROR(reduce_rows(grads_.dln, dln_rows, RC));
  return layernorm_backward_rows(dres, dw.ln1w, dw.ln1b, dln_rows, residual, w.ln1w, ln1_mean, ln1_rstd, Nr);
}

Status GPT2::backward(float loss_scale) { return backward_stage(nullptr, loss_scale); }

Status GPT2::backward_stage(const float* dy, float loss_scale) {
  trace::Span span("backward");
  using offload::Pass;
  char& ready = ready_for_backward_[static_cast<size_t>(slot_)];
  STRATA_ASSERT_MSG(ready, "backward() needs a forward() with targets (of this slot)");
  ready = 0;  // the logits are overwritten below; a second backward would be wrong
  const int B = last_B_, T = last_T_;
  const int C = config_.n_embd, L = config_.n_layer;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t BTC = static_cast<size_t>(N) * C, RC = residual_floats(B, T);
  if (!stage_.head) {
    STRATA_ASSERT_MSG(dy != nullptr, "a pipeline stage before the last needs its output's gradient");
    device_->copy_on_device(grads_.dres, dy, sizeof(float) * RC);
    STRATA_RETURN_IF_ERROR(backward_blocks(B, T));
    return Status::ok();
  }
  const int counted = num_counted_targets_[static_cast<size_t>(slot_)];
  const float dloss = counted ? loss_scale / static_cast<float>(counted) : 0.0f;
  host_scratch_.assign(N, dloss);
  device_->copy_to_device(acts_.dlosses, host_scratch_.data(), sizeof(float) * N);
  const int Vr = static_cast<int>(vocab_.count);

  device_->zero(grads_.dln, sizeof(float) * BTC);
  device_->zero(grads_.dres, sizeof(float) * RC);
  float* dln_rows = sp_ ? grads_.dln_rows : grads_.dln;
  {
    STRATA_ASSIGN_OR_RETURN(const void* lnf_in, gather_hidden_rows(acts_.lnf, Nr, C));
    STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kBackward));
    // In place: the logits become their gradient.
    k_->classifier_backward(grads_.dln, emb.grads, acts_.logits, acts_.lse, acts_.targets, acts_.dlosses, lnf_in,
                            linear_weight(emb, emb.params), N, C, Vr, static_cast<int>(vocab_.start), precision_);
    release(0, Pass::kBackward);
    STRATA_RETURN_IF_ERROR(reduce_rows(grads_.dln, dln_rows, RC));  // each rank's columns' part of dlnf
  }
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView lnf, acquire(L + 1, Pass::kBackward));
    const float* last_residual = block_output(stage_.end - 1, RC);
    const Status done = layernorm_backward_rows(grads_.dres, lnf.grads, lnf.grads + C, dln_rows, last_residual,
                                                lnf.params, acts_.lnf_mean, acts_.lnf_rstd, Nr);
    release(L + 1, Pass::kBackward);
    STRATA_RETURN_IF_ERROR(done);
    grads_done(L + 1);
  }
  return backward_blocks(B, T);
}

// The stage's blocks in reverse, from the residual stream's gradient in grads_.dres (left there as the
// stage input's gradient), then the embedding on the first stage.
Status GPT2::backward_blocks(int B, int T) {
  using offload::Pass;
  const int C = config_.n_embd;
  const size_t RC = residual_floats(B, T);
  for (int l = stage_.end - 1; l >= stage_.first; --l) {
    const float* residual = l == stage_.first ? acts_.encoded : block_output(l - 1, RC);
    STRATA_ASSIGN_OR_RETURN(offload::UnitView block, acquire(1 + l, Pass::kBackward));
    Status ran;
    if (checkpointing_ != ActivationCheckpointing::kNone && l + 1 < stage_.end) {
      // Recompute the block from its checkpoint (the last block's activations are still those of forward).
      if (checkpointing_ == ActivationCheckpointing::kHost && l > stage_.first)
        device_->copy_to_device(const_cast<float*>(residual), host_checkpoint(l - 1, RC), RC * sizeof(float));
      ran = block_forward(l, block, residual, B, T);
    }
    if (ran.is_ok()) ran = block_backward(l, block, residual, grads_.dres, B, T);
    release(1 + l, Pass::kBackward);  // as in forward
    STRATA_RETURN_IF_ERROR(ran);
    grads_done(1 + l);
  }
  if (!stage_.embedding) return Status::ok();
  // Every rank adds the same wpe gradient (wpe is replicated) and its own vocabulary rows', from every row.
  STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(grads_.dres, RC));
  STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kGradients));
  const size_t wpe_offset = units_[0].layout.specs()[1].offset;
  k_->encoder_backward(emb.grads, emb.grads + wpe_offset, dout, acts_.inputs, B, T, C,
                       static_cast<int>(vocab_.start), static_cast<int>(vocab_.count));
  release(0, Pass::kGradients);
  grads_done(0);
  return Status::ok();
}

double GPT2::flops_per_step(int B, int T) const {
  const double C = config_.n_embd, V = config_.vocab_size, L = config_.n_layer;
  const double tokens = static_cast<double>(B) * T;
  // Per token, forward: matmuls 2*(3C² + C² + 4C² + 4C²) per layer plus the head 2CV; causal attention
  // averages (T+1)/2 keys per query for QKᵀ and for AV: 2 * 2 * C * (T+1)/2 per layer.
  const double matmul = L * 2.0 * 12.0 * C * C + 2.0 * C * V;
  const double attention = L * 2.0 * C * (T + 1.0);
  return 3.0 * tokens * (matmul + attention);  // backward is twice the forward
}

double GPT2::palm_flops_per_step(int B, int T) const {
  const double C = config_.n_embd, L = config_.n_layer;
  const double n = static_cast<double>(whole_num_params()) - static_cast<double>(config_.block_size) * C;
  return static_cast<double>(B) * T * (6.0 * n + 12.0 * L * C * T);
}

}  // namespace strata::engine
