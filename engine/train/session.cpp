#include "engine/train/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <utility>

#include <fmt/format.h>
#include <tbb/info.h>

#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/pipeline_checkpoint.h"
#include "engine/train/memory_plan.h"
#include "kernels/cpu/cpu_kernels.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

// How long the other ranks wait for the one writing a checkpoint (its model file, the moments it gathers, the
// fsyncs): longer than any collective should take, but still an end to a leader that hangs.
constexpr double kCheckpointWaitS = 3600;

comm::Communicator* group_of_several(comm::Communicator* group) {
  return group != nullptr && group->size() > 1 ? group : nullptr;
}

AdamWConfig adamw_config(const TrainingConfig& tc) {
  AdamWConfig ac;
  ac.beta1 = static_cast<float>(tc.beta1);
  ac.beta2 = static_cast<float>(tc.beta2);
  ac.eps = static_cast<float>(tc.eps);
  ac.weight_decay = static_cast<float>(tc.weight_decay);
  ac.grad_clip = static_cast<float>(tc.grad_clip);
  return ac;
}

}  // namespace

Result<std::unique_ptr<kernels::Device>> make_compute_device(const ComputeConfig& compute) {
  const kernels::KernelSet* k = kernels::find_kernel_set(compute.kernels.c_str());
  STRATA_ASSERT(k != nullptr);  // parse_run_config validated the name
  // "auto" picks the GPU where there is one, unless the CPU reference kernels were asked for.
  return kernels::make_device(compute.kernels == "reference" ? "cpu" : compute.device, *k);
}

TrainSession::TrainSession(const RunConfig& config, const TrainOptions& options)
    : config_(config), options_(options) {
  dp_ = group_of_several(options.data_parallel);
  pp_ = group_of_several(options.pipeline);
  tp_ = group_of_several(options.tensor_parallel);
  dp_size_ = dp_ ? dp_->size() : 1;
  dp_rank_ = dp_ ? dp_->rank() : 0;
  pp_size_ = pp_ ? pp_->size() : 1;
  pp_rank_ = pp_ ? pp_->rank() : 0;
  tp_rank_ = tp_ ? tp_->rank() : 0;
  leader_ = dp_rank_ == 0 && pp_rank_ == 0 && tp_rank_ == 0;
  // ZeRO-3: the offload stack's coordinator shards every unit over the ranks and gathers it for use, so every
  // rank runs every forward (validation too) and takes part in checkpoints. Stages 1 and 2 with an offloaded
  // optimizer run the same way (see offload_runtime.h).
  zero3_ = dp_ != nullptr &&
           (config.offload.stage == 3 || (config.offload.stage >= 1 && offload_enabled(config.offload)));
}

TrainSession::~TrainSession() = default;

Result<std::unique_ptr<TrainSession>> TrainSession::create(const RunConfig& config, const TrainOptions& options) {
  std::unique_ptr<TrainSession> s(new TrainSession(config, options));
  STRATA_RETURN_IF_ERROR(s->check_and_open());
  STRATA_RETURN_IF_ERROR(s->build());
  STRATA_RETURN_IF_ERROR(s->load_weights());
  s->log_run();
  return s;
}

int64_t TrainSession::tokens_per_step() const {
  const TrainingConfig& tc = config_.training;
  return static_cast<int64_t>(tc.batch_size) * tc.seq_len * tc.grad_accum_steps * dp_size_;
}

