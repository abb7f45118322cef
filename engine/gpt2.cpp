#include "engine/gpt2.h"

#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/rng.h"

namespace strata::engine {

using kernels::MatmulPrecision;

Status GPT2Config::validate() const {
  auto positive = [](const char* name, int v) -> Status {
    if (v <= 0) return Status::invalid_argument("model.{} must be a positive integer, got {}", name, v);
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(positive("n_layer", n_layer));
  STRATA_RETURN_IF_ERROR(positive("n_head", n_head));
  STRATA_RETURN_IF_ERROR(positive("n_embd", n_embd));
  STRATA_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  STRATA_RETURN_IF_ERROR(positive("block_size", block_size));
  if (n_embd % n_head != 0)
    return Status::invalid_argument("model.n_embd ({}) must be divisible by model.n_head ({})", n_embd, n_head);
  if (vocab_size > 65536)
    return Status::invalid_argument("model.vocab_size ({}) must be <= 65536: token shards store uint16 ids",
                                    vocab_size);
  return Status::ok();
}

Result<std::unique_ptr<GPT2>> GPT2::create(const GPT2Config& config, const kernels::KernelSet& cpu_kernels,
                                           MatmulPrecision precision) {
  std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(cpu_kernels);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> m, create(config, *device, precision));
  m->owned_device_ = std::move(device);
  return m;
}

Result<std::unique_ptr<GPT2>> GPT2::create(const GPT2Config& config, kernels::Device& device,
                                           MatmulPrecision precision, bool offloaded, PipelineStage stage) {
  STRATA_RETURN_IF_ERROR(config.validate());
  if (stage.end < 0) stage.end = config.n_layer;
  if (stage.first < 0 || stage.first >= stage.end || stage.end > config.n_layer)
    return Status::invalid_argument("pipeline stage: blocks [{}, {}) are not a non-empty part of the {} layers",
                                    stage.first, stage.end, config.n_layer);
  std::unique_ptr<GPT2> m(new GPT2(config, device, precision));
  m->offloaded_ = offloaded;
  m->stage_ = stage;
  const int64_t C = config.n_embd, V = config.vocab_size, maxT = config.block_size;

  auto add_unit = [&](std::string name, FlatLayout layout) -> Status {
    Unit u;
    u.name = std::move(name);
    u.layout = std::move(layout);
    const size_t bytes = u.layout.numel() * sizeof(float);
    if (!offloaded && m->holds(m->units_.size())) {
      STRATA_ASSIGN_OR_RETURN(u.params, device.allocate(bytes, "gpt2.params " + u.name));
      STRATA_ASSIGN_OR_RETURN(u.grads, device.allocate(bytes, "gpt2.grads " + u.name));
    }
    m->units_.push_back(std::move(u));
    return Status::ok();
  };

  FlatLayout emb;
  emb.add("wte", {V, C});
  emb.add("wpe", {maxT, C});
  STRATA_RETURN_IF_ERROR(add_unit("wte", std::move(emb)));
  for (int l = 0; l < config.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    FlatLayout b;
    b.add(h + "ln_1.weight", {C});
    b.add(h + "ln_1.bias", {C});
    b.add(h + "attn.c_attn.weight", {3 * C, C});
    b.add(h + "attn.c_attn.bias", {3 * C});
    b.add(h + "attn.c_proj.weight", {C, C});
    b.add(h + "attn.c_proj.bias", {C});
    b.add(h + "ln_2.weight", {C});
    b.add(h + "ln_2.bias", {C});
    b.add(h + "mlp.c_fc.weight", {4 * C, C});
    b.add(h + "mlp.c_fc.bias", {4 * C});
    b.add(h + "mlp.c_proj.weight", {C, 4 * C});
    b.add(h + "mlp.c_proj.bias", {C});
    STRATA_RETURN_IF_ERROR(add_unit("h." + std::to_string(l), std::move(b)));
  }
  FlatLayout lnf;
  lnf.add("ln_f.weight", {C});
  lnf.add("ln_f.bias", {C});
  STRATA_RETURN_IF_ERROR(add_unit("ln_f", std::move(lnf)));
  return m;
}

bool GPT2::holds(size_t u) const {
  const size_t L = static_cast<size_t>(config_.n_layer);
  if (u == 0) return stage_.embedding || stage_.head;
  if (u == L + 1) return stage_.head;
  return static_cast<int>(u - 1) >= stage_.first && static_cast<int>(u - 1) < stage_.end;
}

size_t GPT2::num_params() const {
  size_t n = 0;
  for (const Unit& u : units_) n += u.numel();
  return n;
}

Status GPT2::init_gpt2(uint64_t seed) {
  Rng rng(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * config_.n_layer);
  std::vector<float> host;
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = units_[i];
    host.assign(u.numel(), 0.0f);
    for (const TensorSpec& s : u.layout.specs()) {
      float* p = host.data() + s.offset;
      const size_t n = s.numel();
      const bool is_norm_weight = s.name.find("ln_") != std::string::npos && s.name.ends_with(".weight");
      if (s.shape.size() >= 2) {
        const bool residual_proj = s.name.ends_with("c_proj.weight");
        const double std = residual_proj ? residual_std : 0.02;
        for (size_t j = 0; j < n; ++j) p[j] = static_cast<float>(std * rng.normal());
      } else {
        const float v = is_norm_weight ? 1.0f : 0.0f;
        for (size_t j = 0; j < n; ++j) p[j] = v;
      }
    }
    STRATA_RETURN_IF_ERROR(write_params(i, host.data()));
  }
  return Status::ok();
}

