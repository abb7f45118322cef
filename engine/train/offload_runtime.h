// offload_runtime.h — the offload stack of one training run, built from the "zero_optimization", "aio" and
// "memory" sections: the swap store(s) on NVMe, the pinned host pool, the copy engine, the Coordinator of the
// model's parameters and gradients, and the offloaded optimizer.
//
// Placements (DeepSpeed's names): offload_optimizer.device cpu|nvme puts the fp32 master weights and Adam
// moments in host memory or on NVMe and runs Adam on the CPU; offload_param.device cpu|nvme makes the device
// hold only the units being computed, with the rest in host memory or on NVMe. offload_param needs
// offload_optimizer (the fp32 master weights would otherwise have to stay on the device). Gradients go home to
// host memory whenever the optimizer is offloaded.
//
// ZeRO-3 (zero_optimization.stage 3 over a data-parallel group of more than one rank): the coordinator keeps
// only this rank's shard of every unit at home and gathers units for use, and the optimizer updates only the
// shards. The shards live in host memory or on nvme; "none" for either target means host memory here (on the
// CPU backend the device tier is host memory too). Stages 1 and 2 with offload_optimizer (DeepSpeed's
// ZeRO-Offload) run the same way: the parameters, which those stages all-gather after every update, are
// gathered at their first use instead.
//
// Threading: built and driven by the training thread; owns the copy and I/O threads.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/model/model.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/pipeline.h"
#include "engine/train/offload_config.h"
#include "offload/coordinator.h"
#include "offload/copy_engine.h"
#include "offload/offloaded_adamw.h"
#include "offload/pinned_pool.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"
#include "storage/swap_store.h"

