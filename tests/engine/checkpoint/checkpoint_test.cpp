// checkpoint_test.cpp — saving a checkpoint never loses the last good one: `keep` counts checkpoints by their
// step number and never removes the one just written (also after a resume from an earlier step, and past
// step 999999, where the names stop sorting as text), a second save of the same step replaces the first
// whole, leftovers of failed saves go (before the next save writes, so one left by a full disk does not fail
// it too), a checkpoint moved aside by a save killed halfway is read and restored, a `latest` naming a missing
// folder is an error naming it, a checkpoint folder without `latest` gives its highest complete step, and a
// folder holding checkpoints is refused to a run that would start over. A resume finds the shard its data
// position is in, or refuses data that is not the checkpoint's; it lists the settings that changed.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "engine/checkpoint/checkpoint.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
using ::strata::testing::expect_error;

const GPT2Config kConfig{.n_layer = 1, .n_head = 2, .n_embd = 32, .vocab_size = 67, .block_size = 16};

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / fmt::format("strata_ckpt_{}_{}", ::getpid(), counter_++)).string();
    ASSERT_OK_AND_ASSIGN(device_, kernels::make_device("cpu", *kernels::find_kernel_set("fast")));
    ASSERT_OK_AND_ASSIGN(model_, GPT2::create(kConfig, *device_, kernels::MatmulPrecision::kF32));
    ASSERT_OK(model_->init_weights(3));
    auto opt = AdamW::create(model_->units(), AdamWConfig{}, *device_);
    ASSERT_TRUE(opt.is_ok()) << opt.status().to_string();
    opt_ = std::make_unique<AdamW>(std::move(opt).value());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // One training step, so that every save below has different parameters.
  void train_step() {
    std::vector<int32_t> x(2 * 8, 5), y(2 * 8, 9);
    ASSERT_TRUE(model_->forward(x.data(), y.data(), 2, 8).is_ok());
    ASSERT_OK(model_->backward());
    opt_->step(model_->units(), 1e-2f);
  }
  void save(int step, int keep) {
    TrainState state;
    state.step = step;
    auto saved = save_checkpoint(dir_, *model_, *opt_, state, keep);
    ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
  }
  // A folder that looks like another run's checkpoint to the pruning.
  void fake(const std::string& name) {
    fs::create_directories(fs::path(dir_) / name);
    std::ofstream(fs::path(dir_) / name / "state.json") << "{}";
  }
  bool has(const std::string& name) const { return fs::exists(fs::path(dir_) / name); }
  std::string latest() const {
    std::ifstream in(fs::path(dir_) / "latest");
    std::string name;
    in >> name;
    return name;
  }
  static std::vector<float> params_of(const GPT2& model) {
    std::vector<float> all;
    for (size_t u = 0; u < model.units().size(); ++u) {
      std::vector<float> p(model.whole_layout(u).numel());
      EXPECT_TRUE(model.read_params(u, p.data()).is_ok());
      all.insert(all.end(), p.begin(), p.end());
    }
    return all;
  }
  // Loads the checkpoint `latest` names into a fresh model; its parameters go to *got.
  Result<TrainState> load_fresh(std::vector<float>* got = nullptr) {
    STRATA_ASSIGN_OR_RETURN(auto other, GPT2::create(kConfig, *device_, kernels::MatmulPrecision::kF32));
    STRATA_ASSIGN_OR_RETURN(AdamW other_opt, AdamW::create(other->units(), AdamWConfig{}, *device_));
    STRATA_ASSIGN_OR_RETURN(TrainState state, load_checkpoint(dir_, *other, other_opt));
    if (got != nullptr) *got = params_of(*other);
    return state;
  }
  // load_fresh gives the checkpoint of `step`, with the parameters `want`.
  void expect_loads(int step, const std::vector<float>& want) {
    std::vector<float> got;
    auto state = load_fresh(&got);
    ASSERT_TRUE(state.is_ok()) << state.status().to_string();
    EXPECT_EQ(state.value().step, step);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
  }

  static inline int counter_ = 0;
  std::string dir_;
  std::unique_ptr<kernels::Device> device_;
  std::unique_ptr<GPT2> model_;
  std::unique_ptr<AdamW> opt_;
};

TEST_F(CheckpointTest, KeepCountsByStepNumberPastSixDigits) {
  save(999999, 2);
  save(1000000, 2);
  save(1000001, 2);  // "step_1000000" sorts before "step_999999" as text: it used to be the one removed
  EXPECT_FALSE(has("step_999999"));
  EXPECT_TRUE(has("step_1000000"));
  EXPECT_TRUE(has("step_1000001"));
  EXPECT_EQ(latest(), "step_1000001");
}

