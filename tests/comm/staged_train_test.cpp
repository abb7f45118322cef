// staged_train_test.cpp — run by CTest under `mpiexec -np 2`: the collectives of a device the host cannot
// address, staged through host memory over MPI (engine/staged_communicator.h), on the CPU device posing as such
// a device (tests/forwarding_device.h). Staging only moves bytes, so every call gives bitwise what the MPI
// communicator gives on host buffers, and every parallel mode trains bitwise as on the plain CPU device.
#include <cstring>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "comm/grid.h"
#include "comm/mpi_communicator.h"
#include "engine/staged_communicator.h"
#include "tests/comm/multi_rank_helpers.h"
#include "tests/engine/trainer_fixture.h"
#include "tests/forwarding_device.h"

namespace strata::engine {
namespace {

using testing::UnaddressableDevice;

std::unique_ptr<comm::MpiCommunicator> world_or_die() {
  auto w = comm::MpiCommunicator::world(comm::MpiOptions{.timeout_s = 120});
  EXPECT_TRUE(w.is_ok()) << w.status().to_string();
  return w.is_ok() ? std::move(w).value() : nullptr;
}

// rank r's input: distinct per rank and element, exact in fp32 sums.
std::vector<float> input(int rank, size_t n) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(100 * rank + static_cast<int>(i % 97)) - 30.0f;
  return x;
}

// Device memory holding `host`, and back.
kernels::DeviceBuffer on_device(kernels::Device& d, const std::vector<float>& host) {
  auto b = d.allocate(std::max<size_t>(host.size(), 1) * sizeof(float), "test");
  EXPECT_TRUE(b.is_ok());
  d.copy_to_device(b->data(), host.data(), host.size() * sizeof(float));
  return std::move(b).value();
}
std::vector<float> to_host(kernels::Device& d, const kernels::DeviceBuffer& b, size_t n) {
  std::vector<float> x(n);
  d.copy_to_host(x.data(), b.data(), n * sizeof(float));
  return x;
}

// What MPI is handed, checked: a Communicator that forwards to another and records a failure for every buffer
// that is `device`'s memory (MPI would read a GPU's pointer as host memory). Its splits check too.
class HostOnly final : public comm::Communicator {
 public:
  HostOnly(comm::Communicator& inner, const kernels::Device& device) : inner_(&inner), device_(device) {}
  HostOnly(std::unique_ptr<comm::Communicator> inner, const kernels::Device& device)
      : owned_(std::move(inner)), inner_(owned_.get()), device_(device) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  Status all_reduce(const void* s, void* r, size_t n, DType t, comm::ReduceOp op) override {
    return check(s, r, "all_reduce") ? inner_->all_reduce(s, r, n, t, op) : refused();
  }
  Status all_gather(const void* s, void* r, size_t n, DType t) override {
    return check(s, r, "all_gather") ? inner_->all_gather(s, r, n, t) : refused();
  }
  Status reduce_scatter(const void* s, void* r, size_t n, DType t, comm::ReduceOp op) override {
    return check(s, r, "reduce_scatter") ? inner_->reduce_scatter(s, r, n, t, op) : refused();
  }
  Status broadcast(void* b, size_t n, DType t, int root) override {
    return check(b, b, "broadcast") ? inner_->broadcast(b, n, t, root) : refused();
  }
  Status send(const void* b, size_t n, DType t, int peer, int tag) override {
    return check(b, b, "send") ? inner_->send(b, n, t, peer, tag) : refused();
  }
  Status recv(void* b, size_t n, DType t, int peer, int tag) override {
    return check(b, b, "recv") ? inner_->recv(b, n, t, peer, tag) : refused();
  }
  Status send_recv(const void* s, size_t sn, int dest, void* r, size_t rn, int src, DType t, int tag) override {
    return check(s, r, "send_recv") ? inner_->send_recv(s, sn, dest, r, rn, src, t, tag) : refused();
  }
  Status barrier() override { return inner_->barrier(); }
  Result<std::unique_ptr<comm::Communicator>> split(int color, int key, const std::string& name) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> part, inner_->split(color, key, name));
    if (part == nullptr) return part;
    return std::unique_ptr<comm::Communicator>(std::make_unique<HostOnly>(std::move(part), device_));
  }

 private:
  bool check(const void* s, const void* r, const char* what) const {
    for (const void* p : {s, r}) {
      if (p != nullptr && device_.owns(p, 0)) {
        ADD_FAILURE() << what << " on group '" << name() << "' was handed device memory";
        return false;
      }
    }
    return true;
  }
  // Still collective: a refused call would leave the other ranks waiting, so the run stops here.
  static Status refused() { return Status::internal("device memory handed to MPI"); }
  std::unique_ptr<comm::Communicator> owned_;
  comm::Communicator* inner_;
  const kernels::Device& device_;
};

