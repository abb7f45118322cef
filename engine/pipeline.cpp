#include "engine/pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "common/timer.h"

namespace strata::engine {
namespace {

// Between neighbours, activations only go forward and gradients only back, and MPI keeps each direction's
// messages in order: one tag serves both.
constexpr int kTagStage = 11, kTagParams = 13, kTagMoments = 14;

}  // namespace

PipelinePlan plan_pipeline(const GPT2Config& c, int seq_len, int stages) {
  const int L = c.n_layer;
  STRATA_ASSERT(stages >= 1 && stages <= L);
  const double C = c.n_embd;
  const double block = 24.0 * C * C + 2.0 * C * (seq_len + 1.0), head = 2.0 * C * c.vocab_size;
  // best[p][j]: the smallest largest stage cost splitting blocks [0, j) into p stages (the head on the last
  // stage of the whole plan only, added at the end); cut[p][j]: where the last of those p stages starts.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(L + 1, 0));
  best[0][0] = 0;
  for (int p = 1; p <= stages; ++p) {
    for (int j = p; j <= L; ++j) {
      for (int i = p - 1; i < j; ++i) {  // the p-th stage runs blocks [i, j)
        const double last = (j - i) * block + (p == stages && j == L ? head : 0.0);
        const double worst = std::max(best[p - 1][i], last);
        if (worst < best[p][j]) best[p][j] = worst, cut[p][j] = i;
      }
    }
  }
  PipelinePlan plan;
  plan.stages.resize(static_cast<size_t>(stages));
  plan.flops.resize(static_cast<size_t>(stages));
  for (int p = stages, j = L; p >= 1; j = cut[p][j], --p) {
    PipelineStage& st = plan.stages[static_cast<size_t>(p - 1)];
    st.first = cut[p][j];
    st.end = j;
    st.embedding = p == 1;
    st.head = p == stages;
    plan.flops[static_cast<size_t>(p - 1)] = (j - cut[p][j]) * block + (st.head ? head : 0.0);
  }
  return plan;
}

int PipelinePlan::owner(size_t u) const {
  if (u == 0) return 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    if (static_cast<int>(u) - 1 >= stages[s].first && static_cast<int>(u) - 1 < stages[s].end) return static_cast<int>(s);
  }
  return static_cast<int>(stages.size()) - 1;  // ln_f, after the last block
}

std::string PipelinePlan::describe() const {
  std::string blocks, cost;
  for (size_t s = 0; s < stages.size(); ++s) {
    const PipelineStage& st = stages[s];
    blocks += fmt::format("{}[{}, {}){}{}", s ? " | " : "", st.first, st.end, st.embedding ? " + embedding" : "",
                          st.head ? " + head" : "");
    cost += fmt::format("{}{:.3g}", s ? " | " : "", flops[s] / 1e9);
  }
  return "blocks " + blocks + "; forward GFLOP/token " + cost;
}

// ---- the schedule ----

PipelineRunner::PipelineRunner(GPT2& model, comm::Communicator& pp, PipelineSchedule schedule, int micro_batches,
                               int B, int T)
    : model_(model), pp_(pp), schedule_(schedule), m_(micro_batches), B_(B), T_(T), stage_(pp.rank()),
      stages_(pp.size()) {
  slots_ = schedule == PipelineSchedule::kGPipe ? m_ : std::min(stages_ - stage_, m_);
  model_.set_activation_slots(std::max(1, slots_));
  model_.set_marks_steps(false);  // a step of the offload trace is the whole schedule
  btc_ = model.residual_floats(B, T);  // this rank's rows of it under sequence parallelism
}

Result<std::unique_ptr<PipelineRunner>> PipelineRunner::create(GPT2& model, comm::Communicator& pp,
                                                               PipelineSchedule schedule, int micro_batches, int B,
                                                               int T) {
  std::unique_ptr<PipelineRunner> r(new PipelineRunner(model, pp, schedule, micro_batches, B, T));
  const size_t bytes = r->btc_ * sizeof(float);
  for (kernels::DeviceBuffer* b : {&r->x_in_, &r->dy_, &r->out_, &r->dx_}) {
    STRATA_ASSIGN_OR_RETURN(*b, model.device().allocate(bytes, "pipeline.exchange"));
  }
  return r;
}

