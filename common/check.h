// check.h — STRATA_ASSERT for broken invariants, and the one macro family that checks foreign calls.
//
// STRATA_ASSERT aborts with the condition, function and file:line: it is for bugs, never for user input (use
// Status for that). The foreign-call checks (POSIX_CHECK, MPI_CHECK, URING_CHECK, and CUDA_CHECK & co. in the
// CUDA backend) are one-line uses of STRATA_CHECK_CALL, which prints the call as text with file:line and aborts.
#pragma once

#include <cerrno>
#include <cstring>

namespace strata::detail {
[[noreturn]] void assert_fail(const char* cond, const char* func, const char* file, int line, const char* msg);
[[noreturn]] void call_fail(const char* what, const char* call, const char* err, const char* func,
                            const char* file, int line);
}  // namespace strata::detail

#define STRATA_ASSERT(cond)                                                                   \
  do {                                                                                        \
    if (!(cond)) ::strata::detail::assert_fail(#cond, __func__, __FILE__, __LINE__, nullptr); \
  } while (0)
#define STRATA_ASSERT_MSG(cond, msg)                                                      \
  do {                                                                                    \
    if (!(cond)) ::strata::detail::assert_fail(#cond, __func__, __FILE__, __LINE__, msg); \
  } while (0)

// Generic foreign-call check: `ok_expr` decides success given the call's result `_r`; `err_expr` turns `_r`
// into a C string for the message.
#define STRATA_CHECK_CALL(what, call, ok_expr, err_expr)                                     \
  do {                                                                                       \
    auto _r = (call);                                                                        \
    if (!(ok_expr)) ::strata::detail::call_fail(what, #call, err_expr, __func__, __FILE__, __LINE__); \
  } while (0)

// liburing returns -errno.
#define URING_CHECK(call) STRATA_CHECK_CALL("liburing", call, _r >= 0, std::strerror(-static_cast<int>(_r)))
// POSIX calls returning -1 and setting errno.
#define POSIX_CHECK(call) STRATA_CHECK_CALL("posix", call, _r != -1, std::strerror(errno))
// MPI returns MPI_SUCCESS (0).
#define MPI_CHECK(call) STRATA_CHECK_CALL("MPI", call, _r == 0, "MPI error")
