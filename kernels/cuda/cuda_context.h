// cuda_context.h — the CUDA backend's per-process state: the device, the compute stream every op in
// kernels/cuda is enqueued on, the cuBLAS and cuBLASLt handles bound to that stream, and cuBLASLt's workspace.
//
// Created on first use by cuda_context(), which asserts that a device is usable: callers that may run without a
// GPU ask cuda_available() (cuda_kernels.h) first and get a Status naming why not. Threading: one host thread
// drives the backend at a time (the KernelSet contract); the ops are asynchronous on `compute`, so a caller
// synchronizes the stream (or records an event) before it reads results on the host.
//
// Deliberately free of common/status.h (and so of fmt): .cu files include it.
#pragma once

#include <atomic>
#include <cstddef>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace strata::kernels::cuda {

struct CudaContext {
  int device = 0;  // this process's GPU: its rank on the node modulo the GPUs (cuda_context.cpp)
  cudaDeviceProp props{};
  cudaStream_t compute = nullptr;  // non-blocking; all kernels/cuda ops run here, in call order
  cublasHandle_t blas = nullptr;   // strided-batched GEMMs of attention; bound to `compute`
  cublasLtHandle_t lt = nullptr;   // every matmul_* GEMM
  void* lt_workspace = nullptr;    // cuBLASLt's scratch (kLtWorkspaceBytes), owned here
  static constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
};

CudaContext& cuda_context();

// An experimental setting of the backend, off or on, read once per process from environment variable `var`
// (unset, empty or `off_value`: off; `on_value`: on; anything else stops the process naming the variable and
// both values) at its first use; set() overrides it (tests). A static object: its strings must outlive it.
class EnvSwitch {
 public:
  EnvSwitch(const char* var, const char* off_value, const char* on_value)
      : var_(var), off_(off_value), on_(on_value) {}
  bool on();
  void set(bool on) { state_.store(on ? 1 : 0, std::memory_order_relaxed); }

 private:
  const char *var_, *off_, *on_;
  std::atomic<int> state_{-1};  // -1 until read
};

// Stream-ordered device scratch on the compute stream (cudaMallocAsync from the device's default pool, which is
// told to keep freed memory cached): valid for work enqueued on `compute` after construction and before
// destruction; freed in stream order, so the host never waits. Move-only.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  explicit DeviceScratch(size_t bytes);
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  DeviceScratch(DeviceScratch&& o) noexcept : ptr_(o.ptr_) { o.ptr_ = nullptr; }
  ~DeviceScratch();
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// A grid for a grid-stride loop over n elements with `threads` per block: enough blocks to fill the device, no
// more than the work needs.
unsigned grid_for(size_t n, unsigned threads);

}  // namespace strata::kernels::cuda
