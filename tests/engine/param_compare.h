// param_compare.h — comparing two training runs' parameters in engine tests: every unit's parameters on the host,
// and how far apart two runs' total updates are.
#pragma once

#include <cmath>
#include <vector>

#include "engine/model/gpt2/gpt2.h"
#include "kernels/device.h"

namespace strata::testing {

// Every unit's parameters, in the model's order, copied to the host.
inline std::vector<float> host_params(const engine::GPT2& m) {
  std::vector<float> out;
  for (const engine::Unit& u : m.units()) {
    std::vector<float> h(u.numel());
    m.device().copy_to_host(h.data(), u.p(), h.size() * sizeof(float));
    out.insert(out.end(), h.begin(), h.end());
  }
  return out;
}

// ‖(a − a_init) − (b − b_init)‖ / ‖b − b_init‖: how far run a's total update is from run b's, relative to
// b's.
inline double update_distance(const std::vector<float>& a_init, const std::vector<float>& a,
                              const std::vector<float>& b_init, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double ua = double(a[i]) - a_init[i], ub = double(b[i]) - b_init[i];
    diff += (ua - ub) * (ua - ub);
    norm += ub * ub;
  }
  return std::sqrt(diff / norm);
}

}  // namespace strata::testing
