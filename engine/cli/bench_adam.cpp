#include "engine/cli/bench_adam.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>

#include "common/aligned.h"
#include "common/dtype.h"
#include "common/timer.h"
#include "common/units.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/fast_simd.h"
#include "offload/optimizer_swap.h"
#include "offload/pinned_pool.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"
#include "storage/swap_store.h"

namespace strata::engine {

void add_bench_adam_command(CLI::App& bench, BenchAdamOptions& o) {
  CLI::App* cmd = bench.add_subcommand(
      "adam", "Time the CPU optimizer pass (AdamW + 16-bit working copy) against a same-bytes bandwidth probe");
  cmd->add_option("--params", o.params, "Parameters per step: a count, or with k/M/G (decimal)")->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "Working copy written: f32 (none), bf16, f16, or all")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "all"}))
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "Worker threads (0: every core the process may use)")->capture_default_str();
  cmd->add_option("--steps", o.steps, "Timed steps of each (median reported)")->capture_default_str();
  cmd->add_option("--nvme", o.nvme_dir, "Also time the optimizer swap pipeline with its states in this folder");
  cmd->add_option("--sub-group", o.sub_group, "Elements per sub-group of the swap pipeline (k/M/G)")
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "One JSON object per dtype instead of the table");
}

namespace {

constexpr size_t kBlock = 1 << 15;  // the optimizer's own TBB block (fast_adamw.cpp), so both split alike

// Reads params, m, v, grads; writes params, m, v (and the 16-bit copy): the optimizer's bytes, no arithmetic
// to speak of.
void probe(float* p, float* m, float* v, const float* g, uint16_t* w, size_t n) {
  const size_t blocks = (n + kBlock - 1) / kBlock;
  tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t k = r.begin(); k < r.end(); ++k) {
      const size_t i0 = k * kBlock, i1 = std::min(n, i0 + kBlock);
      if (w == nullptr) {
        for (size_t i = i0; i < i1; ++i) {
          const float gi = g[i];
          m[i] += gi;
          v[i] += gi;
          p[i] += gi;
        }
      } else {
        for (size_t i = i0; i < i1; ++i) {
          const float gi = g[i];
          m[i] += gi;
          v[i] += gi;
          const float pn = p[i] + gi;
          p[i] = pn;
          uint32_t bits;
          std::memcpy(&bits, &pn, sizeof bits);
          w[i] = static_cast<uint16_t>(bits >> 16);
        }
      }
    }
  });
}

