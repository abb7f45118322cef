#include "storage/io_queue.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "common/check.h"

namespace strata {

std::string errno_text(int err) {
  const char* name = strerrorname_np(err);
  return fmt::format("{} ({})", std::strerror(err), name ? name : fmt::format("errno {}", err));
}

// ---- IoBatch ---------------------------------------------------------------------------------------------------

IoBatch::~IoBatch() { (void)wait(); }

void IoBatch::add(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ += n;
}

void IoBatch::finish(const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!status.is_ok() && errors_++ == 0) first_error_ = status;
  STRATA_ASSERT(pending_ > 0);
  // Notify under the lock: the waiter may destroy the batch the moment it sees pending_ == 0.
  if (--pending_ == 0) cv_.notify_all();
}

Status IoBatch::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  Status result = errors_ <= 1 ? first_error_
                               : Status(first_error_.code(), fmt::format("{} (and {} more failed requests)",
                                                                         first_error_.message(), errors_ - 1));
  errors_ = 0;
  first_error_ = Status::ok();
  return result;
}

bool IoBatch::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_ == 0;
}

// ---- IoQueue ---------------------------------------------------------------------------------------------------

struct IoQueue::Request {
  IoQueue* queue;
  IoRequest req;
  IoBatch* batch;
  std::atomic<size_t> remaining;
  std::mutex mu;  // guards error
  Status error;
  std::vector<Piece> pieces;
};

struct IoQueue::Piece : RawIo {
  Request* parent = nullptr;
  uint64_t start = 0;   // the piece's first byte in the file
  char* base = nullptr;  // and in memory
  uint32_t full = 0;     // its whole length
  uint32_t moved = 0;
  int retries = 0;
};

IoQueue::IoQueue(IoEngine& engine, const IoQueueOptions& options)
    : engine_(engine), options_(options), lanes_(engine.lanes()), depth_(engine.queue_depth()) {
  STRATA_ASSERT(lanes_ > 0 && depth_ > 0);
  STRATA_ASSERT_MSG(options_.block_size > 0 && options_.block_size % 4096 == 0 && options_.block_size <= (1u << 30),
                    "block_size must be a positive multiple of 4096, at most 1 GiB");
  in_flight_.assign(lanes_, 0);
}

IoQueue::~IoQueue() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return total_in_flight_ == 0 && waiting_reads_.empty() && waiting_writes_.empty(); });
}

IoQueueStats IoQueue::stats() const {
  IoQueueStats st{requests_.load(), pieces_.load(), resumed_short_.load(), retried_.load(), failed_.load()};
  std::lock_guard<std::mutex> lock(mu_);
  st.busy_s = busy_s_;
  if (busy_) st.busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
  return st;
}

void IoQueue::take_waiting(std::vector<RawIo*>* run) {
  while (total_in_flight_ < static_cast<uint64_t>(lanes_) * depth_) {
    // Reads first, but never more than a full queue's worth of them ahead of a waiting write: somebody may be
    // waiting for that write too (to reuse its buffer), and a stream of reads must not hold it back for ever.
    // Writes beyond max_write_bytes_in_flight wait even for a free slot: a read that comes later then finds at
    // most that many bytes of writes ahead of it in the device.
    const uint64_t cap = options_.max_write_bytes_in_flight;
    const bool write_may_go =
        !waiting_writes_.empty() &&
        (cap == 0 || write_bytes_in_flight_ == 0 || write_bytes_in_flight_ + waiting_writes_.front()->full <= cap);
    if (waiting_reads_.empty() && !write_may_go) break;
    const bool write =
        write_may_go && (waiting_reads_.empty() || reads_past_writes_ >= static_cast<uint64_t>(lanes_) * depth_);
    if (write) {
      reads_past_writes_ = 0;
      write_bytes_in_flight_ += waiting_writes_.front()->full;
    } else if (!waiting_writes_.empty()) {
      ++reads_past_writes_;
    }
    std::deque<Piece*>& from = write ? waiting_writes_ : waiting_reads_;
    Piece* p = from.front();
    from.pop_front();
    uint32_t lane = next_lane_;
    while (in_flight_[lane] >= depth_) lane = (lane + 1) % lanes_;
    next_lane_ = (lane + 1) % lanes_;
    ++in_flight_[lane];
    ++total_in_flight_;
    p->lane = lane;
    run->push_back(p);
  }
  if (total_in_flight_ > 0 && !busy_) {
    busy_ = true;
    busy_since_ = std::chrono::steady_clock::now();
  }
}

