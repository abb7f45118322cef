// cudnn_attention.cpp — causal attention through cuDNN's fused flash-attention engines (cudnn_attention.h).
//
// cuDNN's fused attention engines (runtime fusion: they compile the graph they are given) take operation graphs of
// the form its frontend (cudnn-frontend) builds, so the graphs below are that form, op for op, for this one case:
// training, causal (top-left), no bias, dropout or padding, bf16 in and out, fp32 compute, the 1/sqrt(hs) scale
// by value. As a frontend built against cuDNN 9.19's headers lowers it: the forward is Q·Kᵀ, the scale, the
// causal mask (row and column indices, row ≥ column, the rest −inf), the softmax as max, subtract, exp, sum, then
// the stats (max + ln sum: the natural log-sum-exp the flash kernels save too) and the division, and P·V; the
// backward recomputes P from the stats and forms dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P∘(dP − rowsum(dO∘O))·scale,
// dK = dSᵀ·Q and dQ = dS·K. The frontend's deterministic form is tried first (dQ written by its own product from
// dS, no atomic accumulation: the same bits every run, as the rest of the CUDA backend; its workspace holds dP, so
// not where that is over an eighth of the free memory), then the one accumulating dQ in fp32 (first with
// STRATA_CUDNN_DETERMINISTIC=0). On cuDNN 9.21 and later, what a frontend built against those headers sends is tried
// where these find no engine: the forward as one fused operation (SDPA_FWD, causal through a mask subgraph), the
// backward with its mask as one diagonal-band operation.
//
// Layouts: q, k and v are (B,NH,T,hs) views of the (B,T,3C) rows (strides 3C·T, hs, 3C, 1; k and v at C and 2C
// elements on), Kᵀ the same tensor with its last two dimensions' sizes and strides swapped; the output and its
// gradient (B,NH,T,hs) views of (B,T,C) rows; dq, dk, dv views of dqkv like q, k, v; the stats (B,NH,T,1) packed.
//
// Plans are built once per shape (B, T, NH, hs) and backward preference, both directions at the first ask, and
// kept: the engines compile their kernels (NVRTC) then, not in a step. Without a GPU, cuDNN 9.19 chooses engines
// for both graphs for an H100's recorded properties and compiles their kernels (kernels_cuda_test
// CudnnAttentionGraphs).
#include "kernels/cuda/cudnn_attention.h"

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "common/check.h"
#include "common/log.h"
#include "kernels/cuda/cuda_context.h"

#ifdef STRATA_HAVE_CUDNN
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/cuda/cudnn_graph.h"
#endif

