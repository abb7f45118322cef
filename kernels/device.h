// device.h — a compute backend as the engine drives it: its KernelSet, and the memory those kernels read and
// write (allocate, zero, copy to and from the host, synchronize).
//
// Two implementations: "cpu" (kernels/cpu/cpu_device.cpp: ordinary host memory, synchronous copies, the fast or
// reference KernelSet) and "cuda" (kernels/cuda/cuda_device.cpp: device memory, every op on the compute stream).
// The model, optimizer and checkpoints are written once against this interface. Threading: one host thread
// drives a Device at a time (the KernelSet contract); the allocation ledger is thread-safe. The tiers and copy
// streams of offload/ build on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "kernels/kernels.h"

namespace strata::kernels {

// Memory of one Device: move-only, frees itself, says what it is for.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, size_t bytes, std::string purpose, std::function<void()> release)
      : data_(data), bytes_(bytes), purpose_(std::move(purpose)), release_(std::move(release)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~DeviceBuffer() { reset(); }

  void reset() {
    if (release_) release_();
    release_ = nullptr;
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }
  const std::string& purpose() const { return purpose_; }

 private:
  void swap(DeviceBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(purpose_, o.purpose_);
    std::swap(release_, o.release_);
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::string purpose_;
  std::function<void()> release_;
};

// A point in a device's compute stream (Device::fence()): wait() returns once every operation enqueued before
// the fence has finished. Copyable; any thread may wait on it, any number of times.
class DeviceFence {
 public:
  DeviceFence() = default;  // already passed
  explicit DeviceFence(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() const {
    if (wait_) wait_();
  }

 private:
  std::function<void()> wait_;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual const char* name() const = 0;           // "cpu", "cuda"
  virtual std::string description() const = 0;    // for logs: the kernels, or the GPU's name and memory
  virtual const KernelSet& kernels() const = 0;   // every pointer passed to it is this device's memory
  virtual bool host_accessible() const = 0;       // the host may read and write this device's memory directly

  // `bytes` of this device's memory, zero-filled, for `purpose`, within the memory limit: OutOfMemory names the
  // purpose, the size, the limit and who holds what. Counted in the ledger until the buffer is released (the
  // buffers must not outlive the device).
  Result<DeviceBuffer> allocate(size_t bytes, std::string purpose);

  // The hard budget of allocate() in bytes (memory.device_memory_limit); 0, the default, is what the hardware
  // has. The kernels' own transient scratch (CUDA's stream-ordered pool) is outside it.
  void set_memory_limit(uint64_t bytes) { ledger_->limit = bytes; }
  // What the hardware could give allocate() now (CUDA: cudaMemGetInfo's free bytes); 0 when the backend cannot
  // tell, as for a host-accessible device, whose memory is the host's (offload::memory_headroom).
  virtual uint64_t free_memory() const { return 0; }
  uint64_t memory_limit() const { return ledger_->limit; }
  uint64_t live_bytes() const;
  uint64_t peak_bytes() const;
  // "2.3 GiB live (peak 2.4), limit 8.0 GiB: gpt2.activations 1.2 GiB, adamw.m 0.5 GiB, ..." by purpose, the
  // purpose's text up to its first space (so "gpt2.params h.3" counts as "gpt2.params").
  std::string memory_report() const;
  // Whether [p, p + bytes) lies within one live buffer from allocate() (bytes 0: whether p does). What code
  // that is handed a pointer uses to tell this device's memory from the host's (comm/staged_communicator.h).
  bool owns(const void* p, size_t bytes) const;
  // In order with the kernels: dst[0..bytes) = 0.
  virtual void zero(void* dst, size_t bytes) = 0;
  // Host -> device, in order with the kernels; `src` may be reused when the call returns.
  virtual void copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  // Device -> host after all work enqueued so far; `dst` holds the bytes when the call returns.
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  // Device -> device, in order with the kernels (the ranges do not overlap).
  virtual void copy_on_device(void* dst, const void* src, size_t bytes) = 0;
  // Waits for everything enqueued so far.
  virtual void synchronize() = 0;
  // Copies for the copy engine's threads (offload/copy_engine.h). They may run on any thread, concurrently with
  // the driving thread and with each other, and return when the bytes have arrived. They run on the device's
  // own host-to-device and device-to-host copy streams, so they overlap the kernels and are NOT ordered with
  // them: a download of what kernels wrote, or an upload into memory that kernels may still read, first waits
  // for a fence() taken after those kernels; kernels that read an upload are enqueued after it returned.
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  // The point the compute stream has reached (driving thread only).
  virtual DeviceFence fence() = 0;
  // Page-locks [p, p + bytes) of host memory for this device's copy engines (CUDA: cudaHostRegister), so
  // upload/download to and from it are DMA at the link's speed, with no staging copy through a bounce buffer.
  // Undone by unregister_host(p) before the memory is unmapped. Any thread. A device the CPU copies for needs
  // nothing and returns ok; a failure (the driver's error) leaves the memory usable, only slower to copy.
  virtual Status register_host(void* p, size_t bytes) {
    (void)p, (void)bytes;
    return Status::ok();
  }
  virtual void unregister_host(void* p) { (void)p; }
  // acc + the sum of x[i]² over n floats, accumulated in double in an order fixed by n alone (deterministic),
  // so a norm over many buffers is a chain of calls. Waits.
  virtual double add_sum_squares(double acc, const float* x, size_t n) = 0;

 protected:
  // The backend's allocation of `bytes` zero-filled bytes (its errors name the purpose); the budget and the
  // ledger are allocate()'s.
  virtual Result<DeviceBuffer> allocate_impl(size_t bytes, const std::string& purpose) = 0;

 private:
  struct Ledger {
    std::mutex mu;
    uint64_t limit = 0, live = 0, peak = 0;
    std::map<std::string, uint64_t> by_purpose;
    std::map<uintptr_t, size_t> buffers;  // live allocations: start -> bytes
  };
  std::shared_ptr<Ledger> ledger_ = std::make_shared<Ledger>();
};

// "cpu" with the given CPU KernelSet (cpu_fast_kernels() or cpu_reference_kernels()), "cuda", or "auto" (cuda
// when this build has the CUDA backend and a GPU is usable, else cpu). Unknown names, and "cuda" where it cannot
// run, are InvalidArgument / NotFound naming why. kernels/device.cpp.
Result<std::unique_ptr<Device>> make_device(std::string_view name, const KernelSet& cpu_kernels);
std::unique_ptr<Device> make_cpu_device(const KernelSet& cpu_kernels);

}  // namespace strata::kernels
