// trace.h — a timeline of where a run's time goes, across its threads, written as Chrome trace JSON (open it in
// ui.perfetto.dev or chrome://tracing): the training thread's phases and waits, the optimizer worker's reads,
// updates and writes, the swap store's transfers. `strata train --trace FILE` and `strata bench step --trace FILE`
// record one.
//
// Off unless start() was called: then a span costs one relaxed atomic load. On, an event is two clock reads and
// one slot of a buffer allocated by start() (40 bytes each; events past its capacity are counted and dropped,
// never reallocated). Names must be string literals (the pointer is kept, not the text).
//
// Threading: recording is thread-safe. start() must not run while another thread may record (call it before
// the threads it should see start working), nor at the same time as write().
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace strata::trace {

namespace detail {
extern std::atomic<bool> g_on;
uint64_t now_ns();
void record(char phase, const char* name, uint64_t begin_ns, uint64_t end_ns, int64_t arg);
}  // namespace detail

inline bool on() { return detail::g_on.load(std::memory_order_relaxed); }

// Begins recording into a buffer of `capacity` events (any earlier recording is dropped).
void start(size_t capacity = size_t{1} << 20);
// Stops recording and writes what was recorded to `path`; an error names the file.
Status write(const std::string& path);
// Events recorded and dropped (the buffer was full) since start().
size_t recorded();
size_t dropped();

// Names the calling thread in the trace, while recording (a no-op when off). A thread given the name of an
// earlier one continues that one's row: the optimizer's worker, started anew each step, is one row.
void name_thread(const char* name);

// A span on the calling thread, from construction to destruction; `arg` (a sub-group, a unit; -1: none) is
// shown with it.
class Span {
 public:
  explicit Span(const char* name, int64_t arg = -1) : name_(name), arg_(arg), begin_(on() ? detail::now_ns() : 0) {}
  ~Span() {
    if (begin_ != 0 && on()) detail::record('X', name_, begin_, detail::now_ns(), arg_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  int64_t arg_;
  uint64_t begin_;
};

// The clock spans use (0 while off), for an interval that begins on one thread and ends on another.
inline uint64_t begin() { return on() ? detail::now_ns() : 0; }
// Records [begin_ns, now) as an asynchronous interval of its own row in the trace (transfers that overlap each
// other); a no-op when begin_ns is 0 (taken while off).
inline void end_async(const char* name, uint64_t begin_ns, int64_t arg = -1) {
  if (begin_ns != 0 && on()) detail::record('b', name, begin_ns, detail::now_ns(), arg);
}
// A moment on the calling thread.
inline void instant(const char* name, int64_t arg = -1) {
  if (on()) {
    const uint64_t t = detail::now_ns();
    detail::record('i', name, t, t, arg);
  }
}

}  // namespace strata::trace
