// dp_train_test.cpp — run by CTest under `mpiexec -np 2`: data-parallel training (ZeRO stage 0, the CPU
// backend, gradients summed over MPI) against one process that accumulates the same micro-batches. The sums
// are the same sums in another association (each rank adds its own micro-batches, then the ranks are added),
// so the runs agree within fp32 rounding, not bitwise: losses and gradient norms within 1e-5 relative, final
// weights within 2e-5 absolute after 5 steps (the tiny model's weights are O(0.1)).
#include <unistd.h>

#include <cmath>
#include <fstream>

#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"
#include "storage/safetensors.h"
#include "tests/comm/multi_rank_helpers.h"
#include "tests/engine/trainer_fixture.h"

namespace strata::engine {
namespace {

using DataParallelTest = TrainerTest;
using FamilyDataParallelTest = FamilyTrainerTest;

TEST_F(DataParallelTest, TwoRanksMatchOneProcessAccumulatingTheirMicroBatches) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  comm::Communicator& world = *w.value();
  ASSERT_EQ(world.size(), 2) << "run under mpiexec -np 2 (CTest does)";
  for (const int accum : {1, 2}) {
    SCOPED_TRACE(accum);
    const std::string dp_name = fmt::format("dp{}", accum), one_name = fmt::format("one{}", accum);
    json dp = base_config(dp_name);
    dp["training"]["max_steps"] = 5;
    dp["training"]["grad_accum_steps"] = accum;
    // Every rank's own temporary folder: only rank 0 writes into its checkpoint folder and metrics.
    ASSERT_TRUE(train(dp, "", (dir_ / (dp_name + ".jsonl")).string(), &world).is_ok());
    if (world.rank() == 0) {
      json one = base_config(one_name);
      one["training"]["max_steps"] = 5;
      one["training"]["grad_accum_steps"] = 2 * accum;
      ASSERT_TRUE(train(one, "", (dir_ / (one_name + ".jsonl")).string()).is_ok());
      const auto a = losses(dir_ / (dp_name + ".jsonl")), b = losses(dir_ / (one_name + ".jsonl"));
      ASSERT_EQ(a.size(), 5u);
      ASSERT_EQ(b.size(), 5u);
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_NEAR(a[i].first, b[i].first, 1e-5 * std::abs(b[i].first)) << "loss of step " << i + 1;
        EXPECT_NEAR(a[i].second, b[i].second, 1e-5 * std::abs(b[i].second)) << "norm of step " << i + 1;
      }
      const double worst = max_difference(dir_ / dp_name / "step_000005" / "model.safetensors",
                                          dir_ / one_name / "step_000005" / "model.safetensors");
      EXPECT_LE(worst, 2e-5) << "largest weight difference";
    } else {
      EXPECT_FALSE(fs::exists(dir_ / dp_name / "step_000005")) << "only rank 0 writes checkpoints";
    }
    ASSERT_TRUE(world.barrier().is_ok());
  }
}

