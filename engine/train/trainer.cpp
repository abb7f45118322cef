#include "engine/train/trainer.h"

#include <csignal>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"

namespace strata::engine {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

std::string hms(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const long s = std::lround(seconds);
  return s >= 3600 ? fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60)
                   : fmt::format("{:02d}:{:02d}", s / 60, s % 60);
}

// The progress line of a step, every training.log_every steps (and the first and last).
std::string progress_line(const StepResult& r, int max_steps, double tok_s, double elapsed, double eta,
                          std::optional<float> val) {
  std::string line = fmt::format("step {:>5}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:>7.0f} tok/s | "
                                 "{:>6.0f} ms | elapsed {} | eta {}",
                                 r.step, max_steps, r.loss, r.lr, r.grad_norm, tok_s, r.seconds * 1e3, hms(elapsed),
                                 hms(eta));
  if (val) line += fmt::format(" | val {:.4f}", *val);
  if (r.offload) line += " | " + r.offload->summary();
  return line;
}

// The step's line of the metrics file.
nlohmann::json metrics_line(const StepResult& r, double tok_s, std::optional<float> val) {
  nlohmann::json m = {{"step", r.step},           {"loss", r.loss},        {"lr", r.lr},
                      {"grad_norm", r.grad_norm}, {"tokens_per_s", tok_s}, {"step_ms", r.seconds * 1e3}};
  if (r.pipeline_bubble >= 0) m["pipeline_bubble"] = r.pipeline_bubble;
  if (val) m["val_loss"] = *val;
  if (r.skipped) m["skipped"] = true;
  if (r.offload) m["offload"] = r.offload->to_json();
  return m;
}

void write_line(std::FILE* f, const nlohmann::json& line) {
  std::fprintf(f, "%s\n", line.dump().c_str());
  std::fflush(f);
}

// Restores SIGINT's and SIGTERM's handlers when the run ends.
struct StopSignals {
  StopSignals() {
    g_stop_signal = 0;
    old_int = std::signal(SIGINT, on_stop_signal);
    old_term = std::signal(SIGTERM, on_stop_signal);
  }
  ~StopSignals() {
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
  }
  void (*old_int)(int) = nullptr;
  void (*old_term)(int) = nullptr;
};

}  // namespace