// The swap pipeline over n parameters in sub-groups of `sub`, states under `dir`; prints one row or object.
// `adam_s` is the in-memory pass over the same parameters (bf16 copy), for the bound.
int bench_swap(const BenchAdamOptions& o, uint64_t n, uint64_t sub, float* p, const float* g, uint16_t* w,
               double adam_s) {
  auto engine = make_io_engine(EngineOptions{.kind = EngineKind::kAuto, .lanes = 2, .queue_depth = 32});
  if (!engine.is_ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", engine.status().to_string().c_str());
    return 1;
  }
  IoQueue queue(*engine.value(), IoQueueOptions{size_t{1} << 20});
  SwapStoreOptions so;
  so.dir = o.nvme_dir;
  so.file_bytes = uint64_t{1} << 30;
  // Two versions of every key can coexist (copy-on-write), plus slack for the allocator.
  so.max_files = static_cast<uint32_t>((2 * 12 * n + so.file_bytes - 1) / so.file_bytes + 2);
  auto store = SwapStore::open(queue, so);
  if (!store.is_ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", store.status().to_string().c_str());
    return 1;
  }
  auto pool = offload::PinnedPool::create(
      offload::PinnedPoolOptions{.budget_bytes = offload::OptimizerSwapper::staging_bytes(sub) + (8u << 20)});
  if (!pool.is_ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", pool.status().to_string().c_str());
    return 1;
  }
  std::vector<offload::OptimizerGroup> groups;
  for (uint64_t at = 0; at < n; at += sub) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(sub, n - at));
    groups.push_back({fmt::format("g{}", groups.size()), len, {{0, len, 0.1f}}, {}});
  }
  auto swapper = offload::OptimizerSwapper::create(*store.value(), *pool.value(), groups);
  if (!swapper.is_ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", swapper.status().to_string().c_str());
    return 1;
  }
  offload::OptimizerSwapper& s = *swapper.value();
  size_t at = 0;
  for (size_t i = 0; i < groups.size(); at += groups[i].numel, ++i) {
    if (Status st = s.initialize(i, p + at); !st.is_ok()) {
      std::fprintf(stderr, "strata bench adam: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  // The disk under the step's own byte pattern, through the same store and keys: read every state (into A),
  // then read them all again (into B) while writing A back over them, everything in flight at once. The second
  // pass moves the 24 bytes per parameter a step moves, in the same mix of reads and writes.
  auto a = AlignedBuffer::allocate(12 * n, "bench_adam.disk_probe_a", 4096);
  auto b = AlignedBuffer::allocate(12 * n, "bench_adam.disk_probe_b", 4096);
  if (!a.is_ok() || !b.is_ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", (a.is_ok() ? b.status() : a.status()).to_string().c_str());
    return 1;
  }
  auto all_keys = [&](char* read_into, const char* write_from) -> Result<double> {
    IoBatch batch;
    Timer t;
    size_t offset = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const char* what : {"master", "m", "v"}) {
        const std::string key = s.state_key(g, what);
        const size_t bytes = groups[g].numel * sizeof(float);
        STRATA_RETURN_IF_ERROR(store.value()->read(key, read_into + offset, bytes, &batch));
        if (write_from != nullptr) STRATA_RETURN_IF_ERROR(store.value()->write(key, write_from + offset, bytes, &batch));
        offset += bytes;
      }
    }
    STRATA_RETURN_IF_ERROR(batch.wait());
    return t.seconds();
  };
  auto read_s = all_keys(a->as<char>(), nullptr);
  auto mixed_s = read_s.is_ok() ? all_keys(b->as<char>(), a->as<char>()) : Result<double>(read_s.status());
  if (!mixed_s.is_ok()) {
    std::fprintf(stderr, "strata bench adam: disk probe: %s\n", mixed_s.status().to_string().c_str());
    return 1;
  }
  const double read_gbs = 12.0 * n / read_s.value() / 1e9, mixed_gbs = 24.0 * n / mixed_s.value() / 1e9;

  std::vector<const float*> grads;
  std::vector<void*> working;
  at = 0;
  for (const auto& gr : groups) {
    grads.push_back(g + at);
    working.push_back(w + at);
    at += gr.numel;
  }
  kernels::AdamWParams hp;
  hp.lr = 1e-4f;
  std::vector<double> times;
  offload::OptimizerStepStats last;
  for (int step = -1; step < o.steps; ++step) {
    hp.step = step + 2;
    Timer t;
    if (Status st = s.step(grads, working, DType::kBF16, hp); !st.is_ok()) {
      std::fprintf(stderr, "strata bench adam: %s\n", st.to_string().c_str());
      return 1;
    }
    if (step >= 0) times.push_back(t.seconds());
    last = s.last_step_stats();
  }
  const double step_s = median(times);
  const double disk_s = mixed_s.value();
  const double bound = std::max(disk_s, adam_s);
  if (o.json) {
    std::printf("%s\n", nlohmann::json{{"bench", "adam_nvme"},
                                       {"params", n},
                                       {"sub_group", sub},
                                       {"engine", engine.value()->name()},
                                       {"seconds_per_step", step_s},
                                       {"disk_read_gb_per_s", read_gbs},
                                       {"disk_mixed_gb_per_s", mixed_gbs},
                                       {"disk_seconds", disk_s},
                                       {"adam_seconds", adam_s},
                                       {"ratio_to_bound", step_s / bound},
                                       {"read_wait_s", last.read_wait_s},
                                       {"update_s", last.update_s},
                                       {"write_wait_s", last.write_wait_s}}
                            .dump()
                            .c_str());
  } else {
    std::printf("\nswap pipeline (%s engine, states in %s, sub-groups of %llu): %.3f s/step\n",
                engine.value()->name().c_str(), o.nvme_dir.c_str(), static_cast<unsigned long long>(sub), step_s);
    std::printf("  disk through the store: reads alone %.2f GB/s; the step's mix (12 B/param read + 12 written, all "
                "in flight) %.2f GB/s -> %.3f s\n",
                read_gbs, mixed_gbs, disk_s);
    std::printf("  in-memory pass %.3f s; bound max(disk, pass) %.3f s; step / bound = %.2f (last step: reads "
                "waited %.3f s, updates %.3f s, writes waited %.3f s)\n",
                adam_s, bound, step_s / bound, last.read_wait_s, last.update_s, last.write_wait_s);
  }
  return 0;
}

}  // namespace