Status PipelineRunner::forward(int i, const int32_t* inputs, const int32_t* targets, PipelineStepStats* st) {
  Timer t;
  model_.use_slot(i % slots_);
  STRATA_ASSIGN_OR_RETURN(const float loss,
                          model_.forward_stage(inputs, targets, stage_ > 0 ? x_in_.as<float>() : nullptr, B_, T_));
  if (stage_ + 1 < stages_) {
    model_.device().copy_on_device(out_.data(), model_.stage_output(), btc_ * sizeof(float));
    model_.device().synchronize();  // the stage's compute time is its kernels' (the bubble is what is left)
  } else {
    st->loss_sum += loss;
  }
  st->compute_s += t.seconds();
  return Status::ok();
}

Status PipelineRunner::backward(int i, float loss_scale, PipelineStepStats* st) {
  Timer t;
  model_.use_slot(i % slots_);
  STRATA_RETURN_IF_ERROR(model_.backward_stage(stage_ + 1 < stages_ ? dy_.as<float>() : nullptr, loss_scale));
  if (stage_ > 0) {
    model_.device().copy_on_device(dx_.data(), model_.stage_input_grad(), btc_ * sizeof(float));
    model_.device().synchronize();
  }
  st->compute_s += t.seconds();
  return Status::ok();
}

Status PipelineRunner::send_forward() {
  if (stage_ + 1 == stages_) return Status::ok();
  return pp_.send(out_.data(), btc_, DType::kF32, stage_ + 1, kTagStage);
}
Status PipelineRunner::recv_forward() {
  if (stage_ == 0) return Status::ok();
  return pp_.recv(x_in_.data(), btc_, DType::kF32, stage_ - 1, kTagStage);
}
Status PipelineRunner::send_backward() {
  if (stage_ == 0) return Status::ok();
  return pp_.send(dx_.data(), btc_, DType::kF32, stage_ - 1, kTagStage);
}
Status PipelineRunner::recv_backward() {
  if (stage_ + 1 == stages_) return Status::ok();
  return pp_.recv(dy_.data(), btc_, DType::kF32, stage_ + 1, kTagStage);
}

Result<PipelineStepStats> PipelineRunner::run(const std::vector<const int32_t*>& inputs,
                                              const std::vector<const int32_t*>& targets, float loss_scale) {
  STRATA_ASSERT(static_cast<int>(inputs.size()) == m_ && static_cast<int>(targets.size()) == m_);
  PipelineStepStats st;
  Timer total;
  model_.begin_step();
  const bool last = stage_ + 1 == stages_;
  if (schedule_ == PipelineSchedule::kGPipe) {
    for (int i = 0; i < m_; ++i) {
      STRATA_RETURN_IF_ERROR(recv_forward());
      STRATA_RETURN_IF_ERROR(forward(i, inputs[i], targets[i], &st));
      STRATA_RETURN_IF_ERROR(send_forward());
    }
    for (int i = 0; i < m_; ++i) {
      STRATA_RETURN_IF_ERROR(recv_backward());
      STRATA_RETURN_IF_ERROR(backward(i, loss_scale, &st));
      STRATA_RETURN_IF_ERROR(send_backward());
    }
    st.total_s = total.seconds();
    return st;
  }
  // 1F1B (Megatron-LM's schedule without interleaving).
  const int warmup = std::min(stages_ - stage_ - 1, m_), remaining = m_ - warmup;
  for (int i = 0; i < warmup; ++i) {
    STRATA_RETURN_IF_ERROR(recv_forward());
    STRATA_RETURN_IF_ERROR(forward(i, inputs[i], targets[i], &st));
    STRATA_RETURN_IF_ERROR(send_forward());
  }
  if (remaining > 0) STRATA_RETURN_IF_ERROR(recv_forward());
  for (int i = 0; i < remaining; ++i) {
    const int f = warmup + i;
    STRATA_RETURN_IF_ERROR(forward(f, inputs[f], targets[f], &st));
    if (!last) {  // the activation forward, the oldest micro-batch's gradient back
      STRATA_RETURN_IF_ERROR(pp_.send_recv(out_.data(), btc_, stage_ + 1, dy_.data(), btc_, stage_ + 1, DType::kF32,
                                           kTagStage));
    }
    STRATA_RETURN_IF_ERROR(backward(i, loss_scale, &st));
    if (i + 1 == remaining) {
      STRATA_RETURN_IF_ERROR(send_backward());
    } else if (stage_ > 0) {  // the gradient back, the next activation in
      STRATA_RETURN_IF_ERROR(pp_.send_recv(dx_.data(), btc_, stage_ - 1, x_in_.data(), btc_, stage_ - 1, DType::kF32,
                                           kTagStage));
    }
  }
  for (int i = 0; i < warmup; ++i) {
    STRATA_RETURN_IF_ERROR(recv_backward());
    STRATA_RETURN_IF_ERROR(backward(remaining + i, loss_scale, &st));
    STRATA_RETURN_IF_ERROR(send_backward());
  }
  st.total_s = total.seconds();
  return st;
}

