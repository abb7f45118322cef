// aligned.h — move-only, self-freeing aligned allocations that say what they are for.
//
// Every allocation carries a purpose string ("gpt2.params", "activations") and is counted in a process-wide
// ledger by purpose, so memory accounting can report who holds what (memory_report()). The ledger is
// thread-safe; a buffer itself is not (one owner at a time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/status.h"

namespace strata {

constexpr size_t kDefaultAlignment = 64;  // a cache line / one AVX-512 register

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Allocates `bytes` (rounded up to the alignment) zero-filled. Returns OutOfMemory naming the purpose.
  static Result<AlignedBuffer> allocate(size_t bytes, std::string purpose, size_t alignment = kDefaultAlignment);

  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept { swap(o); }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~AlignedBuffer() { reset(); }

  void reset();
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return bytes_; }
  const std::string& purpose() const { return purpose_; }

 private:
  void swap(AlignedBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(purpose_, o.purpose_);
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::string purpose_;
};

// Live bytes held by AlignedBuffers, by purpose, as "purpose: N MiB" lines; and the total.
std::string memory_report();
size_t memory_live_bytes();

}  // namespace strata
