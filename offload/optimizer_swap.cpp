#include "offload/optimizer_swap.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "common/timer.h"
#include "kernels/cpu/fast.h"

namespace strata::offload {

// One staging slot: master, m and v of one sub-group, each region padded to 4 KiB so all three stay
// page-aligned for O_DIRECT; the batches of its reads and of its writes.
struct OptimizerSwapper::Slot {
  PinnedBuffer buf;
  std::unique_ptr<IoBatch> reads, writes;
  size_t group = SIZE_MAX;  // the sub-group its reads were issued for
  float* region(size_t region_floats, int k) const { return buf.as<float>() + region_floats * k; }
};

namespace {
// Floats per region (master, m or v) of a slot for sub-groups of at most `largest` elements: padded to 4 KiB
// so all three regions stay page-aligned for O_DIRECT.
size_t region_floats(size_t largest) { return (largest * sizeof(float) + 4095) / 4096 * 4096 / sizeof(float); }
}  // namespace

size_t OptimizerSwapper::staging_bytes(size_t largest, const OptimizerSwapOptions& options, bool grads) {
  return static_cast<size_t>(options.slots) * (grads ? 4 : 3) * region_floats(largest) * sizeof(float);
}

OptimizerSwapper::OptimizerSwapper(SwapStore& store, std::vector<OptimizerGroup> groups,
                                   const OptimizerSwapOptions& options)
    : store_(store), groups_(std::move(groups)), options_(options), initialized_(groups_.size(), false) {}

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
                                                     fmt::format("optimizer swap slot {}", i)));
    s->slots_.push_back(std::move(slot));
  }
  return s;
}

OptimizerSwapper::~OptimizerSwapper() {
  for (auto& slot : slots_) {  // nothing may still point into the slots or at the keys
    if (slot->reads) (void)slot->reads->wait();
    if (slot->writes) (void)slot->writes->wait();
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!initialized_[g]) continue;
    for (const char* what : {"master", "m", "v"}) (void)store_.free(key(g, what));
  }
}

std::string OptimizerSwapper::key(size_t g, const char* what) const {
  return options_.key_prefix + groups_[g].name + "." + what;
}

Status OptimizerSwapper::initialize(size_t g, const float* master, const float* m, const float* v) {
  if (g >= groups_.size()) return Status::invalid_argument("optimizer swap: no sub-group {}", g);
  const size_t bytes = groups_[g].numel * sizeof(float);
  Slot& slot = *slots_[0];
  if (slot.writes) STRATA_RETURN_IF_ERROR(slot.writes->wait());
  std::memcpy(slot.region(region_floats_, 0), master, bytes);
  const float* moments[] = {m, v};
  for (int k = 1; k < 3; ++k) {
    if (moments[k - 1] != nullptr) {
      std::memcpy(slot.region(region_floats_, k), moments[k - 1], bytes);
    } else {
      std::memset(slot.region(region_floats_, k), 0, bytes);
    }
  }
  for (int k = 0; k < 3; ++k) {
    static const char* kWhat[] = {"master", "m", "v"};
    STRATA_RETURN_IF_ERROR(store_.write(key(g, kWhat[k]), slot.region(region_floats_, k), bytes));
  }
  initialized_[g] = true;
  return Status::ok();
}

Status OptimizerSwapper::issue_read(size_t g) {
  Slot& slot = *slots_[g % slots_.size()];
  if (slot.writes) {  // the slot's previous sub-group must be on disk before its memory is reused
    Timer t;
    const Status written = slot.writes->wait();
    stats_.write_wait_s += t.seconds();
    slot.writes.reset();
    if (!written.is_ok())
      return written.with_context(fmt::format("optimizer swap: writing sub-group '{}' ({})", groups_[slot.group].name,
                                              key(slot.group, "{master,m,v}")));
  }
  const size_t bytes = groups_[g].numel * sizeof(float);
  slot.reads = std::make_unique<IoBatch>();
  slot.group = g;
  static const char* kWhat[] = {"master", "m", "v"};
  for (int k = 0; k < 3; ++k)
    STRATA_RETURN_IF_ERROR(store_.read(key(g, kWhat[k]), slot.region(region_floats_, k), bytes, slot.reads.get()));
  stats_.bytes_read += 3 * bytes;
  if (!groups_[g].grad_key.empty()) {
    STRATA_RETURN_IF_ERROR(store_.read(groups_[g].grad_key, slot.region(region_floats_, 3), bytes, slot.reads.get()));
    stats_.bytes_read += bytes;
  }
  return Status::ok();
}

