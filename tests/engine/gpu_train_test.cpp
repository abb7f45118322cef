// gpu_train_test.cpp — GPT-2 training steps on the "cuda" device against the same steps on the "cpu" device
// (fast kernels): same initialisation, same batches, AdamW with clipping. fp32 matches within fp32 tolerances
// (the kernels sum in different orders), bf16 within bf16 tolerances; GPU runs are bitwise reproducible; a
// checkpoint saved from the GPU and loaded back (on the GPU, and on the CPU) gives bitwise the same weights.
// Skips, saying why, where no GPU is usable.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/rng.h"
#include "engine/checkpoint.h"
#include "engine/gpt2.h"
#include "engine/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"
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
};

// ‖(a.params − a.init) − (b.params − b.init)‖ / ‖b.params − b.init‖: how far apart the two runs' total updates are.
double update_distance(const TrainRun& a, const TrainRun& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    const double ua = double(a.params[i]) - a.init[i], ub = double(b.params[i]) - b.init[i];
    diff += (ua - ub) * (ua - ub);
    norm += ub * ub;
  }
  return std::sqrt(diff / norm);
}

std::vector<float> host_params(const GPT2& m) {
  std::vector<float> out;
  for (const Unit& u : m.units()) {
    std::vector<float> h(u.numel());
    m.device().copy_to_host(h.data(), u.p(), h.size() * sizeof(float));
    out.insert(out.end(), h.begin(), h.end());
  }
  return out;
}

TrainRun train(kernels::Device& device, MatmulPrecision precision, uint64_t seed = 5) {
  TrainRun r;
  auto model = GPT2::create(kConfig, device, precision);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  GPT2& m = *model.value();
  EXPECT_TRUE(m.init_gpt2(seed).is_ok());
  r.init = host_params(m);
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
  r.params = host_params(m);
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

// The GPU's bf16 mode also rounds attention's products (the CPU's attention stays fp32), so the runs differ by
// bf16 rounding. Parameters are compared by their total update, not element by element: Adam normalizes each
// gradient, so a parameter whose exact gradient is zero (the key bias: softmax ignores a constant added to a
// row of scores) takes lr-sized steps driven by rounding noise, differently on each side.
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

TEST_F(GpuTrainTest, CheckpointRoundTripsThroughTheHost) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("strata_gpu_ckpt_{}", ::getpid())).string();
  auto model = GPT2::create(kConfig, *gpu_, MatmulPrecision::kF32);
  ASSERT_TRUE(model.is_ok());
  ASSERT_OK(model.value()->init_gpt2(9));
  auto opt = AdamW::create(model.value()->units(), AdamWConfig{}, *gpu_);
  ASSERT_TRUE(opt.is_ok());
  std::vector<int32_t> x(kB * kT, 3), y(kB * kT, 7);
  ASSERT_TRUE(model.value()->forward(x.data(), y.data(), kB, kT).is_ok());
  ASSERT_OK(model.value()->backward());
  opt->step(model.value()->units(), 1e-3f);  // non-zero moments to save
  auto saved = save_checkpoint(dir, *model.value(), *opt, TrainState{.step = 1, .train_pos = {}, .config = {}}, 0);
  ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
  const std::vector<float> want = host_params(*model.value());

  for (kernels::Device* d : {gpu_.get(), cpu_.get()}) {
    auto other = GPT2::create(kConfig, *d, MatmulPrecision::kF32);
    ASSERT_TRUE(other.is_ok());
    auto other_opt = AdamW::create(other.value()->units(), AdamWConfig{}, *d);
    ASSERT_TRUE(other_opt.is_ok());
    auto st = load_checkpoint(saved.value(), *other.value(), *other_opt);
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    const std::vector<float> got = host_params(*other.value());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "on " << d->name();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::engine
