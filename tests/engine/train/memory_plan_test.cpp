// memory_plan_test.cpp — the memory check before a run allocates: its count of the state is what the model and
// the offload stack then allocate, placement by placement, and a state over a budget is refused naming the tier,
// the budget's key and the fix, before anything large is allocated.
#include "engine/train/memory_plan.h"

#include <chrono>
#include <map>

#include "engine/optim/optimizer.h"
#include "engine/train/offload_runtime.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/engine/offload_train_fixture.h"

namespace strata::engine {
namespace {

// The pool's live bytes by the plan's purposes: each buffer counted under the longest item name that its purpose
// is or starts with (followed by a space: "offload.grads h.0" is "offload.grads"). Buffers no item names are
// counted under "other".
std::map<std::string, uint64_t> pool_by_item(const offload::PinnedPool& pool, const MemoryPlan& plan) {
  std::map<std::string, uint64_t> out;
  pool.for_each_live([&](void*, size_t bytes, const std::string& purpose) {
    std::string best = "other";
    for (const MemoryPlan::Item& i : plan.host) {
      const bool names = purpose == i.what || purpose.rfind(i.what + " ", 0) == 0;
      if (names && (best == "other" || i.what.size() > best.size())) best = i.what;
    }
    out[best] += bytes;
  });
  return out;
}

Result<MemoryPlan> plan_for(const RunConfig& c, kernels::Device& device) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GPT2> shape,
                          GPT2::create(c.model.gpt2, device, kernels::MatmulPrecision::kF32, /*offloaded=*/true));
  MemoryPlacement p;
  p.offloaded = offload_enabled(c.offload);
  return plan_memory(*shape, c.offload, p);
}

TEST_F(OffloadTrainTest, ThePlannedStateIsWhatThePlainRunAllocates) {
  auto c = parse_run_config(config("plain", json()), "test");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
  auto plan = plan_for(*c, *device);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_TRUE(plan->host.empty());
  ASSERT_EQ(device->live_bytes(), 0u) << "planning allocated " << device->memory_report();
  auto model = GPT2::create(c->model.gpt2, *device, kernels::MatmulPrecision::kF32);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  auto adam = AdamW::create((*model)->units(), AdamWConfig{}, *device);
  ASSERT_TRUE(adam.is_ok()) << adam.status().to_string();
  EXPECT_EQ(plan->device_bytes(), device->live_bytes()) << device->memory_report();
  EXPECT_EQ(plan->device_bytes(), 16 * (*model)->num_params());
}

// Every offload placement: each host item of the plan is exactly what the stack's pool holds under that purpose,
// nothing else is in the pool, the device holds at least the plan's device items, and the nvme state is the
// bytes of the state classes each folder's store holds.
TEST_F(OffloadTrainTest, ThePlannedStateIsWhatTheOffloadStackAllocatesInEveryPlacement) {
  for (const Placement& pl : placements()) {
    if (pl.zero.is_null()) continue;  // not offloaded: the test above
    SCOPED_TRACE(pl.name);
    json j = config(pl.name, pl);
    auto c = parse_run_config(j, "test");
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    std::unique_ptr<kernels::Device> device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    auto plan = plan_for(*c, *device);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    auto model = GPT2::create(c->model.gpt2, *device, kernels::MatmulPrecision::kF32, /*offloaded=*/true);
    ASSERT_TRUE(model.is_ok()) << model.status().to_string();
    auto rt = OffloadRuntime::create(c->offload, AdamWConfig{}, *device, **model);
    ASSERT_TRUE(rt.is_ok()) << rt.status().to_string();
    const std::map<std::string, uint64_t> held = pool_by_item((*rt)->pool(), *plan);
    EXPECT_EQ(held.count("other"), 0u) << "the pool holds what the plan does not count: " << (*rt)->pool().report();
    for (const MemoryPlan::Item& i : plan->host) {
      const auto it = held.find(i.what);
      EXPECT_EQ(it == held.end() ? 0 : it->second, i.bytes) << i.what << "\n" << (*rt)->pool().report();
    }
    EXPECT_EQ(plan->host_bytes(), (*rt)->pool().used_bytes());
    EXPECT_LE(plan->device_bytes(), device->live_bytes()) << device->memory_report();
    const bool nvme = j.dump().find("nvme") != std::string::npos;
    EXPECT_EQ(plan->nvme_state.empty(), !nvme);
    uint64_t classes = 0;  // fp32 copies of the model on nvme: parameters 1, optimizer 3, gradients 1
    if (c->offload.offload_param.device == "nvme") classes += 1;
    if (c->offload.offload_optimizer.device == "nvme") classes += 3;
    if (c->offload.gradients == "nvme") classes += 1;
    uint64_t state = 0;
    for (const auto& entry : plan->nvme_state) state += entry.second;
    EXPECT_EQ(state, classes * 4 * (*model)->num_params());
  }
}

