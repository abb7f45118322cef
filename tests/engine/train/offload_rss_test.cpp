// The budgets hold for the whole process: `strata train` with parameters and optimizer state on NVMe, a
// host budget and a device budget (the CPU backend's device tier is ordinary memory too) keeps its peak
// resident set within host budget + device budget + a stated margin for the process itself, for a model whose
// training state is several times that, and so does a resume from its checkpoint. Runs the real binary in a
// child process and reads its peak RSS.
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/engine/trainer_fixture.h"

extern char** environ;

namespace strata::engine {
namespace {

// Beyond the budgets and the process's own footprint (code and libraries, measured in the same test by a
// plain run of a tiny model: about 220 MiB with the CUDA libraries linked), what a run may hold outside the
// tiers: allocator slack, the files' pages being copied. (The initial weights, a checkpoint's save and its
// resume go a sub-group at a time through the optimizer's host buffers or staging slots; load_memory_test.cpp
// holds each load's heap growth to a quarter of a unit.)
constexpr uint64_t kTransientMargin = 128ull << 20;

// Runs `strata train --config <config> --quiet [more...]`; returns the exit code and the child's peak RSS in
// bytes.
std::pair<int, uint64_t> run_strata(const std::string& config, const std::vector<std::string>& more = {}) {
  const std::string binary = STRATA_BINARY;
  std::vector<std::string> args = {binary, "train", "--config", config, "--quiet"};
  args.insert(args.end(), more.begin(), more.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, binary.c_str(), nullptr, nullptr, argv.data(), environ) != 0) return {-1, 0};
  int status = 0;
  struct rusage ru {};
  if (wait4(pid, &status, 0, &ru) != pid) return {-1, 0};
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, static_cast<uint64_t>(ru.ru_maxrss) * 1024};
}

TEST_F(TrainerTest, PeakRssStaysWithinTheHostAndDeviceBudgets) {
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer holds freed blocks in a quarantine (256 MiB by default) that a plain build does not have,
  // and it grows with what the run frees: the children run with none, so the bound measures Strata's memory.
  const char* asan = std::getenv("ASAN_OPTIONS");
  ::setenv("ASAN_OPTIONS", (std::string(asan != nullptr ? asan : "") + ":quarantine_size_mb=0").c_str(), 1);
#endif
  // The process's own footprint: the same binary training a one-block, width-16 model.
  json tiny = base_config("tiny");
  tiny["model"] = {{"n_layer", 1}, {"n_head", 1}, {"n_embd", 16}, {"vocab_size", kVocab}, {"block_size", 16}};
  tiny["training"]["max_steps"] = 2;
  std::ofstream((dir_ / "tiny.json").string()) << tiny.dump(2);
  const auto [tiny_code, baseline] = run_strata((dir_ / "tiny.json").string());
  ASSERT_EQ(tiny_code, 0);

  // 8 blocks of width 768 and a vocabulary of 16384: 69M parameters, 20 bytes each of training state
  // (parameters, gradients, fp32 master, two moments) = 1.4 GB, against 384 MiB of host budget and 192 MiB of
  // device budget (which holds the 50 MB embedding unit's parameters and gradient while it is used).
  constexpr uint64_t kHost = 384ull << 20, kDevice = 192ull << 20;
  json j = base_config("rss");
  j["model"] = {{"n_layer", 8}, {"n_head", 8}, {"n_embd", 768}, {"vocab_size", 16384}, {"block_size", 16}};
  j["training"]["max_steps"] = 2;
  j["training"]["val_every"] = 0;
  j["zero_optimization"] = {
      {"stage", 3},
      {"offload_param", {{"device", "nvme"}, {"nvme_path", (dir_ / "swap").string()}, {"buffer_count", 2}}},
      {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", (dir_ / "swap").string()}}},
      {"sub_group_size", 2'000'000},
      {"stage3_max_live_parameters", 8'000'000},
      {"stage3_prefetch_bucket_size", 8'000'000}};
  j["memory"] = {{"host_memory_limit", kHost}, {"device_memory_limit", kDevice}};
  const std::string config = (dir_ / "rss.json").string();
  std::ofstream(config) << j.dump(2);

  const auto [code, peak] = run_strata(config);
  ASSERT_EQ(code, 0) << "strata train failed; run it by hand: " << STRATA_BINARY << " train --config " << config;
  const uint64_t bound = baseline + kHost + kDevice + kTransientMargin;
  std::printf("peak RSS %.1f MiB; bound %.1f MiB (process %.0f + host %.0f + device %.0f + margin %.0f); training "
              "state %.0f MiB\n",
              peak / 1048576.0, bound / 1048576.0, baseline / 1048576.0, kHost / 1048576.0, kDevice / 1048576.0,
              kTransientMargin / 1048576.0, 69.3e6 * 20 / 1048576.0);
  EXPECT_LE(peak, bound);
  EXPECT_TRUE(fs::exists(dir_ / "rss" / "step_000002" / "model.safetensors"));

  // Resuming reads the checkpoint (277 MB of weights and 555 MB of moments, more than the bound) a sub-group at
  // a time, without keeping the files' pages: one more step stays within the same bound.
  const auto [resumed_code, resumed_peak] = run_strata(config, {"--resume", "--max-steps", "3"});
  ASSERT_EQ(resumed_code, 0) << "strata train --resume failed; run it by hand: " << STRATA_BINARY
                             << " train --config " << config << " --resume --max-steps 3";
  std::printf("resumed: peak RSS %.1f MiB\n", resumed_peak / 1048576.0);
  EXPECT_LE(resumed_peak, bound);
  EXPECT_TRUE(fs::exists(dir_ / "rss" / "step_000003" / "model.safetensors"));
}

}  // namespace
}  // namespace strata::engine