Status TrainSession::check_and_open() {
  const RunConfig& config = config_;
  const TrainingConfig& tc = config.training;
  const int B = tc.batch_size, T = tc.seq_len;
  // The configured sizes must be the groups this process was given (mpirun starts them:
  // docs/parallelism.md).
  const std::pair<int, comm::Communicator*> sizes[] = {{config.parallel.tensor_parallel_size, tp_},
                                                       {config.parallel.pipeline_parallel_size, pp_}};
  for (const auto& [want, group] : sizes) {
    if (want != (group != nullptr ? group->size() : 1))
      return Status::invalid_argument(
          "{}: parallel.tensor_parallel_size {} x pipeline_parallel_size {} needs a multiple of {} ranks: launch "
          "with mpirun -np N",
          config.source, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
          config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size);
  }
  const int64_t global_batch = static_cast<int64_t>(B) * tc.grad_accum_steps * dp_size_;
  if (tc.global_batch_size > 0 && tc.global_batch_size != global_batch)
    return Status::invalid_argument(
        "{}: training.global_batch_size (train_batch_size) {} is not training.batch_size {} x grad_accum_steps {} x "
        "{} data-parallel rank(s) = {}",
        config.source, tc.global_batch_size, B, tc.grad_accum_steps, dp_size_, global_batch);
  if ((dp_ || pp_ || tp_) && !leader_) logger().set_level(spdlog::level::warn);
  threads_.emplace(config.compute.threads);  // TBB's and the matmuls' (OpenMP's)

  STRATA_RETURN_IF_ERROR(check_writable_dir(tc.checkpoint_dir, "training.checkpoint_dir"));
  // A new run would replace and prune an earlier run's checkpoints there: refused unless asked for.
  if (options_.resume.empty() && !tc.overwrite_checkpoints)
    STRATA_RETURN_IF_ERROR(check_no_checkpoints(tc.checkpoint_dir));
  if (!options_.metrics_path.empty() && leader_) {
    metrics_.reset(std::fopen(options_.metrics_path.c_str(), options_.resume.empty() ? "w" : "a"));
    if (!metrics_)
      return Status::io_error("cannot open metrics file {}: {}", options_.metrics_path, std::strerror(errno));
  }
  if (!options_.batches) {
    STRATA_ASSIGN_OR_RETURN(DataLoader train,
                            DataLoader::open(config.data.train, B, T, config.model.vocab_size(), "data.train"));
    train_.emplace(std::move(train));
  }
  if (!config.data.val.empty()) {
    STRATA_ASSIGN_OR_RETURN(DataLoader v, DataLoader::open(config.data.val, B, T, config.model.vocab_size(), "data.val"));
    val_.emplace(std::move(v));
  }
  // A folder given as data.train takes every .bin in it: `strata tokenize` writes its validation shards there too.
  for (const std::string& p : train_ ? train_->paths() : std::vector<std::string>()) {
    if (!val_) {
      if (fs::path(p).filename().string().find("_val_") != std::string::npos)
        STRATA_LOG_WARN("data.train ({}) reads {}, which looks like a validation shard", config.data.train, p);
      continue;
    }
    std::error_code ec;
    for (const std::string& q : val_->paths()) {
      if (fs::equivalent(p, q, ec))
        return Status::invalid_argument(
            "{}: data.train ({}) and data.val ({}) both read {}: the validation loss would be measured on training "
            "data; narrow data.train (for example DIR/*_train_*.bin)",
            config.source, config.data.train, config.data.val, p);
    }
  }
  x_.resize(static_cast<size_t>(B) * T);
  y_.resize(x_.size());
  return Status::ok();
}

