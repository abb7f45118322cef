// The Llama family's blocks over the decoder runtime (llama.h).
#include "engine/model/llama/llama.h"

#include <cmath>
#include <memory>

#include "common/check.h"
#include "engine/model/seeded_init.h"

namespace strata::engine {

using kernels::MatmulPrecision;

Result<std::unique_ptr<Llama>> Llama::create(const LlamaConfig& config, const kernels::KernelSet& cpu_kernels,
                                             MatmulPrecision precision) {
  return create_on_cpu<Llama>(config, cpu_kernels, precision);
}

Result<std::unique_ptr<Llama>> Llama::create(const LlamaConfig& config, kernels::Device& device,
                                             MatmulPrecision precision, bool offloaded, PipelineStage stage,
                                             comm::Communicator* tp, bool sequence_parallel) {
  STRATA_RETURN_IF_ERROR(config.validate());
  const kernels::KernelSet& k = device.kernels();
  const bool has_ops = k.rmsnorm_forward != nullptr && k.rmsnorm_backward != nullptr &&
                       k.residual_rmsnorm_forward != nullptr && k.rope_forward != nullptr &&
                       k.rope_backward != nullptr && k.swiglu_forward != nullptr && k.swiglu_backward != nullptr &&
                       (!config.qk_norm() || (k.qk_norm_forward != nullptr && k.qk_norm_backward != nullptr));
  if (!has_ops) {
    return Status::unimplemented(
        "the {} backend has no kernels for the Llama family's RMSNorm, RoPE, SwiGLU or QK-norm yet (docs/gpu.md): "
        "train it with compute.device \"cpu\"",
        k.name);
  }
  const int t = tp != nullptr ? tp->size() : 1;
  if (t > 1) {
    for (auto [key, value] : {std::pair{"num_attention_heads", config.num_attention_heads},
                              std::pair{"num_key_value_heads", config.num_key_value_heads},
                              std::pair{"intermediate_size", config.intermediate_size}}) {
      if (value % t != 0) {
        return Status::invalid_argument(
            "model.{} ({}) must be divisible by parallel.tensor_parallel_size ({}): each rank takes an equal share",
            key, value, t);
      }
    }
  }
  std::unique_ptr<Llama> m(new Llama(config, device, precision));
  const int hs = config.head_size();
  m->heads_ = config.num_attention_heads / t;
  m->kv_heads_ = config.num_key_value_heads / t;
  m->attn_width_ = m->heads_ * hs;
  m->qkv_width_ = (m->heads_ + 2 * m->kv_heads_) * hs;
  m->mlp_width_ = config.intermediate_size / t;
  const DecoderShape shape{.width = config.hidden_size,
                           .vocab = config.vocab_size,
                           .layers = config.num_hidden_layers,
                           .context = config.max_position_embeddings,
                           .context_key = "model.max_position_embeddings",
                           .norm = NormKind::kRMSNorm,
                           .norm_eps = config.rms_norm_eps,
                           .positions = false};
  STRATA_RETURN_IF_ERROR(
      m->build(shape, offloaded, stage, tp, sequence_parallel, llama_unit_specs(config), llama_tensor_split));
  // In the order of BlockParams.
  static constexpr const char* kBlockTensors[10] = {
      "input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.q_proj.bias",
      "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight",
      "self_attn.o_proj.bias",   "post_attention_layernorm.weight", "mlp.gate_proj.weight",
      "mlp.down_proj.weight"};
  for (size_t i = 0; i < 10; ++i) {
    const TensorSpec* s = m->units_[1].layout.find(std::string("model.layers.0.") + kBlockTensors[i]);
    m->block_offsets_[i] = s != nullptr ? s->offset : kNone;
  }
  std::vector<float> cos, sin;
  llama_rope_tables(config, config.max_position_embeddings, &cos, &sin);
  const size_t bytes = cos.size() * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(m->rope_cos_, device.allocate(bytes, "llama.rope_cos"));
  STRATA_ASSIGN_OR_RETURN(m->rope_sin_, device.allocate(bytes, "llama.rope_sin"));
  device.copy_to_device(m->rope_cos_.as<float>(), cos.data(), bytes);
  device.copy_to_device(m->rope_sin_.as<float>(), sin.data(), bytes);
  return m;
}

Llama::BlockParams Llama::block_params(const float* cbase) const {
  float* base = const_cast<float*>(cbase);
  float* p[10];
  for (size_t i = 0; i < 10; ++i) p[i] = block_offsets_[i] == kNone ? nullptr : base + block_offsets_[i];
  return BlockParams{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9]};
}