TEST_F(CheckpointTest, AfterAResumeFromAnEarlierStepTheNewCheckpointsStay) {
  fake("step_002500");  // the abandoned run's, above the step it was resumed from
  fake("step_003000");
  save(2100, 2);
  EXPECT_TRUE(has("step_002100")) << "the checkpoint just written was removed";
  EXPECT_EQ(latest(), "step_002100");
  EXPECT_TRUE(has("step_003000"));
  EXPECT_FALSE(has("step_002500"));
  save(2200, 2);
  EXPECT_TRUE(has("step_002200"));
  EXPECT_FALSE(has("step_002100"));
  EXPECT_TRUE(has("step_003000"));
  auto state = load_fresh();
  ASSERT_TRUE(state.is_ok()) << state.status().to_string();
  EXPECT_EQ(state.value().step, 2200);
}

TEST_F(CheckpointTest, ASecondSaveOfAStepReplacesTheFirstWhole) {
  fake("step_000004.tmp");  // a save that failed or was killed
  save(5, 2);
  train_step();
  const std::vector<float> want = params_of(*model_);
  save(5, 2);  // e.g. the signal handler's save right after a periodic one
  EXPECT_FALSE(has("step_000005.tmp"));
  EXPECT_FALSE(has("step_000004.tmp"));
  std::vector<float> got;
  auto state = load_fresh(&got);
  ASSERT_TRUE(state.is_ok()) << state.status().to_string();
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
}

TEST_F(CheckpointTest, AFailedSavesLeftoverGoesBeforeTheNextSaveWrites) {
  // What a save that ran out of space leaves: a whole model file in its ".tmp" folder. With a keep of 0 the
  // pruning (which removed such folders after a save) never runs, so only the save itself can take it away
  // before it writes.
  fs::create_directories(fs::path(dir_) / "step_000003.tmp");
  std::ofstream(fs::path(dir_) / "step_000003.tmp" / "model.safetensors") << std::string(4096, 'x');
  fake("step_000002.tmp.old");  // may be the only copy of a step: not a leftover
  save(4, 0);
  EXPECT_FALSE(has("step_000003.tmp"));
  EXPECT_TRUE(has("step_000002.tmp.old"));
  EXPECT_TRUE(has("step_000004"));
}

TEST_F(CheckpointTest, AFolderHoldingCheckpointsIsRefusedToANewRun) {
  ASSERT_OK(check_no_checkpoints(dir_));  // none yet (the folder does not even exist)
  fs::create_directories(fs::path(dir_) / "step_000009.tmp");  // an unfinished save is no checkpoint
  ASSERT_OK(check_no_checkpoints(dir_));
  fake("step_000010");  // a checkpoint without `latest` (a run killed before its first save finished naming it)
  Status refused = check_no_checkpoints(dir_);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("step_000010"), std::string::npos) << refused.message();
  save(11, 2);
  refused = check_no_checkpoints(dir_);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  for (const char* part : {"'latest' names step_000011", "--resume", "training.overwrite_checkpoints", dir_.c_str()})
    EXPECT_NE(refused.message().find(part), std::string::npos) << part << " not in: " << refused.message();
}

TEST_F(CheckpointTest, ALatestNamingAMissingFolderIsAnErrorNamingIt) {
  save(7, 0);
  fs::remove_all(fs::path(dir_) / "step_000007");
  auto state = load_checkpoint(dir_, *model_, *opt_);
  ASSERT_FALSE(state.is_ok());
  EXPECT_NE(state.status().to_string().find("step_000007"), std::string::npos) << state.status().to_string();
}

// Where the filesystem cannot exchange two folders in one step, a second save of a step moves the old folder
// aside ("step_N.tmp.old") before putting the new one in place. Killed in between, `latest` names a folder that
// is not there: the load reads the copy moved aside, and the next save puts it back (or, where the new one made
// it into place, removes the old one).
TEST_F(CheckpointTest, ACheckpointMovedAsideByAKilledSaveIsReadAndRestored) {
  save(8, 3);
  const std::vector<float> want = params_of(*model_);
  fs::rename(fs::path(dir_) / "step_000008", fs::path(dir_) / "step_000008.tmp.old");
  ASSERT_NO_FATAL_FAILURE(expect_loads(8, want));

  fake("step_000006.tmp.old");  // killed after the new step 6 was in place: the old copy is left over
  fake("step_000006");
  train_step();
  save(9, 3);
  EXPECT_TRUE(has("step_000008")) << "the only copy of step 8 goes back to its name";
  EXPECT_FALSE(has("step_000008.tmp.old"));
  EXPECT_FALSE(has("step_000006.tmp.old"));
  EXPECT_TRUE(has("step_000006"));
  EXPECT_TRUE(has("step_000009"));
  // Restored checkpoints count against `keep` like the others.
  train_step();
  save(10, 2);
  EXPECT_FALSE(has("step_000008"));
  EXPECT_FALSE(has("step_000006"));
  EXPECT_TRUE(has("step_000009"));
  EXPECT_TRUE(has("step_000010"));
}

