// grad_sync.h — the gradient's sums across ranks that every optimizer shares: each unit's share of the global
// norm under tensor parallelism, the whole model's norm over tensor and pipeline groups (every rank gets the
// same bits), and the sum of the units that several pipeline stages hold (a head tied to the embedding).
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/model/unit.h"
#include "engine/model/unit_split.h"
#include "engine/parallel/pipeline.h"
#include "kernels/device.h"

namespace strata::engine {

// Unit u's share of the global gradient norm on this rank, from its gradient in device memory: its sum of
// squares (add_sum_squares from 0), less what tensor parallelism leaves to another rank (Model::norm_shares).
double unit_norm_share(const NormShares& shares, size_t u, const Unit& unit, kernels::Device& device);
// The global gradient norm of `units` under tensor parallelism: each unit's share here, summed over the
// group (every rank gets the same bits), then added in unit order. Collective over shares.group.
Result<double> tensor_parallel_grad_norm(const std::vector<Unit>& units, const NormShares& shares,
                                         kernels::Device& device);

// The units that more than one pipeline stage holds (PipelinePlan::shared_units: GPT-2's embedding, which is its
// LM head too, on the first and the last stage) and the group of the stages that hold them. After backward each
// holder adds the others' gradients of them into its own, so that every copy takes the same update. Which units,
// and with whom, is decided here once for every optimizer; where the gradient lies (a unit's device buffer, a
// shard, the offload coordinator's host or NVMe copy) is the optimizer's, which calls sum() on it.
class SharedGrads {
 public:
  // Collective over `pp` (null or one stage: nothing is shared). Every shared unit must have the same holders
  // (one group serves them all).
  static Result<SharedGrads> create(const PipelinePlan& plan, comm::Communicator* pp);
  SharedGrads() = default;

  // The shared units this stage holds, in unit order (empty on the stages that hold none).
  const std::vector<size_t>& units() const { return units_; }
  bool shared(size_t u) const { return std::find(units_.begin(), units_.end(), u) != units_.end(); }
  // The holders' group (only where units() is not empty).
  comm::Communicator& group() const { return *group_; }
  // n floats at g (memory the group's communicator takes) summed over the holders, in place; `name` is the unit's.
  Status sum(float* g, size_t n, const std::string& name) const;
  // Each shared unit's device gradient here (Unit::g(), whole).
  Status sum_units(const std::vector<Unit>& units) const;

 private:
  std::vector<size_t> units_;
  std::unique_ptr<comm::Communicator> group_;
};
// Replaces each unit's entry of `per_unit` (this stage's values; other stages' units: anything) with the value
// of the stage that owns the unit. Collective over `pp`; the doubles travel as pairs of fp32 words (bits
// copied, never converted), so every stage ends with the same bits.
Status take_from_owners(const PipelinePlan& plan, comm::Communicator& pp, std::vector<double>* per_unit);
// The whole model's gradient norm from each unit's sum of squares on this rank (`per_unit`; only the units this
// stage owns matter): summed over the tensor-parallel group (`shares`), taken from the owning stages (`pp`; null
// or one stage: none), and added in unit order, so every rank gets the same bits. Collective over both groups.
Result<double> whole_model_norm(const PipelinePlan& plan, comm::Communicator* pp, const NormShares& shares,
                                std::vector<double> per_unit);

}  // namespace strata::engine