Status GPT2::read_params(size_t u, float* host) const {
  STRATA_ASSERT(u < units_.size());
  if (!holds(u)) {
    if (params_source_) return params_source_(u, host);
    return Status::internal("unit '{}' belongs to another pipeline stage", units_[u].name);
  }
  if (coordinator_ != nullptr) return coordinator_->read_params(u, host);
  STRATA_ASSERT_MSG(!offloaded_, "an offloaded model needs set_coordinator()");
  device_->copy_to_host(host, units_[u].p(), units_[u].numel() * sizeof(float));
  return Status::ok();
}

Status GPT2::write_params(size_t u, const float* host) {
  STRATA_ASSERT(u < units_.size());
  if (!holds(u)) return Status::ok();  // another stage's
  if (coordinator_ != nullptr) return coordinator_->write_params(u, host);
  STRATA_ASSERT_MSG(!offloaded_, "an offloaded model needs set_coordinator()");
  device_->copy_to_device(units_[u].p(), host, units_[u].numel() * sizeof(float));
  return Status::ok();
}

Result<offload::UnitView> GPT2::acquire(size_t u, offload::Pass pass) {
  if (coordinator_ != nullptr) return coordinator_->acquire(u, pass);
  STRATA_ASSERT_MSG(!offloaded_, "an offloaded model needs set_coordinator()");
  return offload::UnitView{units_[u].p(), units_[u].g()};
}

void GPT2::release(size_t u, offload::Pass pass) {
  if (coordinator_ != nullptr) coordinator_->release(u, pass);
}

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
  const size_t C = config_.n_embd, V = config_.vocab_size;
  // Per-layer activations: every layer's of this stage, or with checkpointing one layer's (recomputed in
  // backward).
  const size_t layers = static_cast<size_t>(stage_.end - stage_.first);
  const size_t L = checkpointing_ == ActivationCheckpointing::kNone ? layers : 1;
  // Block outputs: every layer's (they are the checkpoints), or two alternating ones when the checkpoints live
  // in host memory.
  const size_t R = checkpointing_ == ActivationCheckpointing::kHost ? std::min<size_t>(2, layers) : layers;
  const size_t BT = static_cast<size_t>(B) * T;
  const size_t att_floats = k_->attention_saved_floats(B, T, config_.n_embd, config_.n_head, precision_);
  // Sizes in floats, in the order of the Activations struct, then the per-block gradient scratch.
  const size_t sizes[] = {
      BT * C,                                  // encoded
      L * BT * C, L * BT, L * BT,              // ln1, ln1_mean, ln1_rstd
      L * BT * 3 * C,                          // qkv
      L * BT * C,                              // atty
      L * att_floats,                          // att: what attention saves for backward
      L * BT * C, L * BT * C,                  // attproj, residual2
      L * BT * C, L * BT, L * BT,              // ln2, ln2_mean, ln2_rstd
      L * BT * 4 * C, L * BT * 4 * C,          // fch, fch_gelu
      L * BT * C, R * BT * C,                  // fcproj, residual3
      BT * C, BT, BT,                          // lnf, lnf_mean, lnf_rstd
      stage_.head ? BT * V : 0, BT, BT, BT,    // logits (the head's stage only), losses, lse, dlosses
      BT, BT,                                  // inputs, targets (int32, same size as float)
      BT * C, BT * C, BT * C, BT * 3 * C, BT * 4 * C, BT * 4 * C,  // dres, dln, datty, dqkv, dfch, dfch_gelu
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
    const size_t bytes = static_cast<size_t>(slots_) * (layers - 1) * BT * C * sizeof(float);
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
                     &grads_.dres, &grads_.dln, &grads_.datty, &grads_.dqkv, &grads_.dfch, &grads_.dfch_gelu};
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

