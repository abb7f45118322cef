// The Llama family's golden test, llm.c-style: the two models of scripts/make_llama_fixture.py, built in plain
// PyTorch from transformers' modeling code (a tied GQA Llama with llama3 RoPE scaling; an untied Qwen3 with q/k/v/o
// biases, QK-norm and head_dim apart from hidden/heads), read from their Hugging Face folders (config.json through
// read_hf_llama_config, sharded safetensors), against ours: logits, loss, every gradient, and ten AdamW steps with
// clipping, on every CPU kernel set.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model/llama/llama.h"
#include "engine/optim/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "storage/safetensors.h"
#include "storage/safetensors_shards.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

std::string fixture(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/llama/" + name;
}

// The tensor `name` of `file` as fp32, at the shape given.
std::vector<float> read_tensor(const SafetensorsFile& file, const std::string& name, std::span<const int64_t> shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  std::vector<float> v(n);
  const Status read = file.read_into(name, DType::kF32, shape, v.data());
  EXPECT_TRUE(read.is_ok()) << read.to_string();
  return v;
}

float metadata_float(const SafetensorsFile& f, const char* key) { return std::stof(f.metadata().at(key)); }

class LlamaGoldenTest : public ::testing::TestWithParam<std::tuple<const char*, const char*>> {
 protected:
  void SetUp() override {
    const auto [name, kernel_set] = GetParam();
    dir_ = fixture(name);
    ASSERT_OK_AND_ASSIGN(config_, read_hf_llama_config(dir_));
    const kernels::KernelSet* k = kernels::find_kernel_set(kernel_set);
    ASSERT_NE(k, nullptr);
    ASSERT_OK_AND_ASSIGN(model_, Llama::create(config_, *k, kernels::MatmulPrecision::kF32));
    // The checkpoint's tensors by transformers' names, which are the units' own.
    ASSERT_OK_AND_ASSIGN(SafetensorsShards weights, SafetensorsShards::open(dir_));
    size_t tensors = 0;
    for (Unit& u : model_->units()) {
      for (const TensorSpec& s : u.layout.specs()) {
        const SafetensorsEntry* e = weights.find(s.name);
        ASSERT_NE(e, nullptr) << s.name << " is not in " << dir_;
        const std::vector<float> v = read_tensor(weights.file_of(*e), s.name, s.shape);
        std::copy(v.begin(), v.end(), u.p_for_update() + s.offset);
        ++tensors;
      }
    }
    ASSERT_EQ(tensors, weights.names().size()) << "the checkpoint has tensors the model does not";
    ASSERT_OK_AND_ASSIGN(SafetensorsFile golden, SafetensorsFile::open(dir_ + "/golden.safetensors"));
    const SafetensorsEntry* inputs = golden.find("inputs");
    ASSERT_NE(inputs, nullptr);
    B_ = static_cast<int>(inputs->shape[0]);
    T_ = static_cast<int>(inputs->shape[1]);
    for (const char* ids : {"inputs", "targets"}) {
      const std::vector<float> f = read_tensor(golden, ids, inputs->shape);
      std::vector<int32_t>& out = ids[0] == 'i' ? x_ : y_;
      for (float v : f) out.push_back(static_cast<int32_t>(v));
    }
    logits_ = read_tensor(golden, "logits", std::vector<int64_t>{B_, T_, config_.vocab_size});
    loss_ = read_tensor(golden, "loss", std::vector<int64_t>{1})[0];
    n_steps_ = std::stoi(golden.metadata().at("n_steps"));
    losses_ = read_tensor(golden, "losses", std::vector<int64_t>{n_steps_});
    adamw_.beta1 = metadata_float(golden, "beta1");
    adamw_.beta2 = metadata_float(golden, "beta2");
    adamw_.eps = metadata_float(golden, "eps");
    adamw_.weight_decay = metadata_float(golden, "weight_decay");
    adamw_.grad_clip = metadata_float(golden, "grad_clip");
    lr_ = metadata_float(golden, "lr");
    golden_ = std::make_unique<SafetensorsFile>(std::move(golden));
  }

  std::string dir_;
  LlamaConfig config_;
  std::unique_ptr<Llama> model_;
  std::unique_ptr<SafetensorsFile> golden_;
  int B_ = 0, T_ = 0, n_steps_ = 0;
  std::vector<int32_t> x_, y_;
  std::vector<float> logits_, losses_;
  float loss_ = 0, lr_ = 0;
  AdamWConfig adamw_;
};

