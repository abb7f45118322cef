// Offloaded training that is refused or fails, by name and with nothing half-done: configurations and budgets
// refused at start (parameters offloaded without the optimizer, host and device budgets too small for the state,
// the spares or the activations, and the spares' sizes), and reads of the optimizer's swap files damaged between
// two steps, failing the step that needed them. The placements trained bitwise the plain run: offload_train_test.cpp.
#include <chrono>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model/gpt2/gpt2.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/matmul_info.h"
#include "tests/engine/offload_train_fixture.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

// A model and its offload runtime driven step by step (the trainer's calls, in its order), for tests that
// damage the optimizer's swap files between two calls.
struct SteppedRun {
  std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
  std::unique_ptr<GPT2> model;
  std::unique_ptr<OffloadRuntime> runtime;
  static constexpr int B = 2, T = 16;
  std::vector<int32_t> x = std::vector<int32_t>(B * T), y = std::vector<int32_t>(B * T);
  fs::path swap;

  Status open(const json& j, float grad_clip) {
    STRATA_ASSIGN_OR_RETURN(const RunConfig c, parse_run_config(j, "test"));
    STRATA_ASSIGN_OR_RETURN(model, GPT2::create(c.model.gpt2, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true));
    AdamWConfig adam;
    adam.grad_clip = grad_clip;
    STRATA_ASSIGN_OR_RETURN(runtime, OffloadRuntime::create(c.offload, adam, *device, *model));
    STRATA_RETURN_IF_ERROR(model->init_weights(1));
    for (int i = 0; i < B * T; ++i) x[i] = (i * 7) % kVocab, y[i] = (i * 7 + 7) % kVocab;
    return optimizer().adopt_params();
  }
  Optimizer& optimizer() { return runtime->optimizer(); }
  offload::OffloadedAdamW& offloaded() { return runtime->offloaded_optimizer(); }
  void damage_swap_files() const { testing::damage_files_under(swap); }
  // Forward, then the last update's completion, `between` (if any), then the step's backward (no step()).
  Status forward_and_backward(const std::function<void()>& between) {
    STRATA_RETURN_IF_ERROR(model->zero_grads());
    STRATA_RETURN_IF_ERROR(model->forward(x.data(), y.data(), B, T).status());
    STRATA_RETURN_IF_ERROR(optimizer().finish());  // the last update complete: its writes are on disk
    if (between) between();
    STRATA_RETURN_IF_ERROR(optimizer().begin_last_backward(1e-3f));
    return model->backward(1.0f);
  }
  Result<double> step(bool damage) {
    STRATA_RETURN_IF_ERROR(forward_and_backward(damage ? [this] { damage_swap_files(); } : std::function<void()>()));
    bool skipped = false;
    return optimizer().step(1e-3f, &skipped);
  }
  // Waits up to 10 s for the update in flight to end (it failed, or finished).
  bool wait_for_update_end() {
    for (int i = 0; i < 10000 && !offloaded().update_ended(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return offloaded().update_ended();
  }
};

// After a clipped step the next update reads its first sub-groups' state during backward, before its scale is
// known. A read that fails there (the swap files damaged in between) is the step's error, naming the
// optimizer's key, never a silently skipped update.
TEST_F(OffloadTrainTest, AReadFailingBeforeTheScaleIsKnownFailsTheStep) {
  json j = config("gated_fault", {{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}}}, {"sub_group_size", 3000}});
  j["training"]["grad_clip"] = 1e-6;  // every step clips
  SteppedRun r;
  r.swap = dir_ / "swap";
  ASSERT_TRUE(r.open(j, 1e-6f).is_ok());
  Optimizer& opt = r.optimizer();
  auto step = [&](bool damage) { return r.step(damage); };
  ASSERT_TRUE(step(false).is_ok());  // clipped: the next step's update is gated
  // step() returns the error when the reads have failed by then; if they are still in flight it opens the
  // gate, and the error comes with the update's publication (here finish(), in training the next forward).
  Status error = step(true).status();
  if (error.is_ok()) error = opt.finish();
  ASSERT_FALSE(error.is_ok()) << "the damaged state was read before the step's scale was known";
  // The read's own error, naming the key, not a later symptom ("sub-groups were never published").
  EXPECT_NE(error.to_string().find("checksum mismatch"), std::string::npos) << error.to_string();
  EXPECT_NE(error.to_string().find("opt.wte.0"), std::string::npos) << error.to_string();

