#include "engine/parallel/grad_sync.h"

#include <cmath>

namespace strata::engine {

double unit_norm_share(const NormShares& shares, size_t u, const Unit& unit, kernels::Device& device) {
  return shares.share(u, unit.g(), 0, unit.numel(),
                      [&](const float* x, size_t n) { return device.add_sum_squares(0.0, x, n); });
}

Result<double> tensor_parallel_grad_norm(const std::vector<Unit>& units, const NormShares& shares,
                                         kernels::Device& device) {
  std::vector<double> per(units.size());
  for (size_t u = 0; u < per.size(); ++u) per[u] = unit_norm_share(shares, u, units[u], device);
  STRATA_RETURN_IF_ERROR(shares.sum(&per));
  double sum = 0.0;
  for (const double x : per) sum += x;
  return std::sqrt(sum);
}

Result<SharedGrads> SharedGrads::create(const PipelinePlan& plan, comm::Communicator* pp) {
  SharedGrads shared;
  if (pp == nullptr || pp->size() < 2) return shared;
  const std::vector<size_t> units = plan.shared_units();
  for (const size_t u : units) {
    if (plan.holders[u] != plan.holders[units.front()])
      return Status::unimplemented("pipeline: units shared by different sets of stages (units {} and {})",
                                   units.front(), u);
  }
  const int s = pp->rank();
  bool holder = false;
  if (!units.empty()) {
    const std::vector<int>& h = plan.holders[units.front()];
    holder = std::find(h.begin(), h.end(), s) != h.end();
  }
  // Every stage takes part in the split; the ones that hold none get a group of theirs, unused.
  STRATA_ASSIGN_OR_RETURN(shared.group_, pp->split(holder ? 0 : 1, s, "pp.tied"));
  if (holder) shared.units_ = units;
  return shared;
}

Status SharedGrads::sum(float* g, size_t n, const std::string& name) const {
  return group_->all_reduce(g, g, n, DType::kF32, comm::ReduceOp::kSum)
      .with_context("the gradient of " + name + ", which several pipeline stages hold");
}

Status SharedGrads::sum_units(const std::vector<Unit>& units) const {
  for (const size_t u : units_) STRATA_RETURN_IF_ERROR(sum(units[u].g(), units[u].numel(), units[u].name));
  return Status::ok();
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

}  // namespace strata::engine
