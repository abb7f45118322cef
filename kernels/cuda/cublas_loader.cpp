// cublas_loader.cpp — cuBLAS and cuBLASLt, loaded when the CUDA backend first calls them instead of when the
// process starts.
//
// Linked in directly, cuBLASLt's initializers ran at every start of every binary that contains the CUDA
// backend, GPU or not: about 0.4 s of `strata --version` on the CI machine, and every test process paid it. And
// a CPU-only machine could not start `strata` at all without the CUDA libraries. So this file defines the few
// cuBLAS entry points the backend uses, with the headers' own declarations (the compiler checks every
// signature), and each forwards to the real function, looked up once in the library dlopen'ed on first use.
// If the library cannot be loaded, the entry points return CUBLAS_STATUS_NOT_INITIALIZED, cublasGetStatusString
// says why, and cublas_load_status() (cuda_available() asks it) names the library and dlerror's reason.
//
// Where: the soname (libcublas.so.<major> of the headers this was built with) through the usual search (the
// binary's RUNPATH, LD_LIBRARY_PATH, the ld.so cache), then the toolkit's library folder found at build time.
#include <dlfcn.h>

#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/cuda/cublas_loader.h"
#include "kernels/cuda/cuda_check.h"

namespace strata::kernels::cuda {
namespace {

struct Library {
  void* handle = nullptr;
  std::string error;  // why it could not be loaded
};

Library open_library(const char* base) {
  const std::string soname = fmt::format("{}.so.{}", base, CUBLAS_VER_MAJOR);
  Library lib;
  lib.handle = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib.handle != nullptr) return lib;
  const std::string first = ::dlerror();
#ifdef STRATA_CUDA_LIBRARY_DIR
  const std::string path = std::string(STRATA_CUDA_LIBRARY_DIR) + "/" + soname;
  lib.handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib.handle != nullptr) return lib;
  lib.error = fmt::format("{}; and {}", first, ::dlerror());
#else
  lib.error = first;
#endif
  return lib;
}

enum Which { kLt = 0, kBlas = 1 };

const Library& library(Which which) {
  // cuBLASLt first: libcublas depends on it.
  static const Library libs[2] = {open_library("libcublasLt"), open_library("libcublas")};
  return libs[which];
}

// Every entry point defined below, so that cublas_load_status() checks them all.
std::vector<std::pair<Which, const char*>>& entry_points() {
  static std::vector<std::pair<Which, const char*>> names;
  return names;
}
struct EntryPoint {
  EntryPoint(Which which, const char* name) { entry_points().emplace_back(which, name); }
};

template <typename F>
F resolve(Which which, const char* name) {
  const Library& lib = library(which);
  if (lib.handle == nullptr) return nullptr;
  return reinterpret_cast<F>(::dlsym(lib.handle, name));
}

}  // namespace

Status cublas_load_status() {
  for (const Which w : {kLt, kBlas}) {
    if (!library(w).error.empty())
      return Status(StatusCode::kNotFound, fmt::format("the CUDA backend needs cuBLAS: {}", library(w).error));
  }
  static const Status symbols = [] {
    for (const auto& [w, name] : entry_points()) {
      if (::dlsym(library(w).handle, name) == nullptr)
        return Status(StatusCode::kNotFound, fmt::format("the loaded cuBLAS has no {}: {}", name, ::dlerror()));
    }
    return Status::ok();
  }();
  return symbols;
}

}  // namespace strata::kernels::cuda

// The entry points. `name` is the exported symbol (cublas_v2.h maps cublasCreate to cublasCreate_v2); a C
// function has one declaration, so a parameter list that differs from the header's does not compile.
#define STRATA_CUBLAS_FORWARD(which, name, params, args)                                                   \
  namespace {                                                                                             \
  const strata::kernels::cuda::EntryPoint entry_##name{strata::kernels::cuda::which, #name};              \
  }                                                                                                       \
  extern "C" cublasStatus_t CUBLASWINAPI name params {                                                    \
    using namespace strata::kernels::cuda;                                                                \
    static const auto real = resolve<cublasStatus_t(CUBLASWINAPI*) params>(which, #name);                 \
    return real != nullptr ? real args : CUBLAS_STATUS_NOT_INITIALIZED;                                   \
  }

STRATA_CUBLAS_FORWARD(kBlas, cublasCreate_v2, (cublasHandle_t * handle), (handle))
STRATA_CUBLAS_FORWARD(kBlas, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream), (handle, stream))
STRATA_CUBLAS_FORWARD(kBlas, cublasSetMathMode, (cublasHandle_t handle, cublasMath_t mode), (handle, mode))
STRATA_CUBLAS_FORWARD(kBlas, cublasGemmEx,
                      (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                       const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                       cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                       cublasComputeType_t computeType, cublasGemmAlgo_t algo),
                      (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
                       computeType, algo))
STRATA_CUBLAS_FORWARD(kBlas, cublasGemmStridedBatchedEx,
                      (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                       const void* alpha, const void* A, cudaDataType Atype, int lda, long long int strideA,
                       const void* B, cudaDataType Btype, int ldb, long long int strideB, const void* beta, void* C,
                       cudaDataType Ctype, int ldc, long long int strideC, int batchCount,
                       cublasComputeType_t computeType, cublasGemmAlgo_t algo),
                      (handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta,
                       C, Ctype, ldc, strideC, batchCount, computeType, algo))
STRATA_CUBLAS_FORWARD(kLt, cublasLtCreate, (cublasLtHandle_t * handle), (handle))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmulDescCreate,
                      (cublasLtMatmulDesc_t * desc, cublasComputeType_t computeType, cudaDataType_t scaleType),
                      (desc, computeType, scaleType))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmulDescSetAttribute,
                      (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,
                       size_t sizeInBytes),
                      (desc, attr, buf, sizeInBytes))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatrixLayoutCreate,
                      (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld),
                      (layout, type, rows, cols, ld))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmulPreferenceSetAttribute,
                      (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                       size_t sizeInBytes),
                      (pref, attr, buf, sizeInBytes))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmulAlgoGetHeuristic,
                      (cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
                       cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                       cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                       cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount),
                      (lightHandle, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, preference, requestedAlgoCount,
                       heuristicResultsArray, returnAlgoCount))
STRATA_CUBLAS_FORWARD(kLt, cublasLtMatmul,
                      (cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                       const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                       const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                       cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                       size_t workspaceSizeInBytes, cudaStream_t stream),
                      (lightHandle, computeDesc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
                       workspaceSizeInBytes, stream))

namespace {
const strata::kernels::cuda::EntryPoint entry_cublasGetStatusString{strata::kernels::cuda::kBlas,
                                                                    "cublasGetStatusString"};
}
extern "C" const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  using namespace strata::kernels::cuda;
  static const auto real = resolve<decltype(&cublasGetStatusString)>(kBlas, "cublasGetStatusString");
  if (real != nullptr) return real(status);
  static const std::string why = cublas_load_status().to_string();
  return why.c_str();
}
