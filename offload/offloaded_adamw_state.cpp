// offloaded_adamw_state.cpp — OffloadedAdamW's state in and out, apart from its updates: loading weights and
// moments into it (a sub-group at a time), reading them back, and the views and pieces checkpoints are written
// from (offload/offloaded_adamw.h). Training thread.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "offload/offloaded_adamw.h"

#include "engine/checkpoint/pipeline_checkpoint.h"

namespace strata::offload {

using engine::Optimizer;
using engine::Unit;
using engine::pipeline_recv_moments;
using engine::pipeline_recv_piece;

namespace {

Status outside_unit(const Unit& u, size_t offset) {
  return Status::invalid_argument("offload: element {} is outside unit '{}' ({} elements)", offset, u.name, u.numel());
}

}  // namespace

Status OffloadedAdamW::fill_groups(size_t unit, const StateFill& fill, bool publish) {
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = groups_[i];
    if (g.unit != unit) continue;
    const size_t n = g.spec.numel;
    auto load = [&](float* master, float* m, float* v) -> Status {
      STRATA_RETURN_IF_ERROR(fill(0, g.offset, {master, n}));
      STRATA_RETURN_IF_ERROR(fill(1, g.offset, {m, n}));
      STRATA_RETURN_IF_ERROR(fill(2, g.offset, {v, n}));
      return publish ? coordinator_->write_params(unit, g.offset, n, master) : Status::ok();
    };
    if (swapper_) {
      STRATA_RETURN_IF_ERROR(swapper_->initialize(i, load));
    } else {
      STRATA_RETURN_IF_ERROR(load(g.state, g.state + n, g.state + 2 * n));
    }
  }
  return Status::ok();
}

Status OffloadedAdamW::load_unit(size_t unit, const float* m, const float* v) {
  if (!model_->holds(unit) || model_->on_device(unit)) return Status::ok();  // another stage's, or not ours
  const ShardRange sh = coordinator_->shard(unit);
  std::vector<float> params(sh.len);
  STRATA_RETURN_IF_ERROR(coordinator_->read_shard(unit, params.data()));
  return fill_groups(
      unit,
      [&](int k, size_t offset, std::span<float> dst) {  // offset: the element's place in the unit
        const float* src = k == 0 ? params.data() + (offset - sh.lo) : k == 1 ? (m ? m + offset : nullptr)
                                                                              : (v ? v + offset : nullptr);
        if (src == nullptr) {
          std::fill(dst.begin(), dst.end(), 0.0f);
        } else {
          std::memcpy(dst.data(), src, dst.size_bytes());
        }
        return Status::ok();
      },
      /*publish=*/false);
}

OffloadedAdamW::~OffloadedAdamW() { (void)finish(); }

Status OffloadedAdamW::adopt_params() {
  STRATA_RETURN_IF_ERROR(finish());
  if (on_device_) STRATA_RETURN_IF_ERROR(on_device_->adopt_params());
  for (size_t u = 0; u < model_->units().size(); ++u) STRATA_RETURN_IF_ERROR(load_unit(u, nullptr, nullptr));
  return Status::ok();
}

Status OffloadedAdamW::write_moments(size_t unit, const float* m, const float* v) {
  STRATA_RETURN_IF_ERROR(finish());
  if (model_->on_device(unit)) return on_device_->write_moments(unit, m, v);
  return load_unit(unit, m, v);
}

Status OffloadedAdamW::read_moments(size_t unit, float* m, float* v) {
  STRATA_RETURN_IF_ERROR(finish());
  if (model_->on_device(unit)) return on_device_->read_moments(unit, m, v);
  if (!model_->holds(unit)) {  // the first stage, writing a checkpoint: from the stage that has it
    if (pp_ == nullptr) return Status::internal("offload: unit {} is not here and there is no pipeline", unit);
    return pipeline_recv_moments(plan_, *pp_, unit, model_->units()[unit].numel(), m, v);
  }
  if (coordinator_->sharded()) return gather_moments(unit, m, v);
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = groups_[i];
    if (g.unit != unit) continue;
    if (swapper_) {
      STRATA_RETURN_IF_ERROR(swapper_->read_state(i, nullptr, m + g.offset, v + g.offset));
      continue;
    }
    std::memcpy(m + g.offset, g.state + g.spec.numel, g.spec.numel * sizeof(float));
    std::memcpy(v + g.offset, g.state + 2 * g.spec.numel, g.spec.numel * sizeof(float));
  }
  return Status::ok();
}

