// gpu_train_test.cpp — GPT-2 training steps on the "cuda" device against the same steps on the "cpu" device
// (fast kernels): same initialisation, same batches, AdamW with clipping. fp32 matches within fp32 tolerances
// (the kernels sum in different orders), bf16 within bf16 tolerances; GPU runs are bitwise reproducible; a
// checkpoint saved from the GPU and loaded back (on the GPU, and on the CPU) gives bitwise the same weights;
// offloaded training on the GPU matches the plain GPU run. Skips, saying why, where no GPU is usable.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"
#include "tests/engine/param_compare.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using kernels::MatmulPrecision;

const GPT2Config kConfig{.n_layer = 2, .n_head = 4, .n_embd = 64, .vocab_size = 211, .block_size = 48};
constexpr int kB = 3, kT = 37, kSteps = 8;

struct TrainRun {
  std::vector<float> losses;
  std::vector<float> init;    // every unit's parameters before the first step, on the host
  std::vector<float> params;  // and after the last
  uint64_t working_copies = 0;  // GPT2::working_copies_made
};

double update_distance(const TrainRun& a, const TrainRun& b) {
  return testing::update_distance(a.init, a.params, b.init, b.params);
}

TrainRun train(kernels::Device& device, MatmulPrecision precision, uint64_t seed = 5, bool working_copies = true) {
  TrainRun r;
  auto model = GPT2::create(kConfig, device, precision);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  GPT2& m = *model.value();
  m.set_working_copies(working_copies);
  EXPECT_TRUE(m.init_weights(seed).is_ok());
  r.init = testing::host_params(m);
  AdamWConfig ac;
  ac.grad_clip = 0.5f;  // low enough that clipping is active on some steps
  auto opt = AdamW::create(m.units(), ac, device);
  EXPECT_TRUE(opt.is_ok());
  Rng rng(seed + 1);
  std::vector<int32_t> x(kB * kT), y(kB * kT);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<int32_t>(rng.below(kConfig.vocab_size));
      y[i] = i % 11 == 4 ? -1 : static_cast<int32_t>(rng.below(kConfig.vocab_size));  // some ignored targets
    }
    EXPECT_TRUE(m.zero_grads().is_ok());
    auto loss = m.forward(x.data(), y.data(), kB, kT);
    EXPECT_TRUE(loss.is_ok());
    r.losses.push_back(loss.value());
    EXPECT_TRUE(m.backward().is_ok());
    opt->step(m.units(), 1e-3f);
  }
  r.params = testing::host_params(m);
  r.working_copies = m.working_copies_made();
  return r;
}

class GpuTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = kernels::make_device("cuda", kernels::cpu_fast_kernels());
    if (!d.is_ok()) GTEST_SKIP() << "no GPU to train on here: " << d.status().message();
    gpu_ = std::move(d).value();
    cpu_ = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    RecordProperty("device", gpu_->description());
  }
  std::unique_ptr<kernels::Device> gpu_, cpu_;
};

TEST_F(GpuTrainTest, Fp32StepsMatchTheCpu) {
  const TrainRun cpu = train(*cpu_, MatmulPrecision::kF32), gpu = train(*gpu_, MatmulPrecision::kF32);
  EXPECT_TRUE(testing::all_close(gpu.losses, cpu.losses, 1e-5, 1e-5, "losses"));
  // After 8 AdamW steps of lr 1e-3 a weight's path is a few ulps of rounding differences amplified by the
  // normalized update; 1e-4 absolute is ~0.5% of an lr-sized step.
  EXPECT_TRUE(testing::all_close(gpu.params, cpu.params, 1e-4, 1e-4, "params"));
  EXPECT_LT(cpu.losses.back(), cpu.losses.front()) << "the loss must fall over the steps";
}

