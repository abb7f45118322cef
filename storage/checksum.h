// checksum.h — XXH3-64, the checksum of every swap store chunk (docs/formats/swap.md), at the speed of the
// machine's vectors.
//
// Debian's libxxhash is built for baseline x86-64 (SSE2): about 16 GB/s on one core of the CI machine, and the
// offloaded step hashes every NVMe byte it moves, on the cores that also run the kernels. The AVX2 variant of
// the same function runs at 33-40 GB/s there (its AVX-512 variant at 26-31, so it is not used). The value is
// XXH3's whatever the path: files written by either read back with the other, and with libxxhash.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// XXH3_64bits_withSeed(data, len, seed), on the fastest path this CPU has.
uint64_t xxh3_64(const void* data, size_t len, uint64_t seed = 0);
// The path xxh3_64 takes here: "avx2", or "sse2" (the portable one elsewhere than x86-64).
const char* xxh3_path();

// XXH3-64 over bytes that come in pieces: the same value as xxh3_64 of their concatenation (seed 0). On
// xxHash's portable path: for data produced piecewise (a file being written), not for the hot paths. Not
// thread-safe; movable, not copyable.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(Xxh3Stream&& o) noexcept : state_(o.state_) { o.state_ = nullptr; }
  Xxh3Stream& operator=(Xxh3Stream&&) = delete;
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;

  void update(const void* data, size_t len);
  uint64_t digest() const;  // of everything so far; update may go on
  void reset();

 private:
  void* state_;  // XXH3_state_t, 64-byte aligned, from XXH3_createState
};

namespace detail {
uint64_t xxh3_64_sse2(const void* data, size_t len, uint64_t seed);
uint64_t xxh3_64_avx2(const void* data, size_t len, uint64_t seed);  // x86-64 builds, CPUs with AVX2
}  // namespace detail

}  // namespace strata
