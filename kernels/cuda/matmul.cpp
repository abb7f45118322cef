// matmul.cpp — matmul forward and backward through cuBLASLt.
//
// Row-major (N,C) activations are column-major (C,N) matrices to cuBLAS, so each product is written below in
// column-major terms. fp32 runs with CUBLAS_COMPUTE_32F (full fp32, no TF32). bf16 rounds both operands to bf16
// (the CPU backend's kBF16 semantics) and multiplies them on the tensor cores with fp32 accumulation and an fp32
// output. The bias is fused into the forward GEMM's epilogue; "+=" into gradients is the GEMM's beta = 1 (and
// matmul_backward_set's beta 0 overwrites). The bias gradient is a deterministic column sum (reduce.cuh), not
// cuBLASLt's BGRAD epilogue, which overwrites. Under bf16 the MLP's hidden activations (N,4C) are bf16
// (hidden_bytes): the first linear writes gelu(pre) and pre in bf16 through cuBLASLt's GELU_AUX_BIAS epilogue
// (its bias rounded to bf16, D's type, as autocast rounds it), the second reads gelu(pre) as it is, its input
// gradient comes out as gelu'(pre) * (dout @ W) in bf16 through DGELU, and the first linear's backward reads
// that; where cuBLASLt declines an epilogue, the GEMM and a bf16 GELU kernel. No conversion pass and no fp32
// copy of the widest activations. Every linear's input is hidden the same way (the layernorms write theirs in
// bf16), and so are the attention's: the QKV linear writes qkv (N,3C) in bf16 (its bias rounded too), the output
// linear reads the attention's bf16 output and writes its input gradient in bf16 for the attention's backward,
// whose bf16 dqkv the QKV linear's backward reads. The classifier's GEMMs write and read bf16 logits
// (classifier.cu).
//
// Each distinct problem (shapes, operations, types, pointer alignments) is planned once: descriptors and the
// heuristic's best algorithms (up to 4, the next taken where cublasLtMatmul refuses one) are cached, so a
// training step does no planning after its first.
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "common/log.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {
namespace {

// What the epilogue does besides the optional bias: nothing; GELU with its input written to `aux`
// (GELU_AUX[_BIAS]: D = gelu(acc + bias), aux = acc + bias); or the GELU's gradient at the input in `aux`
// multiplied into the product (DGELU: D = gelu'(aux) * acc; no bias, beta 0).
enum class Epilogue : uint8_t { kPlain, kGeluAux, kDGelu };

// D (m,n) = alpha * op(A) (m,k) @ op(B) (k,n) + beta * D, column-major, with an optional bias (m) epilogue.
struct Gemm {
  cublasOperation_t op_a, op_b;
  int m, n, k;
  const void* a;
  int lda;
  const void* b;
  int ldb;
  void* d;  // d_type: fp32, or bf16 (the classifier's logits, the MLP's hidden activations)
  int ldd;
  float beta;
  const void* bias;  // null: no bias; of D's type (cublasLt.h: the bias takes D's type, bar int8 and fp8 kernels)
  cudaDataType_t ab_type;
  cudaDataType_t d_type = CUDA_R_32F;
  Epilogue epilogue = Epilogue::kPlain;
  const void* aux = nullptr;  // (m,n) with leading dimension aux_ld (a multiple of 8), of D's type
  int aux_ld = 0;
};

int alignment_of(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && addr % a != 0) a /= 2;
  return a;
}

// `supported` false: cuBLASLt has no algorithm for this epilogue here (only GELU ones may say so; the caller
// then runs the GEMM and the GELU apart). Never destroyed: plans live as long as the process.
struct Plan {
  bool supported = true;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  // The heuristic's candidates, best first, and the one in use: one that cublasLtMatmul refuses at its first
  // run gives way to the next (a GELU epilogue falls back only when every candidate refused).
  static constexpr int kMaxAlgos = 4;
  std::array<cublasLtMatmulAlgo_t, kMaxAlgos> algos{};
  int algo_count = 0, algo_index = 0;
};

