// fault_engine.h — an IoEngine wrapper that, by seed and rate, makes transfers fail the ways disks and kernels
// do: EIO, ENOSPC (writes), short transfers (the rest is resumed by IoQueue and must come out right), torn
// writes (only a prefix reaches the disk, success reported) and flipped bits (a read returns one bit wrong,
// success reported). The last two are silent by design: only checksums can catch them. Writes can also be
// held back until the test lets them go, to reach the orders a slow disk gives on purpose.
//
// Faults are drawn from one seeded generator in submission order, so a single-threaded test replays exactly.
// Thread-safe: forwards to the wrapped engine; its own state is behind a mutex. File operations pass through.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "common/rng.h"
#include "storage/io_engine.h"

namespace strata {

struct FaultOptions {
  uint64_t seed = 1;
  double eio_rate = 0;     // reads and writes fail with EIO, nothing moved
  double enospc_rate = 0;  // writes fail with ENOSPC, nothing moved
  double short_rate = 0;   // a prefix moves and the result says so (IoQueue resumes the rest)
  double torn_rate = 0;    // writes: a prefix reaches the disk, full success reported
  double flip_rate = 0;    // reads: one bit of the returned bytes flipped, success reported
};

struct FaultCounts {
  uint64_t eio = 0, enospc = 0, short_transfers = 0, torn = 0, flipped = 0;
  uint64_t total() const { return eio + enospc + short_transfers + torn + flipped; }
};

class FaultEngine final : public IoEngine {
 public:
  FaultEngine(IoEngine& inner, const FaultOptions& options);
  ~FaultEngine() override;

  std::string name() const override { return "faulty(" + inner_.name() + ")"; }
  uint32_t lanes() const override { return inner_.lanes(); }
  uint32_t queue_depth() const override { return inner_.queue_depth(); }
  Result<int> open(const std::string& path, const OpenOptions& o) override { return inner_.open(path, o); }
  Status close(int file) override { return inner_.close(file); }
  const std::string& path(int file) const override { return inner_.path(file); }
  bool direct(int file) const override { return inner_.direct(file); }
  Status allocate(int file, uint64_t bytes) override { return inner_.allocate(file, bytes); }
  Result<uint64_t> size(int file) const override { return inner_.size(file); }
  Status sync(int file) override { return inner_.sync(file); }
  Result<bool> try_lock(int file) override { return inner_.try_lock(file); }
  Status create_dirs(const std::string& dir) override { return inner_.create_dirs(dir); }
  Status remove(const std::string& path) override { return inner_.remove(path); }
  Result<std::vector<std::string>> list(const std::string& dir) const override { return inner_.list(dir); }
  size_t alignment(int file) const override { return inner_.alignment(file); }
  Status add_buffer(void* data, size_t len) override { return inner_.add_buffer(data, len); }
  void remove_buffer(void* data) override { inner_.remove_buffer(data); }
  Status register_buffers(std::span<const iovec> regions) override { return inner_.register_buffers(regions); }
  void unregister_buffers() override { inner_.unregister_buffers(); }
  void submit(RawIo* const* ios, size_t n) override;
  void shutdown() override;

  // Turns injection on or off (e.g. to write clean data first, then read it back under faults).
  void set_enabled(bool enabled);
  // While on, writes are kept back instead of reaching the disk (a disk slow to write, with the test deciding
  // when it catches up); turning it off submits them, in order. shutdown() turns it off.
  void hold_writes(bool hold);
  size_t held_writes() const;
  // Submits the first n held writes (all of them if fewer), in order, and keeps holding what comes after.
  void release_writes(size_t n);
  uint64_t reads_submitted() const;  // reads that reached this engine so far
  FaultCounts counts() const;

 private:
  struct Shadow;
  static void on_shadow_done(RawIo* io, int64_t res);
  void pass_on(RawIo* const* ios, size_t n, bool may_hold);  // submit's work; may_hold: writes obey hold_writes

  IoEngine& inner_;
  FaultOptions options_;
  mutable std::mutex mu_;
  Rng rng_;
  bool enabled_ = true;
  bool holding_ = false;
  std::vector<RawIo*> held_;
  uint64_t reads_ = 0;
  FaultCounts counts_;
  std::atomic<int64_t> shadows_{0};
};

}  // namespace strata
