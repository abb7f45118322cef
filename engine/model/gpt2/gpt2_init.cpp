// GPT2's parameters: which units a rank holds, GPT-2's initialisation, reading and writing them whole or as a
// tensor-parallel rank's slices, and handing them to the compute (acquire/release), with their bf16 working copies.
#include "engine/model/gpt2/gpt2.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/log.h"
#include "common/rng.h"

namespace strata::engine {

size_t GPT2::num_params() const {
  size_t n = 0;
  for (size_t u = 0; u < units_.size(); ++u) n += holds(u) ? units_[u].numel() : 0;
  return n;
}

size_t GPT2::whole_num_params() const {
  size_t n = 0;
  for (size_t u = 0; u < units_.size(); ++u) n += whole_layout(u).numel();
  return n;
}

GPT2Init::GPT2Init(const GPT2& model, uint64_t seed)
    : model_(model), rng_(seed), residual_std_(0.02 / std::sqrt(2.0 * model.config().n_layer)) {}

namespace {
// Weights (2-D and larger) are drawn; 1-D tensors are constants (layernorm weights 1, biases 0).
bool drawn(const TensorSpec& s) { return s.shape.size() >= 2; }
}  // namespace

void GPT2Init::skip_to(size_t end) {
  for (const TensorSpec& s : model_.whole_layout(unit_).specs()) {
    const size_t lo = std::max(at_, s.offset), hi = std::min(end, s.offset + s.numel());
    if (!drawn(s) || lo >= hi) continue;
    double u1 = 0, u2 = 0;
    for (size_t j = lo; j < hi; ++j) rng_.normal_uniforms(&u1, &u2);
  }
  at_ = end;
}

Status GPT2Init::fill(size_t unit, size_t offset, std::span<float> dst) {
  if (unit >= model_.units().size() || offset > model_.whole_layout(unit).numel() ||
      dst.size() > model_.whole_layout(unit).numel() - offset)
    return Status::internal("GPT-2 init: [{}, {}) of unit {} is outside the model", offset, offset + dst.size(), unit);
  if (unit < unit_ || (unit == unit_ && offset < at_))
    return Status::internal("GPT-2 init: [{}, {}) of unit {} asked for after element {} of unit {}: pieces come in "
                            "order",
                            offset, offset + dst.size(), unit, at_, unit_);
  for (; unit_ < unit; ++unit_, at_ = 0) skip_to(model_.whole_layout(unit_).numel());
  skip_to(offset);
  const size_t end = offset + dst.size();
  for (const TensorSpec& s : model_.whole_layout(unit).specs()) {
    const size_t lo = std::max(offset, s.offset), hi = std::min(end, s.offset + s.numel());
    if (lo >= hi) continue;
    float* p = dst.data() + (lo - offset);
    if (drawn(s)) {
      fill_normal(rng_, p, hi - lo, s.name.ends_with("c_proj.weight") ? residual_std_ : 0.02);
    } else {
      const bool norm_weight = s.name.find("ln_") != std::string::npos && s.name.ends_with(".weight");
      std::fill(p, p + (hi - lo), norm_weight ? 1.0f : 0.0f);
    }
  }
  at_ = end;
  return Status::ok();
}

Status GPT2::init_gpt2(uint64_t seed) {
  GPT2Init init(*this, seed);
  std::vector<float> host;
  for (size_t i = 0; i < units_.size(); ++i) {  // the whole tensors (tensor parallelism takes its slices)
    host.resize(whole_layout(i).numel());
    STRATA_RETURN_IF_ERROR(init.fill(i, 0, host));
    STRATA_RETURN_IF_ERROR(write_params(i, host.data()));
  }
  return Status::ok();
}

Status GPT2::read_local_params(size_t u, float* host) const {
  if (coordinated(u)) return coordinator_->read_params(u, host);
  STRATA_ASSERT_MSG(!offloaded_ || on_device(u), "an offloaded model needs set_coordinator()");
  device_->copy_to_host(host, units_[u].p(), units_[u].numel() * sizeof(float));
  return Status::ok();
}

Status GPT2::read_params(size_t u, float* host) const {
  STRATA_ASSERT(u < units_.size());
  if (!holds(u)) {  // the whole unit, from the stage that holds it
    if (params_source_) return params_source_(u, host);
    return Status::internal("unit '{}' belongs to another pipeline stage", units_[u].name);
  }
  if (tp_ == nullptr) return read_local_params(u, host);
  std::vector<float> local(units_[u].numel());
  STRATA_RETURN_IF_ERROR(read_local_params(u, local.data()));
  return gather_whole(u, local.data(), host);
}

Status GPT2::write_params(size_t u, const float* host) {
  STRATA_ASSERT(u < units_.size());
  if (!holds(u)) return Status::ok();  // another stage's
  std::vector<float> local;
  if (tp_ != nullptr) {
    local.resize(units_[u].numel());
    slice_whole(u, host, local.data());
    host = local.data();
  }
  if (coordinated(u)) return coordinator_->write_params(u, host);
  STRATA_ASSERT_MSG(!offloaded_ || on_device(u), "an offloaded model needs set_coordinator()");
  device_->copy_to_device(units_[u].p_for_update(), host, units_[u].numel() * sizeof(float));
  return Status::ok();
}

Status GPT2::gather_whole(size_t u, const float* local, float* whole) const {
  if (tp_ == nullptr) {
    std::memcpy(whole, local, units_[u].numel() * sizeof(float));
    return Status::ok();
  }
  // Every rank's slices padded to the largest rank's size (the vocabulary's last slice may be shorter).
  const UnitSplit& split = splits_[u];
  const size_t padded = split.max_local_numel();
  std::vector<float> mine(padded, 0.0f), all(padded * static_cast<size_t>(tp_size_));
  std::memcpy(mine.data(), local, units_[u].numel() * sizeof(float));
  STRATA_RETURN_IF_ERROR(tp_->all_gather(mine.data(), all.data(), padded, DType::kF32)
                             .with_context("gathering the tensor-parallel slices of " + units_[u].name));
  for (int r = 0; r < tp_size_; ++r) split.assemble(all.data() + static_cast<size_t>(r) * padded, r, whole);
  return Status::ok();
}

void GPT2::slice_whole(size_t u, const float* whole, float* local) const {
  if (tp_ == nullptr) {
    std::memcpy(local, whole, units_[u].numel() * sizeof(float));
    return;
  }
  splits_[u].slice(whole, tp_rank_, local);
}

Result<offload::UnitView> GPT2::acquire(size_t u, offload::Pass pass) {
  if (coordinated(u)) return coordinator_->acquire(u, pass);
  STRATA_ASSERT_MSG(!offloaded_ || on_device(u), "an offloaded model needs set_coordinator()");
  const Unit& unit = units_[u];
  if (pass == offload::Pass::kGradients) return offload::UnitView{unit.p(), unit.g()};
  refresh_working_copy(u);
  return offload::UnitView{unit.p(), unit.g(), unit.params16_current ? unit.params16.as<uint16_t>() : nullptr};
}

// One rounding pass over the unit at its first use after a change, in the compute order (the device's stream),
// where each of its linears would round its weight at every use.
void GPT2::refresh_working_copy(size_t u) {
  Unit& unit = units_[u];
  if (unit.params16_current || !wants_working_copies() || !has_linears(u) || unit.numel() == 0) return;
  if (unit.params16.size() == 0) {
    if (working_copies_refused_) return;  // the budget had no room for an earlier unit's: none is tried again
    Result<kernels::DeviceBuffer> b = device_->allocate(unit.numel() * sizeof(uint16_t), "gpt2.params16 " + unit.name);
    if (!b.is_ok()) {
      STRATA_LOG_WARN("no room for the bf16 working copy of '{}' in the device budget ({}): the linears of it and "
                      "of the units after it round their weights to bf16 at every use instead (the same numbers, "
                      "more time)",
                      unit.name, b.status().message());
      working_copies_refused_ = true;
      return;
    }
    unit.params16 = std::move(b).value();
  }
  k_->weights_to_bf16(unit.params16.as<uint16_t>(), unit.p(), unit.numel());
  unit.params16_current = true;
  ++working_copies_made_;
}

void GPT2::release(size_t u, offload::Pass pass) {
  if (coordinated(u)) coordinator_->release(u, pass);
}

Status GPT2::keep_on_device(const std::vector<bool>& units) {
  STRATA_ASSERT_MSG(offloaded_ && coordinator_ == nullptr && on_device_.empty(),
                    "keep_on_device: an offloaded model, before set_coordinator, once");
  STRATA_ASSERT(units.size() == units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!units[u] || !holds(u)) continue;
    Unit& unit = units_[u];
    const size_t bytes = unit.numel() * sizeof(float);
    STRATA_ASSIGN_OR_RETURN(unit.params, device_->allocate(bytes, "gpt2.params " + unit.name));
    STRATA_ASSIGN_OR_RETURN(unit.grads, device_->allocate(bytes, "gpt2.grads " + unit.name));
    device_->zero(unit.params.data(), bytes);  // as the coordinator's parameters are, until written
    device_->zero(unit.grads.data(), bytes);
  }
  on_device_ = units;
  return Status::ok();
}

void GPT2::tell_coordinator_working_copies() {
  if (coordinator_ == nullptr) return;
  std::vector<bool> units(units_.size(), false);
  if (wants_working_copies())
    for (size_t u = 0; u < units.size(); ++u) units[u] = has_linears(u) && !on_device(u);
  coordinator_->set_working_copies(std::move(units));
}

}  // namespace strata::engine
