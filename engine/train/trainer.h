// trainer.h — the training loop behind `strata train`, over a TrainSession (session.h).
//
// Gradient accumulation, warmup + cosine learning rate, global-norm clipping, validation, per-step metrics as
// JSON lines, periodic and final checkpoints, --resume, and a clean stop on SIGINT/SIGTERM that saves a
// checkpoint first. Deterministic: the same config and seed give the same losses, bit for bit. Runs on the
// calling thread; the kernels use the TBB arena (compute.threads caps it).
#pragma once

#include <string>

#include "common/status.h"
#include "engine/train/config.h"
#include "engine/train/session.h"

namespace strata::engine {

struct TrainSummary {
  int steps = 0;            // optimizer steps this invocation ran
  float last_loss = 0.0f;   // training loss of the last step
  float val_loss = -1.0f;   // the last validation loss (-1 if none ran)
  std::string checkpoint;   // the last checkpoint written
  double tokens_per_s = 0;  // over the whole run
};

// Builds the session, then steps it to training.max_steps: the progress line and metrics of each step,
// validation every training.val_every steps, a checkpoint every training.checkpoint_every and at the end. A run
// whose loss or gradient norm stays non-finite for 10 steps, or ends non-finite, stops with an error and saves
// none of that state; SIGINT or SIGTERM saves a checkpoint first, then stops with an error naming --resume.
Result<TrainSummary> run_training(const RunConfig& config, const TrainOptions& options);

}  // namespace strata::engine
