// offloaded_adamw_worker.cpp — OffloadedAdamW's update worker (offload/offloaded_adamw.h): taking the sub-groups
// fed to it, the fused Adam passes (in host memory, into spare buffers while speculative, or through the NVMe
// swap pipeline), and handing each sub-group's new master weights to the training thread to publish. The training
// thread's side (step(), the handoff, publication) is offloaded_adamw.cpp.
#include "offload/offloaded_adamw.h"

#include <algorithm>

#include "common/timer.h"
#include "common/trace.h"
#include "kernels/cpu/fast.h"

namespace strata::offload {
namespace {

// A failed step after some sub-groups' new parameters were published: the run cannot go on from this state (the
// trainer says where it can resume from, if anywhere).
Status must_resume(const Status& st, int step) {
  return st.with_context("optimizer step " + std::to_string(step) + " (its state is half updated: the run stops)");
}

}  // namespace

Result<size_t> OffloadedAdamW::take_next(bool wait) {
  constexpr size_t kEnd = OptimizerSwapper::kEnd, kNotYet = OptimizerSwapper::kNotYet;
  Handoff& h = *handoff_;
  std::unique_lock lock(h.mu);
  for (;;) {
    if (h.abandoned) {
      h.cancelled = true;
      return Status::internal("optimizer step {}: abandoned by the training thread", h.step);
    }
    if (h.taken < h.feed.size()) {
      const Handoff::Item item = h.feed[h.taken];
      if (!item.grads.done()) {
        if (!wait) return kNotYet;
        lock.unlock();
        Timer waited;
        (void)item.grads.wait();
        lock.lock();
        h.gate_wait_s += waited.seconds();
        continue;
      }
      if (Status st = item.grads.wait(); !st.is_ok())
        return st.with_context("gradients of '" + model_->units()[groups_[item.group].unit].name + "'");
      ++h.taken;
      return item.group;
    }
    if (h.closed) return kEnd;
    if (!wait) return kNotYet;
    Timer waited;
    h.cv.wait(lock);
    h.gate_wait_s += waited.seconds();
  }
}

Status OffloadedAdamW::deliver(size_t group, const float* master) {
  Handoff& h = *handoff_;
  std::unique_lock lock(h.mu);
  const size_t pos = h.master.size();
  h.master.push_back(master);
  h.ready = pos + 1;
  h.cv.notify_all();
  // The master weights live in the worker's buffers: a swap slot (nvme), which the swapper reuses for the
  // position `slots` later, whose read it issues `slots - 2` positions from now — so this waits until the
  // position that far back is published; or the sub-group's own state (cpu), untouched until the next update.
  // The copies out of a published position may still be reading it: they end before its memory is reused.
  const size_t lag = swapper_ ? static_cast<size_t>(std::max(2, options_.swap_slots)) - 2 : groups_.size();
  trace::Span span("waiting for publication", static_cast<int64_t>(group));
  h.cv.wait(lock, [&] { return h.published + lag > pos || h.abandoned; });
  const bool abandoned = h.abandoned;
  lock.unlock();
  // Abandoned: the update is rolled back, which may rewrite any slot.
  wait_copies(abandoned ? SIZE_MAX : pos + 1 - std::min(pos + 1, lag));
  if (abandoned) {
    lock.lock();
    h.cancelled = true;
    return Status::internal("optimizer step {}: abandoned by the training thread", h.step);
  }
  return Status::ok();
}

void OffloadedAdamW::wait_copies(size_t end) {
  Handoff& h = *handoff_;
  std::vector<CopyTicket> pending;
  {
    std::lock_guard lock(h.mu);
    end = std::min(end, h.copies.size());
    for (; h.copies_waited < end; ++h.copies_waited) {
      for (CopyTicket& t : h.copies[h.copies_waited]) pending.push_back(std::move(t));
    }
  }
  for (const CopyTicket& t : pending) (void)t.wait();  // their failures reach the unit's next reader
}

Status OffloadedAdamW::run_update(const kernels::AdamWParams& hp, const std::vector<const float*>& grads,
                                  bool keep_old) {
  OffloadedStepStats& stats = handoff_->stats;  // the worker's own until done
  if (swapper_) {
    OptimizerSwapper::StepPlan plan;
    plan.next = [this](bool wait) { return take_next(wait); };
    plan.keep_old = keep_old;
    bool gated = false;
    {
      std::lock_guard lock(handoff_->mu);
      gated = handoff_->gated;
    }
    if (gated) {  // reads first; the parameters once step() knows the norm
      plan.params = [this]() -> Result<kernels::AdamWParams> {
        Handoff& h = *handoff_;
        trace::Span span("waiting for the norm");
        Timer gate;
        std::unique_lock lock(h.mu);
        h.cv.wait(lock, [&] { return h.opened || h.abandoned; });
        h.gate_wait_s += gate.seconds();
        if (h.abandoned) {
          h.cancelled = true;
          return Status::internal("optimizer step {}: cancelled before its update", h.step);
        }
        return h.hp;
      };
    }
    Status st = swapper_->step(grads, {}, DType::kF32, hp,
                               [&](size_t i, const float* master) { return deliver(i, master); }, plan);
    stats.nvme_read_bytes = swapper_->last_step_stats().bytes_read;
    stats.nvme_write_bytes = swapper_->last_step_stats().bytes_written;
    if (keep_old) {
      // Reaching here ok means step() confirmed the guess (it closes the feed only then).
      if (st.is_ok()) return swapper_->commit();
      swapper_->rollback();
      bool confirmed = false;
      {
        std::lock_guard lock(handoff_->mu);
        confirmed = !handoff_->speculative;
        handoff_->failed_unconfirmed = !confirmed;
      }
      // Confirmed, some sub-groups' new parameters are published already: like any failed step, the run must
      // restart from a checkpoint. Unconfirmed, step() restores them (abandon_speculation).
      return confirmed ? must_resume(st, hp.step) : st;
    }
    // A failed step leaves some sub-groups updated (OptimizerSwapper's contract): the run must restart from a
    // checkpoint, which the error says.
    if (!st.is_ok()) return must_resume(st, hp.step);
    return Status::ok();
  }
  return run_host_update(hp, grads, keep_old);
}

size_t OffloadedAdamW::take_spare(size_t floats) {
  size_t best = SIZE_MAX;
  for (size_t k = 0; k < spares_.size(); ++k) {
    const size_t have = buffers_[spares_[k]].floats;
    if (have >= floats && (best == SIZE_MAX || have < buffers_[spares_[best]].floats)) best = k;
  }
  if (best == SIZE_MAX) return SIZE_MAX;
  const size_t b = spares_[best];
  spares_.erase(spares_.begin() + static_cast<std::ptrdiff_t>(best));
  return b;
}

Status OffloadedAdamW::run_host_update(const kernels::AdamWParams& hp, const std::vector<const float*>& grads,
                                       bool keep_old) {
  Handoff& h = *handoff_;
  OffloadedStepStats& stats = h.stats;
  std::vector<std::pair<size_t, size_t>> into_spare;  // (sub-group, buffer) updated while speculative
  auto update = [&]() -> Status {
    for (;;) {
      STRATA_ASSIGN_OR_RETURN(const size_t i, take_next(true));
      if (i == OptimizerSwapper::kEnd) return Status::ok();
      const Group& g = groups_[i];
      const size_t n = g.spec.numel;
      float* out = g.state;  // in place, unless the update may yet be undone
      size_t spare = SIZE_MAX;  // the buffer `out` is in, when not in place
      bool unconfirmed = false, deciding = false;
      if (keep_old) {
        std::lock_guard lock(h.mu);
        unconfirmed = h.speculative;
        deciding = h.deciding;
      }
      if (unconfirmed) {
        // Into a spare while the norm is not being taken yet; once step() takes it (the backward has ended: the
        // last units, the embedding), the guess is settled within the gradients' last arrivals, and the update in
        // place, which reads and writes the same lines, is the faster one to wait for.
        spare = deciding ? SIZE_MAX : take_spare(3 * n);
        if (spare != SIZE_MAX) {
          out = buffers_[spare].memory.as<float>();
        } else {
          // No spare left (or step() is deciding): the rest waits for step() to confirm the guess (or abandon it).
          trace::Span span("waiting for the norm");
          Timer waited;
          std::unique_lock lock(h.mu);
          h.cv.wait(lock, [&] { return !h.speculative || h.abandoned; });
          h.gate_wait_s += waited.seconds();
          if (h.abandoned) {
            h.cancelled = true;
            return Status::internal("optimizer step {}: abandoned by the training thread", h.step);
          }
        }
      }
      const float* grad = grads[i];
      if (grad == nullptr) {
        if (Status st = grad_store_->read(g.spec.grad_key, grad_scratch_.data(), n * sizeof(float)); !st.is_ok()) {
          if (spare != SIZE_MAX) spares_.push_back(spare);  // nothing was written to it
          return st;
        }
        stats.nvme_read_bytes += n * sizeof(float);
        grad = grad_scratch_.as<float>();
      }
      const float *master = g.state, *m = master + n, *v = m + n;
      for (const OptimizerSegment& s : g.spec.segments) {
        kernels::AdamWParams p = hp;
        p.weight_decay = s.weight_decay;
        kernels::cpu::fast::adamw_update_into(master + s.offset, m + s.offset, v + s.offset, grad + s.offset,
                                              out + s.offset, out + n + s.offset, out + 2 * n + s.offset, nullptr,
                                              DType::kF32, s.numel, p);
      }
      if (spare != SIZE_MAX) into_spare.push_back({i, spare});  // holds the sub-group's new state now
      STRATA_RETURN_IF_ERROR(deliver(i, out));
    }
  };
  const Status status = update();
  // Confirmed (step() cleared `speculative`), the spares hold their sub-groups' new state and the old buffers
  // become spares; otherwise the spares are dropped and the old state stands, and a failed worker says so in the
  // same breath, so that step() does not confirm it after all. Nothing else reads a sub-group's state while an
  // update runs.
  bool confirmed = false;
  {
    std::lock_guard lock(h.mu);
    confirmed = !h.speculative;
    h.failed_unconfirmed = !confirmed && !status.is_ok();
  }
  for (const auto& [i, b] : into_spare) {
    Group& g = groups_[i];
    if (confirmed) {
      spares_.push_back(g.buffer);
      g.buffer = b;
      g.state = buffers_[b].memory.as<float>();
    } else {
      spares_.push_back(b);
    }
  }
  // Confirmed (or never speculative), some sub-groups are updated and published already: like any failed step,
  // the run must restart from a checkpoint.
  if (!status.is_ok() && confirmed) return must_resume(status, hp.step);
  return status;
}

}  // namespace strata::offload
