// grid.h — the rank grid of a parallel run: tensor parallelism innermost (neighbouring ranks, within a node),
// then data parallelism, then pipeline stages: world rank = (pp * dp_size + dp) * tp_size + tp. Each rank gets
// a communicator for each of its three groups (the ranks that differ from it in that coordinate only).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace strata::comm {

struct GridCoords {
  int tp = 0, dp = 0, pp = 0;
};

class RankGrid {
 public:
  // Splits `world` into the groups; `world` must outlive the grid. A world size that is not a multiple of
  // tp_size * pp_size is an error naming both config keys. Collective over `world`.
  static Result<std::unique_ptr<RankGrid>> create(Communicator& world, int tp_size, int pp_size);

  // The coordinates of world rank r (and back), for any rank.
  GridCoords coords(int world_rank) const;
  int world_rank(const GridCoords& c) const { return (c.pp * dp_size_ + c.dp) * tp_size_ + c.tp; }

  int tp_size() const { return tp_size_; }
  int dp_size() const { return dp_size_; }
  int pp_size() const { return pp_size_; }
  const GridCoords& me() const { return me_; }
  Communicator& world() { return world_; }
  Communicator& tp() { return *tp_; }
  Communicator& dp() { return *dp_; }
  Communicator& pp() { return *pp_; }
  // "rank 5 of 8: tp 1/2, dp 0/2, pp 1/2"
  std::string describe() const;

 private:
  RankGrid(Communicator& world) : world_(world) {}
  Communicator& world_;
  int tp_size_ = 1, dp_size_ = 1, pp_size_ = 1;
  GridCoords me_;
  std::unique_ptr<Communicator> tp_, dp_, pp_;
};

// Every rank must run the same configuration and the same binary: each hashes its config text and its
// executable, the hashes are gathered, and any rank that differs from rank 0 is named (the same error on every
// rank). Collective over `world`.
Status check_same_run(Communicator& world, const std::string& config_text);

}  // namespace strata::comm
