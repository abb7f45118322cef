#include "engine/optim/pipeline_adamw.h"

#include "engine/parallel/grad_sync.h"

namespace strata::engine {

Result<std::unique_ptr<PipelineAdamW>> PipelineAdamW::create(Model& model, const PipelinePlan& plan,
                                                            const AdamWConfig& config, kernels::Device& device,
                                                            comm::Communicator& pp) {
  std::unique_ptr<PipelineAdamW> opt(new PipelineAdamW());
  opt->model_ = &model;
  opt->plan_ = plan;
  opt->config_ = config;
  opt->device_ = &device;
  opt->pp_ = &pp;
  STRATA_ASSIGN_OR_RETURN(opt->shared_, SharedGrads::create(plan, &pp));
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
  const int s = pp_->rank();
  STRATA_RETURN_IF_ERROR(shared_.sum_units(units));  // each holder's part of a shared unit's gradient, on each
  // Every unit's sum of squares from its owner (a shared unit's from its first holder), added in unit order:
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

}  // namespace strata::engine
