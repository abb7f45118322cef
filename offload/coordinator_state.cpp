// The Coordinator's state (coordinator_state.h): the slots, eviction, loads, prefetch, and the ZeRO-3 gathers and
// reduce-scatters, out of line.
#include "offload/coordinator_state.h"

namespace strata::offload {

Result<Coordinator::Slot> Coordinator::State::new_slot(size_t bytes, const std::string& what) {
  for (size_t i = 0; i < spares.size(); ++i) {
    if (spares[i].buf.size() == bytes) {
      Slot s = std::move(spares[i]);
      spares.erase(spares.begin() + static_cast<std::ptrdiff_t>(i));
      return s;
    }
  }
  auto got = device.allocate(bytes, kSlotPurpose);
  if (!got.is_ok() && got.status().code() == StatusCode::kOutOfMemory && !spares.empty()) {
    drop_spares();
    got = device.allocate(bytes, kSlotPurpose);
  }
  if (!got.is_ok()) return got.status().with_context(what);
  slot_bytes += bytes;
  return Slot{std::move(got).value(), {}, {}};
}

CopyTicket Coordinator::State::upload(void* dst, const void* src, size_t bytes, kernels::DeviceFence fence,
                                      std::vector<CopyTicket> reuse, std::vector<CopyTicket> after) {
  kernels::Device* dev = &device;
  stats.h2d_bytes += bytes;
  return copies.h2d.submit_settled(
      [dev, dst, src, bytes, fence, reuse](const Status& data) {
        wait_all(reuse);
        fence.wait();
        if (!data.is_ok()) return data;
        dev->upload(dst, src, bytes);
        return Status::ok();
      },
      bytes, std::move(after));
}

Status Coordinator::State::wait_home_writes(UnitRec& r) {
  Status first;
  for (CopyTicket& t : r.chunk_writes) {
    if (Status st = t.wait(); !st.is_ok()) {
      if (first.is_ok()) first = st.with_context(fmt::format("writing unit '{}' home", r.info.name));
    } else {
      t = CopyTicket();
    }
  }
  return first;
}

std::vector<size_t> Coordinator::State::next_use(bool grads) const {
  std::vector<size_t> d(units.size(), kNever);
  if (!replaying()) {
    for (size_t u = 0; u < units.size(); ++u)
      d[u] = std::numeric_limits<size_t>::max() / 2 + static_cast<size_t>(clock - units[u].last_access);
    return d;
  }
  const size_t n = trace.size();
  const size_t horizon = grads ? (pos < n ? n - pos : 0) : n;
  for (size_t k = 1; k <= horizon; ++k) {
    const Access& a = trace[(pos + k - 1) % n];
    if ((grads ? uses_grads(a.pass) : uses_params(a.pass)) && d[a.unit] == kNever) d[a.unit] = k;
  }
  return d;
}

Status Coordinator::State::write_back(UnitRec& r) {
  STRATA_ASSERT(r.home == Tier::kNvme && r.home_stale && r.dev_params.data() != nullptr);
  STRATA_RETURN_IF_ERROR(r.params_ready.wait());
  wait_all(r.chunk_writes);  // overwritten below (a failed one's chunk too)
  device.fence().wait();
  StagingLease staging(&read_staging);
  staging.take();
  float* staged = staging.buf->as<float>();
  device.download(staged, r.dev_params.data(), r.bytes);
  const size_t chunk = options.nvme_chunk_elements;
  for (size_t k = 0, off = 0; off < r.info.numel; ++k, off += chunk) {
    const size_t len = std::min(chunk, r.info.numel - off);
    STRATA_RETURN_IF_ERROR(store->write(r.nvme_keys[k], staged + off, len * sizeof(float))
                               .with_context("offload: writing unit '" + r.info.name + "' home before evicting it"));
    r.chunk_writes[k] = CopyTicket();
  }
  stats.nvme_write_bytes += r.bytes;
  ++stats.write_backs;
  r.home_stale = false;
  return Status::ok();
}

Result<bool> Coordinator::State::evict_one(size_t sooner_than, bool params_only) {
  const std::vector<size_t> pd = next_use(false), gd = next_use(true);
  size_t best = SIZE_MAX, best_d = 0;
  bool best_grads = false;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitRec& r = units[u];
    if (r.in_use > 0) continue;
    if (r.dev_params.data() != nullptr && !r.persistent && !r.resident && pd[u] > sooner_than &&
        (best == SIZE_MAX || pd[u] > best_d)) {
      best = u, best_d = pd[u], best_grads = false;
    }
    const bool grads_movable = r.grad_state != GradState::kDevice || send_grads_home != nullptr;
    if (!params_only && r.dev_grads.data() != nullptr && grads_movable && gd[u] > sooner_than &&
        (best == SIZE_MAX || gd[u] > best_d)) {
      best = u, best_d = gd[u], best_grads = true;
    }
  }
  if (best == SIZE_MAX) return false;
  UnitRec& r = units[best];
  if (best_grads) {
    if (r.grad_state == GradState::kDevice) send_grads_home(best, r.grads_last_use);  // now kBoth or kHost
    if (r.dev_grads.data() == nullptr) {  // send_grads_home gave it back already
      ++stats.evictions;
      return true;
    }
    if (r.grad_state == GradState::kBoth) r.grad_state = GradState::kHost;
    drop_device_grads(r);
  } else {
    if (r.home_stale) STRATA_RETURN_IF_ERROR(write_back(r));
    give_back_params(r);  // one being assembled: the pieces written so far went home too, and the rest will
  }
  ++stats.evictions;
  return true;
}

