// trainer_fixture.h — tiny random token shards and a tiny GPT-2 config for end-to-end training tests.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/rng.h"
#include "engine/train/config.h"
#include "engine/train/trainer.h"
#include "storage/token_shard.h"

namespace strata::engine {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kVocab = 97;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_trainer_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "data");
    // Tokens with structure (a noisy repeating pattern) so the loss can fall.
    Rng rng(7);
    auto make = [&](const std::string& name, size_t n) {
      std::vector<uint16_t> t(n);
      for (size_t i = 0; i < n; ++i) t[i] = rng.uniform() < 0.8 ? static_cast<uint16_t>((i * 7) % kVocab)
                                                               : static_cast<uint16_t>(rng.below(kVocab));
      ASSERT_TRUE(write_token_shard((dir_ / "data" / name).string(), t.data(), n).is_ok());
    };
    make("t_train_000000.bin", 3000);
    make("t_train_000001.bin", 2000);
    make("t_val_000000.bin", 1000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  json base_config(const std::string& ckpt) const {
    return json{{"model", {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", kVocab}, {"block_size", 16}}},
                {"data", {{"train", (dir_ / "data" / "t_train_*.bin").string()},
                          {"val", (dir_ / "data" / "t_val_000000.bin").string()}}},
                {"training", {{"batch_size", 2}, {"seq_len", 16}, {"max_steps", 6}, {"lr", 3e-3}, {"warmup_steps", 2},
                              {"val_every", 3}, {"val_batches", 2}, {"checkpoint_dir", (dir_ / ckpt).string()},
                              {"keep_checkpoints", 0}, {"seed", 5}}}};
  }
  Result<TrainSummary> train(const json& j, const std::string& resume = "", const std::string& metrics = "",
                             comm::Communicator* data_parallel = nullptr, comm::Communicator* pipeline = nullptr,
                             comm::Communicator* tensor_parallel = nullptr) {
    auto c = parse_run_config(j, "test");
    if (!c.is_ok()) return c.status();
    TrainOptions o;
    o.progress = false;
    o.resume = resume;
    o.metrics_path = metrics;
    o.data_parallel = data_parallel;
    o.pipeline = pipeline;
    o.tensor_parallel = tensor_parallel;
    o.device = device_;
    o.device_plane = device_plane_;
    o.gradient_factor = gradient_factor_;
    return run_training(c.value(), o);
  }
  // Loss and grad_norm of every training step, in order, from a metrics file.
  static std::vector<std::pair<double, double>> losses(const fs::path& metrics) {
    std::ifstream in(metrics);
    std::vector<std::pair<double, double>> out;
    for (std::string line; std::getline(in, line);) {
      const json m = json::parse(line);
      if (!m.contains("loss")) continue;  // step 0 of a fine-tune: validation only
      out.emplace_back(m.at("loss").get<double>(), m.at("grad_norm").get<double>());
    }
    return out;
  }
  // Every line of a metrics file, parsed; one empty object for a missing or empty file, so that checks of its
  // first or last line fail instead of the test binary.
  static std::vector<json> metrics_lines(const fs::path& metrics) {
    std::vector<json> out;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
    if (out.empty()) out.push_back(json::object());
    return out;
  }
  static std::vector<char> file_bytes(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) ADD_FAILURE() << "cannot open " << p;  // two missing files must not compare equal silently
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  fs::path dir_;
  kernels::Device* device_ = nullptr;  // train() trains on this device when set (else compute.device's)
  comm::DevicePlaneFactory device_plane_;    // and makes the groups' device planes with this when set
  std::function<float(int)> gradient_factor_;  // TrainOptions::gradient_factor of train()'s runs
};

}  // namespace strata::engine
