// coordinator_state.h — the inside of the Coordinator (offload/coordinator.h), for its own .cpp only: every
// unit's residency record, the device slots, farthest-next-use eviction on the recorded trace, the loads and
// prefetch along it, and under ZeRO-3 the gathers and reduce-scatters on the queue of collectives. The public
// protocol (acquire/release, write/read, flush) is coordinator.cpp, built on these.
//
// Threading: as the Coordinator's (one driving thread; jobs on the copy and collective queues).
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "common/check.h"
#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "kernels/cpu/fast.h"
#include "offload/coordinator.h"
#include "offload/staging_buffers.h"

namespace strata::offload {

inline constexpr size_t kNever = std::numeric_limits<size_t>::max();
inline constexpr char kSlotPurpose[] = "offload.slots";

enum class GradState : uint8_t {
  kZero,    // the gradient is zero; no copy is valid (a device buffer, if present, is stale)
  kDevice,  // the device copy is the truth; host is stale (dirty)
  kBoth,    // a download of the device copy to host is queued or done; the device copy stays valid
  kHost,    // host holds the truth; no device copy
};

struct Access {
  size_t unit;
  Pass pass;
  bool operator==(const Access&) const = default;
};

inline bool uses_params(Pass p) { return p != Pass::kGradients; }
inline bool uses_grads(Pass p) { return p != Pass::kForward; }

// A unit's `bytes` stored as swap keys of `chunk` bytes each (the last one shorter), read into or written from
// one contiguous buffer.
inline Status read_chunks(SwapStore& store, const std::vector<std::string>& keys, size_t chunk, void* dst, size_t bytes) {
  for (size_t k = 0; k < keys.size(); ++k) {
    const size_t off = k * chunk;
    STRATA_RETURN_IF_ERROR(store.read(keys[k], static_cast<char*>(dst) + off, std::min(chunk, bytes - off)));
  }
  return Status::ok();
}
inline Status write_chunks(SwapStore& store, const std::vector<std::string>& keys, size_t chunk, const void* src,
                    size_t bytes) {
  for (size_t k = 0; k < keys.size(); ++k) {
    const size_t off = k * chunk;
    STRATA_RETURN_IF_ERROR(store.write(keys[k], static_cast<const char*>(src) + off, std::min(chunk, bytes - off)));
  }
  return Status::ok();
}


// Waits for jobs that used a buffer before it is reused. Ordering only: a job's failure is reported by whoever
// waits for its result, and must not fail the unrelated job that reuses its memory.
inline void wait_all(const std::vector<CopyTicket>& tickets) {
  for (const CopyTicket& t : tickets) (void)t.wait();
}

// A device buffer no unit holds, kept for reuse: usable once the jobs in `after` have finished (whatever their
// outcome) and `fence` has passed.
struct Coordinator::Slot {
  kernels::DeviceBuffer buf;
  kernels::DeviceFence fence;
  std::vector<CopyTicket> after;
};

struct Coordinator::State {
  struct UnitRec {
    CoordinatorUnit info;
    size_t bytes = 0;       // of the unit's parameters (or gradients)
    size_t slot_bytes = 0;  // of a device copy: `bytes`, or under ZeRO-3 all ranks' padded shards
    ShardRange shard;       // this rank's part (the whole unit unless sharded)
    size_t home_bytes = 0;  // of this rank's part at home (len elements)
    bool persistent = false;  // one rank: on the device for good (home kDevice)
    bool resident = false;    // ZeRO-3, under the persistence threshold: never evicted, outside the live cap
    Tier home = Tier::kHost;
    // Parameters.
    kernels::DeviceBuffer dev_params;  // present: the unit is on the device (or on its way: params_ready)
    // A persistent unit's bf16 working copy of dev_params (Coordinator::set_working_copies), and whether it
    // holds the present ones: write_params clears that, the next acquire makes the copy again.
    kernels::DeviceBuffer dev_params16;
    bool params16_current = false;
    CopyTicket params_ready;
    CopyTicket params_home_read;  // the last job reading the home copy (kept across evictions)
    kernels::DeviceFence params_last_use;
    PinnedBuffer host_params;           // home host
    std::vector<std::string> nvme_keys;  // home nvme, one per chunk
    std::vector<bool> nvme_written;      // which chunks have been written (keys are made by the first write)
    // Home nvme, not sharded: the device copy is newer than the nvme one. write_params refreshes a unit on the
    // device without writing it home (the optimizer's new parameters, every step), and the device copy is
    // written home only when it is evicted, or read from the device by read_params. With every unit on the
    // device (a device budget that holds the model) parameters then never go to nvme between steps.
    bool home_stale = false;
    // Home nvme: each chunk's last write queued on the nvme queue (write_params with `reads`). A later read of
    // the chunk takes it as a data prerequisite (a failed write fails the read instead of reading the previous
    // version), and a write from the driving thread waits for it (the store refuses a key being written).
    std::vector<CopyTicket> chunk_writes;
    // A device copy write_params is filling from the optimizer's buffers, piece by piece in order, just before
    // the unit's use: valid only once `assembled` reaches numel (its home copy is written as well, and is the
    // truth until then).
    bool assembling = false;
    size_t assembled = 0;
    int in_use = 0;
    uint64_t last_access = 0;
    // Gradients.
    GradState grad_state = GradState::kZero;
    kernels::DeviceBuffer dev_grads;
    CopyTicket grads_ready;     // an upload of the host copy into dev_grads (prefetch)
    CopyTicket grads_home_read; // the last job reading the home copy (kept across evictions)
    CopyTicket grads_download;  // kBoth: the download into host_grads (ZeRO-3: the reduce into the home shard)
    // ZeRO-3: the reduce-scatter that reads dev_grads (before grads_download with gradients on nvme, whose
    // shard I/O follows it), which a reuse of the device buffer waits for.
    CopyTicket grads_reduce;
    kernels::DeviceFence grads_last_use;
    PinnedBuffer host_grads;             // grad_home host
    std::vector<std::string> grad_keys;  // grad_home nvme, one per chunk
    double grad_sumsq = 0;               // grad_home nvme: sum of squares of the last download (on the d2h
                                         // thread; ZeRO-3: of the shard's last write, on the gradient io thread);
                                         // host: taken by flush_grads when grad_sumsq_valid
    bool grad_sumsq_valid = false;       // host: grad_sumsq is that of host_grads as they are now
    // grad_home host, not sharded: the sum of squares of the last download, taken on the norms queue as soon as
    // it landed (queued by the step's last backward), and where it goes; null when none was queued since the
    // last change to host_grads. Anything that writes host_grads waits for grads_norm first.
    CopyTicket grads_norm;
    std::shared_ptr<double> grads_norm_sumsq;
    // Before host_grads change outside a download: waits for a sum of squares still reading them, and forgets it.
    void settle_norm() {
      (void)grads_norm.wait();  // fails only when the download it follows did, which that download reports
      grads_norm = CopyTicket();
      grads_norm_sumsq.reset();
    }
    bool grads_reduced = false;          // ZeRO-3: a reduce-scatter added to the home shard since zero_grads
  };

