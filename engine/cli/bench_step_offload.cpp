// `strata bench step --offload-…`: the offloaded training step against the bound docs/architecture.md sets for it,
// max(compute, NVMe traffic / disk bandwidth, optimizer time), every term measured in the same run: the same
// model's forward+backward kept on the device, the step's NVMe byte mix pushed through a swap store in the
// same folder, and the CPU Adam pass over the same parameters in memory. Both models are TrainSessions of the
// config bench_run_config makes, on one device: the plain one without offload, the other with it.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>

#include "common/aligned.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/timer.h"
#include "common/trace.h"
#include "common/units.h"
#include "engine/cli/bench_kernels.h"
#include "engine/cli/bench_step.h"
#include "engine/train/offload_runtime.h"
#include "engine/train/session.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/thread_limit.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"
#include "storage/swap_store.h"

namespace strata::engine {
namespace {

// CPU seconds this process has used so far, every thread, user and system.
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// Seconds the disk takes to read `read` bytes while writing `write` bytes, everything queued at once, through
// a swap store in `dir` (8 MiB keys) on the runtime's engine and queue settings (the aio defaults, the cap on
// writes in flight), in the steady state the measured steps run in: every key written before, so the store's
// files exist and a write goes (copy-on-write) to space written before, as the swapper's alternate versions do
// after the first steps. A store's first writes also create and preallocate its files and fill never-written
// extents (which the file system must convert), several times slower on a fast NVMe drive: a probe timing them
// made the disk term too large. The median of 3 rounds after a warm-up round.
Result<double> disk_seconds(const std::string& dir, uint64_t read, uint64_t write) {
  constexpr uint64_t kKey = 8 << 20;
  constexpr int kRounds = 3;
  STRATA_ASSIGN_OR_RETURN(const auto io, nvme_io_options(AioConfig{}));
  STRATA_ASSIGN_OR_RETURN(auto engine, make_io_engine(io.first));
  IoQueue queue(*engine, io.second);
  const uint64_t reads = (read + kKey - 1) / kKey, writes = (write + kKey - 1) / kKey;
  SwapStoreOptions so;
  so.dir = dir;
  so.file_bytes = uint64_t{1} << 30;
  // Room for the reads' keys and two versions of every written key.
  so.max_files = static_cast<uint32_t>(((reads + 2 * writes) * kKey) / (so.file_bytes - 4096) + 2);
  STRATA_ASSIGN_OR_RETURN(auto store, SwapStore::open(queue, so));
  // 64 keys' worth of memory, cycled: the disk, not memory, is what is measured.
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer a, AlignedBuffer::allocate(64 * kKey, "bench_step.disk_probe_read", 4096));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer b, AlignedBuffer::allocate(64 * kKey, "bench_step.disk_probe_write", 4096));
  std::fill(b.as<char>(), b.as<char>() + 64 * kKey, 'x');
  for (uint64_t i = 0; i < reads; ++i)
    STRATA_RETURN_IF_ERROR(store->write(fmt::format("r{}", i), b.as<char>() + (i % 64) * kKey, kKey));
  for (uint64_t i = 0; i < writes; ++i)
    STRATA_RETURN_IF_ERROR(store->write(fmt::format("w{}", i), b.as<char>() + (i % 64) * kKey, kKey));
  std::vector<double> times;
  for (int round = 0; round <= kRounds; ++round) {
    IoBatch batch;
    Timer t;
    for (uint64_t i = 0; i < std::max(reads, writes); ++i) {
      if (i < reads)
        STRATA_RETURN_IF_ERROR(store->read(fmt::format("r{}", i), a.as<char>() + (i % 64) * kKey, kKey, &batch));
      if (i < writes)
        STRATA_RETURN_IF_ERROR(store->write(fmt::format("w{}", i), b.as<char>() + (i % 64) * kKey, kKey, &batch));
    }
    STRATA_RETURN_IF_ERROR(batch.wait());
    if (round > 0) times.push_back(t.seconds());
  }
  return median(times);
}

