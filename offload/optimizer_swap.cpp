#include "offload/optimizer_swap.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "common/check.h"
#include "common/timer.h"
#include "common/trace.h"
#include "kernels/cpu/fast.h"

namespace strata::offload {

// One staging slot: master, m and v of one sub-group (and its gradient, when read from a key), each region
// padded to 4 KiB so all stay page-aligned for O_DIRECT; the batch of its reads, and one batch per region of
// its writes, so that a region is read into again as soon as its own write is done.
struct OptimizerSwapper::Slot {
  PinnedBuffer buf;
  std::unique_ptr<IoBatch> reads;
  std::unique_ptr<IoBatch> writes[3];  // master, m, v of `written`
  size_t group = SIZE_MAX;             // the sub-group its reads were issued for
  size_t written = SIZE_MAX;           // the sub-group whose writes are in flight (SIZE_MAX: none)
  int regions_read = 0;                // of `group`'s master, m, v: how many reads are issued
  Status write_error;                  // the first failed write of `written`
  float* region(size_t region_floats, int k) const { return buf.as<float>() + region_floats * k; }
  bool region_free(int k) const { return !writes[k] || writes[k]->done(); }
};

namespace {
// A slot's regions, and the state each sub-group keeps under a key of its own in the store.
constexpr const char* kRegionName[] = {"master", "m", "v"};
// Floats per region (master, m or v) of a slot for sub-groups of at most `largest` elements: padded to 4 KiB
// so all three regions stay page-aligned for O_DIRECT.
size_t region_floats(size_t largest) { return (largest * sizeof(float) + 4095) / 4096 * 4096 / sizeof(float); }
}  // namespace

size_t OptimizerSwapper::staging_bytes(size_t largest, const OptimizerSwapOptions& options, bool grads) {
  return static_cast<size_t>(options.slots) * (grads ? 4 : 3) * region_floats(largest) * sizeof(float);
}

OptimizerSwapper::OptimizerSwapper(SwapStore& store, std::vector<OptimizerGroup> groups,
                                   const OptimizerSwapOptions& options)
    : store_(store),
      groups_(std::move(groups)),
      options_(options),
      initialized_(groups_.size(), false),
      version_(groups_.size(), 0),
      pending_(groups_.size(), false),
      in_step_(groups_.size(), false) {}

Result<std::unique_ptr<OptimizerSwapper>> OptimizerSwapper::create(SwapStore& store, PinnedPool& pool,
                                                                   std::vector<OptimizerGroup> groups,
                                                                   const OptimizerSwapOptions& options) {
  if (groups.empty()) return Status::invalid_argument("optimizer swap: no sub-groups");
  if (options.slots < 2) return Status::invalid_argument("optimizer swap: slots must be >= 2, got {}", options.slots);
  std::set<std::string> names;
  size_t largest = 0;
  for (const OptimizerGroup& g : groups) {
    if (g.numel == 0) return Status::invalid_argument("optimizer swap: sub-group '{}' is empty", g.name);
    if (!names.insert(g.name).second)
      return Status::invalid_argument("optimizer swap: two sub-groups are named '{}'", g.name);
    size_t at = 0;
    for (const OptimizerSegment& s : g.segments) {
      if (s.offset != at || s.numel == 0)
        return Status::invalid_argument("optimizer swap: sub-group '{}': segments must tile it in order; one "
                                        "starts at {} where {} was expected",
                                        g.name, s.offset, at);
      at += s.numel;
    }
    if (at != g.numel)
      return Status::invalid_argument("optimizer swap: sub-group '{}': segments cover {} of {} elements", g.name, at,
                                      g.numel);
    largest = std::max(largest, g.numel);
  }
  const bool grads = std::any_of(groups.begin(), groups.end(), [](const OptimizerGroup& g) { return !g.grad_key.empty(); });
  std::unique_ptr<OptimizerSwapper> s(new OptimizerSwapper(store, std::move(groups), options));
  s->region_floats_ = region_floats(largest);
  s->regions_ = grads ? 4 : 3;
  for (int i = 0; i < options.slots; ++i) {
    auto slot = std::make_unique<Slot>();
    STRATA_ASSIGN_OR_RETURN(slot->buf, pool.try_acquire(s->regions_ * s->region_floats_ * sizeof(float),
                                                     fmt::format("offload.optimizer swap slot {}", i)));
    s->slots_.push_back(std::move(slot));
  }
  return s;
}

OptimizerSwapper::~OptimizerSwapper() {
  for (auto& slot : slots_) {  // nothing may still point into the slots or at the keys
    if (slot->reads) (void)slot->reads->wait();
    for (auto& w : slot->writes) {
      if (w) (void)w->wait();
    }
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    free_version(g, 0);
    free_version(g, 1);
  }
}

std::string OptimizerSwapper::key(size_t g, const char* what, int version) const {
  return fmt::format("{}{}.{}@{}", options_.key_prefix, groups_[g].name, what, version);
}

void OptimizerSwapper::free_version(size_t g, int version) {
  for (const char* what : {"master", "m", "v"}) {
    if (store_.contains(key(g, what, version))) (void)store_.free(key(g, what, version));
  }
}

void OptimizerSwapper::promote(size_t g) {
  free_version(g, version_[g]);
  version_[g] ^= 1;
}

size_t OptimizerSwapper::pending() const { return static_cast<size_t>(std::count(pending_.begin(), pending_.end(), true)); }

Status OptimizerSwapper::commit() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!pending_[g]) continue;
    promote(g);
    pending_[g] = false;
  }
  return Status::ok();
}

