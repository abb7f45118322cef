// The model runtime (model.h): where the units' parameters and gradients live, reading and writing them whole or as
// a tensor-parallel rank's slices, and handing them to the compute (acquire/release) with their bf16 working copies.
#include "engine/model/model.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "common/log.h"

namespace strata::engine {

void Model::place(bool offloaded, const PipelineStage& stage, comm::Communicator* tp) {
  STRATA_ASSERT(units_.empty() && stage.end >= 0);
  offloaded_ = offloaded;
  stage_ = stage;
  if (tp != nullptr && tp->size() > 1) {
    tp_ = tp;
    tp_rank_ = tp->rank();
    tp_size_ = tp->size();
    norm_shares_.group = tp;
  }
}

Status Model::add_unit(UnitSpec spec, const std::function<TensorSplit(const std::string& name)>& split_of) {
  Unit u;
  static_cast<UnitSpec&>(u) = std::move(spec);
  if (tp_ != nullptr) {  // this rank's slices
    std::vector<TensorSplit> splits;
    for (const TensorSpec& s : u.layout.specs()) splits.push_back(split_of(s.name));
    UnitSplit split(std::move(u.layout), std::move(splits), tp_size_);
    u.layout = split.local(tp_rank_);
    norm_shares_.excluded.push_back(tp_rank_ > 0 ? split.replicated_ranges(tp_rank_) : Ranges{});
    splits_.push_back(std::move(split));
  }
  const size_t bytes = u.layout.numel() * sizeof(float);
  if (!offloaded_ && stage_.holds(u)) {
    STRATA_ASSIGN_OR_RETURN(u.params, device_->allocate(bytes, family_ + ".params " + u.name));
    STRATA_ASSIGN_OR_RETURN(u.grads, device_->allocate(bytes, family_ + ".grads " + u.name));
  }
  units_.push_back(std::move(u));
  return Status::ok();
}

Status Model::init_weights(uint64_t seed) {
  const std::unique_ptr<WeightsInit> init = initial_weights(seed);
  std::vector<float> host;
  for (size_t i = 0; i < units_.size(); ++i) {  // the whole tensors (tensor parallelism takes its slices)
    host.resize(whole_layout(i).numel());
    STRATA_RETURN_IF_ERROR(init->fill(i, 0, host));
    STRATA_RETURN_IF_ERROR(write_params(i, host.data()));
  }
  return Status::ok();
}

size_t Model::num_params() const {
  size_t n = 0;
  for (size_t u = 0; u < units_.size(); ++u) n += holds(u) ? units_[u].numel() : 0;
  return n;
}

size_t Model::whole_num_params() const {
  size_t n = 0;
  for (size_t u = 0; u < units_.size(); ++u) n += whole_layout(u).numel();
  return n;
}

Status Model::read_local_params(size_t u, float* host) const {
  if (coordinated(u)) return coordinator_->read_params(u, host);
  STRATA_ASSERT_MSG(!offloaded_ || on_device(u), "an offloaded model needs set_coordinator()");
  device_->copy_to_host(host, units_[u].p(), units_[u].numel() * sizeof(float));
  return Status::ok();
}

Status Model::read_params(size_t u, float* host) const {
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

Status Model::write_params(size_t u, const float* host) {
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

Status Model::gather_whole(size_t u, const float* local, float* whole) const {
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

void Model::slice_whole(size_t u, const float* whole, float* local) const {
  if (tp_ == nullptr) {
    std::memcpy(local, whole, units_[u].numel() * sizeof(float));
    return;
  }
  splits_[u].slice(whole, tp_rank_, local);
}

Result<offload::UnitView> Model::acquire(size_t u, offload::Pass pass) {
  if (coordinated(u)) return coordinator_->acquire(u, pass);
  STRATA_ASSERT_MSG(!offloaded_ || on_device(u), "an offloaded model needs set_coordinator()");
  const Unit& unit = units_[u];
  if (pass == offload::Pass::kGradients) return offload::UnitView{unit.p(), unit.g()};
  refresh_working_copy(u);
  return offload::UnitView{unit.p(), unit.g(), unit.params16_current ? unit.params16.as<uint16_t>() : nullptr};
}

// One rounding pass over the unit at its first use after a change, in the compute order (the device's stream),
// where each of its linears would round its weight at every use.
void Model::refresh_working_copy(size_t u) {
  Unit& unit = units_[u];
  if (unit.params16_current || !wants_working_copies() || !has_linears(u) || unit.numel() == 0) return;
  if (unit.params16.size() == 0) {
    if (working_copies_refused_) return;  // the budget had no room for an earlier unit's: none is tried again
    Result<kernels::DeviceBuffer> b =
        device_->allocate(unit.numel() * sizeof(uint16_t), family_ + ".params16 " + unit.name);
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

void Model::release(size_t u, offload::Pass pass) {
  if (coordinated(u)) coordinator_->release(u, pass);
}

Status Model::keep_on_device(const std::vector<bool>& units) {
  STRATA_ASSERT_MSG(offloaded_ && coordinator_ == nullptr && on_device_.empty(),
                    "keep_on_device: an offloaded model, before set_coordinator, once");
  STRATA_ASSERT(units.size() == units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!units[u] || !holds(u)) continue;
    Unit& unit = units_[u];
    const size_t bytes = unit.numel() * sizeof(float);
    STRATA_ASSIGN_OR_RETURN(unit.params, device_->allocate(bytes, family_ + ".params " + unit.name));
    STRATA_ASSIGN_OR_RETURN(unit.grads, device_->allocate(bytes, family_ + ".grads " + unit.name));
    device_->zero(unit.params.data(), bytes);  // as the coordinator's parameters are, until written
    device_->zero(unit.grads.data(), bytes);
  }
  on_device_ = units;
  return Status::ok();
}

void Model::tell_coordinator_working_copies() {
  if (coordinator_ == nullptr) return;
  std::vector<bool> units(units_.size(), false);
  if (wants_working_copies())
    for (size_t u = 0; u < units.size(); ++u) units[u] = has_linears(u) && !on_device(u);
  coordinator_->set_working_copies(std::move(units));
}

Status Model::zero_grads() {
  if (coordinator_ != nullptr) STRATA_RETURN_IF_ERROR(coordinator_->zero_grads());
  for (size_t i = 0; i < units_.size(); ++i)
    if (holds(i) && !coordinated(i)) device_->zero(units_[i].g(), units_[i].numel() * sizeof(float));
  return Status::ok();
}

Status Model::tp_all_reduce(float* x, size_t n) {
  if (tp_ == nullptr) return Status::ok();
  return tp_->all_reduce(x, x, n, DType::kF32, comm::ReduceOp::kSum).with_context("tensor-parallel all-reduce");
}

}  // namespace strata::engine
