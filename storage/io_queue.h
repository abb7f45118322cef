// io_queue.h — what callers use to read and write through an IoEngine: requests of any size, split into
// block_size pieces spread over the engine's lanes, completed together in an IoBatch.
//
// The correctness logic lives here, once, for every engine: a short transfer is resumed from where it stopped
// (never taken as success), EINTR/EAGAIN are retried, end of file and 0-byte writes are errors, and every
// -errno becomes a Status naming the operation, length, offset and file. Requests that O_DIRECT cannot take
// (offset, length or buffer not aligned) fail at once with InvalidArgument, before reaching the kernel.
//
// Scheduling: at most queue_depth pieces per lane are in flight; the rest wait in the queue, and each slot that
// frees goes to the next waiting piece, reads before writes (a read is usually what somebody waits for; a write
// usually only frees its buffer), each kind in submission order, but at most queue_depth x lanes reads ahead of
// a waiting write, so writes are never starved. With max_write_bytes_in_flight, writes beyond it wait even while
// slots are free, so a read that comes later has a slot and goes into the device behind no more than that.
// Nothing orders a read after a write of the same bytes that has not completed: wait for the write first.
//
// Threading: submit, read and write are thread-safe, and submit never blocks. A request's on_complete runs on
// an engine thread (on the submitting thread for a zero-length request, which moves no bytes) and must never
// wait for I/O (IoBatch::wait, read, write): with an engine that completes on the submitting thread, pieces it
// frees slots for are handed over only after it returns. The queue must outlive its requests; the destructor
// waits for them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "common/status.h"
#include "storage/io_engine.h"

namespace strata {

// Requests a caller waits for together. Reusable after wait() returns.
class IoBatch {
 public:
  IoBatch() = default;
  IoBatch(const IoBatch&) = delete;
  IoBatch& operator=(const IoBatch&) = delete;
  ~IoBatch();  // waits, so a batch never dies with requests pointing at it

  // Blocks until every request submitted with this batch has completed; returns the first error (with a count
  // of the others), or ok.
  Status wait();
  bool done() const;

 private:
  friend class IoQueue;
  void add(size_t n);
  void finish(const Status& status);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t pending_ = 0;
  size_t errors_ = 0;
  Status first_error_;
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  int file = -1;
  uint64_t offset = 0;
  void* buf = nullptr;
  size_t len = 0;
  // Runs once on an engine thread after every byte moved (never on failure); its Status becomes the request's.
  // The swap store verifies checksums here, so verification runs in parallel with the I/O still in flight.
  std::function<Status()> on_complete;
};

struct IoQueueOptions {
  size_t block_size = size_t{1} << 20;  // largest piece handed to the engine; a multiple of 4096
  int max_retries = 16;                 // EINTR/EAGAIN resubmissions of one piece before giving up
  // Bytes of writes in flight at most (0: no cap but the engine's slots; one write piece always may go). A read
  // waits in the device behind the writes in flight when it came, so a smaller cap keeps reads quick while
  // writes stream; the device needs a few in flight for its bandwidth.
  uint64_t max_write_bytes_in_flight = 0;
};

struct IoQueueStats {
  uint64_t requests = 0, pieces = 0, resumed_short = 0, retried = 0, failed = 0;
  double busy_s = 0;  // time with at least one piece in the engine: how long the disk had work
};

class IoQueue {
 public:
  IoQueue(IoEngine& engine, const IoQueueOptions& options = {});
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;
  ~IoQueue();

  // Queues `request`; its outcome arrives in `batch`.
  void submit(IoRequest request, IoBatch* batch);
  // Synchronous conveniences.
  Status read(int file, uint64_t offset, void* buf, size_t len);
  Status write(int file, uint64_t offset, const void* buf, size_t len);

  IoEngine& engine() const { return engine_; }
  size_t block_size() const { return options_.block_size; }
  IoQueueStats stats() const;

 private:
  struct Request;
  struct Piece;
  static void on_piece_done(RawIo* io, int64_t res);
  // Moves waiting pieces into free lane slots (reads first) and onto `run`. Caller holds mu_.
  void take_waiting(std::vector<RawIo*>* run);
  void hand_over(std::vector<RawIo*>& run);  // to the engine, without mu_
  void release_lane(uint32_t lane, IoOp op, uint32_t bytes);
  Status check_request(const IoRequest& r) const;
  void finish_piece(Piece* p, Status status);

  IoEngine& engine_;
  IoQueueOptions options_;
  uint32_t lanes_, depth_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> in_flight_;  // per lane
  uint64_t total_in_flight_ = 0;
  // Busy time: closed periods with pieces in the engine, and the start of the open one (when busy_).
  double busy_s_ = 0;
  bool busy_ = false;
  std::chrono::steady_clock::time_point busy_since_;
  uint64_t write_bytes_in_flight_ = 0;
  std::deque<Piece*> waiting_reads_, waiting_writes_;  // pieces no lane had a slot for yet
  uint64_t reads_past_writes_ = 0;  // reads taken since the oldest waiting write began to wait
  uint32_t next_lane_ = 0;
  std::atomic<uint64_t> requests_{0}, pieces_{0}, resumed_short_{0}, retried_{0}, failed_{0};
};

// "No space left on device (ENOSPC)".
std::string errno_text(int err);

}  // namespace strata
