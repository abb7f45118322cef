// optimizer_swap_test.cpp — the optimizer swap pipeline (offload/optimizer_swap.h) against the same fused Adam run
// on host arrays: bitwise equal master weights, moments and working copies after several steps, for 2, 3 and 4
// staging slots (gated steps too), every working dtype, odd sub-group sizes and per-segment weight decay, on the
// in-memory and the POSIX engine; how long a sub-group's new master weights stay valid; and under injected bit
// flips and EIO, an error (naming the key) rather than a wrong update.
#include "offload/optimizer_swap.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "common/rng.h"
#include "kernels/cpu/fast.h"
#include "storage/fault_engine.h"
#include "storage/io_engine.h"
#include "storage/memory_engine.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;

std::vector<OptimizerGroup> test_groups() {
  // Odd sizes, a group larger than a checksum chunk, segments with and without decay.
  return {{"wte", 4099, {{0, 4000, 0.1f}, {4000, 99, 0.0f}}, {}},
          {"h.0", 70001, {{0, 33, 0.0f}, {33, 69000, 0.1f}, {69033, 968, 0.0f}}, {}},
          {"ln_f", 37, {{0, 37, 0.0f}}, {}}};
}

struct Harness {
  std::string dir;
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<FaultEngine> faulty;
  std::unique_ptr<IoQueue> queue;
  std::unique_ptr<SwapStore> store;
  std::unique_ptr<PinnedPool> pool;

  explicit Harness(const std::string& kind, const FaultOptions* faults = nullptr) {
    static std::atomic<int> counter{0};
    dir = (fs::temp_directory_path() / fmt::format("strata_optswap_{}_{}", ::getpid(), counter++)).string();
    if (kind == "memory") {
      MemoryEngineOptions o;
      o.direct_alignment = 4096;
      o.lanes = 2;
      engine = std::make_unique<MemoryEngine>(o);
    } else {
      auto e = make_io_engine(EngineOptions{.kind = EngineKind::kPosix, .lanes = 2, .queue_depth = 8});
      EXPECT_TRUE(e.is_ok());
      engine = std::move(e).value();
    }
    IoEngine* io = engine.get();
    if (faults != nullptr) {
      faulty = std::make_unique<FaultEngine>(*engine, *faults);
      io = faulty.get();
    }
    queue = std::make_unique<IoQueue>(*io, IoQueueOptions{64 << 10});
    SwapStoreOptions so;
    so.dir = dir;
    so.file_bytes = 8 << 20;
    so.max_files = 4;
    so.checksum_chunk = 64 << 10;
    auto s = SwapStore::open(*queue, so);
    if (faults == nullptr) {
      EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    }
    if (s.is_ok()) store = std::move(s).value();  // under injected faults, opening may fail: the test skips it
    auto p = PinnedPool::create(PinnedPoolOptions{.budget_bytes = 16 << 20, .lock = false});
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    pool = std::move(p).value();
  }
  ~Harness() {
    store.reset();
    queue.reset();
    faulty.reset();
    engine.reset();
    fs::remove_all(dir);
  }
};

// Host-side state of every group, and the same steps run directly with the fused Adam.
struct HostState {
  std::vector<std::vector<float>> master, m, v, grads;
  explicit HostState(const std::vector<OptimizerGroup>& groups, uint64_t seed) {
    Rng rng(seed);
    for (const auto& g : groups) {
      std::vector<float> p(g.numel);
      for (auto& x : p) x = static_cast<float>(rng.uniform(-1, 1));
      master.push_back(p);
      m.emplace_back(g.numel, 0.0f);
      v.emplace_back(g.numel, 0.0f);
      grads.emplace_back(g.numel, 0.0f);
    }
  }
  void new_grads(Rng& rng) {
    for (auto& g : grads)
      for (auto& x : g) x = static_cast<float>(rng.uniform(-1, 1));
  }
};