// ZeRO-1 keeps a slice of Adam's moments per rank and all-reduces the gradients: bitwise the stage-0 run, its
// gathered checkpoint included; small reduce and all-gather buckets change no bit of either stage. ZeRO-2 reduce-scatters the gradients and adds the ranks' sums of squares for
// the norm in another order: within rounding of stage 0 (losses and norms 1e-5 relative, weights and moments
// 2e-5 absolute). Resuming from a stage-1 checkpoint (moments gathered to rank 0, then sliced again) is
// bitwise the straight run.
TEST_P(FamilyDataParallelTest, ZeroStagesOneAndTwoShardTheMomentsExactly) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  const SharedDir shared_dir(world, "strata_zero_test");
  ASSERT_FALSE(shared_dir.path.empty());
  const fs::path& shared = shared_dir.path;
  auto config = [&](const std::string& name, int stage, int steps) {
    json j = base_config(name);
    j["training"]["max_steps"] = steps;
    j["training"]["checkpoint_dir"] = (shared / name).string();
    j["zero_optimization"] = {{"stage", stage}};
    return j;
  };
  for (int stage = 0; stage <= 2; ++stage) {
    const std::string name = fmt::format("zero{}", stage);
    ASSERT_TRUE(train(config(name, stage, 6), "", (dir_ / (name + ".jsonl")).string(), &world).is_ok()) << name;
  }
  // Small buckets (reduce_bucket_size 100, allgather_bucket_size 70: pieces of 50 and 35 elements per rank, so
  // most tensors take many calls, the last one partial): the same bits as whole-tensor collectives.
  for (int stage = 1; stage <= 2; ++stage) {
    const std::string name = fmt::format("zero{}_buckets", stage);
    json j = config(name, stage, 6);
    j["zero_optimization"]["reduce_bucket_size"] = 100;
    j["zero_optimization"]["allgather_bucket_size"] = 70;
    ASSERT_TRUE(train(j, "", (dir_ / (name + ".jsonl")).string(), &world).is_ok()) << name;
  }
  // Stage 1 in two parts: 3 steps, then resumed to 6.
  ASSERT_TRUE(train(config("zero1_resumed", 1, 3), "", "", &world).is_ok());
  ASSERT_TRUE(world.barrier().is_ok());  // rank 0's checkpoint is written before anyone reads it
  ASSERT_TRUE(train(config("zero1_resumed", 1, 6), (shared / "zero1_resumed").string(), "", &world).is_ok());
  if (world.rank() == 0) {
    const fs::path z0 = shared / "zero0" / "step_000006", z1 = shared / "zero1" / "step_000006",
                   z2 = shared / "zero2" / "step_000006", r1 = shared / "zero1_resumed" / "step_000006";
    EXPECT_EQ(losses(dir_ / "zero0.jsonl"), losses(dir_ / "zero1.jsonl"));
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(z0 / f) == file_bytes(z1 / f)) << "stage 1 vs 0: " << f;
      EXPECT_TRUE(file_bytes(z1 / f) == file_bytes(r1 / f)) << "stage 1 resumed vs straight: " << f;
    }
    for (const char* stage : {"zero1", "zero2"}) {
      const std::string small = std::string(stage) + "_buckets";
      EXPECT_EQ(losses(dir_ / (std::string(stage) + ".jsonl")), losses(dir_ / (small + ".jsonl"))) << small;
      for (const char* f : {"model.safetensors", "optimizer.safetensors"})
        EXPECT_TRUE(file_bytes(shared / stage / "step_000006" / f) == file_bytes(shared / small / "step_000006" / f))
            << small << ": " << f;
    }
    const auto a = losses(dir_ / "zero0.jsonl"), b = losses(dir_ / "zero2.jsonl");
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i].first, b[i].first, 1e-5 * std::abs(a[i].first)) << "loss of step " << i + 1;
      EXPECT_NEAR(a[i].second, b[i].second, 1e-5 * std::abs(a[i].second)) << "norm of step " << i + 1;
    }
    EXPECT_LE(max_difference(z0 / "model.safetensors", z2 / "model.safetensors"), 2e-5);
    EXPECT_LE(max_difference(z0 / "optimizer.safetensors", z2 / "optimizer.safetensors"), 2e-5);
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

// With the optimizer offloaded (host memory, or NVMe with sub-groups) and parameters in host memory, every rank
// offloads the whole optimizer state and the offloaded optimizer sums the gradients in host memory: bitwise the
// data-parallel run without offload.
TEST_F(DataParallelTest, OffloadedOptimizerOverTwoRanksIsBitwiseThePlainDataParallelRun) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  const json nvme_optimizer = {{"device", "nvme"}, {"nvme_path", (dir_ / "swap").string()}};
  const json grads_nvme = {{"gradients", "nvme"}};
  const std::pair<json, json> placements[] = {  // zero_optimization, memory
      {json(), json()},
      {{{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}, json()},
      {{{"stage", 0}, {"offload_optimizer", nvme_optimizer}, {"sub_group_size", 3000}}, json()},
      // Gradients on nvme: summed over the ranks where they lie (read, all-reduced, written back).
      {{{"stage", 0}, {"offload_optimizer", nvme_optimizer}, {"sub_group_size", 3000}}, grads_nvme},
      // The embedding and h.0 kept whole on the device (offload_optimizer.ratio): their gradients summed over the
      // ranks there, in the same order.
      {{{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.4}}}}, json()},
  };
  for (size_t i = 0; i < std::size(placements); ++i) {
    const std::string name = fmt::format("offload{}", i);
    json j = base_config(name);
    if (!placements[i].first.is_null()) j["zero_optimization"] = placements[i].first;
    if (!placements[i].second.is_null()) j["memory"] = placements[i].second;
    const auto trained = train(j, "", (dir_ / (name + ".jsonl")).string(), w.value().get());
    ASSERT_TRUE(trained.is_ok()) << name << ": " << trained.status().to_string();
  }
  if (w.value()->rank() == 0) {
    for (const char* name : {"offload1", "offload2", "offload3", "offload4"}) {
      EXPECT_EQ(losses(dir_ / "offload0.jsonl"), losses(dir_ / (std::string(name) + ".jsonl"))) << name;
      for (const char* f : {"model.safetensors", "optimizer.safetensors"})
        EXPECT_TRUE(file_bytes(dir_ / "offload0" / "step_000006" / f) == file_bytes(dir_ / name / "step_000006" / f))
            << name << ": " << f;
    }
  }
  ASSERT_TRUE(w.value()->barrier().is_ok());
}