void GPT2::block_forward(int l, const float* params, const float* residual, int B, int T) {
  const int C = config_.n_embd, NH = config_.n_head;
  const int N = B * T;
  const size_t BTC = static_cast<size_t>(N) * C;
  const BlockParams w = block_params(l, params);
  const size_t a = act_layer(l);
  float* ln1 = acts_.ln1 + a * BTC;
  float* ln1_mean = acts_.ln1_mean + a * N;
  float* ln1_rstd = acts_.ln1_rstd + a * N;
  float* qkv = acts_.qkv + a * BTC * 3;
  float* atty = acts_.atty + a * BTC;
  float* att = acts_.att + a * k_->attention_saved_floats(B, T, C, NH, precision_);
  float* attproj = acts_.attproj + a * BTC;
  float* residual2 = acts_.residual2 + a * BTC;
  float* ln2 = acts_.ln2 + a * BTC;
  float* ln2_mean = acts_.ln2_mean + a * N;
  float* ln2_rstd = acts_.ln2_rstd + a * N;
  float* fch = acts_.fch + a * BTC * 4;
  float* fch_gelu = acts_.fch_gelu + a * BTC * 4;
  float* fcproj = acts_.fcproj + a * BTC;
  float* residual3 = block_output(l, BTC);

  k_->layernorm_forward(ln1, ln1_mean, ln1_rstd, residual, w.ln1w, w.ln1b, N, C);
  k_->matmul_forward(qkv, ln1, w.qkvw, w.qkvb, N, C, 3 * C, precision_);
  k_->attention_forward(atty, att, qkv, B, T, C, NH, precision_);
  k_->matmul_forward(attproj, atty, w.attprojw, w.attprojb, N, C, C, precision_);
  k_->residual_forward(residual2, residual, attproj, BTC);
  k_->layernorm_forward(ln2, ln2_mean, ln2_rstd, residual2, w.ln2w, w.ln2b, N, C);
  k_->matmul_forward(fch, ln2, w.fcw, w.fcb, N, C, 4 * C, precision_);
  k_->gelu_forward(fch_gelu, fch, BTC * 4);
  k_->matmul_forward(fcproj, fch_gelu, w.fcprojw, w.fcprojb, N, 4 * C, C, precision_);
  k_->residual_forward(residual3, residual2, fcproj, BTC);
}

Result<float> GPT2::forward(const int32_t* inputs, const int32_t* targets, int B, int T) {
  return forward_stage(inputs, targets, nullptr, B, T);
}

const float* GPT2::stage_output() const {
  return block_output(stage_.end - 1, static_cast<size_t>(last_B_) * last_T_ * config_.n_embd);
}

const float* GPT2::stage_input_grad() const { return grads_.dres; }

Result<float> GPT2::forward_stage(const int32_t* inputs, const int32_t* targets, const float* x_in, int B, int T) {
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
    device_->copy_to_device(acts_.encoded, x_in, sizeof(float) * N * config_.n_embd);
  }

  char& ready = ready_for_backward_[static_cast<size_t>(slot_)];
  ready = 0;  // until this forward has succeeded
  STRATA_RETURN_IF_ERROR(forward_units(B, T));

  if (!stage_.head) {  // the next stage takes it from here; a backward may follow
    ready = 1;
    return 0.0f;
  }
  ready = targets != nullptr;
  if (!ready) return 0.0f;
  int& counted = num_counted_targets_[static_cast<size_t>(slot_)];
  counted = 0;
  for (int i = 0; i < N; ++i) {
    STRATA_ASSERT(targets[i] < V);
    if (targets[i] >= 0) ++counted;
  }
  device_->copy_to_device(acts_.targets, targets, sizeof(int32_t) * N);
  k_->softmax_crossentropy_forward(acts_.losses, acts_.lse, acts_.logits, acts_.targets, N, V, 0);
  // Summed in double and in a fixed order so the loss does not depend on the kernels' threading.
  host_scratch_.resize(N);
  device_->copy_to_host(host_scratch_.data(), acts_.losses, sizeof(float) * N);
  double sum = 0.0;
  for (int i = 0; i < N; ++i) sum += host_scratch_[i];
  return counted ? static_cast<float>(sum / counted) : 0.0f;
}

