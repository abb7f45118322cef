// offload_train_fixture.h — what the offloaded-training tests share (offload_train_test.cpp, offload_ratio_test.cpp):
// a trainer fixture for the 4-block test model with a zero_optimization section, the placements every offload
// test can run, and a clip the model's norms cross on some steps only.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/engine/trainer_fixture.h"
#include "tests/test_util.h"

namespace strata::engine {

struct Placement {
  const char* name;
  json zero;         // the zero_optimization section; nvme paths are filled in
  json checkpoints;  // the activation_checkpointing section (null: none)
  json memory = json();  // the memory section (null: none)
};

class OffloadTrainTest : public TrainerTest {
 protected:
  json config(const std::string& run, const json& zero, int accum = 1) const {
    json j = base_config(run);
    set_layers(j, 4);  // blocks whose inputs are checkpoints of other blocks
    j["training"]["grad_accum_steps"] = accum;
    j["training"]["val_every"] = 2;  // forward-only passes between steps: a prefix of the recorded trace
    if (!zero.is_null()) j["zero_optimization"] = fill_paths(zero);
    return j;
  }
  json config(const std::string& run, const Placement& p, int accum = 1) const {
    json j = config(run, p.zero, accum);
    if (!p.checkpoints.is_null()) j["activation_checkpointing"] = p.checkpoints;
    if (!p.memory.is_null()) j["memory"] = p.memory;
    return j;
  }
  json fill_paths(json zero) const {
    for (const char* t : {"offload_param", "offload_optimizer"}) {
      if (zero.contains(t) && zero[t].value("device", "") == "nvme") zero[t]["nvme_path"] = (dir_ / "swap").string();
    }
    return zero;
  }
  void expect_same_run(const std::string& want, const std::string& got, int step) const {
    const std::string dir = fmt::format("step_{:06d}", step);
    EXPECT_EQ(losses(dir_ / (want + ".jsonl")), losses(dir_ / (got + ".jsonl"))) << got << ": losses differ";
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const auto a = file_bytes(dir_ / want / dir / f);
      EXPECT_FALSE(a.empty());
      EXPECT_TRUE(a == file_bytes(dir_ / got / dir / f)) << got << ": " << f << " differs from " << want;
    }
  }
  // The offload counters of a run's metrics, summed over its steps.
  static json offload_totals(const fs::path& metrics) {
    std::ifstream in(metrics);
    json sum = json::object();
    for (std::string line; std::getline(in, line);) {
      const json m = json::parse(line);
      if (!m.contains("offload")) return json();
      for (const auto& [k, v] : m["offload"].items()) sum[k] = sum.value(k, 0.0) + v.get<double>();
    }
    return sum;
  }
  void run(const std::string& name, const json& j, const std::string& resume = "") {
    auto r = train(j, resume, (dir_ / (name + ".jsonl")).string());
    ASSERT_TRUE(r.is_ok()) << name << ": " << r.status().to_string();
  }
};

// The same, over the families (kFamilies): the tests the "bitwise the plain run" matrix runs on every family.
class FamilyOffloadTrainTest : public OffloadTrainTest, public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    family_ = GetParam();
    OffloadTrainTest::SetUp();
  }
};

inline constexpr double kClip = 1.7;  // crossed by some of the test model's steps, not all (checked)

inline std::vector<Placement> placements() {
  const json opt_cpu = {{"device", "cpu"}};
  const json opt_nvme = {{"device", "nvme"}};
  const json on_device = {{"enabled", true}}, on_host = {{"enabled", true}, {"cpu_checkpointing", true}};
  return {
      {"checkpoints_device", json(), on_device},
      {"checkpoints_host", json(), on_host},
      {"optimizer_cpu", {{"stage", 2}, {"offload_optimizer", opt_cpu}}, json()},
      {"optimizer_nvme", {{"stage", 2}, {"offload_optimizer", opt_nvme}, {"sub_group_size", 5000}}, json()},
      {"params_cpu",
       {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}, {"offload_optimizer", opt_cpu},
        {"stage3_param_persistence_threshold", 0}},
       json()},
      {"params_nvme_optimizer_nvme",
       {{"stage", 3}, {"offload_param", {{"device", "nvme"}, {"buffer_count", 2}}}, {"offload_optimizer", opt_nvme},
        {"stage3_param_persistence_threshold", 100}, {"sub_group_size", 3000},
        {"stage3_max_live_parameters", 20000}, {"stage3_prefetch_bucket_size", 15000}},
       on_host},
      {"gradients_nvme_optimizer_cpu",
       {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}, {"offload_optimizer", opt_cpu},
        {"stage3_param_persistence_threshold", 0}, {"sub_group_size", 3000}},
       json(), {{"gradients", "nvme"}}},
      {"gradients_nvme_optimizer_nvme",
       {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}, {"offload_optimizer", opt_nvme},
        {"stage3_param_persistence_threshold", 0}, {"sub_group_size", 3000}, {"stage3_max_live_parameters", 20000}},
       json(), {{"gradients", "nvme"}}},
  };
}

}  // namespace strata::engine
