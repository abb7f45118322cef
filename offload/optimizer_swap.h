// optimizer_swap.h — the optimizer swap pipeline of NVMe-offloaded training (ZeRO-Infinity's "offload_optimizer
// device nvme"): every sub-group's fp32 master weights and Adam moments m, v live in the swap store as three
// keys, and a step streams the sub-groups through pinned staging slots — reading sub-group i+1 and writing
// sub-group i−1 while the fused CPU Adam (kernels/cpu/fast.h adamw_update_mixed) updates sub-group i — and
// hands back each sub-group's new working copy (bf16/f16, or fp32) for the device.
//
// Owns: its staging slots (pinned buffers from the pool, 12 bytes per element of the largest sub-group each)
// and its keys in the store ("<prefix><group>.master", ".m", ".v"), freed on destruction. Does not own the
// store or the pool (they must outlive it) nor the callers' gradient and working-copy buffers.
//
// Failure: a read or write error stops the step and is returned, naming the key. Writes go through the store's
// copy-on-write, so every key keeps either its old or its new version: a failed step can leave some sub-groups
// updated and others not, and the caller must treat the optimizer state as that of an unfinished step (retry
// the step from a checkpoint). A checksum mismatch is a Corruption status, never a wrong update.
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
  int slots = 3;  // staging slots: 3 overlaps read, update and write; 2 reads only after the slot's write
};

// Where a step's time went (seconds), and what it moved.
struct OptimizerStepStats {
  double read_wait_s = 0;   // waiting for a sub-group's master/m/v to arrive
  double update_s = 0;      // the fused Adam passes
  double write_wait_s = 0;  // waiting for writes (slot reuse and the end of the step)
  uint64_t bytes_read = 0, bytes_written = 0;
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

  // Stores sub-group g's fp32 master weights (`master`, group layout) and moments (zeros where null).
  Status initialize(size_t g, const float* master, const float* m = nullptr, const float* v = nullptr);

  // One AdamW step over every sub-group, in order: grads[g] (host fp32, group layout, already reduced; null for
  // a group with a grad_key, which is read with the group's state) updates
  // master, m, v in the store, and working[g] receives the new weights as `working_dtype` (2 bytes per element
  // for bf16/f16, 4 for fp32). hp.weight_decay is ignored: each segment has its own. hp.grad_scale carries the
  // unscale and clip coefficient, as in adamw_update. `working` may be empty: no working copies are written.
  // `on_updated(g, master)`, when set, runs on this thread after sub-group g's update with its new fp32 master
  // weights (valid during the call), while the writes of earlier sub-groups proceed; an error stops the step.
  using UpdatedFn = std::function<Status(size_t group, const float* master)>;
  Status step(const std::vector<const float*>& grads, const std::vector<void*>& working, DType working_dtype,
              const kernels::AdamWParams& hp, const UpdatedFn& on_updated = nullptr);

  // Reads sub-group g's state back (for checkpoints and tests); any pointer may be null.
  Status read_state(size_t g, float* master, float* m, float* v);

  const OptimizerStepStats& last_step_stats() const { return stats_; }

 private:
  struct Slot;
  OptimizerSwapper(SwapStore& store, std::vector<OptimizerGroup> groups, const OptimizerSwapOptions& options);
  std::string key(size_t g, const char* what) const;
  Status issue_read(size_t g);

  SwapStore& store_;
  std::vector<OptimizerGroup> groups_;
  OptimizerSwapOptions options_;
  size_t region_floats_ = 0;  // floats per region of a slot (master, m, v[, grads]), padded to 4 KiB
  int regions_ = 3;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<bool> initialized_;
  OptimizerStepStats stats_;
};

}  // namespace strata::offload