Status TrainSession::build() {
  const RunConfig& config = config_;
  const TrainingConfig& tc = config.training;
  const int B = tc.batch_size, T = tc.seq_len;
  if (options_.device == nullptr) {
    STRATA_ASSIGN_OR_RETURN(own_device_, make_compute_device(config.compute));
  }
  device_ = options_.device != nullptr ? options_.device : own_device_.get();
  device_->set_memory_limit(config.offload.device_memory_limit);
  // On a device the host cannot address, the groups' collectives on device buffers go over NCCL, or are staged
  // through host memory (comm/staged_communicator.h); host buffers (the losses, norms, checkpoints) go over
  // MPI. Every rank sets up its groups in the same order (each is collective over its own ranks).
  int g = 0;
  for (comm::Communicator** group : {&dp_, &pp_, &tp_}) {
    STRATA_ASSIGN_OR_RETURN(*group, comm::device_collectives(*group, *device_, config.parallel.distributed_backend,
                                                             options_.device_plane, &device_groups_[g++]));
  }
  const bool offloaded = offload_enabled(config.offload) || zero3_;
  plan_ = plan_pipeline(config.model.unit_specs(), config.model.pipeline_costs(T), pp_size_);
  const PipelineStage stage = pp_ ? plan_.stages[static_cast<size_t>(pp_rank_)] : PipelineStage{};
  {
    // Before anything large is allocated: the state this rank's placements put on each tier, counted on the
    // model's units as this rank holds them (created offloaded, so with nothing allocated), against the budgets.
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> shape,
                            create_model(config.model, *device_, config.compute.matmul_precision, true, stage, tp_,
                                         config.parallel.sequence_parallel));
    MemoryPlacement placement;
    placement.offloaded = offloaded;
    placement.zero3_ranks = zero3_ ? static_cast<size_t>(dp_size_) : 1;
    if (dp_ && !zero3_ && (config.offload.stage == 1 || config.offload.stage == 2))
      placement.zero12_ranks = static_cast<size_t>(dp_size_);
    auto memory = plan_memory(*shape, config.offload, placement);
    if (!memory.is_ok()) return memory.status().with_context(config.source);
    const MemoryBudgets budgets = measure_memory_budgets(*memory, config.offload, *device_);
    const Status fits = check_memory_fits(*memory, budgets, config.offload);
    if (!fits.is_ok()) return fits.with_context(config.source);
  }
  STRATA_ASSIGN_OR_RETURN(model_, create_model(config.model, *device_, config.compute.matmul_precision, offloaded,
                                               stage, tp_, config.parallel.sequence_parallel));
  model_->set_working_copies(config.compute.bf16_working_copies);
  if (pp_) {
    STRATA_ASSIGN_OR_RETURN(
        pipeline_, PipelineRunner::create(*model_, *pp_,
                                          config.parallel.pipeline_schedule == "gpipe" ? PipelineSchedule::kGPipe
                                                                                       : PipelineSchedule::k1F1B,
                                          tc.grad_accum_steps, B, T));
    if (pp_rank_ == 0) model_->set_params_source(pipeline_params_source(*model_, plan_, *pp_));
    STRATA_LOG_INFO("pipeline: {} stages, {} schedule, {} micro-batches per step: {}", pp_size_,
                    config.parallel.pipeline_schedule, tc.grad_accum_steps, plan_.describe());
  }
  STRATA_RETURN_IF_ERROR(build_optimizer(adamw_config(tc), offloaded));

  // Activation checkpointing; host checkpoints come from the offload stack's pool (the host tier's budget),
  // or from a pool of their own under the same limit.
  const ActivationCheckpointConfig& acfg = config.offload.activation_checkpointing;
  if (acfg.enabled) {
    offload::PinnedPool* pool = offload_stack_ ? &offload_stack_->pool() : nullptr;
    if (acfg.cpu_checkpointing && pool == nullptr) {
      STRATA_ASSIGN_OR_RETURN(checkpoint_pool_, offload::PinnedPool::create(offload::PinnedPoolOptions{
                                                    .budget_bytes = config.offload.host_memory_limit, .lock = false,
                                                    .budget_name = "memory.host_memory_limit"}));
      pool = checkpoint_pool_.get();
      register_pool_buffers(*pool, *device_);
    }
    model_->set_activation_checkpointing(
        acfg.cpu_checkpointing ? ActivationCheckpointing::kHost : ActivationCheckpointing::kDevice, pool);
  }
  // Before the weights are written (minutes for a model on NVMe): a device budget too small for the
  // activations fails now.
  return model_->reserve_activations(B, T).with_context(
      fmt::format("activations for training.batch_size {} x training.seq_len {}", B, T));
}

