#include "engine/model/gpt2/gpt2.h"

#include <algorithm>

#include "common/check.h"
#include "common/trace.h"

namespace strata::engine {

using kernels::MatmulPrecision;

Result<std::unique_ptr<GPT2>> GPT2::create(const GPT2Config& config, const kernels::KernelSet& cpu_kernels,
                                           MatmulPrecision precision) {
  return create_on_cpu<GPT2>(config, cpu_kernels, precision);
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
  std::unique_ptr<GPT2> m(new GPT2(config, device, precision));
  m->attn_width_ = config.n_embd / t;
  m->heads_ = config.n_head / t;
  m->mlp_width_ = 4 * config.n_embd / t;
  const DecoderShape shape{.width = config.n_embd,
                           .vocab = config.vocab_size,
                           .layers = config.n_layer,
                           .context = config.block_size,
                           .context_key = "model.block_size",
                           .norm = NormKind::kLayerNorm,
                           .positions = true};
  STRATA_RETURN_IF_ERROR(
      m->build(shape, offloaded, stage, tp, sequence_parallel, gpt2_unit_specs(config), gpt2_tensor_split));
  return m;
}

GPT2::BlockParams GPT2::block_params(int l, const float* cbase) const {
  const Unit& u = units_[1 + l];
  float* base = const_cast<float*>(cbase);
  const auto& s = u.layout.specs();  // in the canonical order of create()
  return BlockParams{base + s[0].offset, base + s[1].offset, base + s[2].offset,  base + s[3].offset,
                     base + s[4].offset, base + s[5].offset, base + s[6].offset,  base + s[7].offset,
                     base + s[8].offset, base + s[9].offset, base + s[10].offset, base + s[11].offset};
}

std::vector<size_t> GPT2::layer_activation_floats(int B, int T) const {
  const int N = B * T, Nr = static_cast<int>(rows_here(N)), C = config_.n_embd, A = attn_width_;
  const size_t RC = static_cast<size_t>(Nr) * C, ln = hidden_floats(Nr, C);
  std::vector<size_t> f(kLayerActs);
  f[kLn1] = f[kLn2] = ln;
  f[kLn1Mean] = f[kLn1Rstd] = f[kLn2Mean] = f[kLn2Rstd] = static_cast<size_t>(Nr);
  f[kQkv] = hidden_floats(N, 3 * A);
  f[kAtty] = hidden_floats(N, A);
  f[kAtt] = k_->attention_saved_floats(B, T, A, heads_, precision_);
  f[kAttproj] = f[kResidual2] = f[kFcproj] = RC;
  f[kFch] = f[kFchGelu] = hidden_floats(N, mlp_width_);
  return f;
}

std::vector<size_t> GPT2::block_scratch_floats(int B, int T) const {
  const int N = B * T;
  std::vector<size_t> f(kScratch);
  f[kDatty] = hidden_floats(N, attn_width_);
  f[kDqkv] = hidden_floats(N, 3 * attn_width_);
  f[kDfch] = f[kDfchGelu] = hidden_floats(N, mlp_width_);
  return f;
}

// Under tensor parallelism the QKV and first MLP linear produce this rank's heads and hidden units (A = C/t,
// F = 4C/t wide), and the attention output and second MLP linear its partial sums of the (B,T,C) outputs, with
// the bias added on rank 0 only, summed over the group (sequence parallelism: the linears' inputs gathered from
// the ranks' rows, their outputs reduce-scattered to them).
Status GPT2::block_forward(int l, const offload::UnitView& unit, const float* residual, float* out, int B, int T) {
  const int C = config_.n_embd, A = attn_width_, NH = heads_, F = mlp_width_;
  const int N = B * T, Nr = static_cast<int>(rows_here(N));
  const size_t RC = static_cast<size_t>(Nr) * C;
  const BlockParams w = block_params(l, unit.params);
  auto weight = [&unit](const float* t) { return linear_weight(unit, t); };
  const size_t a = act_layer(l);
  void* ln1 = layer_act(kLn1, a);
  float* ln1_mean = layer_act(kLn1Mean, a);
  float* ln1_rstd = layer_act(kLn1Rstd, a);
  void* qkv = layer_act(kQkv, a);
  void* atty = layer_act(kAtty, a);
  float* att = layer_act(kAtt, a);
  float* attproj = layer_act(kAttproj, a);
  float* residual2 = layer_act(kResidual2, a);
  void* ln2 = layer_act(kLn2, a);
  float* ln2_mean = layer_act(kLn2Mean, a);
  float* ln2_rstd = layer_act(kLn2Rstd, a);
  void* fch = layer_act(kFch, a);
  void* fch_gelu = layer_act(kFchGelu, a);
  float* fcproj = layer_act(kFcproj, a);
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
  k_->residual_forward(out, residual2, fcproj, RC);
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
  const void* ln1 = layer_act(kLn1, a);
  const float* ln1_mean = layer_act(kLn1Mean, a);
  const float* ln1_rstd = layer_act(kLn1Rstd, a);
  const void* qkv = layer_act(kQkv, a);
  const void* atty = layer_act(kAtty, a);
  const float* att = layer_act(kAtt, a);
  const float* residual2 = layer_act(kResidual2, a);
  const void* ln2 = layer_act(kLn2, a);
  const float* ln2_mean = layer_act(kLn2Mean, a);
  const float* ln2_rstd = layer_act(kLn2Rstd, a);
  const void* fch = layer_act(kFch, a);
  const void* fch_gelu = layer_act(kFchGelu, a);

  // The residual adds pass dres through unchanged, so dres is used directly as the gradient of fcproj and of
  // attproj, and the layernorm backwards accumulate into it: no residual_backward copies are needed. dfch,
  // dln, datty and dqkv are each written by one op's backward, which overwrites them: nothing is zeroed.
  {
    // dfch is overwritten (dfch_gelu: the kernels' scratch).
    STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(dres, RC));
    k_->matmul_backward_gelu(scratch(kDfch), dw.fcprojw, dw.fcprojb, dout, fch_gelu, fch, weight(w.fcprojw),
                             scratch(kDfchGelu), N, F, C, precision_);
  }
  {
    STRATA_ASSIGN_OR_RETURN(const void* ln2_in, gather_hidden_rows(ln2, Nr, C));
    k_->matmul_backward_set_hidden(dln(), dw.fcw, dw.fcb, scratch(kDfch), ln2_in, weight(w.fcw), N, C, F,
                                   precision_);
  }
  STRATA_RETURN_IF_ERROR(reduce_rows(dln(), dln_rows(), RC));
  STRATA_RETURN_IF_ERROR(
      norm_backward_rows(dres, dw.ln2w, dw.ln2b, dln_rows(), residual2, w.ln2w, ln2_mean, ln2_rstd, Nr));

  {
    STRATA_ASSIGN_OR_RETURN(const float* dout, gather_rows(dres, RC));
    k_->matmul_backward_hidden(scratch(kDatty), dw.attprojw, dw.attprojb, dout, atty, weight(w.attprojw), N, A, C,
                               precision_);
  }
  k_->attention_backward(scratch(kDqkv), scratch(kDatty), qkv, atty, att, B, T, A, NH, NH, precision_);
  {
    STRATA_ASSIGN_OR_RETURN(const void* ln1_in, gather_hidden_rows(ln1, Nr, C));
    k_->matmul_backward_set_hidden(dln(), dw.qkvw, dw.qkvb, scratch(kDqkv), ln1_in, weight(w.qkvw), N, C, 3 * A,
                                   precision_);
  }
  STRATA_RETURN_IF_ERROR(reduce_rows(dln(), dln_rows(), RC));
  return norm_backward_rows(dres, dw.ln1w, dw.ln1b, dln_rows(), residual, w.ln1w, ln1_mean, ln1_rstd, Nr);
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
