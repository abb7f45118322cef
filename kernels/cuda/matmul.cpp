// matmul.cpp — matmul forward and backward through cuBLASLt.
//
// Row-major (N,C) activations are column-major (C,N) matrices to cuBLAS, so each product is written below in
// column-major terms. fp32 runs with CUBLAS_COMPUTE_32F (full fp32, no TF32). bf16 rounds both operands to bf16
// (the CPU backend's kBF16 semantics) and multiplies them on the tensor cores with fp32 accumulation and an fp32
// output. The bias is fused into the forward GEMM's epilogue; "+=" into gradients is the GEMM's beta = 1. The
// bias gradient is a deterministic column sum (reduce.cuh), not cuBLASLt's BGRAD epilogue, which overwrites.
//
// Each distinct problem (shapes, operations, types, pointer alignments) is planned once: descriptors and the
// heuristic's best algorithm are cached, so a training step does no planning after its first.
#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "kernels/cuda/convert.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

// D (m,n) = alpha * op(A) (m,k) @ op(B) (k,n) + beta * D, column-major, with an optional bias (m) epilogue.
struct Gemm {
  cublasOperation_t op_a, op_b;
  int m, n, k;
  const void* a;
  int lda;
  const void* b;
  int ldb;
  float* d;
  int ldd;
  float beta;
  const float* bias;  // null: no epilogue
  cudaDataType_t ab_type;
};

int alignment_of(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && addr % a != 0) a /= 2;
  return a;
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

using PlanKey = std::tuple<int, int, int, int, int, int, int, int, int, bool, bool, int, int, int, int>;

Plan make_plan(const CudaContext& ctx, const Gemm& g, int align_a, int align_b, int align_d) {
  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.op_a, sizeof(g.op_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b, sizeof(g.op_b)));
  if (g.bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = CUDA_R_32F;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    // The heuristic takes the bias's alignment from the pointer's value (cublasLt.h), so it is set before it
    // as well as on every call: planned with NULL, an algorithm assuming an aligned bias could be picked and
    // then run on a bias packed at a 4-byte offset.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  // Stored (pre-op) shapes.
  const bool ta = g.op_a != CUBLAS_OP_N, tb = g.op_b != CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, g.ab_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, g.ab_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_32F, g.m, g.n, g.ldd));

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t workspace = CudaContext::kLtWorkspaceBytes;
  const uint32_t aligns[4] = {static_cast<uint32_t>(align_a), static_cast<uint32_t>(align_b),
                              static_cast<uint32_t>(align_d), static_cast<uint32_t>(align_d)};
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aligns[0],
                                                    sizeof(uint32_t)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &aligns[1],
                                                    sizeof(uint32_t)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &aligns[2],
                                                    sizeof(uint32_t)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &aligns[3],
                                                    sizeof(uint32_t)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &found));
  CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  if (found == 0) {
    const std::string msg = fmt::format(
        "cuBLASLt has no algorithm for m={} n={} k={} op_a={} op_b={} lda={} ldb={} ldd={} type={} bias={}", g.m, g.n,
        g.k, static_cast<int>(g.op_a), static_cast<int>(g.op_b), g.lda, g.ldb, g.ldd, static_cast<int>(g.ab_type),
        g.bias != nullptr);
    STRATA_ASSERT_MSG(found > 0, msg.c_str());
  }
  p.algo = result.algo;
  return p;
}

void run_gemm(const Gemm& g) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // an empty sum: only the accumulating GEMMs (backward with N = 0) meet it, and add nothing
    STRATA_ASSERT_MSG(g.beta == 1.0f && g.bias == nullptr, "matmul with an empty inner dimension");
    return;
  }
  const CudaContext& ctx = cuda_context();
  static std::map<PlanKey, Plan> plans;  // one driving thread (cuda_context.h), so no lock
  const int align_a = alignment_of(g.a), align_b = alignment_of(g.b), align_d = alignment_of(g.d);
  // The bias pointer's alignment is part of the key too (an algorithm may depend on it), though cuBLASLt takes
  // no preference for it.
  const int align_bias = g.bias != nullptr ? alignment_of(g.bias) : 0;
  const PlanKey key{g.op_a, g.op_b, g.m,         g.n,     g.k,     g.lda,   g.ldb,     g.ldd,
                    g.ab_type, g.beta != 0.0f, g.bias != nullptr, align_a, align_b, align_d, align_bias};
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, make_plan(ctx, g, align_a, align_b, align_d)).first;
  const Plan& p = it->second;
  if (g.bias != nullptr) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt, p.desc, &alpha, g.a, p.a, g.b, p.b, &g.beta, g.d, p.d, g.d, p.d, &p.algo,
                              ctx.lt_workspace, CudaContext::kLtWorkspaceBytes, ctx.compute));
}

