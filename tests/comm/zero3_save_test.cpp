// zero3_save_test.cpp — run by CTest under `mpiexec -np 2`: checkpoints of state spread over ranks are written
// by rank 0 from pieces the others send it one after another — ZeRO-3 shards (each rank holding a shard of every
// unit's weights, m and v, in host memory or on NVMe), and a pipeline's second stage's units. This binary counts
// every operator new of each process (tests/heap_counter.cpp): no rank's heap may grow by more than a quarter of
// the largest unit sent during the save — reading units whole, as saves did before, held one to six times it —
// and the files must hold exactly the state the ranks keep.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/pipeline_checkpoint.h"
#include "engine/parallel/pipeline.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "storage/safetensors.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/heap_counter.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

// The world of the two ranks (CTest runs this binary under mpiexec -np 2), and the configs of both tests: a
// model with ZeRO-3 and its optimizer offloaded to `optimizer` (cpu or nvme) in sub-groups of 16384 elements.
class Zero3SaveTest : public TrainerTest {
 protected:
  void SetUp() override {
    TrainerTest::SetUp();
    auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    world_ = std::move(w).value();
    ASSERT_EQ(world_->size(), 2) << "run under mpiexec -np 2 (CTest does)";
  }
  json offloaded_config(const std::string& ckpt, json model, const std::string& optimizer) const {
    json j = base_config(ckpt);
    j["model"] = std::move(model);
    j["zero_optimization"] = {{"stage", 3},
                              {"sub_group_size", 16384},
                              {"offload_optimizer", {{"device", optimizer}, {"nvme_path", (dir_ / "swap").string()}}}};
    return j;
  }
  std::unique_ptr<comm::MpiCommunicator> world_;
};

// The tensors of unit u's state (a whole unit's floats, in its layout) named `prefix + name` in `file`: the
// first difference, or "" when every element is bitwise equal.
std::string compare(const SafetensorsFile& file, const GPT2& model, size_t u, const std::string& prefix,
                    const std::vector<float>& want) {
  for (const TensorSpec& s : model.whole_layout(u).specs()) {
    const SafetensorsEntry* t = file.find(prefix + s.name);
    if (t == nullptr || t->numel() != s.numel())
      return fmt::format("{}{}: missing, or not {} elements", prefix, s.name, s.numel());
    const float* got = reinterpret_cast<const float*>(t->data);
    for (size_t i = 0; i < s.numel(); ++i) {
      if (std::memcmp(&got[i], &want[s.offset + i], sizeof(float)) != 0)
        return fmt::format("{}{}[{}]: {} in the file, {} gathered", prefix, s.name, i, got[i], want[s.offset + i]);
    }
  }
  return "";
}

