#include "offload/coordinator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "comm/communicator.h"
#include "common/check.h"
#include "common/log.h"
#include "common/timer.h"
#include "kernels/cpu/fast.h"
#include "offload/coordinator_state.h"

namespace strata::offload {

namespace {
// The gradient norm's sum of squares of host memory (kernels/cpu/fast.h, from 0).
double host_sum_squares(const float* x, size_t n) { return kernels::cpu::fast::add_sum_squares(0.0, x, n); }

// Publishing a step's parameters copies them on the training thread, in the next forward's path: one thread
// copies at a fraction of the memory's bandwidth, so large copies are split over the cores.
void copy_floats(float* dst, const float* src, size_t n) {
  constexpr size_t kChunk = size_t{1} << 18;  // floats: 1 MiB
  if (n <= kChunk) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  tbb::parallel_for(tbb::blocked_range<size_t>(0, (n + kChunk - 1) / kChunk), [&](const tbb::blocked_range<size_t>& r) {
    for (size_t c = r.begin(); c < r.end(); ++c)
      std::memcpy(dst + c * kChunk, src + c * kChunk, std::min(kChunk, n - c * kChunk) * sizeof(float));
  });
}
}  // namespace

Coordinator::Coordinator(std::unique_ptr<State> s) : s_(std::move(s)), options_(s_->options) {}
Coordinator::~Coordinator() = default;

Result<std::unique_ptr<Coordinator>> Coordinator::create(kernels::Device& device, CopyEngine& copies,
                                                         PinnedPool* pool, SwapStore* store,
                                                         std::vector<CoordinatorUnit> units,
                                                         const CoordinatorOptions& options, SwapStore* grad_store,
                                                         comm::Communicator* shard_group) {
  if (grad_store == nullptr) grad_store = store;
  if (shard_group != nullptr && shard_group->size() < 2) shard_group = nullptr;  // one rank: nothing to shard
  if (shard_group != nullptr) {
    if (options.param_home != Tier::kHost && options.param_home != Tier::kNvme)
      return Status::invalid_argument("offload: zero_optimization.stage 3 keeps each rank's parameter shard in host "
                                      "memory or on nvme (offload_param.device cpu or nvme), not on the device");
  }
  if (options.nvme_chunk_elements == 0 || options.nvme_chunk_elements % 1024 != 0)
    return Status::invalid_argument("offload: nvme_chunk_elements must be a positive multiple of 1024, got {}",
                                    options.nvme_chunk_elements);
  if (options.param_home == Tier::kNvme && store == nullptr)
    return Status::invalid_argument("offload: parameters on nvme need a swap store (offload_param.nvme_path)");
  if (options.grad_home != Tier::kHost && options.grad_home != Tier::kNvme)
    return Status::invalid_argument("offload: gradients go home to host or nvme");
  if (options.grad_home == Tier::kNvme && grad_store == nullptr)
    return Status::invalid_argument("offload: gradients on nvme need a swap store");
  if (pool == nullptr) return Status::invalid_argument("offload: the coordinator needs a pinned pool for gradients");
  if (options.nvme_buffers < 1)
    return Status::invalid_argument("offload_param.buffer_count must be >= 1, got {}", options.nvme_buffers);
  auto s = std::make_unique<State>(device, copies, pool, store, options);
  s->grad_store = grad_store;
  s->group = shard_group;
  const size_t ranks = shard_group ? static_cast<size_t>(shard_group->size()) : 1;
  const size_t rank = shard_group ? static_cast<size_t>(shard_group->rank()) : 0;
  size_t largest_stride = 0;
  s->units.resize(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    State::UnitRec& r = s->units[u];
    r.info = std::move(units[u]);
    if (r.info.numel == 0) return Status::invalid_argument("offload: unit '{}' has no parameters", r.info.name);
    r.bytes = r.info.numel * sizeof(float);
    if (!r.info.present) continue;  // another pipeline stage's: no state, shard {0, 0, 0}
    if (shard_group != nullptr) {
      r.shard.stride = shard_stride(r.info.numel, ranks);
      r.shard.lo = std::min(r.info.numel, rank * r.shard.stride);
      r.shard.len = std::min(r.info.numel, r.shard.lo + r.shard.stride) - r.shard.lo;
      largest_stride = std::max(largest_stride, r.shard.stride);
    } else {
      r.shard = ShardRange{0, r.info.numel, r.info.numel};
    }
    r.slot_bytes = ranks * r.shard.stride * sizeof(float);
    r.home_bytes = r.shard.len * sizeof(float);
    const size_t home_capacity = r.shard.stride * sizeof(float);  // room for a padded shard
    r.persistent = shard_group == nullptr &&
                   (options.param_home == Tier::kDevice || r.info.numel <= options.persistence_threshold);
    r.resident = shard_group != nullptr && r.info.numel <= options.persistence_threshold;
    r.home = r.persistent ? Tier::kDevice : options.param_home;
    const size_t chunks = (r.shard.len + options.nvme_chunk_elements - 1) / options.nvme_chunk_elements;
    if (options.grad_home == Tier::kNvme) {
      for (size_t k = 0; k < chunks; ++k) r.grad_keys.push_back(fmt::format("grad.{}.{}", r.info.name, k));
    } else {
      STRATA_ASSIGN_OR_RETURN(r.host_grads, pool->try_acquire(home_capacity, "offload.grads " + r.info.name));
      std::memset(r.host_grads.data(), 0, home_capacity);
    }
    if (r.home == Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(r.dev_params, device.allocate(r.bytes, "offload.persistent " + r.info.name));
    } else if (r.home == Tier::kHost) {
      STRATA_ASSIGN_OR_RETURN(r.host_params, pool->try_acquire(home_capacity, "offload.params " + r.info.name));
      std::memset(r.host_params.data(), 0, home_capacity);
    } else {
      r.nvme_written.assign(chunks, false);
      r.chunk_writes.resize(chunks);
      for (size_t k = 0; k < chunks; ++k) r.nvme_keys.push_back(fmt::format("{}{}.{}", options.key_prefix, r.info.name, k));
    }
  }
  size_t largest_read = 0, largest_write = 0;
  for (const State::UnitRec& r : s->units) {
    const size_t capacity = r.shard.stride * sizeof(float);  // a gather sends a whole padded shard
    // Gradients come back from nvme only unsharded (ZeRO-3 reduces each micro-batch's into its home shard).
    const bool grads_read = options.grad_home == Tier::kNvme && shard_group == nullptr;
    if (r.home == Tier::kNvme || grads_read) largest_read = std::max(largest_read, capacity);
    if (options.grad_home == Tier::kNvme) largest_write = std::max(largest_write, capacity);
  }
  if (shard_group != nullptr) {
    STRATA_ASSIGN_OR_RETURN(s->reduce_scratch,
                            pool->try_acquire(largest_stride * sizeof(float), "offload.zero3 reduce-scatter"));
    s->collectives = std::make_unique<CopyQueue>("collectives");
  }
  // Gradient shards read, added to and written back (ZeRO-3), or gradients summed over ranks where they lie
  // (sum_grads_over): on a queue of their own, behind no parameter traffic.
  if (options.grad_home == Tier::kNvme) s->grad_io = std::make_unique<CopyQueue>("gradient io");
  if (options.grad_home == Tier::kHost && shard_group == nullptr)
    s->norms = std::make_unique<CopyQueue>("gradient norms");
  // Where the kernels run on the host's own cores, the backward leaves none idle for the sums of squares.
  s->norms_on_arrival = !device.host_accessible();
  for (int i = 0; i < options.nvme_buffers; ++i) {
    if (largest_read > 0) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, pool->try_acquire(largest_read, "offload.nvme read staging"));
      s->read_staging.add(std::move(b));
    }
    if (largest_write > 0) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer b, pool->try_acquire(largest_write, "offload.nvme write staging"));
      s->write_staging.add(std::move(b));
    }
  }
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(s)));
  Coordinator* self = c.get();
  c->s_->send_grads_home = [self](size_t u, const kernels::DeviceFence& fence) { self->send_grads_home(u, fence); };
  return c;
}