// The operands of one GEMM, as the precision wants them: the fp32 originals, or bf16 copies in scratch whose
// rows are padded to a multiple of 8 elements (16 bytes), which the tensor-core kernels need: an odd width such
// as GPT-2's vocabulary (50257) otherwise leaves cuBLASLt only its slow unaligned kernels.
struct Operand {
  DeviceScratch rounded;
  const void* ptr;
  int ld;  // row stride in elements
};
constexpr int kBf16RowAlign = 8;
int round_up(int x, int to) { return (x + to - 1) / to * to; }
// `pad_rows`: also append zero rows up to a multiple of 8, so that a GEMM dimension taken from the row count
// can be rounded up the same way (the zero rows add nothing).
Operand operand(const float* x, int rows, int cols, MatmulPrecision precision, bool pad_rows = false) {
  if (precision == MatmulPrecision::kF32) return {DeviceScratch(), x, cols};
  const int ld = round_up(cols, kBf16RowAlign);
  const int prows = pad_rows ? round_up(rows, kBf16RowAlign) : rows;
  DeviceScratch s(static_cast<size_t>(prows) * ld * sizeof(uint16_t));
  f32_to_bf16_rows(s.as<uint16_t>(), ld, x, cols, rows, cols);
  if (prows > rows) {
    CUDA_CHECK(cudaMemsetAsync(s.as<uint16_t>() + static_cast<size_t>(rows) * ld, 0,
                               static_cast<size_t>(prows - rows) * ld * sizeof(uint16_t), cuda_context().compute));
  }
  const void* p = s.as<void>();
  return {std::move(s), p, ld};
}
cudaDataType_t ab_type(MatmulPrecision precision) {
  return precision == MatmulPrecision::kF32 ? CUDA_R_32F : CUDA_R_16BF;
}

}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC,
                    MatmulPrecision precision) {
  // An output width that is not a multiple of 8 (GPT-2's vocabulary, 50257) keeps the bf16 GEMM off its fast
  // kernels: compute OC rounded up (zero weight rows) into an aligned scratch and copy the OC columns over — one
  // extra pass over the output, much less than it saves. Not with a bias, whose length must be OC.
  const bool pad = precision == MatmulPrecision::kBF16 && OC % kBf16RowAlign != 0 && bias == nullptr;
  const int m = pad ? round_up(OC, kBf16RowAlign) : OC;
  const Operand w = operand(weight, OC, C, precision, pad);
  const Operand x = operand(inp, N, C, precision);
  DeviceScratch padded(pad ? static_cast<size_t>(N) * m * sizeof(float) : 0);
  float* d = pad ? padded.as<float>() : out;
  // out^T (OC,N) = W (C,OC)^T @ inp^T (C,N)
  run_gemm(Gemm{CUBLAS_OP_T, CUBLAS_OP_N, m, N, C, w.ptr, w.ld, x.ptr, x.ld, d, m, 0.0f, bias, ab_type(precision)});
  if (pad) {
    copy_rows(out, OC, d, m, N, OC);
  }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int C, int OC, MatmulPrecision precision) {
  const bool bf16 = precision == MatmulPrecision::kBF16;
  const Operand dy = operand(dout, N, OC, precision);  // bf16: columns padded with zeros to dy.ld
  const Operand w = operand(weight, OC, C, precision, bf16);  // bf16: zero rows up to a multiple of 8
  const Operand x = operand(inp, N, C, precision);
  const cudaDataType_t t = ab_type(precision);
  // dinp^T (C,N) += W (C,OC) @ dout^T (OC,N), the inner dimension rounded up over the zero padding in bf16.
  const int k = bf16 ? round_up(OC, kBf16RowAlign) : OC;
  run_gemm(Gemm{CUBLAS_OP_N, CUBLAS_OP_N, C, N, k, w.ptr, w.ld, dy.ptr, dy.ld, dinp, C, 1.0f, nullptr, t});
  // dweight^T (C,OC) += inp^T (C,N) @ dout (N,OC)
  run_gemm(Gemm{CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, x.ptr, x.ld, dy.ptr, dy.ld, dweight, C, 1.0f, nullptr, t});
  if (dbias != nullptr) column_sums_accumulate(dbias, dout, N, OC);
}

}  // namespace strata::kernels::cuda