// One of four: AdamW on a pipeline stage's device; sharded over the data-parallel ranks (ZeRO 1 and 2); the
// offload stack's (host memory or NVMe, and ZeRO-3); or AdamW on the device.
Status TrainSession::build_optimizer(const AdamWConfig& ac, bool offloaded) {
  const OffloadConfig& oc = config_.offload;
  const bool zero12 = dp_ && !zero3_ && (oc.stage == 1 || oc.stage == 2);
  if (pp_ && !dp_ && !offloaded && (oc.stage == 1 || oc.stage == 2))
    STRATA_LOG_INFO("zero_optimization.stage {}: one data-parallel rank per pipeline stage, so each stage keeps its "
                    "whole optimizer state (nothing to shard it over)",
                    oc.stage);
  if (pp_ && !offloaded && !zero12) {
    STRATA_ASSIGN_OR_RETURN(pipeline_opt_, PipelineAdamW::create(*model_, plan_, ac, *device_, *pp_));
    opt_ = pipeline_opt_.get();
  } else if (zero12) {
    ShardedAdamWOptions so;
    so.stage = oc.stage;
    so.held.resize(model_->units().size());
    for (size_t u = 0; u < so.held.size(); ++u) so.held[u] = model_->holds(u);
    so.reduce_bucket = static_cast<size_t>(oc.reduce_bucket_size);
    so.allgather_bucket = static_cast<size_t>(oc.allgather_bucket_size);
    STRATA_ASSIGN_OR_RETURN(sharded_opt_, ShardedAdamW::create(model_->units(), ac, *device_, *dp_, so));
    sharded_opt_->set_norm_shares(&model_->norm_shares());
    if (pp_) STRATA_RETURN_IF_ERROR(sharded_opt_->set_pipeline(plan_, *pp_));
    opt_ = sharded_opt_.get();
    STRATA_LOG_INFO("zero_optimization.stage {}: Adam's moments sharded over {} ranks ({} of {} elements here)",
                    oc.stage, dp_size_, sharded_opt_->shard_elements(), model_->num_params());
  } else if (offloaded) {
    auto rt = OffloadRuntime::create(oc, ac, *device_, *model_, dp_, pp_, &plan_);
    if (!rt.is_ok()) return rt.status().with_context(config_.source);
    offload_stack_ = std::move(rt).value();
    opt_ = &offload_stack_->optimizer();
    // Over several ranks (stage 0) the offloaded optimizer sums the gradients where they are, in host memory.
    if (dp_ && !zero3_) STRATA_RETURN_IF_ERROR(offload_stack_->offloaded_optimizer().set_gradient_reducer(dp_));
  } else {
    STRATA_ASSIGN_OR_RETURN(AdamW a, AdamW::create(model_->units(), ac, *device_));
    device_opt_.emplace(std::move(a));
    device_opt_->set_norm_shares(&model_->norm_shares());
    opt_ = &*device_opt_;
  }
  return Status::ok();
}

Status TrainSession::load_weights() {
  const RunConfig& config = config_;
  const TrainingConfig& tc = config.training;
  state_.config = config.json;
  if (train_) state_.train_shards = shard_records(*train_);
  if (!options_.resume.empty()) {
    // The data position counts in the checkpoint's shards: checked before the weights are read.
    size_t shard = 0;
    auto loaded = load_checkpoint(options_.resume, *model_, *opt_, [&](const TrainState& saved) -> Status {
      if (!train_) return Status::ok();  // options.batches: no data position
      STRATA_ASSIGN_OR_RETURN(shard,
                              resume_shard(saved.train_shards, saved.train_pos, state_.train_shards, "data.train"));
      return Status::ok();
    });
    if (!loaded.is_ok()) return loaded.status().with_context("--resume " + options_.resume);
    state_.step = loaded->step;
    state_.train_pos = loaded->train_pos;
    state_.train_pos.shard = shard;
    if (train_) STRATA_RETURN_IF_ERROR(train_->seek(state_.train_pos));
    if (const std::vector<std::string> changes = config_changes(loaded->config, config.json);
        leader_ && !changes.empty() && !loaded->config.empty()) {  // every rank runs the same config
      std::string listed;
      for (size_t i = 0; i < changes.size() && i < 12; ++i) listed += (i ? "; " : "") + changes[i];
      if (changes.size() > 12) listed += fmt::format("; and {} more", changes.size() - 12);
      STRATA_LOG_WARN("resuming with settings other than those of the run that saved the checkpoint: {}", listed);
    }
    STRATA_LOG_INFO("resumed from {} at step {}", options_.resume, state_.step);
    if (!tc.init_from.empty())
      STRATA_LOG_WARN("training.init_from ({}) is not used: the run resumed with the checkpoint's weights",
                      tc.init_from);
  } else if (!tc.init_from.empty()) {
    STRATA_RETURN_IF_ERROR(load_model(*model_, *opt_, tc.init_from, {tc.init_from_allow_non_finite})
                               .with_context("training.init_from"));
    STRATA_LOG_INFO("initialised weights from {}", tc.init_from);
  } else if (options_.initial_weights) {
    STRATA_RETURN_IF_ERROR(load_model(*model_, *opt_, options_.initial_weights).with_context("the initial weights"));
  } else {
    STRATA_RETURN_IF_ERROR(init_model(*model_, *opt_, static_cast<uint64_t>(tc.seed)));
  }
  first_step_ = state_.step;
  return Status::ok();
}

