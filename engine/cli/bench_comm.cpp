#include "engine/cli/bench_comm.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "comm/mpi_communicator.h"
#include "common/timer.h"
#include "common/units.h"
#include "comm/staged_communicator.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"

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
  cmd->add_option("--device", o.device, "cpu (host buffers over MPI) or cuda (GPU buffers)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--backend", o.backend,
                  "With --device cuda: auto, nccl or mpi (staged through host memory), as parallel.distributed_backend")
      ->check(CLI::IsMember({"auto", "nccl", "mpi"}))
      ->capture_default_str();
}

namespace {

// The two buffers of a size: host vectors, or the device's memory (a of ones, b of zeros either way).
struct Buffers {
  std::vector<float> host_a, host_b;
  kernels::DeviceBuffer dev_a, dev_b;
  float* a = nullptr;
  float* b = nullptr;
  static Result<Buffers> make(kernels::Device* device, size_t n) {
    Buffers x;
    x.host_a.assign(n, 1.0f);
    if (device == nullptr) {
      x.host_b.assign(n, 0.0f);
      x.a = x.host_a.data();
      x.b = x.host_b.data();
      return x;
    }
    STRATA_ASSIGN_OR_RETURN(x.dev_a, device->allocate(n * sizeof(float), "bench.comm"));
    STRATA_ASSIGN_OR_RETURN(x.dev_b, device->allocate(n * sizeof(float), "bench.comm"));  // zero-filled
    device->copy_to_device(x.dev_a.data(), x.host_a.data(), n * sizeof(float));
    x.a = x.dev_a.as<float>();
    x.b = x.dev_b.as<float>();
    return x;
  }
};

// The sweep over `world` (the run's MPI world): every op at every size, rank 0 printing.
Status sweep(const BenchCommOptions& o, const std::vector<std::string>& ops, uint64_t lo, uint64_t hi,
             comm::Communicator& mpi_world) {
  // Host buffers over MPI, or the GPU's buffers over the device plane the trainer would choose.
  std::unique_ptr<kernels::Device> device;
  std::unique_ptr<comm::Communicator> on_device;  // declared after the device: destroyed first
  comm::Communicator* group = &mpi_world;
  std::string carrier = "MPI (host buffers, fp32)", over = "mpi";
  if (o.device == "cuda") {
    STRATA_ASSIGN_OR_RETURN(device, kernels::make_device("cuda", kernels::cpu_fast_kernels()));
    STRATA_ASSIGN_OR_RETURN(group, comm::device_collectives(group, *device, o.backend, {}, &on_device));
    const bool nccl = dynamic_cast<comm::StagedCommunicator&>(*group).has_device_plane();
    carrier = nccl ? "NCCL (GPU buffers, fp32)" : "MPI (GPU buffers staged through host memory, fp32)";
    over = nccl ? "nccl" : "mpi_staged";
  }
  comm::Communicator& world = *group;
  const int n = world.size();
  const bool leader = world.rank() == 0;
  if (leader && !o.json) {
    std::printf("%d rank(s) over %s%s\n", n, carrier.c_str(),
                n == 1 ? "; a world of one moves nothing between ranks: run under mpirun -np N" : "");
    std::printf("%-15s %12s %12s %12s %12s\n", "op", "bytes", "time (us)", "algbw GB/s", "busbw GB/s");
  }
  for (const std::string& op : ops) {
    for (uint64_t bytes = lo; bytes <= hi; bytes *= 4) {
      // `bytes` is the whole buffer (nccl-tests' size): all-gather's output, reduce-scatter's input.
      const size_t total = std::max<size_t>(n, bytes / sizeof(float) / n * n), part = total / n;
      STRATA_ASSIGN_OR_RETURN(const Buffers buffers, Buffers::make(device.get(), total));
      float* const a = buffers.a;
      float* const b = buffers.b;
      auto call = [&]() -> Status {
        if (op == "all_reduce") return world.all_reduce(a, b, total, DType::kF32, comm::ReduceOp::kSum);
        if (op == "all_gather") return world.all_gather(a, b, part, DType::kF32);
        return world.reduce_scatter(a, b, part, DType::kF32, comm::ReduceOp::kSum);
      };
      for (int i = 0; i < o.warmup; ++i) STRATA_RETURN_IF_ERROR(call());
      STRATA_RETURN_IF_ERROR(world.barrier());
      Timer t;
      for (int i = 0; i < o.iters; ++i) STRATA_RETURN_IF_ERROR(call());
      // The slowest rank's time is the collective's.
      float secs = static_cast<float>(t.seconds() / o.iters);
      STRATA_RETURN_IF_ERROR(world.all_reduce(&secs, &secs, 1, DType::kF32, comm::ReduceOp::kMax));
      const double moved = static_cast<double>(total) * sizeof(float);
      const double algbw = moved / secs / 1e9;
      const double factor = op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
      if (!leader) continue;
      if (o.json) {
        const nlohmann::json j = {{"bench", "comm"},      {"op", op},           {"ranks", n},
                                  {"over", over},         {"bytes", moved},     {"us", secs * 1e6},
                                  {"algbw_gb_per_s", algbw}, {"busbw_gb_per_s", algbw * factor}};
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%-15s %12.0f %12.1f %12.2f %12.2f\n", op.c_str(), moved, secs * 1e6, algbw, algbw * factor);
      }
    }
  }
  return Status::ok();
}

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
  Status swept;
  {
    auto w = comm::MpiCommunicator::world();
    if (!w.is_ok()) return fail(w.status());
    swept = sweep(o, ops, lo, hi, *w.value());
  }  // the world communicator is freed before MPI is finalized
  if (!swept.is_ok()) return fail(swept);
  comm::mpi_finalize();
  return 0;
}

}  // namespace strata::engine
