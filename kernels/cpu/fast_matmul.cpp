// fast_matmul.cpp — matmul forward and backward on oneDNN (CPU engine), with cached primitives.
//
// Every product is one oneDNN matmul C (M,Ncol) [+]= A (M,K) @ B (K,Ncol) [+ bias] whose operands are the
// caller's arrays viewed through strides, so transposes need no copies of ours (oneDNN's brgemm packs its
// operands into blocks as it goes, transposed or not):
//   forward          out (N,OC)  = inp (N,C)       @ weight^T (C,OC)  + bias   (B transposed)
//   backward data    dinp (N,C) += dout (N,OC)     @ weight (OC,C)             (sum post-op)
//   backward weights dW (OC,C)  += dout^T (OC,N)   @ inp (N,C)                 (A transposed, sum post-op)
// "+=" is oneDNN's sum post-op (dst = acc + 1.0 * dst, in fp32), so no temporary and no second pass.
// dbias is column sums of dout over TBB chunks of columns, each column summed in row order: deterministic and
// bit-identical to the fp32 reference.
//
// kBF16 rounds the inputs to bf16 (round to nearest even, exactly common/dtype.h's f32_to_bf16, here with
// AVX-512 across TBB chunks) into per-thread scratch, then runs oneDNN's bf16 x bf16 -> f32 matmul
// (AVX-512 BF16 dot products, fp32 accumulation and destination). Without AVX-512 the rounded values are
// multiplied in fp32 instead (see matmul_bf16_native()).
//
// Threading: oneDNN's runtime here is OpenMP (Debian builds libdnnl with DNNL_CPU_RUNTIME=OMP), so the matmul
// itself runs on OMP_NUM_THREADS threads (default: every core) and the bf16 rounding and dbias on TBB.
// Primitives are cached process-wide behind a mutex, keyed by op, shapes, transposes, precision, bias and
// accumulation; repeated calls with the same shapes create no primitive. Each calling thread has its own
// oneDNN stream and its own bf16 scratch, so calls on disjoint outputs may come from several threads (each
// such thread then gets its own OpenMP team: callers should not run matmuls from many threads at once).
// Determinism: the same inputs on the same machine and thread count give the same bits every run.
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <dnnl.hpp>
#include <dnnl_debug.h>
#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/aligned.h"
#include "common/check.h"
#include "common/dtype.h"
#include "kernels/cpu/fast.h"
#include "kernels/cpu/matmul_info.h"

namespace strata::kernels::cpu {
namespace {

// --- the error boundary ---------------------------------------------------------------------------------------

// The C++ API throws dnnl::error; it must not escape into callers that expect an abort-on-bug contract, so every
// oneDNN call goes through DNNL_CALL, which aborts naming the call, oneDNN's message and status, and file:line.
[[noreturn]] void dnnl_fail(const dnnl::error& e, const char* call, const char* func, const char* file, int line) {
  const std::string err = fmt::format("{} (status {})", e.what(), dnnl_status2str(e.status));
  ::strata::detail::call_fail("oneDNN", call, err.c_str(), func, file, line);
}
template <typename Fn>
auto dnnl_call(Fn&& fn, const char* call, const char* func, const char* file, int line) -> decltype(fn()) {
  try {
    return fn();
  } catch (const dnnl::error& e) {
    dnnl_fail(e, call, func, file, line);
  }
}
#define DNNL_CALL(...) dnnl_call([&]() { return __VA_ARGS__; }, #__VA_ARGS__, __func__, __FILE__, __LINE__)

using dt = dnnl::memory::data_type;

const dnnl::engine& engine() {
  static const dnnl::engine e = DNNL_CALL(dnnl::engine(dnnl::engine::kind::cpu, 0));
  return e;
}
// One stream per calling thread: oneDNN does not promise that a stream may be used by several threads at once.
// On the CPU engine a stream is a small handle and execution is synchronous in the calling thread.
dnnl::stream& stream() {
  thread_local dnnl::stream s = DNNL_CALL(dnnl::stream(engine()));
  return s;
}

// --- the primitive cache --------------------------------------------------------------------------------------

enum class Op : uint8_t { kForward, kBackwardData, kBackwardWeights };

// C (M,Ncol) [+]= A (M,K) @ B (K,Ncol) [+ bias (Ncol)]. A transposed means A is stored as (K,M) row-major.
struct GemmKey {
  Op op;
  dt in_type;  // f32 or bf16 (A and B); C and bias are always f32
  int64_t M, K, Ncol;
  bool trans_a, trans_b, bias, accumulate;
  bool operator==(const GemmKey&) const = default;
};
struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    size_t h = std::hash<int64_t>()(k.M);
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<uint64_t>(k.K));
    mix(static_cast<uint64_t>(k.Ncol));
    mix((static_cast<uint64_t>(k.op) << 8) | (static_cast<uint64_t>(k.in_type) << 16) | (k.trans_a << 0) |
        (k.trans_b << 1) | (k.bias << 2) | (k.accumulate << 3));
    return h;
  }
};