Result<Coordinator::Slot> Coordinator::State::obtain(size_t u, size_t bytes, size_t sooner_than, const char* what) {
  const std::string ctx = fmt::format("device copy of {} of unit '{}'", what, units[u].info.name);
  for (;;) {
    auto s = new_slot(bytes, ctx);
    if (s.is_ok() || s.status().code() != StatusCode::kOutOfMemory) return s;
    STRATA_ASSIGN_OR_RETURN(const bool evicted, evict_one(sooner_than));
    if (!evicted) {
      size_t resident_bytes = 0;  // ZeRO-3 units under the persistence threshold, which are never evicted
      for (const UnitRec& r : units) resident_bytes += r.resident && r.dev_params.data() != nullptr ? r.slot_bytes : 0;
      const std::string resident =
          resident_bytes == 0 ? std::string()
                              : fmt::format(", {} MiB of them units under zero_optimization."
                                            "stage3_param_persistence_threshold, never evicted (lower it)",
                                            resident_bytes >> 20);
      return Status::out_of_memory("{}: the device budget cannot hold the working set ({} MiB in offload slots{}, "
                                   "{} units in use); {}",
                                   ctx, slot_bytes >> 20, resident, in_use_units(), s.status().message());
    }
  }
}

CopyTicket Coordinator::State::fetch_from_nvme(SwapStore* st, const std::vector<std::string>& keys, size_t bytes,
                                               void* dst, kernels::DeviceFence fence, std::vector<CopyTicket> reuse,
                                               std::vector<CopyTicket> after) {
  auto staging = std::make_shared<StagingLease>(&read_staging);
  const size_t chunk = options.nvme_chunk_elements * sizeof(float);
  CopyTicket read = copies.nvme.submit(
      [staging, st, keys, chunk, bytes] {
        staging->take();
        return read_chunks(*st, keys, chunk, staging->buf->data(), bytes);
      },
      bytes);
  stats.nvme_read_bytes += bytes;
  after.push_back(read);
  kernels::Device* dev = &device;
  stats.h2d_bytes += bytes;
  return copies.h2d.submit_settled(
      [dev, dst, staging, bytes, fence, reuse](const Status& data) mutable {
        wait_all(reuse);
        fence.wait();
        if (data.is_ok()) dev->upload(dst, staging->buf->data(), bytes);
        staging.reset();
        return data;
      },
      bytes, std::move(after));
}

