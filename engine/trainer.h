// trainer.h — the training loop behind `strata train`.
//
// Gradient accumulation, warmup + cosine learning rate, global-norm clipping, validation, per-step metrics as
// JSON lines, periodic and final checkpoints, --resume, and a clean stop on SIGINT/SIGTERM that saves a
// checkpoint first. Deterministic: the same config and seed give the same losses, bit for bit. Runs on the
// calling thread; the kernels use the TBB arena (compute.threads caps it).
#pragma once

#include <string>

#include "common/status.h"
#include "engine/config.h"

namespace strata::engine {

struct TrainOptions {
  std::string metrics_path;  // JSON lines, one object per step (empty: none)
  std::string resume;        // checkpoint (step dir or checkpoint_dir) to continue from (empty: fresh)
  bool progress = true;      // the per-step progress line on stdout
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
