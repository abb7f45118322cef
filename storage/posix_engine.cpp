#include "storage/posix_engine.h"

#include <unistd.h>

#include <cerrno>

#include "common/check.h"
#include "common/thread_name.h"

namespace strata {

PosixEngine::PosixEngine(uint32_t lanes, uint32_t queue_depth) : depth_(queue_depth) {
  STRATA_ASSERT(lanes > 0 && queue_depth > 0);
  for (uint32_t i = 0; i < lanes; ++i) {
    lanes_.push_back(std::make_unique<Lane>());
    Lane* lane = lanes_.back().get();
    lane->thread = std::thread([this, lane] {
      set_thread_name("posix io");
      run(*lane);
    });
  }
}

PosixEngine::~PosixEngine() { shutdown(); }

void PosixEngine::submit(RawIo* const* ios, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    Lane& lane = *lanes_[ios[i]->lane % lanes_.size()];
    std::unique_lock<std::mutex> lock(lane.mu);
    if (lane.stop) {
      lock.unlock();
      ios[i]->done(ios[i], -ECANCELED);
      continue;
    }
    lane.queue.push_back(ios[i]);
    lane.cv.notify_one();
  }
}

void PosixEngine::run(Lane& lane) {
  for (;;) {
    RawIo* io;
    {
      std::unique_lock<std::mutex> lock(lane.mu);
      lane.cv.wait(lock, [&] { return lane.stop || !lane.queue.empty(); });
      if (lane.queue.empty()) return;  // stopping, and nothing left
      io = lane.queue.front();
      lane.queue.pop_front();
      if (lane.stop) {
        lock.unlock();
        io->done(io, -ECANCELED);
        continue;
      }
    }
    const int f = fd(io->file);
    const ssize_t r = io->op == IoOp::kRead ? ::pread(f, io->buf, io->len, static_cast<off_t>(io->offset))
                                            : ::pwrite(f, io->buf, io->len, static_cast<off_t>(io->offset));
    io->done(io, r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r));
  }
}

void PosixEngine::shutdown() {
  std::lock_guard<std::mutex> guard(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->mu);
    lane->stop = true;
    lane->cv.notify_all();
  }
  for (auto& lane : lanes_) lane->thread.join();
}

}  // namespace strata
