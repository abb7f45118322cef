// pinned_pool.h — the host tier's pinned (page-locked) buffers, allocated at exact sizes against a hard budget.
//
// Owns: every page it maps. A buffer is its own mmap of the request rounded up to the page size (no power-of-two
// size classes), mlock'ed when PinnedPoolOptions::lock, and counted against the budget by its mapped bytes. The
// budget is given in bytes or derived from MemAvailable, the cgroup's headroom and RLIMIT_MEMLOCK (see
// auto_budget()). Does not own: what is stored in the buffers, or the CUDA registration of them — a later layer
// attaches that through set_hooks().
//
// Threading: every PinnedPool method is thread-safe. acquire() blocks until the bytes fit, serving waiters first
// come, first served, so a large request is not starved by a stream of small ones; try_acquire() and a request
// larger than the whole budget fail at once. mmap/mlock/munmap run on the calling thread outside the pool's lock.
// A PinnedBuffer has one owner at a time; releasing it (on any thread) returns its bytes and wakes waiters. The
// pool must outlive its buffers: destroying a pool with live buffers is a bug and aborts naming their purposes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"

namespace strata::offload {

struct PinnedPoolOptions {
  size_t budget_bytes = 0;  // 0: automatic (auto_budget()); more than the machine's memory is refused
  bool lock = true;         // mlock the pages, so they stay resident and can be DMA'd from
  // Where budget_bytes came from, as errors name it: the config key ("memory.host_memory_limit").
  std::string budget_name = "PinnedPoolOptions.budget_bytes";
};

class PinnedPool;

// A move-only handle to one pinned buffer; destroying or resetting it returns the pages to the pool.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept { swap(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~PinnedBuffer() { reset(); }

  void reset();
  void* data() const { return data_; }  // page-aligned
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }                // the bytes asked for
  size_t mapped_bytes() const { return mapped_; }      // size() rounded up to pages: what the budget counts
  const std::string& purpose() const { return purpose_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class PinnedPool;
  PinnedBuffer(PinnedPool* pool, void* data, size_t size, size_t mapped, std::string purpose)
      : pool_(pool), data_(data), size_(size), mapped_(mapped), purpose_(std::move(purpose)) {}
  void swap(PinnedBuffer& o) noexcept {
    std::swap(pool_, o.pool_);
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(mapped_, o.mapped_);
    std::swap(purpose_, o.purpose_);
  }
  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  std::string purpose_;
};

// (pointer, mapped bytes, purpose) of one buffer; see set_hooks().
using PinnedHook = std::function<void(void* data, size_t mapped_bytes, const std::string& purpose)>;

