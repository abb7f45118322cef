// trainer.h — the training loop behind `strata train`.
//
// Gradient accumulation, warmup + cosine learning rate, global-norm clipping, validation, per-step metrics as
// JSON lines, periodic and final checkpoints, --resume, and a clean stop on SIGINT/SIGTERM that saves a
// checkpoint first. Deterministic: the same config and seed give the same losses, bit for bit. Runs on the
// calling thread; the kernels use the TBB arena (compute.threads caps it).
#pragma once

#include <functional>
#include <string>

#include "comm/communicator.h"
#include "comm/staged_communicator.h"
#include "common/status.h"
#include "engine/train/config.h"

namespace strata::engine {

struct TrainOptions {
  std::string metrics_path;  // JSON lines, one object per step (empty: none)
  std::string resume;        // checkpoint (step dir or checkpoint_dir) to continue from (empty: fresh)
  bool progress = true;      // the per-step progress line on stdout
  // Data parallelism: each rank of this group runs its share of every step's micro-batches — of the step's
  // data_parallel size x grad_accum_steps micro-batches, rank r takes every r-th — and the gradients are summed over
  // the group (ZeRO stage 0: all-reduced, every rank takes the same step; 1 and 2: the moments sharded; 3, and 1 or 2
  // with offload: every unit sharded through the offload stack, docs/parallelism.md), so every rank keeps the same
  // weights. Rank 0 alone prints, writes metrics and checkpoints (the others take part where the state is sharded).
  // Null or a group of one: this process alone. On the GPU the collectives on device buffers go over NCCL or are staged
  // through host memory (parallel.distributed_backend; comm/staged_communicator.h).
  comm::Communicator* data_parallel = nullptr;
  // Pipeline parallelism (parallel.pipeline_parallel_size = its size): this rank runs stage pipeline->rank()
  // of the model on parallel.pipeline_schedule (engine/parallel/pipeline.h), each data-parallel rank's micro-batches
  // flowing through its pipeline; offload, ZeRO-3 and activation checkpointing work on every stage.
  comm::Communicator* pipeline = nullptr;
  // Tensor parallelism (parallel.tensor_parallel_size = its size): the ranks of this group split every block,
  // the heads and the vocabulary (engine/model/unit_split.h) and run every micro-batch together; works with
  // data and pipeline parallelism, offload and ZeRO-3 (not ZeRO 1 or 2 without offload).
  comm::Communicator* tensor_parallel = nullptr;
  // Train on this device instead of the one compute.device names (tests: a device posing as one the host
  // cannot address). Must outlive the call.
  kernels::Device* device = nullptr;
  // Makes each group's device plane instead of NCCL (tests: MPI posing as NCCL on a device posing as a GPU).
  comm::DevicePlaneFactory device_plane;
  // Tests: a factor on step `step`'s gradients (steps count from 1), on top of 1 / micro-batches; infinity
  // makes that step's gradients non-finite, so it is skipped after its backward has begun the update. Empty: 1.
  std::function<float(int step)> gradient_factor;
};

struct TrainSummary {
  int steps = 0;            // optimizer steps this invocation ran
  float last_loss = 0.0f;   // training loss of the last step
  float val_loss = -1.0f;   // the last validation loss (-1 if none ran)
  std::string checkpoint;   // the last checkpoint written
  double tokens_per_s = 0;  // over the whole run
};

Result<TrainSummary> run_training(const RunConfig& config, const TrainOptions& options);

}  // namespace strata::engine
