// sharded_optimizer.h — AdamW under ZeRO stages 1 and 2 over a data-parallel group (DeepSpeed's
// zero_optimization.stage 1 and 2), on any device: the pieces of each collective are packed in host memory
// (copied from and to the device where the host cannot address it).
//
// Every tensor of every unit is cut into `dp` contiguous slices of c = ceil(numel / dp) elements rounded up to
// 16 (so the fused Adam's vector blocks fall where they fall in the unsharded update; the last slices are
// shorter or empty), and rank r keeps Adam's moments for its slices only: 8 bytes per parameter / dp.
//  - stage 1: the gradients are all-reduced (every rank holds the sum) and the norm is the unsharded one, so a
//    stage-1 run is bitwise a stage-0 run;
//  - stage 2: the gradients are reduce-scattered (each rank receives the sums of its own slices: half the bytes
//    of an all-reduce), in pieces of at most 1M elements; the norm adds every rank's sums of squares in rank
//    order, another association than stage 0's, so a stage-2 run matches within rounding.
// Each rank then updates its slices, and the new parameters are all-gathered so every rank holds all of them.
// The model's own gradient buffers stay whole on every rank (its kernels write whole units), so stage 2 saves
// communication here, not gradient memory.
//
// Checkpoints: the moments are gathered to rank 0 while it writes them: rank 0's read_moments() asks the other
// ranks for a unit through the group (they answer inside serve_checkpoint(), which rank 0's end_checkpoint()
// ends), so the order is whatever the checkpoint writer needs.
//
// Pipeline parallelism (set_pipeline): the group is a stage's data-parallel ranks and only the stage's units
// are sharded and updated. step() sums the shared units' gradients over their stages (grad_sync.h SharedGrads,
// after the reduction over the group: whole under stage 1, the shards under stage 2) and takes the whole model's norm
// from every unit's owner, in unit order, as PipelineAdamW does, so a stage-1 pipeline run is bitwise the
// stage-0 one. The first stage's rank 0 receives another stage's moments from that stage's rank 0, which
// gathers them over its own group (engine/checkpoint/pipeline_checkpoint.h).
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "engine/model/model.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/grad_sync.h"
#include "engine/parallel/pipeline.h"

namespace strata::engine {

struct ShardedAdamWOptions {
  int stage = 1;           // 1 or 2
  std::vector<bool> held;  // the units this rank updates (a pipeline stage's); empty: all
  // DeepSpeed's reduce_bucket_size and allgather_bucket_size: the most elements (the group's, all ranks' parts)
  // one reduction or all-gather moves at a time, which bounds the staging buffers (bucket floats, dp x bucket / dp
  // for the received pieces). A stage-2 reduce-scatter and an all-gather are further capped at kMaxPiece elements
  // per rank (Open MPI's large reduce-scatter is slow); stage 1's in-place all-reduce is not.
  size_t reduce_bucket = 500'000'000;
  size_t allgather_bucket = 500'000'000;
  static constexpr size_t kMaxPiece = size_t{1} << 20;
};

class ShardedAdamW final : public Optimizer {
 public:
  // `units` (the device's memory), `device` and `group` must outlive the optimizer.
  static Result<std::unique_ptr<ShardedAdamW>> create(const std::vector<Unit>& units, const AdamWConfig& config,
                                                      kernels::Device& device, comm::Communicator& group,
                                                      const ShardedAdamWOptions& options);
  // Pipeline parallelism: `plan` says which stage owns each unit, `pp` (which must outlive the optimizer) is this
  // rank's pipeline group. Collective over `pp`.
  Status set_pipeline(const PipelinePlan& plan, comm::Communicator& pp);

  // Reduces the gradients over the group (all-reduce or reduce-scatter by stage), then as AdamW::step.
  // Collective.
  Result<double> step(float lr, bool* skipped) override;
  // Tensor parallelism: the norm is the tensor-parallel group's sum of the ranks' shares (`shares` must outlive
  // the optimizer; inactive: the data-parallel group's norm alone).
  void set_norm_shares(const NormShares* shares) { shares_ = shares; }
  int steps_taken() const override { return t_; }
  void set_steps_taken(int t) override { t_ = t; }
  Status adopt_params() override;
  // Rank 0 only (it asks the others, who must be in serve_checkpoint()); the unit's whole moments. Another
  // pipeline stage's unit: received from that stage (the first stage's rank 0, while the others take part in
  // a pipeline checkpoint).
  Status read_moments(size_t unit, float* m, float* v) override;
  // Any rank: keeps its own slices of the unit's whole moments (no communication).
  Status write_moments(size_t unit, const float* m, const float* v) override;
  // Ranks other than 0, while rank 0 writes a checkpoint: answers its read_moments() until end_checkpoint().
  Status serve_checkpoint();
  Status end_checkpoint();  // rank 0, after the checkpoint is written (or failed)

  size_t shard_elements() const { return shard_numel_; }  // this rank's slices, all tensors

 private:
  struct Slice {
    size_t unit, tensor_offset, tensor_numel;  // the tensor within its unit
    size_t c;                                  // elements per rank's slice (padded count)
    size_t lo, len;                            // this rank's slice: [tensor_offset + lo, + len)
    size_t shard_offset;                       // where it starts in this rank's m, v, grad shards
    float weight_decay;
  };
  ShardedAdamW() = default;
  Status gather_moments(size_t unit, float* m, float* v);  // collective over the group
  // Every rank's slice of one tensor from `shard` (this rank's, at the slice's shard offset) into `whole`
  // (the tensor's first element), in pieces. Collective.
  Status all_gather_tensor(const Slice& s, const float* shard, float* whole);
  Status reduce_scatter_tensor(const Slice& s, const float* whole, float* shard);
  bool holds(size_t unit) const { return held_.empty() || held_[unit]; }
  const NormShares& shares() const { return shares_ != nullptr ? *shares_ : no_shares_; }
  Result<double> pipeline_norm_stage2();  // stage 2 under a pipeline: every unit's sum over the group, owners'

  AdamWConfig config_;
  const std::vector<Unit>* units_ = nullptr;
  kernels::Device* device_ = nullptr;
  comm::Communicator* group_ = nullptr;
  int stage_ = 1, t_ = 0;
  const NormShares* shares_ = nullptr;
  NormShares no_shares_;                       // inactive: every share is the whole unit
  std::vector<bool> held_;                     // empty: every unit
  PipelinePlan plan_;                          // pipeline: which stage owns each unit
  comm::Communicator* pp_ = nullptr;           // null: no pipeline
  SharedGrads shared_;                         // pipeline: the units several stages hold
  std::vector<Slice> slices_;
  size_t shard_numel_ = 0;
  kernels::DeviceBuffer m_, v_;      // this rank's slices of the moments
  kernels::DeviceBuffer grad_shard_;  // stage 2: the summed gradient of this rank's slices (device memory)
  size_t reduce_bucket_ = 0;                   // stage 1's all-reduce: elements per call
  size_t reduce_piece_ = 0, gather_piece_ = 0;  // elements per rank of one reduce-scatter or all-gather
  std::vector<float> send_, recv_;  // one piece of a padded collective, in host memory: the larger piece, and dp
                                    // times it
};

}  // namespace strata::engine
