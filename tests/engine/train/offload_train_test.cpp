// Training with the state spread over the tiers gives bitwise the run that keeps everything on the device:
// every placement (optimizer in host memory or on NVMe, parameters in host memory or on NVMe, small sub-groups
// that split tensors, a cap on live parameters that forces evictions, gradient accumulation, activation
// checkpoints on the device or in host memory), resumed runs included. Compared: the per-step loss and gradient norm, and the final checkpoint's weights and moments.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "common/trace.h"
#include "engine/model/gpt2/gpt2.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/matmul_info.h"
#include "offload/pinned_pool.h"
#include "storage/uring_engine.h"
#include "tests/engine/offload_train_fixture.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/forwarding_device.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

TEST_P(FamilyOffloadTrainTest, EveryPlacementIsBitwiseThePlainRun) {
  run("plain", config("plain", json()));
  for (const Placement& p : placements()) {
    SCOPED_TRACE(p.name);
    run(p.name, config(p.name, p));
    expect_same_run("plain", p.name, 6);
    if (p.zero.is_null()) continue;
    // The state really moved: gradients came home every step, and the optimizer or parameters used the disk
    // where they were placed on it.
    const json t = offload_totals(dir_ / (std::string(p.name) + ".jsonl"));
    ASSERT_TRUE(t.is_object()) << "no offload metrics";
    EXPECT_GT(t["d2h_bytes"].get<double>(), 0);
    if (p.zero.dump().find("nvme") != std::string::npos) {
      EXPECT_GT(t["nvme_read_bytes"].get<double>(), 0);
    }
  }
  // The capped run had to evict and fetch again, and the trace's prefetches were used.
  const json t = offload_totals(dir_ / "params_nvme_optimizer_nvme.jsonl");
  EXPECT_GT(t["evictions"].get<double>(), 0);
  EXPECT_GT(t["fetches"].get<double>(), 0);
  EXPECT_GT(t["prefetch_hits"].get<double>(), 0);
  EXPECT_EQ(t["retraces"].get<double>(), 0) << "the access order of training steps does not change";
}

// Under bf16 the units on the device for good keep working copies of their parameters in the coordinator too
// (optimizer offloaded, parameters not), made again after each publication of new parameters: bitwise the plain
// run (whose model keeps its own copies: working_copy_test.cpp), with gradient accumulation, and with updates
// started during the backward into spare buffers. Units the coordinator moves (parameters offloaded) keep none,
// nor does a run with compute.bf16_working_copies = false.
// A copy left stale by a publication would give the next forward the old weights.
TEST_F(OffloadTrainTest, Bf16WorkingCopiesFollowEveryPublication) {
  if (!kernels::cpu::matmul_bf16_native())
    GTEST_SKIP() << "oneDNN has no bf16 matmul here (no AVX-512): the fast matmuls keep no working copies";
  const json opt_cpu = {{"device", "cpu"}};
  const json spares = {{"device", "cpu"}, {"speculative_sub_groups", 8}};
  auto bf16 = [&](const std::string& name, const json& zero) {
    json j = config(name, zero, /*accum=*/2);
    j["compute"]["matmul_precision"] = "bf16";
    if (name == "optimizer_cpu_no_copies_bf16") j["compute"]["bf16_working_copies"] = false;
    return j;
  };
  run("plain_bf16", bf16("plain_bf16", json()));
  for (const auto& [name, zero] : std::vector<std::pair<std::string, json>>{
           {"optimizer_cpu_bf16", {{"stage", 2}, {"offload_optimizer", opt_cpu}}},
           {"optimizer_cpu_spares_bf16", {{"stage", 2}, {"offload_optimizer", spares}, {"sub_group_size", 5000}}},
           {"optimizer_cpu_no_copies_bf16", {{"stage", 2}, {"offload_optimizer", opt_cpu}}},
           // The embedding and h.0 kept on the device: the model keeps their copies, the coordinator the rest's.
           {"optimizer_cpu_ratio_bf16",
            {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.6}, {"speculative_sub_groups", 8}}}}},
           {"params_cpu_bf16",
            {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}, {"offload_optimizer", opt_cpu},
             {"stage3_param_persistence_threshold", 0}}}}) {
    SCOPED_TRACE(name);
    run(name, bf16(name, zero));
    expect_same_run("plain_bf16", name, 6);
    const json t = offload_totals(dir_ / (name + ".jsonl"));
    ASSERT_TRUE(t.is_object()) << "no offload metrics";
    if (name == "params_cpu_bf16" || name == "optimizer_cpu_no_copies_bf16") {
      EXPECT_EQ(t["working_copies"].get<double>(), 0)
          << "units the coordinator moves keep no copies, nor does compute.bf16_working_copies = false";
    } else {
      // 5 units with linears (not the final layernorm; 3 with the ratio), made again after each of the 6 steps'
      // publications (and at the first forward): at least once a step each, never once per micro-batch.
      const double units = name == "optimizer_cpu_ratio_bf16" ? 3 : 5;
      EXPECT_GE(t["working_copies"].get<double>(), units * 5);
      EXPECT_LE(t["working_copies"].get<double>(), units * 7);
    }
  }
}

