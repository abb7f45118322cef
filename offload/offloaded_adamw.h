// offloaded_adamw.h — AdamW with its state off the device (ZeRO-Offload / ZeRO-Infinity's offload_optimizer):
// fp32 master weights and moments in pinned host memory ("cpu") or in the swap store on NVMe ("nvme"), updated
// on the CPU by the fused pass of kernels/cpu/fast.h from the gradients the Coordinator brought home, and the
// new parameters written back through the Coordinator (to their home tier, refreshing any device copy).
//
// The state is split into sub-groups of at most `sub_group_size` elements (DeepSpeed's sub_group_size), each a
// range of one unit; with "nvme" they stream through the OptimizerSwapper's pinned slots (read i+1, update i,
// write i-1), so host memory holds a few sub-groups instead of 12 bytes per parameter. The global norm is
// summed per unit, in unit order, with the same function as the "cpu" Device (kernels/cpu/fast.h
// add_sum_squares), and the update is the same AdamW: on the CPU backend a run with the optimizer offloaded is
// bitwise the run that keeps it on the device.
//
// Overlap: each step's update runs on a worker thread and overlaps the next forward; it may also start during
// the step's last backward, assuming the step will not clip, and is rolled back and redone exactly where it
// does (with "cpu", given spare buffers: speculative_sub_groups). The protocol, and when it speculates, gates or
// waits: docs/architecture.md "Updates started during backward".
//
// Units kept on the device (offload_optimizer.ratio; Model::keep_on_device): the model's first units, whose
// updates are the ones the next forward waits for first. Their parameters and gradients are the model's own
// device buffers, outside the coordinator, and their Adam moments are on the device too (an AdamW over just them).
// Their share of the norm is taken there, added in unit order with the others', so the norm is the same bits;
// under data parallelism, ZeRO-3 included, every rank keeps them whole and sums their gradients over the ranks in
// device memory first. step() updates them on the device's stream, with the same parameters as the others'
// update, before it returns. Checkpoints read and write them as a plain AdamW's (state_view copies them out a
// piece at a time; load_state fills their device buffers).
//
// Threading: the training thread drives it; the update runs on a worker thread (its arithmetic on TBB, NVMe
// I/O on the swap store's engine); every call into the Coordinator stays on the training thread, and new
// parameters are published there (before each unit's use, from the Coordinator's before-use hook).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "engine/checkpoint/state_pieces.h"
#include "engine/model/model.h"
#include "engine/optim/optimizer.h"
#include "engine/parallel/grad_sync.h"
#include "engine/parallel/pipeline.h"
#include "offload/coordinator.h"
#include "offload/optimizer_swap.h"
#include "offload/pinned_pool.h"
#include "storage/swap_store.h"

namespace strata::offload {

struct OffloadedAdamWOptions {
  Tier placement = Tier::kHost;  // kHost ("cpu") or kNvme
  size_t sub_group_size = 1'000'000'000;           // elements; rounded up to a multiple of 1024
  int swap_slots = 3;                              // nvme: staging slots (offload_optimizer.buffer_count)
  bool overlap_backward = true;                    // start updates during the last backward (cpu: see below)
  // cpu: spare state buffers for the first sub-groups a backward updates (the model's last units), each for
  // one sub-group's new master, m and v (12 bytes per element of that sub-group), so that as many sub-groups can
  // be updated during the last backward while their old state stays to return to
  // (offload_optimizer.speculative_sub_groups). 0: updates start after backward.
  size_t speculative_sub_groups = 0;
};

// Where the last step's time went (seconds) and what it moved.
struct OffloadedStepStats {
  double grads_wait_s = 0;  // waiting for gradients to arrive home, and summing them over ranks there
  double update_wait_s = 0;  // the training thread waiting for new parameters and putting them in place
  double update_s = 0;      // the fused Adam passes (with nvme: the whole swap pipeline)
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
};

// What the last step() decided about the updates started during its backward.
struct SpeculationStats {
  bool started = false;     // the update started during backward (assuming no clipping)
  size_t early_groups = 0;  // sub-groups it took before the norm was known (kept, or rolled back)
  bool redone = false;      // they were rolled back: clipping, another lr, or a non-finite norm
  bool early_reads = false;  // gated (the last step clipped): only the first sub-groups' reads started
};

class OffloadedAdamW final : public engine::Optimizer, public engine::PieceState {
 public:
  // `model` gives the layouts (its units, in the coordinator's order); `store` is needed for kNvme. All must
  // outlive the optimizer. Call adopt_params() (or write_moments for every unit) before the first step.
  // With the coordinator's gradients on nvme, `grad_store` is where they are (with kNvme it must be `store`).
  static Result<std::unique_ptr<OffloadedAdamW>> create(const engine::Model& model, Coordinator& coordinator,
                                                        PinnedPool& pool, SwapStore* store,
                                                        const engine::AdamWConfig& config,
                                                        const OffloadedAdamWOptions& options,
                                                        SwapStore* grad_store = nullptr);