kernels::AdamWParams hyper(int step) {
  kernels::AdamWParams hp;
  hp.lr = 1e-2f;
  hp.step = step;
  hp.grad_scale = 0.5f;
  return hp;
}

// `count` sub-groups of one decayed segment each, of first, first + step, ... elements.
std::vector<OptimizerGroup> plain_groups(int count, size_t first, size_t step) {
  std::vector<OptimizerGroup> groups;
  for (int g = 0; g < count; ++g) {
    const size_t n = first + step * static_cast<size_t>(g);
    groups.push_back({fmt::format("g{}", g), n, {{0, n, 0.1f}}, {}});
  }
  return groups;
}

// The swapper's first step over plain_groups, done on `want` in memory (hyper(1), decay 0.1): its gradients.
std::vector<const float*> plain_step(const std::vector<OptimizerGroup>& groups, HostState& want) {
  std::vector<const float*> grads;
  for (size_t g = 0; g < groups.size(); ++g) {
    grads.push_back(want.grads[g].data());
    kernels::AdamWParams p = hyper(1);
    p.weight_decay = 0.1f;
    kernels::cpu::fast::adamw_update_mixed(want.master[g].data(), want.m[g].data(), want.v[g].data(),
                                           want.grads[g].data(), nullptr, DType::kF32, groups[g].numel, p);
  }
  return grads;
}

// The swapper's stored state of every group is bitwise `want`'s.
void expect_state(OptimizerSwapper& s, const std::vector<OptimizerGroup>& groups, const HostState& want) {
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<float> master(groups[g].numel), m(groups[g].numel), v(groups[g].numel);
    ASSERT_TRUE(s.read_state(g, master.data(), m.data(), v.data()).is_ok());
    EXPECT_EQ(0, std::memcmp(master.data(), want.master[g].data(), master.size() * 4)) << groups[g].name;
    EXPECT_EQ(0, std::memcmp(m.data(), want.m[g].data(), m.size() * 4)) << groups[g].name;
    EXPECT_EQ(0, std::memcmp(v.data(), want.v[g].data(), v.size() * 4)) << groups[g].name;
  }
}

// Four steps through the swapper against the same fused Adam on host arrays: bitwise equal state and copies.
// gated: each step's parameters come from plan.params (the step's own argument is wrong), and by then the reads
// of the first `slots` sub-groups are issued: every slot is read into while the parameters are not known.
void check_bitwise(const char* engine, int slots, DType dt, bool grads_in_store = false, bool gated = false) {
  SCOPED_TRACE(fmt::format("engine={} slots={} working={} grads_in_store={} gated={}", engine, slots, dtype_name(dt),
                           grads_in_store, gated));
  Harness h(engine);
  auto groups = test_groups();
  if (grads_in_store) {
    for (auto& g : groups) g.grad_key = "grad." + g.name;
  }
  auto swapper = OptimizerSwapper::create(*h.store, *h.pool, groups, OptimizerSwapOptions{.slots = slots});
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  OptimizerSwapper& s = *swapper.value();
  HostState want(groups, 7);
  for (size_t g = 0; g < groups.size(); ++g) ASSERT_TRUE(s.initialize(g, want.master[g].data()).is_ok());

  const size_t elem = dt == DType::kF32 ? 4 : 2;
  std::vector<std::vector<char>> got_working, want_working;
  for (const auto& g : groups) {
    got_working.emplace_back(g.numel * elem, 0);
    want_working.emplace_back(g.numel * elem, 0);
  }
  Rng rng(11);
  for (int step = 1; step <= 4; ++step) {
    want.new_grads(rng);
    std::vector<const float*> grads;
    std::vector<void*> working;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (grads_in_store) {  // the swapper reads them with the group's state
        ASSERT_TRUE(h.store->write(groups[g].grad_key, want.grads[g].data(), groups[g].numel * 4).is_ok());
        grads.push_back(nullptr);
      } else {
        grads.push_back(want.grads[g].data());
      }
      working.push_back(got_working[g].data());
      for (const auto& seg : groups[g].segments) {
        kernels::AdamWParams p = hyper(step);
        p.weight_decay = seg.weight_decay;
        auto* w16 = dt == DType::kF32 ? nullptr : reinterpret_cast<uint16_t*>(want_working[g].data()) + seg.offset;
        kernels::cpu::fast::adamw_update_mixed(want.master[g].data() + seg.offset, want.m[g].data() + seg.offset,
                                               want.v[g].data() + seg.offset, want.grads[g].data() + seg.offset,
                                               w16, dt, seg.numel, p);
      }
      if (dt == DType::kF32)
        std::memcpy(want_working[g].data(), want.master[g].data(), groups[g].numel * sizeof(float));
    }
    OptimizerStepPlan plan;
    uint64_t read_before_params = 0;
    if (gated) {
      plan.params = [&]() -> Result<kernels::AdamWParams> {
        read_before_params = s.last_step_stats().bytes_read;
        return hyper(step);
      };
    }
    const Status st = s.step(grads, working, dt, gated ? hyper(step + 9) : hyper(step), nullptr, plan);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    const auto& stats = s.last_step_stats();
    size_t total = 0, first_slots = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      total += groups[g].numel;
      if (g < static_cast<size_t>(slots)) first_slots += groups[g].numel;
    }
    if (gated) {
      EXPECT_EQ(read_before_params, (grads_in_store ? 16 : 12) * first_slots);
    }
    EXPECT_EQ(stats.bytes_read, (grads_in_store ? 16 : 12) * total);
    EXPECT_EQ(stats.bytes_written, 12 * total);
  }
  expect_state(s, groups, want);
  for (size_t g = 0; g < groups.size(); ++g)
    EXPECT_EQ(got_working[g], want_working[g]) << groups[g].name << " working copy";
}

