#include "offload/offloaded_adamw.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/log.h"
#include "common/thread_name.h"
#include "common/timer.h"
#include "common/trace.h"
#include "offload/optimizer_swap.h"

namespace strata::offload {

using engine::AdamW;
using engine::AdamWConfig;
using engine::Model;
using engine::PipelinePlan;
using engine::Unit;
using engine::adamw_params;
using engine::SharedGrads;
using engine::step_scale;
using engine::sum_in_rank_order;
using engine::unit_norm_share;
using engine::whole_model_norm;

Result<std::unique_ptr<OffloadedAdamW>> OffloadedAdamW::create(const Model& model, Coordinator& coordinator,
                                                              PinnedPool& pool, SwapStore* store,
                                                              const AdamWConfig& config,
                                                              const OffloadedAdamWOptions& options,
                                                              SwapStore* grad_store) {
  if (options.placement != Tier::kHost && options.placement != Tier::kNvme)
    return Status::invalid_argument("offload_optimizer.device must be cpu or nvme here");
  if (options.placement == Tier::kNvme && store == nullptr)
    return Status::invalid_argument("offload_optimizer.device = nvme needs offload_optimizer.nvme_path");
  if (options.sub_group_size == 0 || options.sub_group_size > static_cast<size_t>(kMaxSubGroupSize))
    return Status::invalid_argument("zero_optimization.sub_group_size must be in [1, 2^40], got {}",
                                    options.sub_group_size);
  if (coordinator.num_units() != model.units().size())
    return Status::invalid_argument("offload: the coordinator has {} units, the model {}", coordinator.num_units(),
                                    model.units().size());
  std::unique_ptr<OffloadedAdamW> opt(new OffloadedAdamW());
  opt->config_ = config;
  opt->options_ = options;
  opt->model_ = &model;
  opt->coordinator_ = &coordinator;
  const size_t group_size = (options.sub_group_size + 1023) / 1024 * 1024;
  for (size_t u = 0; u < model.units().size(); ++u) {
    const Unit& unit = model.units()[u];
    const ShardRange sh = coordinator.shard(u);  // the whole unit unless ZeRO-3
    for (size_t off = sh.lo, k = 0; off < sh.lo + sh.len; off += group_size, ++k) {
      Group g;
      g.unit = u;
      g.offset = off;
      g.shard_offset = off - sh.lo;
      g.spec.name = fmt::format("{}.{}", unit.name, k);
      g.spec.numel = std::min(group_size, sh.lo + sh.len - off);
      // The weight decay runs of the range: each tensor's part of it.
      for (const TensorSpec& s : unit.layout.specs()) {
        const size_t lo = std::max(off, s.offset), hi = std::min(off + g.spec.numel, s.offset + s.numel());
        if (lo >= hi) continue;
        g.spec.segments.push_back({lo - off, hi - lo, s.decay ? config.weight_decay : 0.0f});
      }
      if (coordinator.options().grad_home == Tier::kNvme) {
        const auto& keys = coordinator.grad_keys(u);
        if (keys.size() <= k || coordinator.options().nvme_chunk_elements != group_size)
          return Status::invalid_argument("offload: gradient chunks of '{}' do not match the optimizer's sub-groups",
                                          unit.name);
        g.spec.grad_key = keys[k];
      }
      if (options.placement == Tier::kHost) {
        StateBuffer b;
        b.floats = 3 * g.spec.numel;
        STRATA_ASSIGN_OR_RETURN(b.memory,
                                pool.try_acquire(b.floats * sizeof(float), "offload.optimizer " + g.spec.name));
        g.state = b.memory.as<float>();
        g.buffer = opt->buffers_.size();
        opt->buffers_.push_back(std::move(b));
      }
      opt->groups_.push_back(std::move(g));
    }
  }
  if (options.placement == Tier::kHost && options.overlap_backward) {
    // A spare for each of the first sub-groups a backward feeds the update (the units' in reverse order, each
    // unit's in order), of that sub-group's size: the worker takes the smallest spare that fits (take_spare), so
    // a sub-group and its spare trade places on confirmation without the spares drifting to other sizes, and the
    // last ones (the embedding, the largest, whose update waits for the norm anyway) cost nothing.
    std::vector<size_t> first_fed;
    for (size_t u = model.units().size(); u-- > 0;) {
      for (size_t i = 0; i < opt->groups_.size(); ++i)
        if (opt->groups_[i].unit == u) first_fed.push_back(i);
    }
    const size_t spares = std::min(options.speculative_sub_groups, first_fed.size());
    size_t total = 0;
    for (size_t k = 0; k < spares; ++k) total += 3 * opt->groups_[first_fed[k]].spec.numel;
    for (size_t k = 0; k < spares; ++k) {
      const Group& g = opt->groups_[first_fed[k]];
      StateBuffer b;
      b.floats = 3 * g.spec.numel;
      auto memory = pool.try_acquire(b.floats * sizeof(float), "offload.optimizer speculation " + g.spec.name);
      if (!memory.is_ok()) {
        return memory.status().with_context(fmt::format(
            "offload_optimizer.speculative_sub_groups = {}: {} spare buffers, {:.1f} MiB in all (12 bytes per "
            "element of the first {} sub-groups a backward updates)",
            options.speculative_sub_groups, spares, static_cast<double>(total * sizeof(float)) / (1 << 20),
            spares));
      }
      b.memory = std::move(memory).value();
      opt->spares_.push_back(opt->buffers_.size());
      opt->buffers_.push_back(std::move(b));
    }
  }
  if (model.any_on_device()) {
    std::vector<bool> only(model.units().size());
    for (size_t u = 0; u < only.size(); ++u) only[u] = model.on_device(u);
    STRATA_ASSIGN_OR_RETURN(AdamW a, AdamW::create(model.units(), config, model.device(), &only));
    opt->on_device_ = std::make_unique<AdamW>(std::move(a));
  }
  opt->grad_store_ = grad_store;
  if (coordinator.options().grad_home == Tier::kNvme) {
    if (grad_store == nullptr) return Status::invalid_argument("offload: gradients on nvme need their swap store");
    if (options.placement == Tier::kNvme && grad_store != store)
      return Status::invalid_argument("offload: with the optimizer on nvme its gradients must be in its swap store");
  }
  if (options.placement == Tier::kHost && coordinator.options().grad_home == Tier::kNvme) {
    size_t largest = 0;
    for (const Group& g : opt->groups_) largest = std::max(largest, g.spec.numel);
    STRATA_ASSIGN_OR_RETURN(opt->grad_scratch_, pool.try_acquire(largest * sizeof(float), "offload.optimizer grads"));
  }
  if (options.placement == Tier::kNvme) {
    std::vector<OptimizerGroup> specs;
    for (const Group& g : opt->groups_) specs.push_back(g.spec);
    STRATA_ASSIGN_OR_RETURN(opt->swapper_,
                            OptimizerSwapper::create(*store, pool, std::move(specs),
                                                              OptimizerSwapOptions{
                                                                  .key_prefix = "opt.",
                                                                  .slots = std::max(2, options.swap_slots)}));
  }
  return opt;
}

Status OffloadedAdamW::set_pipeline(const PipelinePlan& plan, comm::Communicator& pp) {
  STRATA_ASSERT_MSG(pp.size() == 1 || !model_->any_on_device(),
                    "units kept on the device under pipeline parallelism (offload_optimizer.ratio)");
  plan_ = plan;
  pp_ = &pp;
  release_spares("pipeline parallelism");
  STRATA_ASSIGN_OR_RETURN(shared_, SharedGrads::create(plan, &pp));
  return Status::ok();
}

Status OffloadedAdamW::sum_shared_grads() {
  const std::vector<size_t>& units = shared_.units();
  if (units.empty()) return Status::ok();
  // Every holder has the unit (the same shard of it under ZeRO-3): each adds the others' parts.
  if (coordinator_->options().grad_home == Tier::kNvme) return coordinator_->sum_grads_over(units, shared_.group());
  for (const size_t u : units) {
    float* g = coordinator_->sharded() ? const_cast<float*>(coordinator_->host_grads(u))
                                       : coordinator_->host_grads_for_update(u);
    STRATA_RETURN_IF_ERROR(shared_.sum(g, coordinator_->shard(u).len, model_->units()[u].name));
  }
  return Status::ok();
}

Result<double> OffloadedAdamW::global_norm() {
  const size_t U = model_->units().size();
  std::vector<double> per(U);
  for (size_t u = 0; u < U; ++u) per[u] = model_->on_device(u) ? 0.0 : coordinator_->grad_sum_squares(u);
  // Doubles travel as pairs of fp32 words (bits copied, never converted), and every rank adds them in the
  // same order, so every rank takes the same decision.
  if (coordinator_->sharded())  // each unit's shards, added in rank order
    STRATA_RETURN_IF_ERROR(sum_in_rank_order(*reducer_, &per, "gradient norm"));
  // The units kept on the device: whole on every rank, their gradients summed over the ranks already.
  for (size_t u = 0; u < U; ++u) {
    if (model_->on_device(u))
      per[u] = unit_norm_share(model_->norm_shares(), u, model_->units()[u], model_->device());
  }
  // Tensor parallelism: each rank's share of each unit (the coordinator leaves replicated tensors out on all
  // ranks but the first), added in rank order; pipeline: each unit's from the stage that owns it.
  return whole_model_norm(plan_, pp_, model_->norm_shares(), std::move(per));
}

Result<double> OffloadedAdamW::step_sharded(float lr, bool* skipped) {
  if (reducer_ == nullptr) return Status::internal("ZeRO-3: the offloaded optimizer has no data-parallel group");
  STRATA_RETURN_IF_ERROR(finish());
  Timer wait;
  STRATA_RETURN_IF_ERROR(coordinator_->flush_grads());  // every reduce-scatter has landed in the shards
  STRATA_RETURN_IF_ERROR(sum_kept_grads());
  STRATA_RETURN_IF_ERROR(sum_shared_grads());
  const double grads_wait_s = wait.seconds();
  STRATA_ASSIGN_OR_RETURN(const double norm, global_norm());
  speculation_ = SpeculationStats{};
  const std::optional<float> scale = step_scale(norm, config_.grad_clip, skipped);
  if (!scale) return norm;
  ++t_;
  // The update completes here: the gathered copies of every unit are stale once any rank's shard changed,
  // and the next forward gathers the new ones.
  const kernels::AdamWParams hp = adamw_params(config_, lr, t_, *scale);
  start_update(hp, /*speculative=*/false);
  update_on_device(hp);
  {
    std::lock_guard lock(handoff_->mu);
    handoff_->grads_wait_s = grads_wait_s;
  }
  STRATA_RETURN_IF_ERROR(finish());
  coordinator_->drop_device_params();
  return norm;
}

Status OffloadedAdamW::sum_kept_grads() {
  if (reducer_ == nullptr) return Status::ok();
  for (size_t u = 0; u < model_->units().size(); ++u) {  // in unit order on every rank
    if (!model_->on_device(u)) continue;
    float* g = model_->units()[u].g();
    STRATA_RETURN_IF_ERROR(reducer_->all_reduce(g, g, model_->units()[u].numel(), DType::kF32, comm::ReduceOp::kSum)
                               .with_context("gradients of " + model_->units()[u].name + " (kept on the device)"));
  }
  return Status::ok();
}

void OffloadedAdamW::update_on_device(const kernels::AdamWParams& hp) {
  if (on_device_) on_device_->apply(hp);
}

void OffloadedAdamW::start_update(const kernels::AdamWParams& hp, bool speculative, bool gated) {
  viewed_ = Viewed{};  // the update uses the slots
  handoff_ = std::make_unique<Handoff>();
  Handoff& h = *handoff_;
  h.speculative = speculative;
  h.gated = gated;
  h.step = hp.step;
  if (!speculative) {
    for (size_t g = 0; g < groups_.size(); ++g) h.feed.push_back({g, CopyTicket()});
    h.closed = true;
  }
  next_publish_ = 0;
  unpublished_.assign(model_->units().size(), 0);
  for (const Group& g : groups_) ++unpublished_[g.unit];
  // Where each sub-group's gradient is (null: in its swap key), taken here so the worker reads only memory.
  const bool grads_on_nvme = coordinator_->options().grad_home == Tier::kNvme;
  std::vector<const float*> grads;
  for (const Group& g : groups_)
    grads.push_back(grads_on_nvme ? nullptr : coordinator_->host_grads(g.unit) + g.shard_offset);
  worker_ = std::thread([this, hp, speculative, grads = std::move(grads)] {
    trace::name_thread("optimizer update");
    set_thread_name("optimizer");
    Timer update;
    Status st = run_update(hp, grads, speculative);
    Handoff& h = *handoff_;
    std::lock_guard lock(h.mu);
    // Stopped by a cancellation before its first update: nothing changed. (A read that failed before the gate
    // opened is an error like any other.)
    if (h.gated && !h.opened && h.cancelled) st = Status::ok();
    h.stats.update_s = update.seconds() - h.gate_wait_s;
    h.status = std::move(st);
    h.done = true;
    h.cv.notify_all();
  });
}

Status OffloadedAdamW::set_gradient_reducer(comm::Communicator* group) {
  reducer_ = group;
  if (group != nullptr) {
    // The gradients are summed over the ranks at home before the norm, which takes it from the sums.
    coordinator_->set_norms_on_arrival(false);
    release_spares("data parallelism");
  }
  return Status::ok();
}

void OffloadedAdamW::release_spares(const char* why) {
  if (spares_.empty()) return;
  STRATA_LOG_WARN("offload_optimizer.speculative_sub_groups is not acted on under {} (no update starts during "
                  "backward there): its {} spare buffers are given back",
                  why, spares_.size());
  for (const size_t b : spares_) buffers_[b].memory.reset();
  spares_.clear();
}

bool OffloadedAdamW::update_ended() const {
  if (!handoff_) return true;
  std::lock_guard lock(handoff_->mu);
  return handoff_->done;
}

bool OffloadedAdamW::gated() const {
  if (!handoff_) return false;
  std::lock_guard lock(handoff_->mu);
  return handoff_->gated && !handoff_->opened;
}

void OffloadedAdamW::open_gate(const kernels::AdamWParams& hp, double grads_wait_s) {
  Handoff& h = *handoff_;
  std::lock_guard lock(h.mu);
  h.hp = hp;
  h.opened = true;
  h.grads_wait_s = grads_wait_s;
  h.cv.notify_all();
}

Status OffloadedAdamW::cancel_gated() {
  {
    std::lock_guard lock(handoff_->mu);
    handoff_->abandoned = true;
    handoff_->cv.notify_all();
  }
  const OffloadedStepStats last = stats_;  // the last completed update's, which this worker never replaced
  const Status worker = join();            // ok unless a read failed before the cancellation
  stats_ = last;
  return worker.with_context("reading the optimizer state of the next step");
}

Status OffloadedAdamW::begin_accumulating_backward() {
  coordinator_->set_accumulating(true);
  return Status::ok();
}

Status OffloadedAdamW::begin_last_backward(float lr) {
  coordinator_->set_accumulating(false);
  STRATA_RETURN_IF_ERROR(finish());  // the last update: published by the forward, its writes done
  update_expected_ = true;
  const bool can_speculate = swapper_ != nullptr || !spares_.empty();  // cpu: given somewhere to put the new state
  if (!can_speculate || !options_.overlap_backward || reducer_ != nullptr || pp_ != nullptr) return Status::ok();
  if (!speculate_next_) {
    // The last step clipped, so this one probably will: no update before the norm, but (nvme) its first
    // sub-groups' state read now (the gradients must be in host memory by then, as step() ensures, not read here).
    if (swapper_ && coordinator_->options().grad_home == Tier::kHost)
      start_update(adamw_params(config_, lr, t_ + 1, 1.0f), /*speculative=*/false, /*gated=*/true);
    return Status::ok();
  }
  speculated_hp_ = adamw_params(config_, lr, t_ + 1, 1.0f);
  fed_.assign(model_->units().size(), false);
  start_update(speculated_hp_, /*speculative=*/true);
  return Status::ok();
}

void OffloadedAdamW::grads_done(size_t unit) {
  if (!handoff_ || unit >= fed_.size() || fed_[unit] || model_->on_device(unit)) return;
  // Still only on the device (the trace expected more of this backward to add to it): not final yet; step()
  // feeds it after flush_grads.
  if (coordinator_->residency(unit, StateClass::kGrads).dirty) return;
  Handoff& h = *handoff_;
  std::lock_guard lock(h.mu);
  if (!h.speculative || h.closed) return;
  fed_[unit] = true;
  const CopyTicket home = coordinator_->grads_home_ticket(unit);
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].unit == unit) h.feed.push_back({g, home});
  }
  h.cv.notify_all();
}