size_t Coordinator::num_units() const { return s_->units.size(); }
const CoordinatorUnit& Coordinator::unit(size_t u) const { return s_->units[u].info; }

Status Coordinator::write_params(size_t u, size_t offset, size_t n, const float* host,
                                 std::vector<CopyTicket>* reads) {
  STRATA_ASSERT(u < s_->units.size());
  State& s = *s_;
  State::UnitRec& r = s.units[u];
  if (offset > r.info.numel || n > r.info.numel - offset)
    return Status::invalid_argument("offload: write of [{}, {}) is outside unit '{}' ({} elements)", offset,
                                    offset + n, r.info.name, r.info.numel);
  STRATA_ASSERT_MSG(r.in_use == 0, "write_params on a unit between acquire and release");
  if (!r.info.present) return Status::ok();  // another pipeline stage's
  // A device copy being assembled takes its pieces in order; any other write leaves it incomplete.
  if (r.assembling && offset != r.assembled) s.drop_partial(r);
  // Jobs may still read the home copy in host memory this overwrites (also loads into slots since evicted);
  // the swap store keeps a version being read.
  if (r.home == Tier::kHost) (void)r.params_home_read.wait();
  // The whole of a loaded (nvme) copy is replaced below, after its load, whatever became of that.
  const bool replaced = reads != nullptr && !s.sharded() && r.home == Tier::kNvme && r.dev_params.data() != nullptr &&
                        !r.persistent && !r.assembling && offset == 0 && n == r.info.numel;
  // Otherwise a load in flight ends first; one that failed left no valid device copy.
  if (!r.assembling && !replaced && !r.params_ready.wait().is_ok()) s.drop_failed_params(r);
  if (s.sharded()) {
    s.drop_params(r);  // other ranks' parts of it may change too
    const size_t lo = std::max(offset, r.shard.lo), hi = std::min(offset + n, r.shard.lo + r.shard.len);
    if (lo >= hi) return Status::ok();
    const float* src = host + (lo - offset);
    if (r.home == Tier::kHost) {
      std::memcpy(r.host_params.as<float>() + (lo - r.shard.lo), src, (hi - lo) * sizeof(float));
      return Status::ok();
    }
    const size_t chunk = s.options.nvme_chunk_elements;
    const size_t at = lo - r.shard.lo, len = hi - lo;
    if (at % chunk != 0 || (len % chunk != 0 && hi != r.shard.lo + r.shard.len))
      return Status::invalid_argument("offload: write of [{}, {}) of unit '{}' does not cover whole nvme chunks of {} "
                                      "of this rank's shard [{}, {})",
                                      offset, offset + n, r.info.name, chunk, r.shard.lo, r.shard.lo + r.shard.len);
    for (size_t off = 0; off < len; off += chunk) {
      const size_t k = (at + off) / chunk;
      STRATA_RETURN_IF_ERROR(s.store->write(r.nvme_keys[k], src + off, std::min(chunk, len - off) * sizeof(float)));
      r.nvme_written[k] = true;
    }
    s.stats.nvme_write_bytes += len * sizeof(float);
    return Status::ok();
  }
  const size_t bytes = n * sizeof(float);
  kernels::DeviceFence fence = r.params_last_use;
  std::vector<CopyTicket> reuse, after;  // a new slot's earlier users; the upload's data prerequisites
  if (r.home == Tier::kHost) {
    copy_floats(r.host_params.as<float>() + offset, host, n);
  } else if (r.home == Tier::kNvme && r.dev_params.data() != nullptr && !r.persistent && !r.assembling) {
    // Only the device copy is refreshed below; it goes home when evicted (home_stale).
    STRATA_RETURN_IF_ERROR(State::check_written(r));
    r.home_stale = true;
  } else if (r.home == Tier::kNvme) {
    const size_t chunk = s.options.nvme_chunk_elements;
    if (offset % chunk != 0 || (n % chunk != 0 && offset + n != r.info.numel))
      return Status::invalid_argument("offload: write of [{}, {}) of unit '{}' does not cover whole nvme chunks of {}",
                                      offset, offset + n, r.info.name, chunk);
    // Published by a forward's hook with no device copy: the pieces go to the device straight from `host` as
    // well as home, so that its use does not wait for them to reach nvme and come back. The unit being
    // acquired gets a slot as a demand load would; a later one (published with it, in the update's order) as
    // a prefetch would, within the budgets. Without room it loads from home when used.
    size_t ahead = kNever;
    if (reads != nullptr && s.acquiring != SIZE_MAX && offset == 0 && r.dev_params.data() == nullptr)
      ahead = u == s.acquiring ? 0 : s.replaying() ? s.next_use(false)[u] : kNever;
    if (ahead != kNever) {
      auto slot = s.params_slot(u, ahead);
      if (!slot.is_ok() && slot.status().code() != StatusCode::kOutOfMemory) return slot.status();
      if (slot.is_ok() && slot->has_value()) {
        Slot& got = **slot;
        fence = got.fence;
        reuse = std::move(got.after);
        r.dev_params = std::move(got.buf);
        r.params_ready = CopyTicket();
        r.assembling = true;
        r.assembled = 0;
        s.live_elements += s.live(r);
        ++s.stats.fetches;
      }
    }
    // A failure is said when it happens (once for this write): a checkpoint takes the weights from the
    // optimizer's copy and never reads this one, so after the run's last step nothing else would (the unit's
    // next load fails on it otherwise).
    auto said = reads != nullptr ? std::make_shared<std::atomic<bool>>(false) : nullptr;
    for (size_t off = 0; off < n; off += chunk) {
      const size_t len = std::min(chunk, n - off);
      const size_t k = (offset + off) / chunk;
      if (reads != nullptr) {
        // In order behind the key's earlier writes on the same queue.
        r.chunk_writes[k] = s.copies.nvme.submit(
            [st = s.store, key = r.nvme_keys[k], src = host + off, len, name = r.info.name, said] {
              Status written = st->write(key, src, len * sizeof(float));
              if (!written.is_ok() && !said->exchange(true))
                STRATA_LOG_WARN("offload: writing unit '{}' home failed: {}", name, written.to_string());
              return written;
            },
            len * sizeof(float));
        reads->push_back(r.chunk_writes[k]);
      } else {
        (void)r.chunk_writes[k].wait();
        STRATA_RETURN_IF_ERROR(s.store->write(r.nvme_keys[k], host + off, len * sizeof(float)));
        r.chunk_writes[k] = CopyTicket();
      }
      r.nvme_written[k] = true;
    }
    s.stats.nvme_write_bytes += bytes;
  }
  if (r.dev_params.data() == nullptr) return Status::ok();
  // Refresh the device copy, after the kernels that read the old one.
  float* dst = r.dev_params.as<float>() + offset;
  if (r.home == Tier::kHost) {
    r.params_ready = s.upload(dst, r.host_params.as<float>() + offset, bytes, fence);
    r.params_home_read = r.params_ready;
    return Status::ok();
  }
  if (reads == nullptr) return s.upload(dst, host, bytes, fence).wait();  // `host` is the caller's
  // After the copy's load or earlier pieces: what it depends on, or (replaced) only follows.
  (replaced ? reuse : after).push_back(r.params_ready);
  r.params_ready = s.upload(dst, host, bytes, fence, std::move(reuse), std::move(after));
  reads->push_back(r.params_ready);
  if (r.assembling) {
    r.assembled += n;
    if (r.assembled == r.info.numel) r.assembling = false;
  }
  return Status::ok();
}