void OptimizerSwapper::rollback() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!pending_[g]) continue;
    free_version(g, version_[g] ^ 1);
    pending_[g] = false;
  }
}

Status OptimizerSwapper::initialize(size_t g, const float* master, const float* m, const float* v) {
  const size_t bytes = g < groups_.size() ? groups_[g].numel * sizeof(float) : 0;
  return initialize(g, [&](float* master_dst, float* m_dst, float* v_dst) {
    std::memcpy(master_dst, master, bytes);
    const float* from[] = {m, v};
    float* to[] = {m_dst, v_dst};
    for (int k = 0; k < 2; ++k) {
      if (from[k] != nullptr) {
        std::memcpy(to[k], from[k], bytes);
      } else {
        std::memset(to[k], 0, bytes);
      }
    }
    return Status::ok();
  });
}

Status OptimizerSwapper::initialize(size_t g, const FillFn& fill) {
  if (g >= groups_.size()) return Status::invalid_argument("optimizer swap: no sub-group {}", g);
  // New contents replace whatever a step left undecided; they are written as the other version, which becomes
  // current once all three keys are written (a refused write leaves the state as it was). The staging slot's
  // writes finish first: were they g's, they would otherwise land in the version freed here.
  Slot& slot = *slots_[0];
  STRATA_RETURN_IF_ERROR(finish_writes(slot));
  STRATA_RETURN_IF_ERROR(fill(slot.region(region_floats_, 0), slot.region(region_floats_, 1),
                              slot.region(region_floats_, 2)));
  const int next = version_[g] ^ 1;
  free_version(g, next);
  pending_[g] = false;
  const size_t bytes = groups_[g].numel * sizeof(float);
  for (int k = 0; k < 3; ++k) {
    if (Status st = store_.write(key(g, kRegionName[k], next), slot.region(region_floats_, k), bytes); !st.is_ok()) {
      free_version(g, next);
      return st;
    }
  }
  promote(g);
  initialized_[g] = true;
  return Status::ok();
}

void OptimizerSwapper::wait_write(Slot& slot, int k) {
  if (!slot.writes[k]) return;
  Status written;
  if (slot.writes[k]->done()) {
    written = slot.writes[k]->wait();
  } else {
    trace::Span span("waiting for a write", static_cast<int64_t>(slot.written));
    Timer t;
    written = slot.writes[k]->wait();
    stats_.write_wait_s += t.seconds();
  }
  slot.writes[k].reset();
  if (slot.write_error.is_ok()) slot.write_error = std::move(written);
}

Status OptimizerSwapper::finish_writes(Slot& slot) {
  if (slot.written == SIZE_MAX) return Status::ok();
  for (int k = 0; k < 3; ++k) wait_write(slot, k);
  const size_t g = slot.written;
  slot.written = SIZE_MAX;
  if (Status written = std::exchange(slot.write_error, Status::ok()); !written.is_ok()) {
    // The old version stays; what was written of the new one goes, so that a retry or a restart from a
    // checkpoint (initialize) finds the store as it was.
    free_version(g, version_[g] ^ 1);
    return written.with_context(fmt::format("optimizer swap: writing sub-group '{}' ({})", groups_[g].name,
                                            key(g, "{master,m,v}", version_[g] ^ 1)));
  }
  if (keep_old_) {
    pending_[g] = true;
  } else {
    promote(g);
  }
  return Status::ok();
}

