// memory_plan.h — what a training run's state takes of each memory tier, counted from the configuration before
// anything is allocated, and the refusal of a run whose state cannot fit.
//
// The state: the fp32 parameters and gradients and Adam's master weights and moments, wherever the placements
// put them (on the device, in the host tier's pinned pool, in the swap stores on nvme), by the arithmetic the
// model and the offload stack allocate with: the model's own units (a family's create with nothing allocated), the
// shards ZeRO shards them into (offload::shard_stride), the units offload_optimizer.ratio keeps on the device
// (units_kept_on_device) and the offload stack's sizes (size_offload). It is the least the run needs: the
// activations, staging buffers and working copies come on top, and are refused by their own budgets when they
// are allocated, before the first step. Counted per process: ranks that share a machine each count its memory.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/model.h"
#include "engine/train/offload_config.h"
#include "kernels/device.h"

namespace strata::engine {

struct MemoryPlan {
  struct Item {
    std::string what;  // the ledger's and the pool's purpose: "gpt2.params", "offload.optimizer", ...
    uint64_t bytes = 0;
  };
  std::vector<Item> device, host;  // the same purpose once per tier, in the order first counted
  // By nvme_path: the bytes one version of the state there takes (the least its disk must hold), and the most
  // its swap store may grow to (two versions of every key while they are rewritten).
  std::map<std::string, uint64_t> nvme_state, nvme_max;

  uint64_t device_bytes() const;
  uint64_t host_bytes() const;
  void add_device(const std::string& what, uint64_t bytes);
  void add_host(const std::string& what, uint64_t bytes);
};

// How the run places its state: the trainer's decisions, passed in so that the plan and the run agree.
struct MemoryPlacement {
  bool offloaded = false;  // the offload stack holds the state (offload_enabled, or ZeRO-3 over several ranks)
  size_t zero3_ranks = 1;  // the data-parallel ranks the offload stack shards over (1: none)
  size_t zero12_ranks = 1;  // without offload, ZeRO stage 1 or 2: the ranks Adam's moments are sharded over
};

// `shape`: the model as this rank holds it (its pipeline stage and tensor-parallel slice), created offloaded so
// that nothing is allocated. InvalidArgument for placements the offload stack refuses.
Result<MemoryPlan> plan_memory(const Model& shape, const OffloadConfig& config, const MemoryPlacement& placement);

// What each tier can hold: memory.device_memory_limit or what the device has free; memory.host_memory_limit or
// the pinned pool's automatic budget; the free space of each nvme_path's filesystem. Measured by the caller
// (measure_memory_budgets) so that tests can give their own.
struct MemoryBudgets {
  uint64_t device = 0;  // 0: unknown (nothing checked)
  std::string device_source;
  uint64_t host = 0;  // the host tier's pool
  std::string host_source;
  // A host-accessible device (the CPU backend): device and host tiers are one memory, which together must fit
  // this (0: unknown).
  uint64_t shared = 0;
  std::string shared_source;
  std::map<std::string, uint64_t> disk_free;  // by nvme_path: the free bytes of its filesystem
};
MemoryBudgets measure_memory_budgets(const MemoryPlan& plan, const OffloadConfig& config,
                                     const kernels::Device& device);

// OutOfMemory naming the tier, its largest holders, the budget and the key that sets it, with what would make
// the state fit, when the plan's state is over a budget. A swap store that may grow past its disk's free space
// (but whose state fits) is a warning.
Status check_memory_fits(const MemoryPlan& plan, const MemoryBudgets& budgets, const OffloadConfig& config);

}  // namespace strata::engine
