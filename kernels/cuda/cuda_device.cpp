// cuda_device.cpp — the "cuda" Device: cudaMalloc'ed memory, every operation in order on the compute stream.
// copy_to_device/copy_to_host wait for their copy (the host side may be pageable). upload/download run on two
// copy streams of their own, for the copy engine's threads; from memory given to register_host() they are DMA.
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "common/log.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/sum_squares.h"
#include "kernels/device.h"

namespace strata::kernels {
namespace {

class CudaDevice final : public Device {
 public:
  CudaDevice() {
    bind();  // the copy streams belong to this process's GPU
    CUDA_CHECK(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&zero_, cudaStreamNonBlocking));
  }
  ~CudaDevice() override {
    CUDA_CHECK(cudaStreamDestroy(h2d_));
    CUDA_CHECK(cudaStreamDestroy(d2h_));
    CUDA_CHECK(cudaStreamDestroy(zero_));
  }
  const char* name() const override { return "cuda"; }
  std::string description() const override { return "cuda (" + cuda_device_description() + ")"; }
  const KernelSet& kernels() const override { return cuda_kernels(); }
  bool host_accessible() const override { return false; }
  uint64_t free_memory() const override {
    bind();
    size_t free_bytes = 0, total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return free_bytes;
  }

  Result<DeviceBuffer> allocate_impl(size_t bytes, const std::string& purpose) override {
    bind();
    void* p = nullptr;
    if (bytes > 0) {
      if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t free_bytes = 0, total = 0;
        (void)cudaMemGetInfo(&free_bytes, &total);
        return Status::out_of_memory("cannot allocate {:.1f} MiB of GPU memory for {}: {} ({:.1f} MiB free of {:.1f})",
                                     bytes / 1048576.0, purpose, cudaGetErrorString(e), free_bytes / 1048576.0,
                                     total / 1048576.0);
      }
      // Zeroed before it is returned, on a stream of its own: a zero-fill queued on the compute stream could
      // land after an upload into the buffer on a copy stream (nothing orders the two), wiping it.
      std::lock_guard lock(zero_mu_);
      CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, zero_));
      CUDA_CHECK(cudaStreamSynchronize(zero_));
    }
    return DeviceBuffer(p, bytes, purpose, [p] {
      if (p != nullptr) {
        // Work still queued may use it: free after the stream drains.
        CUDA_CHECK(cudaStreamSynchronize(bind().compute));
        CUDA_CHECK(cudaFree(p));
      }
    });
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, bind().compute));
  }
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const cudaStream_t s = bind().compute;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    // Pageable source: the call may return before the copy has read it, so wait before the caller reuses it.
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const cudaStream_t s = bind().compute;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, bind().compute));
  }
  void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(bind().compute)); }
  // One stream per direction, each serialized by its mutex, so an upload and a download overlap each other
  // and the compute stream. Returning only once the copy is done keeps the callers' ordering host-side.
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    bind();
    std::lock_guard lock(h2d_mu_);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, h2d_));
    CUDA_CHECK(cudaStreamSynchronize(h2d_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    bind();
    std::lock_guard lock(d2h_mu_);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d2h_));
    CUDA_CHECK(cudaStreamSynchronize(d2h_));
  }
  DeviceFence fence() override {
    const cuda::CudaContext& ctx = bind();
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(e, ctx.compute));
    auto event = std::shared_ptr<CUevent_st>(e, [](cudaEvent_t ev) { CUDA_CHECK(cudaEventDestroy(ev)); });
    // Waited on from other threads (copy jobs, the collectives thread), which must not wake up on GPU 0.
    return DeviceFence([event, device = ctx.device] {
      CUDA_CHECK(cudaSetDevice(device));
      CUDA_CHECK(cudaEventSynchronize(event.get()));
    });
  }
  double add_sum_squares(double acc, const float* x, size_t n) override {
    bind();
    return cuda::add_sum_squares(acc, x, n);
  }
  // Portable: page-locked for every device context, whichever thread registers it.
  Status register_host(void* p, size_t bytes) override {
    bind();
    if (const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable); e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::internal("cudaHostRegister of {:.1f} MiB: {}", bytes / 1048576.0, cudaGetErrorString(e));
    }
    return Status::ok();
  }
  // Runs as a pinned buffer is freed, maybe while an error unwinds: a failure (a sticky error from earlier,
  // most likely) is logged, not fatal, so it does not hide the error that got here.
  void unregister_host(void* p) override {
    bind();
    if (const cudaError_t e = cudaHostUnregister(p); e != cudaSuccess) {
      (void)cudaGetLastError();
      STRATA_LOG_WARN("cudaHostUnregister: {}", cudaGetErrorString(e));
    }
  }

 private:
  // Makes this process's GPU the calling thread's current device (a thread starts on GPU 0): copy threads,
  // the optimizer's and the collectives' threads call in too. Returns the context.
  static const cuda::CudaContext& bind() {
    const cuda::CudaContext& ctx = cuda::cuda_context();
    CUDA_CHECK(cudaSetDevice(ctx.device));
    return ctx;
  }
  cudaStream_t h2d_ = nullptr, d2h_ = nullptr, zero_ = nullptr;
  std::mutex h2d_mu_, d2h_mu_, zero_mu_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device() { return std::make_unique<CudaDevice>(); }

}  // namespace strata::kernels