bool OffloadedAdamW::will_publish(size_t unit) const {
  if (update_expected_) return true;
  return handoff_ && unit < unpublished_.size() && unpublished_[unit] > 0;
}

Result<double> OffloadedAdamW::step(float lr, bool* skipped) {
  coordinator_->set_accumulating(false);
  update_expected_ = false;  // from here the update in flight (if any) says
  if (coordinator_->sharded()) return step_sharded(lr, skipped);
  bool speculating = false;
  if (handoff_) {
    std::lock_guard lock(handoff_->mu);
    speculating = handoff_->speculative;
    handoff_->deciding = speculating;
  }
  const bool gated_update = gated();
  if (!speculating && !gated_update) STRATA_RETURN_IF_ERROR(finish());  // normally done: the forward published it
  Timer wait;
  STRATA_RETURN_IF_ERROR(coordinator_->flush_grads(/*take_norms=*/reducer_ == nullptr));
  if (reducer_ != nullptr) {  // the step's gradient is the sum over the data-parallel ranks
    std::vector<size_t> held;  // another pipeline stage's units are not ours
    for (size_t u = 0; u < model_->units().size(); ++u)
      if (model_->holds(u) && !model_->on_device(u)) held.push_back(u);  // (kept ones: sum_kept_grads)
    if (coordinator_->options().grad_home == Tier::kNvme) {
      STRATA_RETURN_IF_ERROR(coordinator_->sum_grads_over(held, *reducer_));  // summed where they lie
    } else {
      for (size_t u : held) {
        float* g = coordinator_->host_grads_for_update(u);
        STRATA_RETURN_IF_ERROR(
            reducer_->all_reduce(g, g, model_->units()[u].numel(), DType::kF32, comm::ReduceOp::kSum)
                .with_context("gradients of " + model_->units()[u].name));
      }
    }
    STRATA_RETURN_IF_ERROR(sum_kept_grads());
  }
  STRATA_RETURN_IF_ERROR(sum_shared_grads());
  const double grads_wait_s = wait.seconds();
  STRATA_ASSIGN_OR_RETURN(const double norm, global_norm());
  const std::optional<float> scale = step_scale(norm, config_.grad_clip, skipped);
  const bool finite = scale.has_value();
  const kernels::AdamWParams hp = adamw_params(config_, lr, t_ + 1, scale.value_or(0.0f));
  speculation_ = SpeculationStats{};
  speculation_.started = speculating;
  speculation_.early_reads = gated_update;
  if (speculating) {
    Handoff& h = *handoff_;
    // A worker that already failed (a read, a checksum, a write) has rolled every sub-group back, though some
    // were published during backward: the step fails with its error, the published ones restored, instead of
    // being confirmed with the state of before it. The worker says so under the lock in the same breath as it
    // reads `speculative`, so the check and the confirmation are one critical section: a worker failing after
    // it finds the step confirmed, and the run then restarts from a checkpoint (its error says so).
    const bool guessed = finite && hp.lr == speculated_hp_.lr && hp.grad_scale == speculated_hp_.grad_scale;
    Status worker;
    bool confirmed = false;
    {
      std::unique_lock lock(h.mu);
      if (h.failed_unconfirmed) h.cv.wait(lock, [&] { return h.done; });  // its status is set when it ends
      if (h.done) worker = h.status;
      speculation_.early_groups = h.taken;
      if (worker.is_ok() && guessed) {
        // The guess was right: the updates done during backward stand, and the rest follows with the same
        // parameters, overlapping the next forward.
        h.grads_wait_s = grads_wait_s;
        for (size_t g = 0; g < groups_.size(); ++g) {
          if (!fed_[groups_[g].unit]) h.feed.push_back({g, coordinator_->grads_home_ticket(groups_[g].unit)});
        }
        // The backward fed the sub-groups last unit first, but the next forward takes the units first to last
        // and publication follows the feed: what the worker has not taken yet goes in the forward's order, so
        // that the forward waits for each unit's own update instead of for every one fed before it (the first
        // units, whose gradients were final last). Every gradient is home by now (flush_grads).
        std::sort(h.feed.begin() + static_cast<std::ptrdiff_t>(h.taken), h.feed.end(),
                  [](const Handoff::Item& a, const Handoff::Item& b) { return a.group < b.group; });
        h.speculative = false;
        h.closed = true;
        h.cv.notify_all();
        confirmed = true;
      }
    }
    if (!worker.is_ok()) {
      STRATA_RETURN_IF_ERROR(abandon_speculation(/*restore=*/true));
      return worker.with_context("the optimizer's updates during backward (their state is half updated: the run stops)");
    }
    if (confirmed) {
      update_on_device(hp);
      ++t_;
      speculate_next_ = true;
      return norm;  // what the worker delivers is published from the next forward's hook on
    }
    STRATA_RETURN_IF_ERROR(abandon_speculation(/*restore=*/!finite));
    speculation_.redone = true;
  }
  speculate_next_ = finite && hp.grad_scale == 1.0f;
  if (gated_update) {
    bool failed = false;
    {
      std::lock_guard lock(handoff_->mu);
      failed = handoff_->done && !handoff_->status.is_ok();  // its reads during backward
    }
    if (failed) return join();
    if (!finite) {
      STRATA_RETURN_IF_ERROR(cancel_gated());
      return norm;
    }
    ++t_;
    open_gate(hp, grads_wait_s);  // its first sub-groups are read already
    update_on_device(hp);         // after the CPU worker has what it needs (on the CPU backend this runs here)
    return norm;
  }
  if (!finite) return norm;
  ++t_;
  start_update(hp, /*speculative=*/false);
  update_on_device(hp);  // after the CPU worker has started (on the CPU backend this runs here)
  std::lock_guard lock(handoff_->mu);
  handoff_->grads_wait_s = grads_wait_s;
  return norm;
}

