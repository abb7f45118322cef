// staged_train_test.cpp — run by CTest under `mpiexec -np 2`: the collectives of a device the host cannot
// address, staged through host memory over MPI (comm/staged_communicator.h), on the CPU device posing as such
// a device (tests/forwarding_device.h). Staging only moves bytes, so every call gives bitwise what the MPI
// communicator gives on host buffers, and every parallel mode trains bitwise as on the plain CPU device.
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "comm/grid.h"
#include "comm/mpi_communicator.h"
#include "comm/staged_communicator.h"
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

// What a communicator is handed, checked: a Communicator that forwards to another and records a failure for
// every buffer in the wrong memory. The host plane (MPI) must never get `device`'s memory (MPI would read a GPU's
// pointer as host memory); the device plane (NCCL) must never get the host's. Its splits check too, and it
// counts the calls it forwards.
class Checked final : public comm::Communicator {
 public:
  enum class Memory { kHost, kDevice };
  Checked(comm::Communicator& inner, const kernels::Device& device, Memory want = Memory::kHost,
          std::atomic<size_t>* calls = nullptr)
      : inner_(&inner), device_(device), want_(want), calls_(calls) {}
  Checked(std::unique_ptr<comm::Communicator> inner, const kernels::Device& device, Memory want,
          std::atomic<size_t>* calls)
      : owned_(std::move(inner)), inner_(owned_.get()), device_(device), want_(want), calls_(calls) {}
  // A device plane posing as NCCL for `group` (a host-checked MPI group): a split of that MPI group, so that a
  // call one rank makes on this plane and another on the host plane never meets (the test times out instead of
  // passing), checked to take device memory alone, to reduce fp32 alone, and matching messages in order per
  // peer whatever their tags, as NCCL does.
  static comm::DevicePlaneFactory device_plane(const kernels::Device& device, std::atomic<size_t>* calls) {
    return [&device, calls](comm::Communicator& group) -> Result<std::unique_ptr<comm::Communicator>> {
      comm::Communicator& mpi = *dynamic_cast<Checked&>(group).inner_;
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> part,
                              mpi.split(0, mpi.rank(), mpi.name() + ".plane"));
      return std::unique_ptr<comm::Communicator>(
          std::make_unique<Checked>(std::move(part), device, Memory::kDevice, calls));
    };
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  Status all_reduce(const void* s, void* r, size_t n, DType t, comm::ReduceOp op) override {
    return check(s, r, "all_reduce", t) ? inner_->all_reduce(s, r, n, t, op) : refused();
  }
  Status all_gather(const void* s, void* r, size_t n, DType t) override {
    return check(s, r, "all_gather") ? inner_->all_gather(s, r, n, t) : refused();
  }
  Status reduce_scatter(const void* s, void* r, size_t n, DType t, comm::ReduceOp op) override {
    return check(s, r, "reduce_scatter", t) ? inner_->reduce_scatter(s, r, n, t, op) : refused();
  }
  Status broadcast(void* b, size_t n, DType t, int root) override {
    return check(b, b, "broadcast") ? inner_->broadcast(b, n, t, root) : refused();
  }
  Status send(const void* b, size_t n, DType t, int peer, int tag) override {
    return check(b, b, "send") ? inner_->send(b, n, t, peer, plane_tag(tag)) : refused();
  }
  Status recv(void* b, size_t n, DType t, int peer, int tag) override {
    return check(b, b, "recv") ? inner_->recv(b, n, t, peer, plane_tag(tag)) : refused();
  }
  Status send_recv(const void* s, size_t sn, int dest, void* r, size_t rn, int src, DType t, int tag) override {
    return check(s, r, "send_recv") ? inner_->send_recv(s, sn, dest, r, rn, src, t, plane_tag(tag)) : refused();
  }
  Status barrier() override { return inner_->barrier(); }
  Result<std::unique_ptr<comm::Communicator>> split(int color, int key, const std::string& name) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> part, inner_->split(color, key, name));
    if (part == nullptr) return part;
    return std::unique_ptr<comm::Communicator>(std::make_unique<Checked>(std::move(part), device_, want_, calls_));
  }
  double timeout() const override { return inner_->timeout(); }
  void set_timeout(double seconds) override { inner_->set_timeout(seconds); }

 private:
  int plane_tag(int tag) const { return want_ == Memory::kDevice ? 0 : tag; }
  bool check(const void* s, const void* r, const char* what, DType reduced = DType::kF32) const {
    if (calls_ != nullptr) ++*calls_;
    if (want_ == Memory::kDevice && reduced != DType::kF32) {
      ADD_FAILURE() << what << " on the device plane of group '" << name() << "' reduces " << dtype_name(reduced);
      return false;
    }
    for (const void* p : {s, r}) {
      const bool on_device = p != nullptr && device_.owns(p, 0);
      if (want_ == Memory::kHost && on_device) {
        ADD_FAILURE() << what << " on group '" << name() << "' was handed device memory";
        return false;
      }
      if (want_ == Memory::kDevice && !on_device) {
        ADD_FAILURE() << what << " on the device plane of group '" << name() << "' was handed host memory";
        return false;
      }
    }
    return true;
  }
  // Still collective: a refused call would leave the other ranks waiting, so the run stops here.
  static Status refused() { return Status::internal("a buffer in the wrong memory for this communicator"); }
  std::unique_ptr<comm::Communicator> owned_;
  comm::Communicator* inner_;
  const kernels::Device& device_;
  Memory want_;
  std::atomic<size_t>* calls_;
};