// A device whose uploads are slow: the copies out of the optimizer's published buffers end long after
// publication returns, so a staging slot the swapper reused before they ended would show up as wrong
// parameters (with 2 slots it reuses one as soon as its sub-group is published).
class SlowUploadDevice final : public testing::ForwardingDevice {
 public:
  void upload(void* dst, const void* src, size_t bytes) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    ForwardingDevice::upload(dst, src, bytes);
  }
};

TEST_F(OffloadTrainTest, SlowCopiesOutOfPublishedParametersStillGiveThePlainRun) {
  run("plain", config("plain", json()));
  SlowUploadDevice slow;
  device_ = &slow;
  for (int slots : {2, 3}) {
    const std::string name = "slow_uploads_" + std::to_string(slots);
    SCOPED_TRACE(name);
    const json zero = {{"stage", 3},
                       {"offload_param", {{"device", "nvme"}, {"buffer_count", 2}}},
                       {"offload_optimizer", {{"device", "nvme"}, {"buffer_count", slots}}},
                       {"stage3_param_persistence_threshold", 100},
                       {"sub_group_size", 3000},
                       {"stage3_max_live_parameters", 20000}};
    run(name, config(name, zero));
    expect_same_run("plain", name, 6);
  }
  device_ = nullptr;
}

TEST_F(OffloadTrainTest, GradientAccumulationIsExactWithOffloadedGradients) {
  run("plain", config("plain", json(), 2));
  const Placement p = placements().back();  // gradients on NVMe, re-read for every micro-batch
  run(p.name, config(p.name, p, 2));
  expect_same_run("plain", p.name, 6);
}

// With the parameters on the device (the optimizer offloaded), accumulated gradients stay on the device until
// the last micro-batch: still bitwise the plain run, and one download per step however many micro-batches.
TEST_F(OffloadTrainTest, AccumulatedGradientsGoHomeOncePerStep) {
  const Placement p = placements()[2];
  ASSERT_EQ(std::string(p.name), "optimizer_cpu");
  run("plain", config("plain", json(), 3));
  run("accumulated", config("accumulated", p, 3));
  expect_same_run("plain", "accumulated", 6);
  run("single", config("single", p, 1));
  const json three = offload_totals(dir_ / "accumulated.jsonl"), one = offload_totals(dir_ / "single.jsonl");
  ASSERT_TRUE(three.is_object() && one.is_object());
  // Each step's gradient once, the tied embedding's too (the step that records the trace may send it twice: the
  // embedding's second use in backward is not known yet at its first release).
  const double params = 97 * 32 + 16 * 32 + 4 * (12 * 32 * 32 + 13 * 32) + 2 * 32, embedding = (97 + 16) * 32;
  EXPECT_GE(one["d2h_bytes"].get<double>(), 6 * params * sizeof(float));
  EXPECT_LE(one["d2h_bytes"].get<double>(), (6 * params + embedding) * sizeof(float));
  // (Accumulating, the trace is known by the first step's last micro-batch: no second embedding download.)
  EXPECT_GE(three["d2h_bytes"].get<double>(), 6 * params * sizeof(float));
  EXPECT_LE(three["d2h_bytes"].get<double>(), one["d2h_bytes"].get<double>())
      << "gradients went home for every micro-batch";
  // (Fewer, even: the first step, which records the trace, sends the tied embedding's gradient home between its
  // two uses and back again, but not while it accumulates.)
  EXPECT_LE(three["h2d_bytes"].get<double>(), one["h2d_bytes"].get<double>())
      << "gradients came back for every micro-batch";
}