Status OffloadedAdamW::publish_next() {
  Handoff& h = *handoff_;
  const float* master = nullptr;
  size_t group = 0;
  {
    std::lock_guard lock(h.mu);
    master = h.master[next_publish_];
    group = h.feed[next_publish_].group;
  }
  const Group& g = groups_[group];
  trace::Span span("publish", static_cast<int64_t>(group));
  Timer writing;
  std::vector<CopyTicket> copies;  // still reading `master` (the worker's) when this returns
  const Status status = coordinator_->write_params(g.unit, g.offset, g.spec.numel, master, &copies);
  std::lock_guard lock(h.mu);
  h.copies.resize(next_publish_ + 1);
  h.copies[next_publish_] = std::move(copies);
  h.update_wait_s += writing.seconds();
  if (status.is_ok()) {
    --unpublished_[g.unit];
    h.published = ++next_publish_;
  } else {
    h.abandoned = true;  // the worker must not wait for a publication that will not come
  }
  h.cv.notify_all();
  return status;
}

Status OffloadedAdamW::join() {
  Handoff& h = *handoff_;
  worker_.join();
  wait_copies(SIZE_MAX);
  stats_ = h.stats;
  stats_.grads_wait_s = h.grads_wait_s;
  stats_.update_wait_s = h.update_wait_s;
  const Status status = h.status;
  handoff_.reset();
  return status;
}

