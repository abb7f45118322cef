// End-to-end training runs on tiny random shards: determinism, resume, gradient accumulation, and the clear
// errors bad input must give.
#include "engine/train/trainer.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "engine/checkpoint/foreign_weights.h"
#include "engine/model/llama/llama.h"
#include "engine/train/config.h"
#include "storage/safetensors.h"
#include "storage/token_shard.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using ::strata::testing::expect_error;

TEST_P(FamilyTrainerTest, LossFallsAndRunsAreBitwiseDeterministic) {
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

TEST_P(FamilyTrainerTest, ResumeGivesTheSameWeightsAsAStraightRun) {
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
  // A new run in that folder would replace and prune its checkpoints: refused before anything is written,
  // unless asked for.
  const std::vector<char> before = file_bytes(dir_ / "resumed" / "step_000006" / "model.safetensors");
  auto again = train(resumed);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument) << again.status().to_string();
  EXPECT_NE(again.status().message().find("already holds checkpoints"), std::string::npos)
      << again.status().to_string();
  EXPECT_EQ(file_bytes(dir_ / "resumed" / "step_000006" / "model.safetensors"), before);
  resumed["training"]["overwrite_checkpoints"] = true;
  auto over = train(resumed);
  ASSERT_TRUE(over.is_ok()) << over.status().to_string();
  EXPECT_EQ(over->steps, 6);
}

// Fine-tuning from another project's weights: a run started from a model exported to Hugging Face's layout or
// to llm.c's (or from the step folder) trains bitwise as the run started from the model.safetensors they came
// from, and first measures the validation loss of the weights it starts from.
TEST_F(TrainerTest, AModelExportedToHuggingFaceOrLlmcStartsTheSameRun) {
  json first = base_config("first");
  first["training"]["max_steps"] = 2;
  ASSERT_TRUE(train(first, "", (dir_ / "first.jsonl").string()).is_ok());
  // The validation loss of the last step's weights, which each fine-tune below measures again at its step 0.
  const double first_val = metrics_lines(dir_ / "first.jsonl").back().value("val_loss", -1.0);
  ASSERT_GT(first_val, 0);
  const fs::path ours = dir_ / "first" / "step_000002" / "model.safetensors";
  ASSERT_TRUE(export_weights(ours.string(), WeightsFormat::kHuggingFace, (dir_ / "hf").string()).is_ok());
  ASSERT_TRUE(export_weights(ours.string(), WeightsFormat::kLlmc, (dir_ / "model.bin").string()).is_ok());
  std::vector<std::vector<std::pair<double, double>>> runs;
  for (const fs::path& from : {ours, dir_ / "hf" / "model.safetensors", dir_ / "model.bin", ours.parent_path()}) {
    const std::string name = "tune" + std::to_string(runs.size());
    json tune = base_config(name);
    tune["training"]["max_steps"] = 3;
    tune["training"]["init_from"] = from.string();
    auto r = train(tune, "", (dir_ / (name + ".jsonl")).string());
    ASSERT_TRUE(r.is_ok()) << from << ": " << r.status().to_string();
    runs.push_back(losses(dir_ / (name + ".jsonl")));
    const json step0 = metrics_lines(dir_ / (name + ".jsonl")).front();
    EXPECT_EQ(step0.value("step", -1), 0) << from;
    EXPECT_EQ(step0.value("val_loss", -1.0), first_val) << from;
  }
  ASSERT_EQ(runs[0].size(), 3u);
  EXPECT_EQ(runs[1], runs[0]);
  EXPECT_EQ(runs[2], runs[0]);
  EXPECT_EQ(runs[3], runs[0]);  // the step folder names its model.safetensors
  // No steps: the validation of the weights alone, and a checkpoint of them in our format.
  json eval = base_config("eval");
  eval["training"]["max_steps"] = 0;
  eval["training"]["init_from"] = (dir_ / "model.bin").string();
  ASSERT_TRUE(train(eval, "", (dir_ / "eval.jsonl").string()).is_ok());
  EXPECT_EQ(metrics_lines(dir_ / "eval.jsonl").front().value("val_loss", -1.0), first_val);
  EXPECT_EQ(file_bytes(dir_ / "eval" / "step_000000" / "model.safetensors"), file_bytes(ours));
}