using PlanKey =
    std::tuple<int, int, int, int, int, int, int, int, int, int, bool, bool, int, int, int, int, int, int, int>;

cublasLtEpilogue_t lt_epilogue(const Gemm& g) {
  switch (g.epilogue) {
    case Epilogue::kGeluAux:
      return g.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kPlain:
      break;
  }
  return g.bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

// The pointers cuBLASLt reads from the descriptor rather than from cublasLtMatmul's arguments. The heuristic
// takes their alignments from their values (cublasLt.h), so they are set before it as well as on every call:
// planned with NULL, an algorithm assuming an aligned bias could be picked and then run on a bias packed at a
// 4-byte offset.
void set_epilogue_pointers(cublasLtMatmulDesc_t desc, const Gemm& g) {
  if (g.bias != nullptr) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  if (g.epilogue != Epilogue::kPlain) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                                sizeof(g.aux)));
  }
}

MatmulEpilogueCounts epilogue_counts;

Plan make_plan(const CudaContext& ctx, const Gemm& g, int align_a, int align_b, int align_d) {
  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.op_a, sizeof(g.op_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b, sizeof(g.op_b)));
  const cublasLtEpilogue_t epilogue = lt_epilogue(g);
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  }
  if (g.bias != nullptr) {
    const int32_t bias_type = g.d_type;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (g.epilogue != Epilogue::kPlain) {
    // The aux type is left unset: it defaults to D's, and setting it at all is documented to fail
    // cublasLtMatmul for combinations that do not take a non-default one.
    const int64_t aux_ld = g.aux_ld;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  set_epilogue_pointers(p.desc, g);
  // Stored (pre-op) shapes.
  const bool ta = g.op_a != CUBLAS_OP_N, tb = g.op_b != CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, g.ab_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, g.ab_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, g.d_type, g.m, g.n, g.ldd));

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
  if (g.d_type != CUDA_R_32F) {
    // A split-K algorithm may keep its partial sums in D's type (in the output or the workspace) and add them
    // there: in bf16 each partial loses 2^-9 of a magnitude that can be far above the result's (measured on
    // the H200: errors of 0.01-0.05 on a K = 3072 DGELU GEMM whose terms sum to about 18). Only reductions in
    // fp32 (the compute type), as one sequential sum does.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                      sizeof(schemes)));
  }
  std::array<cublasLtMatmulHeuristicResult_t, Plan::kMaxAlgos> results{};
  int found = 0;
  const cublasStatus_t heuristic = cublasLtMatmulAlgoGetHeuristic(ctx.lt, p.desc, p.a, p.b, p.d, p.d, pref,
                                                                  Plan::kMaxAlgos, results.data(), &found);
  CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  if (g.epilogue != Epilogue::kPlain) {
    // A GELU epilogue cuBLASLt does not take for these types, shapes or alignments: the caller falls back.
    // Versions differ in how they say so (NOT_SUPPORTED, INVALID_VALUE, or no algorithm), and cublasLtMatmul's
    // refusal below is taken the same way. Any other failure is a bug, and fails loudly below.
    const bool refused = heuristic == CUBLAS_STATUS_NOT_SUPPORTED || heuristic == CUBLAS_STATUS_INVALID_VALUE;
    if (refused || (heuristic == CUBLAS_STATUS_SUCCESS && found == 0)) {
      if (refused)
        STRATA_LOG_WARN("cuBLASLt declined a GELU epilogue for m={} n={} k={} ({}); the GEMM and the GELU kernel run "
                        "instead",
                        g.m, g.n, g.k, cublasGetStatusString(heuristic));
      p.supported = false;
      ++epilogue_counts.fallback_plans;
      return p;
    }
    ++epilogue_counts.gelu_plans;
  }
  CUBLAS_CHECK(heuristic);
  if (found == 0) {
    const std::string msg = fmt::format(
        "cuBLASLt has no algorithm for m={} n={} k={} op_a={} op_b={} lda={} ldb={} ldd={} type={} bias={}", g.m, g.n,
        g.k, static_cast<int>(g.op_a), static_cast<int>(g.op_b), g.lda, g.ldb, g.ldd, static_cast<int>(g.ab_type),
        g.bias != nullptr);
    STRATA_ASSERT_MSG(found > 0, msg.c_str());
  }
  p.algo_count = std::min(found, Plan::kMaxAlgos);
  for (int i = 0; i < p.algo_count; ++i) p.algos[static_cast<size_t>(i)] = results[static_cast<size_t>(i)].algo;
  return p;
}