std::vector<size_t> Llama::layer_activation_floats(int B, int T) const {
  const int N = B * T, Nr = static_cast<int>(rows_here(N)), C = config_.hidden_size;
  const size_t RC = static_cast<size_t>(Nr) * C;
  const bool qk = config_.qk_norm();
  std::vector<size_t> f(kLayerActs);
  f[kLn1] = f[kLn2] = hidden_floats(Nr, C);
  f[kLn1Rstd] = f[kLn2Rstd] = static_cast<size_t>(Nr);
  f[kQkvRaw] = qk ? hidden_floats(N, qkv_width_) : 0;
  f[kQkRstd] = qk ? static_cast<size_t>(N) * (heads_ + kv_heads_) : 0;
  f[kQkv] = hidden_floats(N, qkv_width_);
  f[kAtty] = hidden_floats(N, attn_width_);
  f[kAtt] = k_->attention_saved_floats(B, T, attn_width_, heads_, precision_);
  f[kAttproj] = f[kResidual2] = f[kMlpOut] = RC;
  f[kGateUp] = hidden_floats(N, 2 * mlp_width_);
  f[kSwiglu] = hidden_floats(N, mlp_width_);
  return f;
}

std::vector<size_t> Llama::block_scratch_floats(int B, int T) const {
  const int N = B * T;
  std::vector<size_t> f(kScratch);
  f[kDatty] = hidden_floats(N, attn_width_);
  f[kDqkv] = hidden_floats(N, qkv_width_);
  f[kDswiglu] = hidden_floats(N, mlp_width_);
  f[kDgateUp] = hidden_floats(N, 2 * mlp_width_);
  f[kDqkNorm] = tensor_parallel() && config_.qk_norm() ? 2 * static_cast<size_t>(config_.head_size()) : 0;
  return f;
}