// The CPU optimizer's pass over n parameters in memory (AdamW, fp32), median of 3.
Result<double> adam_seconds(size_t n) {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(4 * n * sizeof(float), "bench_step.adam"));
  float* p = buf.as<float>();
  // Adam's time does not depend on the values (none denormal, v >= 0), so they are a hash of the index,
  // made on every core: drawn as normals one after another, they took 47 s for 354M parameters on 2 cores
  // and held a 2.5B-parameter GPU bench past its time limit.
  tbb::parallel_for(tbb::blocked_range<size_t>(0, 4 * n, size_t{1} << 16), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t i = r.begin(); i < r.end(); ++i) {
      const float u = static_cast<float>(splitmix64(0, i + 1) >> 40) * 0x1.0p-24f;  // [0, 1)
      p[i] = (i >= 2 * n && i < 3 * n) ? 1e-4f * (u + 0.01f) : 0.02f * (u - 0.5f);  // v > 0
    }
  });
  kernels::AdamWParams hp;
  hp.lr = 1e-4f;
  hp.weight_decay = 0.1f;
  std::vector<double> times;
  for (int i = 0; i < 3; ++i) {
    hp.step = i + 1;
    Timer t;
    kernels::cpu::fast::adamw_update_mixed(p, p + n, p + 2 * n, p + 3 * n, nullptr, DType::kF32, n, hp);
    times.push_back(t.seconds());
  }
  return median(times);
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata bench step: %s\n", st.to_string().c_str());
  return 1;
}

// The steps of one kind, measured: their times, their CPU times (every thread) and, offloaded, where each went.
struct Measured {
  std::vector<double> seconds, cpu_seconds;
  std::vector<OffloadStepReport> reports;
  std::vector<StepPhases> phases;
  std::vector<double> synchronize;  // the device's work left when step() returned
};

// Writes the trace (--trace) when it ends, after a failed step too (the timeline up to it explains it): made
// before the offloaded steps and ended before their session's threads go.
class TraceFile {
 public:
  explicit TraceFile(const BenchStepOptions& o) : o_(o) {
    if (o_.trace_path.empty()) return;
    trace::start();
    trace::name_thread("training");
  }
  ~TraceFile() {
    if (o_.trace_path.empty()) return;
    const size_t dropped = trace::dropped();
    if (Status st = trace::write(o_.trace_path); !st.is_ok()) {
      std::fprintf(stderr, "strata bench step: %s\n", st.to_string().c_str());
    } else if (!o_.json) {
      std::fprintf(stderr, "  trace: %zu events in %s%s\n", trace::recorded(), o_.trace_path.c_str(),
                   dropped > 0 ? fmt::format(" ({} dropped: the buffer was full)", dropped).c_str() : "");
    }
  }
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

 private:
  const BenchStepOptions& o_;
};

class OffloadStepBench {
 public:
  explicit OffloadStepBench(const BenchStepOptions& o)
      : o_(o), folder_(o.nvme_path), rounds_(std::max(1, std::min(o.rounds, o.steps))) {}
  // Every term, measured: the plain steps, the CPU Adam pass, the offloaded steps, then the disk.
  Status run();
  // What run() measured, to stdout.
  void print_json() const;
  void print_text() const;

 private:
  TrainOptions session_options();
  Status build_plain();
  Status plain_step(bool measured);
  Status keep_initial();  // the plain model's weights, which the offloaded one starts from
  Status build_offloaded();
  Status offloaded_step(int s, bool measured);
  Status run_steps();
  size_t median_step() const;  // the index of the median offloaded step
  struct Figures;              // derived from the measurements, for both reports
  Figures figures() const;

  const BenchStepOptions& o_;
  const BenchFolder folder_;
  const int rounds_;
  std::unique_ptr<kernels::Device> device_;  // both sessions'
  std::vector<int32_t> x_, y_;
  std::unique_ptr<TrainSession> plain_, offloaded_;
  std::vector<std::vector<float>> initial_;
  Measured compute_, steps_;
  size_t n_params_ = 0, adam_params_ = 0;  // adam_params_: those whose optimizer state is offloaded
  double step_flops_ = 0, palm_flops_ = 0;
  double adam_s_ = 0, disk_s_ = 0;
  float loss_ = 0;
};

TrainOptions OffloadStepBench::session_options() {
  TrainOptions options;
  options.device = device_.get();
  options.batches = [this](int32_t* x, int32_t* y) {
    std::copy(x_.begin(), x_.end(), x);
    std::copy(y_.begin(), y_.end(), y);
    return Status::ok();
  };
  return options;
}

