// The coordinator on the CPU backend (whose device tier is a bounded arena): parameters from every home tier
// reach the device intact, a device budget smaller than the model forces evictions without stale data,
// gradients accumulate exactly across evictions and come home, a changed access order re-records the trace,
// and failures (a budget below the working set, a failing disk) come back as errors naming the unit.
#include "offload/coordinator.h"

#include <chrono>
#include <cstring>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/log.h"
#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "storage/fault_engine.h"
#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "storage/swap_store.h"
#include "tests/forwarding_device.h"
#include "tests/memory_tiers.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

constexpr int kUnits = 6;

size_t numel_of(int u) { return 3000 + 1024 * (u % 2); }  // two sizes, so freed slots are reused by size

// The CPU device with device-to-host copies slowed down, so that anything that frees or reuses a buffer
// while its download is still running shows up (as wrong gradients, or under ASan).
class SlowDownloadDevice final : public testing::ForwardingDevice {
 public:
  std::string description() const override { return "cpu with slow downloads"; }
  void download(void* dst, const void* src, size_t bytes) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ForwardingDevice::download(dst, src, bytes);
  }
};

// A device, a swap store on an in-memory disk (optionally failing), a pool and a copy engine, with the
// coordinator destroyed first.
struct Rig : testing::MemoryTiers {
  explicit Rig(Tier home, uint64_t device_limit = 0, CoordinatorOptions o = {}, bool faulty = false,
               bool slow_downloads = false)
      : MemoryTiers(faulty) {
    device = slow_downloads ? std::make_unique<SlowDownloadDevice>()
                            : kernels::make_cpu_device(kernels::cpu_fast_kernels());
    device->set_memory_limit(device_limit);
    std::vector<CoordinatorUnit> units;
    for (int u = 0; u < kUnits; ++u) units.push_back({fmt::format("unit{}", u), numel_of(u), true, {}});
    o.param_home = home;
    o.nvme_chunk_elements = 2048;  // units span two chunks
    auto c = Coordinator::create(*device, copies, pool.get(), store.get(), units, o);
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    coord = std::move(c).value();
    Rng rng(11);
    for (int u = 0; u < kUnits; ++u) {
      params.emplace_back(numel_of(u));
      grads.emplace_back(numel_of(u), 0.0f);
      for (float& x : params[u]) x = static_cast<float>(rng.normal());
      EXPECT_TRUE(coord->write_params(u, params[u].data()).is_ok());
    }
  }