// With the parameters offloaded too, the tied embedding's gradient stays on the device between its two uses in
// backward and goes home once (it went home after each use, 2 x 14 KB a step more here; 77 MB for the bench
// model).
TEST_F(OffloadTrainTest, TheTiedEmbeddingsGradientGoesHomeOnceWithParametersOffloaded) {
  const Placement p = placements()[4];
  ASSERT_EQ(std::string(p.name), "params_cpu");
  run("plain", config("plain", json()));
  run("params_cpu", config("params_cpu", p));
  expect_same_run("plain", "params_cpu", 6);
  const json totals = offload_totals(dir_ / "params_cpu.jsonl");
  ASSERT_TRUE(totals.is_object());
  const double params = 97 * 32 + 16 * 32 + 4 * (12 * 32 * 32 + 13 * 32) + 2 * 32, embedding = (97 + 16) * 32;
  EXPECT_GE(totals["d2h_bytes"].get<double>(), 6 * params * sizeof(float));
  // The first step records the trace: its embedding's second use is not known at the first release.
  EXPECT_LE(totals["d2h_bytes"].get<double>(), (6 * params + embedding) * sizeof(float));
}

// ... and when the device budget cannot hold every accumulated gradient, evictions send some home early (the
// next micro-batch brings them back): still bitwise the plain run, where keeping them all would run out of memory.
TEST_F(OffloadTrainTest, AccumulatedGradientsAreEvictedWhenTheDeviceIsShort) {
  Placement p = placements()[2];
  // Found by trying: 900K holds every gradient (no evictions), 600K not even one unit's with the activations;
  // keeping every gradient on the device fails at 700K.
  p.memory = {{"device_memory_limit", "700K"}};
  run("plain", config("plain", json(), 3));
  run("short", config("short", p, 3));
  expect_same_run("plain", "short", 6);
  const json t = offload_totals(dir_ / "short.jsonl");
  ASSERT_TRUE(t.is_object());
  EXPECT_GT(t["evictions"].get<double>(), 0);
}

// Updates start during backward assuming no clipping, and are redone when the step clips: with a clip threshold
// that some steps cross and others do not, both outcomes happen in one run, which is still bitwise the plain run
// (with gradient accumulation too: only the last micro-batch starts updates). With the optimizer on nvme the old
// state stays in the swap files, and after a clipped step the next one only reads its first sub-groups' state
// during backward (gated): also exact. With the optimizer in host memory the early updates go into spare
// buffers: enough for every sub-group, or 2, after which the update waits for the norm and goes on in place.
TEST_F(OffloadTrainTest, UpdatesStartedInBackwardAreKeptOrRedoneExactly) {
  struct Variant {
    const char* name;
    json optimizer;
  };
  const Variant variants[] = {
      {"nvme", {{"device", "nvme"}}},
      {"cpu_spares", {{"device", "cpu"}, {"speculative_sub_groups", 1000}}},
      {"cpu_2_spares", {{"device", "cpu"}, {"speculative_sub_groups", 2}}},
  };
  for (const int accum : {1, 2}) {
    SCOPED_TRACE(accum);
    const std::string plain = fmt::format("plain_clip{}", accum);
    json j = config(plain, json(), accum);
    j["training"]["max_steps"] = 8;
    j["training"]["grad_clip"] = kClip;
    run(plain, j);
    const auto norms = losses(dir_ / (plain + ".jsonl"));
    ASSERT_EQ(norms.size(), 8u);
    int over = 0;
    for (const auto& [loss, norm] : norms) over += norm > kClip;
    ASSERT_GT(over, 0) << "the threshold must clip some steps";
    ASSERT_LT(over, 7) << "and leave some unclipped after an unclipped one: " << json(norms).dump();
    for (const Variant& variant : variants) {
      SCOPED_TRACE(variant.name);
      const std::string name = fmt::format("{}_clip{}", variant.name, accum);
      json z = {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}, {"offload_optimizer", variant.optimizer},
                {"stage3_param_persistence_threshold", 0}, {"sub_group_size", 3000}};
      json o = config(name, z, accum);
      o["training"]["max_steps"] = 8;
      o["training"]["grad_clip"] = kClip;
      run(name, o);
      expect_same_run(plain, name, 8);
      // Which steps kept their early updates and which redid them: metrics lines in step order.
      std::ifstream in(dir_ / (name + ".jsonl"));
      int kept = 0, redone = 0, gated = 0;
      for (std::string line; std::getline(in, line);) {
        const json m = json::parse(line).at("offload");
        gated += m.at("early_reads").get<int>();
        if (m.at("early_start").get<int>() == 0) continue;  // (how many groups it got to depends on timing)
        (m.at("redone").get<int>() ? redone : kept) += 1;
      }
      EXPECT_GT(kept, 0) << json(norms).dump();
      EXPECT_GT(redone, 0) << json(norms).dump();
      if (variant.optimizer.at("device") == "nvme") {
        EXPECT_GT(gated, 0) << json(norms).dump();
      } else {
        EXPECT_EQ(gated, 0) << "only the optimizer on nvme reads ahead";
      }
    }
  }
}