EnvSwitch autotune_setting("STRATA_MATMUL_AUTOTUNE", "0", "1");

// Times the heuristic's candidates on the problem's own operands and keeps the fastest in p.algo_index: each
// writes into scratch (D, and a GELU_AUX epilogue's aux), once to warm up and then 3 times between events, so
// nothing the model holds changes. Waits for the compute stream: once per problem, in the first step. A candidate
// cublasLtMatmul refuses is skipped.
void autotune(const CudaContext& ctx, Plan& p, const Gemm& g) {
  if (p.algo_count < 2) return;
  const size_t elem = g.d_type == CUDA_R_32F ? sizeof(float) : sizeof(uint16_t);
  const size_t d_bytes = static_cast<size_t>(g.ldd) * static_cast<size_t>(g.n) * elem;
  DeviceScratch d(d_bytes);
  CUDA_CHECK(cudaMemsetAsync(d.as<void>(), 0, d_bytes, ctx.compute));  // beta 1 reads it
  Gemm scratch = g;
  scratch.d = d.as<void>();
  const bool writes_aux = g.epilogue == Epilogue::kGeluAux;  // DGELU reads its aux: the real one
  DeviceScratch aux(writes_aux ? static_cast<size_t>(g.aux_ld) * static_cast<size_t>(g.n) * elem : 0);
  if (writes_aux) scratch.aux = aux.as<void>();
  set_epilogue_pointers(p.desc, scratch);
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  const float alpha = 1.0f;
  auto run = [&](int i) {
    return cublasLtMatmul(ctx.lt, p.desc, &alpha, g.a, p.a, g.b, p.b, &g.beta, scratch.d, p.d, scratch.d, p.d,
                          &p.algos[static_cast<size_t>(i)], ctx.lt_workspace, CudaContext::kLtWorkspaceBytes,
                          ctx.compute);
  };
  float best = std::numeric_limits<float>::infinity(), first = best;
  int best_i = p.algo_index;
  for (int i = p.algo_index; i < p.algo_count; ++i) {
    if (run(i) != CUBLAS_STATUS_SUCCESS) continue;
    CUDA_CHECK(cudaEventRecord(start, ctx.compute));
    bool ok = true;
    for (int r = 0; r < 3 && ok; ++r) ok = run(i) == CUBLAS_STATUS_SUCCESS;
    CUDA_CHECK(cudaEventRecord(stop, ctx.compute));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (!ok) continue;
    if (i == p.algo_index) first = ms;
    if (ms < best) best = ms, best_i = i;
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  CUDA_CHECK(cudaGetLastError());
  STRATA_LOG_INFO("cuBLASLt autotune m={} n={} k={}: candidate {} of {} ({:.1f} us against the heuristic's first, "
                  "{:.1f} us)",
                  g.m, g.n, g.k, best_i + 1, p.algo_count, 1e3f * best / 3, 1e3f * first / 3);
  p.algo_index = best_i;
  ++epilogue_counts.autotuned_plans;
}

// Enqueues the GEMM; false (and nothing enqueued) only for a GELU epilogue cuBLASLt does not take here.
bool run_gemm(const Gemm& g) {
  if (g.m == 0 || g.n == 0) return true;
  if (g.k == 0) {  // an empty sum (backward with N = 0): adds nothing, or leaves an overwritten D zero
    STRATA_ASSERT_MSG(g.bias == nullptr && g.epilogue == Epilogue::kPlain,
                      "matmul with an epilogue and an empty inner dimension");
    if (g.beta == 0.0f) {
      const size_t elem = g.d_type == CUDA_R_32F ? sizeof(float) : sizeof(uint16_t);
      CUDA_CHECK(cudaMemset2DAsync(g.d, static_cast<size_t>(g.ldd) * elem, 0, static_cast<size_t>(g.m) * elem, g.n,
                                   cuda_context().compute));
    }
    return true;
  }
  const CudaContext& ctx = cuda_context();
  static std::map<PlanKey, Plan> plans;  // one driving thread (cuda_context.h), so no lock
  const int align_a = alignment_of(g.a), align_b = alignment_of(g.b), align_d = alignment_of(g.d);
  // The bias pointer's alignment is part of the key too (an algorithm may depend on it), though cuBLASLt takes
  // no preference for it.
  const int align_bias = g.bias != nullptr ? alignment_of(g.bias) : 0;
  const int align_aux = g.aux != nullptr ? alignment_of(g.aux) : 0;
  const PlanKey key{g.op_a,      g.op_b,   g.m,      g.n,        g.k,
                    g.lda,       g.ldb,    g.ldd,    g.ab_type,  g.d_type,
                    g.beta != 0.0f,        g.bias != nullptr,    align_a,    align_b,
                    align_d,     align_bias,  static_cast<int>(g.epilogue), g.aux_ld, align_aux};
  auto it = plans.find(key);
  if (it == plans.end()) {
    it = plans.emplace(key, make_plan(ctx, g, align_a, align_b, align_d)).first;
    if (it->second.supported && autotune_setting.on()) autotune(ctx, it->second, g);
  }
  Plan& p = it->second;
  if (!p.supported) return false;
  set_epilogue_pointers(p.desc, g);
  const float alpha = 1.0f;
  auto refused = [](cublasStatus_t st) {
    return st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE;
  };
  cublasStatus_t ran = CUBLAS_STATUS_SUCCESS;
  for (;;) {
    ran = cublasLtMatmul(ctx.lt, p.desc, &alpha, g.a, p.a, g.b, p.b, &g.beta, g.d, p.d, g.d, p.d,
                         &p.algos[static_cast<size_t>(p.algo_index)], ctx.lt_workspace,
                         CudaContext::kLtWorkspaceBytes, ctx.compute);
    // Refused before anything was launched, after the heuristic had offered the algorithm: its next candidate.
    if (!refused(ran) || p.algo_index + 1 >= p.algo_count) break;
    STRATA_LOG_INFO("cuBLASLt refused its algorithm {} of {} for m={} n={} k={} ({}); trying the next",
                    p.algo_index + 1, p.algo_count, g.m, g.n, g.k, cublasGetStatusString(ran));
    ++p.algo_index;
  }
  if (g.epilogue != Epilogue::kPlain && refused(ran)) {
    // Every candidate refused: this problem runs as the GEMM and the GELU kernel from now on.
    STRATA_LOG_WARN("cuBLASLt refused its GELU epilogue for m={} n={} k={} ({}); the GEMM and the GELU kernel run "
                    "instead",
                    g.m, g.n, g.k, cublasGetStatusString(ran));
    p.supported = false;
    --epilogue_counts.gelu_plans;
    ++epilogue_counts.fallback_plans;
    return false;
  }
  CUBLAS_CHECK(ran);
  return true;
}
void run_plain(const Gemm& g) {
  const bool ran = run_gemm(g);
  STRATA_ASSERT_MSG(ran, "a GEMM without a GELU epilogue was not run");
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
// A weight (rows,cols) as an operand: under kBF16 its working copy (kernels.h Weight) where the owner keeps one —
// as it is where it already has `operand`'s layout (cols a multiple of 8, no zero rows wanted, aligned as scratch),
// else copied into scratch with the zero rows after it (4 bytes of traffic an element where rounding is 6) —,
// else `operand` of the fp32 values. Bitwise the same operand either way.
Operand weight_operand(Weight w, int rows, int cols, MatmulPrecision precision, bool pad_rows = false) {
  if (precision == MatmulPrecision::kF32 || w.bf16 == nullptr || cols % kBf16RowAlign != 0)
    return operand(w.f32, rows, cols, precision, pad_rows);
  ++epilogue_counts.working_copy_operands;
  const int prows = pad_rows ? round_up(rows, kBf16RowAlign) : rows;
  // In place only at the alignment scratch has (alignment_of's cap), so the GEMM's plan, keyed by its operands'
  // alignments, is the one the rounded operand gets: the same algorithm, the same bits.
  if (prows == rows && alignment_of(w.bf16) >= 256) return {DeviceScratch(), w.bf16, cols};
  const size_t row_bytes = static_cast<size_t>(cols) * sizeof(uint16_t);
  DeviceScratch s(static_cast<size_t>(prows) * row_bytes);
  const cudaStream_t stream = cuda_context().compute;
  CUDA_CHECK(cudaMemcpyAsync(s.as<void>(), w.bf16, static_cast<size_t>(rows) * row_bytes, cudaMemcpyDeviceToDevice,
                             stream));
  if (prows > rows) {
    CUDA_CHECK(cudaMemsetAsync(s.as<char>() + static_cast<size_t>(rows) * row_bytes, 0,
                               static_cast<size_t>(prows - rows) * row_bytes, stream));
  }
  const void* p = s.as<void>();
  return {std::move(s), p, cols};
}
cudaDataType_t ab_type(MatmulPrecision precision) {
  return precision == MatmulPrecision::kF32 ? CUDA_R_32F : CUDA_R_16BF;
}
// A hidden activation (kernels.h) as an operand: its bf16 rows as they are, or its fp32 ones as `operand` takes
// them (rounded to bf16 under kBF16 where the width keeps them fp32).
Operand hidden_operand(const void* x, int rows, int cols, MatmulPrecision precision) {
  if (hidden_bf16(cols, precision)) return {DeviceScratch(), x, cols};
  return operand(static_cast<const float*>(x), rows, cols, precision);
}

}  // namespace

bool hidden_bf16(int width, MatmulPrecision precision) {
  return precision == MatmulPrecision::kBF16 && width % kBf16RowAlign == 0;
}

void matmul_forward(float* out, const float* inp, Weight weight, const float* bias, int N, int C, int OC,
                    MatmulPrecision precision) {
  // An output width that is not a multiple of 8 (GPT-2's vocabulary, 50257) keeps the bf16 GEMM off its fast
  // kernels: compute OC rounded up (zero weight rows) into an aligned scratch and copy the OC columns over — one
  // extra pass over the output, much less than it saves. Not with a bias, whose length must be OC.
  const bool pad = precision == MatmulPrecision::kBF16 && OC % kBf16RowAlign != 0 && bias == nullptr;
  const int m = pad ? round_up(OC, kBf16RowAlign) : OC;
  const Operand w = weight_operand(weight, OC, C, precision, pad);
  const Operand x = operand(inp, N, C, precision);
  DeviceScratch padded(pad ? static_cast<size_t>(N) * m * sizeof(float) : 0);
  float* d = pad ? padded.as<float>() : out;
  // out^T (OC,N) = W (C,OC)^T @ inp^T (C,N)
  run_plain(Gemm{CUBLAS_OP_T, CUBLAS_OP_N, m, N, C, w.ptr, w.ld, x.ptr, x.ld, d, m, 0.0f, bias, ab_type(precision)});
  if (pad) {
    copy_rows(out, OC, d, m, N, OC);
  }
}

namespace {

// dweight^T (C,OC) += inp^T (C,N) @ dout (N,OC), operands of type t.
void dweight_gemm(float* dweight, const Operand& x, const Operand& dy, int N, int C, int OC, cudaDataType_t t) {
  run_plain(Gemm{CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, x.ptr, x.ld, dy.ptr, dy.ld, dweight, C, 1.0f, nullptr, t});
}

// A linear's two backward GEMMs from its output gradient and input as operands (`operand`, `hidden_operand`;
// under bf16 dy's rows padded with zeros to a multiple of 8, dy.ld): dinp (N,C) = dout @ W + dinp_beta * dinp
// (1 adds into dinp, 0 overwrites it), the padding columns meeting zero weight rows; dweight (OC,C) +=
// dout^T @ inp, the first OC of each row.
void backward_gemms(float* dinp, float dinp_beta, float* dweight, const Operand& dy, const Operand& x,
                    Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  const bool bf16 = precision == MatmulPrecision::kBF16;
  const Operand w = weight_operand(weight, OC, C, precision, bf16);  // bf16: zero rows up to a multiple of 8
  const cudaDataType_t t = ab_type(precision);
  // dinp^T (C,N) = W (C,OC) @ dout^T (OC,N) + beta * dinp^T, the inner dimension rounded up over the zero
  // padding in bf16.
  const int k = bf16 ? round_up(OC, kBf16RowAlign) : OC;
  STRATA_ASSERT_MSG(!bf16 || dy.ld == k, "bf16 gradient rows must be padded to a multiple of 8");
  run_plain(Gemm{CUBLAS_OP_N, CUBLAS_OP_N, C, N, k, w.ptr, w.ld, dy.ptr, dy.ld, dinp, C, dinp_beta, nullptr, t});
  dweight_gemm(dweight, x, dy, N, C, OC, t);
}

// From fp32 dout and inp; dbias += column sums of dout.
void backward(float* dinp, float dinp_beta, float* dweight, float* dbias, const float* dout, const float* inp,
              Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  backward_gemms(dinp, dinp_beta, dweight, operand(dout, N, OC, precision), operand(inp, N, C, precision), weight, N,
                 C, OC, precision);
  if (dbias != nullptr) column_sums_accumulate(dbias, dout, N, OC);
}

// The same GEMM with no GELU epilogue, writing D to `d` instead: what a declined epilogue falls back on.
Gemm without_epilogue(Gemm g, void* d) {
  g.epilogue = Epilogue::kPlain;
  g.aux = nullptr;
  g.aux_ld = 0;
  g.d = d;
  return g;
}

// The bias in D's type (cublasLt.h: a bf16 D takes a bf16 bias; autocast rounds it the same way); empty
// without one.
DeviceScratch bias_in_bf16(const float* bias, int OC) {
  DeviceScratch b(bias != nullptr ? static_cast<size_t>(OC) * sizeof(uint16_t) : 0);
  if (bias != nullptr) f32_to_bf16(b.as<uint16_t>(), bias, static_cast<size_t>(OC));
  return b;
}

// A linear whose output is hidden in bf16 (OC a multiple of 8), from a hidden inp: out (N,OC) = inp @ W^T + bias
// in bf16, the bias rounded to bf16 too (D's type) — or, where `pre` is given, pre = that and out = gelu(pre),
// both bf16: cuBLASLt's GELU_AUX_BIAS epilogue (the aux matrix takes D's type), or the GEMM into pre and the GELU
// kernel where it declines.
void forward_into_bf16(void* out, void* pre, const void* inp, Weight weight, const float* bias, int N, int C,
                       int OC) {
  const Operand w = weight_operand(weight, OC, C, MatmulPrecision::kBF16);
  const Operand x = hidden_operand(inp, N, C, MatmulPrecision::kBF16);
  const DeviceScratch bias16 = bias_in_bf16(bias, OC);
  // out^T (OC,N) = [gelu](W (C,OC)^T @ inp^T (C,N) + bias), in bf16.
  Gemm g{CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, w.ptr, w.ld, x.ptr, x.ld, out, OC, 0.0f,
         bias != nullptr ? bias16.as<const void>() : nullptr, CUDA_R_16BF};
  g.d_type = CUDA_R_16BF;
  if (pre == nullptr) {
    run_plain(g);
    return;
  }
  if (alignment_of(pre) >= 16) {
    g.epilogue = Epilogue::kGeluAux;
    g.aux = pre;
    g.aux_ld = OC;
    if (run_gemm(g)) return;
  }
  run_plain(without_epilogue(g, pre));
  gelu_forward_bf16(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(pre),
                    static_cast<size_t>(N) * static_cast<size_t>(OC));
}

// The backward of a linear whose input side is hidden in bf16 (inp and dinp (N,C), C a multiple of 8) from an
// fp32 dout (N,OC): dinp = dout @ W in bf16 (overwritten) — times gelu'(pre) where `pre` (hidden, like dinp) is
// given: cuBLASLt's DGELU epilogue, or the GEMM into `scratch` and the GELU kernel where it declines —;
// dweight (OC,C) += dout^T @ inp; dbias += column sums of dout.
void backward_into_bf16(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                        Weight weight, const void* pre, void* scratch, int N, int C, int OC) {
  const Operand dy = operand(dout, N, OC, MatmulPrecision::kBF16);  // columns padded with zeros to dy.ld
  // Zero rows up to dy.ld.
  const Operand w = weight_operand(weight, OC, C, MatmulPrecision::kBF16, /*pad_rows=*/true);
  const int k = round_up(OC, kBf16RowAlign);
  // dinp^T (C,N) = [gelu'(pre^T) *] (W (C,k) @ dout^T (k,N)), in bf16.
  Gemm g{CUBLAS_OP_N, CUBLAS_OP_N, C, N, k, w.ptr, w.ld, dy.ptr, dy.ld, dinp, C, 0.0f, nullptr, CUDA_R_16BF};
  g.d_type = CUDA_R_16BF;
  if (pre == nullptr) {
    run_plain(g);
  } else {
    bool fused = false;
    if (alignment_of(pre) >= 16) {
      g.epilogue = Epilogue::kDGelu;
      g.aux = pre;
      g.aux_ld = C;
      fused = run_gemm(g);
    }
    if (!fused) {  // the gradient of gelu(pre) into scratch (bf16), then the GELU's backward into dinp
      run_plain(without_epilogue(g, scratch));
      gelu_backward_bf16(static_cast<uint16_t*>(dinp), static_cast<const uint16_t*>(pre),
                         static_cast<const uint16_t*>(scratch), static_cast<size_t>(N) * static_cast<size_t>(C));
    }
  }
  dweight_gemm(dweight, Operand{DeviceScratch(), inp, C}, dy, N, C, OC, CUDA_R_16BF);  // inp already bf16
  if (dbias != nullptr) column_sums_accumulate(dbias, dout, N, OC);
}

}  // namespace

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  backward(dinp, 1.0f, dweight, dbias, dout, inp, weight, N, C, OC, precision);
}