// The GPU's bf16 mode also rounds attention's products, the logits and the hidden activations (the linears'
// inputs, qkv, the MLP's hidden units) and some of their gradients (the CPU keeps all of those fp32), so the
// runs differ by bf16 rounding. Parameters are compared by
// their total update, not element by element: Adam normalizes each gradient, so a parameter whose exact
// gradient is zero (the key bias: softmax ignores a constant added to a row of scores) takes lr-sized steps
// driven by rounding noise, differently on each side.
TEST_F(GpuTrainTest, Bf16StepsMatchTheCpu) {
  const TrainRun cpu = train(*cpu_, MatmulPrecision::kBF16), gpu = train(*gpu_, MatmulPrecision::kBF16);
  EXPECT_TRUE(testing::all_close(gpu.losses, cpu.losses, 1e-2, 1e-2, "losses"));
  const double d = update_distance(gpu, cpu);
  EXPECT_LT(d, 0.05) << "the GPU's updates are " << d << " of the CPU's away from them";
  const TrainRun other_seed = train(*cpu_, MatmulPrecision::kBF16, 6);
  EXPECT_GT(update_distance(other_seed, cpu), 0.5) << "the update distance does not tell different runs apart";
}

TEST_F(GpuTrainTest, GpuRunsAreBitwiseReproducible) {
  const TrainRun a = train(*gpu_, MatmulPrecision::kBF16), b = train(*gpu_, MatmulPrecision::kBF16);
  EXPECT_EQ(0, std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)));
}

// The units' bf16 working copies (Model::set_working_copies) change no bit of a GPU run (working_copy_test.cpp
// checks the same on the CPU, and cuda_matmul_test MatmulWorkingCopies that the GEMMs take them).
TEST_F(GpuTrainTest, WorkingCopiesTrainBitwiseAsWithout) {
  const TrainRun with = train(*gpu_, MatmulPrecision::kBF16), without = train(*gpu_, MatmulPrecision::kBF16, 5, false);
  EXPECT_GT(with.working_copies, 0u) << "no working copy was made: the comparison below says nothing";
  EXPECT_EQ(without.working_copies, 0u);
  EXPECT_EQ(0, std::memcmp(with.losses.data(), without.losses.data(), with.losses.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(with.params.data(), without.params.data(), with.params.size() * sizeof(float)));
}

TEST_F(GpuTrainTest, CheckpointRoundTripsThroughTheHost) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("strata_gpu_ckpt_{}", ::getpid())).string();
  auto model = GPT2::create(kConfig, *gpu_, MatmulPrecision::kF32);
  ASSERT_TRUE(model.is_ok());
  ASSERT_OK(model.value()->init_weights(9));
  auto opt = AdamW::create(model.value()->units(), AdamWConfig{}, *gpu_);
  ASSERT_TRUE(opt.is_ok());
  std::vector<int32_t> x(kB * kT, 3), y(kB * kT, 7);
  ASSERT_TRUE(model.value()->forward(x.data(), y.data(), kB, kT).is_ok());
  ASSERT_OK(model.value()->backward());
  opt->step(model.value()->units(), 1e-3f);  // non-zero moments to save
  TrainState state;
  state.step = 1;
  auto saved = save_checkpoint(dir, *model.value(), *opt, state, 0);
  ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
  const std::vector<float> want = testing::host_params(*model.value());

  for (kernels::Device* d : {gpu_.get(), cpu_.get()}) {
    auto other = GPT2::create(kConfig, *d, MatmulPrecision::kF32);
    ASSERT_TRUE(other.is_ok());
    auto other_opt = AdamW::create(other.value()->units(), AdamWConfig{}, *d);
    ASSERT_TRUE(other_opt.is_ok());
    auto st = load_checkpoint(saved.value(), *other.value(), *other_opt);
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    const std::vector<float> got = testing::host_params(*other.value());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "on " << d->name();
  }
  std::filesystem::remove_all(dir);
}