struct Gemm {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, bias, c;
  std::string impl;  // oneDNN's implementation name, e.g. "brg:avx512_core_bf16"
};

// Logical (rows, cols); `transposed` means the array is stored as (cols, rows) row-major.
dnnl::memory::desc matrix_desc(int64_t rows, int64_t cols, dt type, bool transposed) {
  const dnnl::memory::dims strides = transposed ? dnnl::memory::dims{1, rows} : dnnl::memory::dims{cols, 1};
  return DNNL_CALL(dnnl::memory::desc({rows, cols}, type, strides));
}

std::shared_ptr<const Gemm> create_gemm(const GemmKey& k) {
  auto g = std::make_shared<Gemm>();
  g->a = matrix_desc(k.M, k.K, k.in_type, k.trans_a);
  g->b = matrix_desc(k.K, k.Ncol, k.in_type, k.trans_b);
  g->c = matrix_desc(k.M, k.Ncol, dt::f32, false);
  if (k.bias) g->bias = matrix_desc(1, k.Ncol, dt::f32, false);  // broadcast over rows
  dnnl::primitive_attr attr;
  if (k.accumulate) {
    dnnl::post_ops po;
    DNNL_CALL(po.append_sum(1.0f));
    DNNL_CALL(attr.set_post_ops(po));
  }
  const auto desc = k.bias ? DNNL_CALL(dnnl::matmul::desc(g->a, g->b, g->bias, g->c))
                           : DNNL_CALL(dnnl::matmul::desc(g->a, g->b, g->c));
  const auto pd = DNNL_CALL(dnnl::matmul::primitive_desc(desc, attr, engine()));
  g->impl = pd.impl_info_str();
  g->prim = DNNL_CALL(dnnl::matmul(pd));
  return g;
}

// Process-wide; a mutex is enough (a lookup is ~100 ns next to a matmul). Bounded so that a caller sweeping
// shapes cannot grow it without limit: when full it is emptied (entries in use stay alive through shared_ptr).
class GemmCache {
 public:
  static GemmCache& instance() {
    static GemmCache* c = new GemmCache();  // never destroyed: calls may come during static destruction
    return *c;
  }
  std::shared_ptr<const Gemm> get(const GemmKey& k) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(k);
    if (it != map_.end()) return it->second;
    if (map_.size() >= kCapacity) map_.clear();
    auto g = create_gemm(k);
    ++created_;
    map_.emplace(k, g);
    return g;
  }
  size_t created() {
    std::lock_guard<std::mutex> lock(mu_);
    return created_;
  }

 private:
  static constexpr size_t kCapacity = 256;  // a GPT has ~10 distinct matmul shapes per precision
  std::mutex mu_;
  std::unordered_map<GemmKey, std::shared_ptr<const Gemm>, GemmKeyHash> map_;
  size_t created_ = 0;
};

void run_gemm(const GemmKey& k, const void* a, const void* b, const float* bias, float* c) {
  const std::shared_ptr<const Gemm> g = GemmCache::instance().get(k);
  const dnnl::engine& eng = engine();
  // Memory objects only wrap the caller's pointers (no allocation of data); oneDNN never writes A, B or bias.
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, DNNL_CALL(dnnl::memory(g->a, eng, const_cast<void*>(a)))},
      {DNNL_ARG_WEIGHTS, DNNL_CALL(dnnl::memory(g->b, eng, const_cast<void*>(b)))},
      {DNNL_ARG_DST, DNNL_CALL(dnnl::memory(g->c, eng, c))},
  };
  if (k.bias) args.emplace(DNNL_ARG_BIAS, DNNL_CALL(dnnl::memory(g->bias, eng, const_cast<float*>(bias))));
  dnnl::stream& s = stream();
  DNNL_CALL(g->prim.execute(s, args));
  DNNL_CALL(s.wait());
}

// --- bf16 inputs ----------------------------------------------------------------------------------------------

