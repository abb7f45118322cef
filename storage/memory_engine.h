// memory_engine.h — an IoEngine over files held in memory, for tests: same contract as the disk engines, with
// a capacity that makes allocate/writes fail with ENOSPC, and no alignment rules (alignment() is 1 unless
// `direct_alignment` asks the engine to insist on it like O_DIRECT does).
//
// Transfers complete inside submit, on the caller's thread, in order. Thread-safe (one mutex).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "storage/io_engine.h"

namespace strata {

struct MemoryEngineOptions {
  uint64_t capacity_bytes = uint64_t{1} << 40;  // total bytes all files may hold
  size_t direct_alignment = 1;                  // 4096 makes direct files demand O_DIRECT alignment
  uint32_t lanes = 1;
  uint32_t queue_depth = 32;
};

class MemoryEngine final : public IoEngine {
 public:
  explicit MemoryEngine(const MemoryEngineOptions& options = {}) : options_(options) {}

  std::string name() const override { return "memory"; }
  uint32_t lanes() const override { return options_.lanes; }
  uint32_t queue_depth() const override { return options_.queue_depth; }
  Result<int> open(const std::string& path, const OpenOptions& options) override;
  Status close(int file) override;
  const std::string& path(int file) const override;
  bool direct(int file) const override;
  Status allocate(int file, uint64_t bytes) override;
  Result<uint64_t> size(int file) const override;
  Status sync(int file) override { return Status::ok(); }
  Result<bool> try_lock(int file) override;
  Status create_dirs(const std::string& dir) override;
  Status remove(const std::string& path) override;
  Result<std::vector<std::string>> list(const std::string& dir) const override;
  size_t alignment(int file) const override;
  void submit(RawIo* const* ios, size_t n) override;
  void shutdown() override;

  uint64_t used_bytes() const;
  // Simulates a crash of the process that holds the locks: every open file is dropped without cleanup, its
  // lock released, its bytes kept.
  void crash();

 private:
  struct Data {
    std::vector<char> bytes;
    bool locked = false;
  };
  struct Handle {
    std::string path;
    std::shared_ptr<Data> data;
    bool direct = false;
    bool holds_lock = false;
  };
  int64_t transfer(RawIo* io);  // bytes moved or -errno; caller holds mu_
  size_t alignment_locked(int file) const;
  Status grow(Data& d, uint64_t bytes);

  MemoryEngineOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Data>> files_;
  std::set<std::string> dirs_;
  std::map<int, Handle> open_;
  int next_id_ = 0;
  uint64_t used_ = 0;
  bool shut_down_ = false;
};

}  // namespace strata
