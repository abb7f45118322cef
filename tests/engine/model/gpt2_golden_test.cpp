// The llm.c-style golden test: the tiny GPT-2 of scripts/make_gpt2_fixture.py, built in PyTorch, against ours —
// logits, loss, every gradient, and ten AdamW steps with clipping — on every CPU kernel set.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model/gpt2/gpt2.h"
#include "engine/optim/optimizer.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

struct Fixture {
  GPT2Config config;
  int B = 0, T = 0, n_steps = 0;
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, wd = 0, clip = 0;
  std::vector<float> params, logits, grads, losses;
  std::vector<int32_t> x, y;
  float loss = 0;
};

bool read_fixture(Fixture* f, std::string* error) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/gpt2_tiny.bin";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot open " + path;
    return false;
  }
  int32_t h[256];
  float hyper[64];
  in.read(reinterpret_cast<char*>(h), sizeof(h));
  in.read(reinterpret_cast<char*>(hyper), sizeof(hyper));
  if (!in || h[0] != 20261101 || h[1] != 1) {
    *error = path + ": bad magic/version (regenerate with scripts/make_gpt2_fixture.py)";
    return false;
  }
  f->config = GPT2Config{h[2], h[3], h[4], h[5], h[6]};
  f->B = h[7];
  f->T = h[8];
  f->n_steps = h[9];
  const size_t np = static_cast<size_t>(h[10]), bt = static_cast<size_t>(f->B) * f->T;
  f->lr = hyper[0], f->beta1 = hyper[1], f->beta2 = hyper[2], f->eps = hyper[3], f->wd = hyper[4], f->clip = hyper[5];
  auto rd = [&](auto& v, size_t n) {
    v.resize(n);
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(v[0])));
  };
  rd(f->params, np);
  rd(f->x, bt);
  rd(f->y, bt);
  rd(f->logits, bt * f->config.vocab_size);
  in.read(reinterpret_cast<char*>(&f->loss), sizeof(float));
  rd(f->grads, np);
  rd(f->losses, static_cast<size_t>(f->n_steps));
  if (!in || in.peek() != EOF) {
    *error = path + ": truncated or longer than its header says";
    return false;
  }
  return true;
}

class GoldenTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::string error;
    ASSERT_TRUE(read_fixture(&fx_, &error)) << error;
    const kernels::KernelSet* k = kernels::find_kernel_set(GetParam());
    ASSERT_NE(k, nullptr);
    auto m = GPT2::create(fx_.config, *k, kernels::MatmulPrecision::kF32);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value();
    ASSERT_EQ(model_->num_params(), fx_.params.size()) << "parameter count differs from the fixture's";
    size_t off = 0;  // units are in the fixture's canonical order
    for (Unit& u : model_->units()) {
      std::memcpy(u.p_for_update(), fx_.params.data() + off, u.numel() * sizeof(float));
      off += u.numel();
    }
  }
  // Concatenated gradients of all units, in canonical order.
  std::vector<float> all_grads() const {
    std::vector<float> g;
    for (const Unit& u : model_->units()) g.insert(g.end(), u.g(), u.g() + u.numel());
    return g;
  }
  Fixture fx_;
  std::unique_ptr<GPT2> model_;
};

// Tolerances: PyTorch and Strata both compute in fp32 but sum in different orders (oneDNN/OpenBLAS blocking,
// our fused kernels), so results agree to a few float32 ulps of the largest partial sums: logits (|x| ≲ 3)
// to 1e-4 absolute; the loss to 1e-5; gradients (|g| up to ~0.1, many ~1e-4) to 2e-5 absolute plus 1e-3
// relative; the ten losses to 1e-4 (AdamW amplifies sub-ulp gradient differences in tiny moments).
TEST_P(GoldenTest, LogitsLossAndGradientsMatchPyTorch) {
  auto loss = model_->forward(fx_.x.data(), fx_.y.data(), fx_.B, fx_.T);
  ASSERT_TRUE(loss.is_ok()) << loss.status().to_string();
  const size_t nlogits = fx_.logits.size();
  EXPECT_TRUE(testing::all_close(model_->logits(), fx_.logits.data(), nlogits, 1e-4, 0, "logits"));
  EXPECT_NEAR(loss.value(), fx_.loss, 1e-5) << "loss";
  ASSERT_OK(model_->zero_grads());
  ASSERT_OK(model_->backward());
  const std::vector<float> g = all_grads();
  // Report per tensor, so a failure names the tensor.
  size_t off = 0;
  for (const Unit& u : model_->units()) {
    for (const TensorSpec& s : u.layout.specs()) {
      EXPECT_TRUE(testing::all_close(g.data() + off + s.offset, fx_.grads.data() + off + s.offset, s.numel(), 2e-5,
                                     1e-3, "grad " + s.name));
    }
    off += u.numel();
  }
}

TEST_P(GoldenTest, TenAdamWStepsMatchPyTorch) {
  AdamWConfig ac;
  ac.beta1 = fx_.beta1;
  ac.beta2 = fx_.beta2;
  ac.eps = fx_.eps;
  ac.weight_decay = fx_.wd;
  ac.grad_clip = fx_.clip;
  auto opt = AdamW::create(model_->units(), ac, model_->device());
  ASSERT_TRUE(opt.is_ok());
  std::vector<float> losses;
  for (int s = 0; s < fx_.n_steps; ++s) {
    ASSERT_OK(model_->zero_grads());
    auto loss = model_->forward(fx_.x.data(), fx_.y.data(), fx_.B, fx_.T);
    ASSERT_TRUE(loss.is_ok());
    ASSERT_OK(model_->backward());
    opt->step(model_->units(), fx_.lr);
    losses.push_back(loss.value());
  }
  EXPECT_TRUE(testing::all_close(losses, fx_.losses, 1e-4, 0, "losses of 10 AdamW steps"));
  EXPECT_LT(losses.back(), losses.front()) << "training did not reduce the loss";
}

INSTANTIATE_TEST_SUITE_P(Kernels, GoldenTest, ::testing::Values("reference", "fast"),
                         [](const auto& info) { return std::string(info.param); });

// The model FLOPs a step, both counts, at GPT-2 124M's shape: products as executed (causal attention over
// (T+1)/2 keys on average) and PaLM's 6N + 12LHQT, which nanoGPT prints for this model (N = 123.65M without the
// position embedding: 855.2 MFLOP a token at T = 1024).
TEST(ModelFlopsTest, Gpt2SmallBothCounts) {
  GPT2Config c;
  c.n_layer = 12;
  c.n_head = 12;
  c.n_embd = 768;
  c.vocab_size = 50257;
  c.block_size = 1024;
  auto device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
  ASSERT_OK_AND_ASSIGN(auto model, GPT2::create(c, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true));
  ASSERT_EQ(model->whole_num_params(), size_t{124439808});
  const double tokens = 8.0 * 1024;
  EXPECT_DOUBLE_EQ(model->palm_flops_per_step(8, 1024) / tokens, 6.0 * 123653376 + 12.0 * 12 * 768 * 1024);
  // Executed: 3 x (the matmuls 2(12C² L + CV) + causal attention 2·2·C·(T+1)/2 L).
  EXPECT_DOUBLE_EQ(model->flops_per_step(8, 1024) / tokens,
                   3.0 * (2.0 * (12.0 * 768 * 768 * 12 + 768.0 * 50257) + 2.0 * 768 * 1025 * 12));
}

}  // namespace
}  // namespace strata::engine