class OptimizerSwapTest : public ::testing::TestWithParam<const char*> {};

TEST_P(OptimizerSwapTest, StepsAreBitwiseTheInMemoryOptimizer) {
  for (int slots : {2, 3})
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) check_bitwise(GetParam(), slots, dt);
}

// Gradients read from the store with each sub-group's state (gradients on NVMe) give the same bits.
TEST_P(OptimizerSwapTest, GradientsReadFromTheStoreAreBitwiseTheInMemoryOptimizer) {
  for (int slots : {2, 3}) check_bitwise(GetParam(), slots, DType::kF32, /*grads_in_store=*/true);
}

// With the parameters known only after the first reads (offload_optimizer's gated update after a clipped step),
// the reads fill every slot first, and the result is still the plain step's bits.
TEST_P(OptimizerSwapTest, GatedStepsFillEverySlotBeforeTheirParametersAndMatch) {
  for (int slots : {2, 3, 4}) {
    check_bitwise(GetParam(), slots, DType::kBF16, /*grads_in_store=*/false, /*gated=*/true);
    check_bitwise(GetParam(), slots, DType::kF32, /*grads_in_store=*/true, /*gated=*/true);
  }
}

// The header's promise about on_updated's `master`, which OffloadedAdamW's publication relies on: with more
// sub-groups than slots (so slots are read into again after the gated fill), a plan that sometimes does not
// know the next sub-group yet, and gated or not, every master stays unchanged until the on_updated call
// slots - 2 positions later has returned.
TEST_P(OptimizerSwapTest, MasterWeightsStayUntilTheSlotIsReadAgain) {
  Harness h(GetParam());
  const std::vector<OptimizerGroup> groups = plain_groups(7, 3000, 1000);
  for (int slots : {2, 3, 4}) {
    for (bool gated : {false, true}) {
      SCOPED_TRACE(fmt::format("slots={} gated={}", slots, gated));
      auto swapper = OptimizerSwapper::create(*h.store, *h.pool, groups, OptimizerSwapOptions{.slots = slots});
      ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
      OptimizerSwapper& s = *swapper.value();
      HostState state(groups, 13);
      for (size_t g = 0; g < groups.size(); ++g) ASSERT_TRUE(s.initialize(g, state.master[g].data()).is_ok());
      Rng rng(17);
      state.new_grads(rng);
      std::vector<const float*> grads;
      for (const auto& g : state.grads) grads.push_back(g.data());
      struct Seen {
        const float* master;
        std::vector<float> copy;
      };
      std::vector<Seen> seen;
      const size_t keep = static_cast<size_t>(slots) - 2;
      // The last `keep` positions handed over must be as they were: the calls `keep` positions after them have
      // not returned yet (or, at the end, the step has not).
      auto check_kept = [&] {
        for (size_t i = seen.size() > keep ? seen.size() - keep : 0; i < seen.size(); ++i)
          EXPECT_EQ(0, std::memcmp(seen[i].master, seen[i].copy.data(), seen[i].copy.size() * sizeof(float)))
              << "position " << i << " changed by position " << seen.size();
      };
      auto on_updated = [&](size_t g, const float* master) -> Status {
        check_kept();
        seen.push_back({master, std::vector<float>(master, master + groups[g].numel)});
        return Status::ok();
      };
      OptimizerStepPlan plan;
      auto order = std::make_shared<size_t>(0);
      auto asks = std::make_shared<int>(0);
      plan.next = [order, asks, n = groups.size()](bool wait) -> Result<size_t> {
        if (!wait && (*asks)++ % 3 == 1) return OptimizerSwapper::kNotYet;
        return *order < n ? (*order)++ : OptimizerSwapper::kEnd;
      };
      if (gated) plan.params = [] { return Result<kernels::AdamWParams>(hyper(1)); };
      ASSERT_TRUE(s.step(grads, {}, DType::kF32, hyper(1), on_updated, plan).is_ok());
      EXPECT_EQ(seen.size(), groups.size());
      check_kept();
    }
  }
}