bool bf16_native() {
  // Probing beats comparing ISA enums: oneDNN's bf16 matmul needs AVX-512 (emulated on avx512_core, native on
  // avx512_core_bf16), and ONEDNN_MAX_CPU_ISA may lower what it uses.
  static const bool native = [] {
    try {
      dnnl::memory::desc m({2, 2}, dt::bf16, dnnl::memory::format_tag::ab);
      dnnl::memory::desc c({2, 2}, dt::f32, dnnl::memory::format_tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m, m, c), engine());
      return true;
    } catch (const dnnl::error& e) {
      if (e.status == dnnl_unimplemented) return false;
      dnnl_fail(e, "probe of a bf16 matmul", __func__, __FILE__, __LINE__);
    }
  }();
  return native;
}

// Rounds n floats to bf16 exactly as f32_to_bf16 does (ties to even, NaN -> quiet NaN, denormals kept), and
// stores either the bf16 bits (`widen` false, dst is uint16_t) or those values widened back to f32 (dst float).
// GCC 12 warns falsely about _mm512_undefined_* inside its own AVX-512 headers (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) void round_bf16_avx512(const float* src, void* dst, size_t n, bool widen) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(src + i);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(hi, one))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, quiet));
    if (widen) {
      _mm512_storeu_si512(static_cast<float*>(dst) + i, _mm512_slli_epi32(r, 16));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i), _mm512_cvtepi32_epi16(r));
    }
  }
  for (; i < n; ++i) {
    const uint16_t h = f32_to_bf16(src[i]);
    if (widen) static_cast<float*>(dst)[i] = bf16_to_f32(h);
    else static_cast<uint16_t*>(dst)[i] = h;
  }
}
#pragma GCC diagnostic pop
void round_bf16_scalar(const float* src, void* dst, size_t n, bool widen) {
  if (!widen) return f32_to_bf16_n(src, static_cast<uint16_t*>(dst), n);
  for (size_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = bf16_to_f32(f32_to_bf16(src[i]));
}

// Per-thread scratch for rounded inputs: grown to the largest request and kept, so steady-state calls allocate
// nothing (the LM head's dout in bf16 is N*V*2 bytes, ~100 MB at N=1024, V=50257).
void* scratch(int slot, size_t bytes) {
  thread_local AlignedBuffer buf[3];
  AlignedBuffer& b = buf[slot];
  if (b.size() < bytes) {
    b.reset();  // free first so that the old and new buffers are never held together
    Result<AlignedBuffer> r = AlignedBuffer::allocate(bytes, "matmul.bf16_inputs");
    STRATA_ASSERT_MSG(r.is_ok(), r.status().message().c_str());
    b = std::move(r).value();
  }
  return b.data();
}

// Rounds x (n) into dst on every core: bf16 bits (`widen` false) or the rounded values as f32.
void round_bf16(const float* x, void* dst, size_t n, bool widen) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  constexpr size_t kChunk = size_t{1} << 16;  // 256 KiB of input per task: big enough to amortise scheduling
  tbb::parallel_for(tbb::blocked_range<size_t>(0, (n + kChunk - 1) / kChunk), [&](const auto& r) {
    const size_t begin = r.begin() * kChunk, end = std::min(n, r.end() * kChunk);
    const size_t off = begin * (widen ? sizeof(float) : sizeof(uint16_t));
    void* d = static_cast<char*>(dst) + off;
    if (avx512) round_bf16_avx512(x + begin, d, end - begin, widen);
    else round_bf16_scalar(x + begin, d, end - begin, widen);
  });
}

// Rounds x (n) into scratch `slot` and returns it: bf16 bits if oneDNN has a bf16 kernel, else rounded f32.
const void* rounded_input(int slot, const float* x, size_t n) {
  const bool widen = !bf16_native();
  void* dst = scratch(slot, n * (widen ? sizeof(float) : sizeof(uint16_t)));
  round_bf16(x, dst, n, widen);
  return dst;
}

// A weight (OC*C = n) as the bf16 matmul takes it: its working copy where the owner keeps one and oneDNN runs
// bf16 itself (bitwise what rounded_input makes), else rounded into scratch `slot`.
const void* rounded_weight(int slot, Weight w, size_t n) {
  if (w.bf16 != nullptr && bf16_native()) return w.bf16;
  return rounded_input(slot, w.f32, n);
}

dt input_type(MatmulPrecision p) {
  return p == MatmulPrecision::kBF16 && bf16_native() ? dt::bf16 : dt::f32;
}

// --- dbias ----------------------------------------------------------------------------------------------------

