// copy_engine.h — the copy engine: queues that each run their jobs in order on a thread of their own, so that
// moves between the tiers overlap compute and each other.
//
// A CopyEngine has three queues: "h2d" (host -> device uploads), "d2h" (device -> host downloads) and "nvme"
// (swap store reads and writes between NVMe and pinned buffers). A job is any function returning Status —
// typically one Device::upload/download or one SwapStore read — and may name prerequisite tickets on any
// queue: it starts only once they have finished, and if one failed it does not run and fails with that
// status (so a failed NVMe read never uploads garbage); a settled job (submit_settled) runs either way, told
// how its prerequisites went. What a job touches must stay alive until its ticket has finished; the job's
// function (and what it captured) is destroyed before that.
//
// Threading: submit() and every CopyTicket method are thread-safe. Each queue runs one job at a time on its
// own thread, in submission order. Destroying a queue waits for every job it has accepted.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace strata::offload {

// The outcome of one queued job. A default ticket has already finished, successfully.
class CopyTicket {
 public:
  CopyTicket() = default;
  Status wait() const;  // blocks until the job has run (or was refused); its status
  bool done() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class CopyQueue;
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
  };
  explicit CopyTicket(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

struct CopyQueueStats {
  uint64_t jobs = 0;
  uint64_t bytes = 0;   // what the submitters said the jobs move
  double busy_s = 0;    // time spent running jobs (waiting for prerequisites excluded)
};

class CopyQueue {
 public:
  explicit CopyQueue(std::string name);
  ~CopyQueue();
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  // Queues `job` behind everything submitted before it. `bytes` is only counted in stats().
  CopyTicket submit(std::function<Status()> job, uint64_t bytes = 0, std::vector<CopyTicket> after = {});
  // The same, but `job` runs whatever became of `after`, given the first failure among them (ok when every one
  // succeeded), and the ticket ends with what it returns: for a job that has waits to make even when it has
  // nothing to copy (a load into a buffer that earlier jobs and kernels may still be using).
  CopyTicket submit_settled(std::function<Status(const Status& prerequisites)> job, uint64_t bytes = 0,
                            std::vector<CopyTicket> after = {});
  CopyQueueStats stats() const;
  const std::string& name() const { return name_; }

 private:
  struct Job {
    std::function<Status(const Status& prerequisites)> fn;
    uint64_t bytes;
    std::vector<CopyTicket> after;
    std::shared_ptr<CopyTicket::State> state;
  };
  void run();

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  CopyQueueStats stats_;
  std::thread thread_;
};

// The three queues of the offload manager.
struct CopyEngine {
  CopyQueue h2d{"h2d"};
  CopyQueue d2h{"d2h"};
  CopyQueue nvme{"nvme"};
};

}  // namespace strata::offload