TEST(StagedCommunicator, EveryCallOnDeviceBuffersGivesTheHostCallsBits) {
  auto world = world_or_die();
  ASSERT_NE(world, nullptr);
  ASSERT_EQ(world->size(), 2) << "run under mpiexec -np 2 (CTest does)";
  UnaddressableDevice dev;
  HostOnly checked(*world, dev);
  StagedCommunicator staged(checked, dev);
  const int r = world->rank(), R = world->size();
  const size_t n = 1000;
  const std::vector<float> x = input(r, n);

  // all_reduce: device to device, in place, and each side on the host.
  std::vector<float> want(n);
  ASSERT_TRUE(world->all_reduce(x.data(), want.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  {
    auto s = on_device(dev, x), d = on_device(dev, std::vector<float>(n));
    ASSERT_TRUE(staged.all_reduce(s.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(to_host(dev, d, n), want);
    ASSERT_TRUE(staged.all_reduce(s.data(), s.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(to_host(dev, s, n), want) << "in place";
    std::vector<float> h(n);
    auto s2 = on_device(dev, x);
    ASSERT_TRUE(staged.all_reduce(s2.data(), h.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(h, want) << "device to host";
    auto d2 = on_device(dev, std::vector<float>(n));
    ASSERT_TRUE(staged.all_reduce(x.data(), d2.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(to_host(dev, d2, n), want) << "host to device";
  }
  // all_gather: separate, in place, and host shards into a device buffer (ZeRO-3's gather).
  std::vector<float> gathered(n * R);
  ASSERT_TRUE(world->all_gather(x.data(), gathered.data(), n, DType::kF32).is_ok());
  {
    auto s = on_device(dev, x), d = on_device(dev, std::vector<float>(n * R));
    ASSERT_TRUE(staged.all_gather(s.data(), d.data(), n, DType::kF32).is_ok());
    EXPECT_EQ(to_host(dev, d, n * R), gathered);
    std::vector<float> mine(n * R, -1.0f);
    std::memcpy(mine.data() + r * n, x.data(), n * sizeof(float));
    auto ip = on_device(dev, mine);
    ASSERT_TRUE(staged.all_gather(ip.as<float>() + r * n, ip.data(), n, DType::kF32).is_ok());
    EXPECT_EQ(to_host(dev, ip, n * R), gathered) << "in place";
    auto d2 = on_device(dev, std::vector<float>(n * R));
    ASSERT_TRUE(staged.all_gather(x.data(), d2.data(), n, DType::kF32).is_ok());
    EXPECT_EQ(to_host(dev, d2, n * R), gathered) << "host to device";
  }
  // reduce_scatter: device to device, and device gradients into host memory (ZeRO-3's reduce).
  const std::vector<float> big = input(r, n * R);
  std::vector<float> scattered(n);
  ASSERT_TRUE(world->reduce_scatter(big.data(), scattered.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  {
    auto s = on_device(dev, big), d = on_device(dev, std::vector<float>(n));
    ASSERT_TRUE(staged.reduce_scatter(s.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(to_host(dev, d, n), scattered);
    std::vector<float> h(n);
    ASSERT_TRUE(staged.reduce_scatter(s.data(), h.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(h, scattered) << "device to host";
  }
  // broadcast, send/recv and send_recv (bf16 too: data movement takes any dtype).
  {
    auto b = on_device(dev, x);
    ASSERT_TRUE(staged.broadcast(b.data(), 2 * n, DType::kBF16, 1).is_ok());
    EXPECT_EQ(to_host(dev, b, n), input(1, n));
    auto s = on_device(dev, x), d = on_device(dev, std::vector<float>(n));
    if (r == 0) {
      ASSERT_TRUE(staged.send(s.data(), n, DType::kF32, 1, 7).is_ok());
    } else {
      ASSERT_TRUE(staged.recv(d.data(), n, DType::kF32, 0, 7).is_ok());
      EXPECT_EQ(to_host(dev, d, n), input(0, n));
    }
    auto e = on_device(dev, std::vector<float>(n));
    ASSERT_TRUE(staged.send_recv(s.data(), n, 1 - r, e.data(), n, 1 - r, DType::kF32, 8).is_ok());
    EXPECT_EQ(to_host(dev, e, n), input(1 - r, n));
  }
  EXPECT_GT(staged.bytes_down(), 0u);
  EXPECT_GT(staged.bytes_up(), 0u);
  // Host buffers pass straight through: nothing staged.
  const size_t down = staged.bytes_down(), up = staged.bytes_up();
  std::vector<float> h(n);
  ASSERT_TRUE(staged.all_reduce(x.data(), h.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(h, want);
  EXPECT_EQ(staged.bytes_down(), down);
  EXPECT_EQ(staged.bytes_up(), up);
  // A split is staged too.
  auto half = staged.split(0, r, "both");
  ASSERT_TRUE(half.is_ok());
  auto s = on_device(dev, x), d = on_device(dev, std::vector<float>(n));
  ASSERT_TRUE(half.value()->all_reduce(s.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(dev, d, n), want);
  EXPECT_GT(static_cast<StagedCommunicator&>(*half.value()).bytes_up(), 0u);
  // A range that starts in a device buffer and runs past its end is an error (every rank, before any call),
  // not host memory for MPI to read.
  const Status past = staged.all_reduce(s.data(), s.data(), n + 1, DType::kF32, comm::ReduceOp::kSum);
  EXPECT_FALSE(past.is_ok());
  EXPECT_NE(past.message().find("runs past the end of its allocation"), std::string::npos) << past.to_string();
}

using StagedTrainTest = TrainerTest;

// Data parallelism with ZeRO stages 0-3, tensor parallelism (with and without sequence parallelism) and a
// two-stage 1F1B pipeline, each trained on the CPU device and on the same device posing as one the host cannot
// address: the same losses and norms, and the same checkpoint bytes; and MPI is never handed the device's memory.
TEST_F(StagedTrainTest, EveryParallelModeOnAnUnaddressableDeviceIsBitwiseTheCpuRun) {
  auto world = world_or_die();
  ASSERT_NE(world, nullptr);
  struct Run {
    const char* name;
    int tp, pp;
    json zero;
    bool sequence_parallel = false;
    bool staged = true;  // whether device buffers reach the communicator (ZeRO-2 packs its pieces on the host)
  };
  const Run runs[] = {
      {"dp", 1, 1, json()},
      {"zero1", 1, 1, {{"stage", 1}}},
      {"zero2", 1, 1, {{"stage", 2}}, false, false},
      {"zero3", 1, 1, {{"stage", 3}}},
      {"tp", 2, 1, json()},
      {"tp_sp", 2, 1, json(), true},
      {"pp", 1, 2, json()},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(run.name);
    auto grid = comm::RankGrid::create(*world, run.tp, run.pp);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    UnaddressableDevice posing;
    for (const bool staged : {false, true}) {
      const std::string name = fmt::format("{}_{}", run.name, staged ? "staged" : "cpu");
      json j = base_config(name);
      j["model"]["n_head"] = 4;
      j["training"]["max_steps"] = 4;
      j["training"]["val_every"] = 2;
      j["training"]["grad_accum_steps"] = 2;
      j["parallel"] = {{"tensor_parallel_size", run.tp},
                       {"pipeline_parallel_size", run.pp},
                       {"sequence_parallel", run.sequence_parallel}};
      if (!run.zero.is_null()) j["zero_optimization"] = run.zero;
      device_ = staged ? &posing : nullptr;
      HostOnly dp(grid.value()->dp(), posing), pp(grid.value()->pp(), posing), tp(grid.value()->tp(), posing);
      const auto trained = train(j, "", (dir_ / (name + ".jsonl")).string(), &dp, &pp, &tp);
      device_ = nullptr;
      ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    }
    if (run.staged) {
      EXPECT_GT(posing.downloaded.load(), 0u) << "the staged run moved device memory through the host";
      EXPECT_GT(posing.uploaded.load(), 0u);
    }
    if (world->rank() == 0) {
      const std::string cpu = fmt::format("{}_cpu", run.name), staged = fmt::format("{}_staged", run.name);
      const auto a = losses(dir_ / (cpu + ".jsonl")), b = losses(dir_ / (staged + ".jsonl"));
      EXPECT_EQ(a.size(), 4u);
      EXPECT_EQ(a, b);
      for (const char* f : {"model.safetensors", "optimizer.safetensors"})
        EXPECT_TRUE(file_bytes(dir_ / cpu / "step_000004" / f) == file_bytes(dir_ / staged / "step_000004" / f)) << f;
    }
    ASSERT_TRUE(world->barrier().is_ok());
  }
}

}  // namespace
}  // namespace strata::engine
