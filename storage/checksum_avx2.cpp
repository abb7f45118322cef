// xxHash's AVX2 path, in a file of its own built with -mavx2 (storage/CMakeLists.txt): with XXH_INLINE_ALL
// every xxHash function here is static, so no AVX2 code can stand in for another file's copy. Called only
// where the CPU has AVX2 (checksum.cpp).
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include "storage/checksum.h"

namespace strata::detail {
uint64_t xxh3_64_avx2(const void* data, size_t len, uint64_t seed) { return XXH3_64bits_withSeed(data, len, seed); }
}  // namespace strata::detail
