#include "comm/grid.h"

#include <cstring>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <xxhash.h>

namespace strata::comm {

Result<std::unique_ptr<RankGrid>> RankGrid::create(Communicator& world, int tp_size, int pp_size) {
  if (tp_size < 1) return Status::invalid_argument("tensor_parallel_size must be >= 1, got {}", tp_size);
  if (pp_size < 1) return Status::invalid_argument("pipeline_parallel_size must be >= 1, got {}", pp_size);
  const int n = world.size();
  if (n % (tp_size * pp_size) != 0)
    return Status::invalid_argument(
        "the world of {} ranks does not factor into tensor_parallel_size {} x pipeline_parallel_size {} x a "
        "data-parallel size: run a multiple of {} ranks, or change those keys",
        n, tp_size, pp_size, tp_size * pp_size);
  std::unique_ptr<RankGrid> g(new RankGrid(world));
  g->tp_size_ = tp_size;
  g->pp_size_ = pp_size;
  g->dp_size_ = n / (tp_size * pp_size);
  g->me_ = g->coords(world.rank());
  const GridCoords& c = g->me_;
  const int tp = tp_size, dp = g->dp_size_;
  // Same color = same group; the key orders the group by the coordinate that varies in it.
  STRATA_ASSIGN_OR_RETURN(g->tp_, world.split(c.pp * dp + c.dp, c.tp, "tp"));
  STRATA_ASSIGN_OR_RETURN(g->dp_, world.split(c.pp * tp + c.tp, c.dp, "dp"));
  STRATA_ASSIGN_OR_RETURN(g->pp_, world.split(c.dp * tp + c.tp, c.pp, "pp"));
  return g;
}

GridCoords RankGrid::coords(int world_rank) const {
  GridCoords c;
  c.tp = world_rank % tp_size_;
  c.dp = (world_rank / tp_size_) % dp_size_;
  c.pp = world_rank / (tp_size_ * dp_size_);
  return c;
}

std::string RankGrid::describe() const {
  return fmt::format("rank {} of {}: tp {}/{}, dp {}/{}, pp {}/{}", world_.rank(), world_.size(), me_.tp, tp_size_,
                     me_.dp, dp_size_, me_.pp, pp_size_);
}

namespace {

// XXH3 of this process's executable, read once.
uint64_t binary_hash() {
  static const uint64_t hash = [] {
    std::ifstream in("/proc/self/exe", std::ios::binary);
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    std::vector<char> buf(1 << 20);
    while (in) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      XXH3_64bits_update(st, buf.data(), static_cast<size_t>(in.gcount()));
    }
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
  }();
  return hash;
}

}  // namespace

Status check_same_run(Communicator& world, const std::string& config_text) {
  const uint64_t mine[2] = {XXH3_64bits(config_text.data(), config_text.size()), binary_hash()};
  std::vector<uint64_t> all(2 * static_cast<size_t>(world.size()));
  // Moved as 4 fp32 words per rank: bits are copied, never converted.
  STRATA_RETURN_IF_ERROR(world.all_gather(mine, all.data(), 4, DType::kF32));
  std::vector<int> config_differs, binary_differs;
  for (int r = 1; r < world.size(); ++r) {
    if (all[2 * r] != all[0]) config_differs.push_back(r);
    if (all[2 * r + 1] != all[1]) binary_differs.push_back(r);
  }
  if (config_differs.empty() && binary_differs.empty()) return Status::ok();
  std::string msg;
  if (!config_differs.empty())
    msg += fmt::format("rank(s) {} run a different configuration than rank 0", fmt::join(config_differs, ", "));
  if (!binary_differs.empty())
    msg += fmt::format("{}rank(s) {} run a different strata binary than rank 0", msg.empty() ? "" : "; ",
                       fmt::join(binary_differs, ", "));
  return Status::invalid_argument("{}: every rank must start with the same config and binary", msg);
}

}  // namespace strata::comm