Status OptimizerSwapper::step(const std::vector<const float*>& grads, const std::vector<void*>& working,
                              DType working_dtype, const kernels::AdamWParams& hp, const UpdatedFn& on_updated) {
  const size_t n = groups_.size();
  if (working.empty()) working_dtype = DType::kF32;  // no copies to write
  if (grads.size() != n || (working.size() != n && !working.empty()))
    return Status::invalid_argument("optimizer swap: step needs {} gradient and working buffers, got {} and {}", n,
                                    grads.size(), working.size());
  for (size_t g = 0; g < n; ++g) {
    if (!initialized_[g])
      return Status::invalid_argument("optimizer swap: sub-group '{}' was never initialized", groups_[g].name);
  }
  stats_ = OptimizerStepStats{};
  // Whatever happens, no batch may outlive the step with requests into the slots unaccounted for.
  auto drain = [&] {
    for (auto& slot : slots_) {
      if (slot->reads) (void)slot->reads->wait();
      slot->reads.reset();
    }
  };
  if (Status st = issue_read(0); !st.is_ok()) {
    drain();
    return st;
  }
  static const char* kWhat[] = {"master", "m", "v"};
  for (size_t g = 0; g < n; ++g) {
    if (g + 1 < n) {
      if (Status st = issue_read(g + 1); !st.is_ok()) {
        drain();
        return st;
      }
    }
    Slot& slot = *slots_[g % slots_.size()];
    Timer wait;
    const Status arrived = slot.reads->wait();
    stats_.read_wait_s += wait.seconds();
    slot.reads.reset();
    if (!arrived.is_ok()) {
      drain();
      return arrived.with_context(fmt::format("optimizer swap: reading sub-group '{}' ({})", groups_[g].name,
                                              key(g, "{master,m,v}")));
    }
    float* master = slot.region(region_floats_, 0);
    float* m = slot.region(region_floats_, 1);
    float* v = slot.region(region_floats_, 2);
    const float* grad = groups_[g].grad_key.empty() ? grads[g] : slot.region(region_floats_, 3);
    Timer update;
    for (const OptimizerSegment& s : groups_[g].segments) {
      kernels::AdamWParams p = hp;
      p.weight_decay = s.weight_decay;
      uint16_t* w16 = working_dtype == DType::kF32 ? nullptr : static_cast<uint16_t*>(working[g]) + s.offset;
      kernels::cpu::fast::adamw_update_mixed(master + s.offset, m + s.offset, v + s.offset, grad + s.offset, w16,
                                             working_dtype, s.numel, p);
    }
    if (working_dtype == DType::kF32 && !working.empty())
      std::memcpy(working[g], master, groups_[g].numel * sizeof(float));
    stats_.update_s += update.seconds();
    if (on_updated) {
      if (Status st = on_updated(g, master); !st.is_ok()) {
        drain();
        return st;
      }
    }
    const size_t bytes = groups_[g].numel * sizeof(float);
    slot.writes = std::make_unique<IoBatch>();
    for (int k = 0; k < 3; ++k) {
      if (Status st = store_.write(key(g, kWhat[k]), slot.region(region_floats_, k), bytes, slot.writes.get());
          !st.is_ok()) {
        drain();
        return st;
      }
    }
    stats_.bytes_written += 3 * bytes;
  }
  Status result;
  Timer tail;
  for (auto& slot : slots_) {
    if (!slot->writes) continue;
    const Status written = slot->writes->wait();
    slot->writes.reset();
    if (result.is_ok() && !written.is_ok())
      result = written.with_context(fmt::format("optimizer swap: writing sub-group '{}' ({})", groups_[slot->group].name,
                                                key(slot->group, "{master,m,v}")));
  }
  stats_.write_wait_s += tail.seconds();
  return result;
}

Status OptimizerSwapper::read_state(size_t g, float* master, float* m, float* v) {
  if (g >= groups_.size() || !initialized_[g])
    return Status::invalid_argument("optimizer swap: no initialized sub-group {}", g);
  const size_t bytes = groups_[g].numel * sizeof(float);
  float* outs[] = {master, m, v};
  static const char* kWhat[] = {"master", "m", "v"};
  for (int k = 0; k < 3; ++k) {
    if (outs[k] != nullptr) STRATA_RETURN_IF_ERROR(store_.read(key(g, kWhat[k]), outs[k], bytes));
  }
  return Status::ok();
}

}  // namespace strata::offload