  kernels::Device& device;
  CopyEngine& copies;
  PinnedPool* pool;
  SwapStore* store;             // parameters' nvme home
  SwapStore* grad_store = nullptr;  // gradients' nvme home
  CoordinatorOptions options;
  std::vector<UnitRec> units;
  std::vector<Slot> spares;
  uint64_t slot_bytes = 0;  // device bytes in slots (units' buffers and spares), for error messages
  size_t live_elements = 0;                // parameter elements on the device that count against the live cap
  // offload_param.buffer_count pinned buffers of the largest nvme-homed unit, taken at create() so that a
  // host budget too small for them fails there instead of blocking a read forever.
  StagingBuffers read_staging;
  // With gradients on nvme: buffer_count buffers the downloads go through on their way to the swap store (a
  // set of their own: taken on the d2h queue and given back on the nvme queue, while read_staging is taken on
  // the nvme queue and given back on the h2d queue, so neither can wait on the other in a cycle).
  StagingBuffers write_staging;
  // The trace.
  std::vector<Access> trace;
  bool recording = true;
  std::vector<bool> working_copies;      // set_working_copies: per unit (empty: none)
  bool working_copies_refused = false;   // an allocation of one failed: none is tried again
  bool accumulating = false;  // Coordinator::set_accumulating
  bool step_is_one_pass = true;  // Coordinator::set_step_is_one_pass
  // Queues unit u's device gradient (kDevice) home after `fence` (Coordinator::send_grads_home), so that an
  // eviction can free a gradient still being added to.
  std::function<void(size_t u, const kernels::DeviceFence& fence)> send_grads_home;
  size_t pos = 0;  // accesses of this step so far
  uint64_t clock = 0;
  size_t acquiring = SIZE_MAX;  // the unit whose forward acquire is calling the before_use hook
  std::function<bool(size_t)> params_pending;  // Coordinator::set_params_pending
  CoordinatorStats stats;
  // ZeRO-3: the group, one shard's worth of reduce-scatter output (used by one collective at a time), and the
  // queue that runs every collective in order (declared last: destroyed first, while what its jobs use lives).
  comm::Communicator* group = nullptr;
  // With gradients on nvme, reduce_scratch is the gradient I/O queue's instead (one job at a time reads a
  // shard's sum so far into it), and that queue runs after the collectives (declared before them: destroyed
  // after, so a reduce-scatter waiting for a write-staging buffer is never left without the queue that gives
  // it back). The gradient I/O queue also runs sum_grads_over's reads and write-backs, with or without ZeRO-3.
  PinnedBuffer reduce_scratch;
  std::unique_ptr<CopyQueue> grad_io;
  std::unique_ptr<CopyQueue> collectives;
  // grad_home host, not sharded: each gradient's sum of squares for the norm, taken as its step's last download
  // lands (UnitRec::grads_norm), so that the norm is summed while the backward still runs rather than after it
  // on the training thread. Declared last: destroyed first, while the host_grads its jobs read still live.
  std::unique_ptr<CopyQueue> norms;
  bool norms_on_arrival = false;  // Coordinator::set_norms_on_arrival