  // One step in `order` (forward in order, backward in reverse): every acquire must see the current
  // parameters, and backward adds a step- and unit-dependent value to every gradient.
  void step(const std::vector<int>& order, int n) {
    coord->begin_step();
    for (int u : order) {
      auto v = coord->acquire(u, Pass::kForward);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      ASSERT_EQ(std::memcmp(v->params, params[u].data(), numel_of(u) * 4), 0) << "stale parameters of unit " << u;
      coord->release(u, Pass::kForward);
    }
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      const int u = *it;
      auto v = coord->acquire(u, Pass::kBackward);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      ASSERT_EQ(std::memcmp(v->params, params[u].data(), numel_of(u) * 4), 0) << "stale parameters of unit " << u;
      for (size_t i = 0; i < numel_of(u); ++i) {
        const float add = 0.25f * static_cast<float>((i + 7 * u + n) % 13) + 0.1f;
        v->grads[i] += add;
        grads[u][i] += add;
      }
      coord->release(u, Pass::kBackward);
    }
  }

  // GPT-2's pattern: unit 0 is the tied embedding, used first and last in forward (encoder, LM head) and in
  // backward (LM head with its parameters, then the encoder's gradient only).
  void tied_step(int n) {
    coord->begin_step();
    std::vector<std::pair<int, Pass>> order;
    for (int u = 0; u < kUnits; ++u) order.push_back({u, Pass::kForward});
    order.push_back({0, Pass::kForward});
    order.push_back({0, Pass::kBackward});
    for (int u = kUnits - 1; u >= 1; --u) order.push_back({u, Pass::kBackward});
    order.push_back({0, Pass::kGradients});
    for (auto [u, pass] : order) {
      auto v = coord->acquire(u, pass);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      if (pass != Pass::kGradients) {
        ASSERT_EQ(std::memcmp(v->params, params[u].data(), numel_of(u) * 4), 0) << "stale parameters of " << u;
      }
      if (pass != Pass::kForward) {
        for (size_t i = 0; i < numel_of(u); ++i) {
          const float add = 0.5f * static_cast<float>((i + 3 * u + n + (pass == Pass::kGradients)) % 11) - 1.0f;
          v->grads[i] += add;
          grads[u][i] += add;
        }
      }
      coord->release(u, pass);
    }
  }

  // Brings the gradients home and checks them; then "updates" the parameters the way the optimizer would.
  void check_grads_and_update(int n) {
    ASSERT_OK(coord->flush_grads());
    for (int u = 0; u < kUnits; ++u) {
      std::vector<float> got(numel_of(u));
      if (coord->options().grad_home == Tier::kNvme) {  // chunks of nvme_chunk_elements in the store
        const auto& keys = coord->grad_keys(u);
        for (size_t k = 0; k < keys.size(); ++k) {
          const size_t off = k * 2048, len = std::min<size_t>(2048, numel_of(u) - off);
          ASSERT_OK(store->read(keys[k], got.data() + off, len * 4));
        }
      } else {
        std::memcpy(got.data(), coord->host_grads(u), numel_of(u) * 4);
      }
      ASSERT_EQ(std::memcmp(got.data(), grads[u].data(), numel_of(u) * 4), 0) << "gradients of unit " << u;
      EXPECT_EQ(coord->grad_sum_squares(u), kernels::cpu::fast::add_sum_squares(0.0, grads[u].data(), numel_of(u)));
      if (coord->options().grad_home == Tier::kHost && !coord->sharded()) {
        // Changed in place (summed over ranks, say): the sum flush_grads took is not used.
        coord->host_grads_for_update(u)[0] += 1.0f;
        grads[u][0] += 1.0f;
        EXPECT_EQ(coord->grad_sum_squares(u), kernels::cpu::fast::add_sum_squares(0.0, grads[u].data(), numel_of(u)));
      }
      for (size_t i = 0; i < numel_of(u); ++i) params[u][i] += 0.001f * static_cast<float>(n + 1);
      ASSERT_OK(coord->write_params(u, params[u].data()));
    }
  }

  void zero_grads() {
    ASSERT_OK(coord->zero_grads());
    for (auto& g : grads) std::fill(g.begin(), g.end(), 0.0f);
  }

  // Unit u's parameters read back through the coordinator equal the current ones.
  void expect_params_read_back(int u) {
    std::vector<float> back(numel_of(u));
    ASSERT_OK(coord->read_params(u, back.data()));
    EXPECT_EQ(back, params[u]) << "unit " << u;
  }

  std::unique_ptr<kernels::Device> device;
  CopyEngine copies;
  std::unique_ptr<Coordinator> coord;
  std::vector<std::vector<float>> params, grads;
};

std::vector<int> all_units() {
  std::vector<int> v;
  for (int u = 0; u < kUnits; ++u) v.push_back(u);
  return v;
}

class CoordinatorHomeTest : public ::testing::TestWithParam<Tier> {};

