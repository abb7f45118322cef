// nccl_comm_test.cpp — the NCCL communicator (device buffers) against the collectives' definitions, on one GPU
// as a world of one (what a one-GPU machine can check: every call's path through NCCL, the stream polling and
// the refusals; data only moves between ranks with several GPUs, which no machine here has). The bootstrap is
// a world of one in this process, so the test needs no MPI runtime (scripts/gpu-check.sh runs it from a
// bundle). Skipped, with the reason, where no GPU is usable.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "comm/nccl_communicator.h"
#include "tests/comm/self_communicator.h"

namespace strata::comm {
namespace {

using testing::SelfCommunicator;

class NcclCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no usable CUDA GPU";
    world_ = std::make_unique<SelfCommunicator>();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    auto n = NcclCommunicator::create(*world_, "nccl", 60);
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    nccl_ = std::move(n).value();
  }
  // A device copy of `host`, and back.
  float* to_device(const std::vector<float>& host) {
    float* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(host.size(), 1) * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    buffers_.push_back(d);
    return d;
  }
  static std::vector<float> to_host(const float* d, size_t n) {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  void TearDown() override {
    for (float* d : buffers_) cudaFree(d);
    nccl_.reset();
    world_.reset();
  }
  std::unique_ptr<Communicator> world_;
  std::unique_ptr<NcclCommunicator> nccl_;
  std::vector<float*> buffers_;
};

TEST_F(NcclCommTest, CollectivesMatchTheirDefinitions) {
  const int r = nccl_->rank(), n = nccl_->size();
  constexpr size_t kCount = 1000;
  std::vector<float> mine(kCount);
  for (size_t i = 0; i < kCount; ++i) mine[i] = static_cast<float>((r + 1) * 1000 + i);
  float* d_mine = to_device(mine);
  float* d_sum = to_device(std::vector<float>(kCount));
  ASSERT_TRUE(nccl_->all_reduce(d_mine, d_sum, kCount, DType::kF32, ReduceOp::kSum).is_ok());
  const std::vector<float> sum = to_host(d_sum, kCount);
  for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(sum[i], static_cast<float>(1000 * n * (n + 1) / 2 + n * i)) << i;
  ASSERT_TRUE(nccl_->all_reduce(d_mine, d_sum, kCount, DType::kF32, ReduceOp::kMax).is_ok());
  EXPECT_EQ(to_host(d_sum, 1)[0], static_cast<float>(n * 1000));

  // All-gather in place: this rank's part already sits in the output.
  std::vector<float> whole(kCount * n, -1.0f);
  std::copy(mine.begin(), mine.end(), whole.begin() + static_cast<std::ptrdiff_t>(r * kCount));
  float* d_whole = to_device(whole);
  ASSERT_TRUE(nccl_->all_gather(d_whole + r * kCount, d_whole, kCount, DType::kF32).is_ok());
  const std::vector<float> gathered = to_host(d_whole, kCount * n);
  for (int q = 0; q < n; ++q)
    for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(gathered[q * kCount + i], static_cast<float>((q + 1) * 1000 + i));

  float* d_shard = to_device(std::vector<float>(kCount));
  ASSERT_TRUE(nccl_->reduce_scatter(d_whole, d_shard, kCount, DType::kF32, ReduceOp::kSum).is_ok());
  const std::vector<float> shard = to_host(d_shard, kCount);
  for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(shard[i], static_cast<float>(n) * gathered[r * kCount + i]) << i;

  float* d_b = to_device(std::vector<float>(17, static_cast<float>(r == 0 ? 7 : 0)));
  ASSERT_TRUE(nccl_->broadcast(d_b, 17, DType::kF32, 0).is_ok());
  EXPECT_EQ(to_host(d_b, 17), std::vector<float>(17, 7.0f));
  EXPECT_TRUE(nccl_->barrier().is_ok());

  auto half = nccl_->split(r % 2, r, "half");
  ASSERT_TRUE(half.is_ok()) << half.status().to_string();
  EXPECT_EQ(half.value()->size(), (n - r % 2 + 1) / 2);
  EXPECT_TRUE(half.value()->barrier().is_ok());
}

TEST_F(NcclCommTest, BadInputIsRefusedByName) {
  float* d = to_device(std::vector<float>(4));
  const Status bf16 = nccl_->all_reduce(d, d, 4, DType::kBF16, ReduceOp::kSum);
  EXPECT_EQ(bf16.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bf16.message().find("fp32 only"), std::string::npos) << bf16.to_string();
  EXPECT_EQ(nccl_->broadcast(d, 4, DType::kF32, nccl_->size()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(nccl_->send(d, 4, DType::kF32, nccl_->rank(), 0).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::comm
