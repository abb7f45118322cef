#include "engine/train/offload_config.h"

#include <fmt/format.h>

#include "common/units.h"
#include "offload/optimizer_swap.h"

namespace strata::engine {
namespace {

Status read_target(JsonSection s, bool is_param, OffloadTargetConfig* t) {
  STRATA_RETURN_IF_ERROR(s.get_string("device", &t->device));
  STRATA_RETURN_IF_ERROR(s.get_string("nvme_path", &t->nvme_path));
  STRATA_RETURN_IF_ERROR(s.get_bool("pin_memory", &t->pin_memory));
  STRATA_RETURN_IF_ERROR(s.get_int_or_auto("buffer_count", &t->buffer_count));
  if (is_param) {
    STRATA_RETURN_IF_ERROR(s.get_int_or_auto("buffer_size", &t->buffer_size));
    STRATA_RETURN_IF_ERROR(s.get_int_or_auto("max_in_cpu", &t->max_in_cpu));
  } else {
    STRATA_RETURN_IF_ERROR(s.get_bool("pipeline_read", &t->pipeline_read));
    STRATA_RETURN_IF_ERROR(s.get_bool("pipeline_write", &t->pipeline_write));
    STRATA_RETURN_IF_ERROR(s.get_bool("overlap_backward", &t->overlap_backward));
    STRATA_RETURN_IF_ERROR(s.get_int("speculative_sub_groups", &t->speculative_sub_groups));
    if (t->speculative_sub_groups < 0)
      return Status::invalid_argument("{} must be >= 0, got {}", s.qualified("speculative_sub_groups"),
                                      t->speculative_sub_groups);
    STRATA_RETURN_IF_ERROR(s.get_double("ratio", &t->ratio));
    if (!(t->ratio > 0.0 && t->ratio <= 1.0))
      return Status::invalid_argument("{} must be in (0, 1] (the share of the optimizer state offloaded; without "
                                      "offload leave out offload_optimizer), got {}",
                                      s.qualified("ratio"), t->ratio);
  }
  STRATA_RETURN_IF_ERROR(s.finish());
  const std::string where = s.qualified("device");
  if (t->device != "none" && t->device != "cpu" && t->device != "nvme")
    return Status::invalid_argument("{} must be \"none\", \"cpu\" or \"nvme\", got \"{}\"", where, t->device);
  if (t->device == "nvme" && t->nvme_path.empty())
    return Status::invalid_argument("{} is \"nvme\", so {} must name the folder for the swap files", where,
                                    s.qualified("nvme_path"));
  for (auto [key, v] : {std::pair{"buffer_count", t->buffer_count}, std::pair{"buffer_size", t->buffer_size},
                        std::pair{"max_in_cpu", t->max_in_cpu}}) {
    if (v <= 0) return Status::invalid_argument("{} must be positive, got {}", s.qualified(key), v);
  }
  return Status::ok();
}

// "4G", "512M", 4294967296 -> bytes; 0 (the default: no limit of ours) stays 0.
Status read_bytes(JsonSection& s, const char* key, uint64_t* out) {
  std::string text;
  int64_t number = -1;
  if (Status st = s.get_int(key, &number); st.is_ok()) {
    if (number < -1) return Status::invalid_argument("{} must be >= 0 bytes, got {}", s.qualified(key), number);
    if (number >= 0) *out = static_cast<uint64_t>(number);
    return Status::ok();
  }
  STRATA_RETURN_IF_ERROR(s.get_string(key, &text));
  const uint64_t bytes = parse_bytes(text);
  if (bytes == 0 && text != "0")
    return Status::invalid_argument("{} must be a byte count such as 4096, \"512M\" or \"4G\", got \"{}\"",
                                    s.qualified(key), text);
  *out = bytes;
  return Status::ok();
}

}  // namespace

Status parse_offload_config(JsonSection& root, const std::string& source, OffloadConfig* c) {
  JsonSection z = root.section("zero_optimization");
  STRATA_RETURN_IF_ERROR(z.get_int("stage", &c->stage));
  STRATA_RETURN_IF_ERROR(read_target(z.section("offload_param"), true, &c->offload_param).with_context(source));
  STRATA_RETURN_IF_ERROR(
      read_target(z.section("offload_optimizer"), false, &c->offload_optimizer).with_context(source));
  STRATA_RETURN_IF_ERROR(z.get_int_or_auto("sub_group_size", &c->sub_group_size));
  STRATA_RETURN_IF_ERROR(z.get_int_or_auto("stage3_prefetch_bucket_size", &c->stage3_prefetch_bucket_size));
  STRATA_RETURN_IF_ERROR(z.get_int_or_auto("stage3_max_live_parameters", &c->stage3_max_live_parameters));
  STRATA_RETURN_IF_ERROR(z.get_int_or_auto("stage3_max_reuse_distance", &c->stage3_max_reuse_distance));
  STRATA_RETURN_IF_ERROR(
      z.get_int_or_auto("stage3_param_persistence_threshold", &c->stage3_param_persistence_threshold));
  STRATA_RETURN_IF_ERROR(z.get_int_or_auto("reduce_bucket_size", &c->reduce_bucket_size));
  STRATA_RETURN_IF_ERROR(z.get_int_or_auto("allgather_bucket_size", &c->allgather_bucket_size));
  c->overlap_comm = c->stage == 3;  // DeepSpeed's default by stage
  STRATA_RETURN_IF_ERROR(z.get_bool("overlap_comm", &c->overlap_comm));
  STRATA_RETURN_IF_ERROR(z.get_bool("contiguous_gradients", &c->contiguous_gradients));
  STRATA_RETURN_IF_ERROR(z.get_bool("reduce_scatter", &c->reduce_scatter));
  STRATA_RETURN_IF_ERROR(z.get_bool("allgather_partitions", &c->allgather_partitions));
  STRATA_RETURN_IF_ERROR(z.finish());
  if (c->stage < 0 || c->stage > 3)
    return Status::invalid_argument("{}: zero_optimization.stage must be 0, 1, 2 or 3, got {}", source, c->stage);
  if (c->offload_param.device != "none" && c->stage != 3) {
    return Status::invalid_argument(
        "{}: zero_optimization.offload_param needs zero_optimization.stage = 3 (as in DeepSpeed), got stage {}",
        source, c->stage);
  }
  for (auto [key, v] : {std::pair{"sub_group_size", c->sub_group_size},
                        std::pair{"stage3_prefetch_bucket_size", c->stage3_prefetch_bucket_size},
                        std::pair{"stage3_max_live_parameters", c->stage3_max_live_parameters},
                        std::pair{"stage3_max_reuse_distance", c->stage3_max_reuse_distance},
                        std::pair{"reduce_bucket_size", c->reduce_bucket_size},
                        std::pair{"allgather_bucket_size", c->allgather_bucket_size}}) {
    if (v <= 0) return Status::invalid_argument("{}: zero_optimization.{} must be positive, got {}", source, key, v);
  }
  // Sub-groups are rounded up to whole 1024-element chunks; beyond 2^40 elements (4 TiB of fp32 each) a size
  // means "one per unit" as well as any, and the rounding must not overflow.
  if (c->sub_group_size > offload::kMaxSubGroupSize)
    return Status::invalid_argument("{}: zero_optimization.sub_group_size must be at most {} (2^40), got {}", source,
                                    offload::kMaxSubGroupSize, c->sub_group_size);
  if (c->stage3_param_persistence_threshold < 0)
    return Status::invalid_argument("{}: zero_optimization.stage3_param_persistence_threshold must be >= 0", source);

  JsonSection a = root.section("aio");
  STRATA_RETURN_IF_ERROR(a.get_int_or_auto("block_size", &c->aio.block_size));
  STRATA_RETURN_IF_ERROR(a.get_int_or_auto("queue_depth", &c->aio.queue_depth));
  STRATA_RETURN_IF_ERROR(a.get_int_or_auto("intra_op_parallelism", &c->aio.intra_op_parallelism));
  STRATA_RETURN_IF_ERROR(a.get_bool("single_submit", &c->aio.single_submit));
  STRATA_RETURN_IF_ERROR(a.get_bool("overlap_events", &c->aio.overlap_events));
  STRATA_RETURN_IF_ERROR(a.finish());
  if (c->aio.block_size < 4096 || c->aio.block_size % 4096 != 0 || c->aio.block_size > (int64_t{1} << 30)) {
    return Status::invalid_argument("{}: aio.block_size must be a multiple of 4096 (O_DIRECT) up to 1 GiB, got {}",
                                    source, c->aio.block_size);
  }
  if (c->aio.queue_depth <= 0 || c->aio.queue_depth > 4096)
    return Status::invalid_argument("{}: aio.queue_depth must be in [1, 4096], got {}", source, c->aio.queue_depth);
  if (c->aio.intra_op_parallelism <= 0 || c->aio.intra_op_parallelism > 64)
    return Status::invalid_argument("{}: aio.intra_op_parallelism must be in [1, 64], got {}", source,
                                    c->aio.intra_op_parallelism);

  JsonSection ac = root.section("activation_checkpointing");
  ActivationCheckpointConfig& act = c->activation_checkpointing;
  STRATA_RETURN_IF_ERROR(ac.get_bool("enabled", &act.enabled));
  STRATA_RETURN_IF_ERROR(ac.get_bool("cpu_checkpointing", &act.cpu_checkpointing));
  STRATA_RETURN_IF_ERROR(ac.get_bool("partition_activations", &act.partition_activations));
  STRATA_RETURN_IF_ERROR(ac.get_bool("contiguous_memory_optimization", &act.contiguous_memory_optimization));
  STRATA_RETURN_IF_ERROR(ac.get_int("number_checkpoints", &act.number_checkpoints));
  STRATA_RETURN_IF_ERROR(ac.get_bool("synchronize_checkpoint_boundary", &act.synchronize_checkpoint_boundary));
  STRATA_RETURN_IF_ERROR(ac.get_bool("profile", &act.profile));
  STRATA_RETURN_IF_ERROR(ac.finish());
  if (act.cpu_checkpointing && !act.enabled)
    return Status::invalid_argument("{}: activation_checkpointing.cpu_checkpointing needs activation_checkpointing."
                                    "enabled = true",
                                    source);

  JsonSection m = root.section("memory");
  STRATA_RETURN_IF_ERROR(read_bytes(m, "device_memory_limit", &c->device_memory_limit).with_context(source));
  STRATA_RETURN_IF_ERROR(read_bytes(m, "host_memory_limit", &c->host_memory_limit).with_context(source));
  STRATA_RETURN_IF_ERROR(m.get_string("gradients", &c->gradients));
  STRATA_RETURN_IF_ERROR(m.finish());
  if (c->gradients != "auto" && c->gradients != "host" && c->gradients != "nvme")
    return Status::invalid_argument("{}: memory.gradients must be \"auto\", \"host\" or \"nvme\", got \"{}\"", source,
                                    c->gradients);
  if (c->gradients == "nvme" && c->offload_param.device != "nvme" && c->offload_optimizer.device != "nvme")
    return Status::invalid_argument("{}: memory.gradients = \"nvme\" needs an offload target on nvme (its nvme_path "
                                    "holds them)",
                                    source);

  // Every key set away from its default that nothing acts on yet: a user must hear that a setting is not
  // happening. Acted on (engine/train/offload_runtime.cpp): both targets' device, nvme_path, pin_memory and
  // buffer_count, sub_group_size, stage3_prefetch_bucket_size, stage3_max_live_parameters,
  // stage3_param_persistence_threshold, and both memory limits; reduce_bucket_size and allgather_bucket_size
  // under stages 1 and 2 without offload (engine/optim/sharded_optimizer.h). zero_optimization.stage is not listed: one
  // process is a data-parallel group of one, where every stage keeps the whole state (issue 5 shards it).
  auto note = [&](const std::string& key, const auto& value, const auto& default_value) {
    if (value != default_value) c->not_acted_on.push_back(fmt::format("{} = {}", key, value));
  };
  const OffloadConfig d;
  auto target = [&](const std::string& name, const OffloadTargetConfig& t, const OffloadTargetConfig& dt) {
    const std::string p = "zero_optimization." + name + ".";
    note(p + "buffer_size", t.buffer_size, dt.buffer_size);
    note(p + "max_in_cpu", t.max_in_cpu, dt.max_in_cpu);
    note(p + "pipeline_read", t.pipeline_read, dt.pipeline_read);
    note(p + "pipeline_write", t.pipeline_write, dt.pipeline_write);
  };
  target("offload_param", c->offload_param, d.offload_param);
  target("offload_optimizer", c->offload_optimizer, d.offload_optimizer);
  // Speculative sub-groups are for the optimizer in host memory: on nvme the old state stays in the swap files
  // (no second buffer needed); with overlap_backward off nothing starts during backward.
  if (c->offload_optimizer.device != "cpu" || !c->offload_optimizer.overlap_backward) {
    note("zero_optimization.offload_optimizer.speculative_sub_groups", c->offload_optimizer.speculative_sub_groups,
         d.offload_optimizer.speculative_sub_groups);
  }
  if (c->offload_optimizer.device == "none")
    note("zero_optimization.offload_optimizer.ratio", c->offload_optimizer.ratio, d.offload_optimizer.ratio);
  note("zero_optimization.stage3_max_reuse_distance", c->stage3_max_reuse_distance, d.stage3_max_reuse_distance);
  const bool offloading = c->offload_optimizer.device != "none" || c->offload_param.device != "none";
  // Stages 1 and 2 (engine/optim/sharded_optimizer.h) cut their collectives by the buckets; stage 0 all-reduces whole
  // units, and stage 3 (with 1 and 2 with offload, which run as 3) gathers and reduces whole units
  // (stage3_prefetch_bucket_size governs its gathers).
  if ((c->stage != 1 && c->stage != 2) || offloading) {
    note("zero_optimization.reduce_bucket_size", c->reduce_bucket_size, d.reduce_bucket_size);
    note("zero_optimization.allgather_bucket_size", c->allgather_bucket_size, d.allgather_bucket_size);
  }
  // What the engine does regardless; a setting that asks otherwise is not happening.
  if (!c->overlap_comm && c->stage == 3) c->not_acted_on.push_back("zero_optimization.overlap_comm = false");
  if (c->overlap_comm && (c->stage == 1 || c->stage == 2) && !offloading)  // with offload they run as stage 3
    c->not_acted_on.push_back("zero_optimization.overlap_comm = true (stages 1 and 2 reduce after backward)");
  note("zero_optimization.contiguous_gradients", c->contiguous_gradients, d.contiguous_gradients);
  // Stage 2 reduce-scatters its gradients, and so does stage 3 (which stages 1 and 2 with offload run as); stages
  // 0 and 1 all-reduce, which is what false asks for.
  if (!c->reduce_scatter && (c->stage >= 2 || offloading))
    c->not_acted_on.push_back("zero_optimization.reduce_scatter = false");
  note("zero_optimization.allgather_partitions", c->allgather_partitions, d.allgather_partitions);
  // The aio section configures the NVMe tier's engine: with nothing placed on nvme it has nothing to act on.
  if (c->offload_param.device != "nvme" && c->offload_optimizer.device != "nvme" && c->gradients != "nvme") {
    note("aio.block_size", c->aio.block_size, d.aio.block_size);
    note("aio.queue_depth", c->aio.queue_depth, d.aio.queue_depth);
    note("aio.intra_op_parallelism", c->aio.intra_op_parallelism, d.aio.intra_op_parallelism);
  }
  note("aio.single_submit", c->aio.single_submit, d.aio.single_submit);
  note("aio.overlap_events", c->aio.overlap_events, d.aio.overlap_events);
  const ActivationCheckpointConfig& da = d.activation_checkpointing;
  note("activation_checkpointing.partition_activations", act.partition_activations, da.partition_activations);
  note("activation_checkpointing.contiguous_memory_optimization", act.contiguous_memory_optimization,
       da.contiguous_memory_optimization);
  note("activation_checkpointing.number_checkpoints", act.number_checkpoints, da.number_checkpoints);
  note("activation_checkpointing.synchronize_checkpoint_boundary", act.synchronize_checkpoint_boundary,
       da.synchronize_checkpoint_boundary);
  note("activation_checkpointing.profile", act.profile, da.profile);
  return Status::ok();
}

}  // namespace strata::engine
