// config.h — the run configuration: one JSON file, read strictly.
//
// Sections: "model" (ModelConfig: the family and its keys, engine/model/family/family.h), "data", "training", "compute", and the offload sections of
// engine/train/offload_config.h ("zero_optimization", "aio", "memory"). Unknown keys are errors that list the valid
// ones; a value of the wrong type is an error naming "file: section.key". Command-line overrides are applied to
// the JSON before it is read (`--set training.lr=3e-4`), so they get exactly the same checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "engine/model/family/family.h"
#include "engine/train/offload_config.h"
#include "kernels/kernels.h"

namespace strata::engine {

struct DataConfig {
  std::string train;  // token shard(s): a file, a directory, or a glob (data/sotu/sotu_train_*.bin)
  std::string val;    // optional, same forms
};

struct TrainingConfig {
  int batch_size = 4;        // B, sequences per micro-batch
  int seq_len = 256;         // T, tokens per sequence (<= the model's context)
  int grad_accum_steps = 1;  // micro-batches per optimizer step
  int max_steps = 1000;
  double lr = 6e-4;
  double min_lr = 6e-5;   // the cosine decays to this; not in the file: lr / 10
  int warmup_steps = 50;  // linear warmup from lr/warmup_steps
  std::string lr_schedule = "cosine";  // after the warmup: "cosine" to min_lr, or "constant" (min_lr = lr)
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global-norm clip; 0 disables
  int64_t seed = 1337;
  int val_every = 100;   // steps; 0 disables
  int val_batches = 20;
  int checkpoint_every = 0;  // steps; 0: only at the end
  std::string checkpoint_dir = "runs/latest";
  int keep_checkpoints = 2;  // newest N kept; 0 keeps all
  // A run that does not resume refuses a checkpoint_dir holding checkpoints (its saves would replace and prune
  // them); true lets it start over there.
  bool overwrite_checkpoints = false;
  int log_every = 1;
  std::string init_from;  // a model.safetensors to start from (fine-tuning); empty: GPT-2 init from seed
  // init_from of a file without Strata's checksums (other projects') loads NaN and inf instead of refusing them.
  bool init_from_allow_non_finite = false;
  // Sequences per optimizer step over every data-parallel rank (DeepSpeed's train_batch_size): when set, it must
  // equal batch_size x grad_accum_steps x the data-parallel size, checked at start. 0: not checked.
  int global_batch_size = 0;
};

struct ComputeConfig {
  std::string device = "auto";   // auto (cuda where a GPU is usable, else cpu) | cpu | cuda
  std::string kernels = "fast";  // fast | reference: the CPU kernel sets (reference runs on the cpu device only)
  kernels::MatmulPrecision matmul_precision = kernels::MatmulPrecision::kF32;  // "fp32" | "bf16"
  int threads = 0;  // 0: all cores the process may use
  // Under bf16, the units' bf16 working copies of their weights (Model::set_working_copies).
  bool bf16_working_copies = true;
};

// How the ranks of `mpirun -np N` are split (comm/grid.h): N / (tensor x pipeline) data-parallel replicas.
struct ParallelConfig {
  int tensor_parallel_size = 1;    // ranks sharing each layer (innermost; engine/model/unit_split.h)
  int pipeline_parallel_size = 1;  // pipeline stages (engine/parallel/pipeline.h), at most the model's layers
  std::string pipeline_schedule = "1f1b";  // "1f1b" (Megatron-LM's) or "gpipe"
  // Megatron-LM's sequence parallelism for the layernorm regions (with tensor_parallel_size > 1;
  // engine/model/gpt2/gpt2.h).
  bool sequence_parallel = false;
  // What carries the groups' collectives on the GPU's buffers (comm/staged_communicator.h): "nccl", "mpi"
  // (staged through host memory), or "auto": NCCL unless this build lacks it or ranks of a group share a GPU.
  std::string distributed_backend = "auto";
};

struct RunConfig {
  ModelConfig model;
  DataConfig data;
  TrainingConfig training;
  ComputeConfig compute;
  ParallelConfig parallel;
  OffloadConfig offload;  // "zero_optimization", "aio", "memory" (engine/train/offload_config.h)
  std::string source;  // where it was read from
  nlohmann::json json;  // the effective JSON (after overrides), saved with checkpoints
};

// Applies "section.key=value" overrides to a JSON object. The value is parsed as JSON when it can be
// (numbers, true/false, quoted strings), else taken as a string.
Status apply_overrides(nlohmann::json* j, const std::vector<std::string>& overrides);

// Reads a RunConfig from JSON. `source` names the file for messages.
Result<RunConfig> parse_run_config(const nlohmann::json& j, const std::string& source);
Result<RunConfig> load_run_config(const std::string& path, const std::vector<std::string>& overrides);

}  // namespace strata::engine