  ~OffloadedAdamW() override;

  // Computes the norm and clip scale on this thread (so the result is exact), then runs the update of every
  // sub-group on a worker thread and returns: the update overlaps the next forward. Each sub-group's new
  // parameters are published on the training thread, in unit order, by publish_through() — the coordinator
  // calls it before each use of a unit — so a unit is never computed with before its update has landed.
  Result<double> step(float lr, bool* skipped) override;
  // Publishes the new parameters of every unit up to `unit` (SIZE_MAX: all, then waits for the update's
  // writes) from the update in flight, if any. Training thread.
  Status publish_through(size_t unit);
  // Whether new parameters of `unit` are to come: from the step's last backward (begin_last_backward) until
  // the update in flight has published all of the unit's sub-groups. The coordinator's prefetch hint
  // (Coordinator::set_params_pending). Training thread.
  bool will_publish(size_t unit) const;
  Status finish() override;
  Status begin_last_backward(float lr) override;
  Status begin_accumulating_backward() override;
  // The model's hook: unit's gradient is complete for this backward (engine::Model::set_on_grads_done). Training
  // thread.
  void grads_done(size_t unit);
  // Data parallelism: step() sums every unit's gradient over `group` (in host memory, before the norm); the
  // updates then no longer start during backward (a local gradient is not the step's). Gradients must go home
  // to host memory. Null: none. Under ZeRO-3 (a sharded coordinator: each rank updates its shards, whose
  // gradients the coordinator has reduced already) it is required: `group` (the data-parallel ranks, another
  // communicator than the coordinator's) sums the norm, and read_moments gathers over it — a collective, so
  // every rank calls read_moments for the same units in the same order. The update then completes inside
  // step(), which drops the gathered parameter copies.
  Status set_gradient_reducer(comm::Communicator* group);
  // Pipeline parallelism: this optimizer updates the stage's units (model.holds); step() sums the gradients of
  // the units several stages hold (engine/parallel/grad_sync.h SharedGrads) and takes the whole model's norm (every
  // unit's sum of squares from its owner, in unit order); for a checkpoint, the first stage receives the other
  // stages' units a piece at a time through gather_piece (without tensor parallelism; with it, read_moments of
  // another stage's unit receives it whole; engine/parallel/pipeline.h). Collective over `pp` (which must outlive the
  // optimizer).
  Status set_pipeline(const engine::PipelinePlan& plan, comm::Communicator& pp);
  int steps_taken() const override { return t_; }
  void set_steps_taken(int t) override { t_ = t; }
  Status adopt_params() override;
  Status read_moments(size_t unit, float* m, float* v) override;
  Status write_moments(size_t unit, const float* m, const float* v) override;
  // PieceState (engine/checkpoint/state_pieces.h), for checkpoints.
  engine::PieceState* piece_state() override { return this; }
  // A sub-group's state in its host buffer, or read from NVMe into the swapper's first staging slot (a unit kept
  // on the device: a piece copied out of it); empty for a unit sharded over ranks or held by another pipeline
  // stage (gather_piece, or under tensor parallelism read_params and read_moments, bring those).
  Result<std::span<const float>> state_view(size_t unit, int k, size_t offset) override;
  Result<bool> load_state(size_t unit, const StateFill& fill) override;
  // Without tensor parallelism: under ZeRO-3 over ranks, every unit the stage holds, a piece of the owner's
  // sub-group at a time (an NVMe sub-group read once into its first staging slot for all its pieces); and on
  // the first pipeline stage, the other stages' units, as they send them.
  bool gathers_pieces(size_t unit) const override;
  bool stages_send_pieces() const override;
  Result<StatePiece> gather_piece(size_t unit, int k, size_t offset, size_t max_len,
                                  const PieceBuffer& buffer) override;

