// io_engine.h — the raw I/O engine interface every NVMe-tier file access goes through (leveldb's Env, made
// asynchronous), and the factory that picks io_uring or the POSIX fallback.
//
// An IoEngine owns files (open, preallocate, lock, remove) and moves bytes for RawIo transfers. It does not
// split, retry, resume or judge: each RawIo completes exactly once with what the kernel said — the bytes moved
// (possibly fewer than asked) or -errno — by calling io->done on one of the engine's own threads (or, for the
// in-memory engine, inside submit). IoQueue (io_queue.h) sits on top and holds the correctness logic once for
// every engine: short transfers resumed, EINTR/EAGAIN retried, -errno turned into a Status naming file and
// offset. That split also lets the fault-injecting engine (fault_engine.h) exercise that logic.
//
// Threading: file operations and submit are thread-safe. done callbacks may call submit again (a resumed
// transfer) and must not block on other I/O. Flow control is the caller's: an engine accepts up to
// queue_depth() transfers in flight per lane without blocking; IoQueue never exceeds that.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata {

enum class IoOp : uint8_t { kRead, kWrite };
const char* io_op_name(IoOp op);

// One transfer as the engine sees it. The submitter owns it and keeps it alive until done is called.
struct RawIo {
  IoOp op = IoOp::kRead;
  int file = -1;        // an id from IoEngine::open
  uint32_t lane = 0;    // which ring/thread serves it (taken modulo lanes())
  uint64_t offset = 0;  // byte offset in the file
  void* buf = nullptr;
  uint32_t len = 0;  // bytes to move (> 0)
  // Called exactly once with the bytes moved (0 <= res <= len) or -errno.
  void (*done)(RawIo* io, int64_t res) = nullptr;
};

struct OpenOptions {
  bool create = false;    // create the file when missing
  bool truncate = false;  // empty it when it exists
  bool direct = true;     // O_DIRECT (bypass the page cache); refused by some filesystems, see IoEngine::open
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  IoEngine() = default;
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // "io_uring", "posix", "memory", "faulty(io_uring)".
  virtual std::string name() const = 0;
  // Independent submission queues (io_uring rings, or POSIX worker threads), and transfers each takes at once.
  virtual uint32_t lanes() const = 0;
  virtual uint32_t queue_depth() const = 0;

  // Files. `open` returns an id for RawIo::file. When O_DIRECT is asked for but the filesystem refuses it
  // (tmpfs), the file is opened buffered, with one warning; direct(file) says which it got.
  virtual Result<int> open(const std::string& path, const OpenOptions& options) = 0;
  virtual Status close(int file) = 0;
  virtual const std::string& path(int file) const = 0;
  virtual bool direct(int file) const = 0;
  // Reserves [0, bytes) on disk (fallocate): a full disk is an IOError naming the file here, not a failed
  // write later.
  virtual Status allocate(int file, uint64_t bytes) = 0;
  virtual Result<uint64_t> size(int file) const = 0;
  virtual Status sync(int file) = 0;
  // An advisory exclusive lock held until close or process death (flock); false when another holder has it.
  virtual Result<bool> try_lock(int file) = 0;
  virtual Status create_dirs(const std::string& dir) = 0;
  virtual Status remove(const std::string& path) = 0;
  // Names (not paths) of the regular files in `dir`.
  virtual Result<std::vector<std::string>> list(const std::string& dir) const = 0;

  // Alignment of offset, length and buffer address that direct I/O on `file` needs (1 when buffered).
  virtual size_t alignment(int file) const = 0;

  // Starts n transfers. Never blocks on I/O, and never fails: problems arrive as negative results in done.
  virtual void submit(RawIo* const* ios, size_t n) = 0;

  // Registers memory that transfers will use (io_uring fixed buffers: the pages are pinned once, not per
  // transfer). Engines without the notion accept and ignore it; where the engine has it but cannot register
  // (no room left, a memlock limit, a kernel before 5.19, SQPOLL) the error says why and transfers work as
  // before. add_buffer / remove_buffer: one buffer at a time, at any time, transfers in flight included (those
  // from a removed buffer finish normally); not with SQPOLL. register_buffers replaces what an earlier
  // register_buffers gave, and unregister_buffers removes it, only while nothing is in flight; buffers given to
  // add_buffer stay until remove_buffer.
  virtual Status add_buffer(void* data, size_t len) { return Status::ok(); }
  virtual void remove_buffer(void* data) {}
  virtual Status register_buffers(std::span<const iovec> regions) { return Status::ok(); }
  virtual void unregister_buffers() {}

  // Completes queued transfers with -ECANCELED, waits for those in flight, and stops the engine's threads.
  // Later submits complete with -ECANCELED. Idempotent; the destructor calls it.
  virtual void shutdown() = 0;
};

enum class EngineKind { kAuto, kUring, kPosix };
const char* engine_kind_name(EngineKind kind);
Result<EngineKind> parse_engine_kind(const std::string& name);  // "auto", "io_uring" (or "uring"), "posix"

struct EngineOptions {
  EngineKind kind = EngineKind::kAuto;
  uint32_t lanes = 1;         // io_uring rings (each with its own completion thread) or POSIX threads
  uint32_t queue_depth = 32;  // transfers in flight per lane
  bool sqpoll = false;        // io_uring: a kernel thread polls the submission queue (no syscall per submit)
  uint32_t sqpoll_idle_ms = 50;
};

// kAuto tries io_uring and falls back to POSIX, with one warning saying why, when the kernel lacks or refuses
// it (ENOSYS, EPERM under seccomp, ENOMEM under RLIMIT_MEMLOCK). kUring fails instead of falling back.
Result<std::unique_ptr<IoEngine>> make_io_engine(const EngineOptions& options);

}  // namespace strata
