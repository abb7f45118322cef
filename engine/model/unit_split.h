// unit_split.h — how a unit is cut over the ranks of a tensor-parallel group (parallel.tensor_parallel_size,
// Megatron-LM's split), and the arithmetic on those slices.
//
// Each rank's unit buffer holds its slices only (docs/architecture.md "Data model"), laid out like the whole unit
// (same tensor names, same order, smaller shapes), so the offload coordinator, ZeRO sharding and the optimizers
// see an ordinary unit. A tensor is replicated, or cut by rows or by columns (TensorSplit); a model family says
// which for each of its tensors (GPT-2: engine/model/gpt2/gpt2.h gpt2_tensor_split). Every rank holds a
// replicated tensor whole and computes the same gradient for it, so every rank applies the same update and the
// copies stay equal. Checkpoints and initialisation use the whole tensors (slice() and assemble() convert), so a
// checkpoint does not depend on the tensor-parallel size.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "common/status.h"
#include "common/sum_ranges.h"
#include "common/tensor.h"

namespace strata::engine {

// How one tensor is cut.
struct TensorSplit {
  enum Kind : uint8_t { kReplicated, kRows, kColumns } kind = kReplicated;
  int segments = 1;  // kRows: the rows are this many equal blocks (q, k, v: 3), each cut into t slices
};

// Rows [start, start + count) of R rows cut into `size` slices of ceil(R/size) rows (the last ones shorter or
// empty).
struct RowSlice {
  int64_t start = 0, count = 0;
};
RowSlice row_slice(int64_t rows, int rank, int size);

// One unit's split over a group of `size` ranks.
class UnitSplit {
 public:
  UnitSplit() = default;
  UnitSplit(FlatLayout whole, std::vector<TensorSplit> splits, int size);

  const FlatLayout& whole() const { return whole_; }
  // Rank r's layout: the same tensors in the same order, its slices' shapes.
  const FlatLayout& local(int rank) const { return local_[static_cast<size_t>(rank)]; }
  size_t max_local_numel() const;  // the largest rank's (the size every rank pads to for an all-gather)
  int size() const { return size_; }
  bool split() const { return size_ > 1; }

  // Rank r's slices of a whole unit (whole layout) into `local` (its layout), and back: assemble writes rank
  // r's part of `whole`; over every rank it writes every element.
  void slice(const float* whole, int rank, float* local) const;
  void assemble(const float* local, int rank, float* whole) const;
  // The [offset, offset + length) ranges of rank r's layout holding replicated tensors, in order, merged.
  Ranges replicated_ranges(int rank) const;

 private:
  // Calls fn(local_offset, whole_offset, count) for each contiguous run of tensor t of rank r.
  template <typename Fn>
  void for_each_run(size_t t, int rank, Fn&& fn) const;

  FlatLayout whole_;
  std::vector<TensorSplit> splits_;
  std::vector<FlatLayout> local_;
  int size_ = 1;
};

// Every entry of `per` becomes its sum over `group`'s ranks, added in rank order; the doubles travel as pairs of
// fp32 words (bits copied, never converted), so every rank gets the same bits. Collective; `what` names it in
// an error.
Status sum_in_rank_order(comm::Communicator& group, std::vector<double>* per, const char* what);

// Each unit's share of the global gradient norm on one rank of a tensor-parallel group, and their sum over it.
// Replicated tensors hold the same gradient on every rank: rank 0 counts them, the others leave them out.
struct NormShares {
  comm::Communicator* group = nullptr;  // null: no tensor parallelism (every share is the whole unit)
  // Per unit: the [offset, offset + length) ranges of its (local) layout this rank does not count.
  std::vector<Ranges> excluded;

  bool active() const { return group != nullptr && group->size() > 1; }
  // Rank's share of unit u's gradient (n floats at `offset` of the unit) from sum_squares(p, n).
  template <typename SumSquares>
  double share(size_t u, const float* x, size_t offset, size_t n, SumSquares&& sum_squares) const {
    static const Ranges kNone;
    return sum_squares_excluding(x, offset, n, active() ? excluded[u] : kNone, sum_squares);
  }
  // per[u] (this rank's shares) become the group's sums, the ranks' shares added in rank order, so every rank
  // gets the same bits. Collective over the group; nothing to do without one.
  Status sum(std::vector<double>* per) const;
};

}  // namespace strata::engine
