// device_test.cpp — kernels/device.h on every device this machine has (cpu always, cuda where a GPU is usable):
// the memory budget (memory.device_memory_limit) is hard and its error names who holds what; released buffers
// return their bytes; the ledger groups purposes; copies round-trip; make_device says why a name cannot run.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"

namespace strata::kernels {
namespace {

std::vector<std::unique_ptr<Device>> devices() {
  std::vector<std::unique_ptr<Device>> out;
  out.push_back(make_cpu_device(cpu_fast_kernels()));
  if (auto gpu = make_device("cuda", cpu_fast_kernels()); gpu.is_ok()) out.push_back(std::move(gpu).value());
  return out;
}

TEST(DeviceTest, BudgetIsHardAndTheErrorNamesTheHolders) {
  for (auto& d : devices()) {
    SCOPED_TRACE(d->name());
    d->set_memory_limit(3u << 20);
    auto a = d->allocate(1u << 20, "gpt2.params h.0");
    auto b = d->allocate(1u << 20, "gpt2.params h.1");
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    EXPECT_EQ(d->live_bytes(), 2u << 20);
    auto c = d->allocate((1u << 20) + 1, "gpt2.activations");
    ASSERT_FALSE(c.is_ok());
    EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
    const std::string msg = c.status().message();
    for (const char* needle : {"gpt2.activations", "memory.device_memory_limit", "gpt2.params 0.002 GiB"})
      EXPECT_NE(msg.find(needle), std::string::npos) << needle << " not in: " << msg;
    EXPECT_EQ(d->live_bytes(), 2u << 20) << "a refused allocation must reserve nothing";

    a.value().reset();  // released: its bytes come back
    EXPECT_EQ(d->live_bytes(), 1u << 20);
    auto again = d->allocate((1u << 20) + 1, "gpt2.activations");
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
    EXPECT_EQ(d->peak_bytes(), (2u << 20) + 1);
    const std::string report = d->memory_report();
    EXPECT_NE(report.find("gpt2.activations"), std::string::npos) << report;
    EXPECT_NE(report.find("limit 0.003 GiB"), std::string::npos) << report;
  }
}

TEST(DeviceTest, BuffersAreZeroedAndCopiesRoundTrip) {
  for (auto& d : devices()) {
    SCOPED_TRACE(d->name());
    const size_t n = 4099;
    auto buf = d->allocate(n * sizeof(float), "test");
    ASSERT_TRUE(buf.is_ok());
    std::vector<float> host(n, 1.0f), back(n, -1.0f);
    d->copy_to_host(back.data(), buf->data(), n * sizeof(float));
    EXPECT_EQ(back, std::vector<float>(n, 0.0f)) << "allocate() must zero-fill";
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f - 7.0f;
    d->copy_to_device(buf->data(), host.data(), n * sizeof(float));
    d->copy_to_host(back.data(), buf->data(), n * sizeof(float));
    EXPECT_EQ(back, host);
    double want = 0;
    for (float x : host) want += static_cast<double>(x) * x;
    EXPECT_DOUBLE_EQ(d->add_sum_squares(1.5, buf->as<float>(), n), 1.5 + want);
  }
}

// owns() tells a device's buffers (and ranges inside one) from anything else, and forgets a released buffer.
TEST(DeviceTest, OwnsItsLiveBuffersAndNothingElse) {
  for (auto& d : devices()) {
    SCOPED_TRACE(d->name());
    auto a = d->allocate(4096, "a");
    auto b = d->allocate(100, "b");
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    const auto* pa = static_cast<const std::byte*>(a->data());
    EXPECT_TRUE(d->owns(pa, 4096));
    EXPECT_TRUE(d->owns(pa + 1000, 3096)) << "a range inside the buffer";
    EXPECT_TRUE(d->owns(pa + 4095, 0));
    EXPECT_FALSE(d->owns(pa + 1000, 3097)) << "past its end";
    if (pa + 4096 != b->data()) {
      EXPECT_FALSE(d->owns(pa + 4096, 1)) << "one past its end";
    }
    EXPECT_TRUE(d->owns(b->data(), 100));
    std::vector<float> host(10);
    EXPECT_FALSE(d->owns(host.data(), sizeof(float)));
    int local = 0;
    EXPECT_FALSE(d->owns(&local, sizeof(local)));
    const void* gone = b->data();
    b.value().reset();
    EXPECT_FALSE(d->owns(gone, 1)) << "released";
  }
}

TEST(DeviceTest, MakeDeviceExplainsWhatItCannotRun) {
  auto bad = make_device("tpu", cpu_fast_kernels());
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("'tpu'"), std::string::npos) << bad.status().message();
  auto any = make_device("auto", cpu_fast_kernels());
  ASSERT_TRUE(any.is_ok()) << "auto always finds a device";
  auto gpu = make_device("cuda", cpu_fast_kernels());
  if (!gpu.is_ok()) {
    EXPECT_EQ(std::string(any.value()->name()), "cpu");
    EXPECT_NE(gpu.status().message().find("compute.device = 'cuda'"), std::string::npos) << gpu.status().message();
  } else {
    EXPECT_EQ(std::string(any.value()->name()), "cuda") << "auto prefers the GPU";
  }
}

}  // namespace
}  // namespace strata::kernels