// Offloaded training on the GPU: the optimizer in host memory, the parameters too, both on NVMe (with host
// activation checkpoints and a live-parameter cap that forces evictions), and the first units kept on the
// device (offload_optimizer.ratio). The placements run the same CUDA
// kernels and the same CPU Adam, so they are bitwise one run; against the plain GPU run (Adam as a CUDA kernel)
// they agree within fp32 rounding.
class GpuOffloadTrainTest : public TrainerTest {
 protected:
  void SetUp() override {
    TrainerTest::SetUp();
    auto d = kernels::make_device("cuda", kernels::cpu_fast_kernels());
    if (!d.is_ok()) GTEST_SKIP() << "no GPU to train on here: " << d.status().message();
  }
  json config(const std::string& run, json zero, const json& checkpoints = json()) const {
    json j = base_config(run);
    j["model"]["n_layer"] = 4;
    j["compute"]["device"] = "cuda";
    for (const char* t : {"offload_param", "offload_optimizer"}) {
      if (zero.contains(t) && zero[t].value("device", "") == "nvme") zero[t]["nvme_path"] = (dir_ / "swap").string();
    }
    if (!zero.is_null()) j["zero_optimization"] = zero;
    if (!checkpoints.is_null()) j["activation_checkpointing"] = checkpoints;
    return j;
  }
  void run(const std::string& name, const json& j) {
    auto r = train(j, "", (dir_ / (name + ".jsonl")).string());
    ASSERT_TRUE(r.is_ok()) << name << ": " << r.status().to_string();
  }
  // One offload counter summed over a run's steps.
  double total(const std::string& name, const char* key) const {
    std::ifstream in(dir_ / (name + ".jsonl"));
    double sum = 0;
    for (std::string line; std::getline(in, line);) sum += json::parse(line).at("offload").at(key).get<double>();
    return sum;
  }
};

TEST_F(GpuOffloadTrainTest, EveryPlacementIsOneRunAndMatchesThePlainGpuRun) {
  run("plain", config("plain", json()));
  const json opt_cpu = {{"device", "cpu"}}, opt_nvme = {{"device", "nvme"}};
  const std::vector<std::pair<std::string, json>> placements = {
      {"optimizer_cpu", {{"stage", 2}, {"offload_optimizer", opt_cpu}}},
      {"params_cpu",
       {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}, {"offload_optimizer", opt_cpu},
        {"stage3_param_persistence_threshold", 0}}},
      {"params_nvme_optimizer_nvme",
       {{"stage", 3}, {"offload_param", {{"device", "nvme"}, {"buffer_count", 2}}}, {"offload_optimizer", opt_nvme},
        {"stage3_param_persistence_threshold", 100}, {"sub_group_size", 3000},
        {"stage3_max_live_parameters", 20000}, {"stage3_prefetch_bucket_size", 15000}}},
      // The embedding and h.0 kept whole on the device (updated by the CUDA AdamW, the rest by the CPU Adam): the
      // plain run's numbers within rounding, not the others' bits.
      {"optimizer_cpu_ratio", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.6}}}}},
  };
  const auto plain = losses(dir_ / "plain.jsonl");
  ASSERT_EQ(plain.size(), 6u);
  for (const auto& [name, zero] : placements) {
    SCOPED_TRACE(name);
    run(name, config(name, zero, name == "params_nvme_optimizer_nvme" ? json{{"enabled", true},
                                                                             {"cpu_checkpointing", true}}
                                                                       : json()));
    const auto got = losses(dir_ / (name + ".jsonl"));
    ASSERT_EQ(got.size(), plain.size());
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_NEAR(got[s].first, plain[s].first, 1e-4 * std::abs(plain[s].first)) << "loss of step " << s + 1;
      EXPECT_NEAR(got[s].second, plain[s].second, 1e-4 * std::abs(plain[s].second)) << "grad norm of step " << s + 1;
    }
    EXPECT_GT(total(name, "d2h_bytes"), 0) << "gradients came home";
    if (name != "optimizer_cpu") {
      EXPECT_GT(total(name, "h2d_bytes"), 0) << "parameters were uploaded";
    }
    if (name == placements.front().first || name == "optimizer_cpu_ratio") continue;
    EXPECT_EQ(got, losses(dir_ / (placements.front().first + ".jsonl")));
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      EXPECT_TRUE(file_bytes(dir_ / placements.front().first / "step_000006" / f) ==
                  file_bytes(dir_ / name / "step_000006" / f))
          << f << " differs from " << placements.front().first << "'s";
    }
  }
}

}  // namespace
}  // namespace strata::engine
