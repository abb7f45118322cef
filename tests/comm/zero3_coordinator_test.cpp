// zero3_coordinator_test.cpp — run by CTest under `mpiexec -np 2`: the ZeRO-3 coordinator with each rank's
// gradient shards on NVMe (a swap store on an in-memory disk) against the same coordinator with them in host
// memory: over two micro-batches (the first reduce-scatter of a step writes the shard, the second reads, adds
// and writes it back) both hold bitwise the sum they must, with the same sums of squares (less excluded
// ranges), also for an empty shard and a unit no backward used; and a disk that fails under one rank's write
// is an error on that rank naming the unit, never a wrong gradient, while the other rank finishes its step.
// Without sharding (data parallelism's stages 0-2), gradients on NVMe are summed over the ranks where they lie
// (Coordinator::sum_grads_over, pipelined over the units): bitwise the ranks' sums with one write-staging
// buffer (no read-ahead) and with three; a rank whose disk fails sums on with NaN and names the unit.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast.h"
#include "offload/coordinator.h"
#include "tests/memory_tiers.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

// Uneven over 2 ranks (the last shard is short, strides are padded) and over chunks of 1024 elements; unit 3
// is so small that rank 1's shard of it is empty, and unit 4 is used in forward only (its gradient is zero).
const std::vector<size_t> kNumel = {3000, 5000, 4100, 10, 2000};
constexpr size_t kChunk = 1024;
constexpr size_t kForwardOnly = 4;
// Left out of unit 1's sum of squares (tensor parallelism's replicated tensors), across both ranks' shards.
const Ranges kExcluded = {{100, 300}, {4000, 50}};

// What rank `rank` adds to element i of unit u in micro-batch m.
float grad_of(int rank, size_t u, size_t i, int m) {
  return 0.25f * static_cast<float>((i + 7 * u + 3 * m + 5 * rank) % 13) + 0.1f;
}

// One rank's offload stack: the in-memory tiers (a swap store whose disk can be made to fail, a pinned pool),
// the CPU device, the copy engine, and the coordinator sharding over `group` (destroyed first).
struct Rank : testing::MemoryTiers {
  // `sharded` false: every rank holds whole gradients (no shard group); `buffers` write-staging buffers.
  Rank(comm::Communicator& group, Tier grad_home, bool sharded = true, int buffers = 1) {
    device = kernels::make_cpu_device(kernels::cpu_fast_kernels());
    std::vector<CoordinatorUnit> units;
    for (size_t u = 0; u < kNumel.size(); ++u)
      units.push_back({fmt::format("unit{}", u), kNumel[u], true, u == 1 ? kExcluded : Ranges{}});
    CoordinatorOptions o;
    o.param_home = Tier::kHost;
    o.grad_home = grad_home;
    o.nvme_chunk_elements = kChunk;
    o.nvme_buffers = buffers;  // one: each reduce-scatter waits for the last one's shard I/O
    auto c = Coordinator::create(*device, copies, pool.get(), store.get(), units, o, nullptr,
                                 sharded ? &group : nullptr);
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    coord = std::move(c).value();
    for (size_t u = 0; u < kNumel.size(); ++u) {
      const std::vector<float> params(kNumel[u], 0.5f);
      EXPECT_TRUE(coord->write_params(u, params.data()).is_ok());
    }
  }

  // Forward over the units, then backward in reverse adding this rank's micro-batch m to every gradient.
  void micro_batch(int rank, int m) {
    coord->begin_step();
    for (size_t u = 0; u < kNumel.size(); ++u) {
      ASSERT_TRUE(coord->acquire(u, Pass::kForward).is_ok());
      coord->release(u, Pass::kForward);
    }
    for (size_t u = kNumel.size(); u-- > 0;) {
      if (u == kForwardOnly) continue;
      auto v = coord->acquire(u, Pass::kBackward);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      for (size_t i = 0; i < kNumel[u]; ++i) v->grads[i] += grad_of(rank, u, i, m);
      coord->release(u, Pass::kBackward);
    }
  }

  // This rank's shard of unit u's gradient, from wherever it lies.
  std::vector<float> shard_grads(size_t u) {
    const ShardRange sh = coord->shard(u);
    std::vector<float> got(sh.len);
    if (coord->options().grad_home == Tier::kHost) {
      if (sh.len > 0) std::memcpy(got.data(), coord->host_grads(u), sh.len * sizeof(float));  // an empty shard: null
      return got;
    }
    const auto& keys = coord->grad_keys(u);
    EXPECT_EQ(keys.size(), (sh.len + kChunk - 1) / kChunk);
    for (size_t k = 0; k < keys.size(); ++k) {
      const size_t off = k * kChunk;
      EXPECT_TRUE(store->read(keys[k], got.data() + off, std::min(kChunk, sh.len - off) * sizeof(float)).is_ok());
    }
    return got;
  }