// dbias (OC) += column sums of dout (N,OC). TBB splits the columns; each column is summed in row order into a
// local fp32 sum and added once, as the reference does, so the result does not depend on the split.
void bias_backward(float* dbias, const float* dout, int N, int OC) {
  constexpr int kCols = 256;  // one row segment is 1 KiB: contiguous loads, and sums stay in L1
  tbb::parallel_for(tbb::blocked_range<int>(0, OC, kCols), [&](const tbb::blocked_range<int>& r) {
    float sum[kCols];
    for (int o0 = r.begin(); o0 < r.end(); o0 += kCols) {
      const int w = std::min(kCols, r.end() - o0);
      std::fill(sum, sum + w, 0.0f);
      for (int n = 0; n < N; ++n) {
        const float* g = dout + static_cast<size_t>(n) * OC + o0;
        for (int j = 0; j < w; ++j) sum[j] += g[j];
      }
      for (int j = 0; j < w; ++j) dbias[o0 + j] += sum[j];
    }
  });
}

}  // namespace

// --- the public functions -------------------------------------------------------------------------------------

namespace fast {

void matmul_forward(float* out, const float* inp, Weight weight, const float* bias, int N, int C, int OC,
                    MatmulPrecision precision) {
  STRATA_ASSERT(N >= 0 && C >= 0 && OC >= 0);
  if (N == 0 || OC == 0) return;
  if (C == 0) {  // an empty sum: oneDNN would be asked for a K = 0 product
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < OC; ++o) out[static_cast<size_t>(n) * OC + o] = bias != nullptr ? bias[o] : 0.0f;
    return;
  }
  const void* a = inp;
  const void* b = weight.f32;
  if (precision == MatmulPrecision::kBF16) {
    a = rounded_input(0, inp, static_cast<size_t>(N) * C);
    b = rounded_weight(1, weight, static_cast<size_t>(OC) * C);
  }
  const GemmKey k{Op::kForward, input_type(precision), N, C, OC, false, true, bias != nullptr, false};
  run_gemm(k, a, b, bias, out);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     Weight weight, int N, int C, int OC, MatmulPrecision precision) {
  STRATA_ASSERT(N >= 0 && C >= 0 && OC >= 0);
  if (dbias != nullptr && N > 0) bias_backward(dbias, dout, N, OC);
  if (N == 0 || C == 0 || OC == 0) return;  // every other "+=" adds an empty sum
  const void* g = dout;
  const void* x = inp;
  const void* w = weight.f32;
  if (precision == MatmulPrecision::kBF16) {
    g = rounded_input(0, dout, static_cast<size_t>(N) * OC);
    x = rounded_input(1, inp, static_cast<size_t>(N) * C);
    w = rounded_weight(2, weight, static_cast<size_t>(OC) * C);
  }
  const dt t = input_type(precision);
  // dinp (N,C) += dout (N,OC) @ weight (OC,C)
  run_gemm(GemmKey{Op::kBackwardData, t, N, OC, C, false, false, false, true}, g, w, nullptr, dinp);
  // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
  run_gemm(GemmKey{Op::kBackwardWeights, t, OC, N, C, true, false, false, true}, g, x, nullptr, dweight);
}

void weights_to_bf16(uint16_t* out, const float* in, size_t n) { round_bf16(in, out, n, /*widen=*/false); }

}  // namespace fast

// --- matmul_info.h --------------------------------------------------------------------------------------------

const char* matmul_cpu_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::all: return "all";
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic: return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
  }
  return "unknown";
}

namespace {

// libgomp's entry points, found where libdnnl loaded it: this library does not link OpenMP itself.
template <typename Fn>
Fn omp_entry(const char* name) {
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
  return reinterpret_cast<Fn>(::dlsym(RTLD_DEFAULT, name));
#else
  (void)name;
  return nullptr;
#endif
}

}  // namespace

int set_matmul_threads(int n) {
  const auto set = omp_entry<void (*)(int)>("omp_set_num_threads");
  if (set == nullptr || n <= 0) return 0;
  set(n);
  return matmul_threads();
}

int matmul_threads() {
  const auto get = omp_entry<int (*)()>("omp_get_max_threads");
  return get != nullptr ? get() : 0;
}

const char* matmul_cpu_runtime() {
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
  return "OpenMP";
#elif DNNL_CPU_RUNTIME == DNNL_RUNTIME_TBB
  return "TBB";
#elif DNNL_CPU_RUNTIME == DNNL_RUNTIME_THREADPOOL
  return "threadpool";
#else
  return "sequential";
#endif
}

std::string matmul_forward_impl(int N, int C, int OC, MatmulPrecision precision) {
  STRATA_ASSERT(N > 0 && C > 0 && OC > 0);
  const GemmKey k{Op::kForward, input_type(precision), N, C, OC, false, true, true, false};
  return GemmCache::instance().get(k)->impl;
}

bool matmul_bf16_native() { return bf16_native(); }

size_t matmul_primitives_created() { return GemmCache::instance().created(); }

}  // namespace strata::kernels::cpu
