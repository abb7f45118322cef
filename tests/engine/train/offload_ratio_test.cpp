// offload_ratio_test.cpp — offload_optimizer.ratio: the model's first units kept whole on the device while the rest
// of the optimizer state is offloaded, against the plain run (engine/train/offload_runtime.h units_kept_on_device).
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model/gpt2/gpt2.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/engine/offload_train_fixture.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

// offload_optimizer.ratio: the model's first units stay whole on the device (parameters, gradients, Adam's
// moments), updated there by step(), and the rest are offloaded as before. Bitwise the plain run in every loss,
// norm, weight and moment (the checkpoints hold the kept units' state too): the optimizer in host memory or on
// NVMe, the parameters offloaded, updates started during the backward into spares under a clip that some steps
// cross, gradient accumulation; and resumed from a checkpoint. Only the offloaded units' gradients go home.
TEST_F(OffloadTrainTest, UnitsKeptOnTheDeviceByRatioTrainAsThePlainRun) {
  // The test model: the embedding (97 x 32 + 16 x 32), 4 blocks of 12704, ln_f 64.
  constexpr double kEmbedding = 3616, kBlock = 12704, kAll = kEmbedding + 4 * kBlock + 64;
  struct Variant {
    const char* name;
    json zero;
    int accum;
    bool clip;
    double kept;  // elements kept on the device
  };
  const Variant variants[] = {
      {"ratio_cpu", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.6}}}}, 1, false,
       kEmbedding + kBlock},
      {"ratio_nvme",
       {{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}, {"ratio", 0.3}}}, {"sub_group_size", 5000}}, 1,
       false, kEmbedding + 2 * kBlock},
      {"ratio_nvme_clip",  // clipping: after a clipped step the update reads ahead, gated
       {{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}, {"ratio", 0.6}}}, {"sub_group_size", 5000}}, 2,
       true, kEmbedding + kBlock},
      {"ratio_params_cpu_spares",
       {{"stage", 3},
        {"offload_param", {{"device", "cpu"}}},
        {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}, {"speculative_sub_groups", 8}}},
        {"stage3_param_persistence_threshold", 0},
        {"sub_group_size", 3000}},
       2, true, kEmbedding + kBlock},
  };
  run("plain", config("plain", json()));
  json clipped = config("plain_clip", json(), 2);
  clipped["training"]["grad_clip"] = kClip;
  run("plain_clip", clipped);
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    json j = config(v.name, v.zero, v.accum);
    if (v.clip) j["training"]["grad_clip"] = kClip;
    run(v.name, j);
    expect_same_run(v.clip ? "plain_clip" : "plain", v.name, 6);
    // The offloaded units' gradients go home once a step (accumulated on the device; with the parameters offloaded,
    // once a micro-batch), the kept units' never.
    const json t = offload_totals(dir_ / (std::string(v.name) + ".jsonl"));
    ASSERT_TRUE(t.is_object()) << "no offload metrics";
    const int sends = v.zero.contains("offload_param") ? v.accum : 1;
    EXPECT_EQ(t["d2h_bytes"].get<double>(), 6 * sends * 4 * (kAll - v.kept));
    if (v.clip) {
      EXPECT_GT(t["early_start"].get<double>(), 0) << "no update started during the backward";
      if (v.zero.dump().find("nvme") != std::string::npos) {
        EXPECT_GT(t["early_reads"].get<double>(), 0) << "no gated update (reads ahead after a clipped step)";
      }
    }
  }
  // Resumed: at the same ratio, and from a run that offloaded everything (the checkpoint does not depend on it).
  for (const auto& [name, before, after] :
       {std::tuple{"resumed", variants[1].zero, variants[1].zero},
        std::tuple{"resumed_ratio_changed", json{{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}},
                   variants[0].zero}}) {
    SCOPED_TRACE(name);
    json first = config(name, before);
    first["training"]["max_steps"] = 3;
    run(std::string(name) + "_part1", first);
    run(name, config(name, after), (dir_ / name).string());
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(dir_ / "plain" / "step_000006" / f) == file_bytes(dir_ / name / "step_000006" / f))
          << f;
    }
  }
}

TEST_F(OffloadTrainTest, TheRatioTakesTheLongestRunOfFirstUnitsThatFits) {
  GPT2Config c;
  c.n_layer = 4;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = kVocab;
  c.block_size = 16;
  auto device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
  ASSERT_OK_AND_ASSIGN(auto model, GPT2::create(c, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true));
  auto kept = [&](double ratio) {
    std::vector<int> units;
    const std::vector<bool> k = units_kept_on_device(*model, ratio);
    for (size_t u = 0; u < k.size(); ++u)
      if (k[u]) units.push_back(static_cast<int>(u));
    return units;
  };
  EXPECT_EQ(kept(1.0), std::vector<int>{});
  EXPECT_EQ(kept(0.96), std::vector<int>{}) << "the embedding alone is 6.6% of the parameters";
  EXPECT_EQ(kept(0.9), (std::vector<int>{0}));
  EXPECT_EQ(kept(0.6), (std::vector<int>{0, 1}));
  EXPECT_EQ(kept(0.3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(kept(1e-9), (std::vector<int>{0, 1, 2, 3, 4})) << "all but ln_f's 64 of 54496";
  EXPECT_EQ(kept(1e-300), (std::vector<int>{0, 1, 2, 3, 4})) << "1 - ratio is 1: the last unit stays offloaded";
}

TEST_F(OffloadTrainTest, ARatioOutsideZeroToOneIsRefusedByName) {
  for (const double ratio : {0.0, -0.5, 1.5}) {
    json zero = {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", ratio}}}};
    auto r = train(config("bad", zero));
    ASSERT_FALSE(r.is_ok()) << ratio;
    EXPECT_NE(r.status().message().find("offload_optimizer.ratio"), std::string::npos) << r.status().to_string();
  }
}

}  // namespace
}  // namespace strata::engine
