#include "storage/checksum.h"

#include "common/check.h"

// The whole of xxHash inlined here, built for this file's flags (baseline x86-64: SSE2).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace strata {

namespace detail {
uint64_t xxh3_64_sse2(const void* data, size_t len, uint64_t seed) { return XXH3_64bits_withSeed(data, len, seed); }
}  // namespace detail

namespace {
using Xxh3Fn = uint64_t (*)(const void*, size_t, uint64_t);
bool use_avx2() {
#if defined(STRATA_XXH3_AVX2)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}
Xxh3Fn pick() {
#if defined(STRATA_XXH3_AVX2)
  if (use_avx2()) return detail::xxh3_64_avx2;
#endif
  return detail::xxh3_64_sse2;
}
}  // namespace

uint64_t xxh3_64(const void* data, size_t len, uint64_t seed) {
  static const Xxh3Fn fn = pick();
  return fn(data, len, seed);
}

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  STRATA_ASSERT(state_ != nullptr);
  reset();
}
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::update(const void* data, size_t len) {
  if (len > 0) XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, len);
}
uint64_t Xxh3Stream::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

const char* xxh3_path() { return use_avx2() ? "avx2" : "sse2"; }

}  // namespace strata