Result<float> PipelineRunner::forward_only(const int32_t* inputs, const int32_t* targets) {
  PipelineStepStats st;
  model_.begin_step();
  STRATA_RETURN_IF_ERROR(recv_forward());
  STRATA_RETURN_IF_ERROR(forward(0, inputs, targets, &st));
  STRATA_RETURN_IF_ERROR(send_forward());
  return static_cast<float>(st.loss_sum);
}

// ---- the optimizer ----

Result<std::unique_ptr<PipelineAdamW>> PipelineAdamW::create(GPT2& model, const PipelinePlan& plan,
                                                            const AdamWConfig& config, kernels::Device& device,
                                                            comm::Communicator& pp) {
  std::unique_ptr<PipelineAdamW> opt(new PipelineAdamW());
  opt->model_ = &model;
  opt->plan_ = plan;
  opt->config_ = config;
  opt->device_ = &device;
  opt->pp_ = &pp;
  STRATA_ASSIGN_OR_RETURN(opt->tied_, split_tied_group(pp));
  for (size_t u = 0; u < model.units().size(); ++u) {
    kernels::DeviceBuffer m, v;
    if (model.holds(u)) {
      const Unit& unit = model.units()[u];
      STRATA_ASSIGN_OR_RETURN(m, device.allocate(unit.numel() * sizeof(float), "adamw.m " + unit.name));
      STRATA_ASSIGN_OR_RETURN(v, device.allocate(unit.numel() * sizeof(float), "adamw.v " + unit.name));
    }
    opt->m_.push_back(std::move(m));
    opt->v_.push_back(std::move(v));
  }
  return opt;
}

Status PipelineAdamW::adopt_params() {
  for (size_t u = 0; u < m_.size(); ++u) {
    if (m_[u].data() == nullptr) continue;
    device_->zero(m_[u].data(), m_[u].size());
    device_->zero(v_[u].data(), v_[u].size());
  }
  return Status::ok();
}

Result<double> PipelineAdamW::step(float lr, bool* skipped) {
  const std::vector<Unit>& units = model_->units();
  const int s = pp_->rank(), P = pp_->size();
  if (P > 1 && (s == 0 || s == P - 1)) {  // the tied embedding: both halves of its gradient on both ends
    const Unit& wte = units[0];
    STRATA_RETURN_IF_ERROR(tied_->all_reduce(wte.g(), wte.g(), wte.numel(), DType::kF32, comm::ReduceOp::kSum)
                               .with_context("the tied embedding's gradient"));
  }
  // Every unit's sum of squares from its owner (the embedding's from the first stage), added in unit order:
  // the single process's norm, bit for bit, given the same gradients.
  std::vector<double> per(units.size(), 0.0);
  for (size_t u = 0; u < units.size(); ++u) {
    if (plan_.owner(u) == s) per[u] = unit_norm_share(model_->norm_shares(), u, units[u], *device_);
  }
  STRATA_ASSIGN_OR_RETURN(const double norm, whole_model_norm(plan_, pp_, model_->norm_shares(), std::move(per)));
  const std::optional<float> scale = step_scale(norm, config_.grad_clip, skipped);
  if (!scale) return norm;
  ++t_;
  const kernels::KernelSet& k = device_->kernels();
  for (size_t u = 0; u < units.size(); ++u) {
    if (!model_->holds(u)) continue;
    const Unit& unit = units[u];
    for (const TensorSpec& t : unit.layout.specs()) {
      kernels::AdamWParams hp = adamw_params(config_, lr, t_, *scale);
      hp.weight_decay = t.decay ? config_.weight_decay : 0.0f;
      k.adamw_update(unit.p_for_update() + t.offset, m_[u].as<float>() + t.offset, v_[u].as<float>() + t.offset,
                     unit.g() + t.offset, t.numel(), hp);
    }
  }
  return norm;
}