Status OffloadedAdamW::abandon_speculation(bool restore) {
  Handoff& h = *handoff_;
  {
    std::lock_guard lock(h.mu);
    h.abandoned = true;
    h.cv.notify_all();
  }
  // The worker rolls back whatever it wrote: every sub-group's state is again that of before the step.
  std::vector<size_t> published;
  for (size_t pos = 0; pos < next_publish_; ++pos) published.push_back(h.feed[pos].group);
  (void)join();
  if (!restore) return Status::ok();  // the redo publishes every sub-group again
  for (const size_t i : published) {
    const Group& g = groups_[i];
    auto put_back = [&](const float* master) {
      return coordinator_->write_params(g.unit, g.offset, g.spec.numel, master);
    };
    STRATA_RETURN_IF_ERROR(swapper_ ? swapper_->with_master(i, put_back) : put_back(g.state));  // cpu: the old state
  }
  return Status::ok();
}

Status OffloadedAdamW::finish() {
  viewed_ = Viewed{};  // the slot it names may be reused from here
  if (!handoff_) return Status::ok();
  bool speculative = false;
  {
    std::lock_guard lock(handoff_->mu);
    speculative = handoff_->speculative;
  }
  // An update started during a backward whose step() never came (an error in between): undone, or (gated)
  // stopped before it changed anything.
  if (speculative) return abandon_speculation(/*restore=*/true);
  if (gated()) return cancel_gated();
  return publish_through(SIZE_MAX);
}

