// offload_config.h — the ZeRO / offload sections of the run configuration, with DeepSpeed's key names and
// meanings so a DeepSpeed user's settings carry over: "zero_optimization" (stage, offload_param,
// offload_optimizer, sub_group_size, stage3_*), "aio", "activation_checkpointing", and Strata's own "memory"
// budgets. engine/train/offload_runtime.cpp acts on them.
//
// Read strictly like every section (unknown keys are errors listing the valid ones; "auto" keeps a default, as
// in configs written for the Hugging Face integration). A key nothing acts on yet is listed by
// parse_offload_config() in `not_acted_on` when its value differs from the default, and the trainer warns about
// each by name — never silently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/json_config.h"
#include "common/status.h"

namespace strata::engine {

// zero_optimization.offload_param and .offload_optimizer (DeepSpeed's DeepSpeedZeroOffload*Config).
struct OffloadTargetConfig {
  std::string device = "none";  // none | cpu | nvme
  std::string nvme_path;        // required for nvme: the folder the swap files go in
  bool pin_memory = false;
  int64_t buffer_count = 5;           // offload_param's default; offload_optimizer's is 4 (OffloadConfig)
  int64_t buffer_size = 100'000'000;  // offload_param only: elements per staging buffer
  int64_t max_in_cpu = 1'000'000'000;  // offload_param only: elements kept in host memory with device nvme
  bool pipeline_read = false, pipeline_write = false;  // offload_optimizer only
  // offload_optimizer only, ours (not DeepSpeed's): with device nvme, start each unit's update during the last
  // backward, as soon as its gradient is final, and redo it exactly if the step clips (OffloadedAdamW).
  bool overlap_backward = true;
  // offload_optimizer only, ours: with device cpu, how many sub-groups may be updated during that backward
  // (overlap_backward) into buffers of their own, which replace the old state once the step is known not to clip
  // (each 12 bytes per element of the sub-group it is for: the first ones the backward feeds, from the host
  // budget). 0: updates start after backward.
  int64_t speculative_sub_groups = 0;
  // offload_optimizer only (DeepSpeed's ZeRO-Offload++ key): the share of the parameters whose optimizer state is
  // offloaded, in (0, 1]. The rest, the model's first units in the forward's order, stay on the device whole
  // (parameters, gradients, Adam's moments), updated there by step() (Model::keep_on_device): their updates are
  // the ones the next forward waits for first; under data parallelism every rank keeps them whole. 1: all
  // offloaded.
  double ratio = 1.0;
};

// offload_optimizer's defaults: DeepSpeed's, which differ from offload_param's in buffer_count.
inline OffloadTargetConfig optimizer_target_defaults() {
  OffloadTargetConfig t;
  t.buffer_count = 4;
  return t;
}

// DeepSpeed's "aio" section, for the NVMe tier: the piece size, pieces in flight per ring and rings (threads) of
// the I/O engine every swap store of the run shares. The defaults are ours, not DeepSpeed's (8 in flight on one
// thread): what the runtime used before these keys were acted on; `strata bench nvme --sweep` prints the best
// section for a disk. Submission is always batched and overlapped with completion: single_submit = true and
// overlap_events = false are warned about, not acted on.
struct AioConfig {
  int64_t block_size = 1'048'576;
  int64_t queue_depth = 32;
  int64_t intra_op_parallelism = 2;
  bool single_submit = false;
  bool overlap_events = true;
};

// DeepSpeed's "activation_checkpointing" section, plus our "enabled" (DeepSpeed turns it on from model code).
struct ActivationCheckpointConfig {
  bool enabled = false;            // keep each block's input only and recompute the block in backward
  bool cpu_checkpointing = false;  // hold those inputs in host memory between forward and backward
  bool partition_activations = false, contiguous_memory_optimization = false;
  int64_t number_checkpoints = 0;  // DeepSpeed's; not needed here (one checkpoint per block)
  bool synchronize_checkpoint_boundary = false, profile = false;
};

struct OffloadConfig {
  int stage = 0;  // zero_optimization.stage: 0..3
  OffloadTargetConfig offload_param;
  OffloadTargetConfig offload_optimizer = optimizer_target_defaults();
  int64_t sub_group_size = 1'000'000'000;
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  int64_t stage3_max_live_parameters = 1'000'000'000;
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  int64_t stage3_param_persistence_threshold = 100'000;
  // Communication keys, DeepSpeed's names and defaults. Acted on as they stand: gradients are always contiguous
  // (one flat buffer per unit), stage 2 reduce-scatters, stage 3's reduce-scatters overlap backward (its
  // collectives run on the coordinator's queue). The bucket sizes cut stages 1 and 2's collectives
  // (engine/optim/sharded_optimizer.h); stage 0 and stage 3 reduce and gather whole units.
  int64_t reduce_bucket_size = 500'000'000;
  int64_t allgather_bucket_size = 500'000'000;
  bool overlap_comm = false;  // DeepSpeed's default by stage: true for stage 3, false otherwise
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  bool allgather_partitions = true;
  AioConfig aio;
  ActivationCheckpointConfig activation_checkpointing;
  uint64_t device_memory_limit = 0;  // memory.device_memory_limit, bytes; 0: what the device has. Acted on: the
                                     // budget of every Device allocation (kernels/device.h)
  uint64_t host_memory_limit = 0;    // memory.host_memory_limit, bytes; 0: what the cgroup and machine allow
  // memory.gradients: where offloaded gradients go home: "host", "nvme" (an offload nvme_path's store), or
  // "auto": nvme when they would take more than half of a set host_memory_limit and an nvme_path is set.
  std::string gradients = "auto";
  std::vector<std::string> not_acted_on;  // "zero_optimization.stage = 3", ... (set keys not yet honoured)
};

// Reads the four sections ("zero_optimization", "aio", "activation_checkpointing", "memory") from `root`; errors name "file: section.key" and the accepted values.
Status parse_offload_config(JsonSection& root, const std::string& source, OffloadConfig* out);

}  // namespace strata::engine
