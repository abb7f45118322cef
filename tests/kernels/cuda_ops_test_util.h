// cuda_ops_test_util.h — what the CUDA kernel tests share (cuda_ops_test.cpp, cuda_matmul_test.cpp): the
// tolerances against the float64 reference, seeded inputs, device buffers that start poisoned with NaN, the
// fixture that skips without a usable GPU, and hidden activations (kernels.h) moved to the device and back.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/kernels.h"

namespace strata::kernels::cuda_test {

// --- tolerances (against float64; see tests/kernels/matmul_test.cpp for the accumulation argument) ------------
// A K-term fp32 sum is within 3*K*eps of the exact one for these U(-1,1)-scale inputs; elementwise fp32 ops are
// within a few ulps (kRtol), and the GPU's tanhf/expf add at most a couple more.
inline double accum_atol(int K) { return 3.0 * K * static_cast<double>(FLT_EPSILON); }
constexpr double kRtol = 16 * static_cast<double>(FLT_EPSILON);
constexpr double kElemAtol = 1e-6;

inline std::vector<float> rand_vec(size_t n, Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.uniform(lo, hi));
  return v;
}
inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// A device copy of a host vector; download() waits for the compute stream first.
template <typename T>
class Dev {
 public:
  // Both constructors end with the device idle: the copy from pageable memory and the poisoning memset run on the
  // legacy stream, which the backend's non-blocking compute stream does not wait for.
  explicit Dev(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // n elements filled with NaN bytes (0xFF…): an element the op forgets to write stays NaN.
  static Dev poisoned(size_t n) { return Dev(n); }
  Dev(const Dev&) = delete;
  Dev(Dev&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr; }
  ~Dev() {
    if (ptr_) cudaFree(ptr_);
  }
  T* get() const { return ptr_; }
  std::vector<T> download() const {
    cuda_synchronize();
    std::vector<T> host(n_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  explicit Dev(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr_, 0xFF, bytes()), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  size_t bytes() const { return n_ * sizeof(T) + 4; }  // the allocation: never 0 bytes; copies move n_ elements
  T* ptr_ = nullptr;
  size_t n_;
};

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status s = cuda_available();
    if (!s.is_ok()) GTEST_SKIP() << "CUDA backend not testable here: " << s.message();
    RecordProperty("device", cuda_device_description());
  }
  const KernelSet& k = cuda_kernels();
};

// Hidden activations (N,F) move in the backend's form (kernels.h: bf16 under kBF16 at widths that are a multiple
// of 8, else fp32): these put them on the device and bring them back as floats.
inline bool hidden_is_bf16(const KernelSet& k, int N, int F, MatmulPrecision p) {
  return k.hidden_bytes(N, F, p) == size_t(N) * F * sizeof(uint16_t);
}
// `shift` floats in front of the data (get() + shift is the buffer): 1 leaves it 4-byte aligned only, which keeps
// cuBLASLt's GELU epilogues off it (their aux matrix must be 16-byte aligned) and so tests the fallbacks.
inline Dev<float> hidden_on_device(const KernelSet& k, const std::vector<float>& v, int N, int F,
                                   MatmulPrecision p, int shift = 0) {
  std::vector<float> raw(shift + (hidden_is_bf16(k, N, F, p) ? (v.size() * 2 + 3) / 4 : v.size()), 0.0f);
  if (!hidden_is_bf16(k, N, F, p)) {
    std::copy(v.begin(), v.end(), raw.begin() + shift);
  } else {
    auto* h = reinterpret_cast<uint16_t*>(raw.data() + shift);
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  }
  return Dev<float>(raw);
}
inline std::vector<float> hidden_to_host(const KernelSet& k, const Dev<float>& d, int N, int F,
                                         MatmulPrecision p, int shift = 0) {
  std::vector<float> raw = d.download();
  const size_t n = size_t(N) * F;
  if (!hidden_is_bf16(k, N, F, p)) return {raw.begin() + shift, raw.begin() + shift + n};
  std::vector<float> out(n);
  const auto* h = reinterpret_cast<const uint16_t*>(raw.data() + shift);
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
  return out;
}
inline Dev<float> hidden_poisoned(const KernelSet& k, int N, int F, MatmulPrecision p, int shift = 0) {
  return Dev<float>::poisoned(shift + (k.hidden_bytes(N, F, p) + 3) / 4);
}

// v as the backend holds it in the hidden form: rounded to bf16 where that is bf16.
inline std::vector<double> held(const std::vector<float>& v, bool bf16) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = bf16 ? bf16_to_f32(f32_to_bf16(v[i])) : v[i];
  return d;
}

// Sets a process-wide switch of the backend for a scope and puts back what it was.
template <typename Value>
class ScopedSwitch {
 public:
  ScopedSwitch(Value (*get)(), void (*set)(Value), Value value) : set_(set), saved_(get()) { set_(value); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;
  ~ScopedSwitch() { set_(saved_); }

 private:
  void (*set_)(Value);
  Value saved_;
};

}  // namespace strata::kernels::cuda_test
