#include "engine/bench_adam.h"

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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
  }
  return 0;
}

}  // namespace strata::engine