// A slot whose writes are still on their way holds back the read into it, never the update of a sub-group whose
// state another slot holds already: with every write kept back by the disk, a gated step still updates each
// sub-group its slots were filled with (the last of them used to wait for the first one's writes, to read the
// next sub-group into that slot first). The result is the plain step's bits.
TEST_P(OptimizerSwapTest, WritesInFlightHoldBackOnlyTheReadIntoTheirSlot) {
  const FaultOptions no_faults;  // only hold_writes
  Harness h(GetParam(), &no_faults);
  ASSERT_NE(h.store, nullptr);
  constexpr int kSlots = 4;
  const std::vector<OptimizerGroup> groups = plain_groups(7, 2000, 500);
  auto swapper = OptimizerSwapper::create(*h.store, *h.pool, groups, OptimizerSwapOptions{.slots = kSlots});
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  OptimizerSwapper& s = *swapper.value();
  HostState want(groups, 21);
  for (size_t g = 0; g < groups.size(); ++g) ASSERT_TRUE(s.initialize(g, want.master[g].data()).is_ok());
  Rng rng(23);
  want.new_grads(rng);
  const std::vector<const float*> grads = plain_step(groups, want);

  h.faulty->hold_writes(true);
  // Should the step wait for the held writes after all, this lets them go after a while, so that the test
  // fails instead of hanging.
  std::atomic<bool> released_by_test{false}, released_by_watchdog{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 200 && !released_by_test.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!released_by_test.load()) {
      released_by_watchdog.store(true);
      h.faulty->hold_writes(false);
    }
  });
  size_t updated = 0;
  auto on_updated = [&](size_t, const float*) -> Status {
    if (++updated == kSlots) {  // the last sub-group the gated fill read
      EXPECT_GT(h.faulty->held_writes(), 0u);
      released_by_test.store(true);
      h.faulty->hold_writes(false);
    }
    return Status::ok();
  };
  OptimizerStepPlan plan;
  plan.params = [] { return Result<kernels::AdamWParams>(hyper(1)); };
  const Status st = s.step(grads, {}, DType::kF32, hyper(9), on_updated, plan);
  released_by_test.store(true);
  watchdog.join();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_FALSE(released_by_watchdog.load())
      << "the step waited for writes held back by the disk before updating sub-groups whose state it had read";
  EXPECT_EQ(updated, groups.size());
  expect_state(s, groups, want);
}