void TrainSession::log_run() const {
  const RunConfig& config = config_;
  const TrainingConfig& tc = config.training;
  for (const std::string& key : config.offload.not_acted_on) {
    STRATA_LOG_WARN("{}: {} is accepted but not acted on yet", config.source, key);
  }
  if (offload_stack_) STRATA_LOG_INFO("{}", offload_stack_->describe());
  STRATA_LOG_INFO("model: {}: {:.2f}M parameters{}", config.model.describe(), model_->whole_num_params() / 1e6,
                  tp_ || pp_ ? fmt::format(" ({:.2f}M on this rank)", model_->num_params() / 1e6) : std::string());
  STRATA_LOG_INFO("data: {}{}; {} tokens per step ({} x {} x {} accum{})",
                  train_ ? fmt::format("{} train tokens in {} shard(s)", train_->total_tokens(), train_->paths().size())
                         : std::string("the batches the program gives"),
                  val_ ? fmt::format(", {} val tokens", val_->total_tokens()) : std::string(), tokens_per_step(),
                  tc.batch_size, tc.seq_len, tc.grad_accum_steps,
                  dp_ ? fmt::format(" x {} data-parallel ranks", dp_size_) : std::string());
  STRATA_LOG_INFO("compute: {}, {} matmuls, {} threads; checkpoints to {}", device_->description(),
                  config.compute.matmul_precision == kernels::MatmulPrecision::kBF16 ? "bf16" : "fp32",
                  config.compute.threads > 0 ? config.compute.threads : tbb::info::default_concurrency(),
                  tc.checkpoint_dir);
}

Result<int> TrainSession::agree_on_stop(int signal) {
  float stop = static_cast<float>(signal);
  for (comm::Communicator* group : {dp_, pp_, tp_}) {
    if (group != nullptr)
      STRATA_RETURN_IF_ERROR(group->all_reduce(&stop, &stop, 1, DType::kF32, comm::ReduceOp::kMax));
  }
  return static_cast<int>(stop);
}

Status TrainSession::next_batch(int32_t* x, int32_t* y) {
  return train_ ? train_->next_batch(x, y) : options_.batches(x, y);
}