  State(kernels::Device& d, CopyEngine& c, PinnedPool* p, SwapStore* s, const CoordinatorOptions& o)
      : device(d), copies(c), pool(p), store(s), options(o) {}

  bool sharded() const { return group != nullptr; }
  // What a device copy of r counts against the live-parameter cap.
  static size_t live(const UnitRec& r) { return r.resident ? 0 : r.info.numel; }

  ~State() {
    for (UnitRec& r : units) {
      wait_all(r.chunk_writes);
      (void)r.params_ready.wait();
      (void)r.grads_ready.wait();
      (void)r.grads_download.wait();
      (void)r.grads_norm.wait();
    }
    for (Slot& s : spares) wait_all(s.after);
  }

  // ---- device slots ----

  Result<Slot> new_slot(size_t bytes, const std::string& what);

  void drop_spares() {
    for (Slot& s : spares) {
      wait_all(s.after);
      s.fence.wait();
      slot_bytes -= s.buf.size();
    }
    spares.clear();
  }

  // Gives r's device gradient back to the spares once the jobs that read or filled it are done; its home copy
  // is then the only one.
  void drop_device_grads(UnitRec& r) {
    to_spare(std::move(r.dev_grads), r.grads_last_use, {r.grads_ready, sharded() ? r.grads_reduce : r.grads_download});
    r.grads_ready = CopyTicket();
  }

  // Keeps a freed buffer for reuse: new_slot takes it back by size, and drops every spare when an allocation
  // would not fit. (Trimming spares eagerly instead cost the demo a third of its step time in allocation and
  // page faults on the CPU backend.)
  void to_spare(kernels::DeviceBuffer buf, kernels::DeviceFence fence, std::vector<CopyTicket> after) {
    spares.push_back(Slot{std::move(buf), std::move(fence), std::move(after)});
  }

  // Queues dst <- src (host to device) once the jobs that used dst before (`reuse`, ordering only) and `fence`
  // have passed and the data prerequisites `after` have succeeded. The ticket ends after `reuse` and `fence`
  // also when a prerequisite failed (a settled job, which then copies nothing): whoever gives dst back to the
  // spares after a failed load waits for the ticket alone, and the next user of dst must not meet the jobs and
  // kernels that used it before. (A plain job would not run at all, and its ticket end without those waits.)
  CopyTicket upload(void* dst, const void* src, size_t bytes, kernels::DeviceFence fence,
                    std::vector<CopyTicket> reuse = {}, std::vector<CopyTicket> after = {});

  // Parameters on nvme exist once written: a read before that is the caller's ordering bug, named.
  static Status check_written(const UnitRec& r) {
    for (bool w : r.nvme_written) {
      if (!w)
        return Status::invalid_argument("offload: unit '{}' has no parameters on nvme yet (write_params first)",
                                        r.info.name);
    }
    return Status::ok();
  }

  // Gives r's device copy of its parameters back to the spares (reusable once the job that filled it and the
  // kernels that read it are done): the unit is no longer on the device.
  void give_back_params(UnitRec& r) {
    to_spare(std::move(r.dev_params), r.params_last_use, {r.params_ready});
    r.params_ready = CopyTicket();
    r.assembling = false;
    live_elements -= live(r);
  }

  // A device copy whose load failed never arrived: forget it, so the next acquire loads the unit again.
  void drop_failed_params(UnitRec& r) {
    if (!r.persistent && r.dev_params.data() != nullptr) give_back_params(r);
    r.params_ready = CopyTicket();
  }

  // A device copy whose assembly by write_params did not complete (the publication stopped, or was not in
  // order): given back, and the unit loads from home (written as well) at its next use.
  void drop_partial(UnitRec& r) {
    if (!r.assembling) return;
    r.assembling = false;
    if (r.dev_params.data() != nullptr) give_back_params(r);
  }

  // Waits for the queued writes of r's home chunks; the first failure (kept: until the chunk is written again
  // every read of it fails). The succeeded ones are forgotten.
  static Status wait_home_writes(UnitRec& r);

  // ---- distances on the trace ----

  bool replaying() const { return !recording && !trace.empty(); }

