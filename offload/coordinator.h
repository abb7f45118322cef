// coordinator.h — the parameter and gradient coordinator: where every unit's parameters and gradients are,
// and moving them between the tiers so that the device holds only the working set (ZeRO-Infinity's
// "partitioned parameter coordinator" for one rank).
//
// Parameters have a home tier (offload_param.device: none -> device, cpu -> host, nvme -> nvme); units of at
// most `persistence_threshold` elements stay on the device whatever the home. The home copy is the truth: the
// optimizer writes new parameters there (write_params) and a device copy, when there is one, is refreshed.
// Gradients are computed on the device and go home to host memory, or to NVMe when host memory is short (the
// optimizer runs on the CPU whenever a coordinator is used), accumulated exactly: a unit's accumulated gradient
// is uploaded again before the kernels add to it, so the sums are bitwise those of a run that keeps everything
// on the device.
//
// The model brackets every use of a unit with acquire(unit, pass) / release(unit, pass). The first step's
// sequence of accesses is recorded as the trace (begin_step() marks where a step starts); from then on every
// acquire prefetches the next accesses' parameters (and accumulated gradients) as far as
// `prefetch_elements` and the device budget allow, and when device memory is short evicts the unit whose next
// use is farthest away (Belady's rule on the trace; least recently used while recording). An access that
// differs from the trace re-records it from that point: nothing waits for an access that will not come, and
// nothing stale is used, because an acquire always waits for the unit's own latest copy.
//
// Device memory comes from Device::allocate (purposes "offload.slots", and "offload.persistent <unit>"), so the
// device budget (memory.device_memory_limit) bounds it; freed slots are kept for reuse by size and given back
// when an allocation would not fit. Host buffers come from the PinnedPool (its budget is the host tier's),
// including fixed sets of NVMe staging buffers taken at create (offload/staging_buffers.h). NVMe copies are
// swap store keys "<key_prefix><unit>.<chunk>" (gradients: "grad.<unit>.<chunk>") of at most
// `nvme_chunk_elements` elements each.
//
// ZeRO-3 (create with a `shard_group` of D > 1 ranks): every unit's flat buffer is padded to D equal shards of
// `stride` elements (a multiple of 16) and this rank keeps only its own, [rank * stride, (rank + 1) * stride)
// clipped to the unit, at home (host or nvme). Loading a unit onto the device all-gathers the shards into a
// slot of D x stride elements; releasing it after a backward reduce-scatters the gradient and adds this rank's
// part to its gradient shard at home, so gradients sum over the micro-batches as they go (another association
// than one rank's local accumulation: equal within fp32 rounding). With grad_home nvme the shard's keys are
// written by the first reduce-scatter of a step and read, added to and written back by the later ones, on a
// queue of their own ("gradient io") behind the collectives: the same additions as in host memory. A unit of at most
// `persistence_threshold` elements is resident instead of persistent: gathered for use like the others, but
// never evicted and not counted against `max_live_elements`, so it is gathered once per step (after the
// optimizer changed its shards) instead of at every use a live-parameter cap would evict it between. The
// collectives run in order on a queue of their own ("collectives"), on `shard_group` only; every rank issues
// the same ones in the same order because the coordinator's decisions depend only on the access sequence and
// the budgets, which are the same on every rank. A collective runs even when its data failed to arrive here
// (the error is reported after it), so the ranks' collectives never fall out of step. write_params and
// read_shard address this rank's shard in unit coordinates; read_params gathers a whole unit (collective).
// The optimizer calls drop_device_params() on every rank after it changed the shards.
//
// Threading: one driving thread calls everything; copies run on the CopyEngine's queues. Destruction waits for
// every job it queued. Errors (a failed read, a budget too small for the working set) come back as Status and
// name the unit and tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/sum_ranges.h"
#include "kernels/device.h"
#include "offload/copy_engine.h"
#include "offload/pinned_pool.h"
#include "offload/tiers.h"
#include "storage/swap_store.h"

namespace strata::comm {
class Communicator;
}