Result<StepResult> TrainSession::step() {
  const TrainingConfig& tc = config_.training;
  const int B = tc.batch_size, T = tc.seq_len;
  Timer step_timer;
  StepResult r;
  double mark = 0;  // the step's time when the last phase ended
  auto lap = [&](double* phase) {
    const double now = step_timer.seconds();
    *phase += now - mark;
    mark = now;
  };
  STRATA_RETURN_IF_ERROR(model_->zero_grads());
  lap(&r.phases.zero_grads);
  double loss_sum = 0.0;
  const double lr = lr_at(state_.step, tc.lr, tc.min_lr, tc.warmup_steps, tc.max_steps);
  // The step's micro-batches: every rank reads all of them (so the data position stays the same everywhere)
  // and computes every dp_size-th.
  const int micro_batches = tc.grad_accum_steps * dp_size_;
  const float grad_scale = (options_.gradient_factor ? options_.gradient_factor(state_.step + 1) : 1.0f) /
                           static_cast<float>(micro_batches);
  if (pipeline_) {  // this rank's micro-batches, then the schedule over them
    xs_.resize(static_cast<size_t>(tc.grad_accum_steps) * B * T);
    ys_.resize(xs_.size());
    std::vector<const int32_t*> in, tgt;
    for (int g = 0; g < micro_batches; ++g) {
      int32_t* xi = xs_.data() + in.size() * B * T;
      int32_t* yi = ys_.data() + in.size() * B * T;
      const bool mine = g % dp_size_ == dp_rank_;
      STRATA_RETURN_IF_ERROR(next_batch(mine ? xi : x_.data(), mine ? yi : y_.data()));
      if (!mine) continue;
      in.push_back(xi);
      tgt.push_back(yi);
    }
    STRATA_ASSIGN_OR_RETURN(const PipelineStepStats ps, pipeline_->run(in, tgt, grad_scale));
    lap(&r.phases.forward);
    float l = static_cast<float>(ps.loss_sum);  // the last stage's; zero elsewhere
    STRATA_RETURN_IF_ERROR(pp_->all_reduce(&l, &l, 1, DType::kF32, comm::ReduceOp::kSum));
    loss_sum = l;
    r.pipeline_bubble = ps.total_s > 0 ? 1.0 - ps.compute_s / ps.total_s : 0.0;
  }
  for (int g = 0; g < micro_batches && !pipeline_; ++g) {
    STRATA_RETURN_IF_ERROR(next_batch(x_.data(), y_.data()));
    if (g % dp_size_ != dp_rank_) continue;
    STRATA_ASSIGN_OR_RETURN(float loss, model_->forward(x_.data(), y_.data(), B, T));
    loss_sum += loss;
    lap(&r.phases.forward);
    {
      trace::Span span("begin backward");
      STRATA_RETURN_IF_ERROR(g + dp_size_ >= micro_batches ? opt_->begin_last_backward(static_cast<float>(lr))
                                                           : opt_->begin_accumulating_backward());
    }
    STRATA_RETURN_IF_ERROR(model_->backward(grad_scale));
    lap(&r.phases.backward);
  }
  if (dp_) {  // sum the gradients (stage 0; sharded and offloaded optimizers reduce their own) and the losses
    for (size_t i = 0; !sharded_opt_ && !offload_stack_ && i < model_->units().size(); ++i) {
      if (!model_->holds(i)) continue;  // another pipeline stage's
      const Unit& u = model_->units()[i];
      STRATA_RETURN_IF_ERROR(dp_->all_reduce(u.g(), u.g(), u.numel(), DType::kF32, comm::ReduceOp::kSum)
                                 .with_context("gradients of " + u.name));
    }
    float l = static_cast<float>(loss_sum);
    STRATA_RETURN_IF_ERROR(dp_->all_reduce(&l, &l, 1, DType::kF32, comm::ReduceOp::kSum));
    loss_sum = l;
  }
  lap(&r.phases.reduce);
  r.loss = static_cast<float>(loss_sum / micro_batches);
  r.lr = lr;
  std::optional<trace::Span> step_call(std::in_place, "optimizer step()");
  Result<double> stepped = opt_->step(static_cast<float>(lr), &r.skipped);
  if (!stepped.is_ok()) {
    // Where the run can go on from, if anywhere: a checkpoint this run or an earlier one wrote.
    std::error_code ec;
    const bool saved = fs::exists(fs::path(tc.checkpoint_dir) / "latest", ec);
    return stepped.status().with_context(
        saved ? fmt::format("step {} (resume with --resume {})", state_.step + 1, tc.checkpoint_dir)
              : fmt::format("step {} (no checkpoint was written yet: the run starts over)", state_.step + 1));
  }
  r.grad_norm = *stepped;
  step_call.reset();
  lap(&r.phases.optimizer_step);
  if (state_.step == first_step_) STRATA_LOG_INFO("{} memory: {}", device_->name(), device_->memory_report());
  if (offload_stack_) r.offload = offload_stack_->take_report();
  r.seconds = step_timer.seconds();
  r.step = ++state_.step;
  return r;
}

