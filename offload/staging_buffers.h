// staging_buffers.h — a fixed set of pinned buffers that copy jobs borrow one at a time on their way between
// NVMe and the device (the coordinator's offload_param.buffer_count).
//
// The set is filled once (add) with buffers taken from the pinned pool when the offload stack is built, so a
// host budget too small for them fails there; afterwards take() only waits for another job to give one back,
// never for the pool. Threading: take/give are thread-safe; add() before any take().
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "offload/pinned_pool.h"

namespace strata::offload {

class StagingBuffers {
 public:
  void add(PinnedBuffer b) {
    all_.push_back(std::make_unique<PinnedBuffer>(std::move(b)));
    free_.push_back(all_.back().get());
  }
  // Blocks while every buffer is out.
  PinnedBuffer* take() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    PinnedBuffer* b = free_.back();
    free_.pop_back();
    return b;
  }
  void give(PinnedBuffer* b) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(b);
    }
    cv_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<PinnedBuffer>> all_;
  std::vector<PinnedBuffer*> free_;
};

// One borrowed buffer, shared by the jobs of a chain (read then upload, download then write) and given back
// when the last of them lets go, whether they ran or failed.
struct StagingLease {
  explicit StagingLease(StagingBuffers* set) : from(set) {}
  ~StagingLease() {
    if (buf) from->give(buf);
  }
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;
  void take() { buf = from->take(); }

  StagingBuffers* from;
  PinnedBuffer* buf = nullptr;
};

}  // namespace strata::offload
