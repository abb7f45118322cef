// working_copy_test.cpp — the units' bf16 working copies of their parameters (Model::set_working_copies, kernels.h
// Weight): training with them is bitwise training without them, across optimizer steps, gradient accumulation,
// activation recompute, forwards without targets and loads of new weights; and a copy is made once per change
// of a unit's parameters, not once per use. A copy left stale after the parameters change (a writer that does not
// say so) makes the next forward use the old weights, and the runs below part.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/matmul_info.h"
#include "kernels/device.h"
#include "tests/engine/hidden_form_backend.h"
#include "tests/engine/param_compare.h"

namespace strata::engine {
namespace {

using kernels::KernelSet;
using kernels::MatmulPrecision;

const GPT2Config kConfig{.n_layer = 3, .n_head = 4, .n_embd = 64, .vocab_size = 211, .block_size = 40};
constexpr int kB = 3, kT = 37, kSteps = 4, kMicroBatches = 2;

struct TrainRun {
  std::vector<float> losses;  // every micro-batch's
  std::vector<float> params;  // after the last step
  uint64_t copies_made = 0;   // GPT2::working_copies_made
  size_t units = 0;
};

// kSteps optimizer steps of kMicroBatches micro-batches each; after step 1 a forward without targets (an
// evaluation's), after step 2 new weights for block 1 written in (a load), both before the next step.
TrainRun train(const KernelSet& k, bool working_copies, ActivationCheckpointing ckpt) {
  TrainRun r;
  auto device = kernels::make_cpu_device(k);
  auto model = GPT2::create(kConfig, *device, MatmulPrecision::kBF16);
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  GPT2& m = *model.value();
  m.set_activation_checkpointing(ckpt);
  m.set_working_copies(working_copies);
  EXPECT_TRUE(m.init_weights(11).is_ok());
  auto opt = AdamW::create(m.units(), AdamWConfig{}, *device);
  EXPECT_TRUE(opt.is_ok());
  Rng rng(12);
  std::vector<int32_t> x(kB * kT), y(kB * kT);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_TRUE(m.zero_grads().is_ok());
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      testing::hidden_form::random_batch(rng, kConfig.vocab_size, &x, &y);
      auto loss = m.forward(x.data(), y.data(), kB, kT);
      EXPECT_TRUE(loss.is_ok()) << loss.status().to_string();
      r.losses.push_back(loss.is_ok() ? loss.value() : NAN);
      EXPECT_TRUE(m.backward(1.0f / kMicroBatches).is_ok());
    }
    opt->step(m.units(), 1e-2f);
    if (s == 1) {
      EXPECT_TRUE(m.forward(x.data(), nullptr, kB, kT).is_ok());
    }
    if (s == 2) {
      std::vector<float> w(m.units()[2].numel());
      Rng wr(13);
      for (float& v : w) v = 0.05f * static_cast<float>(wr.normal());
      EXPECT_TRUE(m.write_params(2, w.data()).is_ok());
    }
  }
  r.params = testing::host_params(m);
  r.copies_made = m.working_copies_made();
  r.units = m.units().size();
  return r;
}

