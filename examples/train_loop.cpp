// train_loop.cpp — a training loop over Strata's public API (engine/strata.h): a session from a config, steps
// with their loss and time, a validation, a checkpoint, and a second session that resumes from it.
//   train_loop CONFIG [section.key=value ...]
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/strata.h"

namespace se = strata::engine;

// Prints the error and returns 1 where `st` is one.
int failed(const strata::Status& st) {
  std::fprintf(stderr, "train_loop: %s\n", st.to_string().c_str());
  return 1;
}

// Steps `session` until it has done `steps`, a line a step.
strata::Status train(se::TrainSession& session, int steps) {
  while (session.steps_done() < steps) {
    STRATA_ASSIGN_OR_RETURN(const se::StepResult r, session.step());
    std::printf("step %d: loss %.4f, norm %.3f, %.1f ms%s\n", r.step, r.loss, r.grad_norm, r.seconds * 1e3,
                r.skipped ? " (skipped)" : "");
  }
  return strata::Status::ok();
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONFIG [section.key=value ...]\n", argv[0]);
    return 2;
  }
  auto config = se::load_run_config(argv[1], std::vector<std::string>(argv + 2, argv + argc));
  if (!config.is_ok()) return failed(config.status());
  const int steps = config->training.max_steps;

  // The first half of the run, then a checkpoint.
  se::TrainOptions options;
  options.progress = false;
  auto first = se::TrainSession::create(*config, options);
  if (!first.is_ok()) return failed(first.status());
  if (strata::Status st = train(**first, steps / 2); !st.is_ok()) return failed(st);
  auto val = (*first)->validate();
  if (!val.is_ok()) return failed(val.status());
  if (*val) std::printf("validation loss %.4f\n", **val);
  auto saved = (*first)->save();
  if (!saved.is_ok()) return failed(saved.status());
  std::printf("saved %s\n", saved->c_str());
  first->reset();  // its device memory and files are released before the next session takes them

  // The rest of it in a new session from that checkpoint: the same steps a straight run would take.
  options.resume = *saved;
  auto second = se::TrainSession::create(*config, options);
  if (!second.is_ok()) return failed(second.status());
  std::printf("resumed at step %d\n", (*second)->steps_done());
  if (strata::Status st = train(**second, steps); !st.is_ok()) return failed(st);
  return 0;
}