Status OffloadedAdamW::publish_through(size_t unit) {
  if (!handoff_) return Status::ok();
  Handoff& h = *handoff_;
  Status status;
  bool speculative = false;
  {
    std::lock_guard lock(h.mu);
    speculative = h.speculative;
  }
  if (gated()) return Status::ok();  // nothing is updated before step() opens it
  if (speculative) {
    // During the backward that feeds it: publish what is ready, never wait (the norm is not known yet).
    for (;;) {
      {
        std::lock_guard lock(h.mu);
        if (h.ready <= next_publish_) break;
      }
      if (status = publish_next(); !status.is_ok()) break;
    }
    if (status.is_ok()) return Status::ok();
    (void)abandon_speculation(/*restore=*/true);
    return status;
  }
  // Publish in the worker's order until no sub-group of a unit <= `unit` is left unpublished.
  auto needed = [&] {
    std::lock_guard lock(h.mu);
    for (size_t pos = next_publish_; pos < h.feed.size(); ++pos) {
      if (groups_[h.feed[pos].group].unit <= unit) return true;
    }
    return false;
  };
  while (status.is_ok() && needed()) {
    {
      trace::Span span("waiting for the update", static_cast<int64_t>(unit));
      Timer waited;
      std::unique_lock lock(h.mu);
      h.cv.wait(lock, [&] { return h.ready > next_publish_ || h.done; });
      h.update_wait_s += waited.seconds();
      if (h.ready <= next_publish_) break;  // the worker ended (failed) before this group
    }
    status = publish_next();
  }
  bool failed = false;
  {
    std::lock_guard lock(h.mu);
    failed = h.done && !h.status.is_ok();
  }
  // The worker goes on (with later sub-groups, or its last writes; or it ended with the last sub-groups still
  // to publish) unless it failed or the caller needs all of it.
  if (status.is_ok() && !failed && unit != SIZE_MAX) return Status::ok();
  const bool complete = next_publish_ == groups_.size();
  const Status worker_status = join();
  if (!status.is_ok()) return status;
  if (!worker_status.is_ok()) return worker_status;
  if (!complete)
    return Status::internal("optimizer step {}: {} of {} sub-groups were never published", t_,
                            groups_.size() - next_publish_, groups_.size());
  return Status::ok();
}

}  // namespace strata::offload