// A slot is read into region by region: the next sub-group's master weights are read as soon as the slot's
// previous master weights are on disk, while its moments are still being written (the read used to wait for
// all three). The disk is held, then let through one write at a time by the test.
TEST_P(OptimizerSwapTest, ASlotIsReadIntoAsEachOfItsRegionsIsWritten) {
  const FaultOptions no_faults;  // only the hold
  Harness h(GetParam(), &no_faults);
  ASSERT_NE(h.store, nullptr);
  const std::vector<OptimizerGroup> groups = plain_groups(4, 1024, 0);  // 4 KiB keys: one write each
  auto swapper = OptimizerSwapper::create(*h.store, *h.pool, groups, OptimizerSwapOptions{.slots = 2});
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  OptimizerSwapper& s = *swapper.value();
  HostState want(groups, 31);
  for (size_t g = 0; g < groups.size(); ++g) ASSERT_TRUE(s.initialize(g, want.master[g].data()).is_ok());
  Rng rng(37);
  want.new_grads(rng);
  const std::vector<const float*> grads = plain_step(groups, want);
  // Polls `done` for up to 5 s.
  auto eventually = [](const std::function<bool()>& done) {
    for (int i = 0; i < 500; ++i) {
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return done();
  };

  h.faulty->hold_writes(true);
  Status st;
  std::thread stepper([&] { st = s.step(grads, {}, DType::kF32, hyper(1)); });
  // Sub-groups 0 and 1 updated, their writes held (master, m, v each); the third sub-group goes into the first
  // slot, whose writes are held.
  const bool both_written = eventually([&] { return h.faulty->held_writes() == 6; });
  EXPECT_TRUE(both_written) << h.faulty->held_writes() << " writes held";
  const uint64_t reads = h.faulty->reads_submitted();
  h.faulty->release_writes(1);  // sub-group 0's master weights reach the disk; its m and v do not yet
  const bool master_read = eventually([&] { return h.faulty->reads_submitted() > reads; });
  EXPECT_TRUE(master_read) << "the read into the first slot waited for the writes of its other regions";
  EXPECT_EQ(h.faulty->held_writes(), 5u);
  h.faulty->hold_writes(false);
  stepper.join();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  expect_state(s, groups, want);
}

// A write the store refuses at once (it is full) fails the step and leaves the sub-group's old state current:
// the new version, whose master and m went in and v did not, must not replace it (it used to, and the old
// keys were freed), and what went in of it is freed. The same for initialize.
TEST(OptimizerSwapFaultTest, AWriteTheStoreRefusesKeepsTheOldState) {
  const std::string dir = (fs::temp_directory_path() / fmt::format("strata_optswap_full_{}", ::getpid())).string();
  MemoryEngine engine(MemoryEngineOptions{.direct_alignment = 4096});
  IoQueue queue(engine, IoQueueOptions{64 << 10});
  SwapStoreOptions so;
  so.dir = dir;
  so.file_bytes = 1 << 20;  // 255 blocks of 4 KiB after the header: five keys of 48 blocks, not six
  so.max_files = 1;
  so.checksum_chunk = 64 << 10;
  auto store = SwapStore::open(queue, so);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  auto pool = PinnedPool::create(PinnedPoolOptions{.budget_bytes = 4 << 20, .lock = false});
  ASSERT_TRUE(pool.is_ok());
  const std::vector<OptimizerGroup> groups = plain_groups(1, 48 * 1024, 0);
  auto swapper = OptimizerSwapper::create(*store.value(), *pool.value(), groups, OptimizerSwapOptions{.slots = 2});
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  OptimizerSwapper& s = *swapper.value();
  HostState want(groups, 41);
  ASSERT_TRUE(s.initialize(0, want.master[0].data()).is_ok());
  Rng rng(43);
  want.new_grads(rng);
  const SwapStoreStats before = store.value()->stats();
  const Status st = s.step({want.grads[0].data()}, {}, DType::kF32, hyper(1));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.to_string().find("is full"), std::string::npos) << st.to_string();
  expect_state(s, groups, want);  // as initialized: master, zero moments
  // What was written of the new version is gone again (it stayed, filling the store, until the swapper died).
  EXPECT_EQ(store.value()->stats().used_bytes, before.used_bytes);
  EXPECT_EQ(store.value()->stats().keys, before.keys);
  // Re-initializing (a restart from a checkpoint) writes a new version beside the old too: this store refuses
  // its third key, and the old state reads back.
  std::vector<float> other(groups[0].numel, 0.5f);
  const Status refused = s.initialize(0, other.data(), other.data(), other.data());
  EXPECT_FALSE(refused.is_ok());
  expect_state(s, groups, want);
  EXPECT_EQ(store.value()->stats().used_bytes, before.used_bytes);
  swapper.value().reset();
  store.value().reset();
  fs::remove_all(dir);
}

