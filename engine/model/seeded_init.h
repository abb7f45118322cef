// seeded_init.h — a family's seeded initial weights (a WeightsInit, model.h) of the common form: each tensor of two
// or more dimensions drawn N(0, std), each 1-D tensor a constant (norm weights 1, biases 0), the random numbers
// drawn in the order of the units and of their elements, so a piece (a load through the optimizer) gets exactly
// what the whole unit's fill would give it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "common/rng.h"
#include "common/status.h"
#include "common/tensor.h"
#include "engine/model/model.h"

namespace strata::engine {

class SeededInit : public WeightsInit {
 public:
  // std_of: a drawn tensor's standard deviation; constant_of: a 1-D tensor's value. `family` names it in errors.
  SeededInit(const Model& model, uint64_t seed, std::function<double(const TensorSpec&)> std_of,
             std::function<float(const TensorSpec&)> constant_of, std::string family)
      : model_(model), rng_(seed), std_of_(std::move(std_of)), constant_of_(std::move(constant_of)),
        family_(std::move(family)) {}
  Status fill(size_t unit, size_t offset, std::span<float> dst) override;

 private:
  static bool drawn(const TensorSpec& s) { return s.shape.size() >= 2; }
  // Draws and drops the random numbers of unit unit_'s elements [at_, end) (what fill skips).
  void skip_to(size_t end);

  const Model& model_;
  Rng rng_;
  std::function<double(const TensorSpec&)> std_of_;
  std::function<float(const TensorSpec&)> constant_of_;
  std::string family_;
  size_t unit_ = 0, at_ = 0;  // the next element to make
};

}  // namespace strata::engine