// Under tensor parallelism the q/k/v and gate/up linears produce this rank's heads and hidden units, o_proj and
// down_proj its partial sums of the (B,T,C) outputs (o_proj's bias added on rank 0 only), summed over the group
// (sequence parallelism: the linears' inputs gathered from the ranks' rows, their outputs reduce-scattered).
Status Llama::block_forward(int l, const offload::UnitView& unit, const float* residual, float* out, int B, int T) {
  const int C = config_.hidden_size, hs = config_.head_size(), NH = heads_, NKV = kv_heads_;
  const int A = attn_width_, Q = qkv_width_, F = mlp_width_;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = static_cast<size_t>(Nr) * C;
  const BlockParams w = block_params(unit.params);
  auto weight = [&unit](const float* t) { return linear_weight(unit, t); };
  const size_t a = act_layer(l);
  void* ln1 = layer_act(kLn1, a);
  float* ln1_rstd = layer_act(kLn1Rstd, a);
  void* qkv = layer_act(kQkv, a);
  void* atty = layer_act(kAtty, a);
  float* attproj = layer_act(kAttproj, a);
  float* residual2 = layer_act(kResidual2, a);
  void* ln2 = layer_act(kLn2, a);
  float* ln2_rstd = layer_act(kLn2Rstd, a);
  void* gate_up = layer_act(kGateUp, a);
  void* swiglu = layer_act(kSwiglu, a);
  float* mlp_out = layer_act(kMlpOut, a);

  norm_forward(ln1, nullptr, ln1_rstd, residual, w.ln1w, nullptr, Nr);
  STRATA_ASSIGN_OR_RETURN(const void* ln1_in, gather_hidden_rows(ln1, Nr, C));
  if (config_.qk_norm()) {
    void* raw = layer_act(kQkvRaw, a);
    k_->matmul_forward_to_hidden(raw, ln1_in, weight(w.qkvw), w.qkvb, N, C, Q, precision_);
    k_->qk_norm_forward(qkv, layer_act(kQkRstd, a), raw, w.qnormw, w.knormw, N, NH, NKV, hs, config_.rms_norm_eps,
                        precision_);
  } else {
    k_->matmul_forward_to_hidden(qkv, ln1_in, weight(w.qkvw), w.qkvb, N, C, Q, precision_);
  }
  k_->rope_forward(qkv, rope_cos_.as<float>(), rope_sin_.as<float>(), B, T, NH, NKV, hs, precision_);
  k_->attention_forward(atty, layer_act(kAtt, a), qkv, B, T, A, NH, NKV, precision_);
  float* partial = partial_for(attproj);
  k_->matmul_forward_hidden(partial, atty, weight(w.ow), tp_rank_ == 0 ? w.ob : nullptr, N, A, C, precision_);
  STRATA_RETURN_IF_ERROR(reduce_rows(partial, attproj, RC));
  residual_norm_forward(residual2, ln2, nullptr, ln2_rstd, residual, attproj, w.ln2w, nullptr, Nr);
  STRATA_ASSIGN_OR_RETURN(const void* ln2_in, gather_hidden_rows(ln2, Nr, C));
  k_->matmul_forward_to_hidden(gate_up, ln2_in, weight(w.gateupw), nullptr, N, C, 2 * F, precision_);
  k_->swiglu_forward(swiglu, gate_up, N, F, precision_);
  partial = partial_for(mlp_out);
  k_->matmul_forward_hidden(partial, swiglu, weight(w.downw), nullptr, N, F, C, precision_);
  STRATA_RETURN_IF_ERROR(reduce_rows(partial, mlp_out, RC));
  k_->residual_forward(out, residual2, mlp_out, RC);
  return Status::ok();
}

