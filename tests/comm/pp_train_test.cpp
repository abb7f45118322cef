// pp_train_test.cpp — run by CTest under `mpiexec -np 4`: pipeline parallelism (engine/parallel/pipeline.h) on
// the CPU backend against one process accumulating the same micro-batches.
//
// Each stage accumulates its units' gradients over the micro-batches in the single process's order, so every
// unit but the tied embedding gets the same bits; the embedding's two halves (the LM head's, on the last stage,
// and the token embedding's, on the first) are accumulated apart and then added, another association. So the
// runs agree within fp32 rounding: losses and norms within 1e-5 relative, final weights and moments within
// 2e-5 absolute after 6 steps (the tiny model's weights are O(0.1)). 1F1B and GPipe run the same arithmetic in
// another order of messages: bitwise equal to each other. A run resumed from a pipeline checkpoint (the first
// stage gathers every stage's units and moments into the usual files) is bitwise the straight run. ZeRO-1 on
// every stage is bitwise the stage-0 pipeline run; ZeRO-2 and -3 match the single process within rounding.
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "comm/grid.h"
#include "comm/mpi_communicator.h"
#include "engine/parallel/grad_sync.h"
#include "storage/safetensors.h"
#include "tests/comm/multi_rank_helpers.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using PipelineTest = TrainerTest;
using FamilyPipelineTest = FamilyTrainerTest;

// The units several stages hold are summed over their holders only: GPT-2's tied embedding between the first and
// the last stage, the middle ones taking no part; a family with an untied head shares nothing.
TEST(SharedGradsTest, SumOverTheHoldersOnly) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 60});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& pp = *w.value();
  ASSERT_EQ(pp.size(), 4) << "run under mpiexec -np 4 (CTest does)";
  GPT2Config c;
  c.n_layer = 4, c.n_head = 2, c.n_embd = 8, c.vocab_size = 64, c.block_size = 16;
  std::vector<UnitSpec> units = gpt2_unit_specs(c);
  const PipelinePlan tied = plan_pipeline(units, gpt2_pipeline_costs(c, 16), 4);
  ASSERT_OK_AND_ASSIGN(SharedGrads shared, SharedGrads::create(tied, &pp));
  const int s = pp.rank();
  const bool end = s == 0 || s == 3;
  EXPECT_EQ(shared.units(), end ? std::vector<size_t>{0} : std::vector<size_t>{});
  if (end) {
    std::vector<float> g{1.0f + s, 10.0f * (1 + s)};
    ASSERT_OK(shared.sum(g.data(), g.size(), units[0].name));
    EXPECT_EQ(g, (std::vector<float>{5.0f, 50.0f})) << "the two ends' parts added, on both";
  }
  units[0].ties_head = false;
  FlatLayout head;
  head.add("lm_head.weight", {64, 8});
  units.push_back({.name = "lm_head", .layout = std::move(head), .role = UnitRole::kHead});
  const PipelinePlan untied = plan_pipeline(units, gpt2_pipeline_costs(c, 16), 4);
  ASSERT_OK_AND_ASSIGN(SharedGrads none, SharedGrads::create(untied, &pp));
  EXPECT_TRUE(none.units().empty());
}

