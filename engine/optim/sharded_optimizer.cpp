#include "engine/optim/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace strata::engine {
namespace {

// Elements of rank q's slice of a tensor of n elements cut in slices of c.
size_t slice_len(size_t n, size_t c, size_t q) { return q * c >= n ? 0 : std::min(c, n - q * c); }

}  // namespace

Result<std::unique_ptr<ShardedAdamW>> ShardedAdamW::create(const std::vector<Unit>& units, const AdamWConfig& config,
                                                         kernels::Device& device, comm::Communicator& group,
                                                         const ShardedAdamWOptions& options) {
  const int stage = options.stage;
  const std::vector<bool>& held = options.held;
  if (stage != 1 && stage != 2)
    return Status::invalid_argument("ShardedAdamW: zero_optimization.stage must be 1 or 2, got {}", stage);
  std::unique_ptr<ShardedAdamW> opt(new ShardedAdamW());
  opt->held_ = held;
  opt->config_ = config;
  opt->units_ = &units;
  opt->device_ = &device;
  opt->group_ = &group;
  opt->stage_ = stage;
  const size_t dp = static_cast<size_t>(group.size()), r = static_cast<size_t>(group.rank());
  if (!held.empty() && held.size() != units.size())
    return Status::internal("ShardedAdamW: {} held flags for {} units", held.size(), units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    if (!held.empty() && !held[u]) continue;  // another pipeline stage's
    for (const TensorSpec& t : units[u].layout.specs()) {
      Slice s;
      s.unit = u;
      s.tensor_offset = t.offset;
      s.tensor_numel = t.numel();
      s.c = ((s.tensor_numel + dp - 1) / dp + 15) / 16 * 16;
      s.lo = std::min(s.tensor_numel, r * s.c);
      s.len = slice_len(s.tensor_numel, s.c, r);
      s.shard_offset = opt->shard_numel_;
      s.weight_decay = t.decay ? config.weight_decay : 0.0f;
      opt->shard_numel_ += s.len;
      opt->slices_.push_back(s);
    }
  }
  const size_t bytes = std::max<size_t>(opt->shard_numel_, 1) * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(opt->m_, device.allocate(bytes, "adamw.m (zero shard)"));
  STRATA_ASSIGN_OR_RETURN(opt->v_, device.allocate(bytes, "adamw.v (zero shard)"));
  if (stage == 2) {
    STRATA_ASSIGN_OR_RETURN(opt->grad_shard_, device.allocate(bytes, "adamw.grad (zero shard)"));
  }
  auto piece = [&](size_t bucket) {
    return std::clamp<size_t>(bucket / dp, 1, ShardedAdamWOptions::kMaxPiece);
  };
  opt->reduce_bucket_ = std::max<size_t>(options.reduce_bucket, 1);
  opt->reduce_piece_ = piece(options.reduce_bucket);
  opt->gather_piece_ = piece(options.allgather_bucket);
  opt->send_.assign(std::max(opt->reduce_piece_, opt->gather_piece_), 0.0f);
  opt->recv_.assign(dp * opt->send_.size(), 0.0f);
  STRATA_RETURN_IF_ERROR(opt->adopt_params());
  return opt;
}

Status ShardedAdamW::set_pipeline(const PipelinePlan& plan, comm::Communicator& pp) {
  plan_ = plan;
  pp_ = &pp;
  STRATA_ASSIGN_OR_RETURN(shared_, SharedGrads::create(plan, &pp));
  return Status::ok();
}

Status ShardedAdamW::adopt_params() {
  device_->zero(m_.data(), m_.size());
  device_->zero(v_.data(), v_.size());
  return Status::ok();
}

Status ShardedAdamW::all_gather_tensor(const Slice& s, const float* shard, float* whole) {
  const size_t dp = static_cast<size_t>(group_->size());
  const bool to_device = device_->owns(whole, 0);  // the parameters, or a checkpoint's host copy of the moments
  for (size_t a = 0; a < s.c; a += gather_piece_) {
    const size_t k = std::min(gather_piece_, s.c - a);
    const size_t mine = s.len > a ? std::min(k, s.len - a) : 0;
    if (mine > 0) device_->copy_to_host(send_.data(), shard + a, mine * sizeof(float));
    std::fill(send_.begin() + mine, send_.begin() + k, 0.0f);
    STRATA_RETURN_IF_ERROR(group_->all_gather(send_.data(), recv_.data(), k, DType::kF32));
    for (size_t q = 0; q < dp; ++q) {
      const size_t len = slice_len(s.tensor_numel, s.c, q);
      if (len <= a) continue;
      float* dst = whole + q * s.c + a;
      const size_t bytes = std::min(k, len - a) * sizeof(float);
      if (to_device) {
        device_->copy_to_device(dst, recv_.data() + q * k, bytes);
      } else {
        std::memcpy(dst, recv_.data() + q * k, bytes);
      }
    }
  }
  return Status::ok();
}

