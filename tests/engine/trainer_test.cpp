// End-to-end training runs on tiny random shards: determinism, resume, gradient accumulation, and the clear
// errors bad input must give.
#include "engine/trainer.h"

#include <filesystem>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>

#include "common/rng.h"
#include "engine/config.h"
#include "storage/safetensors.h"
#include "storage/token_shard.h"

namespace strata::engine {
namespace {

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
  Result<TrainSummary> train(const json& j, const std::string& resume = "", const std::string& metrics = "") {
    auto c = parse_run_config(j, "test");
    if (!c.is_ok()) return c.status();
    TrainOptions o;
    o.progress = false;
    o.resume = resume;
    o.metrics_path = metrics;
    return run_training(c.value(), o);
  }
  static std::vector<char> file_bytes(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) ADD_FAILURE() << "cannot open " << p;  // two missing files must not compare equal silently
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  fs::path dir_;
};

TEST_F(TrainerTest, LossFallsAndRunsAreBitwiseDeterministic) {
  auto a = train(base_config("a"), "", (dir_ / "metrics.jsonl").string());
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  auto b = train(base_config("b"));
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(a->steps, 6);
  EXPECT_EQ(a->last_loss, b->last_loss);
  EXPECT_GE(a->val_loss, 0.0f);
  EXPECT_EQ(file_bytes(dir_ / "a" / "step_000006" / "model.safetensors"),
            file_bytes(dir_ / "b" / "step_000006" / "model.safetensors"));
  // The metrics file has one JSON object per step with the promised fields, and the loss fell.
  std::ifstream in(dir_ / "metrics.jsonl");
  std::string line;
  std::vector<json> rows;
  while (std::getline(in, line)) rows.push_back(json::parse(line));
  ASSERT_EQ(rows.size(), 6u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms"})
    EXPECT_TRUE(rows[0].contains(key)) << key;
  EXPECT_TRUE(rows[2].contains("val_loss"));
  EXPECT_LT(rows.back()["loss"].get<double>(), rows.front()["loss"].get<double>());
}

TEST_F(TrainerTest, ResumeGivesTheSameWeightsAsAStraightRun) {
  json straight = base_config("straight");
  straight["training"]["checkpoint_every"] = 3;
  ASSERT_TRUE(train(straight).is_ok());
  ASSERT_TRUE(fs::exists(dir_ / "straight" / "step_000003" / "state.json"));
  // Continue from step 3 into another folder.
  json resumed = base_config("resumed");
  auto r = train(resumed, (dir_ / "straight" / "step_000003").string());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->steps, 3);
  EXPECT_EQ(file_bytes(dir_ / "straight" / "step_000006" / "model.safetensors"),
            file_bytes(dir_ / "resumed" / "step_000006" / "model.safetensors"));
  EXPECT_EQ(file_bytes(dir_ / "straight" / "step_000006" / "optimizer.safetensors"),
            file_bytes(dir_ / "resumed" / "step_000006" / "optimizer.safetensors"));
  // `latest` points at the newest complete checkpoint, and no temporary folder is left behind.
  std::ifstream latest(dir_ / "resumed" / "latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step_000006");
  for (const auto& e : fs::directory_iterator(dir_ / "resumed"))
    EXPECT_FALSE(e.path().string().ends_with(".tmp")) << e.path();
}

TEST_F(TrainerTest, GradientAccumulationMatchesOneLargeBatch) {
  json big = base_config("big");
  big["training"]["batch_size"] = 4;
  big["training"]["max_steps"] = 3;
  json accum = base_config("accum");
  accum["training"]["batch_size"] = 2;
  accum["training"]["grad_accum_steps"] = 2;
  accum["training"]["max_steps"] = 3;
  auto a = train(big);
  auto b = train(accum);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  // The same tokens in the same windows; only the summation order of gradients differs.
  EXPECT_NEAR(a->last_loss, b->last_loss, 1e-5);
}

TEST_F(TrainerTest, BadInputGivesAClearError) {
  auto expect_error = [&](json j, StatusCode code, const std::vector<std::string>& needles) {
    auto r = train(j);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), code) << r.status().to_string();
    for (const auto& n : needles) EXPECT_NE(r.status().message().find(n), std::string::npos) << r.status().to_string();
  };
  json missing = base_config("m");
  missing["data"]["train"] = (dir_ / "data" / "nope.bin").string();
  expect_error(missing, StatusCode::kNotFound, {"data.train", "nope.bin"});

  // A shard with a bad magic number.
  {
    std::ofstream out(dir_ / "data" / "bad_magic.bin", std::ios::binary);
    std::vector<int32_t> h(256, 0);
    h[0] = 1234;
    h[1] = 1;
    out.write(reinterpret_cast<const char*>(h.data()), 1024);
  }
  json bad = base_config("m");
  bad["data"]["train"] = (dir_ / "data" / "bad_magic.bin").string();
  expect_error(bad, StatusCode::kCorruption, {"data.train", "bad_magic.bin"});

  // Tokens outside the model's vocabulary.
  json small_vocab = base_config("m");
  small_vocab["model"]["vocab_size"] = 50;
  expect_error(small_vocab, StatusCode::kCorruption, {"t_train_000000.bin"});

  // A checkpoint folder that cannot be created (its parent is a file).
  { std::ofstream(dir_ / "a_file") << "x"; }
  json unwritable = base_config("m");
  unwritable["training"]["checkpoint_dir"] = (dir_ / "a_file" / "ckpt").string();
  expect_error(unwritable, StatusCode::kIOError, {"training.checkpoint_dir", "a_file"});

  // Resuming from something that is not a checkpoint.
  auto r = train(base_config("m"), (dir_ / "data").string());
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("not a checkpoint"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace strata::engine