void matmul_backward_set(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                         Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  backward(dinp, 0.0f, dweight, dbias, dout, inp, weight, N, C, OC, precision);
}

size_t hidden_bytes(int N, int F, MatmulPrecision precision) {
  return static_cast<size_t>(N) * static_cast<size_t>(F) * (hidden_bf16(F, precision) ? sizeof(uint16_t) : 4);
}

void matmul_gelu_forward(void* out, void* pre, const void* inp, Weight weight, const float* bias, int N,
                         int C, int OC, MatmulPrecision precision) {
  if (!hidden_bf16(OC, precision)) {
    matmul_forward_hidden(static_cast<float*>(pre), inp, weight, bias, N, C, OC, precision);
    gelu_forward(static_cast<float*>(out), static_cast<const float*>(pre),
                 static_cast<size_t>(N) * static_cast<size_t>(OC));
    return;
  }
  forward_into_bf16(out, pre, inp, weight, bias, N, C, OC);
}

void matmul_forward_to_hidden(void* out, const void* inp, Weight weight, const float* bias, int N, int C,
                              int OC, MatmulPrecision precision) {
  if (!hidden_bf16(OC, precision)) {
    matmul_forward_hidden(static_cast<float*>(out), inp, weight, bias, N, C, OC, precision);
    return;
  }
  forward_into_bf16(out, /*pre=*/nullptr, inp, weight, bias, N, C, OC);
}