Status PipelineAdamW::read_moments(size_t unit, float* m, float* v) {
  const size_t n = model_->units()[unit].numel();
  if (!model_->holds(unit)) return pipeline_recv_moments(plan_, *pp_, unit, n, m, v);
  device_->copy_to_host(m, m_[unit].data(), n * sizeof(float));
  device_->copy_to_host(v, v_[unit].data(), n * sizeof(float));
  return Status::ok();
}

Status PipelineAdamW::write_moments(size_t unit, const float* m, const float* v) {
  if (!model_->holds(unit)) return Status::ok();
  const size_t n = model_->units()[unit].numel();
  device_->copy_to_device(m_[unit].data(), m, n * sizeof(float));
  device_->copy_to_device(v_[unit].data(), v, n * sizeof(float));
  return Status::ok();
}

Result<std::unique_ptr<comm::Communicator>> split_tied_group(comm::Communicator& pp) {
  const int s = pp.rank(), P = pp.size();
  return pp.split(s == 0 || s == P - 1 ? 0 : 1, s, "pp.tied");
}

Status take_from_owners(const PipelinePlan& plan, comm::Communicator& pp, std::vector<double>* per_unit) {
  const size_t U = per_unit->size();
  std::vector<double> all(static_cast<size_t>(pp.size()) * U);
  STRATA_RETURN_IF_ERROR(pp.all_gather(per_unit->data(), all.data(), 2 * U, DType::kF32));
  for (size_t u = 0; u < U; ++u) (*per_unit)[u] = all[static_cast<size_t>(plan.owner(u)) * U + u];
  return Status::ok();
}

Result<double> whole_model_norm(const PipelinePlan& plan, comm::Communicator* pp, const NormShares& shares,
                                std::vector<double> per_unit) {
  STRATA_RETURN_IF_ERROR(shares.sum(&per_unit));  // over the tensor-parallel group
  if (pp != nullptr && pp->size() > 1)
    STRATA_RETURN_IF_ERROR(take_from_owners(plan, *pp, &per_unit).with_context("gradient norm"));
  double sum = 0.0;
  for (const double x : per_unit) sum += x;
  return std::sqrt(sum);
}

// ---- checkpoints ----

Status pipeline_recv_moments(const PipelinePlan& plan, comm::Communicator& pp, size_t unit, size_t n, float* m,
                             float* v) {
  STRATA_RETURN_IF_ERROR(pp.recv(m, n, DType::kF32, plan.owner(unit), kTagMoments));
  return pp.recv(v, n, DType::kF32, plan.owner(unit), kTagMoments);
}

std::function<Status(size_t, float*)> pipeline_params_source(const GPT2& model, const PipelinePlan& plan,
                                                             comm::Communicator& pp) {
  return [&model, plan, &pp](size_t u, float* host) {
    return pp.recv(host, model.whole_layout(u).numel(), DType::kF32, plan.owner(u), kTagParams);
  };
}

namespace {

int piece_tag(int k) { return k == 0 ? kTagParams : kTagMoments; }

// Each piece between stages comes after a header of its offset in the unit and its length (two uint64s, their
// bits as four fp32 words); a length of 0 says the sending stage failed to read it.
struct PieceHeader {
  uint64_t offset = 0, length = 0;
};

// State k of unit u, a piece after another, to the first stage: each its header, then its elements, at most
// Optimizer::kMaxStatePiece. From the stage's ZeRO-3 shards (this rank is its data-parallel group's rank 0; the
// others walk the same pieces, take_part_in_checkpoint), or from where the optimizer keeps the state (a
// sub-group's view, read once and sent in parts). A failed read is said to the first stage before it returns.
Status send_pieces(const GPT2& model, Optimizer& opt, comm::Communicator& pp, size_t u, int k,
                   std::vector<float>& buffer) {
  const std::string what = fmt::format("{} of '{}' to the first stage", k == 0 ? "weights" : k == 1 ? "m" : "v",
                                       model.units()[u].name);
  auto send_header = [&](PieceHeader h) {
    return pp.send(&h, sizeof(h) / sizeof(float), DType::kF32, 0, piece_tag(k)).with_context(what);
  };
  const size_t numel = model.whole_layout(u).numel();
  for (size_t at = 0; at < numel;) {
    Result<std::span<const float>> view = std::span<const float>();
    if (opt.gathers_pieces(u)) {
      Result<Optimizer::StatePiece> piece =
          opt.gather_piece(u, k, at, Optimizer::kMaxStatePiece, Optimizer::buffer_in(buffer));
      view = piece.is_ok() ? Result<std::span<const float>>(piece->data) : piece.status();
    } else {
      view = opt.state_view(u, k, at);
      if (view.is_ok() && view->empty()) view = Status::internal("{}: the optimizer has no view of it", what);
    }
    if (!view.is_ok()) {
      (void)send_header({at, 0});  // the first stage fails at once, naming this stage
      return view.status().with_context(what);
    }
    for (size_t done = 0; done < view->size();) {
      const std::span<const float> part = view->subspan(done, std::min(view->size() - done, Optimizer::kMaxStatePiece));
      STRATA_RETURN_IF_ERROR(send_header({at + done, part.size()}));
      STRATA_RETURN_IF_ERROR(pp.send(part.data(), part.size(), DType::kF32, 0, piece_tag(k)).with_context(what));
      done += part.size();
    }
    at += view->size();
  }
  return Status::ok();
}

}  // namespace

