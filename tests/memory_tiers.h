// memory_tiers.h — the host and NVMe tiers of the offload tests: a swap store on an in-memory disk, reached
// through a fault injector (EIO on every transfer while enabled; disabled at first) unless `faulty` is false,
// and a pinned pool of 64 MiB (not page-locked). Rigs derive from it, so their coordinator goes first.
#pragma once

#include <memory>

#include <gtest/gtest.h>

#include "offload/pinned_pool.h"
#include "storage/fault_engine.h"
#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "storage/swap_store.h"

namespace strata::testing {

struct MemoryTiers {
  explicit MemoryTiers(bool faulty = true) {
    fault->set_enabled(false);
    queue = std::make_unique<IoQueue>(faulty ? static_cast<IoEngine&>(*fault) : memory);
    auto s = SwapStore::open(*queue, SwapStoreOptions{.dir = "/swap", .file_bytes = 4 << 20, .direct = false});
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    store = std::move(s).value();
    auto p = offload::PinnedPool::create(offload::PinnedPoolOptions{.budget_bytes = 64 << 20, .lock = false});
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    pool = std::move(p).value();
  }

  MemoryEngine memory;
  std::unique_ptr<FaultEngine> fault =
      std::make_unique<FaultEngine>(memory, FaultOptions{.seed = 3, .eio_rate = 1.0});
  std::unique_ptr<IoQueue> queue;
  std::unique_ptr<SwapStore> store;
  std::unique_ptr<offload::PinnedPool> pool;
};

}  // namespace strata::testing