namespace strata::offload {

struct CoordinatorUnit {
  std::string name;
  size_t numel = 0;      // fp32 elements of its parameters (and of its gradients)
  bool present = true;   // false: another pipeline stage's unit; it has no state here and is never acquired
  // Ranges of the unit left out of grad_sum_squares (tensor parallelism: the replicated tensors, on every rank
  // of the group but the first, so the group's shares add up to the norm).
  Ranges norm_excluded;
};

struct CoordinatorOptions {
  Tier param_home = Tier::kHost;
  Tier grad_home = Tier::kHost;              // kHost, or kNvme (keys "grad.<unit>.<chunk>") when RAM is short
  size_t persistence_threshold = 0;          // stage3_param_persistence_threshold (elements)
  size_t prefetch_elements = 50'000'000;     // stage3_prefetch_bucket_size: elements fetched ahead of use
  size_t max_live_elements = SIZE_MAX;       // stage3_max_live_parameters: other units' elements on device
  size_t nvme_chunk_elements = 1u << 28;     // elements per swap key; a multiple of 1024
  int nvme_buffers = 4;  // offload_param.buffer_count: pinned staging buffers for NVMe reads, taken at create
  std::string key_prefix = "param.";
};

// How the model will use a unit between acquire and release.
enum class Pass : uint8_t {
  kForward,    // reads its parameters
  kBackward,   // reads its parameters and adds to its gradients
  kGradients,  // adds to its gradients only (the embedding's backward)
};

// This rank's part of a unit under ZeRO-3 (the whole unit otherwise).
struct ShardRange {
  size_t lo = 0, len = 0;  // the unit's elements [lo, lo + len) (len may be 0 on the last ranks of a tiny unit)
  size_t stride = 0;       // elements per rank's shard, padded: rank q's shard starts at q * stride
};

// Elements of each rank's shard of a unit of `numel` elements over `ranks` under ZeRO-3 (padded: a multiple
// of 16); `numel` itself for one rank.
inline size_t shard_stride(size_t numel, size_t ranks) {
  return ranks <= 1 ? numel : ((numel + ranks - 1) / ranks + 15) / 16 * 16;
}

struct UnitView {
  const float* params = nullptr;  // device memory, valid until release (null for kGradients)
  float* grads = nullptr;         // device memory holding the accumulated gradient (null for kForward)
  // The bf16 working copy of params (kernels.h Weight), valid until release; null where none is kept.
  const uint16_t* params16 = nullptr;
};

struct CoordinatorStats {  // since the last take_stats()
  double stall_s = 0;      // the driving thread waiting for a unit's copies to arrive
  uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t fetches = 0;    // parameter loads onto the device (prefetched or on demand)
  uint64_t prefetch_hits = 0;  // acquires whose parameters were already on the device or on their way
  uint64_t evictions = 0;
  uint64_t write_backs = 0;  // evicted parameter copies newer than their nvme home, written there first
  uint64_t retraces = 0;   // times the access order differed from the trace
  // flush_grads: gradients (grad_home host) whose sum of squares for the norm was taken as they landed during
  // the backward, not by flush_grads after it
  uint64_t norms_early = 0;
  uint64_t gather_bytes = 0, reduce_bytes = 0;  // ZeRO-3: units all-gathered, gradients reduce-scattered
  uint64_t working_copies = 0;  // bf16 working copies made (set_working_copies)
};

class Coordinator {
 public:
  // `pool` holds the host tier's buffers; `store` is needed when param_home is nvme, `grad_store` (default:
  // `store`) when grad_home is. Call write_params for each unit before the first step (parameters at home on
  // the device or host start as zeros; on nvme a unit has none until written, and using it is an error).
  // `shard_group` (size > 1): ZeRO-3 over its ranks (param_home host or nvme, grad_home host or nvme, a device whose
  // memory the communicator can address); the coordinator alone issues collectives on it, from its queue.
  static Result<std::unique_ptr<Coordinator>> create(kernels::Device& device, CopyEngine& copies, PinnedPool* pool,
                                                     SwapStore* store, std::vector<CoordinatorUnit> units,
                                                     const CoordinatorOptions& options,
                                                     SwapStore* grad_store = nullptr,
                                                     comm::Communicator* shard_group = nullptr);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  size_t num_units() const;
  const CoordinatorUnit& unit(size_t u) const;
  const CoordinatorOptions& options() const { return options_; }

  // Elements [offset, offset + n) of unit u's parameters become host[0..n) at home, and on the device when it
  // has a copy. With home nvme, offset and n must cover whole chunks (or reach the unit's end). ZeRO-3: only
  // the part inside this rank's shard is kept (chunks count from the shard's start), and a device copy is
  // dropped (the other ranks' parts of it may be stale).
  // With `reads` (not sharded), the copies out of `host` may still run when this returns: their jobs are
  // appended to `reads`, and the caller keeps host[0..n) alive and unchanged until every one has finished.
  // Called with `reads` from the before_use hook of a forward acquire, when u has no device copy and its home
  // is nvme, the pieces (written in order from offset 0) also go straight to a device copy, so that its use
  // does not wait for them to reach nvme and come back: the acquired unit's slot is had as a demand load's,
  // another's as a prefetch's (within the budgets, or not at all). The copy is used only once complete.
  Status write_params(size_t u, size_t offset, size_t n, const float* host, std::vector<CopyTicket>* reads = nullptr);
  Status write_params(size_t u, const float* host) { return write_params(u, 0, unit(u).numel, host); }
  // The current parameters of unit u into host[0..numel). ZeRO-3: gathered from every rank (collective).
  Status read_params(size_t u, float* host);
  // This rank's part of unit u's parameters (shard(u): [lo, lo + len)) into host[0..len). No communication.
  Status read_shard(size_t u, float* host);
  bool sharded() const;
  ShardRange shard(size_t u) const;
  // ZeRO-3: every device copy of parameters is dropped (the next use gathers the new shards). Call on every
  // rank at the same point, with no unit in use.
  void drop_device_params();

