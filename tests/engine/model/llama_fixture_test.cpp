// llama_fixture_test.cpp — the Llama family's golden fixtures (scripts/make_llama_fixture.py,
// tests/fixtures/llama/) as Strata's readers see them: each model folder is a Hugging Face checkpoint whose
// config.json, sharded safetensors and index agree — every tensor transformers names for that config, in the
// shard the index says, at the shape the config gives, and nothing else — and golden.safetensors holds the
// batch, the logits, the loss, one gradient per weight at its weight's shape, and the steps' losses. What the
// family's golden test (to come with the model) reads, checked here so that a regenerated fixture that drifts
// from transformers' names or shapes fails before that.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "storage/safetensors.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using Shape = std::vector<int64_t>;

std::string fixture(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/llama/" + name;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

// The tensors transformers' LlamaForCausalLM / Qwen3ForCausalLM have for config `c`, by name, with their shapes.
std::map<std::string, Shape> expected_tensors(const nlohmann::json& c) {
  const int64_t C = c["hidden_size"], F = c["intermediate_size"], L = c["num_hidden_layers"];
  const int64_t NH = c["num_attention_heads"], NKV = c["num_key_value_heads"], V = c["vocab_size"];
  const int64_t hs = c.value("head_dim", C / NH);
  const bool qwen3 = c["model_type"] == "qwen3", bias = c.value("attention_bias", false);
  std::map<std::string, Shape> t = {{"model.embed_tokens.weight", {V, C}}, {"model.norm.weight", {C}}};
  if (!c["tie_word_embeddings"].get<bool>()) t["lm_head.weight"] = {V, C};
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    t[p + "input_layernorm.weight"] = {C};
    t[p + "post_attention_layernorm.weight"] = {C};
    t[p + "self_attn.q_proj.weight"] = {NH * hs, C};
    t[p + "self_attn.k_proj.weight"] = {NKV * hs, C};
    t[p + "self_attn.v_proj.weight"] = {NKV * hs, C};
    t[p + "self_attn.o_proj.weight"] = {C, NH * hs};
    if (bias) {  // Llama's and Qwen3's attention_bias: q, k, v and o
      t[p + "self_attn.q_proj.bias"] = {NH * hs};
      t[p + "self_attn.k_proj.bias"] = {NKV * hs};
      t[p + "self_attn.v_proj.bias"] = {NKV * hs};
      t[p + "self_attn.o_proj.bias"] = {C};
    }
    if (qwen3) {
      t[p + "self_attn.q_norm.weight"] = {hs};
      t[p + "self_attn.k_norm.weight"] = {hs};
    }
    t[p + "mlp.gate_proj.weight"] = {F, C};
    t[p + "mlp.up_proj.weight"] = {F, C};
    t[p + "mlp.down_proj.weight"] = {C, F};
  }
  return t;
}

class LlamaFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaFixtureTest, TheCheckpointHasTransformersTensorsInTheShardsItsIndexNames) {
  const std::string dir = fixture(GetParam());
  const nlohmann::json config = read_json(dir + "/config.json");
  const nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
  std::map<std::string, Shape> want = expected_tensors(config);
  ASSERT_EQ(index["weight_map"].size(), want.size()) << dir << ": the index names another set of tensors";
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, shard] : index["weight_map"].items()) by_shard[shard].push_back(name);
  EXPECT_EQ(by_shard.size(), 2u) << "the fixture is sharded in two";
  int64_t total = 0;
  for (const auto& [shard, names] : by_shard) {
    auto f = SafetensorsFile::open(dir + "/" + shard);
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    EXPECT_EQ(f->tensors().size(), names.size()) << shard << " holds tensors its index does not name";
    for (const std::string& name : names) {
      ASSERT_TRUE(want.count(name)) << name << " is not a tensor of this config";
      std::vector<float> v(static_cast<size_t>(f->find(name) != nullptr ? f->find(name)->numel() : 0));
      ASSERT_OK(f->read_into(name, DType::kF32, want[name], v.data()));
      for (float x : v) ASSERT_TRUE(std::isfinite(x)) << name;
      total += static_cast<int64_t>(v.size() * sizeof(float));
    }
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
}

TEST_P(LlamaFixtureTest, TheGoldenFileHasTheBatchTheOutputsAndAGradientPerWeight) {
  const std::string dir = fixture(GetParam());
  const nlohmann::json config = read_json(dir + "/config.json");
  auto g = SafetensorsFile::open(dir + "/golden.safetensors");
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  const int64_t V = config["vocab_size"];
  const SafetensorsEntry* inputs = g->find("inputs");
  ASSERT_NE(inputs, nullptr);
  ASSERT_EQ(inputs->shape.size(), 2u);
  const int64_t B = inputs->shape[0], T = inputs->shape[1];
  EXPECT_LE(T, config["max_position_embeddings"].get<int64_t>());
  for (const char* name : {"inputs", "targets"}) {
    std::vector<float> ids(static_cast<size_t>(B * T));
    ASSERT_OK(g->read_into(name, DType::kF32, Shape{B, T}, ids.data()));
    for (float id : ids) ASSERT_TRUE(id >= 0 && id < V && id == std::floor(id)) << name << " holds " << id;
  }
  std::vector<float> logits(static_cast<size_t>(B * T * V)), loss(1);
  ASSERT_OK(g->read_into("logits", DType::kF32, Shape{B, T, V}, logits.data()));
  ASSERT_OK(g->read_into("loss", DType::kF32, Shape{1}, loss.data()));
  EXPECT_NEAR(loss[0], std::log(static_cast<double>(V)), 0.5) << "a freshly initialised model's loss is near ln V";
  const int steps = std::stoi(g->metadata().at("n_steps"));
  std::vector<float> losses(static_cast<size_t>(steps));
  ASSERT_OK(g->read_into("losses", DType::kF32, Shape{steps}, losses.data()));
  EXPECT_EQ(losses[0], loss[0]) << "step 0's loss is the forward's";
  EXPECT_LT(losses.back(), losses[0]) << "ten AdamW steps on one batch lower its loss";
  for (const auto& [name, shape] : expected_tensors(config)) {
    const SafetensorsEntry* e = g->find("grad." + name);
    ASSERT_NE(e, nullptr) << "no gradient of " << name;
    EXPECT_EQ(e->shape, shape) << "grad." << name;
  }
  for (const char* key : {"lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip"})
    EXPECT_TRUE(g->metadata().count(key)) << key;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaFixtureTest, ::testing::Values("llama_tied_gqa", "qwen3_untied"));

}  // namespace
}  // namespace strata