class PinnedPool {
 public:
  // Fails (OutOfMemory) when the automatic budget comes out below one page.
  static Result<std::unique_ptr<PinnedPool>> create(const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // All three: InvalidArgument for 0 bytes; OutOfMemory at once when the request alone exceeds the budget (the
  // message names the purpose, the bytes, the budget and its source), or when mmap/mlock fail (naming
  // RLIMIT_MEMLOCK and how to raise it). Blocks until the bytes fit and earlier waiters are served.
  Result<PinnedBuffer> acquire(size_t bytes, std::string purpose);
  // As acquire(), but OutOfMemory once `timeout` has passed without the bytes fitting.
  Result<PinnedBuffer> acquire_for(size_t bytes, std::string purpose, std::chrono::milliseconds timeout);
  // Never blocks: OutOfMemory when the bytes do not fit now or other callers are already waiting.
  Result<PinnedBuffer> try_acquire(size_t bytes, std::string purpose);

  size_t budget_bytes() const { return budget_; }
  const std::string& budget_source() const { return budget_source_; }  // how budget_bytes() was chosen
  bool locks() const { return lock_; }
  size_t used_bytes() const;  // mapped bytes of live buffers and of acquires being mapped
  size_t peak_bytes() const;
  size_t waiting() const;  // acquires blocked right now
  // "pinned pool: 12288 bytes (0.0 MiB) used of ...", then one line per purpose with its live bytes.
  std::string report() const;

  // Calls fn(data, mapped_bytes, purpose) for each live buffer, on this thread, outside the pool's lock.
  void for_each_live(const std::function<void(void*, size_t, const std::string&)>& fn) const;

  // Registration hook for memory that must be known to someone else (cudaHostRegister/Unregister). on_map is
  // called for every buffer after it is mapped and before acquire returns it; on_unmap before its pages are
  // unmapped. Both run on the thread that acquires / releases, outside the budget lock but serialised by a hook
  // lock (never two calls at once), so a hook may read the pool (used_bytes, report) but must not acquire or
  // release its buffers. set_hooks() may be called at any time: it calls the old on_unmap and then the new on_map
  // for every live buffer, so each pointer given to on_map reaches that same hook set's on_unmap exactly once.
  // Pass empty functions to remove the hooks.
  void set_hooks(PinnedHook on_map, PinnedHook on_unmap);

  // The automatic budget and the line explaining it, as create() would choose it now.
  struct AutoBudget {
    size_t bytes = 0;
    std::string source;
  };
  static AutoBudget auto_budget(bool lock);

 private:
  friend class PinnedBuffer;
  struct Live {
    size_t mapped;
    std::string purpose;
  };
  enum class Wait { kNo, kUntil, kForever };
  PinnedPool(size_t budget, std::string source, bool lock);
  Result<PinnedBuffer> acquire_impl(size_t bytes, std::string purpose, Wait wait,
                                    std::chrono::milliseconds timeout);
  Result<void*> map_pages(size_t mapped, const std::string& purpose) const;
  void release(void* data, size_t mapped);
  void unreserve(size_t mapped);

  const size_t budget_;
  const std::string budget_source_;
  const bool lock_;
  const size_t page_;

  mutable std::mutex mu_;  // guards the budget, the waiters and live_
  std::condition_variable cv_;
  size_t used_ = 0;
  size_t peak_ = 0;
  uint64_t next_ticket_ = 0;
  std::list<uint64_t> waiters_;  // tickets of blocked acquires, oldest first
  std::map<void*, Live> live_;

  std::mutex hook_mu_;  // held around hook calls and live_ changes, so set_hooks sees a consistent set
  PinnedHook on_map_, on_unmap_;
};

// --- the automatic budget, split into pure parsers so tests can feed fake /proc and cgroup text ---------------

// MemAvailable from /proc/meminfo, in bytes; nullopt when absent.
std::optional<uint64_t> parse_meminfo_available(std::string_view meminfo);
// A cgroup memory file ("max", "1073741824", v1's 9223372036854771712): bytes, or nullopt for no limit.
std::optional<uint64_t> parse_cgroup_bytes(std::string_view text);
// The memory cgroup path of this process from /proc/self/cgroup text: the "0::" line for v2, the line listing
// the "memory" controller for v1. nullopt when there is none.
std::optional<std::string> parse_cgroup_path(std::string_view proc_self_cgroup, bool v2);
// Whether CapEff in /proc/self/status text holds CAP_IPC_LOCK (bit 14).
bool parse_cap_ipc_lock(std::string_view proc_status);

// The smallest limit − usage over the process's cgroup and its ancestors under `root` (normally
// /sys/fs/cgroup): cgroup v2's memory.max/memory.current, else v1's memory/memory.limit_in_bytes and
// memory.usage_in_bytes. nullopt when no level has a limit. `where` gets a description of the binding level.
std::optional<uint64_t> read_cgroup_headroom(const std::string& root, std::string_view proc_self_cgroup,
                                             std::string* where);

struct BudgetInputs {
  std::optional<uint64_t> mem_available;    // nullopt: unknown
  std::optional<uint64_t> cgroup_headroom;  // nullopt: no cgroup limit
  std::string cgroup_where;
  bool lock = true;
  bool cap_ipc_lock = false;
  std::optional<uint64_t> memlock_limit;  // RLIMIT_MEMLOCK soft limit; nullopt: unlimited
  size_t page_size = 4096;
};
// 80% of min(MemAvailable, cgroup headroom), capped by RLIMIT_MEMLOCK when locking without CAP_IPC_LOCK,
// rounded down to pages.
PinnedPool::AutoBudget compute_auto_budget(const BudgetInputs& in);
// min(MemAvailable, cgroup headroom) and which of them it is ("MemAvailable 22.9 GiB"); bytes 0 when neither is
// known.
PinnedPool::AutoBudget memory_headroom(const BudgetInputs& in);
// This process's inputs now (/proc/meminfo, its cgroup, its capabilities and RLIMIT_MEMLOCK).
BudgetInputs read_budget_inputs(bool lock);

}  // namespace strata::offload