// A step whose norm is not finite is skipped: the updates it started during backward are rolled back and the
// parameters they published are put back, so the run goes on bitwise as the plain run (which skips the same
// step): the same losses and norms every step, and the same checkpoint at the end. Step 3's gradients are made
// infinite (TrainOptions::gradient_factor), and the steps after it train on from what step 2 left: an update
// that was not undone would show in every later loss and in the final weights. Without a clip the offloaded
// optimizer begins step 3's update during its backward (early_start); with a clip on every step, it only reads
// ahead (early_reads, gated) and is stopped before it changes anything. The optimizer in host memory, with
// spare buffers for its early updates, drops them (it does not read ahead: no clip only). Runs that stay
// non-finite are trainer_test's ARunThatStaysNonFinite...
TEST_F(OffloadTrainTest, ASkippedStepUndoesTheUpdatesStartedInBackward) {
  struct Variant {
    const char* name;
    json optimizer;
    double clip;
  };
  const Variant variants[] = {
      {"nvme", {{"device", "nvme"}}, 0.0},
      {"nvme", {{"device", "nvme"}}, 1e-6},
      {"cpu_spares", {{"device", "cpu"}, {"speculative_sub_groups", 1000}}, 0.0},
      // The first units kept on the device (offload_optimizer.ratio): not updated on a skipped step either.
      {"nvme_ratio", {{"device", "nvme"}, {"ratio", 0.6}}, 1e-6},
      {"cpu_spares_ratio", {{"device", "cpu"}, {"speculative_sub_groups", 1000}, {"ratio", 0.6}}, 0.0},
  };
  constexpr int kSkipped = 3, kSteps = 6;
  gradient_factor_ = [](int step) { return step == kSkipped ? std::numeric_limits<float>::infinity() : 1.0f; };
  for (const Variant& variant : variants) {
    const double clip = variant.clip;
    SCOPED_TRACE(fmt::format("{} clip {}", variant.name, clip));
    auto with_skip = [&](const std::string& name, const json& zero) {
      json j = config(name, zero);
      j["training"]["max_steps"] = kSteps;
      j["training"]["grad_clip"] = clip;
      j["training"]["overwrite_checkpoints"] = true;  // the same folders for every variant
      run(name, j);
    };
    with_skip("plain_skip", json());
    with_skip("offload_skip", {{"stage", 3}, {"offload_param", {{"device", "cpu"}}},
                               {"offload_optimizer", variant.optimizer}, {"stage3_param_persistence_threshold", 0},
                               {"sub_group_size", 3000}});
    const std::vector<json> rows = metrics_lines(dir_ / "offload_skip.jsonl");
    ASSERT_EQ(rows.size(), static_cast<size_t>(kSteps));
    for (const json& m : rows) {
      const bool skipped = m.value("skipped", false);
      EXPECT_EQ(skipped, m.at("step") == kSkipped) << m.dump();
      if (skipped) {
        EXPECT_EQ(m.at("offload").at(clip > 0 ? "early_reads" : "early_start"), 1)
            << "the skipped step had not begun its update (or reads) in backward: nothing was rolled back";
      }
    }
    // The skipped step's norm is NaN, which JSON writes as null: compared as written.
    auto steps = [&](const char* name) {
      std::vector<std::string> out;
      for (const json& m : metrics_lines(dir_ / (std::string(name) + ".jsonl")))
        out.push_back(fmt::format("loss {} norm {}", m.at("loss").dump(), m.at("grad_norm").dump()));
      return out;
    };
    EXPECT_EQ(steps("plain_skip"), steps("offload_skip"));
    EXPECT_TRUE(rows.back().at("grad_norm").is_number()) << "the run did not train on after the skipped step";
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const auto a = file_bytes(dir_ / "plain_skip" / fmt::format("step_{:06d}", kSteps) / f);
      EXPECT_FALSE(a.empty());
      EXPECT_TRUE(a == file_bytes(dir_ / "offload_skip" / fmt::format("step_{:06d}", kSteps) / f)) << f;
    }
  }
}