Result<std::span<const float>> OffloadedAdamW::state_view(size_t unit, int k, size_t offset) {
  STRATA_ASSERT(k >= 0 && k < 3);
  if (model_->on_device(unit) && model_->holds(unit)) return view_on_device(unit, k, offset);
  // Another stage's, or a shard (gather_piece, or read_params and read_moments, bring those).
  if (!model_->holds(unit) || coordinator_->sharded()) return std::span<const float>();
  STRATA_RETURN_IF_ERROR(finish());
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = groups_[i];
    if (g.unit != unit || offset < g.offset || offset >= g.offset + g.spec.numel) continue;
    const float* state = nullptr;
    if (swapper_) {
      STRATA_ASSIGN_OR_RETURN(state, swapper_->view_state(i, k));
    } else {
      state = g.state + k * g.spec.numel;
    }
    return std::span<const float>(state + (offset - g.offset), g.offset + g.spec.numel - offset);
  }
  return outside_unit(model_->units()[unit], offset);
}

Result<std::span<const float>> OffloadedAdamW::view_on_device(size_t unit, int k, size_t offset) {
  STRATA_RETURN_IF_ERROR(finish());
  const Unit& u = model_->units()[unit];
  if (offset >= u.numel()) return outside_unit(u, offset);
  const float* src = k == 0 ? u.p() : k == 1 ? on_device_->m(unit) : on_device_->v(unit);
  const size_t n = std::min(kMaxStatePiece, u.numel() - offset);
  device_view_.resize(n);
  model_->device().copy_to_host(device_view_.data(), src + offset, n * sizeof(float));
  return std::span<const float>(device_view_);
}

Result<bool> OffloadedAdamW::load_on_device(size_t unit, const StateFill& fill) {
  STRATA_RETURN_IF_ERROR(finish());
  const Unit& u = model_->units()[unit];
  kernels::Device& device = model_->device();
  float* dst[3] = {u.p_for_update(), on_device_->m(unit), on_device_->v(unit)};
  constexpr size_t kPiece = size_t{1} << 20;  // elements staged at once
  std::vector<float> staging(std::min(kPiece, u.numel()));
  for (size_t offset = 0; offset < u.numel(); offset += kPiece) {
    const size_t n = std::min(kPiece, u.numel() - offset);
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(fill(k, offset, {staging.data(), n}));
      device.copy_to_device(dst[k] + offset, staging.data(), n * sizeof(float));
    }
  }
  return true;
}

Result<bool> OffloadedAdamW::load_state(size_t unit, const StateFill& fill) {
  if (!model_->holds(unit)) return true;      // another pipeline stage's
  if (model_->on_device(unit)) return load_on_device(unit, fill);
  STRATA_RETURN_IF_ERROR(finish());
  // ZeRO-3 over ranks: the groups cover this rank's shard, so only its part of the unit is asked for (and kept
  // by write_params); nothing here is collective.
  STRATA_RETURN_IF_ERROR(fill_groups(unit, fill, /*publish=*/true));
  return true;
}

bool OffloadedAdamW::gathers_pieces(size_t unit) const {
  if (model_->tensor_parallel() || model_->on_device(unit)) return false;
  if (!model_->holds(unit)) return stages_send_pieces() && pp_->rank() == 0;
  return coordinator_->sharded() && reducer_ != nullptr;
}

bool OffloadedAdamW::stages_send_pieces() const { return pp_ != nullptr && !model_->tensor_parallel(); }