namespace strata::kernels::cuda {
namespace {

EnvSwitch cudnn_setting("STRATA_ATTENTION", "flash", "cudnn");
EnvSwitch accumulate_setting("STRATA_CUDNN_DETERMINISTIC", "1", "0");  // on: the accumulating backward first
uint64_t calls = 0;  // one driving thread (cuda_context.h)

}  // namespace

uint64_t cudnn_attention_calls() { return calls; }
bool cudnn_attention_chosen() { return cudnn_setting.on(); }
void set_cudnn_attention_chosen(bool chosen) { cudnn_setting.set(chosen); }
bool cudnn_attention_deterministic() { return !accumulate_setting.on(); }
void set_cudnn_attention_deterministic(bool deterministic) { accumulate_setting.set(!deterministic); }

#ifndef STRATA_HAVE_CUDNN

bool cudnn_attention_runs(int, int, int, int, std::string* why) {
  if (why != nullptr) *why = "this build has no cuDNN: CMake did not find its headers (cudnn_graph.h)";
  return false;
}
bool cudnn_attention_graphs_finalize(int B, int T, int NH, int hs, std::string* why) {
  return cudnn_attention_runs(B, T, NH, hs, why);
}
bool cudnn_attention_reproducible(int, int, int, int) { return false; }
bool cudnn_attention_plans_for_device(const std::string&, int B, int T, int NH, int hs, std::string* how) {
  return cudnn_attention_runs(B, T, NH, hs, how);
}
void cudnn_attention_forward(uint16_t*, const uint16_t*, float*, int, int, int, int) {
  STRATA_ASSERT_MSG(false, "cudnn_attention_forward in a build without cuDNN");
}
void cudnn_attention_backward(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, const float*, int, int,
                              int, int) {
  STRATA_ASSERT_MSG(false, "cudnn_attention_backward in a build without cuDNN");
}

#else

namespace {

using cudnn::build_plan;
using cudnn::Descriptor;
using cudnn::Dims;
using cudnn::Graph;
using cudnn::operation_graph;
using cudnn::Plan;
using cudnn::Target;

// Unique ids of the tensors a variant pack names (the virtual ones are numbered from kFirstVirtual).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kDO, kDQ, kDK, kDV, kOne, kSoftmaxSum, kDQAccum,
  kFirstVirtual = 100,
};

// cuDNN 9.21's single fused forward operation and the descriptors it takes. 9.19's headers (what CI builds with)
// do not name them; the numbers are those of later headers' cudnn_graph.h (not checked against NVIDIA's own: a
// wrong one makes cuDNN refuse the attribute, and the decomposed forward stands).
constexpr auto kDiagonalBandMaskOp = static_cast<cudnnBackendDescriptorType_t>(44);
constexpr auto kSoftmaxOp = static_cast<cudnnBackendDescriptorType_t>(45);
constexpr auto kSdpaFwdSubgraph = static_cast<cudnnBackendAttributeName_t>(2811);
constexpr auto kSdpaFwdSubgraphInputUid = static_cast<cudnnBackendAttributeName_t>(2812);
constexpr auto kSdpaFwdSubgraphOutputUid = static_cast<cudnnBackendAttributeName_t>(2813);
constexpr auto kSdpaFwdSoftmaxDesc = static_cast<cudnnBackendAttributeName_t>(2814);
constexpr auto kBandMaskXDesc = static_cast<cudnnBackendAttributeName_t>(3000);
constexpr auto kBandMaskBDesc = static_cast<cudnnBackendAttributeName_t>(3005);
constexpr auto kBandMaskYDesc = static_cast<cudnnBackendAttributeName_t>(3006);
constexpr auto kBandMaskComparison = static_cast<cudnnBackendAttributeName_t>(3007);
constexpr auto kSoftmaxXDesc = static_cast<cudnnBackendAttributeName_t>(3100);
constexpr auto kSoftmaxYDesc = static_cast<cudnnBackendAttributeName_t>(3101);
constexpr auto kSoftmaxStatsDesc = static_cast<cudnnBackendAttributeName_t>(3102);
const cudnnPointwiseMode_t kCmpGe = CUDNN_POINTWISE_CMP_GE;  // the band's comparison: keep where row >= column

// The first cuDNN that runs these graphs as written: −inf as the mask's value (9.10 on), 9.10's SDPA excluded
// (the frontend refuses 9.10.0 and 9.10.1), dQ's fp32 accumulator needing no zeroing by the caller (9.6 on), and
// no padding mask needed where T is not a multiple of 128 (the frontend adds one up to 9.15, a backend bug's
// workaround).
constexpr size_t kMinVersion = 91600;
constexpr size_t kUnifiedForwardVersion = 92100;

// The shape's sizes and the strides of its views.
struct Shape {
  int64_t B, T, NH, hs;
  Dims qkv() const { return {T * 3 * NH * hs, hs, 3 * NH * hs, 1}; }  // q, k, v and their gradients
  Dims qkv_t() const { return {T * 3 * NH * hs, hs, 1, 3 * NH * hs}; }  // Kᵀ, Vᵀ: the same, last two swapped
  Dims out() const { return {T * NH * hs, hs, NH * hs, 1}; }            // the output and its gradient
  Dims head() const { return {B, NH, T, hs}; }
  Dims head_t() const { return {B, NH, hs, T}; }
  Dims scores() const { return {B, NH, T, T}; }
  Dims scores_strides() const { return {NH * T * T, T * T, T, 1}; }
  Dims scores_t_strides() const { return {NH * T * T, T * T, 1, T}; }  // a (B,NH,T,T) view of Sᵀ
  Dims rows() const { return {B, NH, T, 1}; }
  Dims rows_strides() const { return {NH * T, T, 1, 1}; }
};

// A graph whose virtual tensors are numbered above the uids the variant packs name.
std::unique_ptr<Graph> new_graph(std::string what) { return std::make_unique<Graph>(std::move(what), kFirstVirtual); }

// The causal mask on the scores s: where a column (key) is past the row (query), −inf. `band`: as cuDNN 9.21's
// one diagonal-band operation (what a frontend built against 9.21's headers sends), else as the pointwise chain
// of row and column indices, comparison and select.
const Descriptor& causal_mask(Graph& g, const Shape& sh, const Descriptor& s, const Descriptor& neg_inf,
                              bool band = false) {
  if (band) {
    const Descriptor& masked = g.temp(sh.scores(), sh.scores_strides());
    Descriptor& op = g.keep(kDiagonalBandMaskOp, fmt::format("causal mask operation of the {}", g.what()));
    op.set(kBandMaskXDesc, s).set(kBandMaskBDesc, neg_inf).set(kBandMaskYDesc, masked)
        .raw(kBandMaskComparison, CUDNN_TYPE_POINTWISE_MODE, 1, &kCmpGe);
    g.add(op);
    return masked;
  }
  const Descriptor& row = g.temp(sh.scores(), sh.scores_strides(), CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  const Descriptor& col = g.temp(sh.scores(), sh.scores_strides(), CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  const Descriptor& keep_it = g.temp(sh.scores(), sh.scores_strides(), CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, nullptr, keep_it, CUDNN_DATA_BOOLEAN);
  const Descriptor& masked = g.temp(sh.scores(), sh.scores_strides());
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &neg_inf, &keep_it, masked);  // keep ? s : −inf
  return masked;
}

// §forward, decomposed: Q·Kᵀ, scale, causal mask, softmax with stats, P·V.
std::unique_ptr<Graph> forward_graph(const Shape& sh) {
  auto g = new_graph(fmt::format("attention forward B={} T={} NH={} hs={}", sh.B, sh.T, sh.NH, sh.hs));
  const Descriptor& q = g->tensor(kQ, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& kt = g->tensor(kK, sh.head_t(), sh.qkv_t(), CUDNN_DATA_BFLOAT16);
  const Descriptor& v = g->tensor(kV, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& o = g->tensor(kO, sh.head(), sh.out(), CUDNN_DATA_BFLOAT16);
  const Descriptor& stats = g->tensor(kStats, sh.rows(), sh.rows_strides(), CUDNN_DATA_FLOAT);
  const Descriptor& scale = g->scalar(kScale);
  const Descriptor& neg_inf = g->scalar(kNegInf);

  const Descriptor& s = g->temp(sh.scores(), sh.scores_strides());
  g->matmul(q, kt, s);
  const Descriptor& scaled = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_MUL, s, &scale, nullptr, scaled);
  const Descriptor& masked = causal_mask(*g, sh, scaled, neg_inf);
  const Descriptor& max = g->temp(sh.rows(), sh.rows_strides());
  g->reduction(CUDNN_REDUCE_TENSOR_MAX, masked, max);
  const Descriptor& shifted = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_SUB, masked, &max, nullptr, shifted);
  const Descriptor& e = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);
  const Descriptor& sum = g->temp(sh.rows(), sh.rows_strides());
  g->reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const Descriptor& log_sum = g->temp(sh.rows(), sh.rows_strides());
  g->pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, log_sum);
  g->pointwise(CUDNN_POINTWISE_ADD, max, &log_sum, nullptr, stats);
  const Descriptor& p = g->temp(sh.scores(), sh.scores_strides(), CUDNN_DATA_BFLOAT16);
  g->pointwise(CUDNN_POINTWISE_DIV, e, &sum, nullptr, p);
  g->matmul(p, v, o);
  return g;
}