  // Of the last completed update (step() returns before its update completes).
  const OffloadedStepStats& last_step_stats() const { return stats_; }
  const SpeculationStats& last_speculation() const { return speculation_; }
  size_t num_groups() const { return groups_.size(); }
  // Whether no update is in flight or its worker has ended (finished, failed, or stopped) without being
  // joined yet. Training thread.
  bool update_ended() const;

 private:
  struct Group {
    size_t unit = 0, offset = 0;  // the range [offset, offset + numel) of the unit
    size_t shard_offset = 0;      // where it starts in this rank's shard of the unit (ZeRO-3; else = offset)
    OptimizerGroup spec;
    float* state = nullptr;  // kHost: master, m, v (3 x numel floats) in buffers_[buffer]
    size_t buffer = 0;
  };
  // kHost: a buffer of host memory for state, of `floats` floats (a sub-group's, or a spare).
  struct StateBuffer {
    PinnedBuffer memory;
    size_t floats = 0;
  };
  OffloadedAdamW() = default;
  // An update in flight, between the training thread and the worker: the sub-groups fed to it in the order it
  // takes them (each with the job bringing its gradient home), how far it got (with the new master weights,
  // valid until published), how far publication got (positions in `feed`), and how it ended.
  struct Handoff {
    struct Item {
      size_t group = 0;
      CopyTicket grads;
    };
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Item> feed;
    bool closed = false;       // nothing more will be fed
    bool speculative = false;  // started before the norm was known (scale 1 assumed); cleared when confirmed
    bool deciding = false;     // speculative, and step() is taking the norm: the guess is settled soon
    // The worker failed while speculative and kept (or went back to) the old state: step() must not confirm it.
    bool failed_unconfirmed = false;
    bool gated = false;        // started before the norm was known, reading only: waits for `hp` from step()
    bool opened = false;       // gated: step() gave it `hp`
    kernels::AdamWParams hp;
    // The worker waiting for `hp`, for sub-groups to be fed, or (speculative) for step(): not the update's time.
    double gate_wait_s = 0;
    size_t taken = 0, ready = 0, published = 0;
    std::vector<const float*> master;  // by position
    // By position: the copies of its published master weights still reading them (to the device and home),
    // which must end before the worker reuses that memory; those before `copies_waited` have ended.
    std::vector<std::vector<CopyTicket>> copies;
    size_t copies_waited = 0;
    bool done = false, abandoned = false;
    bool cancelled = false;    // the worker stopped because it saw `abandoned` (not for an error of its own)
    int step = 0;              // the optimizer step it updates, for the worker's messages (t_ is the trainer's)
    Status status;
    OffloadedStepStats stats;  // the worker's timings and bytes
    double grads_wait_s = 0;   // the training thread's
    double update_wait_s = 0;  // the training thread's, in publish_through
  };
  // Starts the worker on a new handoff: every sub-group in order when not speculative.
  // gated: the update starts reading, and waits for its parameters from open_gate() (or is cancelled).
  void start_update(const kernels::AdamWParams& hp, bool speculative, bool gated = false);
  // Gated update: whether one is waiting; give it the step's parameters; or stop it (nothing was updated; the
  // error of a read that failed before, which would otherwise surface only at the next step's reads).
  bool gated() const;
  void open_gate(const kernels::AdamWParams& hp, double grads_wait_s);
  Status cancel_gated();
  // On the worker: grads[g] is sub-group g's gradient in host memory, or null to read its swap key.
  Status run_update(const kernels::AdamWParams& hp, const std::vector<const float*>& grads, bool keep_old);
  // kHost's update on the worker: with keep_old, sub-groups go into spare buffers while the update is speculative
  // (then it waits for step()); the spares become their state if step() confirmed it, and are dropped otherwise.
  Status run_host_update(const kernels::AdamWParams& hp, const std::vector<const float*>& grads, bool keep_old);
  // On the worker, speculative: the smallest spare buffer that holds `floats` (SIZE_MAX: none), taken.
  size_t take_spare(size_t floats);
  // The update of the model's units kept on the device (engine::Model::keep_on_device, offload_optimizer.ratio), on the
  // device's stream, where step() starts the others'.
  void update_on_device(const kernels::AdamWParams& hp);
  // Data parallelism: each kept unit's gradient summed over the ranks in device memory (every rank keeps it whole
  // and updates it alike).
  Status sum_kept_grads();
  // load_state of a unit kept on the device: its weights and moments from `fill` a piece at a time into its device
  // buffers (so that a load takes every unit through load_state, and none through adopt_params after it).
  Result<bool> load_on_device(size_t unit, const StateFill& fill);
  // state_view of a unit kept on the device: a piece of at most kMaxStatePiece elements copied to host memory
  // (device_view_), so a checkpoint holds no kept unit whole outside the host budget.
  Result<std::span<const float>> view_on_device(size_t unit, int k, size_t offset);
  // Gives the spares back to the pool, with a warning naming `why` they are of no use (no update in flight).
  void release_spares(const char* why);
  Result<size_t> take_next(bool wait);                // on the worker: the next fed sub-group
  Status deliver(size_t group, const float* master);  // on the worker: wait until published
  // Waits for the copies out of the published master weights of every position before `end` (ordering only).
  void wait_copies(size_t end);
  Status publish_next();                              // the next position (delivered) to its home
  // Stops a speculative update; the worker rolls its writes back. With `restore`, parameters it published
  // go back to their old values (the update will not be redone).
  Status abandon_speculation(bool restore);
  Status join();  // waits for the worker, keeps its stats, ends the handoff; the worker's status
  Result<double> step_sharded(float lr, bool* skipped);        // ZeRO-3
  Status sum_shared_grads();                                   // pipeline: over their holders, after flush_grads
  Result<double> global_norm();                                // after flush_grads (and the sums over ranks)
  Status gather_moments(size_t unit, float* m, float* v);      // ZeRO-3, collective over reducer_
  // Sets master from the unit's current parameters and the moments from m, v (zeros where null).
  Status load_unit(size_t unit, const float* m, const float* v);
  // Each of unit's sub-groups from `fill` (load_state's), straight into where its state lives; with `publish`,
  // its weights become the model's parameters too.
  Status fill_groups(size_t unit, const StateFill& fill, bool publish);

