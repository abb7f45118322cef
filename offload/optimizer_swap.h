// optimizer_swap.h — the optimizer swap pipeline of NVMe-offloaded training (ZeRO-Infinity's "offload_optimizer
// device nvme"): every sub-group's fp32 master weights and Adam moments m, v live in the swap store as three
// keys, and a step streams the sub-groups through pinned staging slots — reading sub-group i+1 and writing
// sub-group i−1 while the fused CPU Adam (kernels/cpu/fast.h adamw_update_mixed) updates sub-group i — and
// hands back each sub-group's new working copy (bf16/f16, or fp32) for the device.
//
// Versions: a sub-group's state has two sets of keys ("<prefix><group>.master@0", ".m@0", ".v@0" and the same
// with @1); a step reads the current set and writes the other, which becomes current once written (the old set
// is then freed). A step with keep_old leaves its new versions pending instead, so that the caller can still
// decide: commit() makes them current, rollback() frees them and the state is what it was before the step.
// This is what lets the offloaded optimizer start a sub-group's update before the global gradient norm is
// known and redo it exactly when clipping changes it.
//
// Owns: its staging slots (pinned buffers from the pool, 12 bytes per element of the largest sub-group each)
// and its keys in the store, freed on destruction. Does not own the store or the pool (they must outlive it)
// nor the callers' gradient and working-copy buffers.
//
// Failure: a read or write error stops the step and is returned, naming the key. A failed step can leave some
// sub-groups updated (without keep_old: those whose writes completed) and others not, and the caller must
// treat the optimizer state as that of an unfinished step (retry the step from a checkpoint); with keep_old
// nothing is committed and rollback() restores the state of before the step. A checksum mismatch is a
// Corruption status, never a wrong update.
//
// Threading: one thread drives a swapper; the I/O runs on the store's engine threads and the update on TBB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/kernels.h"
#include "offload/pinned_pool.h"
#include "storage/swap_store.h"

namespace strata::offload {

// The largest sub-group (zero_optimization.sub_group_size, elements): 2^40.
constexpr int64_t kMaxSubGroupSize = int64_t{1} << 40;

// A run of a sub-group that shares its weight decay (GPT-2 decays 2-D weights only).
struct OptimizerSegment {
  size_t offset = 0, numel = 0;  // elements, within the sub-group
  float weight_decay = 0.0f;
};
struct OptimizerGroup {
  std::string name;                       // unique; part of the swap keys
  size_t numel = 0;
  std::vector<OptimizerSegment> segments;  // cover [0, numel) exactly, in order
  std::string grad_key;  // when set, the step reads the group's fp32 gradient from this key of the same store
};

struct OptimizerSwapOptions {
  std::string key_prefix = "opt.";
  int slots = 3;  // staging slots: 3 overlaps read, update and write; 2 reads into a slot only as it is written
};

// Where a step's time went (seconds), and what it moved.
struct OptimizerStepStats {
  double read_wait_s = 0;   // waiting for a sub-group's master/m/v to arrive
  double update_s = 0;      // the fused Adam passes
  double write_wait_s = 0;  // waiting for writes (slot reuse and the end of the step)
  uint64_t bytes_read = 0, bytes_written = 0;
};

// Which sub-groups a step updates, in what order, and whether it keeps the old state.
struct OptimizerStepPlan {
  // The sub-group to update next, in the order the caller's gradients become final: a group index, kEnd when
  // there are no more, kNotYet (only when `wait` is false) when the next is not known yet; an error stops the
  // step with it. Called on the stepping thread; the step reads a group's state ahead of its update only as
  // far as this says.
  static constexpr size_t kEnd = SIZE_MAX, kNotYet = SIZE_MAX - 1;
  std::function<Result<size_t>(bool wait)> next;  // null: every sub-group once, in index order
  bool keep_old = false;                          // leave the new versions pending for commit() / rollback()
  // Null: the step's `hp`. Else called once, after the first sub-groups' reads are issued and before the first
  // update: the step's parameters, which may not be known when the step starts (its reads then overlap the
  // wait). An error ends the step before anything was updated.
  std::function<Result<kernels::AdamWParams>()> params;
};

class OptimizerSwapper {
 public:
  // Checks the groups (unique names, segments tiling each group) and takes `options.slots` staging buffers of
  // 12 bytes per element of the largest group from `pool` (OutOfMemory names the pool's budget).
  static Result<std::unique_ptr<OptimizerSwapper>> create(SwapStore& store, PinnedPool& pool,
                                                          std::vector<OptimizerGroup> groups,
                                                          const OptimizerSwapOptions& options = {});
  // The pinned bytes create() will take for sub-groups of at most `largest` elements (size a pool with it);
  // `grads`: the groups read their gradients from keys (a fourth region per slot).
  static size_t staging_bytes(size_t largest, const OptimizerSwapOptions& options = {}, bool grads = false);
  ~OptimizerSwapper();  // frees its keys in the store
  OptimizerSwapper(const OptimizerSwapper&) = delete;
  OptimizerSwapper& operator=(const OptimizerSwapper&) = delete;