  // For every unit, how many accesses ahead its parameters (or gradients) are next used: 1 is the next access.
  // Parameters look past the end of the step into the next one; gradients do not (the next step zeroes them).
  // While recording, the least recently used unit counts as the farthest.
  std::vector<size_t> next_use(bool grads) const;

  // Writes a stale device copy of r's parameters home (home_stale) through one of the read-staging buffers (a
  // unit's worth of the host budget, given back by the loads that hold them without waiting on this thread), on
  // the calling thread: the device copy then is clean and may be dropped.
  Status write_back(UnitRec& r);

  // Frees one device buffer of a unit whose next use is farther than `sooner_than` accesses away (0: any unit
  // not in use): a parameter copy (written home first when stale) or a gradient copy (sent home first when it
  // is only on the device: its next use brings the partial sum back and adds to it). False when there is none.
  Result<bool> evict_one(size_t sooner_than, bool params_only = false);

  // A device buffer of `bytes` for unit u, evicting what is used later than `sooner_than` accesses from now
  // (0: anything not in use) when memory is short. OutOfMemory when nothing more can be evicted.
  Result<Slot> obtain(size_t u, size_t bytes, size_t sooner_than, const char* what);

  std::string in_use_units() const {
    std::string out;
    for (const UnitRec& r : units)
      if (r.in_use > 0) out += (out.empty() ? "" : ", ") + r.info.name;
    return out.empty() ? "no" : out;
  }

  // Queues dst <- the swap keys `keys` (chunks of nvme_chunk_elements): an NVMe read into a read-staging
  // buffer, then the upload, once `fence` has passed and `after` have finished (the ticket ending after
  // `reuse` and `fence` whatever became of the read, as upload's).
  CopyTicket fetch_from_nvme(SwapStore* st, const std::vector<std::string>& keys, size_t bytes, void* dst,
                             kernels::DeviceFence fence, std::vector<CopyTicket> reuse,
                             std::vector<CopyTicket> after);

  // ---- loading parameters ----

  // A device slot for unit u's parameters, as for a load: within the live-parameter cap and the device budget,
  // evicting what is used later than `sooner_than` accesses from now (0, a demand: anything not in use, and
  // the cap is soft). Nothing (ok) when a prefetch finds no room.
  Result<std::optional<Slot>> params_slot(size_t u, size_t sooner_than);

  // Queues the load of unit u's parameters onto the device. A demand load (sooner_than 0) may evict any unit
  // not in use; a prefetch for the access `sooner_than` ahead only units used later, and returns false (with
  // an ok status) when that is not enough.
  Result<bool> load_params(size_t u, size_t sooner_than);

  // ZeRO-3: queues the all-gather of every rank's shard of r's parameters into the slot (from the home copy,
  // or through a read-staging buffer from nvme).
  CopyTicket gather_params(UnitRec& r, Slot& s);

  // ZeRO-3: queues the reduce-scatter of unit u's device gradient (after `fence`), adding this rank's part to
  // its home shard (the first since zero_grads replaces it). The device copy is then consumed.
  void reduce_grads(UnitRec& r, kernels::DeviceFence fence);

  // ZeRO-3 with gradients on nvme: the reduce-scatter lands in a write-staging buffer (collectives queue); the
  // gradient I/O queue then writes it to the shard's keys (the first since zero_grads) or reads the shard's sum
  // so far into reduce_scratch, adds (the same additions as the host shard's home += part) and writes the sum
  // back; the sum of squares for the norm is taken from what it writes, and is NaN until then. A failed read or
  // write fails this and every later job of the unit (grads_download), which flush_grads reports.
  void reduce_grads_to_nvme(UnitRec& r, kernels::DeviceFence fence, bool first);

  // Every key of r's gradient (this rank's part) holds zeros: the step's gradient of a unit no backward used,
  // for the optimizer to read.
  Status write_zero_grads(UnitRec& r);

  void drop_params(UnitRec& r) {  // under ZeRO-3, whose home copies are never stale
    if (r.persistent || r.dev_params.data() == nullptr) return;
    STRATA_ASSERT(!r.home_stale);
    give_back_params(r);
  }

  // Queues the upload of unit u's accumulated host gradient into a device buffer (sooner_than as load_params).
  Result<bool> load_grads(size_t u, size_t sooner_than);

  // Fetches what the next accesses need, as far as the prefetch window and the budget allow.
  Status prefetch();

  void record(const Access& a);

  // r's bf16 working copy, made now if write_params changed the parameters since (after their upload, which
  // acquire has waited for: the copy's rounding is enqueued on the compute stream behind the kernels that read
  // the old one); null where none is kept (set_working_copies).
  const uint16_t* working_copy(UnitRec& r);

  // Waits for a unit's copy, counting the wait as a stall; the error names what was waited for and the unit.
  Status wait_ticket(const CopyTicket& t, const UnitRec& r, const char* what);
};

}  // namespace strata::offload