int run_bench_adam(const BenchAdamOptions& o) {
  const uint64_t n = parse_count(o.params);
  if (n == 0) {
    std::fprintf(stderr, "strata bench adam: --params '%s' is not a positive count (e.g. 100M, 1.5G, 250000)\n",
                 o.params.c_str());
    return 2;
  }
  if (o.steps <= 0 || o.threads < 0) {
    std::fprintf(stderr, "strata bench adam: --steps must be positive and --threads >= 0\n");
    return 2;
  }
  std::optional<tbb::global_control> limit;
  if (o.threads > 0) limit.emplace(tbb::global_control::max_allowed_parallelism, o.threads);
  const int threads = o.threads > 0 ? o.threads : tbb::info::default_concurrency();

  auto alloc = [&](size_t bytes, const char* what) -> std::optional<AlignedBuffer> {
    auto b = AlignedBuffer::allocate(bytes, what, 4096);
    if (!b.is_ok()) {
      std::fprintf(stderr, "strata bench adam: %s\n", b.status().to_string().c_str());
      return std::nullopt;
    }
    return std::move(b).value();
  };
  auto p = alloc(n * 4, "bench_adam.params"), m = alloc(n * 4, "bench_adam.m"), v = alloc(n * 4, "bench_adam.v"),
       g = alloc(n * 4, "bench_adam.grads"), w = alloc(n * 2, "bench_adam.working");
  if (!p || !m || !v || !g || !w) return 1;
  // Real values, written by every thread (first touch spreads the pages as the passes will use them).
  tbb::parallel_for(tbb::blocked_range<size_t>(0, n, kBlock), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t i = r.begin(); i < r.end(); ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 20001) / 20000.0f - 0.5f;  // [-0.5, 0.5]
      p->as<float>()[i] = x;
      m->as<float>()[i] = 0.01f * x;
      v->as<float>()[i] = 1e-4f * (x * x + 0.01f);
      g->as<float>()[i] = 0.1f * x;
      w->as<uint16_t>()[i] = 0;
    }
  });

  std::vector<DType> dtypes;
  if (o.dtype == "all") dtypes = {DType::kF32, DType::kBF16, DType::kF16};
  else {
    DType d;
    parse_dtype(o.dtype, &d);
    dtypes = {d};
  }
  if (!o.json) {
    std::printf("strata bench adam: %llu parameters, %d threads, %s kernels\n", static_cast<unsigned long long>(n),
                threads, kernels::cpu::simd::isa_name(kernels::cpu::simd::active_isa()));
    std::printf("%-5s %9s %12s %12s %9s %11s %7s\n", "copy", "B/param", "s/step", "params/s", "GB/s", "probe GB/s",
                "ratio");
  }
  kernels::AdamWParams hp;
  hp.lr = 1e-4f;
  hp.weight_decay = 0.1f;
  double bf16_pass_s = 0;
  for (DType dt : dtypes) {
    const bool copy = dt != DType::kF32;
    const double bytes_per_param = 28.0 + (copy ? 2.0 : 0.0);
    uint16_t* wp = copy ? w->as<uint16_t>() : nullptr;
    std::vector<double> adam_s, probe_s;
    for (int s = -1; s < o.steps; ++s) {  // step -1 warms both up (page faults, TBB threads)
      hp.step = s + 2;
      Timer t;
      kernels::cpu::fast::adamw_update_mixed(p->as<float>(), m->as<float>(), v->as<float>(), g->as<float>(), wp, dt, n,
                                             hp);
      const double a = t.seconds();
      Timer t2;
      probe(p->as<float>(), m->as<float>(), v->as<float>(), g->as<float>(), wp, n);
      const double b = t2.seconds();
      if (s >= 0) {
        adam_s.push_back(a);
        probe_s.push_back(b);
      }
    }
    const double a = median(adam_s), b = median(probe_s);
    const double gbs = bytes_per_param * n / a / 1e9, probe_gbs = bytes_per_param * n / b / 1e9;
    if (o.json) {
      std::printf("%s\n", nlohmann::json{{"bench", "adam"},
                                         {"params", n},
                                         {"dtype", dtype_name(dt)},
                                         {"threads", threads},
                                         {"seconds_per_step", a},
                                         {"params_per_s", n / a},
                                         {"bytes_per_param", bytes_per_param},
                                         {"gb_per_s", gbs},
                                         {"probe_gb_per_s", probe_gbs},
                                         {"ratio_to_probe", gbs / probe_gbs}}
                              .dump()
                              .c_str());
    } else {
      std::printf("%-5s %9.0f %12.4f %12.3g %9.1f %11.1f %6.0f%%\n", copy ? dtype_name(dt) : "none", bytes_per_param,
                  a, n / a, gbs, probe_gbs, 100.0 * gbs / probe_gbs);
    }
    if (dt == DType::kBF16) bf16_pass_s = a;
  }
  if (!o.nvme_dir.empty()) {
    const uint64_t sub = parse_count(o.sub_group);
    if (sub == 0) {
      std::fprintf(stderr, "strata bench adam: --sub-group '%s' is not a positive count\n", o.sub_group.c_str());
      return 2;
    }
    if (bf16_pass_s == 0) {  // the bound needs the in-memory pass with the same (bf16) copy
      std::vector<double> t;
      for (int s = 0; s < o.steps; ++s) {
        hp.step = s + 1;
        Timer timer;
        kernels::cpu::fast::adamw_update_mixed(p->as<float>(), m->as<float>(), v->as<float>(), g->as<float>(),
                                               w->as<uint16_t>(), DType::kBF16, n, hp);
        t.push_back(timer.seconds());
      }
      bf16_pass_s = median(t);
    }
    return bench_swap(o, n, std::min(sub, n), p->as<float>(), g->as<float>(), w->as<uint16_t>(), bf16_pass_s);
  }
  return 0;
}

}  // namespace strata::engine
