#include "engine/checkpoint/pipeline_checkpoint.h"

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace strata::engine {
namespace {

constexpr int kTagParams = PipelineTags::kParams, kTagMoments = PipelineTags::kMoments;

}  // namespace

namespace {

int piece_tag(int k) { return k == 0 ? kTagParams : kTagMoments; }

// Each piece between stages comes after a header of its offset in the unit and its length (two uint64s, their
// bits as four fp32 words); a length of 0 says the sending stage failed to read it.
struct PieceHeader {
  uint64_t offset = 0, length = 0;
};

// State k of unit u, a piece after another, to the first stage: each its header, then its elements, at most
// PieceState::kMaxStatePiece. From the stage's ZeRO-3 shards (this rank is its data-parallel group's rank 0; the
// others walk the same pieces, take_part_in_checkpoint), or from where the optimizer keeps the state (a
// sub-group's view, read once and sent in parts). A failed read is said to the first stage before it returns.
Status send_pieces(const Model& model, PieceState& pieces, comm::Communicator& pp, size_t u, int k,
                   std::vector<float>& buffer) {
  const std::string what = fmt::format("{} of '{}' to the first stage", k == 0 ? "weights" : k == 1 ? "m" : "v",
                                       model.units()[u].name);
  auto send_header = [&](PieceHeader h) {
    return pp.send(&h, sizeof(h) / sizeof(float), DType::kF32, 0, piece_tag(k)).with_context(what);
  };
  const size_t numel = model.whole_layout(u).numel();
  for (size_t at = 0; at < numel;) {
    Result<std::span<const float>> view = std::span<const float>();
    if (pieces.gathers_pieces(u)) {
      Result<PieceState::StatePiece> piece =
          pieces.gather_piece(u, k, at, PieceState::kMaxStatePiece, PieceState::buffer_in(buffer));
      view = piece.is_ok() ? Result<std::span<const float>>(piece->data) : piece.status();
    } else {
      view = pieces.state_view(u, k, at);
      if (view.is_ok() && view->empty()) view = Status::internal("{}: the optimizer has no view of it", what);
    }
    if (!view.is_ok()) {
      (void)send_header({at, 0});  // the first stage fails at once, naming this stage
      return view.status().with_context(what);
    }
    for (size_t done = 0; done < view->size();) {
      const std::span<const float> part = view->subspan(done, std::min(view->size() - done, PieceState::kMaxStatePiece));
      STRATA_RETURN_IF_ERROR(send_header({at + done, part.size()}));
      STRATA_RETURN_IF_ERROR(pp.send(part.data(), part.size(), DType::kF32, 0, piece_tag(k)).with_context(what));
      done += part.size();
    }
    at += view->size();
  }
  return Status::ok();
}

}  // namespace

Result<PieceState::StatePiece> pipeline_recv_piece(const PipelinePlan& plan, comm::Communicator& pp, size_t unit,
                                                  int k, size_t offset, size_t max_len,
                                                  const PieceState::PieceBuffer& buffer) {
  const int owner = plan.owner(unit);
  const std::string what = fmt::format("a piece of unit {} (state {}, element {}) from stage {}", unit, k, offset,
                                       owner);
  PieceHeader h;
  STRATA_RETURN_IF_ERROR(pp.recv(&h, sizeof(h) / sizeof(float), DType::kF32, owner, piece_tag(k)).with_context(what));
  if (h.length == 0) return Status::io_error("{}: that stage could not read it (its error is in its log)", what);
  if (h.offset != offset || h.length > max_len) {
    return Status::internal("{}: it sent {} elements from element {}, where 1 to {} from element {} were expected",
                            what, h.length, h.offset, max_len, offset);
  }
  float* into = buffer(h.length);
  STRATA_RETURN_IF_ERROR(pp.recv(into, h.length, DType::kF32, owner, piece_tag(k)).with_context(what));
  return PieceState::StatePiece{h.length, std::span<const float>(into, h.length)};
}

Status take_part_in_pipeline_checkpoint(const Model& model, const PipelinePlan& plan, Optimizer& opt,
                                        comm::Communicator& pp) {
  STRATA_RETURN_IF_ERROR(opt.finish());
  const int s = pp.rank();
  std::vector<float> a, b;
  if (PieceState* pieces = opt.piece_state(); pieces != nullptr && pieces->stages_send_pieces()) {
    for (size_t u = 0; u < model.units().size(); ++u) {  // the first stage's model file reads
      if (s != 0 && plan.owner(u) == s) STRATA_RETURN_IF_ERROR(send_pieces(model, *pieces, pp, u, 0, a));
    }
    for (size_t u = 0; u < model.units().size(); ++u) {  // then its moments reads
      if (s == 0 || plan.owner(u) != s) continue;
      STRATA_RETURN_IF_ERROR(send_pieces(model, *pieces, pp, u, 1, a));
      STRATA_RETURN_IF_ERROR(send_pieces(model, *pieces, pp, u, 2, a));
    }
    return Status::ok();
  }
  // Parameters travel whole (read_params gathers a tensor-parallel stage's slices); moments as this rank's slices
  // (the first stage's rank of the same tensor-parallel rank gathers them).
  for (size_t u = 0; u < model.units().size(); ++u) {  // the first stage's model file reads
    if (s == 0 || plan.owner(u) != s) continue;
    a.resize(model.whole_layout(u).numel());
    STRATA_RETURN_IF_ERROR(model.read_params(u, a.data()));
    STRATA_RETURN_IF_ERROR(pp.send(a.data(), a.size(), DType::kF32, 0, kTagParams));
  }
  for (size_t u = 0; u < model.units().size(); ++u) {  // then its moments reads
    if (s == 0 || plan.owner(u) != s) continue;
    a.resize(model.units()[u].numel());
    b.resize(a.size());
    STRATA_RETURN_IF_ERROR(opt.read_moments(u, a.data(), b.data()));
    STRATA_RETURN_IF_ERROR(pp.send(a.data(), a.size(), DType::kF32, 0, kTagMoments));
    STRATA_RETURN_IF_ERROR(pp.send(b.data(), b.size(), DType::kF32, 0, kTagMoments));
  }
  return Status::ok();
}

}  // namespace strata::engine
