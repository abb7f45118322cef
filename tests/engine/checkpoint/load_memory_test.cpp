// Loading state into an offloaded optimizer holds no unit whole outside the host budget: init_model,
// load_model(model, opt, file) and load_checkpoint hand a unit's weights, m and v over a sub-group at a time,
// straight into where the optimizer keeps them (its host buffers, or a staging slot on its way to NVMe). This
// binary counts every operator new of the process, and each load's heap growth must stay under a quarter of the
// embedding unit's weights — reading a unit whole, as these loads did before, takes one to three times them.
// The streamed loads must also give bitwise the state of the whole-unit paths (init_weights or load_model, then
// adopt_params or a checkpoint's write_moments), which the model without offload still takes.
#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "engine/checkpoint/checkpoint.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/heap_counter.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using test::heap_growth;

// A model with a large embedding unit (vocabulary 16384 x width 64: 4 MiB of weights) and small sub-groups.
constexpr size_t kSubGroup = 16384;

class LoadMemoryTest : public TrainerTest {
 protected:
  struct Run {
    std::unique_ptr<kernels::Device> device;
    std::unique_ptr<GPT2> model;
    std::unique_ptr<OffloadRuntime> rt;  // null: not offloaded
    std::unique_ptr<AdamW> plain;
    Optimizer& opt() { return rt ? rt->optimizer() : static_cast<Optimizer&>(*plain); }
  };

  json config(const std::string& optimizer, const std::string& params) const {
    json j = base_config("ckpt");
    j["model"] = {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}, {"vocab_size", 16384}, {"block_size", 16}};
    json zero = {{"stage", 3}, {"sub_group_size", kSubGroup}, {"offload_optimizer", {{"device", optimizer}}}};
    if (!params.empty()) zero["offload_param"] = {{"device", params}};
    for (const char* t : {"offload_param", "offload_optimizer"}) {
      if (zero.contains(t) && zero[t].value("device", "") == "nvme") zero[t]["nvme_path"] = "";  // make() sets it
    }
    j["zero_optimization"] = zero;
    return j;
  }

  // A model and optimizer of `j`, weights not yet written; offloaded unless `plain` (each stack its own swap
  // folder).
  Result<Run> make(json j, bool plain = false) {
    for (const char* t : {"offload_param", "offload_optimizer"}) {
      json& zero = j["zero_optimization"];
      if (zero.contains(t) && zero[t].contains("nvme_path"))
        zero[t]["nvme_path"] = (dir_ / fmt::format("swap{}", stacks_)).string();
    }
    ++stacks_;
    STRATA_ASSIGN_OR_RETURN(RunConfig c, parse_run_config(j, "test"));
    Run r;
    r.device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    STRATA_ASSIGN_OR_RETURN(r.model, GPT2::create(c.model.gpt2, *r.device, kernels::MatmulPrecision::kF32, !plain));
    if (plain) {
      STRATA_ASSIGN_OR_RETURN(AdamW a, AdamW::create(r.model->units(), AdamWConfig{}, *r.device));
      r.plain = std::make_unique<AdamW>(std::move(a));
    } else {
      STRATA_ASSIGN_OR_RETURN(r.rt, OffloadRuntime::create(c.offload, AdamWConfig{}, *r.device, *r.model));
    }
    return r;
  }

  // Every unit's weights, m and v, in order.
  static std::vector<std::vector<float>> state(Run& r) {
    std::vector<std::vector<float>> out;
    for (size_t u = 0; u < r.model->units().size(); ++u) {
      const size_t n = r.model->units()[u].numel();
      std::vector<float> w(n), m(n), v(n);
      EXPECT_TRUE(r.opt().finish().is_ok());
      EXPECT_TRUE(r.model->read_params(u, w.data()).is_ok());
      EXPECT_TRUE(r.opt().read_moments(u, m.data(), v.data()).is_ok());
      out.push_back(std::move(w));
      out.push_back(std::move(m));
      out.push_back(std::move(v));
    }
    return out;
  }

  static Status train_step(Run& r) {
    const int B = 2, T = 16;
    std::vector<int32_t> x(B * T), y(B * T);
    for (int i = 0; i < B * T; ++i) x[i] = (i * 7) % kVocab, y[i] = (i * 7 + 7) % kVocab;
    STRATA_RETURN_IF_ERROR(r.model->zero_grads());
    STRATA_RETURN_IF_ERROR(r.model->forward(x.data(), y.data(), B, T).status());
    STRATA_RETURN_IF_ERROR(r.model->backward(1.0f));
    bool skipped = false;
    STRATA_RETURN_IF_ERROR(r.opt().step(1e-3f, &skipped).status());
    return r.opt().finish();
  }

  int stacks_ = 0;
};

