// cuda_device.cpp — the "cuda" Device: cudaMalloc'ed memory, every operation in order on the compute stream.
// Host-to-device copies are synchronous with respect to their source (pageable host memory; the pinned pool and
// the separate copy streams come with offload/).
#include <memory>

#include <fmt/format.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/sum_squares.h"
#include "kernels/device.h"

namespace strata::kernels {
namespace {

class CudaDevice final : public Device {
 public:
  const char* name() const override { return "cuda"; }
  std::string description() const override { return "cuda (" + cuda_device_description() + ")"; }
  const KernelSet& kernels() const override { return cuda_kernels(); }
  bool host_accessible() const override { return false; }

  Result<DeviceBuffer> allocate_impl(size_t bytes, const std::string& purpose) override {
    const cuda::CudaContext& ctx = cuda::cuda_context();
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
      CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ctx.compute));
    }
    return DeviceBuffer(p, bytes, purpose, [p] {
      if (p != nullptr) {
        // Work still queued may use it: free after the stream drains.
        CUDA_CHECK(cudaStreamSynchronize(cuda::cuda_context().compute));
        CUDA_CHECK(cudaFree(p));
      }
    });
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::cuda_context().compute));
  }
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const cudaStream_t s = cuda::cuda_context().compute;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    // Pageable source: the call may return before the copy has read it, so wait before the caller reuses it.
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const cudaStream_t s = cuda::cuda_context().compute;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  void synchronize() override { cuda_synchronize(); }
  double add_sum_squares(double acc, const float* x, size_t n) override { return cuda::add_sum_squares(acc, x, n); }
};

}  // namespace

std::unique_ptr<Device> make_cuda_device() { return std::make_unique<CudaDevice>(); }

}  // namespace strata::kernels
