// tp_train_test.cpp — run by CTest under mpiexec: tensor parallelism (engine/model/unit_split.h) on the CPU
// backend against one process training the same micro-batches, alone on 2 ranks and as TP=2 x PP=2 x DP=2 on 8.
//
// Tensor parallelism changes the association of sums, not the arithmetic: the row-parallel linears add two
// partial products (and the bias once), the vocab-parallel cross-entropy combines two log-sum-exps, and the norm
// adds the ranks' shares. So the runs agree within fp32 rounding, with the tolerances of the other multi-rank
// tests: losses and norms within 1e-5 relative, final weights and moments within 2e-5 absolute after 6 steps
// (the tiny model's weights are O(0.1)). The checkpoints hold whole tensors, so they compare with the single
// process's file for file. The model has 4 heads (2 per rank) and a vocabulary of 97 (slices of 49 and 48 rows).
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm/grid.h"
#include "comm/mpi_communicator.h"
#include "tests/comm/multi_rank_helpers.h"
#include "tests/engine/trainer_fixture.h"

namespace strata::engine {
namespace {

struct TpRun {
  std::string name;
  int tp, pp, steps;
  bool resume = false;
  json zero = json::object();
  json checkpointing = json::object();  // activation_checkpointing
  bool sequence_parallel = false;
};

class TensorParallelTest : public TrainerTest {
 protected:
  // The model and schedule every run here shares: 3 blocks of 4 heads, 6 steps of `accum` micro-batches.
  json tp_config(const std::string& name, const fs::path& shared, int accum) const {
    json j = base_config(name);
    set_layers(j, 3);
    if (family_ == "gpt2") j["model"]["n_head"] = 4;  // the Llama variants have 4 already
    j["training"]["grad_accum_steps"] = accum;
    j["training"]["checkpoint_dir"] = (shared / name).string();
    j["training"]["overwrite_checkpoints"] = true;  // run_all trains "one" again in each of its calls
    return j;
  }

  // Runs `runs` on every rank of `world` (split into grids of r.tp x r.pp), with `accum` micro-batches per
  // data-parallel rank, then on rank 0 the single process with `one_accum` micro-batches per step, as "one".
  void run_all(comm::Communicator& world, const fs::path& shared, const std::vector<TpRun>& runs, int accum,
               int one_accum) {
    for (const TpRun& r : runs) {
      SCOPED_TRACE(r.name);
      auto grid = comm::RankGrid::create(world, r.tp, r.pp);
      ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
      json j = tp_config(r.name, shared, accum);
      j["training"]["max_steps"] = r.steps;
      j["parallel"] = {{"tensor_parallel_size", r.tp},
                       {"pipeline_parallel_size", r.pp},
                       {"sequence_parallel", r.sequence_parallel}};
      if (!r.zero.empty()) j["zero_optimization"] = r.zero;
      if (!r.checkpointing.empty()) j["activation_checkpointing"] = r.checkpointing;
      const std::string metrics = r.resume ? "" : (dir_ / (r.name + ".jsonl")).string();
      const auto trained = train(j, r.resume ? (shared / r.name).string() : "", metrics, &grid.value()->dp(),
                                 &grid.value()->pp(), &grid.value()->tp());
      ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
      ASSERT_TRUE(world.barrier().is_ok());  // rank 0's checkpoint is written before anyone reads it
    }
    if (world.rank() == 0) {
      const auto trained = train(tp_config("one", shared, one_accum), "", (dir_ / "one.jsonl").string());
      ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    }
  }

