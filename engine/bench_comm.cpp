#include "engine/bench_comm.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "comm/mpi_communicator.h"
#include "common/timer.h"
#include "common/units.h"

namespace strata::engine {

void add_bench_comm_command(CLI::App& bench, BenchCommOptions& o) {
  CLI::App* cmd = bench.add_subcommand(
      "comm", "Collective bandwidth over sizes, as nccl-tests reports it (run under mpirun -np N)");
  cmd->add_option("--min-bytes", o.min_bytes, "Smallest buffer (bytes, K/M/G)")->capture_default_str();
  cmd->add_option("--max-bytes", o.max_bytes, "Largest buffer (bytes, K/M/G); sizes go up by 4x")
      ->capture_default_str();
  cmd->add_option("--ops", o.ops, "Comma-separated: all_reduce, all_gather, reduce_scatter")->capture_default_str();
  cmd->add_option("--iters", o.iters, "Timed calls per size (mean reported)")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Untimed calls per size first")->capture_default_str();
  cmd->add_flag("--json", o.json, "One JSON object per op and size");
}

namespace {

int fail(const Status& st) {
  std::fprintf(stderr, "strata bench comm: %s\n", st.to_string().c_str());
  comm::mpi_finalize();
  return 1;
}

}  // namespace

int run_bench_comm(const BenchCommOptions& o) {
  const uint64_t lo = parse_bytes(o.min_bytes), hi = parse_bytes(o.max_bytes);
  if (lo < 4 || hi < lo || o.iters < 1 || o.warmup < 0) {
    std::fprintf(stderr, "strata bench comm: need 4 <= --min-bytes <= --max-bytes and --iters >= 1\n");
    return 2;
  }
  std::vector<std::string> ops;
  std::stringstream ss(o.ops);
  for (std::string op; std::getline(ss, op, ',');) {
    if (op != "all_reduce" && op != "all_gather" && op != "reduce_scatter") {
      std::fprintf(stderr, "strata bench comm: --ops: unknown op '%s'\n", op.c_str());
      return 2;
    }
    ops.push_back(op);
  }
  if (Status st = comm::mpi_init(nullptr, nullptr); !st.is_ok()) return fail(st);
  auto w = comm::MpiCommunicator::world();
  if (!w.is_ok()) return fail(w.status());
  comm::Communicator& world = *w.value();
  const int n = world.size();
  const bool leader = world.rank() == 0;
  if (leader && !o.json) {
    std::printf("%d rank(s) over MPI (host buffers, fp32)%s\n", n,
                n == 1 ? "; a world of one moves nothing between ranks: run under mpirun -np N" : "");
    std::printf("%-15s %12s %12s %12s %12s\n", "op", "bytes", "time (us)", "algbw GB/s", "busbw GB/s");
  }
  for (const std::string& op : ops) {
    for (uint64_t bytes = lo; bytes <= hi; bytes *= 4) {
      // `bytes` is the whole buffer (nccl-tests' size): all-gather's output, reduce-scatter's input.
      const size_t total = std::max<size_t>(n, bytes / sizeof(float) / n * n), part = total / n;
      std::vector<float> a(total, 1.0f), b(total, 0.0f);
      auto call = [&]() -> Status {
        if (op == "all_reduce") return world.all_reduce(a.data(), b.data(), total, DType::kF32, comm::ReduceOp::kSum);
        if (op == "all_gather") return world.all_gather(a.data(), b.data(), part, DType::kF32);
        return world.reduce_scatter(a.data(), b.data(), part, DType::kF32, comm::ReduceOp::kSum);
      };
      for (int i = 0; i < o.warmup; ++i) {
        if (Status st = call(); !st.is_ok()) return fail(st);
      }
      if (Status st = world.barrier(); !st.is_ok()) return fail(st);
      Timer t;
      for (int i = 0; i < o.iters; ++i) {
        if (Status st = call(); !st.is_ok()) return fail(st);
      }
      // The slowest rank's time is the collective's.
      float secs = static_cast<float>(t.seconds() / o.iters);
      if (Status st = world.all_reduce(&secs, &secs, 1, DType::kF32, comm::ReduceOp::kMax); !st.is_ok()) return fail(st);
      const double moved = static_cast<double>(total) * sizeof(float);
      const double algbw = moved / secs / 1e9;
      const double factor = op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
      if (!leader) continue;
      if (o.json) {
        const nlohmann::json j = {{"bench", "comm"},      {"op", op},           {"ranks", n},
                                  {"bytes", moved},       {"us", secs * 1e6},   {"algbw_gb_per_s", algbw},
                                  {"busbw_gb_per_s", algbw * factor}};
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%-15s %12.0f %12.1f %12.2f %12.2f\n", op.c_str(), moved, secs * 1e6, algbw, algbw * factor);
      }
    }
  }
  w.value().reset();
  comm::mpi_finalize();
  return 0;
}

}  // namespace strata::engine
