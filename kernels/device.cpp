#include "kernels/device.h"

#include <filesystem>

#include <fmt/format.h>

#include "common/log.h"

#ifdef STRATA_HAVE_CUDA
#include "kernels/cuda/cuda_kernels.h"
#endif

namespace strata::kernels {

#ifdef STRATA_HAVE_CUDA
std::unique_ptr<Device> make_cuda_device();  // kernels/cuda/cuda_device.cpp
#endif

Result<std::unique_ptr<Device>> make_device(std::string_view name, const KernelSet& cpu_kernels) {
  if (name == "cpu") return make_cpu_device(cpu_kernels);
  if (name != "cuda" && name != "auto")
    return Status::invalid_argument("compute.device must be 'auto', 'cpu' or 'cuda', got '{}'", name);
#ifdef STRATA_HAVE_CUDA
  if (const Status s = cuda_available(); s.is_ok()) {
    return make_cuda_device();
  } else if (name == "cuda") {
    return Status(s.code(), "compute.device = 'cuda': " + s.message());
  } else if (std::filesystem::exists("/proc/driver/nvidia")) {
    // "auto" on a machine with an NVIDIA driver: a GPU the user expects to use is not usable (no device
    // visible, or cuBLAS missing), which must not pass for a CPU machine.
    STRATA_LOG_WARN("compute.device = 'auto': the GPU is not usable ({}); training on the CPU", s.message());
  }
  return make_cpu_device(cpu_kernels);
#else
  if (name == "cuda")
    return Status::not_found("compute.device = 'cuda', but this build has no CUDA backend (the toolkit was not found "
                             "at configure time, or STRATA_CUDA=OFF)");
  return make_cpu_device(cpu_kernels);
#endif
}

}  // namespace strata::kernels
