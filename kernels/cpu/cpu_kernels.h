// cpu_kernels.h — the two CPU KernelSets: the plain fp32 reference and the fast version.
#pragma once

#include "kernels/kernels.h"

namespace strata::kernels {

const KernelSet& cpu_reference_kernels();  // kernels/cpu/reference.h at T = float; single-threaded
const KernelSet& cpu_fast_kernels();       // kernels/cpu/fast.h

// "reference" or "fast" (also "cpu-reference", "cpu-fast"); nullptr if unknown.
const KernelSet* find_kernel_set(const char* name);

}  // namespace strata::kernels