  // Parameters in host memory and Adam on NVMe, per rank (ZeRO-3 over a data-parallel group of one).
  json host_params_adam_on_nvme() const {
    return {{"stage", 3},
            {"offload_param", {{"device", "cpu"}}},
            {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", (dir_ / "swap").string()}}},
            {"sub_group_size", 3000}};
  }

  // Validation losses (steps 3 and 6), from a metrics file.
  static std::vector<double> val_losses(const fs::path& metrics) {
    std::ifstream in(metrics);
    std::vector<double> out;
    for (std::string line; std::getline(in, line);) {
      const json m = json::parse(line);
      if (m.contains("val_loss")) out.push_back(m.at("val_loss").get<double>());
    }
    return out;
  }

  // Training and validation losses, norms, final weights and moments within fp32 rounding of the single
  // process's, and not its bits (the checks would also pass for a run that ignored the split).
  void expect_matches_one(const fs::path& shared, const std::string& name) const {
    SCOPED_TRACE(name + " vs one process");
    expect_within_rounding(losses(dir_ / "one.jsonl"), losses(dir_ / (name + ".jsonl")), 6,
                           shared / "one" / "step_000006", shared / name / "step_000006");
    EXPECT_NE(losses(dir_ / "one.jsonl"), losses(dir_ / (name + ".jsonl")));
    const std::vector<double> want = val_losses(dir_ / "one.jsonl"), got = val_losses(dir_ / (name + ".jsonl"));
    ASSERT_EQ(want.size(), 2u);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "validation " << i;
  }
};

// Over the families (kFamilies): for the Llama family the query and key/value heads and the MLP are split,
// q_norm's and k_norm's gradients summed over the group.
class FamilyTensorParallelTest : public TensorParallelTest, public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    family_ = GetParam();
    TensorParallelTest::SetUp();
  }
};

TEST_P(FamilyTensorParallelTest, TwoRanksMatchOneProcess) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  if (world.size() != 2) GTEST_SKIP() << "the 2-rank case (CTest runs it under mpiexec -np 2)";
  const SharedDir shared_dir(world, "strata_tp_test");
  ASSERT_FALSE(shared_dir.path.empty());
  const fs::path& shared = shared_dir.path;
  const json offload = host_params_adam_on_nvme();
  const std::vector<TpRun> runs = {
      {"tp2", 2, 1, 6},
      {"tp2resumed", 2, 1, 3},
      {"tp2resumed", 2, 1, 6, true},
      {"tp2offload", 2, 1, 6, false, offload},
      {"tp2ckhost", 2, 1, 6, false, json::object(), {{"enabled", true}, {"cpu_checkpointing", true}}},
      {"tp2sp", 2, 1, 6, false, json::object(), json::object(), true},
      {"tp2spckhost", 2, 1, 6, false, json::object(), {{"enabled", true}, {"cpu_checkpointing", true}}, true},
      {"tp2spoffload", 2, 1, 6, false, offload, json::object(), true},
      // The embedding and h.0 kept whole on the device (offload_optimizer.ratio), each rank its slices.
      {"tp2ratio", 2, 1, 6, false, [&] {
         json z = offload;
         z["offload_optimizer"]["ratio"] = 0.4;
         return z;
       }()},
  };
  run_all(world, shared, runs, 2, 2);
  if (world.rank() == 0) {
    expect_matches_one(shared, "tp2");
    expect_matches_one(shared, "tp2offload");  // parameters in host memory, Adam on NVMe, per rank
    expect_matches_one(shared, "tp2sp");       // sequence parallelism
    expect_matches_one(shared, "tp2spoffload");
    EXPECT_EQ(losses(dir_ / "tp2sp.jsonl"), losses(dir_ / "tp2spckhost.jsonl"));
    EXPECT_EQ(losses(dir_ / "tp2sp.jsonl"), losses(dir_ / "tp2spoffload.jsonl"));
    // The same arithmetic: bitwise equal.
    EXPECT_EQ(losses(dir_ / "tp2.jsonl"), losses(dir_ / "tp2offload.jsonl"));
    EXPECT_EQ(losses(dir_ / "tp2.jsonl"), losses(dir_ / "tp2ratio.jsonl"));
    EXPECT_EQ(losses(dir_ / "tp2.jsonl"), losses(dir_ / "tp2ckhost.jsonl"));
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const std::vector<char> straight = file_bytes(shared / "tp2" / "step_000006" / f);
      EXPECT_TRUE(straight == file_bytes(shared / "tp2resumed" / "step_000006" / f)) << "resumed vs straight: " << f;
      EXPECT_TRUE(straight == file_bytes(shared / "tp2ckhost" / "step_000006" / f)) << "host activation checkpoints: " << f;
      EXPECT_TRUE(straight == file_bytes(shared / "tp2ratio" / "step_000006" / f)) << "units kept on the device: " << f;
      EXPECT_TRUE(file_bytes(shared / "tp2sp" / "step_000006" / f) ==
                  file_bytes(shared / "tp2spckhost" / "step_000006" / f))
          << "sequence parallelism with host activation checkpoints: " << f;
    }
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTensorParallelTest, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return std::string(info.param); });

