#include "kernels/cuda/cuda_context.h"

#include <algorithm>
#include <filesystem>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "kernels/cuda/cublas_loader.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels {

namespace {

struct Availability {
  Status status;
  std::string description;
  int device = 0;
};

// The GPU this process uses: under a launcher that says the process's rank on its node (Open MPI, MPICH, Slurm,
// PMI, MVAPICH, PALS), that rank modulo the GPUs it can see, so the ranks of a node spread over its GPUs
// (several ranks share one where there are fewer GPUs than ranks); else GPU 0. CUDA_VISIBLE_DEVICES narrows
// what it can see, as usual.
int chosen_device(int count) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK",
                          "MV2_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID"}) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    const long rank = std::strtol(v, &end, 10);
    if (*end == '\0' && rank >= 0) return static_cast<int>(rank % count);
  }
  return 0;
}

const Availability& availability() {
  static const Availability a = [] {
    Availability r;
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      // The runtime says "insufficient driver" both for an old driver and for none at all; tell them apart.
      const bool no_driver = err == cudaErrorInsufficientDriver && !std::filesystem::exists("/proc/driver/nvidia");
      r.status = Status(StatusCode::kNotFound,
                        no_driver ? std::string("no usable CUDA device: no NVIDIA driver is loaded on this machine")
                                  : fmt::format("no usable CUDA device: cudaGetDeviceCount says {} ({})",
                                                cudaGetErrorName(err), cudaGetErrorString(err)));
      (void)cudaGetLastError();  // reset the runtime's last-error slot so later probes start clean
      return r;
    }
    if (count == 0) {
      r.status = Status(StatusCode::kNotFound, "no CUDA device: the driver reports 0 devices");
      return r;
    }
    r.device = chosen_device(count);
    cudaDeviceProp p{};
    if (const cudaError_t e = cudaGetDeviceProperties(&p, r.device); e != cudaSuccess) {
      r.status = Status(StatusCode::kNotFound,
                        fmt::format("CUDA device {} cannot be queried: {}", r.device, cudaGetErrorString(e)));
      return r;
    }
    r.description = fmt::format("{}, sm_{}{}, {} SMs, {:.1f} GiB{}", p.name, p.major, p.minor, p.multiProcessorCount,
                                static_cast<double>(p.totalGlobalMem) / (1u << 30),
                                count > 1 ? fmt::format(" (GPU {} of {})", r.device, count) : std::string());
    r.status = cuda::cublas_load_status();  // loaded here, the first time a GPU is there to use
    return r;
  }();
  return a;
}

}  // namespace

Status cuda_available() { return availability().status; }
std::string cuda_device_description() { return availability().description; }

void cuda_synchronize() { CUDA_CHECK(cudaStreamSynchronize(cuda::cuda_context().compute)); }

namespace cuda {

CudaContext& cuda_context() {
  static CudaContext* ctx = [] {
    const Status ok = cuda_available();
    STRATA_ASSERT_MSG(ok.is_ok(), "cuda_context() needs a CUDA device; ask cuda_available() first");
    auto* c = new CudaContext;  // lives for the process: streams and handles must outlive static destructors
    c->device = availability().device;
    CUDA_CHECK(cudaSetDevice(c->device));
    CUDA_CHECK(cudaGetDeviceProperties(&c->props, c->device));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&c->blas));
    CUBLAS_CHECK(cublasSetStream(c->blas, c->compute));
    // Full fp32 arithmetic for fp32 GEMMs (no TF32): the tests hold the backend to fp32 tolerances.
    CUBLAS_CHECK(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH));
    CUBLAS_CHECK(cublasLtCreate(&c->lt));
    CUDA_CHECK(cudaMalloc(&c->lt_workspace, CudaContext::kLtWorkspaceBytes));
    // Keep freed scratch in the pool instead of returning it to the driver at every synchronization.
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, c->device));
    uint64_t threshold = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    return c;
  }();
  return *ctx;
}

bool EnvSwitch::on() {
  int v = state_.load(std::memory_order_relaxed);
  if (v >= 0) return v == 1;
  const char* env = std::getenv(var_);
  const std::string s = env != nullptr ? env : "";
  if (s.empty() || s == off_) {
    v = 0;
  } else if (s == on_) {
    v = 1;
  } else {
    const std::string msg = fmt::format("{}={}: expected '{}' or '{}'", var_, s, off_, on_);
    STRATA_ASSERT_MSG(false, msg.c_str());
  }
  int unset = -1;
  state_.compare_exchange_strong(unset, v);  // a set() in between wins
  return state_.load(std::memory_order_relaxed) == 1;
}

DeviceScratch::DeviceScratch(size_t bytes) {
  if (bytes == 0) return;
  CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, cuda_context().compute));
}

DeviceScratch::~DeviceScratch() {
  if (ptr_ != nullptr) CUDA_CHECK(cudaFreeAsync(ptr_, cuda_context().compute));
}

void zero_floats(float* p, size_t n) {
  if (n > 0) CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(float), cuda_context().compute));
}

unsigned grid_for(size_t n, unsigned threads) {
  const size_t wanted = (n + threads - 1) / threads;
  const size_t cap = static_cast<size_t>(cuda_context().props.multiProcessorCount) * 32;
  return static_cast<unsigned>(std::max<size_t>(1, std::min(wanted, cap)));
}

}  // namespace cuda
}  // namespace strata::kernels