// The same with every Adam pass on the calling thread: the swapper's own hand-offs between the engine threads
// and the caller are then all that ThreadSanitizer sees (the Debian TBB is not instrumented, so work it hands
// to its workers shows up as false races in a TSan build).

TEST(OptimizerSwapThreadsTest, SingleThreadedUpdatesUnderTheEngineThreads) {
  tbb::task_arena one(1);
  one.execute([] { check_bitwise("posix", 3, DType::kBF16); });
}

// A step that keeps the old state (keep_old) in the order a plan gives, sometimes not knowing the next group
// yet: rolled back it leaves the state and the store's bytes exactly as before; redone and committed it is
// bitwise the plain step, and a plain step after it goes on from there. A plan that fails midway or names a
// group twice stops the step, and the rollback again restores everything.
TEST(OptimizerSwapPlanTest, KeptStepsCommitOrRollBackExactly) {
  Harness h("posix");
  const auto groups = test_groups();
  auto swapper = OptimizerSwapper::create(*h.store, *h.pool, groups, OptimizerSwapOptions{.slots = 2});
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  OptimizerSwapper& s = *swapper.value();
  HostState want(groups, 3);
  for (size_t g = 0; g < groups.size(); ++g) ASSERT_TRUE(s.initialize(g, want.master[g].data()).is_ok());
  const uint64_t used_before = h.store->stats().used_bytes;
  auto read_all = [&] {
    std::vector<std::vector<float>> out;
    for (size_t g = 0; g < groups.size(); ++g) {
      std::vector<float> st(3 * groups[g].numel);
      EXPECT_TRUE(s.read_state(g, st.data(), st.data() + groups[g].numel, st.data() + 2 * groups[g].numel).is_ok());
      out.push_back(std::move(st));
    }
    return out;
  };
  const auto initial = read_all();
  Rng rng(5);
  want.new_grads(rng);
  std::vector<const float*> grads;
  for (const auto& g : want.grads) grads.push_back(g.data());
  // Reverse order; every other question without waiting is answered "not yet".
  auto reversed = [&](std::vector<size_t> order, int fail_after = -1) {
    auto at = std::make_shared<size_t>(0);
    auto asks = std::make_shared<int>(0);
    return [=](bool wait) -> Result<size_t> {
      if (!wait && (*asks)++ % 2 == 0) return OptimizerSwapper::kNotYet;
      if (static_cast<int>(*at) == fail_after) return Status::internal("the plan gave up");
      return *at < order.size() ? order[(*at)++] : OptimizerSwapper::kEnd;
    };
  };
  OptimizerStepPlan plan{.next = reversed({2, 1, 0}), .keep_old = true, .params = nullptr};
  ASSERT_TRUE(s.step(grads, {}, DType::kF32, hyper(1), nullptr, plan).is_ok());
  EXPECT_EQ(s.pending(), groups.size());
  EXPECT_FALSE(s.step(grads, {}, DType::kF32, hyper(1)).is_ok()) << "a step while new versions are pending";
  s.rollback();
  EXPECT_EQ(s.pending(), 0u);
  EXPECT_EQ(read_all(), initial) << "rolled back";
  EXPECT_EQ(h.store->stats().used_bytes, used_before) << "the new versions' extents are freed";

  // Failing midway, and naming a group twice: errors, and the rollback restores everything again.
  plan.next = reversed({2, 1, 0}, /*fail_after=*/2);
  const Status failed = s.step(grads, {}, DType::kF32, hyper(1), nullptr, plan);
  EXPECT_NE(failed.message().find("the plan gave up"), std::string::npos) << failed.to_string();
  plan.next = reversed({1, 1});
  s.rollback();
  const Status twice = s.step(grads, {}, DType::kF32, hyper(1), nullptr, plan);
  EXPECT_NE(twice.message().find("twice"), std::string::npos) << twice.to_string();
  s.rollback();
  EXPECT_EQ(read_all(), initial);

  // Parameters not known yet when the step starts (the gate): an error from it ends the step before any
  // update, leaving nothing pending.
  plan.next = reversed({0, 2, 1});
  plan.params = []() -> Result<kernels::AdamWParams> { return Status::internal("cancelled before its update"); };
  const Status cancelled = s.step(grads, {}, DType::kF32, hyper(1), nullptr, plan);
  EXPECT_NE(cancelled.message().find("cancelled before its update"), std::string::npos) << cancelled.to_string();
  EXPECT_EQ(s.pending(), 0u) << "nothing was updated";
  EXPECT_EQ(read_all(), initial);

  // Redone and committed, with the parameters from the gate (the step's own argument is ignored): the plain
  // step's bits, then a plain step continues from them.
  plan.next = reversed({0, 2, 1});
  int asked = 0;
  plan.params = [&asked]() -> Result<kernels::AdamWParams> {
    ++asked;
    return hyper(1);
  };
  ASSERT_TRUE(s.step(grads, {}, DType::kF32, hyper(9), nullptr, plan).is_ok());
  EXPECT_EQ(asked, 1);
  ASSERT_TRUE(s.commit().is_ok());
  for (int step = 1; step <= 2; ++step) {
    if (step == 2) {
      want.new_grads(rng);
      ASSERT_TRUE(s.step(grads, {}, DType::kF32, hyper(2)).is_ok());
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const auto& seg : groups[g].segments) {
        kernels::AdamWParams p = hyper(step);
        p.weight_decay = seg.weight_decay;
        kernels::cpu::fast::adamw_update_mixed(want.master[g].data() + seg.offset, want.m[g].data() + seg.offset,
                                               want.v[g].data() + seg.offset, want.grads[g].data() + seg.offset,
                                               nullptr, DType::kF32, seg.numel, p);
      }
    }
  }
  const auto got = read_all();
  for (size_t g = 0; g < groups.size(); ++g) {
    const size_t n = groups[g].numel;
    EXPECT_EQ(0, std::memcmp(got[g].data(), want.master[g].data(), n * 4)) << groups[g].name;
    EXPECT_EQ(0, std::memcmp(got[g].data() + n, want.m[g].data(), n * 4)) << groups[g].name;
    EXPECT_EQ(0, std::memcmp(got[g].data() + 2 * n, want.v[g].data(), n * 4)) << groups[g].name;
  }
  EXPECT_EQ(h.store->stats().used_bytes, used_before) << "one version of each key remains";
}