// A fine-tune from a file of whole tensors: each rank takes its slices of them (its heads, its half of the MLP,
// its rows of the vocabulary), validates before step 1 over the group, and trains as one process does from the
// same file — also with parameters in host memory and Adam on NVMe, per rank.
TEST_F(TensorParallelTest, AFineTuneSplitsTheFilesWeightsOverTheGroup) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  if (world.size() != 2) GTEST_SKIP() << "the 2-rank case (CTest runs it under mpiexec -np 2)";
  // Every rank makes the same file alone (runs are deterministic), in its own folder.
  json first = base_config("first");
  first["model"]["n_layer"] = 3;
  first["model"]["n_head"] = 4;
  first["training"]["max_steps"] = 2;
  ASSERT_TRUE(train(first, "", (dir_ / "first.jsonl").string()).is_ok());
  const double first_val = metrics_lines(dir_ / "first.jsonl").back().value("val_loss", -1.0);
  ASSERT_GT(first_val, 0);
  auto tune = [&](const std::string& name) {
    json j = base_config(name);
    j["model"]["n_layer"] = 3;
    j["model"]["n_head"] = 4;
    j["training"]["max_steps"] = 3;
    j["training"]["grad_accum_steps"] = 2;
    j["training"]["init_from"] = (dir_ / "first" / "step_000002").string();
    return j;
  };
  const json offload = host_params_adam_on_nvme();
  for (const auto& [name, zero] : {std::pair<std::string, json>{"tp2", json::object()},
                                   std::pair<std::string, json>{"tp2offload", offload}}) {
    SCOPED_TRACE(name);
    auto grid = comm::RankGrid::create(world, 2, 1);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    json j = tune(name);
    j["parallel"] = {{"tensor_parallel_size", 2}};
    if (!zero.empty()) j["zero_optimization"] = zero;
    const auto trained = train(j, "", (dir_ / (name + ".jsonl")).string(), &grid.value()->dp(), &grid.value()->pp(),
                               &grid.value()->tp());
    ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    ASSERT_TRUE(world.barrier().is_ok());
  }
  if (world.rank() == 0) {
    ASSERT_TRUE(train(tune("one"), "", (dir_ / "one.jsonl").string()).is_ok());
    const auto one = losses(dir_ / "one.jsonl");
    ASSERT_EQ(one.size(), 3u);
    for (const char* name : {"tp2", "tp2offload"}) {
      SCOPED_TRACE(std::string(name) + " vs one process");
      const std::vector<json> lines = metrics_lines(dir_ / (std::string(name) + ".jsonl"));
      ASSERT_FALSE(lines.empty());
      EXPECT_EQ(lines.front().value("step", -1), 0);
      EXPECT_NEAR(lines.front().value("val_loss", -1.0), first_val, 1e-6 * first_val);
      const auto got = losses(dir_ / (std::string(name) + ".jsonl"));
      ASSERT_EQ(got.size(), one.size());
      for (size_t i = 0; i < one.size(); ++i)
        EXPECT_NEAR(got[i].first, one[i].first, 1e-5 * std::abs(one[i].first)) << "loss of step " << i + 1;
    }
    EXPECT_EQ(losses(dir_ / "tp2.jsonl"), losses(dir_ / "tp2offload.jsonl"));  // the same arithmetic
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

// Heads that do not divide over the group are refused by name, on every rank.
TEST_F(TensorParallelTest, RefusesHeadsThatDoNotSplit) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  if (world.size() != 2) GTEST_SKIP() << "the 2-rank case (CTest runs it under mpiexec -np 2)";
  auto grid = comm::RankGrid::create(world, 2, 1);
  ASSERT_TRUE(grid.is_ok());
  json j = base_config("odd_heads");
  j["model"]["n_head"] = 1;
  j["parallel"] = {{"tensor_parallel_size", 2}};
  const auto trained = train(j, "", "", &grid.value()->dp(), &grid.value()->pp(), &grid.value()->tp());
  ASSERT_FALSE(trained.is_ok());
  EXPECT_NE(trained.status().message().find("model.n_head (1) must be divisible by parallel.tensor_parallel_size (2)"),
            std::string::npos)
      << trained.status().to_string();
}

