#include "engine/optim/optimizer.h"

#include <cmath>

#include "common/check.h"

namespace strata::engine {

float clip_scale(double norm, float clip) {
  if (clip <= 0) return 1.0f;
  const double coef = clip / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

std::optional<float> step_scale(double norm, float clip, bool* skipped) {
  const bool finite = std::isfinite(norm);
  if (skipped) *skipped = !finite;
  if (!finite) return std::nullopt;
  return clip_scale(norm, clip);
}

kernels::AdamWParams adamw_params(const AdamWConfig& config, float lr, int step, float grad_scale) {
  kernels::AdamWParams hp;
  hp.lr = lr;
  hp.beta1 = config.beta1;
  hp.beta2 = config.beta2;
  hp.eps = config.eps;
  hp.step = step;
  hp.grad_scale = grad_scale;
  return hp;
}

double lr_at(int step, double lr, double min_lr, int warmup, int max_steps) {
  if (step < warmup) return lr * (step + 1) / warmup;
  if (max_steps <= warmup) return lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / (max_steps - warmup));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

Result<AdamW> AdamW::create(const std::vector<Unit>& units, const AdamWConfig& config, kernels::Device& device,
                            const std::vector<bool>* only) {
  STRATA_ASSERT(only == nullptr || only->size() == units.size());
  AdamW opt;
  opt.config_ = config;
  opt.device_ = &device;
  opt.units_ = &units;
  opt.masked_ = only != nullptr;
  if (only != nullptr) opt.with_moments_ = *only;
  for (size_t i = 0; i < units.size(); ++i) {
    const Unit& u = units[i];
    opt.m_.emplace_back();
    opt.v_.emplace_back();
    if (only != nullptr && !(*only)[i]) continue;
    STRATA_ASSIGN_OR_RETURN(opt.m_.back(), device.allocate(u.numel() * sizeof(float), "adamw.m " + u.name));
    STRATA_ASSIGN_OR_RETURN(opt.v_.back(), device.allocate(u.numel() * sizeof(float), "adamw.v " + u.name));
  }
  return opt;
}

double AdamW::grad_norm(const std::vector<Unit>& units, kernels::Device& device) {
  double sum = 0.0;
  // Per unit from zero, then across units in order: the offloaded optimizer gets each unit's sum where the
  // unit's gradient lands (OffloadedAdamW), and adds them the same way, so the norms are the same bits.
  for (const Unit& u : units) sum += device.add_sum_squares(0.0, u.g(), u.numel());
  return std::sqrt(sum);
}

double AdamW::step(const std::vector<Unit>& units, float lr, bool* skipped) {
  STRATA_ASSERT_MSG(!masked_, "AdamW::step over some units only: its owner takes the norm and calls apply()");
  return update(units, lr, grad_norm(units, *device_), skipped);
}

Result<double> AdamW::step(float lr, bool* skipped) {
  if (shares_ == nullptr || !shares_->active()) return step(*units_, lr, skipped);
  STRATA_ASSIGN_OR_RETURN(const double norm, tensor_parallel_grad_norm(*units_, *shares_, *device_));
  return update(*units_, lr, norm, skipped);
}

double AdamW::update(const std::vector<Unit>& units, float lr, double norm, bool* skipped) {
  const std::optional<float> scale = step_scale(norm, config_.grad_clip, skipped);
  if (!scale) return norm;
  ++t_;
  apply_to(units, adamw_params(config_, lr, t_, *scale));
  return norm;
}

void AdamW::apply_to(const std::vector<Unit>& units, const kernels::AdamWParams& step) const {
  const kernels::KernelSet& k = device_->kernels();
  for (size_t i = 0; i < units.size(); ++i) {
    if (!has_moments(i)) continue;
    const Unit& u = units[i];
    for (const TensorSpec& s : u.layout.specs()) {
      kernels::AdamWParams hp = step;
      hp.weight_decay = s.decay ? config_.weight_decay : 0.0f;
      k.adamw_update(u.p_for_update() + s.offset, m(i) + s.offset, v(i) + s.offset, u.g() + s.offset, s.numel(), hp);
    }
  }
}

Status AdamW::adopt_params() {
  for (size_t i = 0; i < m_.size(); ++i) {
    if (!has_moments(i)) continue;
    device_->zero(m(i), m_[i].size());
    device_->zero(v(i), v_[i].size());
  }
  return Status::ok();
}

Status AdamW::read_moments(size_t unit, float* m_host, float* v_host) {
  if (!has_moments(unit)) return Status::internal("adamw: unit {} has no moments here", unit);
  device_->copy_to_host(m_host, m(unit), m_[unit].size());
  device_->copy_to_host(v_host, v(unit), v_[unit].size());
  return Status::ok();
}

Status AdamW::write_moments(size_t unit, const float* m_host, const float* v_host) {
  if (!has_moments(unit)) return Status::internal("adamw: unit {} has no moments here", unit);
  device_->copy_to_device(m(unit), m_host, m_[unit].size());
  device_->copy_to_device(v(unit), v_host, v_[unit].size());
  return Status::ok();
}

}  // namespace strata::engine