namespace {
// Runs handed on by completions that arrived while this thread was inside an engine submit (an engine that
// completes on the submitting thread: in-memory, or a resumed short transfer): the outermost hand-over submits
// them, so a long line of waiting pieces is a loop, not a recursion. Their pieces hold lane slots, so their
// queue outlives them; their engine outlives the queue.
struct Deferred {
  IoEngine* engine;
  std::vector<RawIo*> run;
};
thread_local int t_handing_over = 0;
thread_local std::vector<Deferred> t_deferred;

void submit_run(IoEngine& engine, std::vector<RawIo*>& run) {
  // One engine submit (one io_uring_submit per ring) for the whole run, each lane's pieces together.
  std::stable_sort(run.begin(), run.end(), [](RawIo* a, RawIo* b) { return a->lane < b->lane; });
  engine.submit(run.data(), run.size());
}
}  // namespace

void IoQueue::hand_over(std::vector<RawIo*>& run) {
  if (run.empty()) return;
  if (t_handing_over > 0) {
    t_deferred.push_back({&engine_, std::move(run)});
    return;
  }
  // The pieces may complete, and their requests and this queue be freed, as soon as they are handed over:
  // nothing of this queue is touched from here on.
  ++t_handing_over;
  submit_run(engine_, run);
  for (size_t i = 0; i < t_deferred.size(); ++i) {  // in the order they were handed on; the loop may add more
    Deferred d = std::move(t_deferred[i]);
    submit_run(*d.engine, d.run);
  }
  t_deferred.clear();
  --t_handing_over;
}

void IoQueue::release_lane(uint32_t lane, IoOp op, uint32_t bytes) {
  std::vector<RawIo*> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_[lane];
    --total_in_flight_;
    if (op == IoOp::kWrite) write_bytes_in_flight_ -= bytes;
    take_waiting(&run);  // the freed slot goes to the next waiting piece, reads first
    if (total_in_flight_ == 0 && busy_) {
      busy_ = false;
      busy_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
    }
    // With pieces handed on, total_in_flight_ > 0 keeps ~IoQueue waiting while they are submitted below.
    if (run.empty()) cv_.notify_all();
  }
  // Without a run, the notify above was the last touch of the queue (~IoQueue may be done with it already).
  if (!run.empty()) hand_over(run);
}

Status IoQueue::check_request(const IoRequest& r) const {
  if (r.buf == nullptr && r.len > 0)
    return Status::invalid_argument("{} of {} bytes at offset {} of {}: null buffer", io_op_name(r.op), r.len,
                                    r.offset, engine_.path(r.file));
  if (r.len == 0 || !engine_.direct(r.file)) return Status::ok();
  const size_t a = engine_.alignment(r.file);
  const auto addr = reinterpret_cast<uintptr_t>(r.buf);
  if (r.offset % a != 0 || r.len % a != 0 || addr % a != 0) {
    return Status::invalid_argument(
        "{} of {}: O_DIRECT needs offset, length and buffer address aligned to {} bytes, got offset {}, length {}, "
        "buffer {:#x} (the swap store pads for you; raw IoQueue callers must align)",
        io_op_name(r.op), engine_.path(r.file), a, r.offset, r.len, addr);
  }
  return Status::ok();
}

