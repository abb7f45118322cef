// `strata bench step --offload-…`: the offloaded training step against the bound docs/architecture.md sets for it,
// max(compute, NVMe traffic / disk bandwidth, optimizer time), every term measured in the same run: the same
// model's forward+backward kept on the device, the step's NVMe byte mix pushed through a swap store in the
// same folder, and the CPU Adam pass over the same parameters in memory.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
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
#include "engine/checkpoint/checkpoint.h"
#include "engine/cli/bench_kernels.h"
#include "engine/cli/bench_step.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/thread_limit.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"
#include "storage/swap_store.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

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

ActivationCheckpointing checkpointing_of(const std::string& s) {
  return s == "host" ? ActivationCheckpointing::kHost
                     : s == "device" ? ActivationCheckpointing::kDevice : ActivationCheckpointing::kNone;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata bench step: %s\n", st.to_string().c_str());
  return 1;
}

}  // namespace

int run_bench_step_offload(const BenchStepOptions& o) {
  const kernels::cpu::CpuThreadLimit threads(o.threads);  // TBB's and the matmuls' (OpenMP's)
  if (o.steps <= 0 || o.batch_size <= 0 || o.seq_len <= 0) {
    std::fprintf(stderr, "strata bench step: --steps, --batch and --context must be positive\n");
    return 2;
  }
  const GPT2Config mc{o.n_layer, o.n_head, o.n_embd, o.vocab_size, std::max(o.block_size, o.seq_len)};
  const kernels::KernelSet* k = kernels::find_kernel_set(o.kernels.c_str());
  const auto precision = o.precision == "bf16" ? kernels::MatmulPrecision::kBF16 : kernels::MatmulPrecision::kF32;
  auto device = kernels::make_device(o.device, *k);
  if (!device.is_ok()) return fail(device.status());
  const int B = o.batch_size, T = o.seq_len;
  std::vector<int32_t> x, y;
  random_batch(B, T, mc.vocab_size, o.seed, &x, &y);
  std::string nvme_path = o.nvme_path;
  const bool temp_dir = nvme_path.empty();
  if (temp_dir) nvme_path = (fs::temp_directory_path() / fmt::format("strata-bench-step-{}", getpid())).string();
  struct RemoveDir {
    std::string dir;
    bool on;
    ~RemoveDir() {
      std::error_code ec;
      if (on) fs::remove_all(dir, ec);
    }
  } cleanup{nvme_path, temp_dir};
  const int total = o.warmup + o.steps;
  const ActivationCheckpointing ckpt = checkpointing_of(o.checkpointing);
  std::unique_ptr<offload::PinnedPool> ckpt_pool;
  if (ckpt == ActivationCheckpointing::kHost) {
    auto p = offload::PinnedPool::create(offload::PinnedPoolOptions{.budget_bytes = 0, .lock = false});
    if (!p.is_ok()) return fail(p.status());
    ckpt_pool = std::move(p).value();
    register_pool_buffers(*ckpt_pool, *device.value());
  }

  // 1. Compute: the same model kept on the device, forward + backward only. With --rounds, kept while the
  // offloaded model runs, and its steps alternate with the offloaded ones in blocks.
  std::vector<double> compute, compute_cpu;
  size_t n_params = 0;
  double step_flops = 0, palm_flops = 0;
  size_t adam_params = 0;  // the parameters whose optimizer state is offloaded
  const int rounds = std::max(1, std::min(o.rounds, o.steps));
  std::unique_ptr<GPT2> plain;
  Timer setup;
  {
    auto model = GPT2::create(mc, *device.value(), precision);
    if (!model.is_ok()) return fail(model.status());
    plain = std::move(model).value();
    plain->set_activation_checkpointing(ckpt, ckpt_pool.get());
    plain->set_working_copies(!o.no_working_copies);
    if (Status st = plain->init_gpt2(o.seed); !st.is_ok()) return fail(st);
    n_params = plain->num_params();
    adam_params = n_params;
    if (o.offload_ratio < 1.0) {  // offload_optimizer.ratio: the units kept on the device are updated there
      const std::vector<bool> kept = units_kept_on_device(*plain, o.offload_ratio);
      for (size_t u = 0; u < kept.size(); ++u) adam_params -= kept[u] ? plain->units()[u].numel() : 0;
    }
    step_flops = plain->flops_per_step(B, T) * o.grad_accum;
    palm_flops = plain->palm_flops_per_step(B, T) * o.grad_accum;
  }
  STRATA_LOG_INFO("bench step: {} parameters built and initialised on the device in {:.1f} s", n_params, setup.seconds());
  auto plain_step = [&](bool measured) -> Status {
    GPT2& m = *plain;
    Timer t;
    const double cpu0 = process_cpu_seconds();
    STRATA_RETURN_IF_ERROR(m.zero_grads());
    for (int a = 0; a < o.grad_accum; ++a) {
      STRATA_RETURN_IF_ERROR(m.forward(x.data(), y.data(), B, T).status());
      STRATA_RETURN_IF_ERROR(m.backward());
    }
    m.device().synchronize();
    if (measured) {
      compute.push_back(t.seconds());
      compute_cpu.push_back(process_cpu_seconds() - cpu0);
    }
    return Status::ok();
  };
  // The offloaded model starts from the same weights: the plain model's, which forward and backward leave as they
  // were, copied rather than drawn again (GPT-2's init draws its normals one after another: about 34M a second on
  // 2 cores, so 20 s for 700M parameters).
  std::vector<std::vector<float>> initial;
  auto keep_initial = [&]() -> Status {
    initial.resize(plain->units().size());
    for (size_t u = 0; u < initial.size(); ++u) {
      initial[u].resize(plain->units()[u].numel());
      STRATA_RETURN_IF_ERROR(plain->read_params(u, initial[u].data()));
    }
    return Status::ok();
  };
  if (rounds == 1) {
    setup.reset();
    for (int s = 0; s < total; ++s) {
      if (Status st = plain_step(s >= o.warmup); !st.is_ok()) return fail(st);
    }
    if (Status st = keep_initial(); !st.is_ok()) return fail(st);
    plain.reset();
    STRATA_LOG_INFO("bench step: {} compute-only steps in {:.1f} s", total, setup.seconds());
  }
  // 2. The optimizer term: the CPU Adam pass over the same parameters (those offloaded) in memory.
  setup.reset();
  auto adam_s = adam_seconds(adam_params);
  if (!adam_s.is_ok()) return fail(adam_s.status());
  STRATA_LOG_INFO("bench step: CPU Adam over {} parameters in memory measured in {:.1f} s", adam_params,
                  setup.seconds());
  setup.reset();

  // 3. The offloaded step.
  OffloadConfig oc;
  oc.stage = 3;
  oc.offload_param.device = o.offload_param;
  oc.offload_param.nvme_path = nvme_path + "/param";
  oc.offload_optimizer.device = o.offload_optimizer;
  oc.offload_optimizer.nvme_path = nvme_path + "/optimizer";
  oc.offload_optimizer.overlap_backward = !o.no_overlap_backward;
  oc.offload_optimizer.speculative_sub_groups = o.speculative_sub_groups;
  oc.offload_optimizer.ratio = o.offload_ratio;
  AdamWConfig adam;
  adam.grad_clip = o.grad_clip;
  oc.sub_group_size = o.sub_group_size;
  oc.stage3_param_persistence_threshold = 0;
  oc.stage3_max_live_parameters = o.max_live;
  oc.host_memory_limit = parse_bytes(o.host_limit);
  oc.offload_optimizer.buffer_count = o.buffer_count;
  const bool offloaded = offload_enabled(oc);
  std::vector<double> steps, steps_cpu;
  std::vector<OffloadStepReport> reports;
  // The training thread's time in each call of a step (the median step's is printed). "backward" includes
  // begin_last_backward, which first completes the previous update if the forward has not.
  struct Phases {
    double zero = 0, forward = 0, backward = 0, step = 0, sync = 0;
  };
  std::vector<Phases> phases;
  float loss = 0;
  {
    std::unique_ptr<OffloadRuntime> rt;
    auto model = GPT2::create(mc, *device.value(), precision, offloaded);
    if (!model.is_ok()) return fail(model.status());
    GPT2& m = *model.value();
    std::optional<AdamW> plain_opt;
    Optimizer* opt = nullptr;
    if (offloaded) {
      auto r = OffloadRuntime::create(oc, adam, *device.value(), m);
      if (!r.is_ok()) return fail(r.status());
      rt = std::move(r).value();
      opt = &rt->optimizer();
    } else {
      auto a = AdamW::create(m.units(), adam, *device.value());
      if (!a.is_ok()) return fail(a.status());
      plain_opt.emplace(std::move(a).value());
      opt = &*plain_opt;
    }
    m.set_activation_checkpointing(ckpt, rt ? &rt->pool() : ckpt_pool.get());
    m.set_working_copies(!o.no_working_copies);
    if (initial.empty()) {
      if (Status st = keep_initial(); !st.is_ok()) return fail(st);  // --rounds: the plain model has not stepped
    }
    for (size_t u = 0; u < initial.size(); ++u) {
      if (Status st = m.write_params(u, initial[u].data()); !st.is_ok()) return fail(st);
      std::vector<float>().swap(initial[u]);
    }
    if (Status st = opt->adopt_params(); !st.is_ok()) return fail(st);
    STRATA_LOG_INFO("bench step: the offloaded model built and given the same initial weights in {:.1f} s",
                    setup.seconds());
    // Written when this scope ends, after a failed step too (the timeline up to it explains it), and before
    // the runtime's threads go.
    struct TraceFile {
      const BenchStepOptions& o;
      ~TraceFile() {
        if (o.trace_path.empty()) return;
        const size_t dropped = trace::dropped();
        if (Status st = trace::write(o.trace_path); !st.is_ok()) {
          std::fprintf(stderr, "strata bench step: %s\n", st.to_string().c_str());
        } else if (!o.json) {
          std::fprintf(stderr, "  trace: %zu events in %s%s\n", trace::recorded(), o.trace_path.c_str(),
                       dropped > 0 ? fmt::format(" ({} dropped: the buffer was full)", dropped).c_str() : "");
        }
      }
    } trace_file{o};
    if (!o.trace_path.empty()) {
      trace::start();
      trace::name_thread("training");
    }
    auto offloaded_step = [&](int s, bool measured) -> Status {
      trace::Span step_span("step", s + 1);
      Timer t;
      const double cpu0 = process_cpu_seconds();
      Phases ph;
      double mark = 0;
      auto lap = [&](double* into) {
        const double now = t.seconds();
        *into = now - mark;
        mark = now;
      };
      STRATA_RETURN_IF_ERROR(m.zero_grads());
      lap(&ph.zero);
      for (int a = 0; a < o.grad_accum; ++a) {
        double fwd = 0, bwd = 0;
        STRATA_ASSIGN_OR_RETURN(loss, m.forward(x.data(), y.data(), B, T));  // traced by the model
        lap(&fwd);
        {
          trace::Span span("begin backward");
          STRATA_RETURN_IF_ERROR(a + 1 == o.grad_accum ? opt->begin_last_backward(1e-4f)
                                                       : opt->begin_accumulating_backward());
        }
        STRATA_RETURN_IF_ERROR(m.backward());
        lap(&bwd);
        ph.forward += fwd;
        ph.backward += bwd;
      }
      {
        trace::Span span("optimizer step()");
        STRATA_RETURN_IF_ERROR(opt->step(1e-4f, nullptr).status());
      }
      lap(&ph.step);
      {
        trace::Span span("synchronize");
        m.device().synchronize();
      }
      lap(&ph.sync);
      const double secs = t.seconds();
      OffloadStepReport r = rt ? rt->take_report() : OffloadStepReport{};
      if (measured) {
        steps.push_back(secs);
        steps_cpu.push_back(process_cpu_seconds() - cpu0);
        reports.push_back(r);
        phases.push_back(ph);
      }
      if (!o.json)
        std::fprintf(stderr, "  step %d: %.1f ms%s%s\n", s + 1, secs * 1e3, rt ? (" | " + r.summary()).c_str() : "",
                     measured ? "" : " (not measured)");
      return Status::ok();
    };
    if (rounds == 1) {
      for (int s = 0; s < total; ++s) {
        if (Status st = offloaded_step(s, s >= o.warmup); !st.is_ok()) return fail(st);
      }
    } else {
      // Blocks of plain steps then offloaded steps, each block led by an unmeasured step (the warmup steps in
      // the first): the machine's drift between blocks reaches both terms alike. Each offloaded block ends
      // with its last update completed, unmeasured, so that it does not run into the plain block after it;
      // the block's first step then has no update to wait for, which is why it is not measured.
      const int per_round = (o.steps + rounds - 1) / rounds;
      for (int round = 0, measured = 0, s = 0; round < rounds && measured < o.steps; ++round) {
        const int lead = round == 0 ? std::max(1, o.warmup) : 1;
        const int n = std::min(per_round, o.steps - measured);
        for (int i = 0; i < lead + n; ++i) {
          if (Status st = plain_step(i >= lead); !st.is_ok()) return fail(st);
        }
        for (int i = 0; i < lead + n; ++i) {
          if (Status st = offloaded_step(s++, i >= lead); !st.is_ok()) return fail(st);
        }
        if (Status st = opt->finish(); !st.is_ok()) return fail(st);
        measured += n;
      }
    }
  }
  // The median step's report.
  const double step_s = median(steps);
  const size_t mid = std::distance(steps.begin(), std::find(steps.begin(), steps.end(), step_s));
  const OffloadStepReport& r = reports[mid];
  const Phases& ph = phases[mid];

  // 4. The disk term: the median step's NVMe byte mix through a store in the same folder.
  double disk_s = 0;
  if (r.nvme_read_bytes + r.nvme_write_bytes > 0) {
    auto d = disk_seconds(nvme_path + "/probe", r.nvme_read_bytes, r.nvme_write_bytes);
    if (!d.is_ok()) return fail(d.status());
    disk_s = d.value();
  }
  const double compute_s = median(compute);
  const double bound = std::max({compute_s, disk_s, adam_s.value()});
  const double ratio = step_s / bound;
  // On the CPU backend the offload's own CPU work (checksums, copies, Adam, I/O system calls) competes with the
  // kernels for the same cores, which the bound above does not count: the step also needs at least its CPU
  // time spread over every core.
  const int cores = tbb::info::default_concurrency();
  const double step_cpu_s = median(steps_cpu), compute_cpu_s = median(compute_cpu);
  const double tokens = static_cast<double>(B) * T * o.grad_accum;
  // Model FLOPs utilisation on a GPU: the step's model FLOPs (6 per parameter per token plus attention) per
  // second, over the GPU's measured GEMM rate at the same precision.
  const double gemm_tflops =
      device.value()->host_accessible() ? 0 : measure_gemm_tflop_per_s(precision == kernels::MatmulPrecision::kBF16);
  const double model_tflops = step_flops / step_s / 1e12;
  if (o.json) {
    nlohmann::json j = {{"bench", "step_offload"},
                        {"params", n_params},
                        {"offload_param", o.offload_param},
                        {"offload_optimizer", o.offload_optimizer},
                        {"checkpointing", o.checkpointing},
                        {"grad_clip", o.grad_clip},
                        {"overlap_backward", !o.no_overlap_backward},
                        {"speculative_sub_groups", o.speculative_sub_groups},
                        {"offload_ratio", o.offload_ratio},
                        {"batch", B},
                        {"context", T},
                        {"step_ms", step_s * 1e3},
                        {"grad_accum", o.grad_accum},
                        {"rounds", rounds},
                        {"tokens_per_s", tokens / step_s},
                        {"model_tflop_per_s", model_tflops},
                        {"gemm_tflop_per_s", gemm_tflops},
                        {"mfu", gemm_tflops > 0 ? model_tflops / gemm_tflops : 0.0},
                        {"mfu_palm", gemm_tflops > 0 ? palm_flops / step_s / 1e12 / gemm_tflops : 0.0},
                        {"compute_ms", compute_s * 1e3},
                        {"disk_ms", disk_s * 1e3},
                        {"optimizer_bound_ms", adam_s.value() * 1e3},
                        {"bound_ms", bound * 1e3},
                        {"ratio", ratio},
                        {"cores", cores},
                        {"compute_cpu_ms", compute_cpu_s * 1e3},
                        {"step_cpu_ms", step_cpu_s * 1e3},
                        {"loss", loss},
                        {"phases_ms",
                         {{"zero_grads", ph.zero * 1e3},
                          {"forward", ph.forward * 1e3},
                          {"backward", ph.backward * 1e3},
                          {"optimizer_step", ph.step * 1e3},
                          {"synchronize", ph.sync * 1e3}}},
                        {"breakdown", r.to_json()}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  const std::string ratio_note = o.offload_ratio < 1.0 ? fmt::format(" (ratio {:g})", o.offload_ratio) : "";
  std::printf("GPT-2 L=%d H=%d C=%d V=%d, B=%d T=%d, %.2fM params, %s; params %s, optimizer %s%s, checkpoints %s\n",
              o.n_layer, o.n_head, o.n_embd, o.vocab_size, B, T, n_params / 1e6,
              device.value()->description().c_str(), o.offload_param.c_str(), o.offload_optimizer.c_str(),
              ratio_note.c_str(), o.checkpointing.c_str());
  std::printf("offloaded step (median of %d, %d micro-batches each%s): %.1f ms, %.0f tokens/s, %.1f TFLOP/s of "
              "model FLOPs (%.1f per step)\n",
              o.steps, o.grad_accum,
              rounds > 1 ? fmt::format("; alternated with the plain steps in {} rounds", rounds).c_str() : "",
              step_s * 1e3, tokens / step_s, model_tflops, step_flops / 1e12);
  if (gemm_tflops > 0)
    std::printf("  model FLOPs utilisation: %.1f / %.0f TFLOP/s (the measured %s GEMM rate) = %.1f%% (%.1f%% by PaLM's "
                "count, 6N + 12LCT a token, as nanoGPT and Megatron-LM report it)\n",
                model_tflops, gemm_tflops, o.precision.c_str(), 100.0 * model_tflops / gemm_tflops,
                100.0 * palm_flops / step_s / 1e12 / gemm_tflops);
  std::printf("  breakdown: stall %.1f ms, optimizer %.1f ms (of which waiting for gradients %.1f; the next forward "
              "waited %.1f for it), h2d %.1f MB (%.1f ms busy), d2h %.1f MB (%.1f ms), nvme read %.1f MB + write %.1f "
              "MB (%.1f ms busy)\n",
              r.stall_s * 1e3, r.optimizer_s * 1e3, r.grads_wait_s * 1e3, r.update_wait_s * 1e3, r.h2d_bytes / 1e6,
              r.h2d_busy_s * 1e3,
              r.d2h_bytes / 1e6, r.d2h_busy_s * 1e3, r.nvme_read_bytes / 1e6, r.nvme_write_bytes / 1e6,
              r.nvme_busy_s * 1e3);
  if (o.offload_optimizer == "nvme" || o.speculative_sub_groups > 0) {
    int early = 0, redone = 0;
    for (const OffloadStepReport& s : reports) {
      early += s.early_start > 0;
      redone += s.redone > 0;
    }
    std::printf("  updates started in backward: %d of %d measured steps, %d redone (grad clip %g)%s\n", early,
                static_cast<int>(reports.size()), redone, o.grad_clip,
                o.no_overlap_backward ? ", off by --no-overlap-backward" : "");
  }
  std::printf("  the training thread: zero_grads %.1f ms, forward %.1f, backward %.1f, optimizer step() %.1f, "
              "synchronize %.1f\n",
              ph.zero * 1e3, ph.forward * 1e3, ph.backward * 1e3, ph.step * 1e3, ph.sync * 1e3);
  std::printf("  memory: device %.1f MB (peak %.1f), host %.1f MB (peak %.1f), nvme %.1f MB\n", r.device.live / 1e6,
              r.device.peak / 1e6, r.host.live / 1e6, r.host.peak / 1e6, r.nvme.live / 1e6);
  std::printf("bound = max(compute %.1f ms, disk %.1f ms for its nvme bytes, CPU Adam %.1f ms in memory over %.1fM "
              "parameters) = %.1f ms\n",
              compute_s * 1e3, disk_s * 1e3, adam_s.value() * 1e3, adam_params / 1e6, bound * 1e3);
  std::printf("ratio: step / bound = %.2f (target <= 1.15)\n", ratio);
  std::printf("CPU time per step, all threads: compute %.1f ms, offloaded step %.1f ms (+%.1f ms of offload work); "
              "spread over %d cores the offloaded step needs >= %.1f ms: step / that = %.2f\n",
              compute_cpu_s * 1e3, step_cpu_s * 1e3, (step_cpu_s - compute_cpu_s) * 1e3, cores,
              step_cpu_s / cores * 1e3, step_s / (step_cpu_s / cores));
  return 0;
}

}  // namespace strata::engine
