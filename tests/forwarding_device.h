// forwarding_device.h — a test Device that forwards everything to the CPU device, for tests to override the
// one behaviour they change (slow downloads, host registration, a device the host cannot address).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"

namespace strata::testing {

class ForwardingDevice : public kernels::Device {
 public:
  const char* name() const override { return "cpu"; }
  std::string description() const override { return "cpu (forwarding test device)"; }
  const kernels::KernelSet& kernels() const override { return inner_->kernels(); }
  bool host_accessible() const override { return true; }
  void zero(void* dst, size_t bytes) override { inner_->zero(dst, bytes); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override { inner_->copy_to_device(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { inner_->copy_to_host(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, size_t bytes) override { inner_->copy_on_device(dst, src, bytes); }
  void synchronize() override {}
  void upload(void* dst, const void* src, size_t bytes) override { inner_->upload(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { inner_->download(dst, src, bytes); }
  kernels::DeviceFence fence() override { return {}; }
  double add_sum_squares(double acc, const float* x, size_t n) override { return inner_->add_sum_squares(acc, x, n); }

 protected:
  Result<kernels::DeviceBuffer> allocate_impl(size_t bytes, const std::string& purpose) override {
    return inner_->allocate(bytes, purpose);
  }

 private:
  std::unique_ptr<kernels::Device> inner_ = kernels::make_cpu_device(kernels::cpu_fast_kernels());
};

// The CPU device posing as one whose memory the host cannot address (a GPU's), so that what stages device
// memory through the host (comm/staged_communicator.h) runs in CPU-only CI; counts the bytes its copy
// streams move.
class UnaddressableDevice : public ForwardingDevice {
 public:
  bool host_accessible() const override { return false; }
  void upload(void* dst, const void* src, size_t bytes) override {
    uploaded += bytes;
    ForwardingDevice::upload(dst, src, bytes);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    downloaded += bytes;
    ForwardingDevice::download(dst, src, bytes);
  }
  std::atomic<size_t> uploaded{0}, downloaded{0};
};

}  // namespace strata::testing
