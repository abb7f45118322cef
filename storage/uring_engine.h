// uring_engine.h — the io_uring engine (liburing): one ring per lane, each with its own completion thread.
//
// Submission is batched: IoQueue hands over runs of pieces and each run costs one io_uring_submit (none with
// SQPOLL while the kernel thread is awake). Files are registered in a sparse fixed-file table and buffers
// handed to add_buffer / register_buffers in a sparse fixed-buffer table (Linux 5.19 and later), so the kernel
// neither looks up the fd nor pins pages per transfer: a transfer lying wholly inside a registered buffer is
// issued as READ_FIXED / WRITE_FIXED. Every CQE's result goes to RawIo::done as is; IoQueue judges it.
//
// Threading: submit may be called from any thread (a per-ring mutex guards the submission queue); each ring's
// completion queue is read only by its own thread, which runs the done callbacks.
#pragma once

#include <liburing.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "storage/file_table.h"

namespace strata {

class UringEngine final : public FileTable {
 public:
  // Fails (with the kernel's reason) where io_uring is missing or refused; make_io_engine then falls back.
  static Result<std::unique_ptr<UringEngine>> create(const EngineOptions& options);
  ~UringEngine() override;

  std::string name() const override { return options_.sqpoll ? "io_uring+sqpoll" : "io_uring"; }
  uint32_t lanes() const override { return static_cast<uint32_t>(rings_.size()); }
  uint32_t queue_depth() const override { return options_.queue_depth; }
  void submit(RawIo* const* ios, size_t n) override;
  Status add_buffer(void* data, size_t len) override;
  void remove_buffer(void* data) override;
  Status register_buffers(std::span<const iovec> regions) override;
  void unregister_buffers() override;
  void shutdown() override;

  bool fixed_files() const { return fixed_files_; }
  // Entries of the fixed-buffer table in use (a buffer over 1 GiB, the kernel's limit per entry, takes several).
  size_t fixed_buffers() const;
  static constexpr int kMaxBuffers = 4096;  // entries of the sparse fixed-buffer table

 private:
  struct Ring {
    io_uring ring;
    std::mutex sq_mu;
    std::atomic<int64_t> in_flight{0};
    std::thread reaper;
  };
  struct Region {
    uintptr_t begin, end;
    int index;         // in the fixed-buffer table
    uintptr_t owner;   // the pointer given to add_buffer
    bool bulk;         // from register_buffers
  };
  explicit UringEngine(const EngineOptions& options) : options_(options) {}
  void reap(Ring& ring);
  void submit_to(Ring& ring, RawIo* const* ios, size_t n);
  int find_buffer(const void* buf, size_t len) const;  // caller holds buffers_mu_
  // The caller holds buffers_mu_ exclusively. remove_locked: the bulk regions, or else those add_buffer gave
  // for `owner`.
  Status add_locked(void* data, size_t len, bool bulk);
  void remove_locked(uintptr_t owner, bool bulk);
  void clear_entry(int index);
  Status register_whole_table(std::span<const iovec> regions);  // no sparse table (Linux < 5.19)
  int update_table(int index, const iovec& iov);  // every ring; 0 or -errno

  EngineOptions options_;
  std::vector<std::unique_ptr<Ring>> rings_;
  bool fixed_files_ = false;
  bool sparse_buffers_ = false;  // the rings have a sparse fixed-buffer table
  // Held shared from preparing an SQE until it is submitted, so a table entry never changes in between.
  mutable std::shared_mutex buffers_mu_;
  std::vector<Region> buffers_;  // sorted by begin
  std::vector<int> free_entries_;
  std::atomic<bool> stopping_{false};
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace strata
