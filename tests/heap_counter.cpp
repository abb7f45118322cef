// heap_counter.cpp — operator new and delete that count the heap (tests/heap_counter.h). Link it into one test
// binary only where it is wanted: it replaces the process's operators.
#include "tests/heap_counter.h"

#include <malloc.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace {

// The bytes operator new has handed out and not taken back, and their peak since reset_heap_peak().
std::atomic<int64_t> g_live{0}, g_peak{0};

void count(void* p, int64_t sign) {
  if (p == nullptr) return;
  const int64_t now = g_live.fetch_add(sign * static_cast<int64_t>(malloc_usable_size(p))) +
                      sign * static_cast<int64_t>(malloc_usable_size(p));
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void* allocate(size_t n, size_t align = 0) {
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align)
                                              : std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  count(p, 1);
  return p;
}

void release(void* p) {
  count(p, -1);
  std::free(p);
}

}  // namespace

void* operator new(size_t n) { return allocate(n); }
void* operator new[](size_t n) { return allocate(n); }
void* operator new(size_t n, std::align_val_t a) { return allocate(n, static_cast<size_t>(a)); }
void* operator new[](size_t n, std::align_val_t a) { return allocate(n, static_cast<size_t>(a)); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, size_t) noexcept { release(p); }
void operator delete[](void* p, size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }

namespace strata::test {

int64_t heap_live_bytes() { return g_live.load(); }
void reset_heap_peak() { g_peak.store(g_live.load()); }
int64_t heap_peak_bytes() { return g_peak.load(); }

}  // namespace strata::test