// The forward as cuDNN 9.21's one fused operation: the mask a subgraph of one diagonal-band operation, the stats
// through a softmax descriptor. Returns the graph and the operation the op graph is to hold (only it).
std::pair<std::unique_ptr<Graph>, const Descriptor*> unified_forward_graph(const Shape& sh) {
  auto g = new_graph(
      fmt::format("attention forward (fused operation) B={} T={} NH={} hs={}", sh.B, sh.T, sh.NH, sh.hs));
  const Descriptor& q = g->tensor(kQ, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& k = g->tensor(kK, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& v = g->tensor(kV, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& o = g->tensor(kO, sh.head(), sh.out(), CUDNN_DATA_BFLOAT16);
  const Descriptor& stats = g->tensor(kStats, sh.rows(), sh.rows_strides(), CUDNN_DATA_FLOAT);
  const Descriptor& scale = g->scalar(kScale);
  const Descriptor& neg_inf = g->scalar(kNegInf);

  constexpr int64_t kMaskIn = 90, kMaskOut = 91;
  const Descriptor& mask_in = g->tensor(kMaskIn, sh.scores(), sh.scores_strides(), CUDNN_DATA_FLOAT, true);
  const Descriptor& mask_out = g->tensor(kMaskOut, sh.scores(), sh.scores_strides(), CUDNN_DATA_FLOAT, true);
  Descriptor& band = g->keep(kDiagonalBandMaskOp, "causal mask operation of the fused forward");
  band.set(kBandMaskXDesc, mask_in)
      .set(kBandMaskBDesc, neg_inf)
      .set(kBandMaskYDesc, mask_out)
      .raw(kBandMaskComparison, CUDNN_TYPE_POINTWISE_MODE, 1, &kCmpGe);
  g->check(band.finalize());
  Descriptor& subgraph = g->keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "causal mask subgraph of the fused forward");
  subgraph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, std::vector<const Descriptor*>{&band});
  g->check(subgraph.finalize());

  const Descriptor& softmax_in = g->temp(sh.scores(), sh.scores_strides());
  const Descriptor& softmax_out = g->temp(sh.scores(), sh.scores_strides());
  Descriptor& softmax = g->keep(kSoftmaxOp, "softmax of the fused forward");
  softmax.set(kSoftmaxXDesc, softmax_in).set(kSoftmaxYDesc, softmax_out).set(kSoftmaxStatsDesc, stats);
  g->check(softmax.finalize());

  Descriptor& sdpa = g->keep(CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR, "fused forward operation");
  sdpa.set(CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, q)
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, k)
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, v)
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, o)
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, scale)
      .set(kSdpaFwdSoftmaxDesc, softmax)
      .set(kSdpaFwdSubgraph, subgraph)
      .set(kSdpaFwdSubgraphInputUid, kMaskIn)
      .set(kSdpaFwdSubgraphOutputUid, kMaskOut);
  g->check(sdpa.finalize());
  return {std::move(g), &sdpa};
}

