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

}  // namespace strata::engine