void IoQueue::submit(IoRequest request, IoBatch* batch) {
  STRATA_ASSERT(batch != nullptr);
  requests_.fetch_add(1, std::memory_order_relaxed);
  batch->add(1);
  if (Status st = check_request(request); !st.is_ok()) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    batch->finish(st);
    return;
  }
  if (request.len == 0) {
    batch->finish(request.on_complete ? request.on_complete() : Status::ok());
    return;
  }
  const size_t bs = options_.block_size;
  const size_t n = (request.len + bs - 1) / bs;
  auto* r = new Request{this, std::move(request), batch, {n}, {}, {}, std::vector<Piece>(n)};
  char* base = static_cast<char*>(r->req.buf);
  for (size_t i = 0; i < n; ++i) {
    Piece& p = r->pieces[i];
    p.parent = r;
    p.op = r->req.op;
    p.file = r->req.file;
    p.start = r->req.offset + i * bs;
    p.base = base + i * bs;
    p.full = static_cast<uint32_t>(std::min(bs, r->req.len - i * bs));
    p.offset = p.start;
    p.buf = p.base;
    p.len = p.full;
    p.done = &IoQueue::on_piece_done;
  }
  pieces_.fetch_add(n, std::memory_order_relaxed);
  // Every piece waits in the queue for a lane slot; those that find one go to the engine at once. `r` may be
  // freed by completions as soon as its last piece is handed over, so nothing of it is touched after that.
  std::vector<RawIo*> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::deque<Piece*>& to = r->req.op == IoOp::kRead ? waiting_reads_ : waiting_writes_;
    for (Piece& p : r->pieces) to.push_back(&p);
    take_waiting(&run);
  }
  hand_over(run);
}

void IoQueue::on_piece_done(RawIo* io, int64_t res) {
  auto* p = static_cast<Piece*>(io);
  IoQueue* q = p->parent->queue;
  if (res > 0) {
    STRATA_ASSERT_MSG(res <= p->len, "engine reported more bytes than asked");
    p->moved += static_cast<uint32_t>(res);
    if (p->moved < p->full) {  // short transfer: resume the rest, keeping the lane slot
      q->resumed_short_.fetch_add(1, std::memory_order_relaxed);
      p->offset = p->start + p->moved;
      p->buf = p->base + p->moved;
      p->len = p->full - p->moved;
      q->engine_.submit(&io, 1);
      return;
    }
    q->finish_piece(p, Status::ok());
    return;
  }
  const std::string& path = q->engine_.path(p->file);
  if (res == 0) {
    q->finish_piece(p, Status::io_error("{} of {} bytes at offset {} of {}: {} after {} bytes", io_op_name(p->op),
                                        p->full, p->start, path,
                                        p->op == IoOp::kRead ? "unexpected end of file" : "the device took no bytes",
                                        p->moved));
    return;
  }
  const int err = static_cast<int>(-res);
  if ((err == EINTR || err == EAGAIN) && p->retries < q->options_.max_retries) {
    ++p->retries;
    q->retried_.fetch_add(1, std::memory_order_relaxed);
    q->engine_.submit(&io, 1);
    return;
  }
  q->finish_piece(p, Status::io_error("{} of {} bytes at offset {} of {}: {}", io_op_name(p->op), p->len, p->offset,
                                      path, errno_text(err)));
}

void IoQueue::finish_piece(Piece* p, Status status) {
  Request* r = p->parent;
  const uint32_t lane = p->lane;
  const IoOp op = p->op;
  const uint32_t bytes = p->full;
  if (!status.is_ok()) {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->error.is_ok()) r->error = std::move(status);
  }
  if (r->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) {
    release_lane(lane, op, bytes);
    return;
  }
  // The last piece: every other piece's writes to r happened before their decrement (acq_rel above).
  Status result = std::move(r->error);
  if (result.is_ok() && r->req.on_complete) result = r->req.on_complete();
  if (!result.is_ok()) failed_.fetch_add(1, std::memory_order_relaxed);
  IoBatch* batch = r->batch;
  delete r;
  // The last touch of the queue (~IoQueue waits for it) but for handing on waiting pieces.
  release_lane(lane, op, bytes);
  batch->finish(result);
}

Status IoQueue::read(int file, uint64_t offset, void* buf, size_t len) {
  IoBatch batch;
  submit(IoRequest{IoOp::kRead, file, offset, buf, len, nullptr}, &batch);
  return batch.wait();
}

Status IoQueue::write(int file, uint64_t offset, const void* buf, size_t len) {
  IoBatch batch;
  submit(IoRequest{IoOp::kWrite, file, offset, const_cast<void*>(buf), len, nullptr}, &batch);
  return batch.wait();
}

}  // namespace strata