// The compute term's model: the same model kept on the device, forward + backward only. With --rounds, kept
// while the offloaded model runs, its steps alternating with the offloaded ones in blocks.
Status OffloadStepBench::build_plain() {
  Timer setup;
  STRATA_ASSIGN_OR_RETURN(const RunConfig config, bench_run_config(o_, false, folder_.path() + "/plain"));
  STRATA_ASSIGN_OR_RETURN(device_, make_compute_device(config.compute));
  random_batch(o_.batch_size, o_.seq_len, o_.vocab_size, o_.seed, &x_, &y_);
  STRATA_ASSIGN_OR_RETURN(plain_, TrainSession::create(config, session_options()));
  const Decoder& m = plain_->model();
  n_params_ = m.num_params();
  adam_params_ = n_params_;
  if (o_.offload_ratio < 1.0) {  // offload_optimizer.ratio: the units kept on the device are updated there
    const std::vector<bool> kept = units_kept_on_device(m, o_.offload_ratio);
    for (size_t u = 0; u < kept.size(); ++u) adam_params_ -= kept[u] ? m.units()[u].numel() : 0;
  }
  step_flops_ = m.flops_per_step(o_.batch_size, o_.seq_len) * o_.grad_accum;
  palm_flops_ = m.palm_flops_per_step(o_.batch_size, o_.seq_len) * o_.grad_accum;
  STRATA_LOG_INFO("bench step: {} parameters built and initialised on the device in {:.1f} s", n_params_,
                  setup.seconds());
  return Status::ok();
}

Status OffloadStepBench::plain_step(bool measured) {
  Decoder& m = plain_->model();
  Timer t;
  const double cpu0 = process_cpu_seconds();
  STRATA_RETURN_IF_ERROR(m.zero_grads());
  for (int a = 0; a < o_.grad_accum; ++a) {
    STRATA_RETURN_IF_ERROR(m.forward(x_.data(), y_.data(), o_.batch_size, o_.seq_len).status());
    STRATA_RETURN_IF_ERROR(m.backward());
  }
  m.device().synchronize();
  if (measured) {
    compute_.seconds.push_back(t.seconds());
    compute_.cpu_seconds.push_back(process_cpu_seconds() - cpu0);
  }
  return Status::ok();
}

// Copied rather than drawn again: GPT-2's init draws its normals one after another (about 34M a second on 2
// cores, so 20 s for 700M parameters), and forward and backward leave the weights as they were.
Status OffloadStepBench::keep_initial() {
  const Decoder& m = plain_->model();
  initial_.resize(m.units().size());
  for (size_t u = 0; u < initial_.size(); ++u) {
    initial_[u].resize(m.units()[u].numel());
    STRATA_RETURN_IF_ERROR(m.read_params(u, initial_[u].data()));
  }
  return Status::ok();
}

Status OffloadStepBench::build_offloaded() {
  Timer setup;
  const bool offloaded = o_.offload_param != "none" || o_.offload_optimizer != "none";
  STRATA_ASSIGN_OR_RETURN(const RunConfig config, bench_run_config(o_, offloaded, folder_.path()));
  if (initial_.empty()) STRATA_RETURN_IF_ERROR(keep_initial());  // --rounds: the plain model has not stepped
  TrainOptions options = session_options();
  options.initial_weights = [this](size_t u, size_t offset, std::span<float> dst) {
    std::copy_n(initial_[u].data() + offset, dst.size(), dst.data());
    return Status::ok();
  };
  STRATA_ASSIGN_OR_RETURN(offloaded_, TrainSession::create(config, options));
  std::vector<std::vector<float>>().swap(initial_);
  STRATA_LOG_INFO("bench step: the offloaded model built and given the same initial weights in {:.1f} s",
                  setup.seconds());
  return Status::ok();
}

Status OffloadStepBench::offloaded_step(int s, bool measured) {
  trace::Span step_span("step", s + 1);
  Timer t;
  const double cpu0 = process_cpu_seconds();
  STRATA_ASSIGN_OR_RETURN(const StepResult r, offloaded_->step());
  const double stepped = t.seconds();
  {
    trace::Span span("synchronize");
    offloaded_->device().synchronize();
  }
  const double secs = t.seconds();
  loss_ = r.loss;
  const OffloadStepReport report = r.offload.value_or(OffloadStepReport{});
  if (measured) {
    steps_.seconds.push_back(secs);
    steps_.cpu_seconds.push_back(process_cpu_seconds() - cpu0);
    steps_.reports.push_back(report);
    steps_.phases.push_back(r.phases);
    steps_.synchronize.push_back(secs - stepped);
  }
  if (!o_.json)
    std::fprintf(stderr, "  step %d: %.1f ms%s%s\n", s + 1, secs * 1e3,
                 r.offload ? (" | " + report.summary()).c_str() : "", measured ? "" : " (not measured)");
  return Status::ok();
}

