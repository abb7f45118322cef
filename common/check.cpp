#include "common/check.h"

#include <cstdio>
#include <cstdlib>

namespace strata::detail {

void assert_fail(const char* cond, const char* func, const char* file, int line, const char* msg) {
  std::fprintf(stderr, "strata: assertion failed: %s%s%s in %s at %s:%d\n", cond, msg ? " — " : "", msg ? msg : "",
               func, file, line);
  std::fflush(stderr);
  std::abort();
}

void call_fail(const char* what, const char* call, const char* err, const char* func, const char* file,
               int line) {
  std::fprintf(stderr, "strata: %s call failed: %s: %s in %s at %s:%d\n", what, call, err, func, file, line);
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata::detail
