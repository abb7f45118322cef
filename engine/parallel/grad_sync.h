// grad_sync.h — the gradient's sums across ranks that every optimizer shares: each unit's share of the global
// norm under tensor parallelism, the whole model's norm over tensor and pipeline groups (every rank gets the
// same bits), and the group of the stages that share the tied embedding.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/model/unit.h"
#include "engine/model/unit_split.h"
#include "engine/parallel/pipeline.h"
#include "kernels/device.h"

namespace strata::engine {

// Unit u's share of the global gradient norm on this rank, from its gradient in device memory: its sum of
// squares (add_sum_squares from 0), less what tensor parallelism leaves to another rank (GPT2::norm_shares).
double unit_norm_share(const NormShares& shares, size_t u, const Unit& unit, kernels::Device& device);
// The global gradient norm of `units` under tensor parallelism: each unit's share here, summed over the
// group (every rank gets the same bits), then added in unit order. Collective over shares.group.
Result<double> tensor_parallel_grad_norm(const std::vector<Unit>& units, const NormShares& shares,
                                         kernels::Device& device);

// The first and last stage's group, which shares the tied embedding (collective over `pp`: the other stages get
// a group of their own, unused).
Result<std::unique_ptr<comm::Communicator>> split_tied_group(comm::Communicator& pp);
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