// rounds_ 1: every plain step, then every offloaded one. More: blocks of plain steps then offloaded steps, each
// block led by an unmeasured step (the warmup steps in the first), so the machine's drift between blocks reaches
// both terms alike. Each offloaded block ends with its last update completed, unmeasured, so that it does not
// run into the plain block after it; the block's first step then has no update to wait for, which is why it is
// not measured.
Status OffloadStepBench::run_steps() {
  const TraceFile trace_file(o_);
  if (rounds_ == 1) {
    for (int s = 0; s < o_.warmup + o_.steps; ++s) STRATA_RETURN_IF_ERROR(offloaded_step(s, s >= o_.warmup));
    return Status::ok();
  }
  const int per_round = (o_.steps + rounds_ - 1) / rounds_;
  for (int round = 0, measured = 0, s = 0; round < rounds_ && measured < o_.steps; ++round) {
    const int lead = round == 0 ? std::max(1, o_.warmup) : 1;
    const int n = std::min(per_round, o_.steps - measured);
    for (int i = 0; i < lead + n; ++i) STRATA_RETURN_IF_ERROR(plain_step(i >= lead));
    for (int i = 0; i < lead + n; ++i) STRATA_RETURN_IF_ERROR(offloaded_step(s++, i >= lead));
    STRATA_RETURN_IF_ERROR(offloaded_->optimizer().finish());
    measured += n;
  }
  return Status::ok();
}

Status OffloadStepBench::run() {
  STRATA_RETURN_IF_ERROR(build_plain());
  if (rounds_ == 1) {
    Timer setup;
    for (int s = 0; s < o_.warmup + o_.steps; ++s) STRATA_RETURN_IF_ERROR(plain_step(s >= o_.warmup));
    STRATA_RETURN_IF_ERROR(keep_initial());
    plain_.reset();
    STRATA_LOG_INFO("bench step: {} compute-only steps in {:.1f} s", o_.warmup + o_.steps, setup.seconds());
  }
  // The optimizer term: the CPU Adam pass over the same parameters (those offloaded) in memory.
  Timer setup;
  STRATA_ASSIGN_OR_RETURN(adam_s_, adam_seconds(adam_params_));
  STRATA_LOG_INFO("bench step: CPU Adam over {} parameters in memory measured in {:.1f} s", adam_params_,
                  setup.seconds());
  STRATA_RETURN_IF_ERROR(build_offloaded());
  STRATA_RETURN_IF_ERROR(run_steps());
  offloaded_.reset();  // its memory and threads, before the disk and the GEMM rate are measured
  plain_.reset();
  // The disk term: the median step's NVMe byte mix through a store in the same folder.
  const OffloadStepReport& r = steps_.reports[median_step()];
  if (r.nvme_read_bytes + r.nvme_write_bytes == 0) return Status::ok();
  STRATA_ASSIGN_OR_RETURN(disk_s_, disk_seconds(folder_.path() + "/probe", r.nvme_read_bytes, r.nvme_write_bytes));
  return Status::ok();
}

size_t OffloadStepBench::median_step() const {
  const std::vector<double>& s = steps_.seconds;
  return std::distance(s.begin(), std::find(s.begin(), s.end(), median(s)));
}

struct OffloadStepBench::Figures {
  size_t mid = 0;  // the median step, whose breakdown is reported
  double step_s = 0, compute_s = 0, bound = 0, ratio = 0;
  // On the CPU backend the offload's own CPU work (checksums, copies, Adam, I/O system calls) competes with the
  // kernels for the same cores, which the bound does not count: the step also needs at least its CPU time
  // spread over every core.
  int cores = 0;
  double step_cpu_s = 0, compute_cpu_s = 0;
  double tokens = 0;
  // Model FLOPs utilisation on a GPU: the step's model FLOPs (6 per parameter per token plus attention) per
  // second, over the GPU's measured GEMM rate at the same precision (0 on the CPU).
  double gemm_tflops = 0, model_tflops = 0, palm_tflops = 0;
};