TEST_F(Zero3SaveTest, RanksSendTheirShardsAPieceAtATimeAndTheFilesHoldTheGatheredState) {
  comm::Communicator& world = *world_;
  // A large embedding unit (vocabulary 16384 x width 64: 4 MiB of weights) in sub-groups of 16384 elements.
  const int64_t unit_bytes = int64_t{16384 + 16} * 64 * sizeof(float);
  const int64_t bound = unit_bytes / 4;
  for (const std::string optimizer : {"cpu", "nvme"}) {
    SCOPED_TRACE("optimizer " + optimizer);
    const json j = offloaded_config(
        "ckpt_" + optimizer,
        {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}, {"vocab_size", 16384}, {"block_size", 16}}, optimizer);
    auto c = parse_run_config(j, "test");
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    auto model = GPT2::create(c->model.gpt2, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true);
    ASSERT_TRUE(model.is_ok()) << model.status().to_string();
    auto rt = OffloadRuntime::create(c->offload, AdamWConfig{}, *device, **model, &world);
    ASSERT_TRUE(rt.is_ok()) << rt.status().to_string();
    Optimizer& opt = (*rt)->optimizer();
    ASSERT_TRUE(init_model(**model, opt, 5).is_ok());
    // Two steps, so that the moments are not zero; each rank its own tokens.
    const int B = 2, T = 16;
    std::vector<int32_t> x(B * T), y(B * T);
    for (int i = 0; i < B * T; ++i)
      x[i] = (i * 7 + 3 * world.rank()) % kVocab, y[i] = (i * 7 + 7 + world.rank()) % kVocab;
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE((*model)->zero_grads().is_ok());
      ASSERT_TRUE((*model)->forward(x.data(), y.data(), B, T).is_ok());
      ASSERT_TRUE((*model)->backward(1.0f).is_ok());
      bool skipped = false;
      ASSERT_TRUE(opt.step(1e-3f, &skipped).is_ok());
      ASSERT_TRUE(opt.finish().is_ok());
    }

    TrainState state;
    state.step = 2;
    Status saved;
    const int64_t growth = test::heap_growth([&] {
      if (world.rank() == 0) {
        saved = save_checkpoint(j["training"]["checkpoint_dir"], **model, opt, state, 0).status();
      } else {
        saved = take_part_in_checkpoint(**model, opt, [](size_t) { return true; });
      }
    });
    ASSERT_TRUE(saved.is_ok()) << saved.to_string();
    std::printf("rank %d, optimizer %s: heap growth of the save %.0f KiB (bound %.0f; the embedding unit %.0f)\n",
                world.rank(), optimizer.c_str(), growth / 1024.0, bound / 1024.0, unit_bytes / 1024.0);
    EXPECT_LT(growth, bound) << "rank " << world.rank();
    ASSERT_TRUE(world.barrier().is_ok());

    // The state gathered whole, unit by unit (collective), against the files rank 0 wrote.
    const fs::path folder = fs::path(j["training"]["checkpoint_dir"].get<std::string>()) / "step_000002";
    std::unique_ptr<SafetensorsFile> weights, moments;
    if (world.rank() == 0) {
      auto a = SafetensorsFile::open((folder / "model.safetensors").string());
      auto b = SafetensorsFile::open((folder / "optimizer.safetensors").string());
      ASSERT_TRUE(a.is_ok() && b.is_ok()) << folder;
      weights = std::make_unique<SafetensorsFile>(std::move(a).value());
      moments = std::make_unique<SafetensorsFile>(std::move(b).value());
    }
    for (size_t u = 0; u < (*model)->units().size(); ++u) {
      const size_t n = (*model)->whole_layout(u).numel();
      std::vector<float> p(n), m(n), v(n);
      ASSERT_TRUE((*model)->read_params(u, p.data()).is_ok());
      ASSERT_TRUE(opt.read_moments(u, m.data(), v.data()).is_ok());
      if (world.rank() != 0) continue;
      EXPECT_EQ(compare(*weights, **model, u, "", p), "");
      EXPECT_EQ(compare(*moments, **model, u, "m.", m), "");
      EXPECT_EQ(compare(*moments, **model, u, "v.", v), "");
    }
    ASSERT_TRUE(world.barrier().is_ok());
  }
}