// A run killed after its first save was renamed into place but before `latest` was written: `--resume` (the
// checkpoint_dir) reads the highest complete step, not "not a checkpoint".
TEST_F(CheckpointTest, ACheckpointFolderWithoutLatestGivesItsHighestCompleteStep) {
  save(3, 0);
  train_step();
  save(12, 0);
  const std::vector<float> want = params_of(*model_);
  fs::remove(fs::path(dir_) / "latest");
  fake("step_000011");
  fs::remove(fs::path(dir_) / "step_000011" / "state.json");  // an incomplete folder is never chosen...
  fs::create_directories(fs::path(dir_) / "step_000099.tmp");  // nor an unfinished save
  ASSERT_NO_FATAL_FAILURE(expect_loads(12, want));

  fs::remove_all(dir_);
  fs::create_directories(dir_);
  auto none = load_fresh();
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().to_string();
}

TEST_F(CheckpointTest, TheDataShardsTravelWithTheCheckpointAndACheckSeesThemBeforeTheWeights) {
  TrainState st{.step = 4, .train_pos = {.shard = 1, .offset = 64, .epoch = 2},
                .train_shards = {{"a.bin", 1000}, {"b.bin", 2000}}, .config = {{"training", {{"lr", 0.001}}}}};
  ASSERT_TRUE(save_checkpoint(dir_, *model_, *opt_, st, 0).is_ok());
  auto other = GPT2::create(kConfig, *device_, kernels::MatmulPrecision::kF32);
  ASSERT_TRUE(other.is_ok());
  const std::vector<float> before = params_of(**other);
  ASSERT_OK_AND_ASSIGN(AdamW other_opt, AdamW::create((*other)->units(), AdamWConfig{}, *device_));
  TrainState seen;
  auto refused = load_checkpoint(dir_, **other, other_opt, [&](const TrainState& s) {
    seen = s;
    return Status::invalid_argument("not this data");
  });
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().message(), "not this data");
  EXPECT_EQ(seen.train_shards, st.train_shards);
  EXPECT_EQ(seen.train_pos.shard, 1u);
  EXPECT_EQ(seen.train_pos.offset, 64u);
  EXPECT_EQ(seen.train_pos.epoch, 2u);
  EXPECT_EQ(seen.config, st.config);
  EXPECT_EQ(params_of(**other), before) << "nothing is loaded once the check refuses";
}

// One flipped bit in any file of a checkpoint refuses the resume, naming the file: the tensors' chunks and the
// headers by their checksums, state.json by its own.
TEST_F(CheckpointTest, OneFlippedBitInEachCheckpointFileRefusesTheResume) {
  train_step();
  save(1, 0);
  const fs::path step = fs::path(dir_) / "step_000001";
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "state.json"}) {
    const std::string bytes = [&] {
      std::ifstream in(step / file, std::ios::binary);
      return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    }();
    // Positions spread over the file: its header (or the JSON) and its data.
    for (size_t k = 1; k <= 7; ++k) {
      const size_t at = bytes.size() * k / 8;
      std::string bad = bytes;
      bad[at] = static_cast<char>(bad[at] ^ 0x10);
      std::ofstream(step / file, std::ios::binary | std::ios::trunc) << bad;
      auto r = load_fresh();
      EXPECT_FALSE(r.is_ok()) << file << ": a flip at byte " << at << " of " << bytes.size() << " was read";
      if (!r.is_ok()) {
        EXPECT_NE(r.status().message().find(file), std::string::npos) << file << " byte " << at << ": "
                                                                       << r.status().to_string();
      }
    }
    std::ofstream(step / file, std::ios::binary | std::ios::trunc) << bytes;
  }
  ASSERT_TRUE(load_fresh().is_ok());
}

// A state.json moved beside another step's tensors is not theirs.
TEST_F(CheckpointTest, AStateOfAnotherStepBesideTheWeightsIsRefused) {
  train_step();
  save(25, 0);
  train_step();
  save(38, 0);
  fs::copy_file(fs::path(dir_) / "step_000025" / "state.json", fs::path(dir_) / "step_000038" / "state.json",
                fs::copy_options::overwrite_existing);
  auto r = load_fresh();
  ASSERT_FALSE(r.is_ok());
  expect_error(r.status(), StatusCode::kCorruption, {"step_000038", "step 25", "folder of step 38"});
}