  // A gated update whose reads failed, then cancelled without its step() (a checkpoint, or an error before
  // step(), calls finish()): the read's error, not "nothing happened".
  ASSERT_TRUE(opt.adopt_params().is_ok());  // state written afresh
  ASSERT_TRUE(step(false).is_ok());         // clipped: the next update is gated
  ASSERT_TRUE(r.model->zero_grads().is_ok());
  ASSERT_TRUE(r.model->forward(r.x.data(), r.y.data(), r.B, r.T).is_ok());
  ASSERT_TRUE(opt.finish().is_ok());
  r.damage_swap_files();
  ASSERT_TRUE(opt.begin_last_backward(1e-3f).is_ok());
  ASSERT_TRUE(r.wait_for_update_end()) << "the gated update's first read should have failed within 10 s";
  const Status cancelled = opt.finish();
  EXPECT_NE(cancelled.to_string().find("checksum mismatch"), std::string::npos) << cancelled.to_string();
}

// An update started during backward (assuming no clip) whose state cannot be read there (the swap files damaged
// in between) fails its step with the read's error, said to be the updates during backward's, instead of being
// confirmed with the state of before it, and the model keeps the parameters of before the step. (With step()
// not looking at the worker's failure, it returned the norm: this test failed.)
TEST_F(OffloadTrainTest, AnUpdateFailingDuringBackwardFailsItsStep) {
  json j = config("speculative_fault",
                  {{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}}}, {"sub_group_size", 3000}});
  SteppedRun r;
  r.swap = dir_ / "swap";
  ASSERT_TRUE(r.open(j, /*grad_clip=*/0.0f).is_ok());
  ASSERT_TRUE(r.step(false).is_ok());  // not clipped: the next update starts during backward
  std::vector<std::vector<float>> before(r.model->units().size());
  ASSERT_TRUE(r.forward_and_backward([&] {
                 for (size_t u = 0; u < before.size(); ++u) {
                   before[u].resize(r.model->units()[u].numel());
                   ASSERT_TRUE(r.model->read_params(u, before[u].data()).is_ok());
                 }
                 r.damage_swap_files();
               }).is_ok());
  ASSERT_TRUE(r.wait_for_update_end()) << "the update's reads should have failed within 10 s";
  bool skipped = false;
  const Result<double> norm = r.optimizer().step(1e-3f, &skipped);
  ASSERT_FALSE(norm.is_ok()) << "a step whose update failed must fail";
  const std::string error = norm.status().to_string();
  EXPECT_NE(error.find("checksum mismatch"), std::string::npos) << error;
  EXPECT_NE(error.find("during backward"), std::string::npos) << error;
  EXPECT_TRUE(r.offloaded().last_speculation().started);
  for (size_t u = 0; u < before.size(); ++u) {
    std::vector<float> now(before[u].size());
    ASSERT_TRUE(r.model->read_params(u, now.data()).is_ok());
    EXPECT_TRUE(now == before[u]) << r.model->units()[u].name << " keeps parameters of the failed update";
  }
}

TEST_F(OffloadTrainTest, ParamOffloadWithoutOptimizerOffloadIsRefusedByName) {
  json zero = {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}};
  auto r = train(config("bad", zero));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("offload_optimizer.device"), std::string::npos) << r.status().to_string();
}