  std::unique_ptr<kernels::Device> device;
  CopyEngine copies;
  std::unique_ptr<Coordinator> coord;  // last: destroyed first
};

class Zero3CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 60});
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    world_ = std::move(w).value();
    ASSERT_EQ(world_->size(), 2) << "run under mpiexec -np 2 (CTest does)";
  }
  // A group of its own for each coordinator, whose queue issues the collectives.
  std::unique_ptr<comm::Communicator> group(const std::string& name) {
    auto g = world_->split(0, world_->rank(), name);
    EXPECT_TRUE(g.is_ok()) << g.status().to_string();
    return std::move(g).value();
  }
  std::unique_ptr<comm::Communicator> world_;
};

TEST_F(Zero3CoordinatorTest, GradientShardsOnNvmeHoldBitwiseTheSumsOfShardsInHostMemory) {
  const int rank = world_->rank();
  auto host_group = group("zero3.host"), nvme_group = group("zero3.nvme");
  Rank host(*host_group, Tier::kHost), nvme(*nvme_group, Tier::kNvme);
  for (int step = 0; step < 2; ++step) {
    for (Rank* r : {&host, &nvme}) {
      ASSERT_TRUE(r->coord->zero_grads().is_ok());
      for (int m = 0; m < 2; ++m) r->micro_batch(rank, 10 * step + m);
      ASSERT_TRUE(r->coord->flush_grads().is_ok());
    }
    for (size_t u = 0; u < kNumel.size(); ++u) {
      SCOPED_TRACE(fmt::format("step {}, unit {}", step, u));
      const ShardRange sh = host.coord->shard(u);
      ASSERT_EQ(sh.lo, nvme.coord->shard(u).lo);
      if (u == 3) {
        EXPECT_EQ(sh.len, rank == 0 ? 10u : 0u);
      }
      // Each micro-batch's reduce-scatter adds the two ranks' parts; the second is added to the first.
      std::vector<float> want(sh.len);
      for (size_t i = 0; i < sh.len && u != kForwardOnly; ++i) {
        const size_t e = sh.lo + i;
        const float first = grad_of(0, u, e, 10 * step) + grad_of(1, u, e, 10 * step);
        const float second = grad_of(0, u, e, 10 * step + 1) + grad_of(1, u, e, 10 * step + 1);
        want[i] = first + second;
      }
      const std::vector<float> in_host = host.shard_grads(u), on_nvme = nvme.shard_grads(u);
      if (sh.len > 0) {  // memcmp takes no null pointer, even for 0 bytes (UBSan)
        EXPECT_EQ(0, std::memcmp(in_host.data(), want.data(), sh.len * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(on_nvme.data(), want.data(), sh.len * sizeof(float)));
      }
      const double sumsq = sum_squares_excluding(want.data(), sh.lo, sh.len, u == 1 ? kExcluded : Ranges{},
                                                 [](const float* x, size_t n) {
                                                   return kernels::cpu::fast::add_sum_squares(0.0, x, n);
                                                 });
      EXPECT_EQ(host.coord->grad_sum_squares(u), sumsq);
      EXPECT_EQ(nvme.coord->grad_sum_squares(u), sumsq);
    }
  }
  const CoordinatorStats s = nvme.coord->take_stats();
  EXPECT_GT(s.nvme_read_bytes, 0u) << "the second micro-batch reads the shards back";
  EXPECT_GT(s.nvme_write_bytes, s.nvme_read_bytes);
  ASSERT_TRUE(world_->barrier().is_ok());
}

TEST_F(Zero3CoordinatorTest, AFailingDiskUnderOneRankIsItsErrorNamingTheUnitNeverAWrongGradient) {
  const int rank = world_->rank();
  auto g = group("zero3.faulty");
  Rank r(*g, Tier::kNvme);
  ASSERT_TRUE(r.coord->zero_grads().is_ok());
  r.micro_batch(rank, 0);
  // Rank 1's disk fails for the second micro-batch: its read-add-write of every shard fails.
  ASSERT_TRUE(r.coord->flush_grads().is_ok());  // the first micro-batch's shards are written
  if (rank == 1) r.fault->set_enabled(true);
  r.micro_batch(rank, 1);
  const Status flushed = r.coord->flush_grads();
  r.fault->set_enabled(false);
  if (rank == 1) {
    ASSERT_FALSE(flushed.is_ok());
    EXPECT_NE(flushed.to_string().find("unit0"), std::string::npos) << flushed.to_string();
    EXPECT_NE(flushed.to_string().find("gradient shard"), std::string::npos) << flushed.to_string();
    EXPECT_GT(r.fault->counts().eio, 0u);
  } else {
    ASSERT_TRUE(flushed.is_ok()) << flushed.to_string();
  }
  ASSERT_TRUE(world_->barrier().is_ok());
}

std::vector<size_t> all_units() {
  std::vector<size_t> u(kNumel.size());
  for (size_t i = 0; i < u.size(); ++i) u[i] = i;
  return u;
}

TEST_F(Zero3CoordinatorTest, UnshardedGradientsOnNvmeAreSummedOverTheRanksWhereTheyLie) {
  const int rank = world_->rank();
  for (int buffers : {1, 3}) {
    SCOPED_TRACE(fmt::format("{} write-staging buffers", buffers));
    auto g = group(fmt::format("dp.nvme{}", buffers));
    Rank r(*g, Tier::kNvme, /*sharded=*/false, buffers);
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(r.coord->zero_grads().is_ok());
      r.micro_batch(rank, step);
      ASSERT_TRUE(r.coord->flush_grads(/*take_norms=*/false).is_ok());
      (void)r.coord->take_stats();
      ASSERT_TRUE(r.coord->sum_grads_over(all_units(), *g).is_ok());
      const CoordinatorStats s = r.coord->take_stats();
      size_t bytes = 0;
      for (size_t n : kNumel) bytes += n * sizeof(float);
      EXPECT_EQ(s.nvme_read_bytes, bytes) << "each unit read once";
      EXPECT_EQ(s.nvme_write_bytes, bytes) << "and written back once";
      for (size_t u = 0; u < kNumel.size(); ++u) {
        SCOPED_TRACE(fmt::format("step {}, unit {}", step, u));
        std::vector<float> want(kNumel[u], 0.0f);
        for (size_t i = 0; i < kNumel[u] && u != kForwardOnly; ++i)
          want[i] = grad_of(0, u, i, step) + grad_of(1, u, i, step);
        const std::vector<float> got = r.shard_grads(u);  // the whole unit: unsharded
        ASSERT_EQ(got.size(), want.size());
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)));
        const double sumsq = sum_squares_excluding(want.data(), 0, want.size(), u == 1 ? kExcluded : Ranges{},
                                                   [](const float* x, size_t n) {
                                                     return kernels::cpu::fast::add_sum_squares(0.0, x, n);
                                                   });
        EXPECT_EQ(r.coord->grad_sum_squares(u), sumsq);
      }
    }
  }
  ASSERT_TRUE(world_->barrier().is_ok());
}