// Two pipeline stages with their optimizer offloaded (host memory, NVMe): the second sends the first its units'
// weights (the fp32 master), m and v a piece at a time (take_part_in_pipeline_checkpoint), which the first writes
// as they come. The file's tensors of the second stage's units must be that stage's state, bitwise; and a second
// stage that cannot read its state says so, so that the first fails at once instead of waiting.
TEST_F(Zero3SaveTest, ASecondPipelineStageSendsItsUnitsAPieceAtATime) {
  comm::Communicator& pp = *world_;
  // Width 256: the second stage's block is 0.79M elements (3 MiB), in sub-groups of 16384.
  const int64_t block_bytes = int64_t{12} * 256 * 256 * sizeof(float);
  const int64_t bound = block_bytes / 4;
  for (const std::string optimizer : {"cpu", "nvme"}) {
    SCOPED_TRACE("optimizer " + optimizer);
    json j = offloaded_config(
        "pp_" + optimizer,
        {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 256}, {"vocab_size", 4096}, {"block_size", 16}}, optimizer);
    j["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
    auto c = parse_run_config(j, "test");
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    const PipelinePlan plan = plan_pipeline(c->model.unit_specs(), c->model.pipeline_costs(16), 2);
    std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    auto model = GPT2::create(c->model.gpt2, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true,
                              plan.stages[static_cast<size_t>(pp.rank())]);
    ASSERT_TRUE(model.is_ok()) << model.status().to_string();
    if (pp.rank() == 0) (*model)->set_params_source(pipeline_params_source(**model, plan, pp));
    auto rt = OffloadRuntime::create(c->offload, AdamWConfig{}, *device, **model, nullptr, &pp, &plan);
    ASSERT_TRUE(rt.is_ok()) << rt.status().to_string();
    Optimizer& opt = (*rt)->optimizer();
    ASSERT_TRUE(init_model(**model, opt, 5).is_ok());
    // Moments that are not zero, and not the weights: written into the stage's own units.
    for (size_t u = 0; u < (*model)->units().size(); ++u) {
      if (!(*model)->holds(u)) continue;
      std::vector<float> m((*model)->units()[u].numel()), v(m.size());
      for (size_t i = 0; i < m.size(); ++i)
        m[i] = 1e-3f * static_cast<float>(i % 977), v[i] = 1e-6f * static_cast<float>(i % 499 + 1);
      ASSERT_TRUE(opt.write_moments(u, m.data(), v.data()).is_ok());
    }

    TrainState state;
    state.step = 1;
    Status saved;
    const int64_t growth = test::heap_growth([&] {
      if (pp.rank() == 0) {
        saved = save_checkpoint(j["training"]["checkpoint_dir"], **model, opt, state, 0).status();
      } else {
        saved = take_part_in_pipeline_checkpoint(**model, plan, opt, pp);
      }
    });
    ASSERT_TRUE(saved.is_ok()) << saved.to_string();
    std::printf("stage %d, optimizer %s: heap growth of the save %.0f KiB (bound %.0f; a block %.0f)\n", pp.rank(),
                optimizer.c_str(), growth / 1024.0, bound / 1024.0, block_bytes / 1024.0);
    EXPECT_LT(growth, bound) << "stage " << pp.rank();
    ASSERT_TRUE(pp.barrier().is_ok());

    // The second stage's own state, sent whole on the side, against the file.
    const fs::path folder = fs::path(j["training"]["checkpoint_dir"].get<std::string>()) / "step_000001";
    for (size_t u = 0; u < (*model)->units().size(); ++u) {
      if (plan.owner(u) != 1) continue;
      const size_t n = (*model)->whole_layout(u).numel();
      std::vector<float> p(n), m(n), v(n);
      constexpr int kTag = 99;
      if (pp.rank() == 1) {
        ASSERT_TRUE((*model)->read_params(u, p.data()).is_ok());
        ASSERT_TRUE(opt.read_moments(u, m.data(), v.data()).is_ok());
        for (const std::vector<float>* x : {&p, &m, &v})
          ASSERT_TRUE(pp.send(x->data(), n, DType::kF32, 0, kTag).is_ok());
        continue;
      }
      for (std::vector<float>* x : {&p, &m, &v}) ASSERT_TRUE(pp.recv(x->data(), n, DType::kF32, 1, kTag).is_ok());
      auto weights = SafetensorsFile::open((folder / "model.safetensors").string());
      auto moments = SafetensorsFile::open((folder / "optimizer.safetensors").string());
      ASSERT_TRUE(weights.is_ok() && moments.is_ok()) << folder;
      EXPECT_EQ(compare(*weights, **model, u, "", p), "");
      EXPECT_EQ(compare(*moments, **model, u, "m.", m), "");
      EXPECT_EQ(compare(*moments, **model, u, "v.", v), "");
    }
    ASSERT_TRUE(pp.barrier().is_ok());
    if (optimizer != "nvme") continue;

    // The second stage's swap files damaged: it cannot read its state, says so to the first, and both fail at
    // once (the first naming the stage), instead of the first waiting in its receive.
    if (pp.rank() == 1) testing::damage_files_under(dir_ / "swap");
    state.step = 2;
    const Status failed = pp.rank() == 0
                              ? save_checkpoint(j["training"]["checkpoint_dir"], **model, opt, state, 0).status()
                              : take_part_in_pipeline_checkpoint(**model, plan, opt, pp);
    ASSERT_FALSE(failed.is_ok()) << "stage " << pp.rank();
    const char* says = pp.rank() == 0 ? "from stage 1: that stage could not read it" : "checksum mismatch";
    EXPECT_NE(failed.to_string().find(says), std::string::npos) << failed.to_string();
    ASSERT_TRUE(pp.barrier().is_ok());
  }
}

}  // namespace
}  // namespace strata::engine