// ZeRO-3: every rank keeps only its shard of every unit's parameters, gradients and optimizer state (in host
// memory, or on NVMe), gathers each unit for use and reduce-scatters its gradient after each micro-batch's
// backward. Against stage 0 over the same ranks the gradients are the same sums in another association when
// micro-batches accumulate, and the norm adds the ranks' sums of squares: losses and norms within 1e-5
// relative, weights and moments within 2e-5 absolute (the tiny model's weights are O(0.1)). Covered: shards in
// host memory; on NVMe with sub-groups and a live-parameter cap that makes backward gather evicted units
// again; accumulation over 2 micro-batches per rank; and a resume from a stage-3 checkpoint (shards gathered to
// rank 0, written, read back and cut again), which is bitwise the straight stage-3 run.
// A fine-tune over two ranks: every rank starts from the file's weights, and the validation of those weights
// before the first step (a collective under ZeRO-3, whose parameters are gathered from shards) runs on every
// rank and gives the single process's figure. Stage 3 with everything on NVMe matches stage 0.
TEST_F(DataParallelTest, AFineTuneStartsEveryStageFromTheFilesWeights) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  // Each rank makes the same file alone (runs are deterministic) in its own folder.
  json first = base_config("first");
  first["training"]["max_steps"] = 2;
  ASSERT_TRUE(train(first, "", (dir_ / "first.jsonl").string()).is_ok());
  const double first_val = metrics_lines(dir_ / "first.jsonl").back().value("val_loss", -1.0);
  ASSERT_GT(first_val, 0);
  const json nvme = zero3_on_nvme(dir_ / "swap");
  for (const auto& [name, zero] : {std::pair<std::string, json>{"z0", {{"stage", 0}}}, {"z3", nvme}}) {
    json tune = base_config(name);
    tune["training"]["max_steps"] = 3;
    tune["training"]["init_from"] = (dir_ / "first" / "step_000002").string();
    tune["zero_optimization"] = zero;
    auto r = train(tune, "", (dir_ / (name + ".jsonl")).string(), &world);
    ASSERT_TRUE(r.is_ok()) << name << ": " << r.status().to_string();
    if (world.rank() != 0) continue;
    const json step0 = metrics_lines(dir_ / (name + ".jsonl")).front();
    EXPECT_EQ(step0.value("step", -1), 0) << name;
    EXPECT_NEAR(step0.value("val_loss", -1.0), first_val, 1e-6 * first_val) << name;
  }
  if (world.rank() == 0) {
    const auto a = losses(dir_ / "z0.jsonl"), b = losses(dir_ / "z3.jsonl");
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(b[i].first, a[i].first, 1e-5 * std::abs(a[i].first)) << "loss of step " << i + 1;
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

TEST_P(FamilyDataParallelTest, ZeroStageThreeShardsParametersGradientsAndStateAndMatchesStageZero) {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  ASSERT_TRUE(w.is_ok());
  comm::Communicator& world = *w.value();
  const SharedDir shared_dir(world, "strata_zero3_test");
  ASSERT_FALSE(shared_dir.path.empty());
  const fs::path& shared = shared_dir.path;
  json nvme = zero3_on_nvme(dir_ / "swap");
  nvme["stage3_prefetch_bucket_size"] = 20000;
  const json z3_ratio = {{"stage", 3},
                         {"offload_param", {{"device", "cpu"}}},
                         {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.4}}},
                         {"stage3_param_persistence_threshold", 0}};
  struct Run {
    std::string name;
    json zero;
    int accum, steps;
    std::string resume;
    json checkpointing = json::object();  // activation_checkpointing
    int layers = 2;
    json memory = json::object();
  };
  const Run runs[] = {
      {"z0", {{"stage", 0}}, 1, 6, ""},
      {"z3host", {{"stage", 3}}, 1, 6, ""},
      {"z3nvme", nvme, 1, 6, ""},
      {"z0acc", {{"stage", 0}}, 2, 6, ""},
      {"z3acc", {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}, {"offload_optimizer", {{"device", "cpu"}}}}, 2,
       6, ""},
      {"z2offload", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}, 1, 6, ""},
      // The embedding (3616 elements) and ln_f under the persistence threshold: gathered once per step instead
      // of at each use the live cap evicted it between; the blocks (12704) still evicted.
      {"z3persist", [&] {
         json z = nvme;
         z["stage3_param_persistence_threshold"] = 4000;
         return z;
       }(), 1, 6, ""},
      {"z3resumed", nvme, 1, 3, ""},
      {"z3resumed", nvme, 1, 6, "z3resumed"},
      // The embedding and h.0 kept whole on every rank's device (offload_optimizer.ratio), their gradients summed
      // over the ranks there; straight and resumed (their state saved from rank 0's device, loaded on each).
      {"z3ratio", z3_ratio, 2, 6, ""},
      {"z3ratio_resumed", z3_ratio, 2, 3, ""},
      {"z3ratio_resumed", z3_ratio, 2, 6, "z3ratio_resumed"},
      // Activation checkpoints in host memory: backward gathers (evicted) units again to recompute blocks from
      // them, 3 blocks so the middle one is.
      {"z3l3", nvme, 1, 6, "", json::object(), 3},
      {"z3l3ckhost", nvme, 1, 6, "", {{"enabled", true}, {"cpu_checkpointing", true}}, 3},
      // Gradient shards on NVMe: written by a step's first reduce-scatter, read, added to and written back by
      // the second micro-batch's; with the optimizer on NVMe (which reads them with its state) and in host memory.
      {"z3nvmeacc", nvme, 2, 6, ""},
      {"z3nvmegrads", nvme, 2, 6, "", json::object(), 2, {{"gradients", "nvme"}}},
      {"z3optcpugrads", [&] {
         json z = nvme;
         z["offload_optimizer"] = {{"device", "cpu"}};
         return z;
       }(), 2, 6, "", json::object(), 2, {{"gradients", "nvme"}}},
  };
  for (const Run& r : runs) {
    SCOPED_TRACE(r.name);
    json j = base_config(r.name);
    j["training"]["max_steps"] = r.steps;
    j["training"]["grad_accum_steps"] = r.accum;
    j["training"]["checkpoint_dir"] = (shared / r.name).string();
    j["zero_optimization"] = r.zero;
    set_layers(j, r.layers);
    if (!r.checkpointing.empty()) j["activation_checkpointing"] = r.checkpointing;
    if (!r.memory.empty()) j["memory"] = r.memory;
    const std::string resume = r.resume.empty() ? "" : (shared / r.resume).string();
    const std::string metrics = r.resume.empty() ? (dir_ / (r.name + ".jsonl")).string() : "";
    const auto trained = train(j, resume, metrics, &world);
    ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    ASSERT_TRUE(world.barrier().is_ok());  // rank 0's checkpoint is written before anyone reads it
  }
  if (world.rank() == 0) {
    const auto check = [&](const std::string& plain, const std::string& sharded) {
      SCOPED_TRACE(sharded + " vs " + plain);
      expect_within_rounding(losses(dir_ / (plain + ".jsonl")), losses(dir_ / (sharded + ".jsonl")), 6,
                             shared / plain / "step_000006", shared / sharded / "step_000006");
    };
    // The live-parameter cap made the NVMe run evict units and gather them again within each step.
    std::ifstream in(dir_ / "z3nvme.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json m = json::parse(line).at("offload");
      EXPECT_GT(m.at("evictions").get<int>(), 0) << line;
      EXPECT_GT(m.at("gather_bytes").get<double>(), m.at("reduce_scatter_bytes").get<double>()) << line;
    }
    // Resident units change which gathers happen, not one bit of the arithmetic. A tied embedding is used at
    // both ends of a step: evicted between without persistence, gathered twice; an untied model's small units
    // (embedding, norm, head) are each used in one stretch, so persistence saves little there, and costs nothing.
    {
      const bool tied = family_ != "qwen3";
      std::ifstream a(dir_ / "z3nvme.jsonl"), b(dir_ / "z3persist.jsonl");
      std::string la, lb;
      int steps = 0;
      while (std::getline(a, la) && std::getline(b, lb)) {
        const json ma = json::parse(la).at("offload"), mb = json::parse(lb).at("offload");
        if (tied) {
          EXPECT_LT(mb.at("gather_bytes").get<double>(), ma.at("gather_bytes").get<double>()) << lb;
          EXPECT_LT(mb.at("evictions").get<int>(), ma.at("evictions").get<int>()) << lb;
        } else {
          EXPECT_LE(mb.at("gather_bytes").get<double>(), ma.at("gather_bytes").get<double>()) << lb;
          EXPECT_LE(mb.at("evictions").get<int>(), ma.at("evictions").get<int>()) << lb;
        }
        EXPECT_GT(mb.at("evictions").get<int>(), 0) << lb;
        ++steps;
      }
      EXPECT_EQ(steps, 6);
    }
    EXPECT_EQ(losses(dir_ / "z3nvme.jsonl"), losses(dir_ / "z3persist.jsonl"));
    check("z0", "z3host");
    check("z0", "z3nvme");
    check("z0acc", "z3acc");
    check("z0acc", "z3ratio");
    check("z0", "z2offload");  // ZeRO-Offload: stage 2 with the optimizer offloaded runs sharded as stage 3
    // Not bitwise stage 0: the checks above would pass for an unsharded run too, so the norms must differ
    // somewhere (they are summed per rank's shard, then over the ranks).
    EXPECT_NE(losses(dir_ / "z0.jsonl"), losses(dir_ / "z3host.jsonl"));
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(shared / "z3nvme" / "step_000006" / f) == file_bytes(shared / "z3resumed" / "step_000006" / f))
          << "stage 3 resumed vs straight: " << f;
      EXPECT_TRUE(file_bytes(shared / "z3ratio" / "step_000006" / f) ==
                  file_bytes(shared / "z3ratio_resumed" / "step_000006" / f))
          << "stage 3 with units kept on the device, resumed vs straight: " << f;
      EXPECT_TRUE(file_bytes(shared / "z3nvme" / "step_000006" / f) == file_bytes(shared / "z3persist" / "step_000006" / f))
          << "stage 3 with resident small units vs without: " << f;
      EXPECT_TRUE(file_bytes(shared / "z3l3" / "step_000006" / f) == file_bytes(shared / "z3l3ckhost" / "step_000006" / f))
          << "stage 3 with activation checkpoints vs without: " << f;
    }
    EXPECT_EQ(losses(dir_ / "z3l3.jsonl"), losses(dir_ / "z3l3ckhost.jsonl"));
    // Gradient shards on NVMe: bitwise the same shards in host memory; the gradients' bytes did go to NVMe.
    check("z0acc", "z3nvmeacc");
    for (const char* run : {"z3nvmegrads", "z3optcpugrads"}) {
      SCOPED_TRACE(run);
      EXPECT_EQ(losses(dir_ / "z3nvmeacc.jsonl"), losses(dir_ / (std::string(run) + ".jsonl")));
      for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
        EXPECT_TRUE(file_bytes(shared / "z3nvmeacc" / "step_000006" / f) == file_bytes(shared / run / "step_000006" / f))
            << "gradient shards on NVMe vs in host memory: " << f;
      }
    }
    std::ifstream host_grads(dir_ / "z3nvmeacc.jsonl"), nvme_grads(dir_ / "z3nvmegrads.jsonl");
    int steps = 0;
    for (std::string la, lb; std::getline(host_grads, la) && std::getline(nvme_grads, lb); ++steps) {
      const json a = json::parse(la).at("offload"), b = json::parse(lb).at("offload");
      // Per step, this rank's shard of the 2 micro-batches: written twice and read back once.
      EXPECT_GT(b.at("nvme_write_bytes").get<double>(), a.at("nvme_write_bytes").get<double>()) << lb;
      EXPECT_GT(b.at("nvme_read_bytes").get<double>(), a.at("nvme_read_bytes").get<double>()) << lb;
    }
    EXPECT_EQ(steps, 6);
  }
  ASSERT_TRUE(world.barrier().is_ok());
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyDataParallelTest, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace strata::engine
