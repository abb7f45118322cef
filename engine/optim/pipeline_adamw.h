// pipeline_adamw.h — AdamW on a pipeline stage's device (parallel.pipeline_parallel_size without offload or
// ZeRO): the stage's units' moments, the whole model's clip norm, and the copies of a unit several stages hold
// (the tied embedding) kept equal.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/model/model.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/grad_sync.h"
#include "engine/parallel/pipeline.h"
#include "kernels/device.h"

namespace strata::engine {

// AdamW over a pipeline stage's units, with the clip norm of the whole model and the shared units kept in sync. Checkpoints: the first stage reads the other stages' units and moments (read_params through the
// model's params source, read_moments here) while they run take_part_in_pipeline_checkpoint().
class PipelineAdamW final : public Optimizer {
 public:
  // `model`, `device` and `pp` must outlive it.
  static Result<std::unique_ptr<PipelineAdamW>> create(Model& model, const PipelinePlan& plan,
                                                       const AdamWConfig& config, kernels::Device& device,
                                                       comm::Communicator& pp);
  // Sums the shared units' gradients over their holders (grad_sync.h), then the update with the whole model's
  // norm (every stage takes the same decision). Collective over the pipeline group.
  Result<double> step(float lr, bool* skipped) override;
  int steps_taken() const override { return t_; }
  void set_steps_taken(int t) override { t_ = t; }
  Status adopt_params() override;
  // A unit of another stage: received from it (the first stage, while the others take part in a checkpoint).
  Status read_moments(size_t unit, float* m, float* v) override;
  Status write_moments(size_t unit, const float* m, const float* v) override;  // another stage's: ignored

 private:
  PipelineAdamW() = default;
  Model* model_ = nullptr;
  PipelinePlan plan_;
  AdamWConfig config_;
  kernels::Device* device_ = nullptr;
  comm::Communicator* pp_ = nullptr;
  SharedGrads shared_;
  std::vector<kernels::DeviceBuffer> m_, v_;  // per unit; empty for other stages' units
  int t_ = 0;
};

}  // namespace strata::engine
