// pipeline.h — pipeline parallelism (parallel.pipeline_parallel_size): the GPT-2 blocks split into stages, one
// per rank of a pipeline group, with the micro-batches of a step flowing through them on Megatron-LM's 1F1B
// schedule (or GPipe's, for comparison), activations passed forward and gradients backward with send/recv.
//
// Stages: the L blocks are cut into P consecutive non-empty ranges that balance the stages' forward FLOPs per
// token (the family's PipelineCosts; GPT-2's block 24C^2 + 2C(T+1), its head 2CV: with GPT-2's vocabulary the
// head weighs as much as ~10 blocks of width 768, so the last stage gets fewer blocks); the first stage also runs
// the embedding, the last the final norm, the LM head and the loss. Which stage holds a unit is its role's
// (PipelineStage::holds): an embedding that ties the head lives on both ends, where after backward its two
// gradients are summed (grad_sync.h SharedGrads) and both apply the same update to their copies, which therefore
// stay bitwise equal.
//
// Schedules over m micro-batches on stage s of P:
//  - 1F1B: min(P - s - 1, m) forwards to fill the pipeline, then one forward and one backward in turn, then
//    the remaining backwards; at most P - s micro-batches are in flight on stage s (one activation slot each).
//    The steady state's two exchanges (send the activation forward and receive a gradient back; send a
//    gradient back and receive the next activation) are single send_recv calls, so neighbours never wait on
//    each other's sends.
//  - GPipe: every forward, then every backward; m activation slots.
// Backwards run in micro-batch order on every stage, so each unit's gradient accumulates in the order of one
// process accumulating the same micro-batches: the only differences from the single-rank run are the tied
// embedding's sum (its two halves accumulated apart) and nothing else — the norm is the single rank's bits
// (every unit's sum of squares gathered, added in unit order).
//
// Threading: the training thread drives everything, and uses the pipeline group from it alone (under ZeRO-3
// the offload coordinator's thread uses a data-parallel communicator of its own).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/model/model.h"

namespace strata::engine {

enum class PipelineSchedule : uint8_t { k1F1B, kGPipe };

// The message tags between stages. Between neighbours, activations only go forward and gradients only back, and
// MPI keeps each direction's messages in order: one tag serves both. A checkpoint's parameters and moments
// travel to the first stage under their own (engine/checkpoint/pipeline_checkpoint.h).
struct PipelineTags {
  static constexpr int kStage = 11, kParams = 13, kMoments = 14;
};

// Which blocks each stage runs, and which stages hold each unit.
struct PipelinePlan {
  std::vector<PipelineStage> stages;
  std::vector<double> flops;  // each stage's forward FLOPs per token
  // Per unit, in the model's order: the stages that hold it (PipelineStage::holds), ascending; the first owns it:
  // its value counts once (its share of the gradient norm, its part of a checkpoint).
  std::vector<std::vector<int>> holders;
  int owner(size_t unit) const { return holders[unit].front(); }
  // The units more than one stage holds (an embedding that ties the head), in unit order.
  std::vector<size_t> shared_units() const;
  std::string describe() const;  // "blocks [0, 5) + embedding | [5, 6) + head; forward GFLOP/token 0.02 | 0.04"
};
// The balanced plan of `stages` stages (at most the model's blocks) for a model of `units` (its blocks numbered
// 0 .. L-1, one embedding; every unit held by some stage) at `costs` per token.
PipelinePlan plan_pipeline(const std::vector<UnitSpec>& units, const PipelineCosts& costs, int stages);

struct PipelineStepStats {
  double loss_sum = 0;   // the last stage's losses of its micro-batches, summed (0 elsewhere)
  double compute_s = 0;  // this stage's forwards and backwards
  double total_s = 0;    // the whole schedule; the rest is waiting for neighbours (the bubble) and messages
};

class PipelineRunner {
 public:
  // `model` is this stage's (created with plan.stages[pp.rank()]), `pp` the pipeline group (rank = stage); B, T
  // the micro-batch shape. Sets the model's activation slots; fails only when the device has no room for the
  // buffers the stages exchange.
  static Result<std::unique_ptr<PipelineRunner>> create(Model& model, comm::Communicator& pp,
                                                        PipelineSchedule schedule, int micro_batches, int B, int T);

  // Forward and backward of the step's micro-batches: inputs[i], targets[i] are micro-batch i's (B,T) tokens
  // (every stage gets them; the first stage reads the inputs, the last the targets). Gradients are added to
  // the stage's units scaled by loss_scale.
  Result<PipelineStepStats> run(const std::vector<const int32_t*>& inputs, const std::vector<const int32_t*>& targets,
                                float loss_scale);
  // A forward only (validation); the loss on the last stage, 0 elsewhere.
  Result<float> forward_only(const int32_t* inputs, const int32_t* targets);

 private:
  Status forward(int i, const int32_t* inputs, const int32_t* targets, PipelineStepStats* st);
  Status backward(int i, float loss_scale, PipelineStepStats* st);
  Status send_forward();
  Status recv_forward();
  Status send_backward();
  Status recv_backward();
  PipelineRunner(Model& model, comm::Communicator& pp, PipelineSchedule schedule, int micro_batches, int B, int T);

  Model& model_;
  comm::Communicator& pp_;
  PipelineSchedule schedule_;
  int m_, B_, T_, slots_;
  int stage_, stages_;
  size_t btc_;
  // What crosses to the neighbours, in device memory (so NCCL moves it GPU to GPU): the input activations and
  // the output's gradient received, the output and the input's gradient sent.
  kernels::DeviceBuffer x_in_, dy_, out_, dx_;
};

// The first stage's read of another stage's moments of `unit` (n elements each), for checkpoints.
Status pipeline_recv_moments(const PipelinePlan& plan, comm::Communicator& pp, size_t unit, size_t n, float* m,
                             float* v);
// The first stage's reads of other stages' units, for checkpoints: Model::set_params_source of the first stage.
std::function<Status(size_t unit, float* host)> pipeline_params_source(const Model& model, const PipelinePlan& plan,
                                                                       comm::Communicator& pp);

}  // namespace strata::engine