Status ShardedAdamW::reduce_scatter_tensor(const Slice& s, const float* whole, float* shard) {
  const size_t dp = static_cast<size_t>(group_->size());
  for (size_t a = 0; a < s.c; a += reduce_piece_) {
    const size_t k = std::min(reduce_piece_, s.c - a);
    for (size_t q = 0; q < dp; ++q) {  // rank q's part of this piece, padded with zeros
      const size_t len = slice_len(s.tensor_numel, s.c, q);
      const size_t have = len > a ? std::min(k, len - a) : 0;
      float* dst = recv_.data() + q * k;
      if (have > 0) device_->copy_to_host(dst, whole + q * s.c + a, have * sizeof(float));
      std::fill(dst + have, dst + k, 0.0f);
    }
    STRATA_RETURN_IF_ERROR(group_->reduce_scatter(recv_.data(), send_.data(), k, DType::kF32, comm::ReduceOp::kSum));
    if (s.len > a) device_->copy_to_device(shard + a, send_.data(), std::min(k, s.len - a) * sizeof(float));
  }
  return Status::ok();
}

Result<double> ShardedAdamW::pipeline_norm_stage2() {
  // Each unit's sum of squares over this rank's slices, every rank's added in rank order per unit.
  const std::vector<Unit>& units = *units_;
  const size_t U = units.size();
  std::vector<double> mine(U, 0.0);
  for (const Slice& s : slices_) {
    const float* shard = grad_shard_.as<float>() + s.shard_offset;
    mine[s.unit] += shares().share(s.unit, shard, s.tensor_offset + s.lo, s.len, [&](const float* x, size_t n) {
      return device_->add_sum_squares(0.0, x, n);
    });
  }
  STRATA_RETURN_IF_ERROR(sum_in_rank_order(*group_, &mine, "gradient norm"));
  return whole_model_norm(plan_, pp_, shares(), std::move(mine));
}

Result<double> ShardedAdamW::step(float lr, bool* skipped) {
  const std::vector<Unit>& units = *units_;
  double norm = 0;
  if (stage_ == 1) {
    for (size_t i = 0; i < units.size(); ++i) {
      if (!holds(i)) continue;  // another pipeline stage's
      const Unit& u = units[i];
      const size_t bucket = reduce_bucket_;  // in place, uncapped: whole units by default, as stage 0 reduces them
      for (size_t a = 0; a < u.numel(); a += bucket) {
        STRATA_RETURN_IF_ERROR(group_->all_reduce(u.g() + a, u.g() + a, std::min(bucket, u.numel() - a), DType::kF32,
                                                  comm::ReduceOp::kSum)
                                   .with_context("gradients of " + u.name));
      }
    }
    STRATA_RETURN_IF_ERROR(shared_.sum_units(units));  // pipeline: the units several stages hold
    // The unsharded norm, bit for bit: each unit's share from zero (its owner stage's), summed over the
    // tensor-parallel group, then added in unit order, as AdamW and PipelineAdamW take it.
    std::vector<double> per(units.size(), 0.0);
    for (size_t u = 0; u < units.size(); ++u) {
      if (pp_ == nullptr || plan_.owner(u) == pp_->rank()) per[u] = unit_norm_share(shares(), u, units[u], *device_);
    }
    STRATA_ASSIGN_OR_RETURN(norm, whole_model_norm(plan_, pp_, shares(), std::move(per)));
  } else if (pp_ != nullptr) {
    for (const Slice& s : slices_) {
      float* shard = grad_shard_.as<float>() + s.shard_offset;
      STRATA_RETURN_IF_ERROR(reduce_scatter_tensor(s, units[s.unit].g() + s.tensor_offset, shard)
                                 .with_context("gradients of " + units[s.unit].name));
    }
    // The units several stages hold: the same slices of them on each, summed a run of adjacent ones at a time
    // (GPT-2's embedding: one run, the shard's first).
    for (size_t i = 0; i < slices_.size();) {
      if (!shared_.shared(slices_[i].unit)) {
        ++i;
        continue;
      }
      const size_t at = slices_[i].shard_offset;
      size_t n = 0;
      const size_t unit = slices_[i].unit;
      for (; i < slices_.size() && shared_.shared(slices_[i].unit) && slices_[i].shard_offset == at + n; ++i)
        n += slices_[i].len;
      STRATA_RETURN_IF_ERROR(shared_.sum(grad_shard_.as<float>() + at, n, units[unit].name));
    }
    STRATA_ASSIGN_OR_RETURN(norm, pipeline_norm_stage2());
  } else {
    const bool tensor_parallel = shares().active();
    double mine = 0.0;
    for (const Slice& s : slices_) {
      float* shard = grad_shard_.as<float>() + s.shard_offset;
      STRATA_RETURN_IF_ERROR(reduce_scatter_tensor(s, units[s.unit].g() + s.tensor_offset, shard)
                                 .with_context("gradients of " + units[s.unit].name));
      if (!tensor_parallel) {
        mine = device_->add_sum_squares(mine, shard, s.len);
      } else {  // the slice is elements [tensor_offset + lo, + len) of its unit
        mine += shares().share(s.unit, shard, s.tensor_offset + s.lo, s.len,
                               [&](const float* x, size_t n) { return device_->add_sum_squares(0.0, x, n); });
      }
    }
    // Every rank's sum of squares, added in rank order; under tensor parallelism then summed over its group.
    std::vector<double> total{mine};
    STRATA_RETURN_IF_ERROR(sum_in_rank_order(*group_, &total, "gradient norm"));
    STRATA_RETURN_IF_ERROR(shares().sum(&total));
    norm = std::sqrt(total[0]);
  }
  const std::optional<float> scale = step_scale(norm, config_.grad_clip, skipped);
  if (!scale) return norm;
  ++t_;
  const kernels::KernelSet& k = device_->kernels();
  for (const Slice& s : slices_) {
    if (s.len == 0) continue;
    kernels::AdamWParams hp = adamw_params(config_, lr, t_, *scale);
    hp.weight_decay = s.weight_decay;
    const Unit& u = units[s.unit];
    const float* g = stage_ == 1 ? u.g() + s.tensor_offset + s.lo : grad_shard_.as<float>() + s.shard_offset;
    k.adamw_update(u.p_for_update() + s.tensor_offset + s.lo, m_.as<float>() + s.shard_offset,
                   v_.as<float>() + s.shard_offset, g, s.len, hp);
  }
  // Every rank's new slices to every rank. The source may be `whole` itself: each piece of this rank's slice
  // is staged in the send buffer before anything lands.
  for (const Slice& s : slices_) {
    float* whole = units[s.unit].p_for_update() + s.tensor_offset;
    STRATA_RETURN_IF_ERROR(all_gather_tensor(s, whole + s.lo, whole).with_context("parameters of " + units[s.unit].name));
  }
  return norm;
}

