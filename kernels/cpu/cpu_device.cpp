// cpu_device.cpp — the "cpu" Device: host memory (AlignedBuffer, so the memory ledger counts it), synchronous
// copies, and a CPU KernelSet.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "common/aligned.h"
#include "kernels/cpu/fast.h"
#include "kernels/device.h"

namespace strata::kernels {
namespace {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const KernelSet& k) : k_(&k) {}
  const char* name() const override { return "cpu"; }
  std::string description() const override { return std::string("cpu (") + k_->name + " kernels)"; }
  const KernelSet& kernels() const override { return *k_; }
  bool host_accessible() const override { return true; }

  Result<DeviceBuffer> allocate_impl(size_t bytes, const std::string& purpose) override {
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(bytes, purpose));
    void* data = buf.data();
    auto holder = std::make_shared<AlignedBuffer>(std::move(buf));
    return DeviceBuffer(data, bytes, purpose, [holder]() mutable { holder->reset(); });
  }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (dst != src) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (dst != src) std::memcpy(dst, src, bytes);
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    if (dst != src) std::memcpy(dst, src, bytes);
  }
  void synchronize() override {}
  // The kernels run on the driving thread and have finished when they return: every fence has passed.
  void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  DeviceFence fence() override { return DeviceFence(); }
  double add_sum_squares(double sum, const float* x, size_t n) override {
    return cpu::fast::add_sum_squares(sum, x, n);
  }

 private:
  const KernelSet* k_;
};

}  // namespace

std::unique_ptr<Device> make_cpu_device(const KernelSet& cpu_kernels) {
  return std::make_unique<CpuDevice>(cpu_kernels);
}

}  // namespace strata::kernels