TEST_P(FamilyOffloadTrainTest, ResumeFromAnOffloadedCheckpointIsBitwiseAStraightRun) {
  const Placement p = placements().back();
  run("straight", config("straight", p));
  json first = config("resumed", p);
  first["training"]["max_steps"] = 3;
  run("resumed_part1", first);
  run("resumed", config("resumed", p), (dir_ / "resumed").string());
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(file_bytes(dir_ / "straight" / "step_000006" / f) == file_bytes(dir_ / "resumed" / "step_000006" / f))
        << f;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyOffloadTrainTest, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return std::string(info.param); });

// `strata train --trace`: the timeline holds every step, the model's passes, the optimizer worker's updates and
// the swap store's transfers, each on its thread.
TEST_F(OffloadTrainTest, TheTraceShowsStepsUpdatesAndTransfers) {
  const json zero = {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}, {"offload_optimizer", {{"device", "nvme"}}},
                     {"stage3_param_persistence_threshold", 0}, {"sub_group_size", 3000}};
  trace::start();
  trace::name_thread("training");
  const fs::path path = dir_ / "trace.json";
  {
    struct Stop {  // recording stops (and its file is written) even when the run fails the test
      const fs::path& path;
      ~Stop() { EXPECT_TRUE(trace::write(path.string()).is_ok()); }
    } stop{path};
    run("traced", config("traced", zero));
  }
  std::ifstream in(path);
  const json j = json::parse(in);
  std::map<int, std::string> threads;
  std::map<std::string, std::set<std::string>> where;  // event name -> thread names
  std::set<int> steps;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M") threads[e["tid"]] = e["args"]["name"];
  }
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M") continue;
    where[e["name"]].insert(threads.count(e["tid"]) ? threads[e["tid"]] : "?");
    if (e["name"] == "step") steps.insert(e["args"]["arg"].get<int>());
  }
  EXPECT_EQ(steps, (std::set<int>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(where["forward"], std::set<std::string>{"training"});
  EXPECT_EQ(where["backward"], std::set<std::string>{"training"});
  EXPECT_EQ(where["adam"], std::set<std::string>{"optimizer update"});
  EXPECT_EQ(where["publish"], std::set<std::string>{"training"});
  EXPECT_FALSE(where["nvme read"].empty());
  EXPECT_FALSE(where["nvme write"].empty());
}

// Updates started during the last backward take the sub-groups last unit first, as their gradients become
// final; once step() confirms them, the ones the worker has not taken yet go first unit first, the order the
// next forward publishes and uses them in, so that it waits for each unit's own update rather than for all of
// them. With two spares the worker takes at most three sub-groups before the confirmation (two into spares, one
// waiting for the norm): every update's publications are in ascending sub-group order after at most three.
// Unclipped, every step after the first starts during backward and keeps its updates; still the plain run.
TEST_F(OffloadTrainTest, AfterTheBackwardsEarlyUpdatesTheRestComeInTheForwardsOrder) {
  const json zero = {{"stage", 2},
                     {"offload_optimizer", {{"device", "cpu"}, {"speculative_sub_groups", 2}}},
                     {"sub_group_size", 3000}};
  json plain = config("plain_unclipped", json());
  plain["training"]["grad_clip"] = 0.0;
  run("plain_unclipped", plain);
  json o = config("spares_unclipped", zero);
  o["training"]["grad_clip"] = 0.0;
  trace::start();
  trace::name_thread("training");
  const fs::path path = dir_ / "spares_trace.json";
  {
    struct Stop {
      const fs::path& path;
      ~Stop() { EXPECT_TRUE(trace::write(path.string()).is_ok()); }
    } stop{path};
    run("spares_unclipped", o);
  }
  expect_same_run("plain_unclipped", "spares_unclipped", 6);
  const json totals = offload_totals(dir_ / "spares_unclipped.jsonl");
  ASSERT_FALSE(totals.is_null());
  EXPECT_GE(totals.value("early_start", 0.0), 4.0) << totals.dump();
  EXPECT_EQ(totals.value("redone", 0.0), 0.0) << totals.dump();

  std::ifstream in(path);
  const json j = json::parse(in);
  std::vector<std::pair<double, int>> published;  // (time, sub-group)
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X" && e["name"] == "publish")
      published.push_back({e["ts"].get<double>(), e["args"]["arg"].get<int>()});
  }
  std::sort(published.begin(), published.end());
  std::set<int> groups;
  for (const auto& [ts, g] : published) groups.insert(g);
  const size_t G = groups.size();
  ASSERT_GT(G, 10u) << "small sub-groups, so that most are left at the confirmation";
  ASSERT_EQ(published.size() % G, 0u) << "each update publishes every sub-group once";
  size_t early_orders = 0;  // updates whose first publications were not in ascending order
  for (size_t start = 0; start < published.size(); start += G) {
    std::vector<int> order;
    for (size_t i = start; i < start + G; ++i) order.push_back(published[i].second);
    SCOPED_TRACE(fmt::format("update {}: {}", start / G + 1, fmt::join(order, " ")));
    EXPECT_EQ(std::set<int>(order.begin(), order.end()).size(), G);
    early_orders += !std::is_sorted(order.begin(), order.end());
    EXPECT_TRUE(std::is_sorted(order.begin() + 3, order.end()));
  }
  EXPECT_GT(early_orders, 0u) << "no update took sub-groups during backward";
}