OffloadStepBench::Figures OffloadStepBench::figures() const {
  Figures f;
  f.mid = median_step();
  f.step_s = steps_.seconds[f.mid];
  f.compute_s = median(compute_.seconds);
  f.bound = std::max({f.compute_s, disk_s_, adam_s_});
  f.ratio = f.step_s / f.bound;
  f.cores = tbb::info::default_concurrency();
  f.step_cpu_s = median(steps_.cpu_seconds);
  f.compute_cpu_s = median(compute_.cpu_seconds);
  f.tokens = static_cast<double>(o_.batch_size) * o_.seq_len * o_.grad_accum;
  if (!device_->host_accessible()) f.gemm_tflops = measure_gemm_tflop_per_s(o_.precision == "bf16");
  f.model_tflops = step_flops_ / f.step_s / 1e12;
  f.palm_tflops = palm_flops_ / f.step_s / 1e12;
  return f;
}

void OffloadStepBench::print_json() const {
  const Figures f = figures();
  const StepPhases& ph = steps_.phases[f.mid];
  nlohmann::json j = {{"bench", "step_offload"},
                      {"params", n_params_},
                      {"offload_param", o_.offload_param},
                      {"offload_optimizer", o_.offload_optimizer},
                      {"checkpointing", o_.checkpointing},
                      {"grad_clip", o_.grad_clip},
                      {"overlap_backward", !o_.no_overlap_backward},
                      {"speculative_sub_groups", o_.speculative_sub_groups},
                      {"offload_ratio", o_.offload_ratio},
                      {"batch", o_.batch_size},
                      {"context", o_.seq_len},
                      {"step_ms", f.step_s * 1e3},
                      {"grad_accum", o_.grad_accum},
                      {"rounds", rounds_},
                      {"tokens_per_s", f.tokens / f.step_s},
                      {"model_tflop_per_s", f.model_tflops},
                      {"gemm_tflop_per_s", f.gemm_tflops},
                      {"mfu", f.gemm_tflops > 0 ? f.model_tflops / f.gemm_tflops : 0.0},
                      {"mfu_palm", f.gemm_tflops > 0 ? f.palm_tflops / f.gemm_tflops : 0.0},
                      {"compute_ms", f.compute_s * 1e3},
                      {"disk_ms", disk_s_ * 1e3},
                      {"optimizer_bound_ms", adam_s_ * 1e3},
                      {"bound_ms", f.bound * 1e3},
                      {"ratio", f.ratio},
                      {"cores", f.cores},
                      {"compute_cpu_ms", f.compute_cpu_s * 1e3},
                      {"step_cpu_ms", f.step_cpu_s * 1e3},
                      {"loss", loss_},
                      {"phases_ms",
                       {{"zero_grads", ph.zero_grads * 1e3},
                        {"forward", ph.forward * 1e3},
                        {"backward", ph.backward * 1e3},
                        {"optimizer_step", ph.optimizer_step * 1e3},
                        {"synchronize", steps_.synchronize[f.mid] * 1e3}}},
                      {"breakdown", steps_.reports[f.mid].to_json()}};
  std::printf("%s\n", j.dump().c_str());
}

