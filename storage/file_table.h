// file_table.h — the file half of the io_uring and POSIX engines: open (O_DIRECT, falling back to buffered
// where the filesystem refuses it), fallocate, fstat, fdatasync, flock, mkdir -p, unlink, readdir.
//
// FileTable owns the descriptors; ids are small integers reused after close (io_uring registers them in a
// fixed-file table of kMaxFiles slots). Thread-safe: the table is guarded by a mutex; fd lookups for I/O take
// it briefly. Closing a file with transfers in flight is the caller's bug.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "storage/io_engine.h"

namespace strata {

class FileTable : public IoEngine {
 public:
  static constexpr int kMaxFiles = 256;

  Result<int> open(const std::string& path, const OpenOptions& options) override;
  Status close(int file) override;
  const std::string& path(int file) const override;
  bool direct(int file) const override;
  Status allocate(int file, uint64_t bytes) override;
  Result<uint64_t> size(int file) const override;
  Status sync(int file) override;
  Result<bool> try_lock(int file) override;
  Status create_dirs(const std::string& dir) override;
  Status remove(const std::string& path) override;
  Result<std::vector<std::string>> list(const std::string& dir) const override;
  size_t alignment(int file) const override;

 protected:
  ~FileTable() override;
  int fd(int file) const;
  // Told of every open (fd >= 0) and close (fd == -1) of slot `file`, under the table lock (io_uring updates
  // its registered-file table here).
  std::function<void(int file, int fd)> on_slot_change_;

 private:
  struct Entry {
    int fd = -1;
    bool direct = false;
    std::string path;
  };
  mutable std::mutex mu_;
  std::vector<Entry> files_ = std::vector<Entry>(kMaxFiles);
};

}  // namespace strata