Status GPT2::forward_units(int B, int T) {
  using offload::Pass;
  const int C = config_.n_embd, V = config_.vocab_size, L = config_.n_layer;
  const int N = B * T;
  const size_t BTC = static_cast<size_t>(N) * C;
  if (coordinator_ != nullptr && marks_steps_) coordinator_->begin_step();
  const size_t wpe_offset = units_[0].layout.specs()[1].offset;
  if (stage_.embedding) {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kForward));
    k_->encoder_forward(acts_.encoded, acts_.inputs, emb.params, emb.params + wpe_offset, B, T, C, 0, V);
    release(0, Pass::kForward);
  }
  const float* residual = acts_.encoded;
  for (int l = stage_.first; l < stage_.end; ++l) {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView block, acquire(1 + l, Pass::kForward));
    block_forward(l, block.params, residual, B, T);
    release(1 + l, Pass::kForward);
    residual = block_output(l, BTC);
    if (checkpointing_ == ActivationCheckpointing::kHost && l + 1 < stage_.end)
      device_->copy_to_host(host_checkpoint(l, BTC), residual, BTC * sizeof(float));
  }
  if (!stage_.head) return Status::ok();
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView lnf, acquire(L + 1, Pass::kForward));
    k_->layernorm_forward(acts_.lnf, acts_.lnf_mean, acts_.lnf_rstd, residual, lnf.params, lnf.params + C, N, C);
    release(L + 1, Pass::kForward);
  }
  // The LM head is tied to the token embedding: the embedding unit's second use.
  STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kForward));
  k_->matmul_forward(acts_.logits, acts_.lnf, emb.params, nullptr, N, C, V, precision_);
  release(0, Pass::kForward);
  return Status::ok();
}

void GPT2::block_backward(int l, const offload::UnitView& unit, const float* residual, float* dres, int B, int T) {
  const int C = config_.n_embd, NH = config_.n_head;
  const int N = B * T;
  const size_t BTC = static_cast<size_t>(N) * C;
  const BlockParams w = block_params(l, unit.params);
  const BlockParams dw = block_params(l, unit.grads);
  const size_t a = act_layer(l);
  const float* ln1 = acts_.ln1 + a * BTC;
  const float* ln1_mean = acts_.ln1_mean + a * N;
  const float* ln1_rstd = acts_.ln1_rstd + a * N;
  const float* qkv = acts_.qkv + a * BTC * 3;
  const float* atty = acts_.atty + a * BTC;
  const float* att = acts_.att + a * k_->attention_saved_floats(B, T, C, NH, precision_);
  const float* residual2 = acts_.residual2 + a * BTC;
  const float* ln2 = acts_.ln2 + a * BTC;
  const float* ln2_mean = acts_.ln2_mean + a * N;
  const float* ln2_rstd = acts_.ln2_rstd + a * N;
  const float* fch = acts_.fch + a * BTC * 4;
  const float* fch_gelu = acts_.fch_gelu + a * BTC * 4;

  // The residual adds pass dres through unchanged, so dres is used directly as the gradient of fcproj and of
  // attproj, and the layernorm backwards accumulate into it: no residual_backward copies are needed.
  device_->zero(grads_.dfch_gelu, sizeof(float) * BTC * 4);
  device_->zero(grads_.dfch, sizeof(float) * BTC * 4);
  device_->zero(grads_.dln, sizeof(float) * BTC);
  k_->matmul_backward(grads_.dfch_gelu, dw.fcprojw, dw.fcprojb, dres, fch_gelu, w.fcprojw, N, 4 * C, C, precision_);
  k_->gelu_backward(grads_.dfch, fch, grads_.dfch_gelu, BTC * 4);
  k_->matmul_backward(grads_.dln, dw.fcw, dw.fcb, grads_.dfch, ln2, w.fcw, N, C, 4 * C, precision_);
  k_->layernorm_backward(dres, dw.ln2w, dw.ln2b, grads_.dln, residual2, w.ln2w, ln2_mean, ln2_rstd, N, C);

  device_->zero(grads_.datty, sizeof(float) * BTC);
  device_->zero(grads_.dqkv, sizeof(float) * BTC * 3);
  device_->zero(grads_.dln, sizeof(float) * BTC);
  k_->matmul_backward(grads_.datty, dw.attprojw, dw.attprojb, dres, atty, w.attprojw, N, C, C, precision_);
  k_->attention_backward(grads_.dqkv, grads_.datty, qkv, att, B, T, C, NH, precision_);
  k_->matmul_backward(grads_.dln, dw.qkvw, dw.qkvb, grads_.dqkv, ln1, w.qkvw, N, C, 3 * C, precision_);
  k_->layernorm_backward(dres, dw.ln1w, dw.ln1b, grads_.dln, residual, w.ln1w, ln1_mean, ln1_rstd, N, C);
}