// Tolerances as GPT-2's golden test (gpt2_golden_test.cpp): both sides fp32, summed in different orders.
TEST_P(LlamaGoldenTest, LogitsLossAndGradientsMatchPyTorch) {
  ASSERT_OK_AND_ASSIGN(float loss, model_->forward(x_.data(), y_.data(), B_, T_));
  EXPECT_TRUE(testing::all_close(model_->logits(), logits_.data(), logits_.size(), 1e-4, 0, "logits"));
  EXPECT_NEAR(loss, loss_, 1e-5) << "loss";
  ASSERT_OK(model_->zero_grads());
  ASSERT_OK(model_->backward());
  for (const Unit& u : model_->units()) {
    for (const TensorSpec& s : u.layout.specs()) {
      const std::vector<float> want = read_tensor(*golden_, "grad." + s.name, s.shape);
      EXPECT_TRUE(testing::all_close(u.g() + s.offset, want.data(), s.numel(), 2e-5, 1e-3, "grad " + s.name));
    }
  }
}

TEST_P(LlamaGoldenTest, TenAdamWStepsMatchPyTorch) {
  ASSERT_OK_AND_ASSIGN(auto opt, AdamW::create(model_->units(), adamw_, model_->device()));
  std::vector<float> losses;
  for (int s = 0; s < n_steps_; ++s) {
    ASSERT_OK(model_->zero_grads());
    ASSERT_OK_AND_ASSIGN(float loss, model_->forward(x_.data(), y_.data(), B_, T_));
    ASSERT_OK(model_->backward());
    opt.step(model_->units(), lr_);
    losses.push_back(loss);
  }
  EXPECT_TRUE(testing::all_close(losses, losses_, 1e-4, 0, "losses of 10 AdamW steps"));
  EXPECT_LT(losses.back(), losses.front()) << "training did not reduce the loss";
}

INSTANTIATE_TEST_SUITE_P(FixturesAndKernels, LlamaGoldenTest,
                         ::testing::Combine(::testing::Values("llama_tied_gqa", "qwen3_untied"),
                                            ::testing::Values("reference", "fast")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

// The config.json reader: transformers' keys and defaults, and the settings Strata does not compute refused by
// name.
TEST(LlamaConfigTest, ReadsTheFixturesConfigJson) {
  ASSERT_OK_AND_ASSIGN(LlamaConfig tied, read_hf_llama_config(fixture("llama_tied_gqa")));
  EXPECT_EQ(tied.model_type, "llama");
  EXPECT_EQ(tied.num_key_value_heads, 2);
  EXPECT_TRUE(tied.tie_word_embeddings);
  EXPECT_EQ(tied.rope_scaling.rope_type, "llama3");
  EXPECT_EQ(tied.rope_scaling.original_max_position_embeddings, 16);
  ASSERT_OK_AND_ASSIGN(LlamaConfig qwen, read_hf_llama_config(fixture("qwen3_untied") + "/config.json"));
  EXPECT_TRUE(qwen.qk_norm());
  EXPECT_TRUE(qwen.qkv_bias() && qwen.o_bias());
  EXPECT_EQ(qwen.head_size(), 24);
  EXPECT_EQ(qwen.hidden_size, 48);
}

TEST(LlamaConfigTest, RefusesWhatItDoesNotComputeNamingTheKey) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("strata_llama_config_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& text) {
    std::ofstream(dir / "config.json") << text;
    return read_hf_llama_config(dir.string()).status();
  };
  const std::string base = R"("hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32)";
  EXPECT_TRUE(write("{\"model_type\": \"llama\", " + base + "}").is_ok());
  const Status act = write("{\"model_type\": \"llama\", \"hidden_act\": \"gelu\", " + base + "}");
  EXPECT_NE(act.message().find("hidden_act"), std::string::npos) << act.to_string();
  const Status type = write("{\"model_type\": \"gemma\", " + base + "}");
  EXPECT_NE(type.message().find("gemma"), std::string::npos) << type.to_string();
  const Status heads = write(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 100,
      "max_position_embeddings": 32})");
  EXPECT_NE(heads.message().find("num_key_value_heads"), std::string::npos) << heads.to_string();
  const Status rope = write("{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}, " +
                            base + "}");
  EXPECT_NE(rope.message().find("yarn"), std::string::npos) << rope.to_string();
  EXPECT_FALSE(write("{" + base + "}").is_ok()) << "a config.json without model_type";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::engine