Status Coordinator::read_shard(size_t u, float* host) {
  STRATA_ASSERT(u < s_->units.size());
  if (!s_->units[u].info.present)
    return Status::internal("offload: unit '{}' belongs to another pipeline stage", s_->units[u].info.name);
  if (!s_->sharded()) return read_params(u, host);
  State::UnitRec& r = s_->units[u];
  if (r.home == Tier::kHost) {
    std::memcpy(host, r.host_params.data(), r.home_bytes);
    return Status::ok();
  }
  STRATA_RETURN_IF_ERROR(State::check_written(r));
  return read_chunks(*s_->store, r.nvme_keys, s_->options.nvme_chunk_elements * sizeof(float), host, r.home_bytes);
}

bool Coordinator::sharded() const { return s_->sharded(); }

ShardRange Coordinator::shard(size_t u) const { return s_->units[u].shard; }

void Coordinator::drop_device_params() {
  for (State::UnitRec& r : s_->units) {
    STRATA_ASSERT_MSG(r.in_use == 0, "drop_device_params with a unit between acquire and release");
    s_->drop_params(r);
  }
}

Status Coordinator::read_params(size_t u, float* host) {
  STRATA_ASSERT(u < s_->units.size());
  State::UnitRec& r = s_->units[u];
  if (!r.info.present)
    return Status::internal("offload: unit '{}' belongs to another pipeline stage", r.info.name);
  if (s_->sharded()) {  // every rank's shard, gathered in order with the other collectives
    const size_t ranks = static_cast<size_t>(s_->group->size());
    std::vector<float> mine(r.shard.stride, 0.0f), all(ranks * r.shard.stride);
    // A failed read still takes part in the gather (the ranks' collectives must stay paired), then fails.
    const Status read = read_shard(u, mine.data());
    comm::Communicator* g = s_->group;
    const Status gathered =
        s_->collectives->submit([&] { return g->all_gather(mine.data(), all.data(), mine.size(), DType::kF32); })
            .wait();
    STRATA_RETURN_IF_ERROR(gathered.with_context("offload: gathering unit '" + r.info.name + "'"));
    STRATA_RETURN_IF_ERROR(read);
    std::memcpy(host, all.data(), r.bytes);
    return Status::ok();
  }
  // A load in flight ends first. One that failed (a prefetch's, whose error waits for the unit's acquire) left
  // no device copy: forgotten, and the home copy read below.
  if (!r.params_ready.wait().is_ok()) s_->drop_failed_params(r);
  s_->drop_partial(r);
  if (r.home == Tier::kNvme && !r.home_stale) {
    STRATA_RETURN_IF_ERROR(State::check_written(r));
    if (Status written = State::wait_home_writes(r); !written.is_ok()) {
      // A write home failed while the device copy has the same values: read those, and write them home
      // when the copy is evicted. Without a device copy the values are lost here: the error says which.
      if (r.dev_params.data() == nullptr) return written;
      STRATA_LOG_WARN("offload: {}; reading the device copy, which goes home when evicted", written.to_string());
      r.home_stale = true;
    }
  }
  if (r.home == Tier::kHost) {
    std::memcpy(host, r.host_params.data(), r.bytes);
  } else if (r.home == Tier::kNvme && !r.home_stale) {
    STRATA_RETURN_IF_ERROR(
        read_chunks(*s_->store, r.nvme_keys, s_->options.nvme_chunk_elements * sizeof(float), host, r.bytes));
  } else {
    s_->device.fence().wait();
    s_->device.download(host, r.dev_params.data(), r.bytes);
  }
  return Status::ok();
}