Result<std::optional<Coordinator::Slot>> Coordinator::State::params_slot(size_t u, size_t sooner_than) {
  UnitRec& r = units[u];
  const bool demand = sooner_than == 0;
  STRATA_ASSERT(r.dev_params.data() == nullptr && !r.persistent);
  while (live(r) > 0 && live_elements + live(r) > options.max_live_elements) {
    STRATA_ASSIGN_OR_RETURN(const bool evicted, evict_one(sooner_than, /*params_only=*/true));
    if (!evicted) break;  // demand loads go over the soft cap, not fail
  }
  if (!demand && live(r) > 0 && live_elements + live(r) > options.max_live_elements) return std::optional<Slot>();
  auto slot = obtain(u, r.slot_bytes, sooner_than, "parameters");
  if (!slot.is_ok()) {
    if (!demand && slot.status().code() == StatusCode::kOutOfMemory) return std::optional<Slot>();
    return slot.status();
  }
  return std::optional<Slot>(std::move(slot).value());
}

Result<bool> Coordinator::State::load_params(size_t u, size_t sooner_than) {
  UnitRec& r = units[u];
  STRATA_RETURN_IF_ERROR(check_written(r));
  STRATA_ASSIGN_OR_RETURN(std::optional<Slot> room, params_slot(u, sooner_than));
  if (!room) return false;
  Slot s = std::move(*room);
  void* dst = s.buf.data();
  if (sharded()) {
    r.params_ready = gather_params(r, s);
  } else if (r.home == Tier::kHost) {
    r.params_ready = upload(dst, r.host_params.data(), r.bytes, s.fence, std::move(s.after));
  } else {
    STRATA_ASSERT(r.home == Tier::kNvme);
    r.params_ready = fetch_from_nvme(store, r.nvme_keys, r.bytes, dst, s.fence, std::move(s.after), r.chunk_writes);
  }
  r.params_home_read = r.params_ready;
  ++stats.fetches;
  r.dev_params = std::move(s.buf);
  live_elements += live(r);
  return true;
}

CopyTicket Coordinator::State::gather_params(UnitRec& r, Slot& s) {
  std::shared_ptr<StagingLease> staging;
  CopyTicket read;
  if (r.home == Tier::kNvme) {
    staging = std::make_shared<StagingLease>(&read_staging);
    const size_t chunk = options.nvme_chunk_elements * sizeof(float);
    read = copies.nvme.submit(
        [staging, st = store, keys = r.nvme_keys, chunk, bytes = r.home_bytes] {
          staging->take();
          return read_chunks(*st, keys, chunk, staging->buf->data(), bytes);
        },
        r.home_bytes);
    stats.nvme_read_bytes += r.home_bytes;
  }
  stats.gather_bytes += r.slot_bytes;
  return collectives->submit(
      [g = group, dst = s.buf.data(), home = r.host_params.data(), staging, read, stride = r.shard.stride,
       fence = s.fence, reuse = std::move(s.after)]() mutable {
        wait_all(reuse);
        fence.wait();
        // The collective runs whatever became of this rank's read, so the ranks stay in step; a failed read
        // fails the job after it.
        const Status got = read.wait();
        const Status gathered = g->all_gather(staging ? staging->buf->data() : home, dst, stride, DType::kF32);
        staging.reset();
        return got.is_ok() ? gathered : got;
      },
      r.slot_bytes);
}

