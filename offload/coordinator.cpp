// coordinator.cpp — the Coordinator (coordinator.h): creation, parameters (writes from the optimizer, loads,
// reads back) and the acquire/release protocol. Gradients are coordinator_grads.cpp's.
#include "offload/coordinator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "comm/communicator.h"
#include "common/check.h"
#include "common/log.h"
#include "common/timer.h"
#include "offload/coordinator_state.h"

namespace strata::offload {

namespace {
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
  r.params16_current = false;  // made again from the new parameters at the next acquire
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
    view.params16 = s.working_copy(r);
  }
  return view;
}

void Coordinator::set_working_copies(std::vector<bool> units) {
  STRATA_ASSERT(units.empty() || units.size() == s_->units.size());
  if (s_->device.kernels().weights_to_bf16 == nullptr) units.clear();
  s_->working_copies = std::move(units);
}
bool Coordinator::working_copies() const {
  return std::find(s_->working_copies.begin(), s_->working_copies.end(), true) != s_->working_copies.end();
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
