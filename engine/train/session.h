// session.h — one training run's parts, built from a config: the rank groups, the device, the data, the model,
// the optimizer and the offload stack, the memory they need checked against the budgets first, and the
// weights initialised, read from training.init_from, or resumed from a checkpoint. `strata train`'s loop
// (trainer.h), the benches and programs embedding Strata (engine/strata.h) drive a session a step at a time.
//
// Collective: under mpirun every rank creates its session, steps, validates and saves together, in the same
// order. Threading: one thread drives a session; the kernels use the TBB arena, which compute.threads caps for
// the session's life.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/staged_communicator.h"
#include "common/status.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/checkpoint_state.h"
#include "engine/data/dataloader.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "engine/optim/pipeline_adamw.h"
#include "engine/optim/sharded_optimizer.h"
#include "engine/parallel/pipeline.h"
#include "engine/train/config.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/thread_limit.h"
#include "kernels/device.h"

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
  // cannot address). Must outlive the session.
  kernels::Device* device = nullptr;
  // Makes each group's device plane instead of NCCL (tests: MPI posing as NCCL on a device posing as a GPU).
  comm::DevicePlaneFactory device_plane;
  // Tests: a factor on step `step`'s gradients (steps count from 1), on top of 1 / micro-batches; infinity
  // makes that step's gradients non-finite, so it is skipped after its backward has begun the update. Empty: 1.
  std::function<float(int step)> gradient_factor;
  // Instead of data.train's shards, which are then not opened: fills a micro-batch's inputs and targets,
  // training.batch_size x training.seq_len tokens each (the benches' random tokens). Such a run's checkpoints
  // record no data position.
  std::function<Status(int32_t* inputs, int32_t* targets)> batches;
  // Instead of training.seed's initialisation (and without resume or training.init_from): the weights to start
  // from, as checkpoint.h's WeightsFill gives them (the offloaded bench's: those of the plain model it timed).
  WeightsFill initial_weights;
};

// Where the training thread's time in one step went, in seconds (the benches print the median step's).
struct StepPhases {
  double zero_grads = 0;
  double forward = 0;   // the micro-batches' forwards; under a pipeline, the whole schedule
  double backward = 0;  // their backwards, with the optimizer's begin_*_backward before each
  double reduce = 0;    // the data-parallel sums of the gradients (ZeRO stage 0) and the losses
  double optimizer_step = 0;
};

// The device `compute` names: compute.device ("auto": the GPU where one is usable; the CPU for the reference
// kernels) running compute.kernels.
Result<std::unique_ptr<kernels::Device>> make_compute_device(const ComputeConfig& compute);

// What one optimizer step did.
struct StepResult {
  int step = 0;                 // the steps completed with this one
  float loss = 0;               // the mean training loss of the step's micro-batches, over every rank's
  double lr = 0;                // the learning rate it stepped with
  double grad_norm = 0;         // before clipping
  bool skipped = false;         // the norm was not finite: the update was skipped
  double seconds = 0;           // the step's time on this rank
  double pipeline_bubble = -1;  // pipeline: this stage's idle share of the schedule; -1 without one
  StepPhases phases;
  std::optional<OffloadStepReport> offload;  // where the offloaded step's time went, with the offload stack
};

class TrainSession {
 public:
  // Everything that can fail on input is checked here, before a step: the rank grid against the config, the
  // checkpoint folder, the metrics file, the data, the memory the placements need against the budgets; then
  // the weights are made, read or resumed (options.resume: the optimizer's state and the data position too).
  static Result<std::unique_ptr<TrainSession>> create(const RunConfig& config, const TrainOptions& options);
  ~TrainSession();
  TrainSession(const TrainSession&) = delete;
  TrainSession& operator=(const TrainSession&) = delete;

  // One optimizer step: the step's micro-batches (training.grad_accum_steps per data-parallel rank) forward and
  // backward, the gradients summed over the ranks, and the update. An error names the step and where the run
  // can resume from.
  Result<StepResult> step();
  // The mean loss over training.val_batches batches of data.val, from its start; nothing without data.val, with
  // val_batches 0, or on a data-parallel rank other than 0 outside ZeRO-3 (which has the same weights and leaves
  // it to rank 0).
  Result<std::optional<float>> validate();
  // A checkpoint of the present state in training.checkpoint_dir, pruned to training.keep_checkpoints, which
  // every rank ends together knowing whether every rank's part was written. Its path on the leader, empty
  // elsewhere.
  Result<std::string> save();
  // The largest of every rank's `signal` (0: none), so that every rank stops at the same step.
  Result<int> agree_on_stop(int signal);

  int steps_done() const { return state_.step; }  // optimizer steps, counting those before a resume
  bool resumed() const { return !options_.resume.empty(); }
  bool leader() const { return leader_; }  // the rank that prints, writes metrics and checkpoints
  std::FILE* metrics() const { return metrics_.get(); }  // the leader's metrics file, or null
  int64_t tokens_per_step() const;
  const RunConfig& config() const { return config_; }
  Decoder& model() { return *model_; }
  Optimizer& optimizer() { return *opt_; }
  kernels::Device& device() { return *device_; }

 private:
  explicit TrainSession(const RunConfig& config, const TrainOptions& options);
  Status check_and_open();
  Status build();
  Status build_optimizer(const AdamWConfig& ac, bool offloaded);
  Status load_weights();
  void log_run() const;
  Status next_batch(int32_t* x, int32_t* y);  // data.train's next micro-batch, or options.batches'
  // This rank's part of a checkpoint: the leader writes it (its path into `path`), the others send it their
  // units or serve its gathers.
  Status save_part(std::string* path);

  RunConfig config_;
  TrainOptions options_;
  // The groups (null: none, or a group of one), after the device's collectives were put over them.
  comm::Communicator *dp_ = nullptr, *pp_ = nullptr, *tp_ = nullptr;
  int dp_size_ = 1, dp_rank_ = 0, pp_size_ = 1, pp_rank_ = 0, tp_rank_ = 0;
  bool leader_ = true;
  bool zero3_ = false;  // every unit sharded over the data-parallel ranks by the offload stack
  // Declared in the order they are made, so they are destroyed in the reverse: the optimizers before the
  // model, and the model (whose host activation checkpoints come from a pool) before the pools.
  std::optional<kernels::cpu::CpuThreadLimit> threads_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics_{nullptr, &std::fclose};
  std::optional<DataLoader> train_, val_;
  std::unique_ptr<kernels::Device> own_device_;
  kernels::Device* device_ = nullptr;
  std::unique_ptr<comm::Communicator> device_groups_[3];
  std::unique_ptr<OffloadRuntime> offload_stack_;
  std::unique_ptr<offload::PinnedPool> checkpoint_pool_;
  PipelinePlan plan_;
  std::unique_ptr<Decoder> model_;
  std::unique_ptr<PipelineRunner> pipeline_;
  std::optional<AdamW> device_opt_;
  std::unique_ptr<ShardedAdamW> sharded_opt_;  // ZeRO stage 1 or 2 over the data-parallel ranks
  std::unique_ptr<PipelineAdamW> pipeline_opt_;
  Optimizer* opt_ = nullptr;
  TrainState state_;
  int first_step_ = 0;
  std::vector<int32_t> x_, y_;    // a micro-batch's inputs and targets
  std::vector<int32_t> xs_, ys_;  // pipeline: the step's micro-batches of this rank
};

}  // namespace strata::engine
