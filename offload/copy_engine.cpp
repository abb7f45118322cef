#include "offload/copy_engine.h"

#include "common/thread_name.h"
#include "common/timer.h"

namespace strata::offload {

Status CopyTicket::wait() const {
  if (!state_) return Status::ok();
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool CopyTicket::done() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

CopyQueue::CopyQueue(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}

CopyQueue::~CopyQueue() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

CopyTicket CopyQueue::submit(std::function<Status()> job, uint64_t bytes, std::vector<CopyTicket> after) {
  // A failed prerequisite is the job's outcome, and the job does not run.
  return submit_settled(
      [job = std::move(job)](const Status& prerequisites) { return prerequisites.is_ok() ? job() : prerequisites; },
      bytes, std::move(after));
}

CopyTicket CopyQueue::submit_settled(std::function<Status(const Status&)> job, uint64_t bytes,
                                     std::vector<CopyTicket> after) {
  auto state = std::make_shared<CopyTicket::State>();
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(Job{std::move(job), bytes, std::move(after), state});
  }
  cv_.notify_one();
  return CopyTicket(std::move(state));
}

CopyQueueStats CopyQueue::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void CopyQueue::run() {
  set_thread_name("cq " + name_);
  for (;;) {
    Job job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and everything accepted has run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Status status;
    for (const CopyTicket& t : job.after) {
      if (Status s = t.wait(); !s.is_ok() && status.is_ok()) status = s;
    }
    Timer timer;
    status = job.fn(status);
    const double busy = timer.seconds();
    // What the job captured is destroyed before its ticket finishes, so a waiter may free what the captures'
    // destructors touch.
    job.fn = nullptr;
    job.after.clear();
    {
      std::lock_guard lock(mu_);
      ++stats_.jobs;
      stats_.bytes += job.bytes;
      stats_.busy_s += busy;
    }
    {
      std::lock_guard lock(job.state->mu);
      job.state->done = true;
      job.state->status = std::move(status);
    }
    job.state->cv.notify_all();
  }
}

}  // namespace strata::offload