void Coordinator::set_params_pending(std::function<bool(size_t unit)> fn) { s_->params_pending = std::move(fn); }

void Coordinator::begin_step() {
  State& s = *s_;
  if (s.recording && !s.trace.empty()) s.recording = false;  // the first full step is the trace
  s.pos = 0;
  (void)s.prefetch();  // failures resurface in acquire, which waits for the same tickets
}

Result<UnitView> Coordinator::acquire(size_t u, Pass pass) {
  STRATA_ASSERT(u < s_->units.size());
  STRATA_ASSERT_MSG(s_->units[u].info.present, "acquire of another pipeline stage's unit");
  State& s = *s_;
  State::UnitRec& r = s.units[u];
  if (before_use_) {
    s.acquiring = uses_grads(pass) ? SIZE_MAX : u;
    const Status published = before_use_(s.acquiring);
    s.acquiring = SIZE_MAX;
    STRATA_RETURN_IF_ERROR(published);
  }
  s.drop_partial(r);  // a publication that stopped half-way: the unit loads from home
  s.record(Access{u, pass});
  r.last_access = ++s.clock;
  ++r.in_use;  // protects it from the evictions below
  const GradState grads_before = r.grad_state;
  auto fail = [&](Status st) {
    --r.in_use;
    // The kernels never ran: the gradient is where it was (a device copy brought in stays valid for kZero and
    // kBoth; kHost re-checks its upload next time).
    if (r.grad_state == GradState::kDevice && grads_before != GradState::kDevice) r.grad_state = grads_before;
    return st;
  };
  UnitView view;
  if (uses_params(pass)) {
    if (r.dev_params.data() == nullptr) {
      if (auto loaded = s.load_params(u, 0); !loaded.is_ok()) return fail(loaded.status());
    } else if (!r.persistent) {
      ++s.stats.prefetch_hits;
    }
  }
  if (uses_grads(pass)) {
    r.grad_sumsq_valid = false;
    switch (r.grad_state) {
      case GradState::kDevice:
        break;
      case GradState::kBoth:  // the kernels are about to change the copy being downloaded
        if (Status st = s.wait_ticket(r.grads_download, r, "bringing gradients home"); !st.is_ok()) return fail(st);
        r.grad_state = GradState::kDevice;
        break;
      case GradState::kZero: {
        if (r.dev_grads.data() == nullptr) {
          auto slot = s.obtain(u, r.slot_bytes, 0, "gradients");
          if (!slot.is_ok()) return fail(slot.status());
          Timer wait;
          wait_all(slot->after);  // jobs that used the slot before
          s.stats.stall_s += wait.seconds();
          r.dev_grads = std::move(slot->buf);
        } else {
          // The stale copy's last reader; the zeros replace it anyway.
          (void)(s.sharded() ? r.grads_reduce : r.grads_download).wait();
        }
        s.device.zero(r.dev_grads.data(), r.slot_bytes);  // in order with the kernels (and a shard's padding)
        r.grad_state = GradState::kDevice;
        break;
      }
      case GradState::kHost:
        if (r.dev_grads.data() == nullptr) {
          if (auto loaded = s.load_grads(u, 0); !loaded.is_ok()) return fail(loaded.status());
        }
        if (Status st = s.wait_ticket(r.grads_ready, r, "loading gradients"); !st.is_ok()) {
          // The copy never arrived: give the buffer back so the next acquire uploads again.
          s.to_spare(std::move(r.dev_grads), r.grads_last_use, {r.grads_ready});
          r.grads_ready = CopyTicket();
          return fail(st);
        }
        r.grads_ready = CopyTicket();
        r.grad_state = GradState::kDevice;
        break;
    }
    view.grads = r.dev_grads.as<float>();
  }
  // A prefetch that fails is reported by the acquire of the unit it was for, not this one.
  if (Status st = s.prefetch(); !st.is_ok()) STRATA_LOG_DEBUG("offload: prefetch: {}", st.to_string());
  if (uses_params(pass)) {
    if (Status st = s.wait_ticket(r.params_ready, r, "loading parameters"); !st.is_ok()) {
      s.drop_failed_params(r);
      return fail(st);
    }
    view.params = r.dev_params.as<float>();
  }
  return view;
}