void matmul_forward_hidden(float* out, const void* inp, Weight weight, const float* bias, int N, int C, int OC,
                           MatmulPrecision precision) {
  const Operand w = weight_operand(weight, OC, C, precision);
  const Operand x = hidden_operand(inp, N, C, precision);
  // out^T (OC,N) = W (C,OC)^T @ inp^T (C,N) + bias
  run_plain(
      Gemm{CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, w.ptr, w.ld, x.ptr, x.ld, out, OC, 0.0f, bias, ab_type(precision)});
}

void matmul_backward_gelu(void* dpre, float* dweight, float* dbias, const float* dout, const void* inp,
                          const void* pre, Weight weight, void* scratch, int N, int C, int OC,
                          MatmulPrecision precision) {
  if (!hidden_bf16(C, precision)) {  // the gradient of gelu(pre) into scratch, then the GELU's into dpre
    const size_t n = static_cast<size_t>(N) * static_cast<size_t>(C);
    auto* s = static_cast<float*>(scratch);
    backward(s, 0.0f, dweight, dbias, dout, static_cast<const float*>(inp), weight, N, C, OC, precision);
    zero_floats(static_cast<float*>(dpre), n);
    gelu_backward(static_cast<float*>(dpre), static_cast<const float*>(pre), s, n);
    return;
  }
  backward_into_bf16(dpre, dweight, dbias, dout, inp, weight, pre, scratch, N, C, OC);
}