TEST_F(OffloadTrainTest, AHostBudgetTooSmallForTheStateFailsAtStartNamingIt) {
  json j = config("small", placements()[2]);
  j["memory"] = {{"host_memory_limit", "64KiB"}};
  auto r = train(j);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory) << r.status().to_string();
  EXPECT_NE(r.status().to_string().find("offload."), std::string::npos) << r.status().to_string();
}

// The spare buffers of speculative sub-groups come out of the host budget: a budget the state fits in, but not
// the spares as well, fails at start naming the key (and trains without them).
TEST_F(OffloadTrainTest, SpareBuffersBeyondTheHostBudgetFailAtStartNamingTheKey) {
  json z = placements()[2].zero;  // the optimizer in host memory
  z["sub_group_size"] = 3000;
  json j = config("spares", z);
  // Measured: the run needs between 0.75 and 1 MiB, with 1000 spares (one per sub-group) between 1.5 and 2.
  j["memory"] = {{"host_memory_limit", "1280KiB"}};
  j["training"]["max_steps"] = 1;
  run("spares", j);
  j["zero_optimization"]["offload_optimizer"]["speculative_sub_groups"] = 1000;
  j["training"]["checkpoint_dir"] = (dir_ / "spares2").string();
  auto r = train(j);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory) << r.status().to_string();
  EXPECT_NE(r.status().to_string().find("offload_optimizer.speculative_sub_groups = 1000"), std::string::npos)
      << r.status().to_string();
}

// The spares are the sizes of the sub-groups a backward updates first (the model's last units: ln_f, then the
// last block), not N copies of the largest: with one sub-group per unit, 2 spares hold ln_f's and a block's
// state, and spares for every sub-group as much as the state itself. (As N buffers of the largest sub-group,
// they took 2 and 6 blocks' worth.)
TEST_F(OffloadTrainTest, SpareBuffersAreTheSizesOfTheFirstSubGroupsABackwardUpdates) {
  auto spare_bytes = [&](size_t spares) -> int64_t {
    json z = placements()[2].zero;  // the optimizer in host memory, one sub-group per unit
    z["offload_optimizer"]["speculative_sub_groups"] = spares;
    auto c = parse_run_config(config("sizes", z), "test");
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    auto model = GPT2::create(c->model.gpt2, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true);
    EXPECT_TRUE(model.is_ok()) << model.status().to_string();
    auto rt = OffloadRuntime::create(c->offload, AdamWConfig{}, *device, **model);
    EXPECT_TRUE(rt.is_ok()) << rt.status().to_string();
    return rt.is_ok() ? static_cast<int64_t>((*rt)->pool().used_bytes()) : -1;
  };
  const int64_t none = spare_bytes(0), two = spare_bytes(2), all = spare_bytes(1000);
  constexpr int64_t kPage = 4096, kLnF = 2 * 32, kBlock = 12 * 32 * 32 + 13 * 32, kParams = 3616 + 4 * kBlock + kLnF;
  const int64_t first_two = 12 * (kLnF + kBlock);
  EXPECT_GE(two - none, first_two);
  EXPECT_LE(two - none, first_two + 2 * kPage) << "2 spares: ln_f's and the last block's state";
  EXPECT_GE(all - none, 12 * kParams);
  EXPECT_LE(all - none, 12 * kParams + 6 * kPage) << "a spare for every sub-group: as much as the state";
}

TEST_F(OffloadTrainTest, ADeviceBudgetTooSmallForTheActivationsFailsBeforeAnyWeightIsWritten) {
  json j = config("tight", placements()[5]);  // parameters and optimizer on nvme: writing them is the slow part
  j["memory"] = {{"device_memory_limit", "40K"}};
  auto r = train(j);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory) << r.status().to_string();
  EXPECT_NE(r.status().to_string().find("activations for training.batch_size 2 x training.seq_len 16"),
            std::string::npos)
      << r.status().to_string();
}

}  // namespace
}  // namespace strata::engine