void Coordinator::release(size_t u, Pass pass) {
  STRATA_ASSERT(u < s_->units.size());
  State& s = *s_;
  State::UnitRec& r = s.units[u];
  STRATA_ASSERT_MSG(r.in_use > 0, "release without acquire");
  --r.in_use;
  const kernels::DeviceFence fence = s.device.fence();
  if (uses_params(pass)) r.params_last_use = fence;
  if (!uses_grads(pass)) return;
  r.grads_last_use = fence;
  if (r.in_use > 0) return;  // still being added to
  if (s.sharded()) {
    s.reduce_grads(r, fence);
    r.grad_state = GradState::kZero;  // consumed: a later use this step starts from zeros again
    if (s.next_use(true)[u] == kNever || !s.replaying()) s.to_spare(std::move(r.dev_grads), fence, {r.grads_reduce});
    return;
  }
  // A gradient that more backward work adds to stays here until its last release, which sends it home once:
  // this backward's own second use of the tied embedding (whose device copy stayed anyway), and, with the
  // parameters on the device (so the gradients fit beside them, as in plain training), the next micro-batch's
  // (and under a pipeline schedule, whose trace step is the whole schedule, any later use). When device memory
  // runs short, an eviction sends it home early and its next use brings it back.
  const bool used_again = s.replaying() && s.next_use(true)[u] != kNever;
  const bool again_this_backward = used_again && s.step_is_one_pass;
  const bool params_on_device = s.options.param_home == Tier::kDevice && (s.accumulating || used_again);
  if (again_this_backward || params_on_device) {
    r.grad_state = GradState::kDevice;
    return;
  }
  send_grads_home(u, fence);
}

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

Residency Coordinator::residency(size_t u, StateClass what) const {
  const State::UnitRec& r = s_->units[u];
  Residency res;
  if (what == StateClass::kParams) {
    res.home = r.home;
    res.on_device = r.dev_params.data() != nullptr;
    res.on_host = r.home == Tier::kHost;
    res.on_nvme = r.home == Tier::kNvme && !r.home_stale;
    res.dirty = r.home_stale;
  } else {
    STRATA_ASSERT(what == StateClass::kGrads);
    res.home = s_->options.grad_home;
    res.on_device = r.dev_grads.data() != nullptr &&
                    (r.grad_state == GradState::kDevice || r.grad_state == GradState::kBoth);
    res.on_host = r.grad_state == GradState::kHost || (r.grad_state == GradState::kBoth && r.grads_download.done());
    res.dirty = r.grad_state == GradState::kDevice;
  }
  return res;
}


CopyQueueStats Coordinator::collective_stats() const {
  return s_->collectives ? s_->collectives->stats() : CopyQueueStats{};
}

CoordinatorStats Coordinator::take_stats() {
  CoordinatorStats out = s_->stats;
  s_->stats = CoordinatorStats{};
  return out;
}

}  // namespace strata::offload