TEST_F(Zero3CoordinatorTest, ARankWhoseGradientReadFailsSumsOnWithNaNAndNamesTheUnit) {
  const int rank = world_->rank();
  auto g = group("dp.faulty");
  Rank r(*g, Tier::kNvme, /*sharded=*/false, 3);
  ASSERT_TRUE(r.coord->zero_grads().is_ok());
  r.micro_batch(rank, 0);
  ASSERT_TRUE(r.coord->flush_grads(/*take_norms=*/false).is_ok());
  if (rank == 1) r.fault->set_enabled(true);  // every read of rank 1 fails, with reads ahead in flight
  const Status summed = r.coord->sum_grads_over(all_units(), *g);
  r.fault->set_enabled(false);
  if (rank == 1) {
    ASSERT_FALSE(summed.is_ok());
    EXPECT_NE(summed.to_string().find("gradient of 'unit0' to sum it"), std::string::npos) << summed.to_string();
    EXPECT_GT(r.fault->counts().eio, 0u);
  } else {
    // Rank 0 took part in every unit's sum and finished; what it holds is not finite, so its norm is not either.
    ASSERT_TRUE(summed.is_ok()) << summed.to_string();
  }
  for (size_t u = 0; u < kNumel.size(); ++u) {
    SCOPED_TRACE(fmt::format("unit {}", u));
    EXPECT_TRUE(std::isnan(r.coord->grad_sum_squares(u)));
  }
  ASSERT_TRUE(world_->barrier().is_ok());
}

}  // namespace
}  // namespace strata::offload