Result<Optimizer::StatePiece> pipeline_recv_piece(const PipelinePlan& plan, comm::Communicator& pp, size_t unit,
                                                  int k, size_t offset, size_t max_len,
                                                  const Optimizer::PieceBuffer& buffer) {
  const int owner = plan.owner(unit);
  const std::string what = fmt::format("a piece of unit {} (state {}, element {}) from stage {}", unit, k, offset,
                                       owner);
  PieceHeader h;
  STRATA_RETURN_IF_ERROR(pp.recv(&h, sizeof(h) / sizeof(float), DType::kF32, owner, piece_tag(k)).with_context(what));
  if (h.length == 0) return Status::io_error("{}: that stage could not read it (its error is in its log)", what);
  if (h.offset != offset || h.length > max_len) {
    return Status::internal("{}: it sent {} elements from element {}, where 1 to {} from element {} were expected",
                            what, h.length, h.offset, max_len, offset);
  }
  float* into = buffer(h.length);
  STRATA_RETURN_IF_ERROR(pp.recv(into, h.length, DType::kF32, owner, piece_tag(k)).with_context(what));
  return Optimizer::StatePiece{h.length, std::span<const float>(into, h.length)};
}

Status take_part_in_pipeline_checkpoint(const GPT2& model, const PipelinePlan& plan, Optimizer& opt,
                                        comm::Communicator& pp) {
  STRATA_RETURN_IF_ERROR(opt.finish());
  const int s = pp.rank();
  std::vector<float> a, b;
  if (opt.stages_send_pieces()) {
    for (size_t u = 0; u < model.units().size(); ++u) {  // the first stage's model file reads
      if (s != 0 && plan.owner(u) == s) STRATA_RETURN_IF_ERROR(send_pieces(model, opt, pp, u, 0, a));
    }
    for (size_t u = 0; u < model.units().size(); ++u) {  // then its moments reads
      if (s == 0 || plan.owner(u) != s) continue;
      STRATA_RETURN_IF_ERROR(send_pieces(model, opt, pp, u, 1, a));
      STRATA_RETURN_IF_ERROR(send_pieces(model, opt, pp, u, 2, a));
    }
    return Status::ok();
  }
  // Parameters travel whole (read_params gathers a tensor-parallel stage's slices); moments as this rank's slices
  // (the first stage's rank of the same tensor-parallel rank gathers them).
  for (size_t u = 0; u < model.units().size(); ++u) {  // the first stage's model file reads
    if (s == 0 || plan.owner(u) != s) continue;
    a.resize(model.whole_layout(u).numel());
    STRATA_RETURN_IF_ERROR(model.read_params(u, a.data()));
    STRATA_RETURN_IF_ERROR(pp.send(a.data(), a.size(), DType::kF32, 0, kTagParams));
  }
  for (size_t u = 0; u < model.units().size(); ++u) {  // then its moments reads
    if (s == 0 || plan.owner(u) != s) continue;
    a.resize(model.units()[u].numel());
    b.resize(a.size());
    STRATA_RETURN_IF_ERROR(opt.read_moments(u, a.data(), b.data()));
    STRATA_RETURN_IF_ERROR(pp.send(a.data(), a.size(), DType::kF32, 0, kTagMoments));
    STRATA_RETURN_IF_ERROR(pp.send(b.data(), b.size(), DType::kF32, 0, kTagMoments));
  }
  return Status::ok();
}

}  // namespace strata::engine
