// heap_counter.h — the process's heap, counted: a test binary that links tests/heap_counter.cpp replaces
// operator new and delete with versions that count the bytes handed out (malloc_usable_size) and their peak,
// so a test can bound what a call holds at most. Counts every thread's allocations; not what malloc is called
// for directly (the pinned pool's mmap'ed buffers are the host tier's, accounted by the pool).
#pragma once

#include <cstdint>
#include <utility>

namespace strata::test {

int64_t heap_live_bytes();
// Makes the peak the live bytes now.
void reset_heap_peak();
int64_t heap_peak_bytes();

// The heap growth (peak over the live bytes at the start) while `fn` runs.
template <typename Fn>
int64_t heap_growth(Fn&& fn) {
  reset_heap_peak();
  const int64_t start = heap_live_bytes();
  std::forward<Fn>(fn)();
  return heap_peak_bytes() - start;
}

}  // namespace strata::test