TEST_P(CoordinatorHomeTest, ParametersAndGradientsRoundTripExactly) {
  Rig rig(GetParam());
  for (int n = 0; n < 3; ++n) {
    rig.zero_grads();
    rig.step(all_units(), n);
    rig.check_grads_and_update(n);
  }
  for (int u = 0; u < kUnits; ++u) {
    rig.expect_params_read_back(u);
    EXPECT_EQ(rig.coord->residency(u, StateClass::kParams).home, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, CoordinatorHomeTest, ::testing::Values(Tier::kDevice, Tier::kHost, Tier::kNvme),
                         [](const auto& info) { return std::string(tier_name(info.param)); });

TEST(CoordinatorTest, ADeviceBudgetBelowTheModelEvictsWithoutStaleDataAndAccumulatesExactly) {
  // Room for three of the larger units: a backward use needs parameters and gradients (two slots).
  const uint64_t limit = 3 * numel_of(1) * 4;
  Rig rig(Tier::kNvme, limit);
  for (int n = 0; n < 4; ++n) {
    rig.zero_grads();
    rig.step(all_units(), n);
    rig.step(all_units(), n + 100);  // a second micro-batch: gradients evicted in between come back exactly
    rig.check_grads_and_update(n);
  }
  EXPECT_LE(rig.device->peak_bytes(), limit);
  const CoordinatorStats s = rig.coord->take_stats();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.write_backs, 0u) << "units updated on the device were evicted, their new parameters written home";
  EXPECT_GT(s.prefetch_hits, 0u) << "replayed steps should find prefetched units";
  EXPECT_EQ(s.retraces, 0u);
}

// The gradient norm's sums of squares are taken as the last backward's downloads land, not by flush_grads
// after it, and equal the sums of the gradients as they end up: not of an earlier micro-batch's download (with
// the parameters offloaded every backward sends its gradients home), and not when the gradients will change at
// home before the norm (set_norms_on_arrival(false), as under data parallelism).
class CoordinatorNormTest : public ::testing::TestWithParam<Tier> {};

TEST_P(CoordinatorNormTest, TheNormIsSummedAsTheLastBackwardsGradientsLand) {
  for (const bool on_arrival : {true, false}) {
    SCOPED_TRACE(on_arrival ? "norms on arrival" : "norms in flush_grads");
    Rig rig(GetParam(), 0, {}, /*faulty=*/false, /*slow_downloads=*/true);
    rig.coord->set_norms_on_arrival(on_arrival);
    for (int n = 0; n < 2; ++n) {
      rig.zero_grads();
      rig.coord->set_accumulating(true);
      rig.step(all_units(), n);
      rig.coord->set_accumulating(false);
      rig.step(all_units(), n + 100);
      rig.coord->take_stats();
      rig.check_grads_and_update(n);  // each unit's sum of squares against the gradient's own
      EXPECT_EQ(rig.coord->take_stats().norms_early, on_arrival ? kUnits : 0u) << "step " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ParamHomes, CoordinatorNormTest, ::testing::Values(Tier::kDevice, Tier::kHost),
                         [](const auto& info) { return std::string(tier_name(info.param)); });

// New parameters of a unit on the device are not written to nvme (the device copy is marked newer); read_params
// and the next acquires get them from the device.
TEST(CoordinatorTest, ParametersOnTheDeviceGoHomeOnlyWhenEvicted) {
  Rig rig(Tier::kNvme);
  rig.step(all_units(), 0);  // every unit on the device (no budget)
  rig.coord->take_stats();
  for (int u = 0; u < kUnits; ++u) {
    for (float& x : rig.params[u]) x += 1.0f;
    ASSERT_OK(rig.coord->write_params(u, rig.params[u].data()));
    const Residency res = rig.coord->residency(u, StateClass::kParams);
    EXPECT_TRUE(res.on_device && res.dirty && !res.on_nvme) << "unit " << u;
  }
  EXPECT_EQ(rig.coord->take_stats().nvme_write_bytes, 0u);
  rig.expect_params_read_back(3);  // from the device copy
  rig.step(all_units(), 1);  // still the new parameters, from the device
}

// Under a cap of two units' parameters, loading another evicts a newer device copy, which goes home first; a
// disk that fails that write stops the load with the unit's name, and the newer copy stays on the device.
TEST(CoordinatorTest, AFailedWriteBackKeepsTheNewerDeviceCopy) {
  CoordinatorOptions o;
  o.max_live_elements = 2 * numel_of(1);
  Rig rig(Tier::kNvme, 0, o, /*faulty=*/true);
  rig.zero_grads();
  rig.step(all_units(), 0);
  rig.check_grads_and_update(0);  // the units still on the device now hold newer parameters than nvme
  std::vector<int> resident, absent;
  for (int u = 0; u < kUnits; ++u) {
    const Residency res = rig.coord->residency(u, StateClass::kParams);
    (res.on_device ? resident : absent).push_back(u);
    EXPECT_EQ(res.dirty, res.on_device) << "unit " << u;
  }
  ASSERT_FALSE(resident.empty());
  ASSERT_FALSE(absent.empty());
  rig.fault->set_enabled(true);
  rig.coord->begin_step();
  auto v = rig.coord->acquire(absent[0], Pass::kForward);
  ASSERT_FALSE(v.is_ok());
  EXPECT_NE(v.status().to_string().find("before evicting it"), std::string::npos) << v.status().to_string();
  for (int u : resident) EXPECT_TRUE(rig.coord->residency(u, StateClass::kParams).dirty) << "unit " << u;
  rig.fault->set_enabled(false);
  for (int u : resident) rig.expect_params_read_back(u);
}

// With room for three units, every step evicts: the new parameters go home on eviction and come back exact
// (the step checks every acquire against the current parameters).
TEST(CoordinatorTest, EvictedNewerParametersComeBackExact) {
  const uint64_t limit = 3 * numel_of(1) * 4;
  Rig rig(Tier::kNvme, limit);
  for (int n = 0; n < 3; ++n) {
    rig.zero_grads();
    rig.step(all_units(), n);
    rig.check_grads_and_update(n);
  }
  for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
  EXPECT_GT(rig.coord->take_stats().write_backs, 0u);
}

TEST(CoordinatorTest, GradientsOnNvmeAccumulateExactlyUnderADeviceBudget) {
  CoordinatorOptions o;
  o.grad_home = Tier::kNvme;
  Rig rig(Tier::kHost, 3 * numel_of(1) * 4, o);
  for (int n = 0; n < 3; ++n) {
    rig.zero_grads();
    rig.step(all_units(), n);
    rig.step(all_units(), n + 100);  // accumulated gradients come back from the store
    rig.check_grads_and_update(n);
  }
  EXPECT_EQ(rig.coord->residency(0, StateClass::kGrads).home, Tier::kNvme);
  EXPECT_GT(rig.coord->take_stats().nvme_write_bytes, 0u);
}

// Regression: the tied unit's gradient buffer, kept on the device between its two backward uses, was once
// given back for reuse guarded by an upload that had already finished while its download was still running
// (slow downloads make that window wide).
class CoordinatorTiedTest : public ::testing::TestWithParam<Tier> {};

TEST_P(CoordinatorTiedTest, TheTiedUnitsGradientsSurviveEvictionAcrossMicroBatches) {
  CoordinatorOptions o;
  o.grad_home = GetParam();
  Rig rig(Tier::kNvme, 3 * numel_of(1) * 4, o, /*faulty=*/false, /*slow_downloads=*/true);
  for (int n = 0; n < 3; ++n) {
    rig.zero_grads();
    for (int micro = 0; micro < 3; ++micro) rig.tied_step(10 * n + micro);
    rig.check_grads_and_update(n);
  }
  EXPECT_GT(rig.coord->take_stats().evictions, 0u);
}

INSTANTIATE_TEST_SUITE_P(GradHomes, CoordinatorTiedTest, ::testing::Values(Tier::kHost, Tier::kNvme),
                         [](const auto& info) { return std::string(tier_name(info.param)); });

TEST(CoordinatorTest, AChangedAccessOrderReRecordsTheTraceAndStaysCorrect) {
  Rig rig(Tier::kHost, 3 * numel_of(1) * 4);
  const std::vector<int> full = all_units(), skipping = {0, 2, 5, 3}, reordered = {5, 4, 1, 0, 2, 3};
  int n = 0;
  for (const auto* order : {&full, &full, &skipping, &skipping, &reordered, &full, &full}) {
    rig.zero_grads();
    rig.step(*order, n);
    rig.check_grads_and_update(n);
    ++n;
  }
  const CoordinatorStats s = rig.coord->take_stats();
  EXPECT_EQ(s.retraces, 3u) << "full -> skipping -> reordered -> full";
}

TEST(CoordinatorTest, ADeviceBudgetBelowOneUnitIsAnErrorNamingTheUnit) {
  Rig rig(Tier::kHost, numel_of(0) * 4 / 2);
  rig.coord->begin_step();
  auto v = rig.coord->acquire(1, Pass::kForward);
  ASSERT_FALSE(v.is_ok());
  EXPECT_EQ(v.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(v.status().to_string().find("unit1"), std::string::npos) << v.status().to_string();
  // Nothing is left in use: a later acquire within budget of a smaller request still fails cleanly.
  EXPECT_FALSE(rig.coord->acquire(0, Pass::kForward).is_ok());
}

TEST(CoordinatorTest, AFailingDiskIsAnErrorNamingTheUnitNeverWrongData) {
  Rig rig(Tier::kNvme, 0, {}, /*faulty=*/true);
  rig.fault->set_enabled(true);
  rig.coord->begin_step();
  auto v = rig.coord->acquire(2, Pass::kForward);
  ASSERT_FALSE(v.is_ok());
  EXPECT_NE(v.status().to_string().find("unit2"), std::string::npos) << v.status().to_string();
  rig.fault->set_enabled(false);
  // The next attempt loads it again and sees the right bytes.
  auto again = rig.coord->acquire(2, Pass::kForward);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(std::memcmp(again->params, rig.params[2].data(), numel_of(2) * 4), 0);
  rig.coord->release(2, Pass::kForward);
}

// A prefetch that failed leaves its error for the acquire of its unit; a read of that unit's parameters (a
// checkpoint's) comes from the home copy and must not fail on it.
TEST(CoordinatorTest, AFailedPrefetchDoesNotFailAReadOfItsUnit) {
  CoordinatorOptions o;
  o.max_live_elements = 3 * numel_of(1);
  Rig rig(Tier::kNvme, 0, o, /*faulty=*/true);
  rig.zero_grads();
  rig.step(all_units(), 0);  // records the trace; the units used first next are on the device
  rig.fault->set_enabled(true);
  rig.coord->begin_step();
  for (int u : {0, 1}) {  // on the device; the second acquire's prefetch evicts unit 0 for unit 3, whose read fails
    auto v = rig.coord->acquire(u, Pass::kForward);
    ASSERT_TRUE(v.is_ok()) << v.status().to_string();
    rig.coord->release(u, Pass::kForward);
  }
  ASSERT_FALSE(rig.coord->residency(0, StateClass::kParams).on_device);
  ASSERT_OK(rig.copies.h2d.submit([] { return Status::ok(); }).wait());  // every load queued before has ended
  rig.fault->set_enabled(false);
  for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
}

// The offloaded optimizer's way of publishing: each forward acquire's hook writes its unit's new parameters
// (in `pieces` in order, the copies still reading the caller's buffer when write_params returns), or with
// `publish_all` every pending unit, last first (the order of updates started during backward); the pending
// hint tells prefetch which units the next forward will rewrite.
struct PublishingRig : Rig {
  explicit PublishingRig(CoordinatorOptions o, bool faulty = false) : Rig(Tier::kNvme, 0, o, faulty) {
    coord->set_before_use([this](size_t u) -> Status {
      if (u == SIZE_MAX) return Status::ok();
      if (!publish_all) return publish(u);
      for (int w = kUnits - 1; w >= 0; --w) STRATA_RETURN_IF_ERROR(publish(w));
      return Status::ok();
    });
  }
  Status publish(size_t u) {
    if (!pending[u]) return Status::ok();
    pending[u] = false;
    const size_t n = numel_of(static_cast<int>(u)), first = pieces == 1 ? n : std::min<size_t>(2048, n);
    STRATA_RETURN_IF_ERROR(coord->write_params(u, 0, first, params[u].data(), &copies));
    if (first == n || publish_first_piece_only) return Status::ok();
    return coord->write_params(u, first, n - first, params[u].data() + first, &copies);
  }
  // New parameters for every unit, to be published at their next forward use.
  void update_all(int n) {
    for (const CopyTicket& t : copies) (void)t.wait();  // the old ones are still being copied out
    copies.clear();
    for (int u = 0; u < kUnits; ++u) {
      const size_t end = publish_first_piece_only ? std::min<size_t>(2048, numel_of(u)) : numel_of(u);
      for (size_t i = 0; i < end; ++i) params[u][i] -= 0.002f * static_cast<float>(n + 1);
      pending[u] = true;
    }
  }
  void forward() {
    coord->begin_step();
    for (int u = 0; u < kUnits; ++u) {
      auto v = coord->acquire(u, Pass::kForward);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      ASSERT_EQ(std::memcmp(v->params, params[u].data(), numel_of(u) * 4), 0) << "stale parameters of unit " << u;
      coord->release(u, Pass::kForward);
    }
  }
  void backward(int n) {
    for (int u = kUnits - 1; u >= 0; --u) {
      auto v = coord->acquire(u, Pass::kBackward);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      ASSERT_EQ(std::memcmp(v->params, params[u].data(), numel_of(u) * 4), 0) << "stale parameters of unit " << u;
      for (size_t i = 0; i < numel_of(u); ++i) v->grads[i] += static_cast<float>(n);
      coord->release(u, Pass::kBackward);
    }
  }
  // Prefetch is told which units the next forward publishes (as the optimizer's will_publish does).
  void use_pending_hint() {
    coord->set_params_pending([this](size_t u) { return static_cast<bool>(pending[u]); });
  }
  // A step that records the trace, every device copy dropped, and new values for every unit: the next forward
  // publishes each of them to a device copy of its own.
  void record_step_and_update() {
    ASSERT_OK(coord->zero_grads());
    forward();
    backward(0);
    ASSERT_OK(coord->flush_grads());
    coord->drop_device_params();
    update_all(0);
  }
  int pieces = 2;
  bool publish_first_piece_only = false;
  bool publish_all = false;
  std::vector<bool> pending = std::vector<bool>(kUnits, false);
  std::vector<CopyTicket> copies;
};

// Published at its own acquire, a unit on nvme goes to the device straight from the optimizer's buffer (and
// home): the forward reads nothing from nvme, while the home copy gets the same values (the backward, after
// the live cap evicted the units, loads them from there).
TEST(CoordinatorTest, ParametersPublishedAtTheirAcquireGoToTheDeviceWithoutARoundTrip) {
  for (int pieces : {1, 2}) {
    for (bool hint : {true, false}) {
      SCOPED_TRACE(fmt::format("{} pieces, pending hint {}", pieces, hint));
      CoordinatorOptions o;
      o.max_live_elements = 2 * numel_of(1);
      PublishingRig rig(o);
      rig.pieces = pieces;
      if (hint) rig.use_pending_hint();
      for (int n = 0; n < 3; ++n) {
        ASSERT_OK(rig.coord->zero_grads());
        rig.forward();
        rig.backward(n);
        ASSERT_OK(rig.coord->flush_grads());
        rig.update_all(n);
        (void)rig.coord->take_stats();
        rig.forward();
        const CoordinatorStats fwd = rig.coord->take_stats();
        // Without the hint the prefetches load the old values (replaced on the device before any use).
        if (hint) {
          EXPECT_EQ(fwd.nvme_read_bytes, 0u) << "step " << n;
        }
        rig.backward(n);
        ASSERT_OK(rig.coord->flush_grads());
        EXPECT_GT(rig.coord->take_stats().nvme_read_bytes, 0u) << "the backward loads evicted units from home";
      }
      for (const CopyTicket& t : rig.copies) ASSERT_OK(t.wait());
      for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
    }
  }
}

// Units published together with the one being acquired (the update's order differs from the forward's) go
// to the device as a prefetch would: with room for all, the forward reads nothing from nvme.
TEST(CoordinatorTest, UnitsPublishedWithTheAcquiredOneGoToTheDeviceToo) {
  PublishingRig rig(CoordinatorOptions{});
  rig.publish_all = true;
  rig.use_pending_hint();
  rig.record_step_and_update();
  (void)rig.coord->take_stats();
  rig.forward();
  const CoordinatorStats fwd = rig.coord->take_stats();
  EXPECT_EQ(fwd.nvme_read_bytes, 0u);
  EXPECT_EQ(fwd.fetches, static_cast<uint64_t>(kUnits));
  for (const CopyTicket& t : rig.copies) ASSERT_OK(t.wait());
  rig.coord->drop_device_params();
  for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
}

// With the home writes held back by a slow disk, the acquire that published its unit still sees the new
// values at once; a read of the home copy waits for the writes instead of reading the old version.
TEST(CoordinatorTest, APublishedUnitIsUsableBeforeItsHomeWriteAndTheHomeReadWaitsForIt) {
  PublishingRig rig(CoordinatorOptions{}, /*faulty=*/true);
  rig.use_pending_hint();
  rig.record_step_and_update();
  rig.fault->hold_writes(true);
  rig.forward();
  // The home writes are issued from the copy queue's thread, which a loaded machine may not have run yet.
  for (int i = 0; i < 10000 && rig.fault->held_writes() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GT(rig.fault->held_writes(), 0u);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    rig.fault->hold_writes(false);
  });
  rig.coord->drop_device_params();
  for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
  release.join();
}

// A publication that stops after the first piece leaves a device copy that is never used: the acquire loads
// the unit from home, whose first chunk is new and second old, as the optimizer left it.
TEST(CoordinatorTest, AHalfPublishedUnitIsLoadedFromHome) {
  PublishingRig rig(CoordinatorOptions{});
  rig.publish_first_piece_only = true;
  rig.use_pending_hint();
  ASSERT_OK(rig.coord->zero_grads());
  rig.forward();
  rig.coord->drop_device_params();
  rig.update_all(0);
  (void)rig.coord->take_stats();
  rig.forward();  // checks every unit against the half-updated values
  EXPECT_GT(rig.coord->take_stats().nvme_read_bytes, 0u);
  for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
}

// A home write that fails is not hidden by the device copy published beside it: once that copy is gone, the
// next load of the unit and a read of it fail, naming it, instead of returning the previous version.
TEST(CoordinatorTest, AFailedHomeWriteOfAPublishedUnitFailsItsNextLoadNeverStaleData) {
  PublishingRig rig(CoordinatorOptions{}, /*faulty=*/true);
  rig.use_pending_hint();
  ASSERT_OK(rig.coord->zero_grads());
  rig.forward();
  rig.coord->drop_device_params();
  rig.update_all(0);
  rig.fault->set_enabled(true);
  rig.forward();  // the uploads need no disk: the new values are on the device
  for (const CopyTicket& t : rig.copies) (void)t.wait();
  rig.fault->set_enabled(false);
  rig.coord->drop_device_params();
  rig.coord->begin_step();
  auto v = rig.coord->acquire(1, Pass::kForward);
  ASSERT_FALSE(v.is_ok());
  EXPECT_NE(v.status().to_string().find("writing key 'param.unit1.0'"), std::string::npos) << v.status().to_string();
  std::vector<float> back(numel_of(2));
  const Status read = rig.coord->read_params(2, back.data());
  ASSERT_FALSE(read.is_ok());
  EXPECT_NE(read.to_string().find("unit2"), std::string::npos) << read.to_string();
  // Written again, it reads back right.
  ASSERT_OK(rig.coord->write_params(2, rig.params[2].data()));
  rig.expect_params_read_back(2);
}

// A unit whose home write failed but whose published device copy is still there reads back from that copy
// (a checkpoint of it succeeds), and the copy goes home when it is evicted; one already evicted fails.
TEST(CoordinatorTest, AFailedHomeWriteIsReadFromTheDeviceCopyWhileThereIsOne) {
  CoordinatorOptions o;
  o.max_live_elements = 2 * numel_of(1);  // the forward evicts all but the last units it published
  PublishingRig rig(o, /*faulty=*/true);
  rig.use_pending_hint();
  rig.record_step_and_update();
  rig.fault->set_enabled(true);
  ::testing::internal::CaptureStderr();
  rig.forward();
  for (const CopyTicket& t : rig.copies) (void)t.wait();
  logger().flush();
  const std::string said = ::testing::internal::GetCapturedStderr();
  rig.fault->set_enabled(false);
  // The failure is said when it happens, naming the unit: nothing may read that copy again.
  EXPECT_NE(said.find("offload: writing unit '"), std::string::npos) << said;
  const int last = kUnits - 1;
  ASSERT_TRUE(rig.coord->residency(last, StateClass::kParams).on_device);
  ASSERT_FALSE(rig.coord->residency(0, StateClass::kParams).on_device);
  for (int u = 0; u < kUnits; ++u) {  // a checkpoint reads every unit
    if (!rig.coord->residency(u, StateClass::kParams).on_device) continue;
    rig.expect_params_read_back(u);
    EXPECT_TRUE(rig.coord->residency(u, StateClass::kParams).dirty)
        << "its home copy is not what unit " << u << " holds";
  }
  std::vector<float> back(numel_of(0));
  EXPECT_FALSE(rig.coord->read_params(0, back.data()).is_ok());
  // The units evicted with a failed write are written again (as a resume would); the next forward evicts the
  // read one (the cap), writing it home first, and later loads it from home intact.
  for (int u = 0; u < kUnits; ++u) {
    if (rig.coord->residency(u, StateClass::kParams).on_device) continue;
    ASSERT_OK(rig.coord->write_params(u, rig.params[u].data()));
  }
  rig.forward();
  EXPECT_GT(rig.coord->take_stats().write_backs, 0u);
  rig.backward(1);
  ASSERT_OK(rig.coord->flush_grads());
  for (int u = 0; u < kUnits; ++u) rig.expect_params_read_back(u);
}

TEST(CoordinatorTest, AUnitOnNvmeThatWasNeverWrittenIsAnErrorNamingIt) {
  auto device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
  MemoryEngine memory;
  IoQueue queue(memory);
  auto store = SwapStore::open(queue, SwapStoreOptions{.dir = "/swap", .file_bytes = 4 << 20, .direct = false});
  ASSERT_TRUE(store.is_ok());
  auto pool = PinnedPool::create(PinnedPoolOptions{.budget_bytes = 16 << 20, .lock = false});
  ASSERT_TRUE(pool.is_ok());
  CopyEngine copies;
  CoordinatorOptions o;
  o.param_home = Tier::kNvme;
  o.nvme_chunk_elements = 2048;
  auto c = Coordinator::create(*device, copies, pool->get(), store->get(), {{"blank", 5000, true, {}}}, o);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  std::vector<float> half(2048, 1.0f);
  ASSERT_OK(c.value()->write_params(0, 0, 2048, half.data()));  // one chunk of three
  c.value()->begin_step();
  auto v = c.value()->acquire(0, Pass::kForward);
  ASSERT_FALSE(v.is_ok());
  EXPECT_NE(v.status().to_string().find("'blank'"), std::string::npos) << v.status().to_string();
  std::vector<float> back(5000);
  EXPECT_FALSE(c.value()->read_params(0, back.data()).is_ok());
}

TEST(CoordinatorTest, PersistentUnitsStayOnTheDevice) {
  CoordinatorOptions o;
  o.persistence_threshold = 3000;  // the smaller units
  Rig rig(Tier::kHost, 0, o);
  rig.zero_grads();
  rig.step(all_units(), 0);
  rig.check_grads_and_update(0);
  for (int u = 0; u < kUnits; ++u) {
    const Residency r = rig.coord->residency(u, StateClass::kParams);
    EXPECT_EQ(r.home, numel_of(u) <= 3000 ? Tier::kDevice : Tier::kHost) << u;
    if (r.home == Tier::kDevice) {
      EXPECT_TRUE(r.on_device) << u;
    }
  }
}

}  // namespace
}  // namespace strata::offload
