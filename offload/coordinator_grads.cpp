// coordinator_grads.cpp — the Coordinator's gradients (coordinator.h): sending them home after their last
// backward use, the norm's sums of squares (on the "gradient norms" queue as downloads land, or on the way to
// nvme), the step's flush, zeroing, and summing over data-parallel ranks where they lie. The parameters' side is
// coordinator.cpp; the state both share is coordinator_state.h.
#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>

#include "comm/communicator.h"
#include "common/check.h"
#include "kernels/cpu/fast.h"
#include "offload/coordinator.h"
#include "offload/coordinator_state.h"

namespace strata::offload {

namespace {
// The gradient norm's sum of squares of host memory (kernels/cpu/fast.h, from 0).
double host_sum_squares(const float* x, size_t n) { return kernels::cpu::fast::add_sum_squares(0.0, x, n); }
}  // namespace

void Coordinator::send_grads_home(size_t u, const kernels::DeviceFence& fence) {
  State& s = *s_;
  State::UnitRec& r = s.units[u];
  // Send the gradient home now, overlapping the rest of backward; the device copy stays valid until evicted.
  kernels::Device* dev = &s.device;
  const void* src = r.dev_grads.data();
  const size_t bytes = r.bytes;
  CopyTicket downloaded;
  if (s.options.grad_home == Tier::kHost) {
    void* dst = r.host_grads.data();
    downloaded = s.copies.d2h.submit(
        [dev, dst, src, bytes, fence] {
          fence.wait();
          dev->download(dst, src, bytes);
          return Status::ok();
        },
        bytes, {r.grads_norm});  // the last sum of squares still reading the home copy
    r.grads_download = downloaded;
    queue_norm(u);
  } else {
    // Through a write-staging buffer to the swap store; the sum of squares for the norm is taken on the way,
    // from the same bytes the optimizer will read.
    auto staging = std::make_shared<StagingLease>(&s.write_staging);
    double* sumsq = &r.grad_sumsq;
    const Ranges* excluded = &r.info.norm_excluded;  // the units never move
    downloaded = s.copies.d2h.submit(
        [dev, src, bytes, fence, staging, sumsq, excluded] {
          staging->take();
          fence.wait();
          dev->download(staging->buf->data(), src, bytes);
          *sumsq = sum_squares_excluding(staging->buf->as<float>(), 0, bytes / sizeof(float), *excluded,
                                         host_sum_squares);
          return Status::ok();
        },
        bytes);
    SwapStore* st = s.grad_store;
    const std::vector<std::string> keys = r.grad_keys;
    const size_t chunk = s.options.nvme_chunk_elements * sizeof(float);
    r.grads_download = s.copies.nvme.submit(
        [staging, st, keys, chunk, bytes]() mutable {
          const Status written = write_chunks(*st, keys, chunk, staging->buf->data(), bytes);
          staging.reset();
          return written;
        },
        bytes, {downloaded});
    s.stats.nvme_write_bytes += bytes;
  }
  s.stats.d2h_bytes += bytes;
  r.grad_state = GradState::kBoth;
  // Keep the device copy only when this step adds to it again (the tied embedding); otherwise its memory goes
  // back for reuse once the download has read it, so gradients never pile up on the device.
  if (s.next_use(true)[u] == kNever || !s.replaying()) {
    s.to_spare(std::move(r.dev_grads), fence, {downloaded});
    r.grad_state = GradState::kHost;
  }
}

void Coordinator::queue_norm(size_t u) {
  State& s = *s_;
  State::UnitRec& r = s.units[u];
  r.grads_norm = CopyTicket();
  r.grads_norm_sumsq.reset();
  // Only the step's last backward sends a gradient home for good: an earlier micro-batch's download is brought
  // back and added to, so its sum of squares would be wasted work.
  if (s.norms == nullptr || !s.norms_on_arrival || s.accumulating) return;
  auto sumsq = std::make_shared<double>(std::numeric_limits<double>::quiet_NaN());
  r.grads_norm_sumsq = sumsq;
  r.grads_norm = s.norms->submit(
      [u, sumsq, x = r.host_grads.as<const float>(), lo = r.shard.lo, len = r.shard.len,
       excluded = &r.info.norm_excluded] {  // the units never move
        trace::Span span("gradient norm", static_cast<int64_t>(u));
        *sumsq = sum_squares_excluding(x, lo, len, *excluded, host_sum_squares);
        return Status::ok();
      },
      0, {r.grads_download});
}

void Coordinator::set_norms_on_arrival(bool on) { s_->norms_on_arrival = on; }

void Coordinator::set_accumulating(bool on) { s_->accumulating = on; }

void Coordinator::set_step_is_one_pass(bool on) { s_->step_is_one_pass = on; }

Status Coordinator::zero_grads() {
  for (State::UnitRec& r : s_->units) {
    STRATA_RETURN_IF_ERROR(r.grads_download.wait().with_context("offload: gradients of unit '" + r.info.name + "'"));
    STRATA_RETURN_IF_ERROR(r.grads_ready.wait().with_context("offload: gradients of unit '" + r.info.name + "'"));
    r.settle_norm();
    r.grads_download = CopyTicket();
    r.grads_reduce = CopyTicket();
    r.grads_ready = CopyTicket();
    r.grad_state = GradState::kZero;
    r.grads_reduced = false;
    r.grad_sumsq_valid = false;
  }
  return Status::ok();
}

Status Coordinator::flush_grads(bool take_norms) {
  if (s_->sharded()) {
    for (State::UnitRec& r : s_->units) {
      STRATA_ASSERT_MSG(r.in_use == 0, "flush_grads with a unit between acquire and release");
      STRATA_ASSERT_MSG(r.grad_state == GradState::kZero, "a device gradient without a release");
      if (!r.info.present) continue;
      if (Status st = s_->wait_ticket(r.grads_download, r, "bringing gradients home"); !st.is_ok()) {
        r.grad_sumsq = std::numeric_limits<double>::quiet_NaN();  // a failed reduce never took it
        return st;
      }
      if (!r.grads_reduced) {  // no backward used it
        if (s_->options.grad_home == Tier::kHost) {
          std::memset(r.host_grads.data(), 0, r.home_bytes);
        } else {
          STRATA_RETURN_IF_ERROR(s_->write_zero_grads(r));
        }
      }
      if (r.dev_grads.data() != nullptr) s_->to_spare(std::move(r.dev_grads), r.grads_last_use, {});
    }
    return Status::ok();
  }
  // Backward's order, the order the downloads finish in (last unit first): each unit's sum of squares for the
  // norm is taken as soon as its gradient is home, while the later ones are still arriving.
  for (size_t i = s_->units.size(); i-- > 0;) {
    State::UnitRec& r = s_->units[i];
    STRATA_ASSERT_MSG(r.in_use == 0, "flush_grads with a unit between acquire and release");
    if (!r.info.present) continue;
    switch (r.grad_state) {
      case GradState::kZero:
        (void)r.grads_home_read.wait();  // a read of the home copy may still be in flight
        if (s_->options.grad_home == Tier::kHost) {
          r.settle_norm();
          std::memset(r.host_grads.data(), 0, r.bytes);
        } else {
          STRATA_RETURN_IF_ERROR(s_->write_zero_grads(r));
        }
        r.grad_state = GradState::kHost;
        if (r.dev_grads.data() != nullptr) s_->to_spare(std::move(r.dev_grads), r.grads_last_use, {});
        break;
      case GradState::kDevice:  // still accumulating (no backward after set_accumulating(false)): home now
        send_grads_home(i, s_->device.fence());
        STRATA_RETURN_IF_ERROR(s_->wait_ticket(r.grads_download, r, "bringing gradients home"));
        break;
      case GradState::kBoth:
      case GradState::kHost:
        STRATA_RETURN_IF_ERROR(s_->wait_ticket(r.grads_download, r, "bringing gradients home"));
        break;
    }
    if (take_norms && s_->options.grad_home == Tier::kHost) {
      if (r.grads_norm_sumsq != nullptr) {  // taken as the download landed
        STRATA_RETURN_IF_ERROR(
            r.grads_norm.wait().with_context("offload: the gradient norm of unit '" + r.info.name + "'"));
        r.grad_sumsq = *r.grads_norm_sumsq;
        ++s_->stats.norms_early;
      } else {
        r.grad_sumsq = sum_squares_excluding(r.host_grads.as<float>(), r.shard.lo, r.shard.len,
                                             r.info.norm_excluded, host_sum_squares);
      }
      r.grad_sumsq_valid = true;
    }
  }
  return Status::ok();
}

const float* Coordinator::host_grads(size_t u) const { return s_->units[u].host_grads.as<float>(); }

float* Coordinator::host_grads_for_update(size_t u) {
  State::UnitRec& r = s_->units[u];
  STRATA_ASSERT_MSG(s_->options.grad_home == Tier::kHost, "host_grads_for_update with gradients on nvme");
  STRATA_ASSERT_MSG(!s_->sharded(), "host_grads_for_update under ZeRO-3 (the gradients are reduced already)");
  STRATA_ASSERT_MSG(r.grad_state == GradState::kHost || r.grad_state == GradState::kBoth,
                    "host_grads_for_update before flush_grads");
  if (r.dev_grads.data() != nullptr) s_->drop_device_grads(r);
  r.grad_state = GradState::kHost;
  r.settle_norm();  // the caller changes it
  r.grad_sumsq_valid = false;
  return r.host_grads.as<float>();
}

Status Coordinator::sum_grads_over(const std::vector<size_t>& units, comm::Communicator& group) {
  State& s = *s_;
  // A pipeline over the units: while unit i is all-reduced here, the reads of the next ones run on the I/O queue
  // and the write-backs of the previous ones behind them. The leases are taken on this thread, and at most
  // buffers - 1 units read ahead hold one while they wait for this thread, so a take() here only ever waits for
  // a queued write-back to finish, never for a unit that waits on this thread.
  CopyQueue& io = *s.grad_io;
  const size_t chunk = s.options.nvme_chunk_elements * sizeof(float);
  const size_t ahead = std::min<size_t>(2, static_cast<size_t>(std::max(1, s.options.nvme_buffers)) - 1);
  struct Pending {
    size_t u;
    std::shared_ptr<StagingLease> staging;
    CopyTicket read;
  };
  std::deque<Pending> reading;
  std::vector<CopyTicket> writes;
  Status failed_read;  // the first; this rank still sums the rest, so the ranks stay in step
  size_t next = 0;
  auto start_read = [&]() -> Status {
    const size_t u = units[next++];
    State::UnitRec& r = s.units[u];
    // Under ZeRO-3, this rank's shard, reduce-scattered into its keys already (flush_grads freed the device copy).
    STRATA_ASSERT_MSG(s.sharded() ? r.grad_state == GradState::kZero && r.dev_grads.data() == nullptr
                                  : r.grad_state == GradState::kHost || r.grad_state == GradState::kBoth,
                      "sum_grads_over before flush_grads");
    STRATA_RETURN_IF_ERROR(s.wait_ticket(r.grads_download, r, "bringing gradients home"));
    if (!s.sharded()) {
      if (r.dev_grads.data() != nullptr) s.drop_device_grads(r);  // stale once summed
      r.grad_state = GradState::kHost;
    }
    // Until the sum is written back its norm is not a number: a step that goes on after a failure here skips
    // its update instead of using a half-summed gradient.
    r.grad_sumsq = std::numeric_limits<double>::quiet_NaN();
    auto staging = std::make_shared<StagingLease>(&s.write_staging);
    staging->take();
    SwapStore* st = s.grad_store;
    const std::vector<std::string>* keys = &r.grad_keys;  // the units never move
    const size_t bytes = r.home_bytes;
    const std::string name = r.info.name;
    CopyTicket read = io.submit(
        [st, keys, chunk, staging, bytes, name] {
          return read_chunks(*st, *keys, chunk, staging->buf->data(), bytes)
              .with_context("offload: reading the gradient of '" + name + "' to sum it");
        },
        bytes);
    s.stats.nvme_read_bytes += bytes;
    reading.push_back({u, std::move(staging), std::move(read)});
    return Status::ok();
  };
  // On the way out, every job submitted here has finished: the leases are back and each sum of squares is set.
  auto finish = [&](Status st) {
    for (const Pending& p : reading) {
      Status done = p.read.wait();
      if (st.is_ok()) st = std::move(done);
    }
    for (const CopyTicket& w : writes) {
      Status done = w.wait();
      if (st.is_ok()) st = std::move(done);
    }
    return st;
  };
  auto read_next = [&]() -> Status {  // an earlier failed read, if any, is the cause to report
    Status st = start_read();
    return st.is_ok() ? st : finish(failed_read.is_ok() ? std::move(st) : failed_read);
  };

  while (next < units.size() && reading.size() <= ahead) STRATA_RETURN_IF_ERROR(read_next());
  while (!reading.empty()) {
    Pending p = std::move(reading.front());
    reading.pop_front();
    State::UnitRec& r = s.units[p.u];
    const size_t len = r.shard.len;  // the whole unit unless ZeRO-3
    float* g = p.staging->buf->as<float>();
    // A rank whose read failed still takes part, with NaN: every rank's sum and norm are then not finite, and
    // every rank skips the update rather than the others using what was in the buffer. From its first failed
    // read on, this rank writes nothing back (those units' sums of squares stay NaN), and it fails once every
    // unit has been summed.
    Status read = p.read.wait();
    if (!read.is_ok()) std::fill(g, g + len, std::numeric_limits<float>::quiet_NaN());
    const Status summed = group.all_reduce(g, g, len, DType::kF32, comm::ReduceOp::kSum)
                              .with_context("gradients of " + r.info.name);
    if (!read.is_ok() && failed_read.is_ok()) failed_read = std::move(read);
    if (!summed.is_ok()) return finish(failed_read.is_ok() ? summed : failed_read);  // the cause, if both failed
    if (!failed_read.is_ok()) {
      p.staging.reset();  // before the next read takes one: no write-back will give it back
      if (next < units.size()) STRATA_RETURN_IF_ERROR(read_next());
      continue;
    }
    SwapStore* st = s.grad_store;
    const std::vector<std::string>* keys = &r.grad_keys;
    const size_t bytes = r.home_bytes, lo = r.shard.lo;
    double* sumsq = &r.grad_sumsq;
    const Ranges* excluded = &r.info.norm_excluded;
    const std::string name = r.info.name;
    writes.push_back(io.submit(
        [st, keys, chunk, staging = std::move(p.staging), bytes, lo, len, sumsq, excluded, name]() mutable {
          const float* sum = staging->buf->as<float>();
          STRATA_RETURN_IF_ERROR(write_chunks(*st, *keys, chunk, sum, bytes)
                                     .with_context("offload: writing the summed gradient of '" + name + "'"));
          *sumsq = sum_squares_excluding(sum, lo, len, *excluded, host_sum_squares);
          staging.reset();
          return Status::ok();
        },
        bytes));
    s.stats.nvme_write_bytes += bytes;
    if (next < units.size()) STRATA_RETURN_IF_ERROR(read_next());
  }
  return finish(std::move(failed_read));
}

const std::vector<std::string>& Coordinator::grad_keys(size_t u) const { return s_->units[u].grad_keys; }

CopyTicket Coordinator::grads_home_ticket(size_t u) const { return s_->units[u].grads_download; }

double Coordinator::grad_sum_squares(size_t u) const {
  const State::UnitRec& r = s_->units[u];
  if (!r.info.present) return 0.0;
  if (s_->options.grad_home == Tier::kNvme || r.grad_sumsq_valid) return r.grad_sumsq;
  return sum_squares_excluding(r.host_grads.as<float>(), r.shard.lo, r.shard.len, r.info.norm_excluded,
                               host_sum_squares);
}

}  // namespace strata::offload