INSTANTIATE_TEST_SUITE_P(Engines, OptimizerSwapTest, ::testing::Values("memory", "posix"));

// Flipped bits on reads are caught by the store's checksums: the step fails with Corruption naming an optimizer
// key, and never returns a wrong update as good; EIO surfaces as an IOError. Seeded, so reproducible.
TEST(OptimizerSwapFaultTest, FaultsAreErrorsNeverWrongUpdates) {
  const auto groups = test_groups();
  int failures = 0, clean = 0;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    FaultOptions f;
    f.seed = seed;
    f.flip_rate = 0.02;
    f.eio_rate = 0.01;
    Harness h("memory", &f);
    if (!h.store) continue;  // the store's own header write met an injected EIO
    auto swapper = OptimizerSwapper::create(*h.store, *h.pool, groups);
    ASSERT_TRUE(swapper.is_ok());
    OptimizerSwapper& s = *swapper.value();
    HostState want(groups, seed);
    bool init_ok = true;
    for (size_t g = 0; g < groups.size(); ++g) init_ok = init_ok && s.initialize(g, want.master[g].data()).is_ok();
    if (!init_ok) continue;  // a write hit EIO: reported, nothing to check further
    Rng rng(seed);
    want.new_grads(rng);
    std::vector<const float*> grads;
    std::vector<void*> working;
    std::vector<std::vector<uint16_t>> w16;
    for (size_t g = 0; g < groups.size(); ++g) {
      grads.push_back(want.grads[g].data());
      w16.emplace_back(groups[g].numel);
      working.push_back(w16.back().data());
    }
    const Status st = s.step(grads, working, DType::kBF16, hyper(1));
    if (!st.is_ok()) {
      ++failures;
      EXPECT_TRUE(st.code() == StatusCode::kCorruption || st.code() == StatusCode::kIOError) << st.to_string();
      EXPECT_NE(st.message().find("opt."), std::string::npos) << "the error names the key: " << st.message();
      continue;
    }
    ++clean;
    for (size_t g = 0; g < groups.size(); ++g) {  // a step reported good must have computed from good bytes
      for (const auto& seg : groups[g].segments) {
        kernels::AdamWParams p = hyper(1);
        p.weight_decay = seg.weight_decay;
        kernels::cpu::fast::adamw_update_mixed(want.master[g].data() + seg.offset, want.m[g].data() + seg.offset,
                                               want.v[g].data() + seg.offset, want.grads[g].data() + seg.offset,
                                               nullptr, DType::kF32, seg.numel, p);
      }
      for (size_t i = 0; i < groups[g].numel; ++i)
        ASSERT_EQ(w16[g][i], f32_to_bf16(want.master[g][i])) << groups[g].name << " [" << i << "], seed " << seed;
    }
  }
  EXPECT_GT(failures, 0) << "the fault rates should have hit some steps";
  RecordProperty("failed_steps", failures);
  RecordProperty("clean_steps", clean);
}