// §backward, decomposed. `accumulate`: dQ summed in an fp32 accumulator then converted (the frontend's default,
// atomics); else written by its own product (the frontend's deterministic form on sm_90). `band`: the causal mask
// as one operation (causal_mask).
std::unique_ptr<Graph> backward_graph(const Shape& sh, bool accumulate, bool band = false) {
  auto g = new_graph(fmt::format("attention backward{}{} B={} T={} NH={} hs={}",
                                               accumulate ? " (accumulating dQ)" : "", band ? " (band mask)" : "",
                                               sh.B, sh.T, sh.NH, sh.hs));
  const Descriptor& q = g->tensor(kQ, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& kt = g->tensor(kK, sh.head_t(), sh.qkv_t(), CUDNN_DATA_BFLOAT16);
  const Descriptor& vt = g->tensor(kV, sh.head_t(), sh.qkv_t(), CUDNN_DATA_BFLOAT16);
  const Descriptor& o = g->tensor(kO, sh.head(), sh.out(), CUDNN_DATA_BFLOAT16);
  const Descriptor& d_o = g->tensor(kDO, sh.head(), sh.out(), CUDNN_DATA_BFLOAT16);
  const Descriptor& stats = g->tensor(kStats, sh.rows(), sh.rows_strides(), CUDNN_DATA_FLOAT);
  const Descriptor& dq = g->tensor(kDQ, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& dk = g->tensor(kDK, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& dv = g->tensor(kDV, sh.head(), sh.qkv(), CUDNN_DATA_BFLOAT16);
  const Descriptor& scale = g->scalar(kScale);
  const Descriptor& neg_inf = g->scalar(kNegInf);
  const Descriptor& one = g->scalar(kOne);
  const Descriptor& softmax_sum = g->tensor(kSoftmaxSum, sh.rows(), sh.rows_strides(), CUDNN_DATA_FLOAT);

  // softmax_sum = rowsum(dO∘O) (the product's strides as the frontend writes them)
  const Descriptor& prod = g->temp(sh.head(), {sh.NH * sh.T * sh.hs, sh.T * sh.hs, sh.NH * sh.hs, 1});
  g->pointwise(CUDNN_POINTWISE_MUL, d_o, &o, nullptr, prod);
  const Descriptor& row_sum = g->temp(sh.rows(), sh.rows_strides());
  g->reduction(CUDNN_REDUCE_TENSOR_ADD, prod, row_sum);
  g->pointwise(CUDNN_POINTWISE_MUL, row_sum, &one, nullptr, softmax_sum);

  // P = exp(scale·Q·Kᵀ − stats), masked
  const Descriptor& s = g->temp(sh.scores(), sh.scores_strides());
  g->matmul(q, kt, s);
  const Descriptor& scaled = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_MUL, s, &scale, nullptr, scaled);
  const Descriptor& shifted = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_SUB, scaled, &stats, nullptr, shifted);
  const Descriptor& masked = causal_mask(*g, sh, shifted, neg_inf, band);
  const Descriptor& p = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, p);

  // dV = Pᵀ·dO
  const Descriptor& p_t = g->temp({sh.B, sh.NH, sh.T, sh.T}, sh.scores_t_strides(), CUDNN_DATA_BFLOAT16);
  g->reshape(p, p_t);
  g->matmul(p_t, d_o, dv);

  // dS = P∘(dO·Vᵀ − softmax_sum)·scale
  const Descriptor& dp = g->temp(sh.scores(), sh.scores_strides());
  g->matmul(d_o, vt, dp);
  const Descriptor& centred = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_SUB, dp, &softmax_sum, nullptr, centred);
  const Descriptor& weighted = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_MUL, centred, &p, nullptr, weighted);
  const Descriptor& ds = g->temp(sh.scores(), sh.scores_strides());
  g->pointwise(CUDNN_POINTWISE_MUL, weighted, &scale, nullptr, ds);

  // dK = dSᵀ·Q
  const Descriptor& ds_t = g->temp({sh.B, sh.NH, sh.T, sh.T}, sh.scores_t_strides(), CUDNN_DATA_BFLOAT16);
  g->reshape(ds, ds_t);
  g->matmul(ds_t, q, dk);

  // dQ = dS·K (K seen back in its own layout)
  const Descriptor& k = g->temp(sh.head(), sh.qkv());
  g->reshape(kt, k);
  if (accumulate) {
    const Descriptor& dq_accum = g->tensor(kDQAccum, sh.head(), {sh.NH * sh.T * sh.hs, sh.T * sh.hs, sh.hs, 1},
                                           CUDNN_DATA_FLOAT);
    g->matmul(ds, k, dq_accum);
    g->pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq);
  } else {
    g->matmul(ds, k, dq);
  }
  return g;
}

