#include "engine/parallel/pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "common/timer.h"

namespace strata::engine {
namespace {

constexpr int kTagStage = PipelineTags::kStage, kTagParams = PipelineTags::kParams,
              kTagMoments = PipelineTags::kMoments;

}  // namespace

PipelinePlan plan_pipeline(const std::vector<UnitSpec>& units, const PipelineCosts& costs, int stages) {
  const int L = static_cast<int>(
      std::count_if(units.begin(), units.end(), [](const UnitSpec& u) { return u.role == UnitRole::kBlock; }));
  STRATA_ASSERT(stages >= 1 && stages <= L);
  const double block = costs.block, head = costs.head;
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
  for (const UnitSpec& u : units) {
    std::vector<int>& h = plan.holders.emplace_back();
    for (int s = 0; s < stages; ++s) {
      if (plan.stages[static_cast<size_t>(s)].holds(u)) h.push_back(s);
    }
    STRATA_ASSERT_MSG(!h.empty(), "a unit no pipeline stage holds");
  }
  return plan;
}

std::vector<size_t> PipelinePlan::shared_units() const {
  std::vector<size_t> shared;
  for (size_t u = 0; u < holders.size(); ++u) {
    if (holders[u].size() > 1) shared.push_back(u);
  }
  return shared;
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

PipelineRunner::PipelineRunner(Model& model, comm::Communicator& pp, PipelineSchedule schedule, int micro_batches,
                               int B, int T)
    : model_(model), pp_(pp), schedule_(schedule), m_(micro_batches), B_(B), T_(T), stage_(pp.rank()),
      stages_(pp.size()) {
  slots_ = schedule == PipelineSchedule::kGPipe ? m_ : std::min(stages_ - stage_, m_);
  model_.set_activation_slots(std::max(1, slots_));
  model_.set_marks_steps(false);  // a step of the offload trace is the whole schedule
  btc_ = model.residual_floats(B, T);  // this rank's rows of it under sequence parallelism
}

Result<std::unique_ptr<PipelineRunner>> PipelineRunner::create(Model& model, comm::Communicator& pp,
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

// ---- checkpoints: the first stage's reads ----

Status pipeline_recv_moments(const PipelinePlan& plan, comm::Communicator& pp, size_t unit, size_t n, float* m,
                             float* v) {
  STRATA_RETURN_IF_ERROR(pp.recv(m, n, DType::kF32, plan.owner(unit), kTagMoments));
  return pp.recv(v, n, DType::kF32, plan.owner(unit), kTagMoments);
}

std::function<Status(size_t, float*)> pipeline_params_source(const Model& model, const PipelinePlan& plan,
                                                             comm::Communicator& pp) {
  return [&model, plan, &pp](size_t u, float* host) {
    return pp.recv(host, model.whole_layout(u).numel(), DType::kF32, plan.owner(u), kTagParams);
  };
}

}  // namespace strata::engine