MemoryPlan example_plan() {
  MemoryPlan p;
  p.add_device("gpt2.activations", 1 << 20);
  p.add_device("offload.persistent", 3 << 20);
  p.add_host("offload.optimizer", 12 << 20);
  p.add_host("offload.params", 4 << 20);
  p.add_host("offload.optimizer", 12 << 20);  // the same purpose again: summed
  p.nvme_state["/swap"] = 40 << 20;
  p.nvme_max["/swap"] = 80 << 20;
  return p;
}

TEST(MemoryPlanCheck, EachTierOverItsBudgetIsRefusedNamingTheKeyAndTheLargestHolder) {
  const MemoryPlan plan = example_plan();
  EXPECT_EQ(plan.host.size(), 2u);
  EXPECT_EQ(plan.host_bytes(), uint64_t{28} << 20);
  OffloadConfig config;
  config.offload_optimizer.device = "nvme";
  config.offload_optimizer.nvme_path = "/swap";
  config.offload_param.device = "cpu";
  MemoryBudgets fits;
  fits.device = 4 << 20;
  fits.device_source = "memory.device_memory_limit";
  fits.host = 28 << 20;
  fits.host_source = "memory.host_memory_limit";
  fits.disk_free["/swap"] = 80 << 20;
  EXPECT_TRUE(check_memory_fits(plan, fits, config).is_ok());

  auto refused = [&](const MemoryBudgets& b, std::initializer_list<const char*> words) {
    const Status st = check_memory_fits(plan, b, config);
    ASSERT_FALSE(st.is_ok());
    EXPECT_EQ(st.code(), StatusCode::kOutOfMemory) << st.to_string();
    for (const char* w : words) EXPECT_NE(st.message().find(w), std::string::npos) << w << " in " << st.to_string();
  };
  MemoryBudgets b = fits;
  b.device = (4 << 20) - 1;
  refused(b, {"device memory", "memory.device_memory_limit", "offload.persistent 3.00 MiB", "persistence_threshold"});
  b = fits;
  b.host = (28 << 20) - 1;
  refused(b,
          {"host memory", "memory.host_memory_limit", "offload.optimizer 24.0 MiB, offload.params 4.00 MiB", "\"nvme\""});
  b = fits;
  b.shared = (32 << 20) - 1;
  b.shared_source = "MemAvailable 31.9 MiB";
  refused(b, {"this machine's memory", "MemAvailable 31.9 MiB", "\"nvme\""});
  b = fits;
  b.disk_free["/swap"] = (40 << 20) - 1;
  refused(b, {"zero_optimization.offload_optimizer.nvme_path = /swap", "filesystem"});
  b = fits;
  b.disk_free["/swap"] = 40 << 20;  // the state fits, the store's most does not: a warning only
  EXPECT_TRUE(check_memory_fits(plan, b, config).is_ok());
  b = MemoryBudgets{};  // nothing known: nothing refused
  EXPECT_TRUE(check_memory_fits(plan, b, config).is_ok());
}

// The sizes: a model past any machine's memory is refused by the trainer at once, before it allocates,
// naming what to change; with everything on nvme, past any disk.
TEST_F(OffloadTrainTest, AStatePastTheMachineIsRefusedBeforeAnythingIsAllocated) {
  auto refused = [&](const json& j, std::initializer_list<const char*> words) {
    const auto start = std::chrono::steady_clock::now();
    auto r = train(j);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory) << r.status().to_string();
    for (const char* w : words)
      EXPECT_NE(r.status().message().find(w), std::string::npos) << w << " in " << r.status().to_string();
    EXPECT_LT(s, 20.0) << "refused only after " << s << " s";
  };
  json big = config("big", json());
  big["model"]["n_layer"] = 64;  // 51.5G parameters: 824 GB of state
  big["model"]["n_embd"] = 8192;
  big["model"]["n_head"] = 64;
  refused(big, {"this machine's memory", "gpt2.params", "offload it to nvme"});

  json limited = config("limited", json());
  limited["memory"] = {{"device_memory_limit", "256KiB"}};
  refused(limited, {"device memory", "memory.device_memory_limit", "offload_optimizer.device"});

  // 4096 blocks of width 4096: 13 TB of fp32 state on nvme, and about 2 GB of staging in host memory.
  json disk = config("disk", json{{"stage", 3},
                                  {"offload_param", {{"device", "nvme"}, {"buffer_count", 1}}},
                                  {"offload_optimizer", {{"device", "nvme"}}},
                                  {"sub_group_size", 10'000'000}});
  disk["memory"] = {{"gradients", "nvme"}};
  disk["model"]["n_layer"] = 4096;
  disk["model"]["n_embd"] = 4096;
  disk["model"]["n_head"] = 32;
  refused(disk, {"nvme_path", "filesystem", "free"});
  EXPECT_FALSE(fs::exists(dir_ / "swap")) << "the swap folder was created before the refusal";
}

}  // namespace
}  // namespace strata::engine
