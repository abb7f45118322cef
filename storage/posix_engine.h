// posix_engine.h — the fallback engine: `lanes` worker threads, each running one pread/pwrite at a time from
// its own queue. Chosen by make_io_engine where io_uring is missing or refused.
//
// Each transfer is one system call; a short result goes back to IoQueue as is, which resumes it. Queue depth
// is accepted for flow control but concurrency is the thread count. Thread-safe per io_engine.h.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "storage/file_table.h"

namespace strata {

class PosixEngine final : public FileTable {
 public:
  PosixEngine(uint32_t lanes, uint32_t queue_depth);
  ~PosixEngine() override;

  std::string name() const override { return "posix"; }
  uint32_t lanes() const override { return static_cast<uint32_t>(lanes_.size()); }
  uint32_t queue_depth() const override { return depth_; }
  void submit(RawIo* const* ios, size_t n) override;
  void shutdown() override;

 private:
  struct Lane {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<RawIo*> queue;
    bool stop = false;
    std::thread thread;
  };
  void run(Lane& lane);

  uint32_t depth_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace strata
