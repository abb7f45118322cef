#include "storage/uring_engine.h"

#include <algorithm>
#include <cerrno>

#include "common/check.h"
#include "common/log.h"
#include "common/thread_name.h"
#include "storage/io_queue.h"

// The kernel hands a RawIo from the submitting thread to the completion thread; ThreadSanitizer cannot see that
// edge, so under TSan we draw it by hand.
#if defined(__SANITIZE_THREAD__)
#define STRATA_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STRATA_TSAN 1
#endif
#endif
#ifdef STRATA_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define TSAN_ACQUIRE(p) __tsan_acquire(p)
#define TSAN_RELEASE(p) __tsan_release(p)
#else
#define TSAN_ACQUIRE(p) ((void)0)
#define TSAN_RELEASE(p) ((void)0)
#endif

namespace strata {

namespace {
constexpr uint64_t kWakeup = 0;  // user_data of the NOP that tells a completion thread to stop
}

Result<std::unique_ptr<UringEngine>> UringEngine::create(const EngineOptions& options) {
  if (options.lanes == 0 || options.queue_depth == 0 || options.queue_depth > 4096)
    return Status::invalid_argument("io_uring: lanes must be > 0 and queue_depth in [1, 4096], got {} and {}",
                                    options.lanes, options.queue_depth);
  std::unique_ptr<UringEngine> e(new UringEngine(options));
  for (uint32_t i = 0; i < options.lanes; ++i) {
    auto ring = std::make_unique<Ring>();
    io_uring_params p{};
    // Room for every transfer in flight plus the stop NOP, so the completion queue can never overflow.
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * options.queue_depth + 2;
    if (options.sqpoll) {
      p.flags |= IORING_SETUP_SQPOLL;
      p.sq_thread_idle = options.sqpoll_idle_ms;
    }
    const int rc = io_uring_queue_init_params(options.queue_depth + 1, &ring->ring, &p);
    if (rc < 0) {
      for (auto& made : e->rings_) io_uring_queue_exit(&made->ring);  // no threads yet
      e->rings_.clear();
      return Status::io_error("io_uring_queue_init (depth {}{}): {}", options.queue_depth,
                              options.sqpoll ? ", SQPOLL" : "", errno_text(-rc));
    }
    e->rings_.push_back(std::move(ring));
  }
  // A sparse fixed-file table in every ring; open/close keep it in step (on_slot_change_ runs under the table lock).
  e->fixed_files_ = true;
  for (auto& r : e->rings_) {
    if (io_uring_register_files_sparse(&r->ring, kMaxFiles) < 0) e->fixed_files_ = false;
  }
  if (e->fixed_files_) {
    UringEngine* self = e.get();
    e->on_slot_change_ = [self](int slot, int fd) {
      for (auto& r : self->rings_) {
        const int rc = io_uring_register_files_update(&r->ring, static_cast<unsigned>(slot), &fd, 1);
        STRATA_ASSERT_MSG(rc == 1, "io_uring_register_files_update failed on a registered table");
      }
    };
  } else {
    for (auto& r : e->rings_) (void)io_uring_unregister_files(&r->ring);
  }
  // And a sparse fixed-buffer table, filled by add_buffer. Without one (before Linux 5.19) transfers pin their
  // pages each time, as unregistered memory always does.
  e->sparse_buffers_ = true;
  for (auto& r : e->rings_) {
    if (io_uring_register_buffers_sparse(&r->ring, kMaxBuffers) < 0) e->sparse_buffers_ = false;
  }
  if (e->sparse_buffers_) {
    for (int i = kMaxBuffers - 1; i >= 0; --i) e->free_entries_.push_back(i);
  } else {
    for (auto& r : e->rings_) (void)io_uring_unregister_buffers(&r->ring);
  }
  for (auto& r : e->rings_) {
    Ring* ring = r.get();
    UringEngine* self = e.get();
    ring->reaper = std::thread([self, ring] {
      set_thread_name("uring reaper");
      self->reap(*ring);
    });
  }
  return e;
}

UringEngine::~UringEngine() {
  shutdown();
  for (auto& r : rings_) io_uring_queue_exit(&r->ring);
}

int UringEngine::find_buffer(const void* buf, size_t len) const {
  if (buffers_.empty()) return -1;
  const auto b = reinterpret_cast<uintptr_t>(buf);
  auto it = std::upper_bound(buffers_.begin(), buffers_.end(), b,
                             [](uintptr_t v, const Region& r) { return v < r.begin; });
  if (it == buffers_.begin()) return -1;
  --it;
  return b + len <= it->end ? it->index : -1;
}

void UringEngine::submit(RawIo* const* ios, size_t n) {
  // Runs of transfers for the same ring go in with one io_uring_submit.
  size_t i = 0;
  while (i < n) {
    const uint32_t lane = ios[i]->lane % rings_.size();
    size_t j = i + 1;
    while (j < n && ios[j]->lane % rings_.size() == lane) ++j;
    submit_to(*rings_[lane], ios + i, j - i);
    i = j;
  }
}

void UringEngine::submit_to(Ring& ring, RawIo* const* ios, size_t n) {
  std::unique_lock<std::mutex> lock(ring.sq_mu);
  // Checked under the ring lock, which shutdown also takes before its stop NOP: a transfer either goes in
  // before the NOP (and the completion thread waits for it) or is cancelled here, with no lock held.
  if (stopping_.load(std::memory_order_acquire)) {
    lock.unlock();
    for (size_t i = 0; i < n; ++i) ios[i]->done(ios[i], -ECANCELED);
    return;
  }
  std::shared_lock<std::shared_mutex> buffers(buffers_mu_);  // until the SQEs naming table entries are submitted
  ring.in_flight.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
  for (size_t i = 0; i < n; ++i) {
    RawIo* io = ios[i];
    io_uring_sqe* sqe;
    while ((sqe = io_uring_get_sqe(&ring.ring)) == nullptr) {
      // Full only while the kernel has not consumed what we queued (SQPOLL asleep or busy): push it along.
      const int rc = io_uring_submit(&ring.ring);
      if (rc < 0 && rc != -EAGAIN && rc != -EBUSY && rc != -EINTR) URING_CHECK(rc);
      if (options_.sqpoll) (void)io_uring_sqring_wait(&ring.ring);
    }
    const int file = fixed_files_ ? io->file : fd(io->file);
    const int buf_index = find_buffer(io->buf, io->len);
    if (io->op == IoOp::kRead) {
      if (buf_index >= 0)
        io_uring_prep_read_fixed(sqe, file, io->buf, io->len, io->offset, buf_index);
      else
        io_uring_prep_read(sqe, file, io->buf, io->len, io->offset);
    } else {
      if (buf_index >= 0)
        io_uring_prep_write_fixed(sqe, file, io->buf, io->len, io->offset, buf_index);
      else
        io_uring_prep_write(sqe, file, io->buf, io->len, io->offset);
    }
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    TSAN_RELEASE(io);
    io_uring_sqe_set_data64(sqe, reinterpret_cast<uint64_t>(io));
  }
  for (;;) {
    const int rc = io_uring_submit(&ring.ring);
    // The kernel may take fewer than were queued (it stops at an entry it cannot set up, or when short of
    // request memory): the rest would wait for the next submission on this ring, which may never come while
    // the queue waits for these. Without SQPOLL, whatever the ring still holds is submitted again.
    if (rc >= 0 && (options_.sqpoll || io_uring_sq_ready(&ring.ring) == 0)) break;
    // EAGAIN/EBUSY: the kernel is short of resources for a moment; our CQ cannot overflow (see create).
    if (rc < 0 && rc != -EAGAIN && rc != -EBUSY && rc != -EINTR) URING_CHECK(rc);
    std::this_thread::yield();
  }
}

void UringEngine::reap(Ring& ring) {
  struct Done {
    RawIo* io;
    int64_t res;
  };
  std::vector<Done> done;
  done.reserve(2 * options_.queue_depth + 2);
  bool stop = false;
  for (;;) {
    if (stop && ring.in_flight.load(std::memory_order_acquire) == 0) return;
    io_uring_cqe* cqe;
    const int rc = io_uring_wait_cqe(&ring.ring, &cqe);
    if (rc == -EINTR || rc == -EAGAIN) continue;
    URING_CHECK(rc);
    // Take every ready completion, free their CQ slots, then run the callbacks (which may submit again).
    unsigned head, count = 0;
    done.clear();
    io_uring_for_each_cqe(&ring.ring, head, cqe) {
      ++count;
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      if (data == kWakeup)
        stop = true;
      else
        done.push_back({reinterpret_cast<RawIo*>(data), cqe->res});
    }
    io_uring_cq_advance(&ring.ring, count);
    ring.in_flight.fetch_sub(static_cast<int64_t>(done.size()), std::memory_order_acq_rel);
    for (const Done& d : done) {
      TSAN_ACQUIRE(d.io);
      d.io->done(d.io, d.res);
    }
  }
}

size_t UringEngine::fixed_buffers() const {
  std::shared_lock<std::shared_mutex> lock(buffers_mu_);
  return buffers_.size();
}

int UringEngine::update_table(int index, const iovec& iov) {
  for (size_t k = 0; k < rings_.size(); ++k) {
    iovec one = iov;
    __u64 tag = 0;
    const int rc = io_uring_register_buffers_update_tag(&rings_[k]->ring, static_cast<unsigned>(index), &one, &tag, 1);
    if (rc < 0) {
      iovec none{nullptr, 0};
      for (size_t j = 0; j < k; ++j)  // the entry stays empty everywhere
        (void)io_uring_register_buffers_update_tag(&rings_[j]->ring, static_cast<unsigned>(index), &none, &tag, 1);
      return rc;
    }
  }
  return 0;
}

Status UringEngine::add_locked(void* data, size_t len, bool bulk) {
  if (!sparse_buffers_) return Status::unimplemented("io_uring fixed buffers need Linux 5.19 or later");
  // With SQPOLL the kernel takes SQEs after submit returns, so an entry could change under one.
  if (options_.sqpoll && !bulk)
    return Status::unimplemented("io_uring fixed buffers are added only while nothing is in flight with SQPOLL: "
                                 "use register_buffers");
  const auto owner = reinterpret_cast<uintptr_t>(data);
  constexpr size_t kMaxEntry = size_t{1} << 30;  // the kernel's limit per table entry
  std::vector<int> added;                        // this call's entries, undone if a later part fails
  auto undo = [&] {
    std::erase_if(buffers_, [&](const Region& r) {
      return std::find(added.begin(), added.end(), r.index) != added.end();
    });
    for (const int index : added) clear_entry(index);
  };
  for (size_t at = 0; at < len; at += kMaxEntry) {
    const size_t part = std::min(kMaxEntry, len - at);
    if (free_entries_.empty()) {
      undo();
      return Status::out_of_memory("io_uring fixed-buffer table full ({} entries)", kMaxBuffers);
    }
    const int index = free_entries_.back();
    const int rc = update_table(index, iovec{static_cast<char*>(data) + at, part});
    if (rc < 0) {
      undo();
      return Status::io_error("io_uring fixed buffer of {} bytes: {}", part, errno_text(-rc));
    }
    free_entries_.pop_back();
    added.push_back(index);
    const Region r{owner + at, owner + at + part, index, owner, bulk};
    buffers_.insert(std::upper_bound(buffers_.begin(), buffers_.end(), r,
                                     [](const Region& a, const Region& b) { return a.begin < b.begin; }),
                    r);
  }
  return Status::ok();
}

void UringEngine::clear_entry(int index) {
  // An entry the kernel would not clear stays out of use: reusing it could name the old memory.
  if (update_table(index, iovec{nullptr, 0}) == 0) free_entries_.push_back(index);
}

void UringEngine::remove_locked(uintptr_t owner, bool bulk) {
  std::erase_if(buffers_, [&](const Region& r) {
    if (r.bulk != bulk || (!bulk && r.owner != owner)) return false;
    clear_entry(r.index);
    return true;
  });
}

Status UringEngine::add_buffer(void* data, size_t len) {
  if (data == nullptr || len == 0) return Status::invalid_argument("io_uring fixed buffer: empty");
  std::unique_lock<std::shared_mutex> lock(buffers_mu_);
  return add_locked(data, len, /*bulk=*/false);
}

void UringEngine::remove_buffer(void* data) {
  std::unique_lock<std::shared_mutex> lock(buffers_mu_);
  remove_locked(reinterpret_cast<uintptr_t>(data), /*bulk=*/false);
}

Status UringEngine::register_buffers(std::span<const iovec> regions) {
  std::unique_lock<std::shared_mutex> lock(buffers_mu_);
  if (!sparse_buffers_) return register_whole_table(regions);
  remove_locked(0, /*bulk=*/true);
  for (const iovec& r : regions) {
    if (r.iov_len == 0) continue;
    if (Status st = add_locked(r.iov_base, r.iov_len, /*bulk=*/true); !st.is_ok()) {
      remove_locked(0, /*bulk=*/true);
      return st.with_context(fmt::format("registering {} regions", regions.size()));
    }
  }
  return Status::ok();
}

Status UringEngine::register_whole_table(std::span<const iovec> regions) {
  // Kernels before 5.19 have no sparse table: the whole table at once (Linux 5.1), while nothing is in flight.
  if (!buffers_.empty()) {
    for (auto& r : rings_) (void)io_uring_unregister_buffers(&r->ring);
    buffers_.clear();
  }
  if (regions.empty()) return Status::ok();
  for (auto& r : rings_) {
    const int rc = io_uring_register_buffers(&r->ring, regions.data(), static_cast<unsigned>(regions.size()));
    if (rc < 0) {
      for (auto& u : rings_) (void)io_uring_unregister_buffers(&u->ring);
      return Status::io_error("io_uring_register_buffers ({} regions): {}", regions.size(), errno_text(-rc));
    }
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    const auto b = reinterpret_cast<uintptr_t>(regions[i].iov_base);
    buffers_.push_back({b, b + regions[i].iov_len, static_cast<int>(i), b, true});
  }
  std::sort(buffers_.begin(), buffers_.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  return Status::ok();
}

void UringEngine::unregister_buffers() {
  std::unique_lock<std::shared_mutex> lock(buffers_mu_);
  if (!sparse_buffers_) {
    (void)register_whole_table({});
    return;
  }
  remove_locked(0, /*bulk=*/true);
}

void UringEngine::shutdown() {
  std::lock_guard<std::mutex> guard(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& r : rings_) {
    {
      std::lock_guard<std::mutex> lock(r->sq_mu);
      stopping_.store(true, std::memory_order_release);
      io_uring_sqe* sqe;
      while ((sqe = io_uring_get_sqe(&r->ring)) == nullptr) (void)io_uring_submit(&r->ring);
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kWakeup);
      while (io_uring_submit(&r->ring) < 0) std::this_thread::yield();
    }
    r->reaper.join();
  }
}

}  // namespace strata