Result<std::optional<float>> TrainSession::validate() {
  // Every data-parallel rank has the same weights: rank 0 validates (every stage of its pipeline and every
  // rank of its tensor-parallel groups running the forward), and under ZeRO-3 every rank takes part in
  // gathering them.
  const TrainingConfig& tc = config_.training;
  if (!val_ || tc.val_batches == 0 || (dp_rank_ > 0 && !zero3_)) return std::optional<float>();
  STRATA_RETURN_IF_ERROR(val_->reset());
  const int n = static_cast<int>(std::min<uint64_t>(tc.val_batches, val_->batches_per_epoch()));
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    STRATA_RETURN_IF_ERROR(val_->next_batch(x_.data(), y_.data()));
    STRATA_ASSIGN_OR_RETURN(float loss, pipeline_ ? pipeline_->forward_only(x_.data(), y_.data())
                                                  : model_->forward(x_.data(), y_.data(), tc.batch_size, tc.seq_len));
    sum += loss;
  }
  if (pp_) STRATA_RETURN_IF_ERROR(pp_->broadcast(&sum, 2, DType::kF32, pp_size_ - 1));  // the last stage's, bits
  return std::optional<float>(static_cast<float>(sum / n));
}

// Rank 0 writes; with sharded moments the others hand it their slices while it does (ZeRO-3: they make the
// same collective reads, in the same order).
Status TrainSession::save_part(std::string* path) {
  // Under ZeRO-3 the units a stage's data-parallel rank 0 reads (all of them on the first stage, which holds
  // its own and receives the others'; its own on the others, to send them) are gathered over its group.
  if (zero3_ && dp_rank_ > 0)
    return take_part_in_checkpoint(*model_, *opt_, [&](size_t u) { return !pp_ || plan_.owner(u) == pp_rank_; });
  // A sharded optimizer's data-parallel group serves the gathers of a stage's moments until its rank 0, which
  // reads them, ends them.
  auto end_gathers = [&](Status taken) {
    if (!sharded_opt_) return taken;
    const Status ended = sharded_opt_->end_checkpoint();
    return taken.is_ok() ? ended : taken;
  };
  if (pp_ && dp_rank_ == 0 && pp_rank_ > 0)
    return end_gathers(take_part_in_pipeline_checkpoint(*model_, plan_, *opt_, *pp_));
  // The first stage's other tensor-parallel ranks gather with rank 0 (and receive the other stages' units).
  if (tp_ && dp_rank_ == 0 && tp_rank_ > 0)
    return end_gathers(take_part_in_checkpoint(*model_, *opt_, [](size_t) { return true; }));
  if (!leader_) return sharded_opt_ ? sharded_opt_->serve_checkpoint() : Status::ok();
  if (train_) state_.train_pos = train_->position();
  auto saved = save_checkpoint(config_.training.checkpoint_dir, *model_, *opt_, state_,
                               config_.training.keep_checkpoints);
  STRATA_RETURN_IF_ERROR(end_gathers(saved.status()));
  *path = std::move(saved).value();
  return Status::ok();
}

// Every rank ends a checkpoint together, knowing whether every rank's part succeeded, however long the
// leader's writing takes: a rank that went on as soon as its own part was done could end the job (a signal,
// an error: MPI_Abort) while the leader was still writing, or fail in the next step's first collective after
// the groups' timeout under a long save. Meanwhile the groups wait up to kCheckpointWaitS. A rank whose own
// part failed returns at once (the job then ends, MPI_Abort): the checkpoint cannot be whole without that
// part, and the other ranks — a pipeline's later stages still sending the first stage units it no longer
// reads, or ranks waiting for reads it no longer makes — would otherwise wait out that hour.
Result<std::string> TrainSession::save() {
  std::vector<std::pair<comm::Communicator*, double>> groups;  // and their own timeouts
  for (comm::Communicator* g : {tp_, pp_, dp_}) {
    if (g == nullptr) continue;
    groups.emplace_back(g, g->timeout());
    g->set_timeout(std::max(g->timeout(), kCheckpointWaitS));
  }
  std::string path;
  Status ended = save_part(&path);
  for (auto& [g, timeout] : groups) {  // over each axis of the grid
    if (ended.is_ok()) ended = g->barrier().with_context("ranks ending a checkpoint together");
  }
  for (auto& [g, timeout] : groups) g->set_timeout(timeout);
  if (!ended.is_ok()) return ended;
  return path;
}

}  // namespace strata::engine