struct ShapePlans {
  Status status;  // ok: both plans built
  Plan forward, backward;
};

// The backward's forms in the order they are tried: deterministic, then accumulating dQ (or the other way round
// where asked), each with the mask as the pointwise chain, then (cuDNN 9.21 on) as one operation.
struct BackwardForm {
  bool band, accumulate;
};
std::vector<BackwardForm> backward_forms(size_t version, bool deterministic_first) {
  std::vector<BackwardForm> forms;
  for (const bool band : {false, true}) {
    if (band && version < kUnifiedForwardVersion) break;
    for (const bool accumulate : {!deterministic_first, deterministic_first}) forms.push_back({band, accumulate});
  }
  return forms;
}

using Key = std::tuple<int, int, int, int, bool>;  // B, T, NH, hs, deterministic first

ShapePlans build(const Shape& sh, const Target& target, bool deterministic_first) {
  ShapePlans r;
  auto loaded = cudnn::load();
  if (!loaded.is_ok()) {
    r.status = loaded.status();
    return r;
  }
  const size_t version = loaded.value()->GetVersion();
  if (version < kMinVersion) {
    r.status = Status::not_found("cuDNN {} is older than 9.16, the first these attention graphs are written for",
                                 version);
    return r;
  }
  if (sh.T < 2) {  // the frontend refuses a backward of one query and one key
    r.status = Status::not_found("cuDNN's fused attention takes sequences of 2 or more, not T={}", sh.T);
    return r;
  }
  auto fwd = build_plan(forward_graph(sh), target);
  if (fwd.is_ok()) {
    fwd->how = "decomposed graph, " + fwd->how;
  } else if (version >= kUnifiedForwardVersion) {
    auto [g, op] = unified_forward_graph(sh);
    auto unified = build_plan(std::move(g), target, op);
    if (!unified.is_ok()) {
      r.status = Status(fwd.status().code(), fmt::format("{}; and as one fused operation: {}",
                                                         fwd.status().message(), unified.status().message()));
      return r;
    }
    unified->how = "one fused operation, " + unified->how;
    fwd = std::move(unified);
  } else {
    r.status = fwd.status();
    return r;
  }
  // The deterministic form's workspace holds dP (about B·NH·T·T bf16), so it is passed over where that is more
  // than an eighth of the GPU's free memory.
  size_t free_bytes = SIZE_MAX;
  if (target.handle != nullptr) {
    size_t total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) free_bytes = SIZE_MAX;
  }
  std::string refusals;
  for (const BackwardForm form : backward_forms(version, deterministic_first)) {
    auto bwd = build_plan(backward_graph(sh, form.accumulate, form.band), target);
    if (bwd.is_ok() && !form.accumulate && static_cast<size_t>(bwd->workspace) > free_bytes / 8) {
      refusals += fmt::format("{}the deterministic form's workspace of {:.0f} MiB is over an eighth of the {:.0f} "
                              "MiB free",
                              refusals.empty() ? "" : "; ", static_cast<double>(bwd->workspace) / (1 << 20),
                              static_cast<double>(free_bytes) / (1 << 20));
      continue;
    }
    if (!bwd.is_ok()) {
      refusals += fmt::format("{}{}", refusals.empty() ? "" : "; ", bwd.status().message());
      continue;
    }
    bwd->accumulates_dq = form.accumulate;
    bwd->how = fmt::format("{}{}, {}", form.accumulate ? "accumulating dQ in fp32 (not bitwise reproducible)"
                                                       : "deterministic",
                           form.band ? ", band mask" : "", bwd->how);
    r.forward = std::move(fwd).value();
    r.backward = std::move(bwd).value();
    return r;
  }
  r.status = Status::not_found("cuDNN cannot run the attention backward B={} T={} NH={} hs={}: {}", sh.B, sh.T,
                               sh.NH, sh.hs, refusals);
  return r;
}