// The mirror of block_forward, as GPT-2's: each column-parallel linear's input gradient is this rank's part of the
// (B,T,C) sum, completed over the group before its norm's backward; q_norm's and k_norm's gradients, partial over
// this rank's heads, are summed over it.
Status Llama::block_backward(int l, const offload::UnitView& unit, const float* residual, float* dres, int B,
                             int T) {
  const int C = config_.hidden_size, hs = config_.head_size(), NH = heads_, NKV = kv_heads_;
  const int A = attn_width_, Q = qkv_width_, F = mlp_width_;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = static_cast<size_t>(Nr) * C;
  const BlockParams w = block_params(unit.params);
  const BlockParams dw = block_params(unit.grads);
  auto weight = [&unit](const float* t) { return linear_weight(unit, t); };
  const size_t a = act_layer(l);
  void* dqkv = scratch(kDqkv);

  // As GPT-2's: dres is the gradient of mlp_out and of attproj as it stands, the norms' backwards add into it,
  // and every other gradient here is overwritten by the one op that writes it.
  {
    STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(dres, RC));
    k_->matmul_backward_hidden(scratch(kDswiglu), dw.downw, nullptr, dout, layer_act(kSwiglu, a), weight(w.downw),
                               N, F, C, precision_);
  }
  k_->swiglu_backward(scratch(kDgateUp), scratch(kDswiglu), layer_act(kGateUp, a), N, F, precision_);
  {
    STRATA_ASSIGN_OR_RETURN(const void* ln2_in, gather_hidden_rows(layer_act(kLn2, a), Nr, C));
    k_->matmul_backward_set_hidden(dln(), dw.gateupw, nullptr, scratch(kDgateUp), ln2_in, weight(w.gateupw), N, C,
                                   2 * F, precision_);
  }
  STRATA_RETURN_IF_ERROR(reduce_rows(dln(), dln_rows(), RC));
  STRATA_RETURN_IF_ERROR(norm_backward_rows(dres, dw.ln2w, nullptr, dln_rows(), layer_act(kResidual2, a), w.ln2w,
                                            nullptr, layer_act(kLn2Rstd, a), Nr));
  {
    STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(dres, RC));
    k_->matmul_backward_hidden(scratch(kDatty), dw.ow, dw.ob, dout, layer_act(kAtty, a), weight(w.ow), N, A, C,
                               precision_);
  }
  k_->attention_backward(dqkv, scratch(kDatty), layer_act(kQkv, a), layer_act(kAtty, a), layer_act(kAtt, a), B, T,
                         A, NH, NKV, precision_);
  k_->rope_backward(dqkv, rope_cos_.as<float>(), rope_sin_.as<float>(), B, T, NH, NKV, hs, precision_);
  if (config_.qk_norm()) {
    const void* raw = layer_act(kQkvRaw, a);
    const float* rstd = layer_act(kQkRstd, a);
    if (!tensor_parallel()) {
      k_->qk_norm_backward(dqkv, dw.qnormw, dw.knormw, dqkv, raw, w.qnormw, w.knormw, rstd, N, NH, NKV, hs,
                           precision_);
    } else {
      float* g = scratch(kDqkNorm);
      device_->zero(g, sizeof(float) * 2 * hs);
      k_->qk_norm_backward(dqkv, g, g + hs, dqkv, raw, w.qnormw, w.knormw, rstd, N, NH, NKV, hs, precision_);
      STRATA_RETURN_IF_ERROR(tp_all_reduce(g, 2 * static_cast<size_t>(hs)));
      k_->residual_forward(dw.qnormw, dw.qnormw, g, hs);
      k_->residual_forward(dw.knormw, dw.knormw, g + hs, hs);
    }
  }
  {
    STRATA_ASSIGN_OR_RETURN(const void* ln1_in, gather_hidden_rows(layer_act(kLn1, a), Nr, C));
    k_->matmul_backward_set_hidden(dln(), dw.qkvw, dw.qkvb, dqkv, ln1_in, weight(w.qkvw), N, C, Q, precision_);
  }
  STRATA_RETURN_IF_ERROR(reduce_rows(dln(), dln_rows(), RC));
  return norm_backward_rows(dres, dw.ln1w, nullptr, dln_rows(), residual, w.ln1w, nullptr, layer_act(kLn1Rstd, a),
                            Nr);
}

std::unique_ptr<WeightsInit> Llama::initial_weights(uint64_t seed) const {
  return std::make_unique<SeededInit>(
      *this, seed, [](const TensorSpec&) { return 0.02; },
      [](const TensorSpec& s) { return s.name.ends_with("norm.weight") ? 1.0f : 0.0f; }, "Llama");
}

double Llama::flops_per_step(int B, int T) const {
  const LlamaConfig& c = config_;
  const double C = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, L = c.num_hidden_layers;
  const double hs = c.head_size(), A = c.num_attention_heads * hs;
  const double Q = (c.num_attention_heads + 2.0 * c.num_key_value_heads) * hs;
  // Per token, forward: the linears 2(CQ + AC + 3CF) a layer and the head 2CV; causal attention 2·2·A·(T+1)/2.
  const double matmul = L * 2.0 * (C * Q + A * C + 3.0 * C * F) + 2.0 * C * V;
  const double attention = L * 2.0 * A * (T + 1.0);
  return 3.0 * static_cast<double>(B) * T * (matmul + attention);
}

double Llama::palm_flops_per_step(int B, int T) const {
  // N leaves out an untied embedding (a lookup, no matmul); a tied one is the head's weight too.
  const LlamaConfig& c = config_;
  const double embedding = c.tie_word_embeddings ? 0.0 : static_cast<double>(c.vocab_size) * c.hidden_size;
  const double n = static_cast<double>(whole_num_params()) - embedding;
  const double A = static_cast<double>(c.num_attention_heads) * c.head_size();
  return static_cast<double>(B) * T * (6.0 * n + 12.0 * c.num_hidden_layers * A * T);
}

}  // namespace strata::engine
