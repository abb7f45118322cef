// test_util.h — shared helpers for the GoogleTest suites: seeded random fills and array comparisons that
// print the first mismatches with their indices, so a failure can be reproduced and read; Status checks
// (ASSERT_OK, ASSERT_OK_AND_ASSIGN, expect_error naming the code and the words the message must carry).
#pragma once

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/rng.h"
#include "common/status.h"

// ASSERT_OK(status_expr): fails the test, printing the expression and the Status, unless it is ok.
// ASSERT_OK_AND_ASSIGN(lhs, result_expr): the same for a Result<T>, then moves its value into `lhs`.
#define ASSERT_OK(expr)                                                  \
  do {                                                                   \
    const ::strata::Status _st = (expr);                                 \
    ASSERT_TRUE(_st.is_ok()) << #expr << " failed: " << _st.to_string(); \
  } while (0)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) ASSERT_OK_AND_ASSIGN_IMPL(STRATA_CONCAT(_res_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)                               \
  auto tmp = (expr);                                                            \
  ASSERT_TRUE(tmp.is_ok()) << #expr << " failed: " << tmp.status().to_string(); \
  lhs = std::move(tmp).value()

namespace strata::testing {

// Checks the status has `code` and its message contains every one of `parts`.
inline void expect_error(const Status& st, StatusCode code, std::initializer_list<std::string> parts) {
  EXPECT_EQ(st.code(), code) << st.to_string();
  for (const auto& p : parts)
    EXPECT_NE(st.message().find(p), std::string::npos) << "'" << p << "' not in: " << st.message();
}

// Fills with uniform values in [lo, hi) from a seeded Rng (never all zeros).
template <typename F>
void fill_uniform(F* x, size_t n, Rng& rng, double lo = -1.0, double hi = 1.0) {
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<F>(rng.uniform(lo, hi));
}
template <typename F>
std::vector<F> random_vector(size_t n, Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<F> v(n);
  fill_uniform(v.data(), n, rng, lo, hi);
  return v;
}
template <typename To, typename From>
std::vector<To> cast_vector(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// Checks |got - want| <= atol + rtol * |want| element-wise; reports the count and the first 8 mismatches
// (index, got, want) and the largest error. `what` names the array in the message.
template <typename A, typename B>
::testing::AssertionResult all_close(const A* got, const B* want, size_t n, double atol, double rtol,
                                     const std::string& what) {
  size_t bad = 0;
  std::string first;
  double max_err = 0.0;
  size_t max_at = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]);
    const double w = static_cast<double>(want[i]);
    const double err = std::fabs(g - w);
    const bool ok = std::isfinite(g) == std::isfinite(w) && (err <= atol + rtol * std::fabs(w) || g == w);
    if (std::isfinite(err) && err > max_err) {
      max_err = err;
      max_at = i;
    }
    if (!ok) {
      if (bad < 8) first += "\n    [" + std::to_string(i) + "] got " + std::to_string(g) + " want " + std::to_string(w);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << n << " elements differ (atol " << atol
                                       << ", rtol " << rtol << "); largest error " << max_err << " at [" << max_at
                                       << "]; first:" << first;
}
template <typename A, typename B>
::testing::AssertionResult all_close(const std::vector<A>& got, const std::vector<B>& want, double atol, double rtol,
                                     const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " != " << want.size();
  return all_close(got.data(), want.data(), got.size(), atol, rtol, what);
}

// Overwrites every byte of every file under `dir` (swap files whose reads must then fail their checksums).
inline void damage_files_under(const std::filesystem::path& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    const std::vector<char> junk(static_cast<size_t>(std::filesystem::file_size(e.path())), '\x5a');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
}

}  // namespace strata::testing