void Coordinator::State::reduce_grads(UnitRec& r, kernels::DeviceFence fence) {
  const bool first = !r.grads_reduced;
  r.grads_reduced = true;
  stats.reduce_bytes += r.slot_bytes;
  if (options.grad_home == Tier::kNvme) return reduce_grads_to_nvme(r, fence, first);
  r.grads_reduce = r.grads_download = collectives->submit(
      [g = group, src = r.dev_grads.data(), home = r.host_grads.as<float>(), scratch = reduce_scratch.as<float>(),
       stride = r.shard.stride, len = r.shard.len, first, fence] {
        fence.wait();
        STRATA_RETURN_IF_ERROR(g->reduce_scatter(src, first ? home : scratch, stride, DType::kF32,
                                                 comm::ReduceOp::kSum));
        if (!first) {
          for (size_t i = 0; i < len; ++i) home[i] += scratch[i];
        }
        return Status::ok();
      },
      r.slot_bytes);
}

void Coordinator::State::reduce_grads_to_nvme(UnitRec& r, kernels::DeviceFence fence, bool first) {
  auto staging = std::make_shared<StagingLease>(&write_staging);
  r.grads_reduce = collectives->submit(
      [g = group, src = r.dev_grads.data(), staging, stride = r.shard.stride, fence] {
        staging->take();
        fence.wait();
        return g->reduce_scatter(src, staging->buf->data(), stride, DType::kF32, comm::ReduceOp::kSum);
      },
      r.slot_bytes);
  const size_t bytes = r.home_bytes;
  if (!first) stats.nvme_read_bytes += bytes;
  stats.nvme_write_bytes += bytes;
  r.grads_download = grad_io->submit(
      [st = grad_store, keys = r.grad_keys, chunk = options.nvme_chunk_elements * sizeof(float), bytes,
       sum = reduce_scratch.as<float>(), lo = r.shard.lo, excluded = &r.info.norm_excluded, sumsq = &r.grad_sumsq,
       staging, first]() mutable {
        *sumsq = std::numeric_limits<double>::quiet_NaN();
        float* part = staging->buf->as<float>();
        const size_t len = bytes / sizeof(float);
        if (!first) {
          STRATA_RETURN_IF_ERROR(read_chunks(*st, keys, chunk, sum, bytes)
                                     .with_context("offload: reading this rank's gradient shard to add to it"));
          for (size_t i = 0; i < len; ++i) part[i] = sum[i] + part[i];
        }
        STRATA_RETURN_IF_ERROR(write_chunks(*st, keys, chunk, part, bytes)
                                   .with_context("offload: writing this rank's gradient shard"));
        *sumsq = sum_squares_excluding(part, lo, len, *excluded, [](const float* x, size_t n) {
          return kernels::cpu::fast::add_sum_squares(0.0, x, n);
        });
        staging.reset();
        return Status::ok();
      },
      bytes, {r.grads_reduce, r.grads_download});
}

Status Coordinator::State::write_zero_grads(UnitRec& r) {
  const size_t chunk = options.nvme_chunk_elements;
  const std::vector<float> zeros(std::min(chunk, r.shard.len), 0.0f);
  for (size_t k = 0; k < r.grad_keys.size(); ++k) {
    const size_t len = std::min(chunk, r.shard.len - k * chunk);
    STRATA_RETURN_IF_ERROR(grad_store->write(r.grad_keys[k], zeros.data(), len * sizeof(float))
                               .with_context("offload: zeroing the gradient of unit '" + r.info.name + "'"));
  }
  stats.nvme_write_bytes += r.home_bytes;
  r.grad_sumsq = 0.0;
  return Status::ok();
}

Result<bool> Coordinator::State::load_grads(size_t u, size_t sooner_than) {
  UnitRec& r = units[u];
  STRATA_ASSERT(r.grad_state == GradState::kHost && r.dev_grads.data() == nullptr);
  auto slot = obtain(u, r.bytes, sooner_than, "gradients");
  if (!slot.is_ok()) {
    if (sooner_than != 0 && slot.status().code() == StatusCode::kOutOfMemory) return false;
    return slot.status();
  }
  Slot s = std::move(slot).value();
  // The home copy is valid once its download (and write) succeeded: a data prerequisite.
  r.grads_ready =
      options.grad_home == Tier::kNvme
          ? fetch_from_nvme(grad_store, r.grad_keys, r.bytes, s.buf.data(), s.fence, std::move(s.after),
                            {r.grads_download})
          : upload(s.buf.data(), r.host_grads.data(), r.bytes, s.fence, std::move(s.after), {r.grads_download});
  r.grads_home_read = r.grads_ready;
  r.dev_grads = std::move(s.buf);
  return true;
}

