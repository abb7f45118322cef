// status_test.cpp — Status, Result<T> and the early-return macros (common/status.h).
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "common/status.h"

namespace strata {
namespace {

TEST(Status, DefaultIsOk) {
  const Status s;
  EXPECT_TRUE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "OK");
  EXPECT_TRUE(Status::ok().is_ok());
}

TEST(Status, FactoriesSetCodeAndFormatMessage) {
  struct Want {
    Status s;
    StatusCode code;
    const char* name;
  };
  const Want cases[] = {
      {Status::invalid_argument("n_layer must be positive, got {}", -3), StatusCode::kInvalidArgument,
       "InvalidArgument"},
      {Status::not_found("no file {}", "a.bin"), StatusCode::kNotFound, "NotFound"},
      {Status::corruption("bad checksum at offset {}", 4096), StatusCode::kCorruption, "Corruption"},
      {Status::io_error("short read"), StatusCode::kIOError, "IOError"},
      {Status::out_of_memory("{} MiB for {}", 12, "activations"), StatusCode::kOutOfMemory, "OutOfMemory"},
      {Status::unimplemented("pipeline stages > {}", 1), StatusCode::kUnimplemented, "Unimplemented"},
      {Status::internal("oneDNN said {}", "no"), StatusCode::kInternal, "Internal"},
  };
  for (const Want& w : cases) {
    SCOPED_TRACE(w.name);
    EXPECT_FALSE(w.s.is_ok());
    EXPECT_EQ(w.s.code(), w.code);
    EXPECT_STREQ(status_code_name(w.code), w.name);
    EXPECT_EQ(w.s.to_string(), std::string(w.name) + ": " + w.s.message());
  }
  EXPECT_EQ(cases[0].s.message(), "n_layer must be positive, got -3");
  EXPECT_EQ(cases[2].s.message(), "bad checksum at offset 4096");
  EXPECT_EQ(cases[4].s.message(), "12 MiB for activations");
  // Braces in a message that is itself an argument are not interpreted.
  EXPECT_EQ(Status::invalid_argument("{}", "{not a field}").message(), "{not a field}");
}

TEST(Status, WithContextPrefixesErrorsOnly) {
  const Status e = Status::io_error("short read at offset 8").with_context("while loading ckpt/step_000100");
  EXPECT_EQ(e.code(), StatusCode::kIOError);
  EXPECT_EQ(e.message(), "while loading ckpt/step_000100: short read at offset 8");
  const Status ok = Status::ok().with_context("ignored");
  EXPECT_TRUE(ok.is_ok());
  EXPECT_EQ(ok.message(), "");
}

TEST(Result, HoldsValue) {
  Result<int> v = 7;
  ASSERT_TRUE(v.is_ok());
  EXPECT_TRUE(v.status().is_ok());
  EXPECT_EQ(v.value(), 7);
  EXPECT_EQ(*v, 7);
  *v = 8;
  EXPECT_EQ(v.value(), 8);
}

// (A separate test from HoldsValue: GCC 12 warns falsely, -Wmaybe-uninitialized, when a Result<int> holding a
// value and one holding a Status are destroyed in the same function body.)
TEST(Result, HoldsStatus) {
  const Result<int> e = Status::not_found("no key {}", "lr");
  ASSERT_FALSE(e.is_ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(e.status().message(), "no key lr");
}

TEST(Result, OkStatusWithoutValueIsAnError) {
  // A Result built from an OK Status has no value; it must not read as success (absl::StatusOr's rule).
  const Result<int> r = Status::ok();
  EXPECT_FALSE(r.is_ok());
  EXPECT_FALSE(r.status().is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Result, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(*r.value(), 5);
  std::unique_ptr<int> p = std::move(r).value();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(*p, 5);

  struct S {
    int x;
  };
  Result<S> s = S{3};
  EXPECT_EQ(s->x, 3);
}

// --- macros ---------------------------------------------------------------------------------------------------

Status check_positive(int x) {
  if (x <= 0) return Status::invalid_argument("x must be positive, got {}", x);
  return Status::ok();
}
Result<int> half_of_even(int x) {
  if (x % 2 != 0) return Status::invalid_argument("{} is odd", x);
  return x / 2;
}

int g_reached = 0;
Status two_checks(int a, int b) {
  g_reached = 0;
  STRATA_RETURN_IF_ERROR(check_positive(a));
  g_reached = 1;
  STRATA_RETURN_IF_ERROR(check_positive(b));
  g_reached = 2;
  return Status::ok();
}

TEST(Macros, ReturnIfErrorStopsAtFirstError) {
  EXPECT_TRUE(two_checks(1, 2).is_ok());
  EXPECT_EQ(g_reached, 2);
  const Status s = two_checks(1, -4);
  EXPECT_EQ(s.message(), "x must be positive, got -4");
  EXPECT_EQ(g_reached, 1);
  EXPECT_EQ(two_checks(0, -4).message(), "x must be positive, got 0");
  EXPECT_EQ(g_reached, 0);
}

Result<int> quarter_of(int x) {
  STRATA_RETURN_IF_ERROR(check_positive(x));  // in a function returning Result
  STRATA_ASSIGN_OR_RETURN(int h, half_of_even(x));
  STRATA_ASSIGN_OR_RETURN(const int q, half_of_even(h));  // twice in one scope: distinct temporaries
  return q;
}

TEST(Macros, AssignOrReturnUnwrapsOrPropagates) {
  Result<int> r = quarter_of(12);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(*r, 3);
  EXPECT_EQ(quarter_of(6).status().message(), "3 is odd");
  EXPECT_EQ(quarter_of(7).status().message(), "7 is odd");
  EXPECT_EQ(quarter_of(-8).status().code(), StatusCode::kInvalidArgument);
}

Status assign_into_status_function(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(*out, half_of_even(x));  // assigning to an existing lvalue
  return Status::ok();
}

TEST(Macros, AssignOrReturnInStatusFunction) {
  int out = -1;
  EXPECT_TRUE(assign_into_status_function(10, &out).is_ok());
  EXPECT_EQ(out, 5);
  out = -1;
  EXPECT_EQ(assign_into_status_function(5, &out).message(), "5 is odd");
  EXPECT_EQ(out, -1);
}

Result<std::unique_ptr<int>> make_box(int v) { return std::make_unique<int>(v); }
Result<int> unbox(int v) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<int> p, make_box(v));  // moves a move-only value out
  return *p;
}

TEST(Macros, AssignOrReturnMovesMoveOnlyValues) {
  Result<int> r = unbox(9);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(*r, 9);
}

}  // namespace
}  // namespace strata
