// `strata bench step --pipeline` (engine/cli/bench_step.h): the pipeline schedules' bubble, measured, against
// (p - 1) / (m + p - 1).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/mpi_communicator.h"
#include "comm/staged_communicator.h"
#include "common/timer.h"
#include "engine/cli/bench_step.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/parallel/pipeline.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/thread_limit.h"

namespace strata::engine {
namespace {

int fail(const Status& st) {
  std::fprintf(stderr, "strata bench step: %s\n", st.to_string().c_str());
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

// One (schedule, m) configuration on this stage: the median over the timed steps of the schedule's time and
// of this stage's compute (forwards and backwards) within it.
struct StageTimes {
  double compute_s = 0, total_s = 0;
};

Result<StageTimes> time_schedule(const BenchStepOptions& o, const GPT2Config& mc, const PipelinePlan& plan,
                                 comm::Communicator& pp, PipelineSchedule schedule, int m) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Device> device,
                          kernels::make_device(o.device, *kernels::find_kernel_set(o.kernels.c_str())));
  const auto precision = o.precision == "bf16" ? kernels::MatmulPrecision::kBF16 : kernels::MatmulPrecision::kF32;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> model,
                          GPT2::create(mc, *device, precision, false, plan.stages[static_cast<size_t>(pp.rank())]));
  STRATA_RETURN_IF_ERROR(model->init_weights(o.seed));
  const int B = o.batch_size, T = o.seq_len;
  // The stages exchange device memory: on a GPU over NCCL or staged through host memory, as in training.
  std::unique_ptr<comm::Communicator> on_device;
  STRATA_ASSIGN_OR_RETURN(comm::Communicator* const exchange,
                          comm::device_collectives(&pp, *device, "auto", {}, &on_device));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PipelineRunner> runner,
                          PipelineRunner::create(*model, *exchange, schedule, m, B, T));
  std::vector<std::vector<int32_t>> xs(static_cast<size_t>(m)), ys(static_cast<size_t>(m));
  std::vector<const int32_t*> in, tgt;
  for (int i = 0; i < m; ++i) {
    random_batch(B, T, mc.vocab_size, o.seed + static_cast<uint64_t>(i), &xs[i], &ys[i]);
    in.push_back(xs[i].data());
    tgt.push_back(ys[i].data());
  }
  std::vector<double> compute, total;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    STRATA_RETURN_IF_ERROR(model->zero_grads());
    STRATA_RETURN_IF_ERROR(pp.barrier());  // every stage starts the schedule together
    STRATA_ASSIGN_OR_RETURN(const PipelineStepStats st, runner->run(in, tgt, 1.0f / static_cast<float>(m)));
    if (s < o.warmup) continue;
    compute.push_back(st.compute_s);
    total.push_back(st.total_s);
  }
  std::sort(compute.begin(), compute.end());
  std::sort(total.begin(), total.end());
  return StageTimes{compute[compute.size() / 2], total[total.size() / 2]};
}

}  // namespace

int run_bench_pipeline(const BenchStepOptions& o) {
  std::vector<int> ms;
  std::stringstream ss(o.micro_batches);
  for (std::string tok; std::getline(ss, tok, ',');) {
    const int m = std::atoi(tok.c_str());
    if (m < 1) return fail(Status::invalid_argument("--micro-batches: '{}' is not a positive count", tok));
    ms.push_back(m);
  }
  if (ms.empty() || o.steps < 1 || o.batch_size < 1 || o.seq_len < 1)
    return fail(Status::invalid_argument("--micro-batches, --steps, --batch and --context must be positive"));
  if (Status st = comm::mpi_init(nullptr, nullptr); !st.is_ok()) return fail(st);
  auto w = comm::MpiCommunicator::world();
  if (!w.is_ok()) return fail(w.status());
  comm::Communicator& pp = *w.value();
  const int P = pp.size();
  const bool leader = pp.rank() == 0;
  if (P < 2 || P > o.n_layer) {
    const Status st = Status::invalid_argument("--pipeline: run under mpirun -np P with 2 <= P <= --layers ({}), one "
                                               "rank per stage; got {} rank(s)",
                                               o.n_layer, P);
    comm::mpi_finalize();
    return fail(st);
  }
  const kernels::cpu::CpuThreadLimit threads(o.threads);  // TBB's and the matmuls' (OpenMP's)
  const GPT2Config mc{o.n_layer, o.n_head, o.n_embd, o.vocab_size, std::max(o.block_size, o.seq_len)};
  const PipelinePlan plan = plan_pipeline(gpt2_unit_specs(mc), gpt2_pipeline_costs(mc, o.seq_len), P);
  if (leader && !o.json) {
    std::printf("GPT-2 L=%d H=%d C=%d V=%d, micro-batch B=%d T=%d, %d stages over MPI: %s\n", o.n_layer, o.n_head,
                o.n_embd, o.vocab_size, o.batch_size, o.seq_len, P, plan.describe().c_str());
    std::printf("bubble = 1 - stage compute / step time, the step ending with the last stage (medians of %d "
                "steps), against (p-1)/(m+p-1)\n",
                o.steps);
    std::printf("%-8s %4s %12s %s %10s %10s %8s\n", "schedule", "m", "step ms", "bubble by stage", "mean",
                "(p-1)/(m+p-1)", "ratio");
  }
  for (const PipelineSchedule schedule : {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe}) {
    const char* name = schedule == PipelineSchedule::k1F1B ? "1f1b" : "gpipe";
    for (const int m : ms) {
      auto t = time_schedule(o, mc, plan, pp, schedule, m);
      if (!t.is_ok()) comm::mpi_abort(t.status());
      std::vector<double> mine = {t->compute_s, t->total_s}, all(2 * static_cast<size_t>(P));
      if (Status st = pp.all_gather(mine.data(), all.data(), 4, DType::kF32); !st.is_ok()) comm::mpi_abort(st);
      if (!leader) continue;
      // The step ends when the last stage to finish does (every stage started at the barrier): a stage's
      // bubble is its idle share of that, the time at the end it spends done included.
      double mean = 0, step = 0;
      for (int s = 0; s < P; ++s) step = std::max(step, all[2 * s + 1]);
      std::string by_stage;
      for (int s = 0; s < P; ++s) {
        const double bubble = 1.0 - all[2 * s] / step;
        mean += bubble / P;
        by_stage += fmt::format("{}{:.3f}", s ? " " : "", bubble);
      }
      const double theory = static_cast<double>(P - 1) / (m + P - 1);
      if (o.json) {
        const nlohmann::json j = {{"bench", "pipeline"}, {"schedule", name},  {"stages", P},
                                  {"micro_batches", m},  {"step_ms", step * 1e3}, {"bubble", mean},
                                  {"bubble_theory", theory}, {"ratio", mean / theory}};
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%-8s %4d %12.1f %s %10.3f %10.3f %8.2f\n", name, m, step * 1e3, by_stage.c_str(), mean, theory,
                    mean / theory);
      }
      std::fflush(stdout);
    }
  }
  w.value().reset();
  comm::mpi_finalize();
  return 0;
}

}  // namespace strata::engine