namespace strata::engine {

// True when the configuration moves any state off the device.
bool offload_enabled(const OffloadConfig& config);

// Writes keep at most this many bytes in the NVMe engine: a read (what the optimizer or a prefetch waits for)
// that comes while sub-groups are written then waits behind that much in the device, not behind a full queue
// of writes. Measured on the CI machine (the trace of `bench step`): a 48 MB read issued behind a sub-group's
// writes took 18-22 ms with 64 MiB of writes in flight and 7-11 ms with 8 MiB.
inline constexpr uint64_t kNvmeWriteBytesInFlight = uint64_t{8} << 20;
// The NVMe engine and queue every swap store of a run shares, from the aio section (InvalidArgument names a
// value out of range).
Result<std::pair<EngineOptions, IoQueueOptions>> nvme_io_options(const AioConfig& aio);

// Registers every buffer of the pool, as it is mapped, with `device` (Device::register_host) and with `io` (the NVMe
// tier's engine, IoEngine::add_buffer), and unregisters it from both before it is unmapped. The device copies to or
// from nearly all of them (the parameters' and gradients' homes and staging, host activation checkpoints, and the
// optimizer's master weights and swap slots, which the update publishes from); without it a GPU stages every copy
// through a bounce buffer (measured on an H100: 7.6 GB/s host-to-device instead of 49). The NVMe tier reads into and
// writes from them, and registered the kernel does not pin their pages again for every transfer (on the CI machine 75
// ms of system time per GiB written; docs/benchmarks.md, "bench nvme"). A failed registration says so once (a warning
// for the device, a note for the engine) and leaves that buffer working unregistered. Nothing to do for a
// host-accessible device without an engine. Both must outlive the pool's buffers.
void register_pool_buffers(offload::PinnedPool& pool, kernels::Device& device, IoEngine* io = nullptr);

// What one step moved and where its time went, for the progress line, the metrics file and bench step.
struct OffloadStepReport {
  double stall_s = 0;           // training thread waiting for parameters or gradients to arrive
  double optimizer_s = 0;       // the CPU optimizer (with nvme: its whole swap pipeline)
  double grads_wait_s = 0;      // the optimizer waiting for the last gradients to reach host memory (and
                                // taking the norm's sums of those already there; summing them over the
                                // data-parallel ranks and the pipeline's ends, with nvme gradients their
                                // synchronous reads and writes too)
  double update_wait_s = 0;     // the training thread waiting for the optimizer's new parameters
  // Copy queues' busy time; nvme: the time the disk had I/O in flight (every store: parameters, gradients and
  // the optimizer's state).
  double h2d_busy_s = 0, d2h_busy_s = 0, nvme_busy_s = 0;
  uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t fetches = 0, prefetch_hits = 0, evictions = 0, retraces = 0;
  uint64_t norms_early = 0;  // gradients whose sum of squares for the norm was taken during the backward
  uint64_t write_backs = 0;  // evicted parameters newer than their nvme home, written there first
  uint64_t working_copies = 0;  // bf16 working copies of units' parameters made (Coordinator::set_working_copies)
  uint64_t gather_bytes = 0, reduce_bytes = 0;  // ZeRO-3: units all-gathered, gradients reduce-scattered
  double collectives_busy_s = 0;                // ZeRO-3: the coordinator's collectives (waiting for peers too)
  uint64_t early_start = 0;   // 1 when the optimizer's update started during backward (nvme)
  uint64_t early_groups = 0;  // sub-groups it updated before the norm was known
  uint64_t redone = 0;        // 1 when those updates were rolled back and the step redone
  uint64_t early_reads = 0;   // 1 when (after a clipped step) only its first sub-groups' state was read in backward
  offload::TierUsage device, host, nvme;
  nlohmann::json to_json() const;
  std::string summary() const;  // "dev 12.0M host 1.2G nvme 3.4G | stall 3 ms opt 40 ms"
};

// offload_optimizer.ratio's choice: the longest run of the model's first units (the embedding, then the blocks in
// order, then ln_f) holding at most (1 - ratio) of the parameters; those stay whole on the device
// (Model::keep_on_device); the last unit is always offloaded. The first units, as their updates are what the next
// forward waits for first: the backward makes their gradients final last, and the forward needs them first.
std::vector<bool> units_kept_on_device(const Model& model, double ratio);

// The offload stack's placements and sizes on this rank, from the configuration and the units it offloads:
// what OffloadRuntime::create builds, and what the memory check before any allocation counts
// (engine/train/memory_plan.h). `offloaded[u]`: unit u is this rank's (its pipeline stage's) and not kept whole on the
// device. `ranks`: the data-parallel ranks ZeRO-3 shards over (1: none).
struct OffloadSizing {
  offload::Tier param_tier = offload::Tier::kDevice, opt_tier = offload::Tier::kHost,
                grad_tier = offload::Tier::kHost;
  size_t ranks = 1;
  size_t group = 0;             // zero_optimization.sub_group_size, rounded up to 1024 elements
  uint64_t state_bytes = 0;     // one fp32 class (parameters, gradients, ...) of the offloaded units: their shards
  uint64_t largest_key = 0;     // the largest swap key: a sub-group, or a smaller unit's shard
  uint64_t file_bytes = 0;      // each swap file (preallocated, so no bigger than the state needs)
  // The gradients' store with grad_tier nvme: the optimizer's when it is on nvme (its swap pipeline reads them),
  // else the parameters'.
  std::string grad_path;
  // By nvme_path: the most the store there grows to (two versions of every key can coexist, copy-on-write), and
  // the bytes one version of its state takes: the least the disk must hold.
  std::map<std::string, uint64_t> nvme_max_bytes, nvme_state_bytes;
  uint32_t files(const std::string& path) const;  // the store's file limit
};
// InvalidArgument: offload_param without offload_optimizer.
Result<OffloadSizing> size_offload(const OffloadConfig& config, const Model& model, const std::vector<bool>& offloaded,
                                   size_t ranks);

class OffloadRuntime {
 public:
  // Builds the stack for `model` (created offloaded, on `device`) and attaches the coordinator to it. The
  // model's parameters are zeros until written: init_model or load_model with optimizer()
  // (engine/checkpoint/checkpoint.h), which write them and the optimizer's state a sub-group at a time, or
  // init_weights or load_model and then optimizer().adopt_params().
  // `dp`: the data-parallel group (null: one rank); with stage 3 it must outlive the runtime. `pp` and `plan`:
  // the pipeline this model is a stage of (null: none); the stack then holds only the stage's units.
  static Result<std::unique_ptr<OffloadRuntime>> create(const OffloadConfig& config, const AdamWConfig& adam,
                                                        kernels::Device& device, Model& model,
                                                        comm::Communicator* dp = nullptr,
                                                        comm::Communicator* pp = nullptr,
                                                        const PipelinePlan* plan = nullptr);
  ~OffloadRuntime();

  Optimizer& optimizer() { return *optimizer_; }
  offload::OffloadedAdamW& offloaded_optimizer() { return *optimizer_; }
  offload::Coordinator& coordinator() { return *coordinator_; }
  offload::PinnedPool& pool() { return *pool_; }  // the host tier
  // The counters since the last call, with each tier's live and peak bytes now.
  OffloadStepReport take_report();
  // One line per tier for the log: placements, budgets, what holds the bytes.
  std::string describe() const;

 private:
  OffloadRuntime() = default;
  Status open_store(const std::string& path, uint64_t file_bytes, uint32_t max_files, const AioConfig& aio);

  kernels::Device* device_ = nullptr;
  std::string placements_;
  // Declared in construction order; destroyed in reverse, so nothing outlives what it uses.
  std::unique_ptr<IoEngine> io_engine_;
  std::unique_ptr<IoQueue> io_queue_;
  std::map<std::string, std::unique_ptr<SwapStore>> stores_;  // by nvme_path
  std::unique_ptr<offload::PinnedPool> pool_;
  std::unique_ptr<offload::CopyEngine> copies_;
  std::unique_ptr<comm::Communicator> shard_group_;  // ZeRO-3: the coordinator's own copy of the dp group
  std::unique_ptr<offload::Coordinator> coordinator_;
  std::unique_ptr<offload::OffloadedAdamW> optimizer_;
  offload::CopyQueueStats last_h2d_, last_d2h_, last_collectives_;
  double last_disk_busy_s_ = 0;
  uint64_t nvme_peak_ = 0;
};

}  // namespace strata::engine