  engine::AdamWConfig config_;
  OffloadedAdamWOptions options_;
  const engine::Model* model_ = nullptr;
  Coordinator* coordinator_ = nullptr;
  std::vector<Group> groups_;
  std::vector<StateBuffer> buffers_;  // kHost: every sub-group's state and the spares
  std::vector<size_t> spares_;        // kHost: buffers no sub-group uses (the worker's while an update runs)
  std::unique_ptr<OptimizerSwapper> swapper_;  // kNvme
  std::unique_ptr<engine::AdamW> on_device_;                    // the moments of the model's units kept on the device
  std::vector<float> device_view_;                      // view_on_device's piece
  SwapStore* grad_store_ = nullptr;                      // gradients on nvme
  PinnedBuffer grad_scratch_;                   // kHost with gradients on nvme: one sub-group's
  int t_ = 0;
  OffloadedStepStats stats_;
  SpeculationStats speculation_;
  std::unique_ptr<Handoff> handoff_;  // an update in flight
  std::thread worker_;
  size_t next_publish_ = 0;
  std::vector<size_t> unpublished_;     // per unit: its sub-groups the update in flight has not published
  bool update_expected_ = false;        // between begin_last_backward and step()
  kernels::AdamWParams speculated_hp_;  // what a speculative update assumed
  bool speculate_next_ = true;          // the last step did not clip (or there was none)
  comm::Communicator* reducer_ = nullptr;  // data-parallel group the gradients are summed over
  engine::PipelinePlan plan_;                      // pipeline: which stage owns each unit
  comm::Communicator* pp_ = nullptr;
  engine::SharedGrads shared_;                     // pipeline: the units several stages hold
  std::vector<bool> fed_;               // units fed to the speculative update
  // gather_piece on nvme: the sub-group and state whose region the swapper's first slot holds (SIZE_MAX: none),
  // until anything else may use that slot (finish(), an update).
  struct Viewed {
    size_t group = SIZE_MAX;
    int k = 0;
    const float* data = nullptr;
  } viewed_;
};

}  // namespace strata::offload
