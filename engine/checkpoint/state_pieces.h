// state_pieces.h — an optimizer whose state checkpoints read and write a piece at a time, so that no rank holds
// a unit's weights, m and v whole outside its budgets: the offloaded optimizer's (offload/offloaded_adamw.h),
// whose state lies in host memory or on NVMe, sharded over data-parallel ranks under ZeRO-3, and on a pipeline
// the first stage's, which writes the checkpoint from pieces the other stages send. The protocol (which rank
// calls what, in which order, and what is collective) is docs/formats/checkpoints.md "State in pieces".
// Optimizer::piece_state() gives it where an optimizer has one. Header-only: the optimizers that implement it
// sit below checkpoint/, which uses it.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"

namespace strata::engine {

class PieceState {
 public:
  virtual ~PieceState() = default;

  // A piece of state gathered over ranks: its length on every rank, its elements on the root.
  struct StatePiece {
    size_t length = 0;
    std::span<const float> data;  // the data-parallel group's rank 0 only
  };
  // The most elements of a piece sent from one rank to another: what the receiver holds of it at once.
  static constexpr size_t kMaxStatePiece = size_t{4} << 20;  // 16 MiB
  // Where gather_piece puts a piece it receives: a buffer of `length` floats.
  using PieceBuffer = std::function<float*(size_t length)>;
  // A PieceBuffer that grows `buffer` to each piece's length (the largest so far stays allocated).
  static PieceBuffer buffer_in(std::vector<float>& buffer) {
    return [&buffer](size_t length) {
      buffer.resize(length);
      return buffer.data();
    };
  }
  // Fills dst with state k of a unit (0: the weights, 1: Adam's m, 2: v) from element `offset` on.
  using StateFill = std::function<Status(int k, size_t offset, std::span<float> dst)>;

  // State k of a unit (0: the fp32 master weights, 1: m, 2: v) from element `offset` on, where this rank keeps
  // it; empty where it keeps no such copy (the model's read_params and the optimizer's read_moments then).
  virtual Result<std::span<const float>> state_view(size_t unit, int k, size_t offset) = 0;
  // Whether the unit's state is gathered with gather_piece (the same answer on every rank of the group).
  virtual bool gathers_pieces(size_t unit) const = 0;
  // Whether a pipeline's stages send the first their units' state a piece at a time (the same on every stage).
  virtual bool stages_send_pieces() const = 0;
  // The next piece of state k of the unit, at least one and at most `max_len` elements from `offset`, to the
  // data-parallel group's rank 0. Collective over that group. Only where gathers_pieces(unit).
  virtual Result<StatePiece> gather_piece(size_t unit, int k, size_t offset, size_t max_len,
                                          const PieceBuffer& buffer) = 0;
  // The unit's weights, m and v from `fill`, a piece at a time, straight into where this optimizer keeps them;
  // false, having called nothing, where it keeps no such copy of the unit. Never collective.
  virtual Result<bool> load_state(size_t unit, const StateFill& fill) = 0;
};

}  // namespace strata::engine
