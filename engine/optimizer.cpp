#include "engine/optimizer.h"

#include <cmath>

namespace strata::engine {

double lr_at(int step, double lr, double min_lr, int warmup, int max_steps) {
  if (step < warmup) return lr * (step + 1) / warmup;
  if (max_steps <= warmup) return lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / (max_steps - warmup));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

Result<AdamW> AdamW::create(const std::vector<Unit>& units, const AdamWConfig& config) {
  AdamW opt;
  opt.config_ = config;
  for (const Unit& u : units) {
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer m, AlignedBuffer::allocate(u.numel() * sizeof(float), "adamw.m"));
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer v, AlignedBuffer::allocate(u.numel() * sizeof(float), "adamw.v"));
    opt.m_.push_back(std::move(m));
    opt.v_.push_back(std::move(v));
  }
  return opt;
}

double AdamW::grad_norm(const std::vector<Unit>& units) {
  double sum = 0.0;
  for (const Unit& u : units) {
    const float* g = u.g();
    const size_t n = u.numel();
    // Blocks of 4096 summed in float64 keep the sum accurate without a slow scalar double loop.
    for (size_t i = 0; i < n; i += 4096) {
      const size_t end = std::min(n, i + 4096);
      double s = 0.0;
      for (size_t j = i; j < end; ++j) s += static_cast<double>(g[j]) * g[j];
      sum += s;
    }
  }
  return std::sqrt(sum);
}

double AdamW::step(std::vector<Unit>& units, float lr, const kernels::KernelSet& k, bool* skipped) {
  const double norm = grad_norm(units);
  if (!std::isfinite(norm)) {
    if (skipped) *skipped = true;
    return norm;
  }
  if (skipped) *skipped = false;
  float scale = 1.0f;
  if (config_.grad_clip > 0) {
    const double coef = config_.grad_clip / (norm + 1e-6);
    if (coef < 1.0) scale = static_cast<float>(coef);
  }
  ++t_;
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& u = units[i];
    for (const TensorSpec& s : u.layout.specs()) {
      kernels::AdamWParams hp;
      hp.lr = lr;
      hp.beta1 = config_.beta1;
      hp.beta2 = config_.beta2;
      hp.eps = config_.eps;
      hp.weight_decay = s.decay ? config_.weight_decay : 0.0f;
      hp.step = t_;
      hp.grad_scale = scale;
      k.adamw_update(u.p() + s.offset, m(i) + s.offset, v(i) + s.offset, u.g() + s.offset, s.numel(), hp);
    }
  }
  return norm;
}

}  // namespace strata::engine