Result<TrainSummary> run_training(const RunConfig& config, const TrainOptions& options) {
  const TrainingConfig& tc = config.training;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TrainSession> session, TrainSession::create(config, options));
  const StopSignals signals;
  const bool print = options.progress && session->leader();
  std::FILE* const metrics = session->metrics();
  TrainSummary summary;
  auto validate = [&]() -> Result<std::optional<float>> {
    STRATA_ASSIGN_OR_RETURN(std::optional<float> val, session->validate());
    if (val) summary.val_loss = *val;
    return val;
  };
  auto save = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(std::string path, session->save());
    if (session->leader()) summary.checkpoint = std::move(path);
    return Status::ok();
  };

  // A fine-tune (a new run from training.init_from) measures the weights it starts from first: the baseline its
  // validation losses compare with. With max_steps 0 that is the whole run (and its checkpoint holds the
  // weights in our format).
  if (!tc.init_from.empty() && !session->resumed() && tc.val_every > 0) {
    STRATA_ASSIGN_OR_RETURN(const std::optional<float> val, validate());
    if (val && print) {
      std::puts(fmt::format("step {:>5}/{} | val {:.4f} (the weights of {})", 0, tc.max_steps, *val, tc.init_from)
                    .c_str());
      std::fflush(stdout);
    }
    if (val && metrics) write_line(metrics, {{"step", 0}, {"val_loss", *val}});
  }

  Timer run_timer;
  const int first_step = session->steps_done();
  // Steps in a row whose loss or gradient norm was not finite. Their state is never checkpointed: a run that
  // stays non-finite stops with an error, and `latest` keeps naming the last good checkpoint.
  int non_finite_in_a_row = 0;
  constexpr int kMaxNonFiniteSteps = 10;
  const std::string last_good = fmt::format("`latest` in {} still names the last checkpoint before them",
                                            tc.checkpoint_dir);
  while (session->steps_done() < tc.max_steps) {
    trace::Span step_span("step", session->steps_done() + 1);
    // Every rank stops at the same step (the checkpoint is collective), whichever saw the signal first.
    STRATA_ASSIGN_OR_RETURN(const int stop, session->agree_on_stop(g_stop_signal));
    if (stop != 0 && non_finite_in_a_row > 0) {
      return Status(StatusCode::kInternal,
                    fmt::format("interrupted by signal {} after {} non-finite step(s), whose state is not saved: {}",
                                stop, non_finite_in_a_row, last_good));
    }
    if (stop != 0) {
      STRATA_LOG_WARN("signal {} received: saving a checkpoint at step {} and stopping", stop, session->steps_done());
      STRATA_RETURN_IF_ERROR(save());
      STRATA_LOG_INFO("checkpoint: {}", summary.checkpoint);
      return Status(StatusCode::kInternal,
                    fmt::format("interrupted by signal {}; resume with --resume {}", stop, tc.checkpoint_dir));
    }
    STRATA_ASSIGN_OR_RETURN(const StepResult r, session->step());
    if (r.skipped || !std::isfinite(r.loss)) {
      if (r.skipped) STRATA_LOG_WARN("step {}: loss {}, gradient norm {}; update skipped", r.step, r.loss, r.grad_norm);
      else STRATA_LOG_WARN("step {}: loss {}: not finite", r.step, r.loss);
      if (++non_finite_in_a_row >= kMaxNonFiniteSteps) {
        return Status::invalid_argument("steps {} to {}: {} steps in a row had a non-finite loss or gradient norm "
                                        "(last loss {}, norm {}); stopped without a checkpoint of their state: {}",
                                        r.step + 1 - kMaxNonFiniteSteps, r.step, kMaxNonFiniteSteps, r.loss,
                                        r.grad_norm, last_good);
      }
    } else {
      non_finite_in_a_row = 0;
    }
    const double tok_s = session->tokens_per_step() / r.seconds;
    summary.last_loss = r.loss;
    ++summary.steps;

    std::optional<float> val;
    if (tc.val_every > 0 && (r.step % tc.val_every == 0 || r.step == tc.max_steps)) {
      STRATA_ASSIGN_OR_RETURN(val, validate());
    }
    if (print && (r.step % tc.log_every == 0 || r.step == tc.max_steps || r.step == first_step + 1)) {
      const double elapsed = run_timer.seconds();
      const double eta = elapsed / (r.step - first_step) * (tc.max_steps - r.step);
      std::puts(progress_line(r, tc.max_steps, tok_s, elapsed, eta, val).c_str());
      std::fflush(stdout);
    }
    if (metrics) write_line(metrics, metrics_line(r, tok_s, val));
    const bool checkpoint_due = tc.checkpoint_every > 0 && r.step % tc.checkpoint_every == 0 && r.step != tc.max_steps;
    if (checkpoint_due && non_finite_in_a_row > 0) {
      STRATA_LOG_WARN("step {}: no checkpoint, after {} non-finite step(s)", r.step, non_finite_in_a_row);
    } else if (checkpoint_due) {
      STRATA_RETURN_IF_ERROR(save());
      if (options.progress) STRATA_LOG_INFO("checkpoint: {}", summary.checkpoint);
    }
  }
  if (non_finite_in_a_row > 0) {
    return Status::invalid_argument("the run ended on {} step(s) with a non-finite loss or gradient norm (last loss "
                                    "{}); no checkpoint of their state was written: {}",
                                    non_finite_in_a_row, summary.last_loss, last_good);
  }
  if (summary.steps > 0 || !session->resumed()) STRATA_RETURN_IF_ERROR(save());
  const double total_s = run_timer.seconds();
  summary.tokens_per_s = total_s > 0 ? summary.steps * session->tokens_per_step() / total_s : 0.0;
  return summary;
}

}  // namespace strata::engine