ShapePlans& plans_for(int B, int T, int NH, int hs) {
  // One driving thread (cuda_context.h), so no lock. Never destroyed: at exit the plans would be destroyed after
  // cuDNN itself (loaded after this was made), as CudaContext is left for the same reason.
  static auto& plans = *new std::map<Key, ShapePlans>;
  const bool deterministic = cudnn_attention_deterministic();
  const Key key{B, T, NH, hs, deterministic};
  auto it = plans.find(key);
  if (it == plans.end()) {
    ShapePlans built;
    if (auto h = cudnn::handle(); h.is_ok())
      built = build(Shape{B, T, NH, hs}, Target{h.value(), nullptr}, deterministic);
    else
      built.status = h.status();
    it = plans.emplace(key, std::move(built)).first;
    const ShapePlans& p = it->second;
    if (p.status.is_ok())
      STRATA_LOG_INFO("cuDNN attention B={} T={} NH={} hs={}: forward {}; backward {}", B, T, NH, hs, p.forward.how,
                      p.backward.how);
    else
      STRATA_LOG_WARN("cuDNN attention B={} T={} NH={} hs={} cannot run ({}); the other attention path runs", B, T,
                      NH, hs, p.status.to_string());
  }
  return it->second;
}

// Runs `plan` with the tensors `uids` at `pointers` (the scalars' by host pointer). One stream-ordered scratch holds
// `own_workspace` first (uid and bytes of each tensor the frontend would keep in its workspace: the backward's fp32
// dQ accumulator and rows of dO·O; their pointers are added here), then cuDNN's workspace.
void execute(const Plan& plan, std::vector<int64_t> uids, std::vector<void*> pointers,
             const std::vector<std::pair<int64_t, size_t>>& own_workspace) {
  size_t own = 0;
  for (const auto& [uid, bytes] : own_workspace) own += (bytes + 255) / 256 * 256;
  DeviceScratch scratch(own + static_cast<size_t>(plan.workspace));
  size_t offset = 0;
  for (const auto& [uid, bytes] : own_workspace) {
    uids.push_back(uid);
    pointers.push_back(scratch.as<char>() + offset);
    offset += (bytes + 255) / 256 * 256;
  }
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "attention variant pack");
  pack.set_pointer(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, plan.workspace > 0 ? scratch.as<char>() + own : nullptr)
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, pointers)
      .set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids);
  const Status st = pack.finalize();
  STRATA_ASSERT_MSG(st.is_ok(), st.message().c_str());
  const cudnnStatus_t s = cudnn::load().value()->BackendExecute(cudnn::handle().value(), plan.plan.get(), pack.get());
  if (s != CUDNN_STATUS_SUCCESS) {
    const std::string msg = fmt::format("cudnnBackendExecute ({}): {}", plan.how, cudnn::describe(s));
    STRATA_ASSERT_MSG(false, msg.c_str());
  }
}