// TP=2 x PP=2 x DP=2: each data-parallel rank's 4 micro-batches flow through 2 stages of 2 tensor-parallel
// ranks; one process runs the same 8 micro-batches per step. The same under ZeRO stages 1 (bitwise the stage-0
// run), 2 and 3, and TP=2 x DP=4 under ZeRO stages 1 and 2. A resume of the ZeRO-3 run (its checkpoint gathered
// over all three dimensions) is bitwise the straight run. TP=4 x DP=2 (one head per rank). And PP=3 x DP=2 on 6
// ranks under ZeRO stages 1 (resumed too) and 2, where the middle stage holds neither end of the tied embedding.
TEST_F(TensorParallelTest, ThreeDimensionsOnEightRanksMatchOneProcess) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 240});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  if (world.size() != 8) GTEST_SKIP() << "the 8-rank case (CTest runs it under mpiexec -np 8)";
  const SharedDir shared_dir(world, "strata_3d_test");
  ASSERT_FALSE(shared_dir.path.empty());
  const fs::path& shared = shared_dir.path;
  // ZeRO-3 over each (stage, tensor-parallel rank)'s 2 data-parallel ranks, shards and Adam on NVMe, with a
  // live-parameter cap that evicts within a step.
  const json nvme = zero3_on_nvme(dir_ / "swap");
  const std::vector<TpRun> runs = {
      {"3d", 2, 2, 6},
      {"3dz3nvme", 2, 2, 6, false, nvme},
      {"3dz3resumed", 2, 2, 3, false, nvme},
      {"3dz3resumed", 2, 2, 6, true, nvme},
      {"3dsp", 2, 2, 6, false, json::object(), json::object(), true},
      {"3dz1", 2, 2, 6, false, {{"stage", 1}}},
      {"3dz2", 2, 2, 6, false, {{"stage", 2}}},
      // TP=4 x DP=2: one head per rank, vocabulary slices of 25, 24, 24 and 24 rows.
      {"tp4dp2", 4, 1, 6},
  };
  run_all(world, shared, runs, 4, 8);
  // TP=2 x DP=4 with ZeRO stages 1 and 2 (Adam's moments, then the gradients, sharded over the 4 data-parallel
  // ranks of each tensor-parallel rank): 2 micro-batches per data-parallel rank, the same 8 per step.
  const std::vector<TpRun> zero = {
      {"tp2dp4z1", 2, 1, 6, false, {{"stage", 1}}},
      {"tp2dp4z2", 2, 1, 6, false, {{"stage", 2}}},
  };
  run_all(world, shared, zero, 2, 8);
  // A middle pipeline stage under ZeRO stages 1 and 2: PP=3 x DP=2 on 6 of the 8 ranks (the other 2 wait), 4
  // micro-batches per data-parallel rank; stage 1 also resumed mid-run.
  auto six = world.split(world.rank() < 6 ? 0 : 1, world.rank(), "six");
  ASSERT_TRUE(six.is_ok()) << six.status().to_string();
  if (world.rank() < 6) {
    const std::vector<TpRun> middle = {
        {"pp3dp2z1", 1, 3, 6, false, {{"stage", 1}}},
        {"pp3dp2z1resumed", 1, 3, 3, false, {{"stage", 1}}},
        {"pp3dp2z1resumed", 1, 3, 6, true, {{"stage", 1}}},
        {"pp3dp2z2", 1, 3, 6, false, {{"stage", 2}}},
    };
    run_all(*six.value(), shared, middle, 4, 8);
  }
  ASSERT_TRUE(world.barrier().is_ok());
  if (world.rank() == 0) {
    expect_matches_one(shared, "pp3dp2z1");
    expect_matches_one(shared, "pp3dp2z2");
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(shared / "pp3dp2z1" / "step_000006" / f) ==
                  file_bytes(shared / "pp3dp2z1resumed" / "step_000006" / f))
          << "ZeRO-1 pipeline resumed vs straight: " << f;
    }
  }
  if (world.rank() == 0) {
    expect_matches_one(shared, "tp2dp4z1");
    expect_matches_one(shared, "tp2dp4z2");
    expect_matches_one(shared, "3d");
    expect_matches_one(shared, "3dz3nvme");
    expect_matches_one(shared, "3dsp");  // sequence parallelism: stages pass this rank's rows of the activations
    expect_matches_one(shared, "3dz2");
    expect_matches_one(shared, "tp4dp2");
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(shared / "3d" / "step_000006" / f) == file_bytes(shared / "3dz1" / "step_000006" / f))
          << "ZeRO-1 vs stage 0: " << f;
      EXPECT_TRUE(file_bytes(shared / "3dz3nvme" / "step_000006" / f) ==
                  file_bytes(shared / "3dz3resumed" / "step_000006" / f))
          << "resumed vs straight: " << f;
    }
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

}  // namespace
}  // namespace strata::engine