Status GPT2::backward(float loss_scale) { return backward_stage(nullptr, loss_scale); }

Status GPT2::backward_stage(const float* dy, float loss_scale) {
  using offload::Pass;
  char& ready = ready_for_backward_[static_cast<size_t>(slot_)];
  STRATA_ASSERT_MSG(ready, "backward() needs a forward() with targets (of this slot)");
  ready = 0;  // the logits are overwritten below; a second backward would be wrong
  const int B = last_B_, T = last_T_;
  const int C = config_.n_embd, V = config_.vocab_size, L = config_.n_layer;
  const int N = B * T;
  const size_t BTC = static_cast<size_t>(N) * C;
  if (!stage_.head) {
    STRATA_ASSERT_MSG(dy != nullptr, "a pipeline stage before the last needs its output's gradient");
    device_->copy_to_device(grads_.dres, dy, sizeof(float) * BTC);
    STRATA_RETURN_IF_ERROR(backward_blocks(B, T));
    return Status::ok();
  }
  const int counted = num_counted_targets_[static_cast<size_t>(slot_)];
  const float dloss = counted ? loss_scale / static_cast<float>(counted) : 0.0f;
  host_scratch_.assign(N, dloss);
  device_->copy_to_device(acts_.dlosses, host_scratch_.data(), sizeof(float) * N);
  // In place: the logits become dlogits.
  float* dlogits = acts_.logits;
  k_->softmax_crossentropy_backward(dlogits, acts_.logits, acts_.lse, acts_.targets, acts_.dlosses, N, V, 0);

  device_->zero(grads_.dln, sizeof(float) * BTC);
  device_->zero(grads_.dres, sizeof(float) * BTC);
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kBackward));
    k_->matmul_backward(grads_.dln, emb.grads, nullptr, dlogits, acts_.lnf, emb.params, N, C, V, precision_);
    release(0, Pass::kBackward);
  }
  {
    STRATA_ASSIGN_OR_RETURN(offload::UnitView lnf, acquire(L + 1, Pass::kBackward));
    const float* last_residual = block_output(stage_.end - 1, BTC);
    k_->layernorm_backward(grads_.dres, lnf.grads, lnf.grads + C, grads_.dln, last_residual, lnf.params,
                           acts_.lnf_mean, acts_.lnf_rstd, N, C);
    release(L + 1, Pass::kBackward);
    if (on_grads_done_) on_grads_done_(L + 1);
  }
  return backward_blocks(B, T);
}

// The stage's blocks in reverse, from the residual stream's gradient in grads_.dres (left there as the
// stage input's gradient), then the embedding on the first stage.
Status GPT2::backward_blocks(int B, int T) {
  using offload::Pass;
  const int C = config_.n_embd;
  const size_t BTC = static_cast<size_t>(B) * T * C;
  for (int l = stage_.end - 1; l >= stage_.first; --l) {
    const float* residual = l == stage_.first ? acts_.encoded : block_output(l - 1, BTC);
    STRATA_ASSIGN_OR_RETURN(offload::UnitView block, acquire(1 + l, Pass::kBackward));
    if (checkpointing_ != ActivationCheckpointing::kNone && l + 1 < stage_.end) {
      // Recompute the block from its checkpoint (the last block's activations are still those of forward).
      if (checkpointing_ == ActivationCheckpointing::kHost && l > stage_.first)
        device_->copy_to_device(const_cast<float*>(residual), host_checkpoint(l - 1, BTC), BTC * sizeof(float));
      block_forward(l, block.params, residual, B, T);
    }
    block_backward(l, block, residual, grads_.dres, B, T);
    release(1 + l, Pass::kBackward);
    if (on_grads_done_) on_grads_done_(1 + l);
  }
  if (!stage_.embedding) return Status::ok();
  STRATA_ASSIGN_OR_RETURN(offload::UnitView emb, acquire(0, Pass::kGradients));
  const size_t wpe_offset = units_[0].layout.specs()[1].offset;
  k_->encoder_backward(emb.grads, emb.grads + wpe_offset, grads_.dres, acts_.inputs, B, T, C, 0,
                       config_.vocab_size);
  release(0, Pass::kGradients);
  if (on_grads_done_) on_grads_done_(0);
  return Status::ok();
}

Status GPT2::zero_grads() {
  if (coordinator_ != nullptr) return coordinator_->zero_grads();
  for (size_t i = 0; i < units_.size(); ++i)
    if (holds(i)) device_->zero(units_[i].g(), units_[i].numel() * sizeof(float));
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

}  // namespace strata::engine