void* mut(const void* p) { return const_cast<void*>(p); }

}  // namespace

bool cudnn_attention_graphs_finalize(int B, int T, int NH, int hs, std::string* why) {
  auto loaded = cudnn::load();
  Status st = loaded.status();
  const Shape sh{B, T, NH, hs};
  if (st.is_ok()) st = operation_graph(*forward_graph(sh), nullptr, nullptr).status();
  const size_t version = st.is_ok() ? loaded.value()->GetVersion() : 0;
  for (const BackwardForm form : backward_forms(version, /*deterministic_first=*/true))
    if (st.is_ok()) st = operation_graph(*backward_graph(sh, form.accumulate, form.band), nullptr, nullptr).status();
  if (st.is_ok() && version >= kUnifiedForwardVersion) {
    auto [g, op] = unified_forward_graph(sh);
    st = operation_graph(*g, op, nullptr).status();
  }
  if (!st.is_ok() && why != nullptr) *why = st.to_string();
  return st.is_ok();
}

bool cudnn_attention_plans_for_device(const std::string& device_json, int B, int T, int NH, int hs,
                                      std::string* how) {
  auto device = cudnn::device_properties(device_json);
  ShapePlans p;
  if (device.is_ok())
    p = build(Shape{B, T, NH, hs}, Target{nullptr, &device.value()}, cudnn_attention_deterministic());
  else
    p.status = device.status();
  if (how != nullptr)
    *how = p.status.is_ok() ? fmt::format("forward {}; backward {}", p.forward.how, p.backward.how)
                            : p.status.to_string();
  return p.status.is_ok();
}

bool cudnn_attention_reproducible(int B, int T, int NH, int hs) {
  const ShapePlans& p = plans_for(B, T, NH, hs);
  return p.status.is_ok() && !p.backward.accumulates_dq;
}

bool cudnn_attention_runs(int B, int T, int NH, int hs, std::string* why) {
  const ShapePlans& p = plans_for(B, T, NH, hs);
  if (!p.status.is_ok() && why != nullptr) *why = p.status.to_string();
  return p.status.is_ok();
}

void cudnn_attention_forward(uint16_t* out, const uint16_t* qkv, float* lse, int B, int T, int NH, int hs) {
  const ShapePlans& p = plans_for(B, T, NH, hs);
  STRATA_ASSERT_MSG(p.status.is_ok(), "cudnn_attention_forward for a shape cuDNN cannot run");
  const size_t C = static_cast<size_t>(NH) * hs;
  float scale = 1.0f / std::sqrt(static_cast<float>(hs)), neg_inf = -std::numeric_limits<float>::infinity();
  ++calls;
  execute(p.forward, {kQ, kK, kV, kO, kStats, kScale, kNegInf},
          {mut(qkv), mut(qkv + C), mut(qkv + 2 * C), out, lse, &scale, &neg_inf}, {});
}

void cudnn_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int hs) {
  const ShapePlans& p = plans_for(B, T, NH, hs);
  STRATA_ASSERT_MSG(p.status.is_ok(), "cudnn_attention_backward for a shape cuDNN cannot run");
  const size_t C = static_cast<size_t>(NH) * hs, rows = static_cast<size_t>(B) * NH * T;
  float scale = 1.0f / std::sqrt(static_cast<float>(hs)), neg_inf = -std::numeric_limits<float>::infinity(),
        one = 1.0f;
  std::vector<std::pair<int64_t, size_t>> own{{kSoftmaxSum, rows * sizeof(float)}};
  if (p.backward.accumulates_dq) own.insert(own.begin(), {kDQAccum, rows * hs * sizeof(float)});
  ++calls;
  execute(p.backward, {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kNegInf, kOne},
          {mut(qkv), mut(qkv + C), mut(qkv + 2 * C), mut(out), mut(dout), mut(lse), dqkv, dqkv + C, dqkv + 2 * C,
           &scale, &neg_inf, &one},
          own);
}

#endif  // STRATA_HAVE_CUDNN

}  // namespace strata::kernels::cuda