// A fine-tune over pipeline stages: the validation of the file's weights before the first step runs the
// pipeline's forward-only schedule before any training schedule, on every stage (and, under ZeRO-3, gathers each
// stage's shards), and gives the single process's figure; the runs then match one process's fine-tune.
TEST_F(PipelineTest, AFineTuneOverStagesStartsFromTheFilesWeights) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  ASSERT_EQ(world.size(), 4) << "run under mpiexec -np 4 (CTest does)";
  // Every rank makes the same file alone (runs are deterministic), in its own folder.
  json first = base_config("first");
  first["model"]["n_layer"] = 4;
  first["training"]["max_steps"] = 2;
  ASSERT_TRUE(train(first, "", (dir_ / "first.jsonl").string()).is_ok());
  const double first_val = metrics_lines(dir_ / "first.jsonl").back().value("val_loss", -1.0);
  ASSERT_GT(first_val, 0);
  auto tune = [&](const std::string& name, int accum) {
    json j = base_config(name);
    j["model"]["n_layer"] = 4;
    j["training"]["max_steps"] = 3;
    j["training"]["grad_accum_steps"] = accum;
    j["training"]["init_from"] = (dir_ / "first" / "step_000002").string();
    return j;
  };
  const json nvme = zero3_on_nvme(dir_ / "swap");
  for (const auto& [name, pp, zero] : {std::tuple<std::string, int, json>{"pp4", 4, json::object()},
                                       std::tuple<std::string, int, json>{"pp2z3", 2, nvme}}) {
    SCOPED_TRACE(name);
    auto grid = comm::RankGrid::create(world, 1, pp);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    json j = tune(name, 4);
    j["parallel"] = {{"pipeline_parallel_size", pp}};
    if (!zero.empty()) j["zero_optimization"] = zero;
    const auto trained = train(j, "", (dir_ / (name + ".jsonl")).string(), &grid.value()->dp(), &grid.value()->pp());
    ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    ASSERT_TRUE(world.barrier().is_ok());
  }
  if (world.rank() != 0) return;
  for (const auto& [name, accum] : {std::pair{"one4", 4}, std::pair{"one8", 8}})
    ASSERT_TRUE(train(tune(name, accum), "", (dir_ / (std::string(name) + ".jsonl")).string()).is_ok());
  for (const auto& [plain, staged] : {std::pair{"one4", "pp4"}, std::pair{"one8", "pp2z3"}}) {
    SCOPED_TRACE(std::string(staged) + " vs " + plain);
    const std::vector<json> step0 = metrics_lines(dir_ / (std::string(staged) + ".jsonl"));
    EXPECT_EQ(step0.front().value("step", -1), 0);
    EXPECT_NEAR(step0.front().value("val_loss", -1.0), first_val, 1e-6 * first_val);
    const auto a = losses(dir_ / (std::string(plain) + ".jsonl")), b = losses(dir_ / (std::string(staged) + ".jsonl"));
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(b[i].first, a[i].first, 1e-5 * std::abs(a[i].first)) << "loss of step " << i + 1;
  }
}