// Checkpointing shrinks what forward keeps on the device: one block's activations plus one (B,T,C) input per
// block on the device, or two in all with the inputs in host memory.
TEST(ActivationCheckpointingTest, KeepsLessOnTheDevice) {
  GPT2Config mc{.n_layer = 6, .n_head = 2, .n_embd = 32, .vocab_size = kVocab, .block_size = 16};
  auto pool = offload::PinnedPool::create(offload::PinnedPoolOptions{.budget_bytes = 16 << 20, .lock = false});
  ASSERT_TRUE(pool.is_ok());
  std::vector<int32_t> x(2 * 16, 3), y(2 * 16, 5);
  uint64_t live[3] = {};
  uint64_t host = 0;
  for (int mode = 0; mode < 3; ++mode) {
    auto device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    auto m = GPT2::create(mc, *device, kernels::MatmulPrecision::kF32);
    ASSERT_TRUE(m.is_ok());
    const uint64_t before = device->live_bytes();
    m.value()->set_activation_checkpointing(static_cast<ActivationCheckpointing>(mode), pool->get());
    ASSERT_TRUE(m.value()->forward(x.data(), y.data(), 2, 16).is_ok());
    live[mode] = device->live_bytes() - before;
    if (mode == 2) host = pool.value()->used_bytes();
  }
  EXPECT_LT(live[1], live[0] / 2) << "checkpoints on the device";
  EXPECT_LT(live[2], live[1]) << "checkpoints in host memory";
  EXPECT_GE(host, 5u * 2 * 16 * 32 * sizeof(float)) << "the inputs of blocks 1..5 are in the host pool";
}

// A device whose memory the host cannot touch, as a GPU's, that records register_host/unregister_host; the rest
// is the CPU device's.
class RegisteringDevice final : public testing::ForwardingDevice {
 public:
  bool host_accessible() const override { return false; }
  Status register_host(void* p, size_t bytes) override {
    if (fail_next) {
      fail_next = false;
      return Status::internal("the driver says no");
    }
    registered[p] = bytes;
    return Status::ok();
  }
  void unregister_host(void* p) override { EXPECT_EQ(registered.erase(p), 1u) << "unregistered twice or never"; }