void matmul_backward_hidden(void* dinp, float* dweight, float* dbias, const float* dout, const void* inp,
                            Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  if (!hidden_bf16(C, precision)) {
    backward(static_cast<float*>(dinp), 0.0f, dweight, dbias, dout, static_cast<const float*>(inp), weight, N, C, OC,
             precision);
    return;
  }
  backward_into_bf16(dinp, dweight, dbias, dout, inp, weight, /*pre=*/nullptr, /*scratch=*/nullptr, N, C, OC);
}

void matmul_backward_set_hidden(float* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  backward_gemms(dinp, 0.0f, dweight, hidden_operand(dout, N, OC, precision), hidden_operand(inp, N, C, precision),
                 weight, N, C, OC, precision);
  if (dbias == nullptr) return;
  if (hidden_bf16(OC, precision))
    column_sums_accumulate_bf16(dbias, static_cast<const uint16_t*>(dout), N, OC);
  else
    column_sums_accumulate(dbias, static_cast<const float*>(dout), N, OC);
}

void matmul_forward_bf16_out(uint16_t* out, int ld_out, const void* inp, Weight weight, int N, int C, int OC) {
  STRATA_ASSERT_MSG(ld_out == round_up(OC, kBf16RowAlign), "bf16 output rows must be padded to a multiple of 8");
  // Zero weight rows up to ld_out make the padding columns 0.
  const Operand w = weight_operand(weight, OC, C, MatmulPrecision::kBF16, /*pad_rows=*/true);
  const Operand x = hidden_operand(inp, N, C, MatmulPrecision::kBF16);
  Gemm g{CUBLAS_OP_T, CUBLAS_OP_N, ld_out, N, C, w.ptr, w.ld, x.ptr, x.ld, out, ld_out, 0.0f, nullptr, CUDA_R_16BF};
  g.d_type = CUDA_R_16BF;
  run_plain(g);
}

void matmul_backward_bf16_dout(float* dinp, float* dweight, const uint16_t* dout, int ld_dout, const void* inp,
                               Weight weight, int N, int C, int OC) {
  backward_gemms(dinp, 1.0f, dweight, Operand{DeviceScratch(), dout, ld_dout},
                 hidden_operand(inp, N, C, MatmulPrecision::kBF16), weight, N, C, OC, MatmulPrecision::kBF16);
}

MatmulEpilogueCounts matmul_epilogue_counts() { return epilogue_counts; }

bool matmul_autotune() { return autotune_setting.on(); }
void set_matmul_autotune(bool on) { autotune_setting.set(on); }

}  // namespace strata::kernels::cuda