  const std::vector<OptimizerGroup>& groups() const { return groups_; }
  // The swap key holding sub-group g's current `what` ("master", "m" or "v").
  std::string state_key(size_t g, const char* what) const { return key(g, what); }

  // Stores sub-group g's fp32 master weights (`master`, group layout) and moments (zeros where null), as a new
  // version that replaces the old once all three keys are written: on failure the old state stays.
  Status initialize(size_t g, const float* master, const float* m = nullptr, const float* v = nullptr);
  // The same from `fill`, which writes the group's master weights, m and v (each numel floats) straight into a
  // staging slot: state loaded from files a sub-group at a time, within the pool's budget. An error from it
  // leaves the state as it was.
  using FillFn = std::function<Status(float* master, float* m, float* v)>;
  Status initialize(size_t g, const FillFn& fill);

  // One AdamW step over every sub-group (in index order, or the order plan.next gives; a plan that ends early
  // leaves the rest as they were): grads[g] (host fp32, group layout, already reduced; null for a group with a
  // grad_key, which is read with the group's state) updates
  // master, m, v in the store, and working[g] receives the new weights as `working_dtype` (2 bytes per element
  // for bf16/f16, 4 for fp32). hp.weight_decay is ignored: each segment has its own. hp.grad_scale carries the
  // unscale and clip coefficient, as in adamw_update. `working` may be empty: no working copies are written.
  // `on_updated(g, master)`, when set, runs on this thread after sub-group g's update with its new fp32 master
  // weights, while the writes of earlier sub-groups proceed; an error stops the step. `master` stays unchanged
  // until the on_updated call slots - 2 positions later returns (its slot is read into again only after that:
  // reads run one position ahead, except before plan.params has answered, when nothing is updated yet and the
  // reads fill every slot), and at least until the step returns when fewer positions follow.
  using UpdatedFn = std::function<Status(size_t group, const float* master)>;
  static constexpr size_t kEnd = OptimizerStepPlan::kEnd, kNotYet = OptimizerStepPlan::kNotYet;
  using StepPlan = OptimizerStepPlan;
  Status step(const std::vector<const float*>& grads, const std::vector<void*>& working, DType working_dtype,
              const kernels::AdamWParams& hp, const UpdatedFn& on_updated = nullptr, const StepPlan& plan = StepPlan());

  // The new versions a keep_old step left pending (of the groups whose writes completed) become the state, or
  // are dropped. Not while a step runs.
  Status commit();
  void rollback();
  size_t pending() const;

  // Reads sub-group g's state back (for checkpoints and tests); any pointer may be null.
  Status read_state(size_t g, float* master, float* m, float* v);
  // Reads sub-group g's master weights into a staging slot and calls fn with them (valid during the call):
  // for putting back parameters without a buffer of the caller's. Not while a step runs.
  Status with_master(size_t g, const std::function<Status(const float* master)>& fn);
  // Reads sub-group g's state k (0: master, 1: m, 2: v) into a staging slot and returns it, valid until the
  // next call on the swapper: checkpoints read the state a sub-group at a time within the pool's budget. Not
  // while a step runs.
  Result<const float*> view_state(size_t g, int k);

  const OptimizerStepStats& last_step_stats() const { return stats_; }

 private:
  struct Slot;
  OptimizerSwapper(SwapStore& store, std::vector<OptimizerGroup> groups, const OptimizerSwapOptions& options);
  std::string key(size_t g, const char* what, int version) const;
  std::string key(size_t g, const char* what) const { return key(g, what, version_[g]); }
  void free_version(size_t g, int version);
  void promote(size_t g);  // the other version becomes g's current one; the current one is freed
  // Issues sub-group g's reads into slot s region by region, each once the slot's previous write of it is done
  // (waiting for it when `block`); true when all are issued. Called again with the same g, it goes on.
  Result<bool> issue_read(size_t g, size_t s, bool block);
  void wait_write(Slot& slot, int region);  // a failure is kept in the slot for finish_writes
  Status finish_writes(Slot& slot);  // waits for the slot's writes; the group's new version then is written

  SwapStore& store_;
  std::vector<OptimizerGroup> groups_;
  OptimizerSwapOptions options_;
  size_t region_floats_ = 0;  // floats per region of a slot (master, m, v[, grads]), padded to 4 KiB
  int regions_ = 3;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<bool> initialized_;
  std::vector<int> version_;        // the current set of keys, 0 or 1
  std::vector<bool> pending_;       // the other set holds a new version waiting for commit()
  std::vector<bool> in_step_;       // groups the running step has taken
  bool keep_old_ = false;           // of the running step
  OptimizerStepStats stats_;
};

}  // namespace strata::offload
