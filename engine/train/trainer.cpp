#include "engine/train/trainer.h"

#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <tbb/info.h>

#include "comm/staged_communicator.h"
#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/pipeline_checkpoint.h"
#include "engine/data/dataloader.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "engine/optim/pipeline_adamw.h"
#include "engine/optim/sharded_optimizer.h"
#include "engine/parallel/pipeline.h"
#include "engine/train/memory_plan.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/thread_limit.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// How long the other ranks wait for the one writing a checkpoint (its model file, the moments it gathers, the
// fsyncs): longer than any collective should take, but still an end to a leader that hangs.
constexpr double kCheckpointWaitS = 3600;

std::string hms(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const long s = std::lround(seconds);
  return s >= 3600 ? fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60)
                   : fmt::format("{:02d}:{:02d}", s / 60, s % 60);
}

}  // namespace

Result<TrainSummary> run_training(const RunConfig& config, const TrainOptions& options) {
  const TrainingConfig& tc = config.training;
  const int B = tc.batch_size, T = tc.seq_len;
  comm::Communicator* dp =
      options.data_parallel != nullptr && options.data_parallel->size() > 1 ? options.data_parallel : nullptr;
  const int dp_size = dp ? dp->size() : 1, dp_rank = dp ? dp->rank() : 0;
  comm::Communicator* pp =
      options.pipeline != nullptr && options.pipeline->size() > 1 ? options.pipeline : nullptr;
  const int pp_size = pp ? pp->size() : 1, pp_rank = pp ? pp->rank() : 0;
  comm::Communicator* tp = options.tensor_parallel != nullptr && options.tensor_parallel->size() > 1
                               ? options.tensor_parallel
                               : nullptr;
  const int tp_rank = tp ? tp->rank() : 0;
  const bool leader = dp_rank == 0 && pp_rank == 0 && tp_rank == 0;  // prints, writes metrics and checkpoints
  // The configured sizes must be the groups this process was given (mpirun starts them:
  // docs/parallelism.md).
  const std::pair<int, comm::Communicator*> sizes[] = {{config.parallel.tensor_parallel_size, tp},
                                                       {config.parallel.pipeline_parallel_size, pp}};
  for (const auto& [want, group] : sizes) {
    if (want != (group != nullptr ? group->size() : 1))
      return Status::invalid_argument(
          "{}: parallel.tensor_parallel_size {} x pipeline_parallel_size {} needs a multiple of {} ranks: launch "
          "with mpirun -np N",
          config.source, config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
          config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size);
  }
  // ZeRO-3: the offload stack's coordinator shards every unit over the ranks and gathers it for use, so every
  // rank runs every forward (validation too) and takes part in checkpoints. Stages 1 and 2 with an offloaded
  // optimizer run the same way (see offload_runtime.h).
  const bool zero3 = dp != nullptr && (config.offload.stage == 3 ||
                                       (config.offload.stage >= 1 && offload_enabled(config.offload)));
  const int64_t global_batch = static_cast<int64_t>(B) * tc.grad_accum_steps * dp_size;
  if (tc.global_batch_size > 0 && tc.global_batch_size != global_batch)
    return Status::invalid_argument(
        "{}: training.global_batch_size (train_batch_size) {} is not training.batch_size {} x grad_accum_steps {} x "
        "{} data-parallel rank(s) = {}",
        config.source, tc.global_batch_size, B, tc.grad_accum_steps, dp_size, global_batch);
  if ((dp || pp || tp) && !leader) logger().set_level(spdlog::level::warn);
  const kernels::cpu::CpuThreadLimit threads(config.compute.threads);  // TBB's and the matmuls' (OpenMP's)

  // Everything that can fail on input is checked before the first step.
  STRATA_RETURN_IF_ERROR(check_writable_dir(tc.checkpoint_dir, "training.checkpoint_dir"));
  // A new run would replace and prune an earlier run's checkpoints there: refused unless asked for.
  if (options.resume.empty() && !tc.overwrite_checkpoints)
    STRATA_RETURN_IF_ERROR(check_no_checkpoints(tc.checkpoint_dir));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics(nullptr, &std::fclose);
  if (!options.metrics_path.empty() && leader) {
    metrics.reset(std::fopen(options.metrics_path.c_str(), options.resume.empty() ? "w" : "a"));
    if (!metrics) return Status::io_error("cannot open metrics file {}: {}", options.metrics_path, std::strerror(errno));
  }
  STRATA_ASSIGN_OR_RETURN(DataLoader train,
                          DataLoader::open(config.data.train, B, T, config.model.vocab_size, "data.train"));
  std::optional<DataLoader> val;
  if (!config.data.val.empty()) {
    STRATA_ASSIGN_OR_RETURN(DataLoader v, DataLoader::open(config.data.val, B, T, config.model.vocab_size, "data.val"));
    val.emplace(std::move(v));
  }
  // A folder given as data.train takes every .bin in it: `strata tokenize` writes its validation shards there too.
  for (const std::string& p : train.paths()) {
    if (!val) {
      if (fs::path(p).filename().string().find("_val_") != std::string::npos)
        STRATA_LOG_WARN("data.train ({}) reads {}, which looks like a validation shard", config.data.train, p);
      continue;
    }
    std::error_code ec;
    for (const std::string& q : val->paths()) {
      if (fs::equivalent(p, q, ec))
        return Status::invalid_argument(
            "{}: data.train ({}) and data.val ({}) both read {}: the validation loss would be measured on training "
            "data; narrow data.train (for example DIR/*_train_*.bin)",
            config.source, config.data.train, config.data.val, p);
    }
  }

  const kernels::KernelSet* k = kernels::find_kernel_set(config.compute.kernels.c_str());
  STRATA_ASSERT(k != nullptr);  // parse_run_config validated the name
  // "auto" picks the GPU where there is one, unless the CPU reference kernels were asked for.
  const std::string device_name = config.compute.kernels == "reference" ? "cpu" : config.compute.device;
  std::unique_ptr<kernels::Device> own_device;
  if (options.device == nullptr) {
    STRATA_ASSIGN_OR_RETURN(own_device, kernels::make_device(device_name, *k));
  }
  kernels::Device* const device = options.device != nullptr ? options.device : own_device.get();
  device->set_memory_limit(config.offload.device_memory_limit);
  // On a device the host cannot address, the groups' collectives on device buffers go over NCCL, or are staged
  // through host memory (comm/staged_communicator.h); host buffers (the losses, norms, checkpoints) go over
  // MPI. Every rank sets up its groups in the same order (each is collective over its own ranks).
  std::unique_ptr<comm::Communicator> device_groups[3];
  int g = 0;
  for (comm::Communicator** group : {&dp, &pp, &tp}) {
    STRATA_ASSIGN_OR_RETURN(*group, comm::device_collectives(*group, *device, config.parallel.distributed_backend,
                                                       options.device_plane, &device_groups[g++]));
  }
  const bool offloaded = offload_enabled(config.offload) || zero3;
  // The offload stack and the host pool of activation checkpoints are declared before the model, so the
  // model (whose host checkpoints come from a pool) is destroyed first.
  std::unique_ptr<OffloadRuntime> offload_stack;
  std::unique_ptr<offload::PinnedPool> checkpoint_pool;
  const PipelinePlan plan = plan_pipeline(config.model, T, pp_size);
  const PipelineStage stage = pp ? plan.stages[static_cast<size_t>(pp_rank)] : PipelineStage{};
  {
    // Before anything large is allocated: the state this rank's placements put on each tier, counted on the
    // model's units as this rank holds them (created offloaded, so with nothing allocated), against the budgets.
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> shape,
                            GPT2::create(config.model, *device, config.compute.matmul_precision, true, stage, tp,
                                         config.parallel.sequence_parallel));
    MemoryPlacement placement;
    placement.offloaded = offloaded;
    placement.zero3_ranks = zero3 ? static_cast<size_t>(dp_size) : 1;
    if (dp && !zero3 && (config.offload.stage == 1 || config.offload.stage == 2))
      placement.zero12_ranks = static_cast<size_t>(dp_size);
    auto memory = plan_memory(*shape, config.offload, placement);
    if (!memory.is_ok()) return memory.status().with_context(config.source);
    const MemoryBudgets budgets = measure_memory_budgets(*memory, config.offload, *device);
    const Status fits = check_memory_fits(*memory, budgets, config.offload);
    if (!fits.is_ok()) return fits.with_context(config.source);
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> model,
                          GPT2::create(config.model, *device, config.compute.matmul_precision, offloaded, stage, tp,
                                       config.parallel.sequence_parallel));
  model->set_working_copies(config.compute.bf16_working_copies);
  std::unique_ptr<PipelineRunner> pipeline;
  if (pp) {
    STRATA_ASSIGN_OR_RETURN(
        pipeline, PipelineRunner::create(*model, *pp,
                                         config.parallel.pipeline_schedule == "gpipe" ? PipelineSchedule::kGPipe
                                                                                      : PipelineSchedule::k1F1B,
                                         tc.grad_accum_steps, B, T));
    if (pp_rank == 0) model->set_params_source(pipeline_params_source(*model, plan, *pp));
    STRATA_LOG_INFO("pipeline: {} stages, {} schedule, {} micro-batches per step: {}", pp_size,
                    config.parallel.pipeline_schedule, tc.grad_accum_steps, plan.describe());
  }
  AdamWConfig ac;
  ac.beta1 = static_cast<float>(tc.beta1);
  ac.beta2 = static_cast<float>(tc.beta2);
  ac.eps = static_cast<float>(tc.eps);
  ac.weight_decay = static_cast<float>(tc.weight_decay);
  ac.grad_clip = static_cast<float>(tc.grad_clip);
  std::optional<AdamW> device_opt;
  std::unique_ptr<ShardedAdamW> sharded_opt;  // ZeRO stage 1 or 2 over the data-parallel ranks
  std::unique_ptr<PipelineAdamW> pipeline_opt;
  Optimizer* opt = nullptr;
  const bool zero12 = dp && !zero3 && (config.offload.stage == 1 || config.offload.stage == 2);
  if (pp && !dp && !offloaded && (config.offload.stage == 1 || config.offload.stage == 2))
    STRATA_LOG_INFO("zero_optimization.stage {}: one data-parallel rank per pipeline stage, so each stage keeps its "
                    "whole optimizer state (nothing to shard it over)",
                    config.offload.stage);
  if (pp && !offloaded && !zero12) {
    STRATA_ASSIGN_OR_RETURN(pipeline_opt, PipelineAdamW::create(*model, plan, ac, *device, *pp));
    opt = pipeline_opt.get();
  } else if (zero12) {
    ShardedAdamWOptions so;
    so.stage = config.offload.stage;
    so.held.resize(model->units().size());
    for (size_t u = 0; u < so.held.size(); ++u) so.held[u] = model->holds(u);
    so.reduce_bucket = static_cast<size_t>(config.offload.reduce_bucket_size);
    so.allgather_bucket = static_cast<size_t>(config.offload.allgather_bucket_size);
    STRATA_ASSIGN_OR_RETURN(sharded_opt, ShardedAdamW::create(model->units(), ac, *device, *dp, so));
    sharded_opt->set_norm_shares(&model->norm_shares());
    if (pp) STRATA_RETURN_IF_ERROR(sharded_opt->set_pipeline(plan, *pp));
    opt = sharded_opt.get();
    STRATA_LOG_INFO("zero_optimization.stage {}: Adam's moments sharded over {} ranks ({} of {} elements here)",
                    config.offload.stage, dp_size, sharded_opt->shard_elements(), model->num_params());
  } else if (offloaded) {
    auto rt = OffloadRuntime::create(config.offload, ac, *device, *model, dp, pp, &plan);
    if (!rt.is_ok()) return rt.status().with_context(config.source);
    offload_stack = std::move(rt).value();
    opt = &offload_stack->optimizer();
    // Over several ranks (stage 0) the offloaded optimizer sums the gradients where they are, in host memory.
    if (dp && !zero3) STRATA_RETURN_IF_ERROR(offload_stack->offloaded_optimizer().set_gradient_reducer(dp));
  } else {
    STRATA_ASSIGN_OR_RETURN(AdamW a, AdamW::create(model->units(), ac, *device));
    device_opt.emplace(std::move(a));
    device_opt->set_norm_shares(&model->norm_shares());
    opt = &*device_opt;
  }

  // Activation checkpointing; host checkpoints come from the offload stack's pool (the host tier's budget),
  // or from a pool of their own under the same limit.
  const ActivationCheckpointConfig& acfg = config.offload.activation_checkpointing;
  if (acfg.enabled) {
    offload::PinnedPool* pool = offload_stack ? &offload_stack->pool() : nullptr;
    if (acfg.cpu_checkpointing && pool == nullptr) {
      STRATA_ASSIGN_OR_RETURN(checkpoint_pool, offload::PinnedPool::create(offload::PinnedPoolOptions{
                                                   .budget_bytes = config.offload.host_memory_limit, .lock = false,
                                                   .budget_name = "memory.host_memory_limit"}));
      pool = checkpoint_pool.get();
      register_pool_buffers(*pool, *device);
    }
    model->set_activation_checkpointing(
        acfg.cpu_checkpointing ? ActivationCheckpointing::kHost : ActivationCheckpointing::kDevice, pool);
  }
  // Before the weights are written (minutes for a model on NVMe): a device budget too small for the
  // activations fails now.
  STRATA_RETURN_IF_ERROR(model->reserve_activations(B, T).with_context(
      fmt::format("activations for training.batch_size {} x training.seq_len {}", B, T)));

  TrainState state;
  state.config = config.json;
  state.train_shards = shard_records(train);
  if (!options.resume.empty()) {
    // The data position counts in the checkpoint's shards: checked before the weights are read.
    size_t shard = 0;
    auto loaded = load_checkpoint(options.resume, *model, *opt, [&](const TrainState& saved) -> Status {
      STRATA_ASSIGN_OR_RETURN(shard,
                              resume_shard(saved.train_shards, saved.train_pos, state.train_shards, "data.train"));
      return Status::ok();
    });
    if (!loaded.is_ok()) return loaded.status().with_context("--resume " + options.resume);
    state.step = loaded->step;
    state.train_pos = loaded->train_pos;
    state.train_pos.shard = shard;
    STRATA_RETURN_IF_ERROR(train.seek(state.train_pos));
    if (const std::vector<std::string> changes = config_changes(loaded->config, config.json);
        leader && !changes.empty() && !loaded->config.empty()) {  // every rank runs the same config
      std::string listed;
      for (size_t i = 0; i < changes.size() && i < 12; ++i) listed += (i ? "; " : "") + changes[i];
      if (changes.size() > 12) listed += fmt::format("; and {} more", changes.size() - 12);
      STRATA_LOG_WARN("resuming with settings other than those of the run that saved the checkpoint: {}", listed);
    }
    STRATA_LOG_INFO("resumed from {} at step {}", options.resume, state.step);
    if (!tc.init_from.empty())
      STRATA_LOG_WARN("training.init_from ({}) is not used: the run resumed with the checkpoint's weights", tc.init_from);
  } else if (!tc.init_from.empty()) {
    STRATA_RETURN_IF_ERROR(load_model(*model, *opt, tc.init_from, {tc.init_from_allow_non_finite})
                               .with_context("training.init_from"));
    STRATA_LOG_INFO("initialised weights from {}", tc.init_from);
  } else {
    STRATA_RETURN_IF_ERROR(init_model(*model, *opt, static_cast<uint64_t>(tc.seed)));
  }

  for (const std::string& key : config.offload.not_acted_on) {
    STRATA_LOG_WARN("{}: {} is accepted but not acted on yet", config.source, key);
  }
  if (offload_stack) STRATA_LOG_INFO("{}", offload_stack->describe());
  const int64_t tokens_per_step = static_cast<int64_t>(B) * T * tc.grad_accum_steps * dp_size;
  STRATA_LOG_INFO("model: GPT-2 {} layers, {} heads, width {}, vocab {}, context {}: {:.2f}M parameters{}",
                  config.model.n_layer, config.model.n_head, config.model.n_embd, config.model.vocab_size,
                  config.model.block_size, model->whole_num_params() / 1e6,
                  tp || pp ? fmt::format(" ({:.2f}M on this rank)", model->num_params() / 1e6) : std::string());
  STRATA_LOG_INFO("data: {} train tokens in {} shard(s){}; {} tokens per step ({} x {} x {} accum{})",
                  train.total_tokens(), train.paths().size(),
                  val ? fmt::format(", {} val tokens", val->total_tokens()) : std::string(), tokens_per_step, B, T,
                  tc.grad_accum_steps, dp ? fmt::format(" x {} data-parallel ranks", dp_size) : std::string());
  STRATA_LOG_INFO("compute: {}, {} matmuls, {} threads; checkpoints to {}", device->description(),
                  config.compute.matmul_precision == kernels::MatmulPrecision::kBF16 ? "bf16" : "fp32",
                  config.compute.threads > 0 ? config.compute.threads : tbb::info::default_concurrency(),
                  tc.checkpoint_dir);

  g_stop_signal = 0;
  auto old_int = std::signal(SIGINT, on_stop_signal);
  auto old_term = std::signal(SIGTERM, on_stop_signal);
  struct RestoreSignals {
    decltype(old_int) i, t;
    ~RestoreSignals() {
      std::signal(SIGINT, i);
      std::signal(SIGTERM, t);
    }
  } restore{old_int, old_term};

  std::vector<int32_t> x(static_cast<size_t>(B) * T), y(static_cast<size_t>(B) * T);
  std::vector<int32_t> xs, ys;  // pipeline: the step's micro-batches of this rank
  TrainSummary summary;
  auto validate = [&]() -> Status {
    // Every data-parallel rank has the same weights: rank 0 validates (every stage of its pipeline and every
    // rank of its tensor-parallel groups running the forward), and under ZeRO-3 every rank takes part in
    // gathering them.
    if (!val || tc.val_batches == 0 || (dp_rank > 0 && !zero3)) return Status::ok();
    STRATA_RETURN_IF_ERROR(val->reset());
    const int n = static_cast<int>(std::min<uint64_t>(tc.val_batches, val->batches_per_epoch()));
    double sum = 0.0;
    for (int i = 0; i < n; ++i) {
      STRATA_RETURN_IF_ERROR(val->next_batch(x.data(), y.data()));
      STRATA_ASSIGN_OR_RETURN(float loss, pipeline ? pipeline->forward_only(x.data(), y.data())
                                                   : model->forward(x.data(), y.data(), B, T));
      sum += loss;
    }
    if (pp) STRATA_RETURN_IF_ERROR(pp->broadcast(&sum, 2, DType::kF32, pp_size - 1));  // the last stage's, bits
    summary.val_loss = static_cast<float>(sum / n);
    return Status::ok();
  };
  // Rank 0 writes; with sharded moments the others hand it their slices while it does (ZeRO-3: they make the
  // same collective reads, in the same order).
  auto checkpoint = [&]() -> Status {
    // Under ZeRO-3 the units a stage's data-parallel rank 0 reads (all of them on the first stage, which holds
    // its own and receives the others'; its own on the others, to send them) are gathered over its group.
    if (zero3 && dp_rank > 0)
      return take_part_in_checkpoint(*model, *opt, [&](size_t u) { return !pp || plan.owner(u) == pp_rank; });
    // A sharded optimizer's data-parallel group serves the gathers of a stage's moments until its rank 0, which
    // reads them, ends them.
    auto end_gathers = [&](Status taken) {
      if (!sharded_opt) return taken;
      const Status ended = sharded_opt->end_checkpoint();
      return taken.is_ok() ? ended : taken;
    };
    if (pp && dp_rank == 0 && pp_rank > 0)
      return end_gathers(take_part_in_pipeline_checkpoint(*model, plan, *opt, *pp));
    // The first stage's other tensor-parallel ranks gather with rank 0 (and receive the other stages' units).
    if (tp && dp_rank == 0 && tp_rank > 0)
      return end_gathers(take_part_in_checkpoint(*model, *opt, [](size_t) { return true; }));
    if (!leader) return sharded_opt ? sharded_opt->serve_checkpoint() : Status::ok();
    state.train_pos = train.position();
    auto saved = save_checkpoint(tc.checkpoint_dir, *model, *opt, state, tc.keep_checkpoints);
    STRATA_RETURN_IF_ERROR(end_gathers(saved.status()));
    STRATA_ASSIGN_OR_RETURN(summary.checkpoint, std::move(saved));
    return Status::ok();
  };
  // Every rank ends a checkpoint together, knowing whether every rank's part succeeded, however long the
  // leader's writing takes: a rank that went on as soon as its own part was done could end the job (a signal,
  // an error: MPI_Abort) while the leader was still writing, or fail in the next step's first collective after
  // the groups' timeout under a long save. Meanwhile the groups wait up to kCheckpointWaitS. A rank whose own
  // part failed returns at once (the job then ends, MPI_Abort): the checkpoint cannot be whole without that
  // part, and the other ranks — a pipeline's later stages still sending the first stage units it no longer
  // reads, or ranks waiting for reads it no longer makes — would otherwise wait out that hour.
  auto checkpoint_together = [&]() -> Status {
    std::vector<std::pair<comm::Communicator*, double>> groups;  // and their own timeouts
    for (comm::Communicator* g : {tp, pp, dp}) {
      if (g == nullptr) continue;
      groups.emplace_back(g, g->timeout());
      g->set_timeout(std::max(g->timeout(), kCheckpointWaitS));
    }
    Status ended = checkpoint();
    for (auto& [g, timeout] : groups) {  // over each axis of the grid
      if (ended.is_ok()) ended = g->barrier().with_context("ranks ending a checkpoint together");
    }
    for (auto& [g, timeout] : groups) g->set_timeout(timeout);
    return ended;
  };

  // A fine-tune (a new run from training.init_from) measures the weights it starts from first: the baseline its
  // validation losses compare with. With max_steps 0 that is the whole run (and its checkpoint holds the
  // weights in our format).
  if (!tc.init_from.empty() && options.resume.empty() && tc.val_every > 0) {
    STRATA_RETURN_IF_ERROR(validate());
    if (val.has_value() && tc.val_batches > 0) {
      if (options.progress && leader) {
        std::puts(fmt::format("step {:>5}/{} | val {:.4f} (the weights of {})", 0, tc.max_steps, summary.val_loss,
                              tc.init_from)
                      .c_str());
        std::fflush(stdout);
      }
      if (metrics) {
        std::fprintf(metrics.get(), "%s\n", nlohmann::json{{"step", 0}, {"val_loss", summary.val_loss}}.dump().c_str());
        std::fflush(metrics.get());
      }
    }
  }

  Timer run_timer;
  const int first_step = state.step;
  // Steps in a row whose loss or gradient norm was not finite. Their state is never checkpointed: a run that
  // stays non-finite stops with an error, and `latest` keeps naming the last good checkpoint.
  int non_finite_in_a_row = 0;
  constexpr int kMaxNonFiniteSteps = 10;
  const std::string last_good = fmt::format("`latest` in {} still names the last checkpoint before them",
                                            tc.checkpoint_dir);
  for (; state.step < tc.max_steps; ++state.step) {
    trace::Span step_span("step", state.step + 1);
    // Every rank stops at the same step (the checkpoint is collective), whichever saw the signal first.
    float stop = static_cast<float>(g_stop_signal);
    for (comm::Communicator* group : {dp, pp, tp}) {
      if (group != nullptr) STRATA_RETURN_IF_ERROR(group->all_reduce(&stop, &stop, 1, DType::kF32, comm::ReduceOp::kMax));
    }
    if (stop != 0 && non_finite_in_a_row > 0) {
      return Status(StatusCode::kInternal,
                    fmt::format("interrupted by signal {} after {} non-finite step(s), whose state is not saved: {}",
                                int(stop), non_finite_in_a_row, last_good));
    }
    if (stop != 0) {
      STRATA_LOG_WARN("signal {} received: saving a checkpoint at step {} and stopping", int(stop), state.step);
      STRATA_RETURN_IF_ERROR(checkpoint_together());
      STRATA_LOG_INFO("checkpoint: {}", summary.checkpoint);
      return Status(StatusCode::kInternal, fmt::format("interrupted by signal {}; resume with --resume {}", int(stop),
                                                       tc.checkpoint_dir));
    }
    Timer step_timer;
    STRATA_RETURN_IF_ERROR(model->zero_grads());
    double loss_sum = 0.0;
    double bubble = -1.0;  // pipeline: this stage's idle share of the schedule
    const double lr = lr_at(state.step, tc.lr, tc.min_lr, tc.warmup_steps, tc.max_steps);
    // The step's micro-batches: every rank reads all of them (so the data position stays the same everywhere)
    // and computes every dp_size-th.
    const int micro_batches = tc.grad_accum_steps * dp_size;
    const float grad_scale = (options.gradient_factor ? options.gradient_factor(state.step + 1) : 1.0f) /
                             static_cast<float>(micro_batches);
    if (pipeline) {  // this rank's micro-batches, then the schedule over them
      xs.resize(static_cast<size_t>(tc.grad_accum_steps) * B * T);
      ys.resize(xs.size());
      std::vector<const int32_t*> in, tgt;
      for (int g = 0; g < micro_batches; ++g) {
        int32_t* xi = xs.data() + in.size() * B * T;
        int32_t* yi = ys.data() + in.size() * B * T;
        STRATA_RETURN_IF_ERROR(train.next_batch(g % dp_size == dp_rank ? xi : x.data(),
                                                g % dp_size == dp_rank ? yi : y.data()));
        if (g % dp_size != dp_rank) continue;
        in.push_back(xi);
        tgt.push_back(yi);
      }
      STRATA_ASSIGN_OR_RETURN(const PipelineStepStats ps,
                              pipeline->run(in, tgt, grad_scale));
      float l = static_cast<float>(ps.loss_sum);  // the last stage's; zero elsewhere
      STRATA_RETURN_IF_ERROR(pp->all_reduce(&l, &l, 1, DType::kF32, comm::ReduceOp::kSum));
      loss_sum = l;
      bubble = ps.total_s > 0 ? 1.0 - ps.compute_s / ps.total_s : 0.0;
    }
    for (int g = 0; g < micro_batches && !pipeline; ++g) {
      STRATA_RETURN_IF_ERROR(train.next_batch(x.data(), y.data()));
      if (g % dp_size != dp_rank) continue;
      STRATA_ASSIGN_OR_RETURN(float loss, model->forward(x.data(), y.data(), B, T));
      loss_sum += loss;
      if (g + dp_size >= micro_batches) {
        STRATA_RETURN_IF_ERROR(opt->begin_last_backward(static_cast<float>(lr)));
      } else {
        STRATA_RETURN_IF_ERROR(opt->begin_accumulating_backward());
      }
      STRATA_RETURN_IF_ERROR(model->backward(grad_scale));
    }
    if (dp) {  // sum the gradients (stage 0; sharded and offloaded optimizers reduce their own) and the losses
      for (size_t i = 0; !sharded_opt && !offload_stack && i < model->units().size(); ++i) {
        if (!model->holds(i)) continue;  // another pipeline stage's
        const Unit& u = model->units()[i];
        STRATA_RETURN_IF_ERROR(dp->all_reduce(u.g(), u.g(), u.numel(), DType::kF32, comm::ReduceOp::kSum)
                                   .with_context("gradients of " + u.name));
      }
      float l = static_cast<float>(loss_sum);
      STRATA_RETURN_IF_ERROR(dp->all_reduce(&l, &l, 1, DType::kF32, comm::ReduceOp::kSum));
      loss_sum = l;
    }
    const float loss = static_cast<float>(loss_sum / micro_batches);
    bool skipped = false;
    std::optional<trace::Span> step_call(std::in_place, "optimizer step()");
    Result<double> stepped = opt->step(static_cast<float>(lr), &skipped);
    if (!stepped.is_ok()) {
      // Where the run can go on from, if anywhere: a checkpoint this run or an earlier one wrote.
      std::error_code ec;
      const bool saved = std::filesystem::exists(std::filesystem::path(tc.checkpoint_dir) / "latest", ec);
      return stepped.status().with_context(
          saved ? fmt::format("step {} (resume with --resume {})", state.step + 1, tc.checkpoint_dir)
                : fmt::format("step {} (no checkpoint was written yet: the run starts over)", state.step + 1));
    }
    const double norm = *stepped;
    step_call.reset();
    if (state.step == first_step) STRATA_LOG_INFO("{} memory: {}", device->name(), device->memory_report());
    std::optional<OffloadStepReport> report;
    if (offload_stack) report = offload_stack->take_report();
    if (skipped || !std::isfinite(loss)) {
      if (skipped) STRATA_LOG_WARN("step {}: loss {}, gradient norm {}; update skipped", state.step + 1, loss, norm);
      else STRATA_LOG_WARN("step {}: loss {}: not finite", state.step + 1, loss);
      if (++non_finite_in_a_row >= kMaxNonFiniteSteps) {
        return Status::invalid_argument("steps {} to {}: {} steps in a row had a non-finite loss or gradient norm "
                                        "(last loss {}, norm {}); stopped without a checkpoint of their state: {}",
                                        state.step + 2 - kMaxNonFiniteSteps, state.step + 1, kMaxNonFiniteSteps, loss,
                                        norm, last_good);
      }
    } else {
      non_finite_in_a_row = 0;
    }
    const double step_s = step_timer.seconds();
    const double tok_s = tokens_per_step / step_s;
    summary.last_loss = loss;
    ++summary.steps;
    const int done = state.step + 1;

    bool ran_val = false;
    if (tc.val_every > 0 && (done % tc.val_every == 0 || done == tc.max_steps)) {
      STRATA_RETURN_IF_ERROR(validate());
      ran_val = val.has_value() && tc.val_batches > 0;
    }
    if (options.progress && leader && (done % tc.log_every == 0 || done == tc.max_steps || done == first_step + 1)) {
      const double elapsed = run_timer.seconds();
      const double eta = elapsed / (done - first_step) * (tc.max_steps - done);
      std::string line = fmt::format("step {:>5}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:>7.0f} tok/s | "
                                     "{:>6.0f} ms | elapsed {} | eta {}",
                                     done, tc.max_steps, loss, lr, norm, tok_s, step_s * 1e3, hms(elapsed), hms(eta));
      if (ran_val) line += fmt::format(" | val {:.4f}", summary.val_loss);
      if (report) line += " | " + report->summary();
      std::puts(line.c_str());
      std::fflush(stdout);
    }
    if (metrics) {
      nlohmann::json m = {{"step", done},           {"loss", loss},           {"lr", lr},
                          {"grad_norm", norm},       {"tokens_per_s", tok_s},  {"step_ms", step_s * 1e3}};
      if (bubble >= 0) m["pipeline_bubble"] = bubble;
      if (ran_val) m["val_loss"] = summary.val_loss;
      if (skipped) m["skipped"] = true;
      if (report) m["offload"] = report->to_json();
      std::fprintf(metrics.get(), "%s\n", m.dump().c_str());
      std::fflush(metrics.get());
    }
    const bool checkpoint_due = tc.checkpoint_every > 0 && done % tc.checkpoint_every == 0 && done != tc.max_steps;
    if (checkpoint_due && non_finite_in_a_row > 0) {
      STRATA_LOG_WARN("step {}: no checkpoint, after {} non-finite step(s)", done, non_finite_in_a_row);
    } else if (checkpoint_due) {
      state.step = done;
      STRATA_RETURN_IF_ERROR(checkpoint_together());
      if (options.progress) STRATA_LOG_INFO("checkpoint: {}", summary.checkpoint);
      state.step = done - 1;
    }
  }
  if (non_finite_in_a_row > 0) {
    return Status::invalid_argument("the run ended on {} step(s) with a non-finite loss or gradient norm (last loss "
                                    "{}); no checkpoint of their state was written: {}",
                                    non_finite_in_a_row, summary.last_loss, last_good);
  }
  if (summary.steps > 0 || options.resume.empty()) {
    STRATA_RETURN_IF_ERROR(checkpoint_together());
  }
  const double total_s = run_timer.seconds();
  summary.tokens_per_s = total_s > 0 ? summary.steps * tokens_per_step / total_s : 0.0;
  return summary;
}

}  // namespace strata::engine