Result<bool> OptimizerSwapper::issue_read(size_t g, size_t s, bool block) {
  Slot& slot = *slots_[s];
  const size_t bytes = groups_[g].numel * sizeof(float);
  if (slot.group != g || !slot.reads) {  // a new sub-group for this slot (else: the rest of its regions)
    slot.reads = std::make_unique<IoBatch>();
    slot.group = g;
    slot.regions_read = 0;
    if (!groups_[g].grad_key.empty()) {  // a region nothing writes
      STRATA_RETURN_IF_ERROR(
          store_.read(groups_[g].grad_key, slot.region(region_floats_, 3), bytes, slot.reads.get()));
      stats_.bytes_read += bytes;
    }
  }
  // The slot's previous sub-group must be on disk before its memory is reused, but only region by region: the
  // read of the master weights overlaps the writes of the moments.
  for (int& k = slot.regions_read; k < 3; ++k) {
    if (!block && !slot.region_free(k)) return false;
    wait_write(slot, k);
    if (!slot.write_error.is_ok()) return finish_writes(slot);  // the error, naming the sub-group written
    STRATA_RETURN_IF_ERROR(store_.read(key(g, kRegionName[k]), slot.region(region_floats_, k), bytes, slot.reads.get()));
    stats_.bytes_read += bytes;
  }
  STRATA_RETURN_IF_ERROR(finish_writes(slot));  // every region is written: the new version is current
  return true;
}

Status OptimizerSwapper::step(const std::vector<const float*>& grads, const std::vector<void*>& working,
                              DType working_dtype, const kernels::AdamWParams& hp, const UpdatedFn& on_updated,
                              const StepPlan& plan) {
  const size_t n = groups_.size();
  if (working.empty()) working_dtype = DType::kF32;  // no copies to write
  if (grads.size() != n || (working.size() != n && !working.empty()))
    return Status::invalid_argument("optimizer swap: step needs {} gradient and working buffers, got {} and {}", n,
                                    grads.size(), working.size());
  for (size_t g = 0; g < n; ++g) {
    if (!initialized_[g])
      return Status::invalid_argument("optimizer swap: sub-group '{}' was never initialized", groups_[g].name);
  }
  if (const size_t p = pending(); p > 0)
    return Status::invalid_argument("optimizer swap: {} sub-group(s) still pending from the last step: commit() or "
                                    "rollback() first",
                                    p);
  stats_ = OptimizerStepStats{};
  keep_old_ = plan.keep_old;
  std::fill(in_step_.begin(), in_step_.end(), false);
  size_t in_order = 0;
  auto next = [&](bool wait) -> Result<size_t> {
    size_t g = in_order < n ? in_order++ : kEnd;
    if (plan.next) {
      STRATA_ASSIGN_OR_RETURN(g, plan.next(wait));
    }
    if (g == kNotYet && wait) return Status::internal("optimizer swap: the step's plan did not wait for a sub-group");
    if (g == kEnd || g == kNotYet) return g;
    if (g >= n) return Status::invalid_argument("optimizer swap: the step's plan names sub-group {} of {}", g, n);
    if (in_step_[g])
      return Status::invalid_argument("optimizer swap: the step's plan names sub-group '{}' twice", groups_[g].name);
    in_step_[g] = true;
    return g;
  };
  // Whatever happens, no batch may outlive the step with requests into the slots unaccounted for; writes that
  // completed count (committed, or pending with keep_old).
  auto drain = [&](const Status& st) {
    for (auto& slot : slots_) {
      if (slot->reads) (void)slot->reads->wait();
      slot->reads.reset();
      (void)finish_writes(*slot);
    }
    return st;
  };
  // Reads run one position ahead of the update (position p's into slot p % slots), so a slot is read again
  // only after its previous sub-group's writes were issued a position earlier, and the on_updated call slots - 2
  // positions after it returned (the header's promise about `master`). Before the step's parameters are known
  // (plan.params), in the first position only, nothing is updated or written yet, so the reads fill every slot
  // while the caller waits for them. A read ahead whose slot is still being written waits until after this
  // position's update: the update never waits for a write that only a later sub-group needs finished.
  const size_t num_slots = slots_.size();
  std::vector<size_t> order;  // the sub-groups the plan named so far, by position
  size_t issued = 0;          // positions whose reads are issued
  bool ended = false;
  auto learn_next = [&](bool wait) -> Status {
    STRATA_ASSIGN_OR_RETURN(const size_t g, next(wait));
    if (g == kEnd) ended = true;
    if (g != kEnd && g != kNotYet) order.push_back(g);
    return Status::ok();
  };
  // Issues the reads of the positions before `upto` that the plan knows; without `block`, stops at a slot region
  // whose write is still in flight (and goes on with that slot the next time).
  auto issue_reads = [&](size_t upto, bool block) -> Status {
    while (issued < upto) {
      if (issued == order.size()) {
        if (ended) break;
        STRATA_RETURN_IF_ERROR(learn_next(false));
        if (issued == order.size()) break;  // the plan does not know the next one yet
      }
      STRATA_ASSIGN_OR_RETURN(const bool all, issue_read(order[issued], issued % num_slots, block));
      if (!all) break;  // the rest of that slot's regions are still being written
      ++issued;
    }
    return Status::ok();
  };
  if (Status st = learn_next(true); !st.is_ok()) return drain(st);
  kernels::AdamWParams step_hp = hp;
  bool have_hp = !plan.params;
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const size_t g = order[pos];
    Slot& slot = *slots_[pos % num_slots];
    if (Status st = issue_reads(pos + 1, /*block=*/true); !st.is_ok()) return drain(st);
    // The next sub-group's state read while this one is updated, as soon as the plan knows which it is; every
    // slot's before the parameters are known.
    if (Status st = issue_reads(have_hp ? pos + 2 : pos + num_slots, /*block=*/false); !st.is_ok()) return drain(st);
    Timer wait;
    Status arrived;
    {
      trace::Span span("waiting for a read", static_cast<int64_t>(g));
      arrived = slot.reads->wait();
    }
    stats_.read_wait_s += wait.seconds();
    slot.reads.reset();
    if (!arrived.is_ok())
      return drain(arrived.with_context(
          fmt::format("optimizer swap: reading sub-group '{}' ({})", groups_[g].name, key(g, "{master,m,v}"))));
    float* master = slot.region(region_floats_, 0);
    float* m = slot.region(region_floats_, 1);
    float* v = slot.region(region_floats_, 2);
    const float* grad = groups_[g].grad_key.empty() ? grads[g] : slot.region(region_floats_, 3);
    if (!have_hp) {  // this sub-group's read, and those of the next ones, are on their way
      Result<kernels::AdamWParams> known = plan.params();
      if (!known.is_ok()) return drain(known.status());
      step_hp = known.value();
      have_hp = true;
    }
    Timer update;
    {
      trace::Span span("adam", static_cast<int64_t>(g));
      for (const OptimizerSegment& sg : groups_[g].segments) {
        kernels::AdamWParams p = step_hp;
        p.weight_decay = sg.weight_decay;
        uint16_t* w16 = working_dtype == DType::kF32 ? nullptr : static_cast<uint16_t*>(working[g]) + sg.offset;
        kernels::cpu::fast::adamw_update_mixed(master + sg.offset, m + sg.offset, v + sg.offset, grad + sg.offset,
                                               w16, working_dtype, sg.numel, p);
      }
      if (working_dtype == DType::kF32 && !working.empty())
        std::memcpy(working[g], master, groups_[g].numel * sizeof(float));
    }
    stats_.update_s += update.seconds();
    if (on_updated) {
      if (Status st = on_updated(g, master); !st.is_ok()) return drain(st);
    }
    const size_t bytes = groups_[g].numel * sizeof(float);
    slot.written = g;
    for (int k = 0; k < 3; ++k) {
      slot.writes[k] = std::make_unique<IoBatch>();
      if (Status st = store_.write(key(g, kRegionName[k], version_[g] ^ 1), slot.region(region_floats_, k), bytes,
                                   slot.writes[k].get());
          !st.is_ok()) {
        slot.write_error = st;  // the new version is incomplete: the old one stays current
        return drain(st);
      }
    }
    stats_.bytes_written += 3 * bytes;
    if (Status st = issue_reads(pos + 2, /*block=*/false); !st.is_ok()) return drain(st);
    if (order.size() == pos + 1 && !ended) {  // the plan did not know the next one yet: wait for it
      if (Status st = learn_next(true); !st.is_ok()) return drain(st);
    }
  }
  Status result;
  for (auto& slot : slots_) {
    const Status written = finish_writes(*slot);
    if (result.is_ok() && !written.is_ok()) result = written;
  }
  return result;
}