Status Coordinator::State::prefetch() {
  if (!replaying()) return Status::ok();
  const size_t n = trace.size();
  size_t window = 0;
  std::vector<bool> seen(units.size(), false);
  for (size_t k = 1; k <= n; ++k) {
    const size_t at = (pos + k - 1) % n;
    const Access& a = trace[at];
    UnitRec& r = units[a.unit];
    if (uses_params(a.pass) && !r.persistent && !seen[a.unit]) {
      seen[a.unit] = true;
      window += r.info.numel;
      if (window > options.prefetch_elements && k > 1) break;
      // A forward publishes a pending update of its unit first (the before_use hook).
      const bool replaced_soon =
          a.pass == Pass::kForward && r.home == Tier::kNvme && params_pending && params_pending(a.unit);
      if (r.dev_params.data() == nullptr && !replaced_soon) {
        STRATA_ASSIGN_OR_RETURN(bool queued, load_params(a.unit, k));
        if (!queued) break;
      }
    }
    const bool same_step = pos + k - 1 < n;
    if (same_step && uses_grads(a.pass) && r.grad_state == GradState::kHost && r.dev_grads.data() == nullptr) {
      STRATA_ASSIGN_OR_RETURN(bool queued, load_grads(a.unit, k));
      if (!queued) break;
    }
  }
  return Status::ok();
}

void Coordinator::State::record(const Access& a) {
  if (replaying()) {
    if (pos < trace.size() && trace[pos] == a) {
      ++pos;
      return;
    }
    ++stats.retraces;
    STRATA_LOG_INFO("offload: unit access order changed at access {} ('{}'); re-recording the trace", pos,
                    units[a.unit].info.name);
    trace.resize(std::min(pos, trace.size()));
    recording = true;
  }
  trace.push_back(a);
  pos = trace.size();
}

const uint16_t* Coordinator::State::working_copy(UnitRec& r) {
  const size_t u = static_cast<size_t>(&r - units.data());
  if (working_copies.empty() || !working_copies[u] || !r.persistent || r.info.numel == 0) return nullptr;
  if (r.dev_params16.data() == nullptr) {
    if (working_copies_refused) return nullptr;
    auto b = device.allocate(r.info.numel * sizeof(uint16_t), "offload.params16 " + r.info.name);
    if (!b.is_ok()) {
      STRATA_LOG_WARN("offload: no room for the bf16 working copy of unit '{}' in the device budget ({}): the "
                      "linears of it and of the units after it round their weights to bf16 at every use instead",
                      r.info.name, b.status().message());
      working_copies_refused = true;
      return nullptr;
    }
    r.dev_params16 = std::move(b).value();
    r.params16_current = false;
  }
  if (!r.params16_current) {
    device.kernels().weights_to_bf16(r.dev_params16.as<uint16_t>(), r.dev_params.as<float>(), r.info.numel);
    r.params16_current = true;
    ++stats.working_copies;
  }
  return r.dev_params16.as<uint16_t>();
}

Status Coordinator::State::wait_ticket(const CopyTicket& t, const UnitRec& r, const char* what) {
  Timer timer;
  Status s;
  if (t.done()) {
    s = t.wait();
  } else {
    trace::Span span("stall", static_cast<int64_t>(&r - units.data()));
    s = t.wait();
  }
  stats.stall_s += timer.seconds();
  if (!s.is_ok()) return s.with_context(fmt::format("{} of unit '{}'", what, r.info.name));
  return Status::ok();
}

}  // namespace strata::offload
