// trainer_fixture.h — tiny random token shards and a tiny model config for end-to-end training tests: GPT-2's, or
// (family_, for the tests parameterised on the family: kFamilies) a Llama 3-style one (tied, grouped-query
// attention, llama3 RoPE scaling) or a Qwen3-style one (untied, q/k/v/o biases, QK-norm, head_dim apart from
// hidden/heads).
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

// The families and variants the family-parameterised tests run over.
inline constexpr const char* kFamilies[] = {"gpt2", "llama", "qwen3"};

// A tiny model section of `family` (kFamilies) with `layers` blocks, context 16, vocabulary kVocab; each family's
// blocks about as large as GPT-2's (12.7K parameters), so the offload tests' sub-group sizes, live-parameter caps
// and persistence thresholds cut them alike.
inline json tiny_model_section(const std::string& family, int layers) {
  if (family == "gpt2")
    return {{"n_layer", layers}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", kVocab}, {"block_size", 16}};
  json m = {{"family", "llama"}, {"hidden_size", 32}, {"num_hidden_layers", layers}, {"num_attention_heads", 4},
            {"num_key_value_heads", 2}, {"vocab_size", kVocab}, {"max_position_embeddings", 16}};
  if (family == "llama") {
    m.update({{"model_type", "llama"}, {"intermediate_size", 96},  // 12.4K a block {"rope_theta", 500000.0},
              {"tie_word_embeddings", true},
              {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8}}}});
  } else {
    EXPECT_EQ(family, "qwen3");
    m.update({{"model_type", "qwen3"}, {"intermediate_size", 80}, {"head_dim", 12},  // 12.5K a block {"rms_norm_eps", 1e-6},
              {"attention_bias", true}, {"tie_word_embeddings", false}});
  }
  return m;
}
// Sets the blocks of a model section of any family.
inline void set_layers(json& j, int layers) {
  j["model"][j["model"].contains("family") ? "num_hidden_layers" : "n_layer"] = layers;
}

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
    return json{{"model", tiny_model_section(family_, 2)},
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
  std::string family_ = "gpt2";  // base_config's model (kFamilies)
  kernels::Device* device_ = nullptr;  // train() trains on this device when set (else compute.device's)
  comm::DevicePlaneFactory device_plane_;    // and makes the groups' device planes with this when set
  std::function<float(int)> gradient_factor_;  // TrainOptions::gradient_factor of train()'s runs
};

// TrainerTest over the families (kFamilies).
class FamilyTrainerTest : public TrainerTest, public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    family_ = GetParam();
    TrainerTest::SetUp();
  }
};

}  // namespace strata::engine