Status ShardedAdamW::gather_moments(size_t unit, float* m, float* v) {
  for (const Slice& s : slices_) {
    if (s.unit != unit) continue;
    STRATA_RETURN_IF_ERROR(all_gather_tensor(s, m_.as<float>() + s.shard_offset, m + s.tensor_offset));
    STRATA_RETURN_IF_ERROR(all_gather_tensor(s, v_.as<float>() + s.shard_offset, v + s.tensor_offset));
  }
  return Status::ok();
}

Status ShardedAdamW::read_moments(size_t unit, float* m, float* v) {
  if (!holds(unit))
    return pipeline_recv_moments(plan_, *pp_, unit, (*units_)[unit].numel(), m, v);
  if (group_->rank() != 0)
    return Status::internal("ShardedAdamW::read_moments is rank 0's; the others serve_checkpoint()");
  float request = static_cast<float>(unit);
  STRATA_RETURN_IF_ERROR(group_->broadcast(&request, 1, DType::kF32, 0));
  return gather_moments(unit, m, v);
}

Status ShardedAdamW::end_checkpoint() {
  float request = -1.0f;
  return group_->broadcast(&request, 1, DType::kF32, 0);
}

Status ShardedAdamW::serve_checkpoint() {
  std::vector<float> m, v;
  for (;;) {
    float request = 0;
    STRATA_RETURN_IF_ERROR(group_->broadcast(&request, 1, DType::kF32, 0));
    if (request < 0) return Status::ok();
    const size_t unit = static_cast<size_t>(request);
    if (unit >= units_->size()) return Status::internal("checkpoint: rank 0 asked for unit {} of {}", unit, units_->size());
    m.resize((*units_)[unit].numel());
    v.resize(m.size());
    STRATA_RETURN_IF_ERROR(gather_moments(unit, m.data(), v.data()));
  }
}

Status ShardedAdamW::write_moments(size_t unit, const float* m, const float* v) {
  for (const Slice& s : slices_) {
    if (s.unit != unit) continue;
    device_->copy_to_device(m_.as<float>() + s.shard_offset, m + s.tensor_offset + s.lo, s.len * sizeof(float));
    device_->copy_to_device(v_.as<float>() + s.shard_offset, v + s.tensor_offset + s.lo, s.len * sizeof(float));
  }
  return Status::ok();
}

}  // namespace strata::engine