Status OptimizerSwapper::read_state(size_t g, float* master, float* m, float* v) {
  if (g >= groups_.size() || !initialized_[g])
    return Status::invalid_argument("optimizer swap: no initialized sub-group {}", g);
  const size_t bytes = groups_[g].numel * sizeof(float);
  float* outs[] = {master, m, v};
  for (int k = 0; k < 3; ++k) {
    if (outs[k] != nullptr) STRATA_RETURN_IF_ERROR(store_.read(key(g, kRegionName[k]), outs[k], bytes));
  }
  return Status::ok();
}

Status OptimizerSwapper::with_master(size_t g, const std::function<Status(const float* master)>& fn) {
  STRATA_ASSIGN_OR_RETURN(const float* master, view_state(g, 0));
  return fn(master);
}

Result<const float*> OptimizerSwapper::view_state(size_t g, int k) {
  if (g >= groups_.size() || !initialized_[g])
    return Status::invalid_argument("optimizer swap: no initialized sub-group {}", g);
  STRATA_ASSERT(k >= 0 && k < 3);
  Slot& slot = *slots_[0];
  STRATA_RETURN_IF_ERROR(finish_writes(slot));
  float* dst = slot.region(region_floats_, k);
  STRATA_RETURN_IF_ERROR(store_.read(key(g, kRegionName[k]), dst, groups_[g].numel * sizeof(float)));
  return static_cast<const float*>(dst);
}

}  // namespace strata::offload