void expect_bitwise(const TrainRun& with, const TrainRun& without) {
  ASSERT_EQ(with.losses.size(), without.losses.size());
  for (size_t i = 0; i < with.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&with.losses[i], &without.losses[i], sizeof(float)), 0)
        << "micro-batch " << i << ": loss " << with.losses[i] << " with working copies, " << without.losses[i]
        << " without";
  }
  ASSERT_EQ(with.params.size(), without.params.size());
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < with.params.size(); ++i) {
    if (std::memcmp(&with.params[i], &without.params[i], sizeof(float)) == 0) continue;
    if (differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << "parameters differ, the first at " << first << ": " << with.params[first] << " vs "
                        << without.params[first];
}

TEST(WorkingCopyTest, TrainsBitwiseAsWithout) {
  if (!kernels::cpu::matmul_bf16_native())
    GTEST_SKIP() << "oneDNN has no bf16 matmul here (no AVX-512): the fast matmuls round to fp32 and take no copy";
  for (const KernelSet* k : {&testing::hidden_form::fast(), &testing::hidden_form::bf16_hidden_kernels()}) {
    for (ActivationCheckpointing ckpt : {ActivationCheckpointing::kNone, ActivationCheckpointing::kDevice}) {
      SCOPED_TRACE(std::string(k->name) + (ckpt == ActivationCheckpointing::kNone ? "" : ", recompute"));
      const TrainRun with = train(*k, true, ckpt), without = train(*k, false, ckpt);
      expect_bitwise(with, without);
      // Each unit with linears (all but the final layernorm) once per change of its parameters that a forward
      // followed: the initial weights and each step but the last (the unit written after step 2 changed with
      // that step too); not once per micro-batch, recompute or forward.
      EXPECT_EQ(with.copies_made, kSteps * (with.units - 1));
      EXPECT_EQ(without.copies_made, 0u);
    }
  }
}

// The copies are what the linears use: a unit whose copy holds other numbers gives other losses. (Guards the
// test above against passing because nothing took the copies.)
TEST(WorkingCopyTest, TheLinearsReadTheCopy) {
  if (!kernels::cpu::matmul_bf16_native()) GTEST_SKIP() << "oneDNN has no bf16 matmul here (no AVX-512)";
  auto device = kernels::make_cpu_device(testing::hidden_form::fast());
  auto model = GPT2::create(kConfig, *device, MatmulPrecision::kBF16);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  GPT2& m = *model.value();
  ASSERT_TRUE(m.init_weights(11).is_ok());
  Rng rng(12);
  std::vector<int32_t> x(kB * kT), y(kB * kT);
  testing::hidden_form::random_batch(rng, kConfig.vocab_size, &x, &y);
  auto first = m.forward(x.data(), y.data(), kB, kT);
  ASSERT_TRUE(first.is_ok());
  // Block 0's copy, scaled by 2 behind the model's back (it stays "current"): the next forward must change.
  const Unit& u = m.units()[1];
  ASSERT_TRUE(u.params16_current);
  auto* w16 = u.params16.as<uint16_t>();
  for (size_t i = 0; i < u.numel(); ++i) w16[i] = f32_to_bf16(2.0f * bf16_to_f32(w16[i]));
  auto second = m.forward(x.data(), y.data(), kB, kT);
  ASSERT_TRUE(second.is_ok());
  EXPECT_NE(first.value(), second.value());
  // And a write through p_for_update() makes the copy again, from the fp32 parameters: the first loss back.
  std::vector<float> h(u.numel());
  ASSERT_TRUE(m.read_params(1, h.data()).is_ok());
  ASSERT_TRUE(m.write_params(1, h.data()).is_ok());
  auto third = m.forward(x.data(), y.data(), kB, kT);
  ASSERT_TRUE(third.is_ok());
  EXPECT_EQ(first.value(), third.value());
}

// A device budget with room for the embedding's copy but not a block's: the first refusal stops the copies (one
// warning), the embedding keeps its copy, and training goes on with the same numbers.
TEST(WorkingCopyTest, ABudgetWithoutRoomStopsTheCopiesNotTheRun) {
  if (!kernels::cpu::matmul_bf16_native()) GTEST_SKIP() << "oneDNN has no bf16 matmul here (no AVX-512)";
  auto run = [](bool working_copies, bool tight, uint64_t* made) {
    auto device = kernels::make_cpu_device(testing::hidden_form::fast());
    auto model = GPT2::create(kConfig, *device, MatmulPrecision::kBF16);
    EXPECT_TRUE(model.is_ok()) << model.status().to_string();
    GPT2& m = *model.value();
    m.set_working_copies(working_copies);
    EXPECT_TRUE(m.reserve_activations(kB, kT).is_ok());
    EXPECT_TRUE(m.init_weights(11).is_ok());
    auto opt = AdamW::create(m.units(), AdamWConfig{}, *device);
    EXPECT_TRUE(opt.is_ok());
    const size_t emb = m.units()[0].numel() * sizeof(uint16_t), block = m.units()[1].numel() * sizeof(uint16_t);
    EXPECT_LT(emb, block);
    if (tight) device->set_memory_limit(device->live_bytes() + emb + (block - emb) / 2);
    Rng rng(12);
    std::vector<int32_t> x(kB * kT), y(kB * kT);
    std::vector<float> losses;
    for (int s = 0; s < 3; ++s) {
      testing::hidden_form::random_batch(rng, kConfig.vocab_size, &x, &y);
      EXPECT_TRUE(m.zero_grads().is_ok());
      auto loss = m.forward(x.data(), y.data(), kB, kT);
      EXPECT_TRUE(loss.is_ok()) << loss.status().to_string();
      losses.push_back(loss.is_ok() ? loss.value() : NAN);
      EXPECT_TRUE(m.backward().is_ok());
      opt->step(m.units(), 1e-2f);
    }
    EXPECT_TRUE(m.units()[0].params16.size() > 0 || !working_copies);
    EXPECT_EQ(m.units()[1].params16.size(), 0u);
    *made = m.working_copies_made();
    return losses;
  };
  uint64_t made_tight = 0, made_none = 0;
  const std::vector<float> tight = run(true, true, &made_tight), none = run(false, false, &made_none);
  ASSERT_EQ(tight.size(), none.size());
  EXPECT_EQ(std::memcmp(tight.data(), none.data(), tight.size() * sizeof(float)), 0);
  EXPECT_EQ(made_tight, 3u) << "the embedding's copy, once a step";
  EXPECT_EQ(made_none, 0u);
}

// The reference backend uses no copies, so the model keeps none for it; nor under fp32; nor the fast one where
// oneDNN has no native bf16 matmul (its matmuls round to fp32 values, not bf16 bits).
TEST(WorkingCopyTest, KeptOnlyWhereUsed) {
  auto ref = GPT2::create(kConfig, kernels::cpu_reference_kernels(), MatmulPrecision::kBF16);
  ASSERT_TRUE(ref.is_ok());
  EXPECT_FALSE(ref.value()->keeps_working_copies());
  auto f32 = GPT2::create(kConfig, kernels::cpu_fast_kernels(), MatmulPrecision::kF32);
  ASSERT_TRUE(f32.is_ok());
  EXPECT_FALSE(f32.value()->keeps_working_copies());
  auto bf16 = GPT2::create(kConfig, kernels::cpu_fast_kernels(), MatmulPrecision::kBF16);
  ASSERT_TRUE(bf16.is_ok());
  EXPECT_EQ(bf16.value()->keeps_working_copies(), kernels::cpu::matmul_bf16_native());
}

}  // namespace
}  // namespace strata::engine
