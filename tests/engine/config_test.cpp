#include "engine/config.h"

#include <gtest/gtest.h>

namespace strata::engine {
namespace {

using nlohmann::json;

TEST(ConfigTest, DefaultsParseAndOverridesApply) {
  json j = {{"model", {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}, {"vocab_size", 97}, {"block_size", 16}}},
            {"training", {{"seq_len", 16}}}};
  ASSERT_TRUE(apply_overrides(&j, {"training.lr=1e-3", "training.checkpoint_dir=runs/x", "compute.kernels=\"reference\""})
                  .is_ok());
  auto c = parse_run_config(j, "cfg.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->training.lr, 1e-3);
  EXPECT_EQ(c->training.checkpoint_dir, "runs/x");
  EXPECT_EQ(c->compute.kernels, "reference");
  EXPECT_EQ(c->model.n_layer, 2);
}

TEST(ConfigTest, UnknownKeyListsTheValidKeys) {
  json j = {{"training", {{"learning_rate", 1e-3}}}};
  auto c = parse_run_config(j, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  const std::string msg = c.status().message();
  EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'learning_rate'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lr"), std::string::npos) << msg;
  EXPECT_NE(msg.find("warmup_steps"), std::string::npos) << msg;

  auto top = parse_run_config(json{{"modle", json::object()}}, "cfg.json");
  ASSERT_FALSE(top.is_ok());
  EXPECT_NE(top.status().message().find("'modle'"), std::string::npos) << top.status().message();
}

TEST(ConfigTest, WrongTypeNamesTheField) {
  auto c = parse_run_config(json{{"model", {{"n_layer", "six"}}}}, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("model.n_layer"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("integer"), std::string::npos) << c.status().message();
}

TEST(ConfigTest, ContextLongerThanTheModelIsRejected) {
  auto c = parse_run_config(json{{"model", {{"block_size", 64}}}, {"training", {{"seq_len", 128}}}}, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("training.seq_len"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("block_size"), std::string::npos) << c.status().message();
}

TEST(ConfigTest, BadValuesAreRejectedByName) {
  for (const auto& [over, field] : std::vector<std::pair<std::string, std::string>>{
           {"model.n_head=5", "n_head"},
           {"compute.matmul_precision=\"fp8\"", "matmul_precision"},
           {"compute.kernels=\"gpu\"", "compute.kernels"},
           {"training.beta2=1.5", "beta2"},
           {"training.batch_size=0", "batch_size"}}) {
    json j = json::object();
    ASSERT_TRUE(apply_overrides(&j, {over}).is_ok());
    auto c = parse_run_config(j, "cfg.json");
    ASSERT_FALSE(c.is_ok()) << over;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << over << ": " << c.status().message();
  }
  json j = json::object();
  EXPECT_FALSE(apply_overrides(&j, {"no_equals_sign"}).is_ok());
}

}  // namespace
}  // namespace strata::engine
