// optimizer.h — AdamW over a model's units, with global-norm clipping and the learning-rate schedule.
//
// Moments m and v are fp32 flat buffers per unit, in the unit's layout, in the memory of the model's Device. Weight decay applies to tensors whose
// TensorSpec says so (2-D weights), as in GPT-2 training and the PyTorch fixture. One thread drives it; the
// kernels parallelise inside.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/model/unit.h"
#include "engine/parallel/grad_sync.h"
#include "kernels/device.h"
#include "kernels/kernels.h"

namespace strata::engine {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  float grad_clip = 1.0f;  // 0: no clipping
};

// The gradient scale of global-norm clipping (PyTorch's clip_grad_norm_): clip / (norm + 1e-6) when that is
// < 1, else 1; clip 0 turns clipping off. One definition, so every optimizer clips with the same bits.
float clip_scale(double norm, float clip);
// The step's gradient scale from its norm: clip_scale for a finite norm, nothing for a non-finite one (the
// update is skipped). Sets *skipped (when given) to which.
std::optional<float> step_scale(double norm, float clip, bool* skipped);

// The fused update's parameters for one step of `config` (weight decay left 0: it is per tensor).
kernels::AdamWParams adamw_params(const AdamWConfig& config, float lr, int step, float grad_scale);

// Warmup + cosine: linear from lr/warmup to lr over `warmup` steps, then cosine down to min_lr at max_steps.
// `step` is 0-based.
double lr_at(int step, double lr, double min_lr, int warmup, int max_steps);

class PieceState;  // engine/checkpoint/state_pieces.h

// What the trainer and checkpoints need of an optimizer, wherever its state lives: AdamW below keeps it on the
// model's device, OffloadedAdamW (offload/offloaded_adamw.h) in host memory or on NVMe.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of every unit from its gradients with learning rate lr, clipped by global norm first
  // (PyTorch's clip_grad_norm_: scale = clip / (norm + 1e-6) when that is < 1). Returns the pre-clip norm. A
  // non-finite norm skips the update (nothing changes, step count included) and sets *skipped.
  virtual Result<double> step(float lr, bool* skipped) = 0;
  virtual int steps_taken() const = 0;
  virtual void set_steps_taken(int t) = 0;
  // The optimizer's master weights become the model's current parameters and the moments zero (after the
  // model was initialised or its weights loaded).
  virtual Status adopt_params() = 0;
  // Adam's moments of unit i, host fp32 in the unit's layout (checkpoints). write_moments also takes the
  // master weights from the model's current parameters, so load those first.
  virtual Status read_moments(size_t unit, float* m, float* v) = 0;
  virtual Status write_moments(size_t unit, const float* m, const float* v) = 0;
  // The piece-by-piece access to its state that checkpoints use where it lies offloaded
  // (engine/checkpoint/state_pieces.h); null where the state is read with the model's read_params and
  // read_moments.
  virtual PieceState* piece_state() { return nullptr; }
  // Completes an update still running in the background (OffloadedAdamW overlaps it with the next forward);
  // call before reading the parameters other than through the model's own forward (checkpoints).
  virtual Status finish() { return Status::ok(); }
  // The next backward is the step's last micro-batch, and `lr` the learning rate step() will most likely get:
  // OffloadedAdamW may start updating units as their gradients become final (redoing them exactly if step()
  // finds the guess wrong). Optional to call.
  virtual Status begin_last_backward(float lr) {
    (void)lr;
    return Status::ok();
  }
  // The next backward is not the step's last micro-batch (gradient accumulation): OffloadedAdamW then keeps
  // device-resident gradients on the device until the last one. Optional to call.
  virtual Status begin_accumulating_backward() { return Status::ok(); }
};

class AdamW final : public Optimizer {
 public:
  // Moments for `units`, zeroed, on `device` (the units' device, which must outlive the optimizer). The units
  // must outlive it too: the Optimizer interface updates them. With `only`, just the units it marks have moments
  // (and are updated; their buffers are named "adamw.m <unit>" and "adamw.v <unit>" either way).
  static Result<AdamW> create(const std::vector<Unit>& units, const AdamWConfig& config, kernels::Device& device,
                              const std::vector<bool>* only = nullptr);

  // Global L2 norm of all gradients: each unit's sum of squares in double from zero, added in unit order
  // (independent of threading, and the same bits as the offloaded optimizer's).
  static double grad_norm(const std::vector<Unit>& units, kernels::Device& device);

  // One update of every unit with learning rate lr. Clips by global norm first (PyTorch's clip_grad_norm_:
  // scale = clip / (norm + 1e-6) when that is < 1). Returns the pre-clip norm. A non-finite norm skips the
  // update (nothing changes, step count included) and is reported through *skipped.
  double step(const std::vector<Unit>& units, float lr, bool* skipped = nullptr);

  // One update of the units with moments, with the step's parameters as given (hp.step counts from 1, hp.grad_scale
  // is the clip scale, hp.weight_decay is ignored: it is per tensor), where the caller took the norm and keeps the
  // step count (OffloadedAdamW's units on the device). In the device's stream order.
  void apply(const kernels::AdamWParams& hp) const { apply_to(*units_, hp); }
  bool has_moments(size_t i) const { return !masked_ || with_moments_[i]; }

  // Tensor parallelism: the norm is the group's sum of the ranks' shares (`shares` must outlive the optimizer).
  void set_norm_shares(const NormShares* shares) { shares_ = shares; }

  // The Optimizer interface, over the units given to create().
  Result<double> step(float lr, bool* skipped) override;
  int steps_taken() const override { return t_; }
  void set_steps_taken(int t) override { t_ = t; }
  Status adopt_params() override;  // zeroes the moments: the parameters are the master weights
  Status read_moments(size_t unit, float* m, float* v) override;
  Status write_moments(size_t unit, const float* m, const float* v) override;
  // Moments of unit i (layout of the unit); device memory.
  float* m(size_t i) const { return m_[i].as<float>(); }
  float* v(size_t i) const { return v_[i].as<float>(); }
  const AdamWConfig& config() const { return config_; }

 private:
  AdamWConfig config_;
  kernels::Device* device_ = nullptr;
  const std::vector<Unit>* units_ = nullptr;
  // The update of step(), given the norm.
  double update(const std::vector<Unit>& units, float lr, double norm, bool* skipped);
  void apply_to(const std::vector<Unit>& units, const kernels::AdamWParams& hp) const;

  std::vector<kernels::DeviceBuffer> m_, v_;
  const NormShares* shares_ = nullptr;
  bool masked_ = false;              // created with `only`: apply() alone
  std::vector<bool> with_moments_;   // masked_: `only`
  int t_ = 0;
};

}  // namespace strata::engine