TEST(StagedCommunicator, EveryCallOnDeviceBuffersGivesTheHostCallsBits) {
  auto world = world_or_die();
  ASSERT_NE(world, nullptr);
  ASSERT_EQ(world->size(), 2) << "run under mpiexec -np 2 (CTest does)";
  UnaddressableDevice dev;
  Checked checked(*world, dev);
  comm::StagedCommunicator staged(checked, dev);
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
  EXPECT_GT(static_cast<comm::StagedCommunicator&>(*half.value()).bytes_up(), 0u);
  // A range that starts in a device buffer and runs past its end is an error (every rank, before any call),
  // not host memory for MPI to read.
  const Status past = staged.all_reduce(s.data(), s.data(), n + 1, DType::kF32, comm::ReduceOp::kSum);
  EXPECT_FALSE(past.is_ok());
  EXPECT_NE(past.message().find("runs past the end of its allocation"), std::string::npos) << past.to_string();
}

// With a device plane, a call with any buffer on the device goes over it: untouched when all are there (nothing
// staged), with only the host side's own bytes copied when they mix; calls on host buffers alone go over the
// host communicator. The same bits every way.
TEST(StagedCommunicator, CallsOnDeviceBuffersGoOverTheDevicePlane) {
  auto world = world_or_die();
  ASSERT_NE(world, nullptr);
  ASSERT_EQ(world->size(), 2) << "run under mpiexec -np 2 (CTest does)";
  UnaddressableDevice dev;
  Checked checked(*world, dev);
  std::atomic<size_t> calls{0};
  auto plane = Checked::device_plane(dev, &calls)(checked);
  ASSERT_TRUE(plane.is_ok()) << plane.status().to_string();
  comm::StagedCommunicator staged(checked, dev, std::move(plane).value());
  ASSERT_TRUE(staged.has_device_plane());
  const int r = world->rank(), R = world->size();
  const size_t n = 1000;
  const std::vector<float> x = input(r, n), big = input(r, n * R);
  std::vector<float> sum(n), gathered(n * R), scattered(n);
  ASSERT_TRUE(world->all_reduce(x.data(), sum.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  ASSERT_TRUE(world->all_gather(x.data(), gathered.data(), n, DType::kF32).is_ok());
  ASSERT_TRUE(world->reduce_scatter(big.data(), scattered.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());

  // Device to device: the plane, nothing staged.
  auto s = on_device(dev, x), d = on_device(dev, std::vector<float>(n));
  ASSERT_TRUE(staged.all_reduce(s.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(dev, d, n), sum);
  ASSERT_TRUE(staged.all_reduce(s.data(), s.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(dev, s, n), sum) << "in place";
  std::vector<float> mine(n * R, -1.0f);
  std::memcpy(mine.data() + r * n, x.data(), n * sizeof(float));
  auto ip = on_device(dev, mine);
  ASSERT_TRUE(staged.all_gather(ip.as<float>() + r * n, ip.data(), n, DType::kF32).is_ok());
  EXPECT_EQ(to_host(dev, ip, n * R), gathered) << "all_gather in place";
  auto sb = on_device(dev, big);
  ASSERT_TRUE(staged.reduce_scatter(sb.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(dev, d, n), scattered);
  auto b = on_device(dev, x);
  ASSERT_TRUE(staged.broadcast(b.data(), 2 * n, DType::kBF16, 1).is_ok());
  EXPECT_EQ(to_host(dev, b, n), input(1, n));
  auto xs = on_device(dev, x), e = on_device(dev, std::vector<float>(n));
  ASSERT_TRUE(staged.send_recv(xs.data(), n, 1 - r, e.data(), n, 1 - r, DType::kF32, 8).is_ok());
  EXPECT_EQ(to_host(dev, e, n), input(1 - r, n));
  if (r == 0) {
    ASSERT_TRUE(staged.send(xs.data(), n, DType::kF32, 1, 7).is_ok());
  } else {
    ASSERT_TRUE(staged.recv(e.data(), n, DType::kF32, 0, 7).is_ok());
    EXPECT_EQ(to_host(dev, e, n), input(0, n));
  }
  EXPECT_EQ(staged.device_plane_calls(), 7u);
  EXPECT_EQ(calls.load(), 7u);
  EXPECT_EQ(staged.bytes_down(), 0u) << "nothing staged";
  EXPECT_EQ(staged.bytes_up(), 0u);

  // Host buffers alone: the host communicator, nothing staged.
  std::vector<float> h(n);
  ASSERT_TRUE(staged.all_reduce(x.data(), h.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(h, sum);
  EXPECT_EQ(staged.device_plane_calls(), 7u);
  EXPECT_EQ(staged.bytes_down() + staged.bytes_up(), 0u);
  // Mixed: the plane, with only this rank's part copied (ZeRO-3's gather of host shards into a device buffer,
  // and its reduce-scatter of device gradients into host memory).
  auto d2 = on_device(dev, std::vector<float>(n * R));
  ASSERT_TRUE(staged.all_gather(x.data(), d2.data(), n, DType::kF32).is_ok());
  EXPECT_EQ(to_host(dev, d2, n * R), gathered) << "host shards into a device buffer";
  EXPECT_EQ(staged.bytes_up(), n * sizeof(float));
  ASSERT_TRUE(staged.reduce_scatter(sb.data(), h.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(h, scattered) << "device gradients into host memory";
  EXPECT_EQ(staged.bytes_down(), n * sizeof(float));
  std::vector<float> h2(n), twice(n);  // `s` holds the sum on every rank since the in-place call
  for (size_t i = 0; i < n; ++i) twice[i] = static_cast<float>(R) * sum[i];
  ASSERT_TRUE(staged.all_reduce(s.data(), h2.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(h2, twice) << "device to host";
  EXPECT_EQ(staged.device_plane_calls(), 10u);
  EXPECT_EQ(calls.load(), 10u);

  // A split has a plane of its own.
  auto half = staged.split(0, r, "both");
  ASSERT_TRUE(half.is_ok()) << half.status().to_string();
  auto& part = static_cast<comm::StagedCommunicator&>(*half.value());
  ASSERT_TRUE(part.has_device_plane());
  auto s2 = on_device(dev, x);
  ASSERT_TRUE(part.all_reduce(s2.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(dev, d, n), sum);
  EXPECT_EQ(part.device_plane_calls(), 1u);
  EXPECT_EQ(calls.load(), 11u);
}

// Two ranks share a GPU when their host and bus agree, or their UUIDs do (containers that name one host twice).
TEST(DeviceCollectives, SameGpuByHostAndBusOrByUuid) {
  EXPECT_TRUE(comm::same_gpu("h1/0000:1B:00.0 GPU-aa", "h1/0000:1B:00.0 GPU-aa"));
  EXPECT_TRUE(comm::same_gpu("h1/0000:1B:00.0 GPU-aa", "h2/0000:1B:00.0 GPU-aa")) << "one GPU, two host names";
  EXPECT_TRUE(comm::same_gpu("h1/0000:1B:00.0 GPU-aa", "h1/0000:1B:00.0 GPU-bb")) << "MIG instances of one GPU";
  EXPECT_FALSE(comm::same_gpu("h1/0000:1B:00.0 GPU-aa", "h1/0000:1C:00.0 GPU-bb"));
  EXPECT_FALSE(comm::same_gpu("h1/0000:1B:00.0 GPU-aa", "h2/0000:1B:00.0 GPU-bb")) << "same slot, two machines";
  EXPECT_FALSE(comm::same_gpu("", "")) << "unknown places are nobody's";
}

// A device plane that starts on rank 0 and fails on rank 1 (the split is collective, so both make it first):
// under "auto" neither rank keeps a plane, and a call on device buffers meets over MPI; under "nccl" both fail,
// the error named on the rank it happened on. Neither hangs (a rank with a plane its peer lacks would).
TEST(DeviceCollectives, APlaneThatFailsOnOneRankIsDroppedOnEvery) {
  auto world = world_or_die();
  ASSERT_NE(world, nullptr);
  ASSERT_EQ(world->size(), 2) << "run under mpiexec -np 2 (CTest does)";
  UnaddressableDevice dev;
  std::atomic<size_t> calls{0};
  const comm::DevicePlaneFactory posing = Checked::device_plane(dev, &calls);
  const comm::DevicePlaneFactory fails_on_rank_1 =
      [&posing](comm::Communicator& group) -> Result<std::unique_ptr<comm::Communicator>> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> plane, posing(group));
    if (group.rank() == 1) return Status::internal("posing NCCL: no usable network on rank 1");
    return plane;
  };
  const int r = world->rank();
  const size_t n = 257;
  const std::vector<float> x = input(r, n);
  std::vector<float> sum(n);
  ASSERT_TRUE(world->all_reduce(x.data(), sum.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  {
    Checked checked(*world, dev);
    std::unique_ptr<comm::Communicator> owned;
    auto staged = comm::device_collectives(&checked, dev, "auto", fails_on_rank_1, &owned);
    ASSERT_TRUE(staged.is_ok()) << staged.status().to_string();
    auto& s = dynamic_cast<comm::StagedCommunicator&>(*staged.value());
    EXPECT_FALSE(s.has_device_plane());
    auto on = on_device(dev, x), out = on_device(dev, std::vector<float>(n));
    ASSERT_TRUE(s.all_reduce(on.data(), out.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
    EXPECT_EQ(to_host(dev, out, n), sum);
    EXPECT_EQ(s.device_plane_calls(), 0u);
  }
  {
    Checked checked(*world, dev);
    std::unique_ptr<comm::Communicator> owned;
    auto staged = comm::device_collectives(&checked, dev, "nccl", fails_on_rank_1, &owned);
    ASSERT_FALSE(staged.is_ok());
    const std::string message = staged.status().to_string();
    EXPECT_NE(message.find("parallel.distributed_backend \"nccl\""), std::string::npos) << message;
    EXPECT_NE(message.find(r == 1 ? "no usable network on rank 1" : "failed to start on another of its ranks"),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(calls.load(), 0u) << "no call went over a plane";
}

using StagedTrainTest = TrainerTest;

// Data parallelism with ZeRO stages 0-3, tensor parallelism (with and without sequence parallelism) and a
// two-stage 1F1B pipeline, each trained on the CPU device, on the same device posing as one the host cannot
// address (every device buffer staged), and on that device with a device plane posing as NCCL: the same losses
// and norms, and the same checkpoint bytes; MPI is never handed the device's memory, nor the plane the host's,
// and the ranks always meet on the same plane (a call one rank made on the plane and another on MPI would
// never complete: the test would time out).
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
  enum Variant { kCpu, kStaged, kPlane };
  const char* const variant_names[] = {"cpu", "staged", "plane"};
  for (const Run& run : runs) {
    SCOPED_TRACE(run.name);
    auto grid = comm::RankGrid::create(*world, run.tp, run.pp);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    UnaddressableDevice posing;
    std::atomic<size_t> plane_calls{0};
    size_t staged_bytes[3] = {0, 0, 0};
    for (const Variant v : {kCpu, kStaged, kPlane}) {
      const std::string name = fmt::format("{}_{}", run.name, variant_names[v]);
      json j = base_config(name);
      j["model"]["n_head"] = 4;
      j["training"]["max_steps"] = 4;
      j["training"]["val_every"] = 2;
      j["training"]["grad_accum_steps"] = 2;
      j["parallel"] = {{"tensor_parallel_size", run.tp},
                       {"pipeline_parallel_size", run.pp},
                       {"sequence_parallel", run.sequence_parallel},
                       {"distributed_backend", v == kStaged ? "mpi" : "auto"}};
      if (!run.zero.is_null()) j["zero_optimization"] = run.zero;
      device_ = v != kCpu ? &posing : nullptr;
      if (v == kPlane) device_plane_ = Checked::device_plane(posing, &plane_calls);
      Checked dp(grid.value()->dp(), posing), pp(grid.value()->pp(), posing), tp(grid.value()->tp(), posing);
      const size_t before = posing.downloaded.load() + posing.uploaded.load();
      const auto trained = train(j, "", (dir_ / (name + ".jsonl")).string(), &dp, &pp, &tp);
      staged_bytes[v] = posing.downloaded.load() + posing.uploaded.load() - before;
      device_ = nullptr;
      device_plane_ = nullptr;
      ASSERT_TRUE(trained.is_ok()) << trained.status().to_string();
    }
    if (run.staged) {
      EXPECT_GT(staged_bytes[kStaged], 0u) << "the staged run moved device memory through the host";
      EXPECT_GT(plane_calls.load(), 0u) << "the device plane carried the calls on device buffers";
      EXPECT_LT(staged_bytes[kPlane], staged_bytes[kStaged]) << "copying less between host and device";
    } else {
      EXPECT_EQ(plane_calls.load(), 0u);
    }
    if (world->rank() == 0) {
      const auto cpu = losses(dir_ / fmt::format("{}_cpu.jsonl", run.name));
      EXPECT_EQ(cpu.size(), 4u);
      for (const Variant v : {kStaged, kPlane}) {
        const std::string name = fmt::format("{}_{}", run.name, variant_names[v]);
        SCOPED_TRACE(name);
        EXPECT_EQ(losses(dir_ / (name + ".jsonl")), cpu);
        for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
          const fs::path a = dir_ / fmt::format("{}_cpu", run.name) / "step_000004" / f;
          EXPECT_TRUE(file_bytes(a) == file_bytes(dir_ / name / "step_000004" / f)) << f;
        }
      }
    }
    ASSERT_TRUE(world->barrier().is_ok());
  }
}

}  // namespace
}  // namespace strata::engine