TEST_F(LoadMemoryTest, LoadsThroughAnOffloadedOptimizerHoldNoUnitWhole) {
  const int64_t unit_bytes = int64_t{16384 + 16} * 64 * sizeof(float);
  const int64_t bound = unit_bytes / 4;
  for (const auto& [optimizer, params] : {std::pair<std::string, std::string>{"cpu", ""}, {"nvme", "nvme"}}) {
    SCOPED_TRACE("optimizer " + optimizer + (params.empty() ? "" : ", parameters " + params));
    fs::remove_all(dir_ / "ckpt");
    const json j = config(optimizer, params);

    // Initial weights: init_model against init_weights + adopt_params without offload.
    ASSERT_OK_AND_ASSIGN(Run a, make(j));
    const int64_t init = heap_growth([&] { ASSERT_OK(init_model(*a.model, a.opt(), 5)); });
    EXPECT_LT(init, bound) << "init_model";
    ASSERT_OK_AND_ASSIGN(Run ref, make(j, /*plain=*/true));
    ASSERT_OK(ref.model->init_weights(5));
    ASSERT_OK(ref.opt().adopt_params());
    EXPECT_TRUE(state(a) == state(ref)) << "init_model differs from init_weights";

    // A checkpoint after two steps (moments not zero), read back into a fresh stack.
    ASSERT_OK(train_step(a));
    ASSERT_OK(train_step(a));
    TrainState two;
    two.step = 2;
    ASSERT_OK_AND_ASSIGN(const std::string saved, save_checkpoint((dir_ / "ckpt").string(), *a.model, a.opt(), two, 0));
    ASSERT_OK_AND_ASSIGN(Run b, make(j));
    const int64_t resume = heap_growth([&] { ASSERT_OK(load_checkpoint(saved, *b.model, b.opt()).status()); });
    EXPECT_LT(resume, bound) << "load_checkpoint";
    const auto want = state(a);
    EXPECT_TRUE(state(b) == want) << "the resumed state differs from the saved";
    ASSERT_OK_AND_ASSIGN(Run plain, make(j, /*plain=*/true));  // the whole-unit path
    ASSERT_OK(load_checkpoint(saved, *plain.model, plain.opt()).status());
    EXPECT_TRUE(state(plain) == want) << "the whole-unit resume differs from the saved";

    // A fine-tune's weights (training.init_from): the checkpoint's weights, moments zero.
    ASSERT_OK_AND_ASSIGN(Run c, make(j));
    const int64_t weights = heap_growth([&] { ASSERT_OK(load_model(*c.model, c.opt(), saved)); });
    EXPECT_LT(weights, bound) << "load_model";
    const auto tuned = state(c);
    for (size_t k = 0; k < tuned.size(); ++k) {
      if (k % 3 == 0) {
        EXPECT_TRUE(tuned[k] == want[k]) << "weights of unit " << k / 3;
      } else {
        EXPECT_TRUE(tuned[k] == std::vector<float>(tuned[k].size(), 0.0f)) << "moments of unit " << k / 3;
      }
    }
    std::printf("%s: heap growth init %.0f KiB, resume %.0f KiB, weights %.0f KiB (bound %.0f; a unit %.0f)\n",
                optimizer.c_str(), init / 1024.0, resume / 1024.0, weights / 1024.0, bound / 1024.0,
                unit_bytes / 1024.0);
  }
}

}  // namespace
}  // namespace strata::engine