void OffloadStepBench::print_text() const {
  const Figures f = figures();
  const OffloadStepReport& r = steps_.reports[f.mid];
  const StepPhases& ph = steps_.phases[f.mid];
  const std::string ratio_note = o_.offload_ratio < 1.0 ? fmt::format(" (ratio {:g})", o_.offload_ratio) : "";
  std::printf("GPT-2 L=%d H=%d C=%d V=%d, B=%d T=%d, %.2fM params, %s; params %s, optimizer %s%s, checkpoints %s\n",
              o_.n_layer, o_.n_head, o_.n_embd, o_.vocab_size, o_.batch_size, o_.seq_len, n_params_ / 1e6,
              device_->description().c_str(), o_.offload_param.c_str(), o_.offload_optimizer.c_str(),
              ratio_note.c_str(), o_.checkpointing.c_str());
  std::printf("offloaded step (median of %d, %d micro-batches each%s): %.1f ms, %.0f tokens/s, %.1f TFLOP/s of "
              "model FLOPs (%.1f per step)\n",
              o_.steps, o_.grad_accum,
              rounds_ > 1 ? fmt::format("; alternated with the plain steps in {} rounds", rounds_).c_str() : "",
              f.step_s * 1e3, f.tokens / f.step_s, f.model_tflops, step_flops_ / 1e12);
  if (f.gemm_tflops > 0)
    std::printf("  model FLOPs utilisation: %.1f / %.0f TFLOP/s (the measured %s GEMM rate) = %.1f%% (%.1f%% by PaLM's "
                "count, 6N + 12LCT a token, as nanoGPT and Megatron-LM report it)\n",
                f.model_tflops, f.gemm_tflops, o_.precision.c_str(), 100.0 * f.model_tflops / f.gemm_tflops,
                100.0 * f.palm_tflops / f.gemm_tflops);
  std::printf("  breakdown: stall %.1f ms, optimizer %.1f ms (of which waiting for gradients %.1f; the next forward "
              "waited %.1f for it), h2d %.1f MB (%.1f ms busy), d2h %.1f MB (%.1f ms), nvme read %.1f MB + write %.1f "
              "MB (%.1f ms busy)\n",
              r.stall_s * 1e3, r.optimizer_s * 1e3, r.grads_wait_s * 1e3, r.update_wait_s * 1e3, r.h2d_bytes / 1e6,
              r.h2d_busy_s * 1e3, r.d2h_bytes / 1e6, r.d2h_busy_s * 1e3, r.nvme_read_bytes / 1e6,
              r.nvme_write_bytes / 1e6, r.nvme_busy_s * 1e3);
  if (o_.offload_optimizer == "nvme" || o_.speculative_sub_groups > 0) {
    int early = 0, redone = 0;
    for (const OffloadStepReport& s : steps_.reports) {
      early += s.early_start > 0;
      redone += s.redone > 0;
    }
    std::printf("  updates started in backward: %d of %d measured steps, %d redone (grad clip %g)%s\n", early,
                static_cast<int>(steps_.reports.size()), redone, o_.grad_clip,
                o_.no_overlap_backward ? ", off by --no-overlap-backward" : "");
  }
  std::printf("  the training thread: zero_grads %.1f ms, forward %.1f, backward %.1f, optimizer step() %.1f, "
              "synchronize %.1f\n",
              ph.zero_grads * 1e3, ph.forward * 1e3, ph.backward * 1e3, ph.optimizer_step * 1e3,
              steps_.synchronize[f.mid] * 1e3);
  std::printf("  memory: device %.1f MB (peak %.1f), host %.1f MB (peak %.1f), nvme %.1f MB\n", r.device.live / 1e6,
              r.device.peak / 1e6, r.host.live / 1e6, r.host.peak / 1e6, r.nvme.live / 1e6);
  std::printf("bound = max(compute %.1f ms, disk %.1f ms for its nvme bytes, CPU Adam %.1f ms in memory over %.1fM "
              "parameters) = %.1f ms\n",
              f.compute_s * 1e3, disk_s_ * 1e3, adam_s_ * 1e3, adam_params_ / 1e6, f.bound * 1e3);
  std::printf("ratio: step / bound = %.2f (target <= 1.15)\n", f.ratio);
  std::printf("CPU time per step, all threads: compute %.1f ms, offloaded step %.1f ms (+%.1f ms of offload work); "
              "spread over %d cores the offloaded step needs >= %.1f ms: step / that = %.2f\n",
              f.compute_cpu_s * 1e3, f.step_cpu_s * 1e3, (f.step_cpu_s - f.compute_cpu_s) * 1e3, f.cores,
              f.step_cpu_s / f.cores * 1e3, f.step_s / (f.step_cpu_s / f.cores));
}

}  // namespace

int run_bench_step_offload(const BenchStepOptions& o) {
  const kernels::cpu::CpuThreadLimit threads(o.threads);  // TBB's and the matmuls' (OpenMP's), for the Adam term
  if (o.steps <= 0 || o.batch_size <= 0 || o.seq_len <= 0) {
    std::fprintf(stderr, "strata bench step: --steps, --batch and --context must be positive\n");
    return 2;
  }
  OffloadStepBench bench(o);
  if (Status st = bench.run(); !st.is_ok()) return fail(st);
  if (o.json) {
    bench.print_json();
  } else {
    bench.print_text();
  }
  return 0;
}

}  // namespace strata::engine
