// cpu_op_checks.h — the CPU op tests' checks, generic over a case (ops_test.cpp, llama_ops_test.cpp): a case
// holds one op's inputs, outputs and gradients at F = float or double; these run it on a backend and compare it
// with the float64 reference, with central finite differences, with itself across thread counts, and check that
// its backward adds into (or overwrites) the gradients it is given.
//
// A case: a constructor from the shape and seed; params() naming them; forward(Backend)/backward(Backend) (the
// backward adds into the zero-initialised gradients); loss(), the scalar whose gradient backward computes;
// arrays(), every output and gradient by name; fd_inputs(), the inputs with their gradients; kOverwrites.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "common/rng.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/reference.h"
#include "tests/kernels/cpu_ops_test_util.h"
#include "tests/test_util.h"

namespace strata::kernels::cpu_ops_test {

using ::strata::testing::all_close;

// Runs `op` at float through backend k's KernelSet, at double through the reference template.
#define STRATA_RUN_OP(k, op, ...)           \
  do {                                      \
    if constexpr (std::is_same_v<F, float>) \
      kernels(k).op(__VA_ARGS__);           \
    else                                    \
      cpu::ref::op(__VA_ARGS__);            \
  } while (0)

template <typename F>
struct Array {
  const char* name;
  std::vector<F>* v;
  bool is_grad;
};
template <typename F>
struct FdInput {
  const char* grad_name;
  std::vector<F>* x;
  std::vector<F>* grad;
};
// Scalar loss of the finite-difference checks: sum(out * w) over every output with a weight w.
template <typename F>
double weighted_sum(const std::vector<F>& out, const std::vector<F>& w) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * w[i];
  return s;
}

// ---- the checks, generic over a case ------------------------------------------------------------------------

struct Tol {
  double atol, rtol;
};
using Tols = std::map<std::string, Tol>;  // by array name; every array of a case must have one

// Runs forward then backward of Case<float> on `backend` and of Case<double> on the reference, and compares
// every output and gradient.
template <template <typename> class Case, typename... Shape>
void expect_close_to_double(Backend backend, const Tols& tols, Shape... shape) {
  Case<double> want(shape...);
  want.forward(Backend::kRef);
  want.backward(Backend::kRef);
  Case<float> got(shape...);
  got.forward(backend);
  got.backward(backend);
  auto g = got.arrays();
  auto w = want.arrays();
  for (size_t i = 0; i < g.size(); ++i) {
    const auto tol = tols.find(g[i].name);
    ASSERT_NE(tol, tols.end()) << "no tolerance stated for " << g[i].name;
    EXPECT_TRUE(all_close(*g[i].v, *w[i].v, tol->second.atol, tol->second.rtol, g[i].name))
        << got.params() << ", " << backend_name(backend) << " vs float64 reference";
  }
}

// Central differences in float64 of the case's loss against its float64 reference gradients. The step is
// relative, h = 1e-5 max(1, |x|): truncation error ~h² |f'''| ~ 1e-10 and rounding ~1e-16 |loss| / h ~ 1e-10 for
// these O(1)-O(10) losses; the largest difference seen is 1.0e-9. We allow 1e-8 + 1e-7 |g|, while a wrong
// formula term is off by 1e-3 or more.
constexpr double kFdStep = 1e-5;
constexpr Tol kFdTol{1e-8, 1e-7};

template <template <typename> class Case, typename... Shape>
void expect_gradients_match_finite_differences(Shape... shape) {
  Case<double> c(shape...);
  c.forward(Backend::kRef);
  c.backward(Backend::kRef);
  for (auto& in : c.fd_inputs()) {
    std::vector<double> fd(in.x->size());
    for (size_t i = 0; i < fd.size(); ++i) {
      const double x0 = (*in.x)[i];
      const double h = kFdStep * std::max(1.0, std::fabs(x0));
      (*in.x)[i] = x0 + h;
      c.forward(Backend::kRef);
      const double up = c.loss();
      (*in.x)[i] = x0 - h;
      c.forward(Backend::kRef);
      const double down = c.loss();
      (*in.x)[i] = x0;
      fd[i] = (up - down) / (2 * h);
    }
    EXPECT_TRUE(all_close(*in.grad, fd, kFdTol.atol, kFdTol.rtol, in.grad_name))
        << c.params() << ", float64 reference vs central differences, h = " << kFdStep << " max(1,|x|)";
  }
}

// Fast forward + backward on one thread, then on every core, then on every core again: bitwise equal.
template <template <typename> class Case, typename... Shape>
void expect_fast_deterministic(Shape... shape) {
  Case<float> one(shape...), all(shape...), again(shape...);
  tbb::task_arena single(1);
  single.execute([&] {
    one.forward(Backend::kFast);
    one.backward(Backend::kFast);
  });
  for (Case<float>* c : {&all, &again}) {
    c->forward(Backend::kFast);
    c->backward(Backend::kFast);
  }
  auto a = one.arrays(), b = all.arrays(), c = again.arrays();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(*a[i].v, *b[i].v, a[i].name)) << one.params() << ", 1 thread vs all threads";
    EXPECT_TRUE(bitwise_equal(*b[i].v, *c[i].v, b[i].name)) << one.params() << ", run 1 vs run 2";
  }
}

// Backward on gradients prefilled with random values must give prefill + the gradient from zero, up to the
// rounding of one more addition per accumulation step (allowed 4e-6 on results of a few units, seen 1.4e-6;
// "=" instead of "+=" misses by the prefill, ~0.5). Cross-entropy overwrites: a NaN prefill must leave no trace.
template <template <typename> class Case, typename... Shape>
void expect_backward_accumulates(Backend backend, Shape... shape) {
  Case<float> fresh(shape...), pre(shape...);
  fresh.forward(backend);
  fresh.backward(backend);
  pre.forward(backend);
  Rng rng(4242);
  std::vector<std::vector<float>> prefill;
  for (auto& a : pre.arrays()) {
    if (!a.is_grad) continue;
    if (Case<float>::kOverwrites)
      std::fill(a.v->begin(), a.v->end(), NAN);
    else
      *a.v = rand_vec<float>(a.v->size(), rng);
    prefill.push_back(*a.v);
  }
  pre.backward(backend);
  auto f = fresh.arrays(), p = pre.arrays();
  for (size_t i = 0, k = 0; i < p.size(); ++i) {
    if (!p[i].is_grad) continue;
    const std::string what = fmt::format("{} via the {} KernelSet", p[i].name, backend_name(backend));
    if (Case<float>::kOverwrites) {
      EXPECT_TRUE(bitwise_equal(*p[i].v, *f[i].v, what)) << pre.params() << ", NaN-prefilled vs zeroed";
    } else {
      std::vector<double> want(p[i].v->size());
      for (size_t j = 0; j < want.size(); ++j) want[j] = double(prefill[k][j]) + (*f[i].v)[j];
      EXPECT_TRUE(all_close(*p[i].v, want, 4e-6, 4e-6, what)) << pre.params() << ", prefilled vs prefill + fresh";
    }
    ++k;
  }
}

}  // namespace strata::kernels::cpu_ops_test