Result<engine::PieceState::StatePiece> OffloadedAdamW::gather_piece(size_t unit, int k, size_t offset, size_t max_len,
                                                           const PieceBuffer& buffer) {
  STRATA_ASSERT(k >= 0 && k < 3 && max_len > 0 && gathers_pieces(unit));
  if (handoff_) STRATA_RETURN_IF_ERROR(finish());  // an update in flight ends first (and the view with it)
  if (!model_->holds(unit)) return pipeline_recv_piece(plan_, *pp_, unit, k, offset, max_len, buffer);
  const std::string& name = model_->units()[unit].name;
  const size_t numel = model_->units()[unit].numel(), stride = coordinator_->shard(unit).stride;
  if (offset >= numel) return outside_unit(model_->units()[unit], offset);
  const int owner = static_cast<int>(offset / stride), me = reducer_->rank();
  const size_t local = offset - static_cast<size_t>(owner) * stride;  // in the owner's shard
  // The group's rank q holds shard q (the coordinator's shards are cut over a copy of the same group).
  STRATA_ASSERT(coordinator_->shard(unit).len == 0 || coordinator_->shard(unit).lo == static_cast<size_t>(me) * stride);
  const float* data = nullptr;
  uint64_t length = 0;  // 0 from the owner: it could not read the piece
  Status read;
  if (me == owner) {
    read = Status::internal("offload: element {} of unit '{}' is in no sub-group of rank {}", offset, name, me);
    for (size_t i = 0; i < groups_.size(); ++i) {
      const Group& g = groups_[i];
      if (g.unit != unit || local < g.shard_offset || local >= g.shard_offset + g.spec.numel) continue;
      if (swapper_ && (viewed_.group != i || viewed_.k != k)) {
        viewed_ = Viewed{};
        Result<const float*> got = swapper_->view_state(i, k);
        if (got.is_ok()) viewed_ = Viewed{i, k, *got};
        read = got.status();
      } else {
        read = Status::ok();
      }
      if (!read.is_ok()) break;
      const float* state = swapper_ ? viewed_.data : g.state + static_cast<size_t>(k) * g.spec.numel;
      data = state + (local - g.shard_offset);
      length = std::min({g.shard_offset + g.spec.numel - local, numel - offset, max_len});
      break;
    }
  }
  // Every rank learns the length (the bits of a uint64 as two floats); 0 says the owner failed.
  const std::string what = fmt::format("a piece of '{}' (state {}, element {}) from rank {}", name, k, offset, owner);
  STRATA_RETURN_IF_ERROR(reducer_->broadcast(&length, 2, DType::kF32, owner).with_context(what));
  if (length == 0) {
    if (!read.is_ok()) return read.with_context(what);
    return Status::io_error("{}: that rank could not read it (its error is in its log)", what);
  }
  constexpr int kTagPiece = 17;
  if (me == 0 && owner != 0) {
    float* into = buffer(length);
    STRATA_RETURN_IF_ERROR(reducer_->recv(into, length, DType::kF32, owner, kTagPiece).with_context(what));
    data = into;
  } else if (me == owner && owner != 0) {
    STRATA_RETURN_IF_ERROR(reducer_->send(data, length, DType::kF32, 0, kTagPiece).with_context(what));
  }
  return StatePiece{length, me == 0 ? std::span<const float>(data, length) : std::span<const float>()};
}

Status OffloadedAdamW::gather_moments(size_t unit, float* m, float* v) {
  if (reducer_ == nullptr) return Status::internal("ZeRO-3: the offloaded optimizer has no data-parallel group");
  const ShardRange sh = coordinator_->shard(unit);
  const size_t ranks = static_cast<size_t>(reducer_->size()), numel = model_->units()[unit].numel();
  // This rank's m then v, each padded to the shard stride; every rank's pair gathered in rank order.
  std::vector<float> mine(2 * sh.stride, 0.0f), all(ranks * 2 * sh.stride);
  Status read;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = groups_[i];
    if (g.unit != unit) continue;
    float* gm = mine.data() + g.shard_offset;
    float* gv = mine.data() + sh.stride + g.shard_offset;
    if (swapper_) {
      // A failed read still takes part in the gather below (the ranks' collectives must stay paired).
      if (Status st = swapper_->read_state(i, nullptr, gm, gv); !st.is_ok() && read.is_ok()) read = st;
      continue;
    }
    std::memcpy(gm, g.state + g.spec.numel, g.spec.numel * sizeof(float));
    std::memcpy(gv, g.state + 2 * g.spec.numel, g.spec.numel * sizeof(float));
  }
  STRATA_RETURN_IF_ERROR(reducer_->all_gather(mine.data(), all.data(), mine.size(), DType::kF32)
                             .with_context("moments of " + model_->units()[unit].name));
  STRATA_RETURN_IF_ERROR(read.with_context("moments of " + model_->units()[unit].name));
  for (size_t q = 0; q < ranks && q * sh.stride < numel; ++q) {
    const size_t lo = q * sh.stride, len = std::min(sh.stride, numel - lo);
    std::memcpy(m + lo, all.data() + q * 2 * sh.stride, len * sizeof(float));
    std::memcpy(v + lo, all.data() + q * 2 * sh.stride + sh.stride, len * sizeof(float));
  }
  return Status::ok();
}

}  // namespace strata::offload