  std::map<void*, size_t> registered;
  bool fail_next = false;
};

// Host buffers are registered with a GPU for DMA as they are mapped (and those mapped before the hooks, at
// once), and unregistered before they are unmapped; a failed registration leaves the buffer usable and is never
// unregistered.
TEST(RegisterDeviceBuffersTest, RegistersWhatTheDeviceCopiesAndUnregistersBeforeUnmapping) {
  RegisteringDevice device;
  auto pool = offload::PinnedPool::create(offload::PinnedPoolOptions{.budget_bytes = 16 << 20, .lock = false});
  ASSERT_TRUE(pool.is_ok());
  auto early = pool.value()->acquire(5000, "offload.params h.0");
  ASSERT_TRUE(early.is_ok());
  register_pool_buffers(*pool.value(), device);
  ASSERT_EQ(device.registered.size(), 1u);
  EXPECT_EQ(device.registered.count(early->data()), 1u);
  EXPECT_EQ(device.registered[early->data()], early->mapped_bytes());
  {
    auto grads = pool.value()->acquire(100, "offload.grads h.0");
    auto state = pool.value()->acquire(100, "offload.optimizer h.0");
    auto slot = pool.value()->acquire(100, "offload.optimizer swap slot 0");
    auto ckpt = pool.value()->acquire(100, "gpt2.activation_checkpoints");
    device.fail_next = true;
    auto refused = pool.value()->acquire(100, "offload.nvme read staging");
    ASSERT_TRUE(grads.is_ok() && state.is_ok() && slot.is_ok() && ckpt.is_ok() && refused.is_ok());
    EXPECT_EQ(device.registered.size(), 5u);
    for (const auto* b : {&*grads, &*state, &*slot, &*ckpt}) EXPECT_EQ(device.registered.count(b->data()), 1u);
    EXPECT_EQ(device.registered.count(refused->data()), 0u);
    refused->as<char>()[99] = 1;  // still usable
  }
  EXPECT_EQ(device.registered.size(), 1u);
  early->reset();
  EXPECT_TRUE(device.registered.empty());
}

// The NVMe tier's engine gets the same buffers as io_uring fixed buffers (so its transfers do not pin their
// pages each time), next to the GPU's registration, and loses them before they are unmapped.
TEST(RegisterDeviceBuffersTest, RegistersThePoolWithTheIoEngineToo) {
  auto engine = UringEngine::create(EngineOptions{.kind = EngineKind::kUring, .lanes = 2, .queue_depth = 4});
  if (!engine.is_ok()) GTEST_SKIP() << "no io_uring here: " << engine.status().message();
  UringEngine& io = *engine.value();
  {
    std::vector<char> probe(4096);
    const Status st = io.add_buffer(probe.data(), probe.size());
    if (!st.is_ok()) GTEST_SKIP() << "io_uring fixed buffers are not available here: " << st.to_string();
    io.remove_buffer(probe.data());
  }
  RegisteringDevice device;
  auto pool = offload::PinnedPool::create(offload::PinnedPoolOptions{.budget_bytes = 16 << 20, .lock = false});
  ASSERT_TRUE(pool.is_ok());
  auto early = pool.value()->acquire(5000, "offload.params h.0");
  ASSERT_TRUE(early.is_ok());
  register_pool_buffers(*pool.value(), device, &io);
  EXPECT_EQ(io.fixed_buffers(), 1u);
  {
    auto slot = pool.value()->acquire(3 << 20, "offload.optimizer swap slot 0");
    ASSERT_TRUE(slot.is_ok());
    EXPECT_EQ(io.fixed_buffers(), 2u);
    EXPECT_EQ(device.registered.size(), 2u);
  }
  EXPECT_EQ(io.fixed_buffers(), 1u);
  early->reset();
  EXPECT_EQ(io.fixed_buffers(), 0u);
  EXPECT_TRUE(device.registered.empty());
}

}  // namespace
}  // namespace strata::engine
