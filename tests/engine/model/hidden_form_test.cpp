// hidden_form_test.cpp — the model's handling of hidden activations (kernels.h: the linears' inputs, qkv, the
// attention's output, the MLP's hidden units and some of their gradients, kept in a form only the backend reads)
// on the CPU, where the backends keep them fp32. The test backend of hidden_form_backend.h keeps them in bf16, as
// CUDA does, so the sizes, per-layer offsets and strides GPT2 uses for them, and which slot reads or writes which,
// are checked here without a GPU: a float offset where a hidden one belongs, or an fp32 read of a bf16 buffer,
// makes the runs below diverge or read garbage.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"
#include "tests/engine/hidden_form_backend.h"
#include "tests/engine/param_compare.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using kernels::KernelSet;
using kernels::MatmulPrecision;
using testing::hidden_form::bf16_hidden_kernels;
using testing::hidden_form::fast;

// Widths that are multiples of 8 (C = 64, 3C, 4C), so every hidden activation is bf16 under kBF16.
const GPT2Config kConfig{.n_layer = 3, .n_head = 4, .n_embd = 64, .vocab_size = 211, .block_size = 40};
constexpr int kB = 3, kT = 37, kSteps = 6;

struct TrainRun {
  std::vector<float> losses;
  std::vector<float> init, params;  // every unit's parameters, before the first step and after the last
  uint64_t activation_bytes = 0;    // the device memory the first forward added
};


TrainRun train(const KernelSet& k, ActivationCheckpointing ckpt = ActivationCheckpointing::kNone) {
  TrainRun r;
  auto device = kernels::make_cpu_device(k);
  auto model = GPT2::create(kConfig, *device, MatmulPrecision::kBF16);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  GPT2& m = *model.value();
  m.set_activation_checkpointing(ckpt);
  EXPECT_TRUE(m.init_weights(7).is_ok());
  r.init = testing::host_params(m);
  auto opt = AdamW::create(m.units(), AdamWConfig{}, *device);
  EXPECT_TRUE(opt.is_ok());
  Rng rng(8);
  std::vector<int32_t> x(kB * kT), y(kB * kT);
  for (int s = 0; s < kSteps; ++s) {
    testing::hidden_form::random_batch(rng, kConfig.vocab_size, &x, &y);
    EXPECT_TRUE(m.zero_grads().is_ok());
    const uint64_t before = device->live_bytes();
    auto loss = m.forward(x.data(), y.data(), kB, kT);
    EXPECT_TRUE(loss.is_ok()) << loss.status().to_string();
    if (s == 0) r.activation_bytes = device->live_bytes() - before;
    r.losses.push_back(loss.is_ok() ? loss.value() : NAN);
    EXPECT_TRUE(m.backward().is_ok());
    opt->step(m.units(), 1e-3f);
  }
  r.params = testing::host_params(m);
  return r;
}

double update_distance(const TrainRun& a, const TrainRun& b) {
  return testing::update_distance(a.init, a.params, b.init, b.params);
}

// Training with every hidden activation in bf16 follows training with them in fp32 within bf16 rounding, and
// keeps less on the device; a run that read a bf16 buffer as floats (or at a float offset) would not.
TEST(HiddenFormTest, Bf16HiddenActivationsTrainLikeFp32Ones) {
  ASSERT_EQ(bf16_hidden_kernels().hidden_bytes(10, 64, MatmulPrecision::kBF16), 10u * 64 * 2);
  const TrainRun f32 = train(fast()), bf16 = train(bf16_hidden_kernels());
  EXPECT_TRUE(testing::all_close(bf16.losses, f32.losses, 1e-2, 1e-2, "losses"));
  EXPECT_NE(bf16.losses, f32.losses) << "the bf16 hidden form did not round anything";
  const double d = update_distance(bf16, f32);
  EXPECT_LT(d, 0.05) << "the bf16 run's updates are " << d << " of the fp32 run's away from them";
  // ln1, ln2, qkv, atty, fch, fch_gelu per layer, lnf, and the gradients datty, dqkv, dfch, dfch_gelu: half the
  // bytes each.
  EXPECT_LT(bf16.activation_bytes, f32.activation_bytes);
}

// Recomputing blocks from checkpoints writes their hidden activations again at the same offsets: the same
// training, step by step.
TEST(HiddenFormTest, RecomputedBlocksMatchKeptOnes) {
  const TrainRun kept = train(bf16_hidden_kernels());
  const TrainRun recomputed = train(bf16_hidden_kernels(), ActivationCheckpointing::kDevice);
  EXPECT_TRUE(testing::all_close(recomputed.losses, kept.losses, 1e-6, 1e-6, "losses"));
  EXPECT_LT(update_distance(recomputed, kept), 1e-4);
}

}  // namespace
}  // namespace strata::engine
