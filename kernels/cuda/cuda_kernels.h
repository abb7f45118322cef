// cuda_kernels.h — the CUDA KernelSet and how to ask whether it can run here.
//
// cuda_kernels() fills every KernelSet slot (kernels/kernels.h) with a GPU implementation: same shapes, same
// semantics ("+=" into gradients, cross-entropy backward overwriting), but every pointer is DEVICE memory and
// every op is enqueued on cuda_context().compute and returns before it finishes. Results are deterministic: no
// floating-point atomics; reductions run in a fixed order that depends only on the shapes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/cuda/convert.h"
#include "kernels/kernels.h"

namespace strata::kernels {

// Ok when a CUDA device can be used; otherwise a Status saying why (no driver, no device, a driver older than
// the runtime), for tests to skip with and for --device to report. Never aborts; cheap after the first call.
Status cuda_available();
// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB" — for logs and benchmark headers. Needs cuda_available().
std::string cuda_device_description();

const KernelSet& cuda_kernels();

// Waits until every op enqueued so far has finished; aborts (naming the call) on an asynchronous kernel error.
void cuda_synchronize();

}  // namespace strata::kernels
