// offload_throughput.cpp — an offload throughput test over Strata's public API (engine/strata.h): a session
// with the config's placements (zero_optimization.offload_param and offload_optimizer: cpu or nvme), a few
// warm-up steps, then the measured ones, and where their time went.
//   offload_throughput WARMUP STEPS CONFIG [section.key=value ...]
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine/strata.h"

namespace se = strata::engine;

int failed(const strata::Status& st) {
  std::fprintf(stderr, "offload_throughput: %s\n", st.to_string().c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s WARMUP STEPS CONFIG [section.key=value ...]\n", argv[0]);
    return 2;
  }
  const int warmup = std::atoi(argv[1]), steps = std::atoi(argv[2]);
  if (warmup < 0 || steps < 1) return failed(strata::Status::invalid_argument("WARMUP >= 0 and STEPS >= 1"));
  std::vector<std::string> overrides(argv + 4, argv + argc);
  overrides.push_back("training.max_steps=" + std::to_string(warmup + steps));  // the learning rate's schedule
  auto config = se::load_run_config(argv[3], overrides);
  if (!config.is_ok()) return failed(config.status());

  se::TrainOptions options;
  options.progress = false;
  auto session = se::TrainSession::create(*config, options);
  if (!session.is_ok()) return failed(session.status());
  double seconds = 0, stall = 0, optimizer = 0;
  uint64_t nvme_bytes = 0;
  for (int i = 0; i < warmup + steps; ++i) {
    auto r = (*session)->step();
    if (!r.is_ok()) return failed(r.status());
    if (i < warmup) continue;
    seconds += r->seconds;
    if (r->offload) {
      stall += r->offload->stall_s;
      optimizer += r->offload->optimizer_s;
      nvme_bytes += r->offload->nvme_read_bytes + r->offload->nvme_write_bytes;
    }
  }
  const double tokens = static_cast<double>((*session)->tokens_per_step()) * steps;
  std::printf("%d steps: %.0f tokens/s, %.1f ms a step; waiting for offloaded state %.1f ms, the CPU optimizer "
              "%.1f ms, NVMe %.1f MiB a step\n",
              steps, tokens / seconds, seconds / steps * 1e3, stall / steps * 1e3, optimizer / steps * 1e3,
              static_cast<double>(nvme_bytes) / steps / (1 << 20));
  return 0;
}