TEST_P(FamilyPipelineTest, StagesMatchOneProcessAndTheSchedulesEachOther) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  ASSERT_EQ(world.size(), 4) << "run under mpiexec -np 4 (CTest does)";
  const SharedDir shared_dir(world, "strata_pp_test");
  ASSERT_FALSE(shared_dir.path.empty());
  const fs::path& shared = shared_dir.path;
  struct Run {
    std::string name;
    int pp;  // stages; the other factor of 4 is data parallelism
    std::string schedule;
    int steps;
    bool resume;
    json zero = json::object();
    json checkpointing = json::object();  // activation_checkpointing
    int layers = 4;
    json memory = json::object();
  };
  // Each stage's parameters and optimizer state on NVMe (ZeRO-3 over the 2 data-parallel ranks of a stage in
  // pp2z3), sub-groups, and a live-parameter cap that evicts within a step.
  const json nvme = zero3_on_nvme(dir_ / "swap");
  // 4 micro-batches per data-parallel rank per step: 1F1B's warmup, steady state and cooldown all happen.
  const Run runs[] = {
      {"pp4", 4, "1f1b", 6, false},
      {"pp4gpipe", 4, "gpipe", 6, false},
      {"pp2dp2", 2, "1f1b", 6, false},
      {"pp2resumed", 2, "1f1b", 3, false},
      {"pp2resumed", 2, "1f1b", 6, true},
      {"pp4nvme", 4, "1f1b", 6, false, nvme},
      {"pp2off", 2, "1f1b", 6, false, {{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}},
      // The same with the optimizer and the gradients on NVMe: the gradients summed over the data-parallel ranks
      // and the tied embedding's over the two ends where they lie.
      {"pp2offnvme", 2, "1f1b", 6, false,
       {{"stage", 0},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", (dir_ / "swap").string()}}},
        {"sub_group_size", 3000}},
       json::object(), 4, {{"gradients", "nvme"}}},
      // ZeRO-1 and -2 over each stage's 2 data-parallel ranks, without offload; stage 2 resumed mid-run.
      {"pp2z1", 2, "1f1b", 6, false, {{"stage", 1}}},
      {"pp2z2", 2, "1f1b", 6, false, {{"stage", 2}}},
      {"pp2z2resumed", 2, "1f1b", 3, false, {{"stage", 2}}},
      {"pp2z2resumed", 2, "1f1b", 6, true, {{"stage", 2}}},
      {"pp2z3", 2, "1f1b", 6, false, nvme},
      {"pp2z3resumed", 2, "1f1b", 3, false, nvme},
      {"pp2z3resumed", 2, "1f1b", 6, true, nvme},
      // Gradient shards on NVMe too: the tied embedding's shard summed over the two ends where it lies.
      {"pp2z3grads", 2, "1f1b", 6, false, nvme, json::object(), 4, {{"gradients", "nvme"}}},
      // 3 blocks per stage: the middle one is recomputed from its checkpoint, with 2 micro-batches in flight.
      {"pp2l6", 2, "1f1b", 6, false, json::object(), json::object(), 6},
      {"pp2l6ckdev", 2, "1f1b", 6, false, json::object(), {{"enabled", true}}, 6},
      {"pp2l6ckhost", 2, "1f1b", 6, false, json::object(), {{"enabled", true}, {"cpu_checkpointing", true}}, 6},
  };
  for (const Run& r : runs) {
    SCOPED_TRACE(r.name);
    auto grid = comm::RankGrid::create(world, 1, r.pp);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    json j = base_config(r.name);
    set_layers(j, r.layers);
    j["training"]["max_steps"] = r.steps;
    j["training"]["grad_accum_steps"] = 4;
    j["training"]["checkpoint_dir"] = (shared / r.name).string();
    j["parallel"] = {{"pipeline_parallel_size", r.pp}, {"pipeline_schedule", r.schedule}};
    if (!r.zero.empty()) j["zero_optimization"] = r.zero;
    if (!r.checkpointing.empty()) j["activation_checkpointing"] = r.checkpointing;
    if (!r.memory.empty()) j["memory"] = r.memory;
    const std::string metrics = r.resume ? "" : (dir_ / (r.name + ".jsonl")).string();
    const auto trained = train(j, r.resume ? (shared / r.name).string() : "", metrics, &grid.value()->dp(),
                               &grid.value()->pp());
    ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    ASSERT_TRUE(world.barrier().is_ok());  // rank 0's checkpoint is written before anyone reads it
  }
  if (world.rank() == 0) {
    // One process over the same micro-batches: 4 per step (pp4), or 2 ranks x 4 (pp2dp2).
    for (const auto& [name, accum] : {std::pair{"one4", 4}, std::pair{"one8", 8}}) {
      json j = base_config(name);
      set_layers(j, 4);
      j["training"]["max_steps"] = 6;
      j["training"]["grad_accum_steps"] = accum;
      j["training"]["checkpoint_dir"] = (shared / name).string();
      const auto trained = train(j, "", (dir_ / (std::string(name) + ".jsonl")).string());
      ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    }
    const auto check = [&](const std::string& plain, const std::string& staged) {
      SCOPED_TRACE(staged + " vs " + plain);
      expect_within_rounding(losses(dir_ / (plain + ".jsonl")), losses(dir_ / (staged + ".jsonl")), 6,
                             shared / plain / "step_000006", shared / staged / "step_000006");
    };
    check("one4", "pp4");
    check("one8", "pp2dp2");
    check("one4", "pp4nvme");  // offload on every stage
    check("one8", "pp2off");   // the offloaded optimizer on every stage, gradients summed over 2 ranks
    check("one8", "pp2z3");    // ZeRO-3 over each stage's 2 data-parallel ranks, shards on NVMe
    check("one8", "pp2z2");    // gradients reduce-scattered, the norm added per rank: within rounding
    // ZeRO-1 all-reduces the gradients and takes the norm as stage 0 does: bitwise the stage-0 pipeline run.
    EXPECT_EQ(losses(dir_ / "pp2dp2.jsonl"), losses(dir_ / "pp2z1.jsonl"));
    EXPECT_EQ(losses(dir_ / "pp4.jsonl"), losses(dir_ / "pp4gpipe.jsonl"));
    EXPECT_EQ(losses(dir_ / "pp2off.jsonl"), losses(dir_ / "pp2offnvme.jsonl"));
    EXPECT_EQ(losses(dir_ / "pp2z3.jsonl"), losses(dir_ / "pp2z3grads.jsonl"));
    EXPECT_EQ(losses(dir_ / "pp2l6.jsonl"), losses(dir_ / "pp2l6ckdev.jsonl"));
    EXPECT_EQ(losses(dir_ / "pp2l6.jsonl"), losses(dir_ / "pp2l6ckhost.jsonl"));
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(shared / "pp4" / "step_000006" / f) == file_bytes(shared / "pp4gpipe" / "step_000006" / f))
          << "GPipe vs 1F1B: " << f;
      EXPECT_TRUE(file_bytes(shared / "pp2off" / "step_000006" / f) ==
                  file_bytes(shared / "pp2offnvme" / "step_000006" / f))
          << "optimizer and gradients on NVMe vs in host memory: " << f;
      EXPECT_TRUE(file_bytes(shared / "pp2z3" / "step_000006" / f) == file_bytes(shared / "pp2z3grads" / "step_000006" / f))
          << "ZeRO-3 stages with gradient shards on NVMe vs in host memory: " << f;
      EXPECT_TRUE(file_bytes(shared / "pp2dp2" / "step_000006" / f) ==
                  file_bytes(shared / "pp2resumed" / "step_000006" / f))
          << "resumed vs straight: " << f;
      EXPECT_TRUE(file_bytes(shared / "pp2z3" / "step_000006" / f) ==
                  file_bytes(shared / "pp2z3resumed" / "step_000006" / f))
          << "ZeRO-3 stages resumed vs straight: " << f;
      EXPECT_TRUE(file_bytes(shared / "pp2dp2" / "step_000006" / f) == file_bytes(shared / "pp2z1" / "step_000006" / f))
          << "ZeRO-1 stages vs stage 0: " << f;
      EXPECT_TRUE(file_bytes(shared / "pp2z2" / "step_000006" / f) ==
                  file_bytes(shared / "pp2z2resumed" / "step_000006" / f))
          << "ZeRO-2 stages resumed vs straight: " << f;
      // Recomputed activations are the forward's bits: checkpointing (per in-flight micro-batch) changes nothing.
      for (const char* ck : {"pp2l6ckdev", "pp2l6ckhost"})
        EXPECT_TRUE(file_bytes(shared / "pp2l6" / "step_000006" / f) == file_bytes(shared / ck / "step_000006" / f))
            << ck << ": " << f;
    }
    // With a tied embedding, not bitwise the single process (the embedding's halves at the two ends add in
    // another order): the checks above would also pass for a run that ignored the stages, so they must differ
    // somewhere. An untied model's stages each sum what one process sums, in its order: bitwise equal.
    if (family_ != "qwen3")
      EXPECT_NE(losses(dir_ / "one4.jsonl"), losses(dir_ / "pp4.jsonl"));
    else
      EXPECT_EQ(losses(dir_ / "one4.jsonl"), losses(dir_ / "pp4.jsonl"));
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyPipelineTest, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace strata::engine
