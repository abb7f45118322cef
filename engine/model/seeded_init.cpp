// A family's seeded initial weights (seeded_init.h).
#include "engine/model/seeded_init.h"

#include <algorithm>

namespace strata::engine {

void SeededInit::skip_to(size_t end) {
  for (const TensorSpec& s : model_.whole_layout(unit_).specs()) {
    const size_t lo = std::max(at_, s.offset), hi = std::min(end, s.offset + s.numel());
    if (!drawn(s) || lo >= hi) continue;
    double u1 = 0, u2 = 0;
    for (size_t j = lo; j < hi; ++j) rng_.normal_uniforms(&u1, &u2);
  }
  at_ = end;
}

Status SeededInit::fill(size_t unit, size_t offset, std::span<float> dst) {
  if (unit >= model_.units().size() || offset > model_.whole_layout(unit).numel() ||
      dst.size() > model_.whole_layout(unit).numel() - offset)
    return Status::internal("{} init: [{}, {}) of unit {} is outside the model", family_, offset,
                            offset + dst.size(), unit);
  if (unit < unit_ || (unit == unit_ && offset < at_))
    return Status::internal("{} init: [{}, {}) of unit {} asked for after element {} of unit {}: pieces come in "
                            "order",
                            family_, offset, offset + dst.size(), unit, at_, unit_);
  for (; unit_ < unit; ++unit_, at_ = 0) skip_to(model_.whole_layout(unit_).numel());
  skip_to(offset);
  const size_t end = offset + dst.size();
  for (const TensorSpec& s : model_.whole_layout(unit).specs()) {
    const size_t lo = std::max(offset, s.offset), hi = std::min(end, s.offset + s.numel());
    if (lo >= hi) continue;
    float* p = dst.data() + (lo - offset);
    if (drawn(s))
      fill_normal(rng_, p, hi - lo, std_of_(s));
    else
      std::fill(p, p + (hi - lo), constant_of_(s));
  }
  at_ = end;
  return Status::ok();
}

}  // namespace strata::engine
