// nccl_plane_test.cpp — the groups' collectives on the GPU with NCCL as the device plane
// (comm/staged_communicator.h), as a world of one on one GPU: device_collectives() takes NCCL for "auto" and
// "nccl", a call with any buffer in the CUDA device's memory goes over it (host buffers of such a call copied
// through device staging), one on host buffers alone over the host communicator, and every result is the
// collective's definition. What one GPU can check: the routing, NCCL's stream after the compute stream's
// kernels, the device staging; data moves between ranks only with several GPUs, which no machine here has
// (tests/comm/staged_train_test.cpp checks the same routing over 2 ranks, with MPI posing as NCCL). Skipped,
// with the reason, where no GPU is usable.
#include <cuda_runtime.h>

#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm/staged_communicator.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/device.h"
#include "tests/comm/self_communicator.h"

namespace strata::engine {
namespace {

class NcclPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = kernels::make_device("cuda", kernels::cpu_fast_kernels());
    if (!d.is_ok()) GTEST_SKIP() << "no GPU here: " << d.status().message();
    device_ = std::move(d).value();
  }
  kernels::DeviceBuffer on_device(const std::vector<float>& host) {
    auto b = device_->allocate(host.size() * sizeof(float), "test");
    EXPECT_TRUE(b.is_ok());
    device_->copy_to_device(b->data(), host.data(), host.size() * sizeof(float));
    return std::move(b).value();
  }
  std::vector<float> to_host(const kernels::DeviceBuffer& b, size_t n) {
    std::vector<float> x(n);
    device_->copy_to_host(x.data(), b.data(), n * sizeof(float));
    return x;
  }
  comm::testing::SelfCommunicator self_;
  std::unique_ptr<kernels::Device> device_;
};

TEST_F(NcclPlaneTest, DeviceBuffersGoOverNcclAndHostBuffersOverTheHost) {
  std::unique_ptr<comm::Communicator> owned;
  auto group = comm::device_collectives(&self_, *device_, "nccl", {}, &owned);
  ASSERT_TRUE(group.is_ok()) << group.status().to_string();
  auto& staged = dynamic_cast<comm::StagedCommunicator&>(*group.value());
  ASSERT_TRUE(staged.has_device_plane()) << "NCCL for \"nccl\"";

  const size_t n = 1 << 20;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 1013) - 500.0f;
  // Work still queued on the compute stream when the call starts must be waited for: the zero below runs only
  // after a host function that sleeps 200 ms, so an all-reduce that did not wait would read `x`, not zeros.
  auto s = on_device(x), d = on_device(std::vector<float>(n, -1.0f));
  ASSERT_EQ(cudaLaunchHostFunc(
                kernels::cuda::cuda_context().compute,
                [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr),
            cudaSuccess);
  device_->zero(s.data(), n * sizeof(float));
  ASSERT_TRUE(staged.all_reduce(s.data(), d.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(d, n), std::vector<float>(n, 0.0f)) << "after the compute stream's kernels";
  device_->copy_to_device(s.data(), x.data(), n * sizeof(float));
  ASSERT_TRUE(staged.all_reduce(s.data(), s.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(to_host(s, n), x) << "in place";
  ASSERT_TRUE(staged.all_gather(s.data(), d.data(), n, DType::kF32).is_ok());
  EXPECT_EQ(to_host(d, n), x);
  ASSERT_TRUE(staged.broadcast(d.data(), 2 * n, DType::kBF16, 0).is_ok());
  EXPECT_EQ(to_host(d, n), x) << "a world of one's broadcast leaves the root's bytes";
  EXPECT_EQ(staged.device_plane_calls(), 4u);
  EXPECT_EQ(staged.bytes_up() + staged.bytes_down(), 0u) << "nothing staged";

  // Mixed: host shards into device memory and device memory into host shards, through device staging.
  auto g = on_device(std::vector<float>(n, -1.0f));
  ASSERT_TRUE(staged.all_gather(x.data(), g.data(), n, DType::kF32).is_ok());
  EXPECT_EQ(to_host(g, n), x) << "host to device";
  std::vector<float> h(n, -1.0f);
  ASSERT_TRUE(staged.reduce_scatter(g.data(), h.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(h, x) << "device to host";
  EXPECT_EQ(staged.device_plane_calls(), 6u);
  EXPECT_EQ(staged.bytes_up(), n * sizeof(float));
  EXPECT_EQ(staged.bytes_down(), n * sizeof(float));

  // Host buffers alone: the host communicator.
  std::vector<float> h2(n);
  ASSERT_TRUE(staged.all_reduce(x.data(), h2.data(), n, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(h2, x);
  EXPECT_EQ(staged.device_plane_calls(), 6u);

  // A split has NCCL too.
  auto part = staged.split(0, 0, "part");
  ASSERT_TRUE(part.is_ok()) << part.status().to_string();
  auto& p = dynamic_cast<comm::StagedCommunicator&>(*part.value());
  ASSERT_TRUE(p.has_device_plane());
  ASSERT_TRUE(p.all_reduce(s.data(), d.data(), n, DType::kF32, comm::ReduceOp::kMax).is_ok());
  EXPECT_EQ(to_host(d, n), x);
  EXPECT_EQ(p.device_plane_calls(), 1u);
}

TEST_F(NcclPlaneTest, MpiStagesEverythingAndAutoTakesNccl) {
  std::unique_ptr<comm::Communicator> owned;
  auto mpi = comm::device_collectives(&self_, *device_, "mpi", {}, &owned);
  ASSERT_TRUE(mpi.is_ok()) << mpi.status().to_string();
  EXPECT_FALSE(dynamic_cast<comm::StagedCommunicator&>(*mpi.value()).has_device_plane());
  std::unique_ptr<comm::Communicator> owned2;
  auto automatic = comm::device_collectives(&self_, *device_, "auto", {}, &owned2);
  ASSERT_TRUE(automatic.is_ok()) << automatic.status().to_string();
  EXPECT_TRUE(dynamic_cast<comm::StagedCommunicator&>(*automatic.value()).has_device_plane())
      << "one rank on its own GPU: NCCL";
}

}  // namespace
}  // namespace strata::engine