  // Called at the start of every acquire with the unit about to be used, or SIZE_MAX for a backward use (which
  // will overwrite gradients): the offloaded optimizer publishes the new parameters of an update that runs in
  // the background through it. Its error fails the acquire. Driving thread.
  void set_before_use(std::function<Status(size_t unit)> fn) { before_use_ = std::move(fn); }
  // Whether unit u's parameters will be written (write_params) before its next forward use: the offloaded
  // optimizer has an update of it coming. Prefetch then leaves a unit at home on nvme alone when its next use
  // is a forward (the load would be replaced at once); its publication puts it on the device. Driving thread.
  void set_params_pending(std::function<bool(size_t unit)> fn);

  // Whether the units on the device for good (param_home kDevice, one rank) keep a bf16 working copy of their
  // parameters beside them (kernels.h Weight; UnitView::params16): made at a unit's first params acquire after
  // write_params changed them (one rounding pass on the compute stream, after the upload), 2 bytes an element,
  // "offload.params16 <unit>" in the device budget, allocated at that first acquire. Once one does not fit, no
  // more are made (one warning) and acquires give none for the units without one. Off by default; ignored where
  // the device's kernels make no copies (KernelSet::weights_to_bf16 null). Driving thread.
  // `units[u]`: whether unit u may keep one (empty: none does).
  void set_working_copies(std::vector<bool> units);
  bool working_copies() const;  // whether any unit may

  // The step protocol. begin_step() marks the start of a forward pass (a step, or one micro-batch of it).
  void begin_step();
  // Whether each step of the trace is one forward and backward (true unless a pipeline schedule makes the
  // whole schedule one step): then a gradient used again later in the trace is used again in this backward
  // (the tied embedding), and stays on the device until then even with the parameters offloaded.
  void set_step_is_one_pass(bool on);
  Result<UnitView> acquire(size_t u, Pass pass);
  void release(size_t u, Pass pass);

  // Every gradient becomes zero (nothing is touched until a unit is next used).
  Status zero_grads();
  // Gradient accumulation: `on` while the backward passes to come are not the step's last (with the parameters
  // on the device their gradients then add up there). Off by default. These calls' modes:
  // docs/architecture.md "Gradients at home".
  void set_accumulating(bool on);
  // Waits until every gradient is at its home; then, until the next acquire, host_grads(u) (grad_home host) or
  // grad_keys(u) (nvme) is unit u's accumulated gradient and grad_sum_squares(u) its sum of squares (ZeRO-3:
  // this rank's shard, summed over the group). `take_norms` false: the gradients change before the norm.
  Status flush_grads(bool take_norms = true);
  // grad_home host, not sharded: whether each gradient's sum of squares is taken as its download lands, while
  // the device computes the rest of the backward. On by default where the device's memory is not the host's.
  void set_norms_on_arrival(bool on);
  const float* host_grads(size_t u) const;
  // The same gradient for changing in place before the optimizer reads it (summing it over data-parallel
  // ranks): any device copy of it is dropped, so nothing stale is used. grad_home host; after flush_grads().
  float* host_grads_for_update(size_t u);
  // grad_home nvme: each unit's gradient summed over `group` where it lies, and its sum of squares taken again
  // from the sum; pipelined on the I/O queue. Collective over `group` (the units in the same order on every
  // rank), after flush_grads(); a rank whose read failed still takes part, with NaN, and fails after.
  Status sum_grads_over(const std::vector<size_t>& units, comm::Communicator& group);
  const std::vector<std::string>& grad_keys(size_t u) const;
  double grad_sum_squares(size_t u) const;
  // The job that brings unit u's gradient home after its last release (host memory, or its nvme keys written):
  // any thread may wait for it; until it is done the home copy must not be read. Driving thread.
  CopyTicket grads_home_ticket(size_t u) const;

  Residency residency(size_t u, StateClass what) const;  // kParams or kGrads
  CoordinatorStats take_stats();   // the counters since the last call, then zeroes them
  CopyQueueStats collective_stats() const;  // ZeRO-3's queue of collectives (zeros otherwise)

 private:
  struct Slot;
  struct State;
  explicit Coordinator(std::unique_ptr<State> s);
  // Queues unit u's device gradient (kDevice) to its home after the kernels before `fence`: kBoth, or kHost
  // when the step uses it no more.
  void send_grads_home(size_t u, const kernels::DeviceFence& fence);
  // After a download of unit u's gradient into host memory: its sum of squares queued behind it, when the
  // download is the step's last (see set_norms_on_arrival); else no norm is pending for the new home copy.
  void queue_norm(size_t u);
  std::unique_ptr<State> s_;
  CoordinatorOptions options_;
  std::function<Status(size_t)> before_use_;
};

}  // namespace strata::offload