// A model whose weights are not finite is not saved: the save fails naming the tensor, and `latest` keeps
// naming the last good checkpoint, which stays whole.
TEST_F(CheckpointTest, ANonFiniteStateIsNotSavedAndLatestStays) {
  train_step();
  save(1, 0);
  const std::vector<float> good = params_of(*model_);
  std::vector<float> p(model_->whole_layout(1).numel());
  ASSERT_OK(model_->read_params(1, p.data()));
  p[3] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_OK(model_->write_params(1, p.data()));
  TrainState state;
  state.step = 2;
  auto saved = save_checkpoint(dir_, *model_, *opt_, state, 0);
  ASSERT_FALSE(saved.is_ok());
  expect_error(saved.status(), StatusCode::kInvalidArgument, {"h.0.ln_1.weight", "element 3", "not finite"});
  EXPECT_EQ(latest(), "step_000001");
  EXPECT_FALSE(has("step_000002"));
  EXPECT_FALSE(has("step_000002.tmp"));
  expect_loads(1, good);
}

TEST(ResumeShardTest, FindsTheCheckpointsShardOrRefusesOtherData) {
  const std::vector<ShardRecord> saved = {{"a.bin", 1000}, {"b.bin", 2000}, {"c.bin", 3000}};
  const DataLoader::Position pos{.shard = 1, .offset = 500, .epoch = 0};
  auto at = [&](const std::vector<ShardRecord>& now) { return resume_shard(saved, pos, now, "data.train"); };
  ASSERT_OK_AND_ASSIGN(size_t same, at(saved));
  EXPECT_EQ(same, 1u);
  // A shard added before it (sorting first): the position follows its file.
  ASSERT_OK_AND_ASSIGN(size_t moved, at({{"0.bin", 10}, {"a.bin", 1000}, {"b.bin", 2000}, {"c.bin", 3000}}));
  EXPECT_EQ(moved, 2u);
  // Shards after it added or gone: the same place.
  ASSERT_OK_AND_ASSIGN(size_t fewer, at({{"a.bin", 1000}, {"b.bin", 2000}}));
  EXPECT_EQ(fewer, 1u);
  // Its file gone, or the same name with other tokens: refused, naming the file and what is there now.
  for (const auto& now : {std::vector<ShardRecord>{{"a.bin", 1000}, {"c.bin", 3000}},
                          std::vector<ShardRecord>{{"a.bin", 1000}, {"b.bin", 2048}, {"c.bin", 3000}},
                          std::vector<ShardRecord>{{"a.bin", 1000}}}) {
    auto r = at(now);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string msg = r.status().message();
    EXPECT_NE(msg.find("data.train"), std::string::npos) << msg;
    EXPECT_NE(msg.find("b.bin (2000 tokens"), std::string::npos) << msg;
    EXPECT_NE(msg.find(now.size() > 1 ? now[1].file : "no shard"), std::string::npos) << msg;
  }
  // Two shards with its name and size: which one is not knowable.
  EXPECT_FALSE(at({{"b.bin", 2000}, {"x.bin", 5}, {"b.bin", 2000}}).is_ok());
  // A checkpoint from before the records: its index, unchecked; a position past its own list: corrupt.
  ASSERT_OK_AND_ASSIGN(size_t old, resume_shard({}, pos, {{"z.bin", 1}, {"y.bin", 2}}, "data.train"));
  EXPECT_EQ(old, 1u);
  EXPECT_EQ(resume_shard({{"a.bin", 1}}, pos, {{"a.bin", 1}}, "data.train").status().code(), StatusCode::kCorruption);
}

TEST(ConfigChangesTest, NamesEachChangedSettingByItsDottedKey) {
  const nlohmann::json saved = {{"training", {{"lr", 0.001}, {"max_steps", 10}, {"seed", 1}}},
                                {"data", {{"train", "a/*.bin"}}},
                                {"zero_optimization", {{"stage", 3}}}};
  nlohmann::json now = saved;
  EXPECT_TRUE(config_changes(saved, now).empty());
  now["training"]["lr"] = 0.0005;
  now["training"]["max_steps"] = 20;
  now["zero_optimization"].erase("stage");
  now["compute"] = {{"threads", 2}};
  const std::vector<std::string> want = {"compute.threads: (unset) -> 2", "training.lr: 0.001 -> 0.0005",
                                         "training.max_steps: 10 -> 20", "zero_optimization.stage: 3 -> (unset)"};
  EXPECT_EQ(config_changes(saved, now), want);
}

}  // namespace
}  // namespace strata::engine