// Fine-tuning a Llama-family model from a Hugging Face folder (config.json and sharded safetensors, the Qwen3
// fixture: untied, biased, QK-norm): its config.json fills the model section, the run measures the folder's
// weights at step 0, and it trains bitwise as the run started from the same weights in our format (the step-0
// checkpoint a run of no steps writes) with the whole model section written out. A section key that disagrees
// with config.json, and our file under another model section, are refused naming the key.
TEST_F(TrainerTest, AHuggingFaceLlamaFolderFillsTheModelSectionAndTrainsAsOurFile) {
  const std::string folder = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/llama/qwen3_untied";
  std::ifstream in(folder + "/config.json");
  const json hf = json::parse(in);
  json eval = base_config("eval");
  eval["model"] = {{"family", "llama"}};
  eval["training"]["max_steps"] = 0;
  eval["training"]["init_from"] = folder;
  ASSERT_OK(train(eval, "", (dir_ / "eval.jsonl").string()).status());
  const double folder_val = metrics_lines(dir_ / "eval.jsonl").front().value("val_loss", -1.0);
  ASSERT_GT(folder_val, 0);
  const fs::path ours = dir_ / "eval" / "step_000000" / "model.safetensors";

  json from_folder = eval;
  from_folder["training"]["max_steps"] = 3;
  from_folder["training"]["checkpoint_dir"] = (dir_ / "from_folder").string();
  ASSERT_OK(train(from_folder, "", (dir_ / "from_folder.jsonl").string()).status());
  json from_ours = from_folder;
  from_ours["training"]["checkpoint_dir"] = (dir_ / "from_ours").string();
  from_ours["training"]["init_from"] = ours.string();
  json model = {{"family", "llama"}};
  for (const char* key : {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                          "rope_theta", "tie_word_embeddings", "attention_bias"})
    model[key] = hf.at(key);
  from_ours["model"] = model;
  ASSERT_OK(train(from_ours, "", (dir_ / "from_ours.jsonl").string()).status());
  EXPECT_EQ(metrics_lines(dir_ / "from_ours.jsonl").front().value("val_loss", -1.0), folder_val);
  EXPECT_EQ(losses(dir_ / "from_folder.jsonl"), losses(dir_ / "from_ours.jsonl"));
  EXPECT_EQ(losses(dir_ / "from_folder.jsonl").size(), 3u);
  EXPECT_EQ(file_bytes(dir_ / "from_folder" / "step_000003" / "model.safetensors"),
            file_bytes(dir_ / "from_ours" / "step_000003" / "model.safetensors"));

  // Exported back to a Hugging Face folder (sharded small here), it reads as the same model and starts the same
  // run again; exported once more unsharded into the same folder, the stale shards and index are gone.
  const fs::path trained = dir_ / "from_ours" / "step_000003";
  const fs::path hf_out = dir_ / "hf_out";
  ASSERT_OK(export_weights(trained.string() + "/model.safetensors", WeightsFormat::kHuggingFace, hf_out.string(),
                           DType::kF32, {}, 40000));
  std::set<std::string> shards;
  {
    std::ifstream index(hf_out / "model.safetensors.index.json");
    ASSERT_TRUE(index.good()) << "sharded at 40 kB: an index";
    const json parsed = json::parse(index);
    for (const auto& [name, shard] : parsed.at("weight_map").items()) shards.insert(shard.get<std::string>());
  }
  EXPECT_GT(shards.size(), 2u);
  for (const std::string& shard : shards) EXPECT_TRUE(fs::exists(hf_out / shard)) << shard;
  ASSERT_OK_AND_ASSIGN(const LlamaConfig exported, read_hf_llama_config(hf_out.string()));
  ASSERT_OK_AND_ASSIGN(const LlamaConfig original, read_hf_llama_config(folder));
  EXPECT_EQ(llama_metadata(exported), llama_metadata(original));
  json again = eval;
  again["training"]["init_from"] = hf_out.string();
  again["training"]["checkpoint_dir"] = (dir_ / "again").string();
  json from_trained = again;
  from_trained["training"]["init_from"] = trained.string();
  from_trained["training"]["checkpoint_dir"] = (dir_ / "from_trained").string();
  from_trained["model"] = model;
  for (json* j : {&again, &from_trained}) (*j)["training"]["max_steps"] = 2;
  ASSERT_OK(train(again, "", (dir_ / "again.jsonl").string()).status());
  ASSERT_OK(train(from_trained, "", (dir_ / "from_trained.jsonl").string()).status());
  EXPECT_EQ(losses(dir_ / "again.jsonl"), losses(dir_ / "from_trained.jsonl"));
  EXPECT_EQ(file_bytes(dir_ / "again" / "step_000002" / "model.safetensors"),
            file_bytes(dir_ / "from_trained" / "step_000002" / "model.safetensors"));
  ASSERT_OK(export_weights(trained.string(), WeightsFormat::kHuggingFace, hf_out.string()));
  EXPECT_TRUE(fs::exists(hf_out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(hf_out / "model.safetensors.index.json"));
  for (const std::string& shard : shards) EXPECT_FALSE(fs::exists(hf_out / shard)) << shard << " is stale";

  json conflict = eval;
  conflict["model"]["hidden_size"] = 64;
  expect_error(train(conflict).status(), StatusCode::kInvalidArgument, {"model.hidden_size", "64", "config.json"});
  json other = from_ours;
  other["training"]["checkpoint_dir"] = (dir_ / "other").string();
  other["model"]["rope_theta"] = 10000.0;
  expect_error(train(other).status(), StatusCode::kInvalidArgument, {"model.rope_theta", "10000", "1000000"});
}

// The checkpoint's data position is a shard index and a token offset: a resume whose data.train lists other
// shards would read other tokens without a word. A shard added before it is followed by name; a missing one
// refuses the resume before any weight is read.
TEST_F(TrainerTest, AResumeFollowsItsShardOrRefusesOtherData) {
  json straight = base_config("straight");
  straight["training"]["checkpoint_every"] = 3;
  ASSERT_TRUE(train(straight).is_ok());
  const std::string step3 = (dir_ / "straight" / "step_000003").string();
  // The same shards in another folder, with one more that sorts first.
  fs::create_directories(dir_ / "moved");
  for (const char* name : {"t_train_000000.bin", "t_train_000001.bin"})
    fs::copy_file(dir_ / "data" / name, dir_ / "moved" / name);
  fs::copy_file(dir_ / "data" / "t_val_000000.bin", dir_ / "moved" / "a_extra.bin");
  json moved = base_config("moved_run");
  moved["data"]["train"] = (dir_ / "moved" / "*.bin").string();
  auto r = train(moved, step3);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(file_bytes(dir_ / "straight" / "step_000006" / "model.safetensors"),
            file_bytes(dir_ / "moved_run" / "step_000006" / "model.safetensors"));
  // Without the shard the position is in: refused, naming it; nothing written.
  json other = base_config("other_run");
  other["data"]["train"] = (dir_ / "data" / "t_train_000001.bin").string();
  auto refused = train(other, step3);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("t_train_000000.bin (3000 tokens"), std::string::npos)
      << refused.status().to_string();
  EXPECT_FALSE(fs::exists(dir_ / "other_run" / "step_000006"));
}