TEST(OptimizerSwapConfigTest, BadGroupsAreRejectedByName) {
  Harness h("memory");
  auto expect_bad = [&](std::vector<OptimizerGroup> groups, const char* needle) {
    auto s = OptimizerSwapper::create(*h.store, *h.pool, std::move(groups));
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.status().message().find(needle), std::string::npos) << s.status().message();
  };
  expect_bad({{"a", 10, {{0, 5, 0.f}}, {}}}, "cover 5 of 10");
  expect_bad({{"a", 10, {{0, 5, 0.f}, {6, 4, 0.f}}, {}}}, "starts at 6");
  expect_bad({{"a", 10, {{0, 10, 0.f}}, {}}, {"a", 4, {{0, 4, 0.f}}, {}}}, "two sub-groups are named 'a'");
  expect_bad({}, "no sub-groups");
  // Staging slots come from the pool's budget: too large a group is refused, naming the budget.
  auto big = OptimizerSwapper::create(*h.store, *h.pool, {{"big", 4 << 20, {{0, 4 << 20, 0.f}}, {}}});
  ASSERT_FALSE(big.is_ok());
  EXPECT_EQ(big.status().code(), StatusCode::kOutOfMemory) << big.status().to_string();
}

}  // namespace
}  // namespace strata::offload