// A run that goes non-finite never succeeds silently: after 10 steps in a row of non-finite loss or gradients
// it stops with an error, and it writes no checkpoint of that state, so `latest` still names the last good
// one, whose files are untouched. A run that ends on non-finite steps fails the same way.
TEST_F(TrainerTest, ARunThatStaysNonFiniteStopsAndLatestKeepsTheLastGoodCheckpoint) {
  json good = base_config("blown");
  ASSERT_TRUE(train(good).is_ok());
  const fs::path ck = dir_ / "blown";
  const std::vector<char> weights = file_bytes(ck / "step_000006" / "model.safetensors");
  json blown = base_config("blown");
  blown["training"]["lr"] = 1e38;  // the first update makes the weights overflow the next forward
  blown["training"]["max_steps"] = 30;
  blown["training"]["checkpoint_every"] = 4;
  blown["training"]["val_every"] = 0;
  auto r = train(blown, (ck / "step_000006").string());
  ASSERT_FALSE(r.is_ok());
  expect_error(r.status(), StatusCode::kInvalidArgument, {"10 steps in a row", "without a checkpoint", "latest"});
  auto latest = [&] {
    std::ifstream in(ck / "latest");
    std::string name;
    in >> name;
    return name;
  };
  // Step 7 trained (its loss finite); the steps after it did not, so the periodic save at 8 was not made.
  EXPECT_EQ(latest(), "step_000006");
  for (int s = 7; s <= 30; ++s) EXPECT_FALSE(fs::exists(ck / fmt::format("step_{:06d}", s))) << s;
  EXPECT_EQ(file_bytes(ck / "step_000006" / "model.safetensors"), weights);

  blown["training"]["max_steps"] = 9;  // ends on 2 non-finite steps
  auto ended = train(blown, (ck / "step_000006").string());
  ASSERT_FALSE(ended.is_ok());
  expect_error(ended.status(), StatusCode::kInvalidArgument, {"ended on 2 step(s)", "no checkpoint"});
  EXPECT_EQ(latest(), "step_000006");
}

TEST_P(FamilyTrainerTest, GradientAccumulationMatchesOneLargeBatch) {
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

INSTANTIATE_TEST_SUITE_P(Families, FamilyTrainerTest, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return std::string(info.param); });

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

  // The folder `strata tokenize` wrote, train and validation shards alike, as data.train.
  json folder = base_config("m");
  folder["data"]["train"] = (dir_ / "data").string();
  expect_error(folder, StatusCode::kInvalidArgument, {"both read", "t_val_000000.bin", "narrow data.train"});

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

  // DeepSpeed's train_batch_size that is not batch_size x grad_accum_steps x the data-parallel size (1 here).
  json global = base_config("m");
  global["train_batch_size"] = 2 * global["training"]["batch_size"].get<int>();
  expect_error(global, StatusCode::kInvalidArgument, {"train_batch_size", "1 data-parallel rank"});

  // Resuming from something that is not a checkpoint.
  auto r = train(base_config("m"), (dir_ / "data").string());
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("not a checkpoint"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace strata::engine
