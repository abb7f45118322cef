// swap_store.h — the NVMe tier's swap space: named extents of any size in a few preallocated, locked files per
// rank, every extent checksummed (XXH3-64 per chunk) and verified on every read. The layout is in
// docs/formats/swap.md.
//
// Owns: its swap files (created lazily up to max_files, removed on destruction, stale ones of dead processes
// removed at open), a 4 KiB-granular best-fit extent allocator with coalescing, the key index with each
// version's checksums (in memory only: swap is scratch space and does not outlive the process), and small
// bounce buffers for padding and unaligned callers. Does not own the IoQueue/IoEngine it runs on (they must
// outlive it) nor the callers' buffers.
//
// Writes are copy-on-write: a write goes to a new extent and the key switches to it only once every byte has
// been written, so a failed write leaves the previous version readable. While a key has a write in flight,
// reading, writing or freeing it again is refused with InvalidArgument (a caller that reads back what it has
// not finished writing has an ordering bug; a silent stale read would hide it). Reads of a key may overlap
// each other and a later overwrite or free of it: the old extent is released when its last reader finishes.
//
// Threading: every method is thread-safe; the index and allocator sit behind one mutex and no I/O happens
// under it. Checksums are taken in each chunk's completion on the engine's threads: a written chunk's once
// it is on disk (from the bytes the caller keeps until the batch completes), a read chunk's verified before
// the read succeeds; the calling thread only queues. The async write/read return once every chunk is
// queued; they block only while every bounce buffer is in flight. The caller keeps `buf` alive and unchanged
// until the batch completes; after a failed read its contents are unspecified.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "storage/io_queue.h"

namespace strata {

constexpr char kSwapFilePrefix[] = "strata-swap-";
constexpr char kSwapFileSuffix[] = ".swp";
constexpr uint64_t kSwapBlock = 4096;          // header size, extent alignment and padding unit
constexpr char kSwapMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'S', 'W'};
constexpr uint32_t kSwapVersion = 1;

// The first 4 KiB of every swap file (docs/formats/swap.md), little-endian; then zeros, and at byte 4088 the XXH3-64
// (seed 0) of bytes [0, 4088). Written when the file is made, for people and tools; the store never reads it.
struct SwapFileHeader {
  char magic[8];  // kSwapMagic
  uint32_t version, header_bytes, rank, pid, file_index, extent_alignment;
  uint64_t file_bytes, created_unix_ns, checksum_chunk;
  char host[64];  // NUL-terminated
};
static_assert(offsetof(SwapFileHeader, rank) == 16 && offsetof(SwapFileHeader, file_bytes) == 32 &&
              offsetof(SwapFileHeader, host) == 56 && sizeof(SwapFileHeader) == 120);

class SwapBouncePool;  // swap_store_parts.h

struct SwapStoreOptions {
  std::string dir;                              // created when missing
  int rank = 0;                                 // in the file names, so ranks can share a directory
  uint64_t file_bytes = uint64_t{1} << 30;      // size of each preallocated file (rounded up to 4 KiB)
  uint32_t max_files = 8;                       // files are added lazily, up to this many
  uint64_t checksum_chunk = uint64_t{1} << 20;  // bytes per checksum; a multiple of 4096
  bool direct = true;                           // O_DIRECT (the engine falls back to buffered where refused)
};

struct SwapStoreStats {
  uint64_t capacity_bytes = 0;  // what max_files files can hold: max_files * (file_bytes - 4096)
  uint64_t reserved_bytes = 0;  // disk space of the files made so far, headers included
  uint64_t used_bytes = 0;      // allocated extent bytes (padded to 4 KiB), old versions still being read included
  uint64_t free_bytes = 0;      // unallocated extent bytes in the files made so far
  uint64_t largest_free_extent = 0;
  uint64_t logical_bytes = 0;   // sum of the stored keys' lengths
  uint32_t files = 0;
  uint64_t extents = 0;         // allocated extents
  uint64_t free_extents = 0;    // separate free ranges: how fragmented the free space is
  uint64_t keys = 0;
  uint64_t checksum_failures = 0;
};

// Where a key's current version lives (for diagnostics and tests).
struct SwapExtent {
  std::string path;
  uint64_t offset = 0;  // of the extent in the file
  uint64_t length = 0;  // the key's bytes
  uint64_t padded = 0;  // bytes reserved on disk, a multiple of 4096
  uint64_t generation = 0;
};

class SwapStore {
 public:
  // Creates `dir`, removes the swap files of dead processes there (one log line), and creates the first file,
  // so that a missing directory, a read-only filesystem or a full disk is reported here.
  static Result<std::unique_ptr<SwapStore>> open(IoQueue& queue, const SwapStoreOptions& options);
  // Clean shutdown: waits for the requests still in flight, then removes and closes every file.
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Queues the write or read of `key`; the outcome arrives in `batch`. The returned Status is for what is
  // known at once: a read of an unknown key (NotFound) or with the wrong length, a key with a write in
  // flight, a key larger than a file (InvalidArgument), a store that is full (OutOfMemory), a new swap file
  // the disk has no room for (IOError). On such an error nothing was queued.
  Status write(const std::string& key, const void* buf, size_t len, IoBatch* batch);
  Status read(const std::string& key, void* buf, size_t len, IoBatch* batch);
  // Synchronous forms; their errors name the key.
  Status write(const std::string& key, const void* buf, size_t len);
  Status read(const std::string& key, void* buf, size_t len);
  // Forgets `key`; its extent returns to the allocator once no read of it is in flight.
  Status free(const std::string& key);

  bool contains(const std::string& key) const;  // true once a write of it has succeeded
  Result<size_t> length(const std::string& key) const;
  Result<SwapExtent> locate(const std::string& key) const;
  SwapStoreStats stats() const;
  std::vector<std::string> file_paths() const;
  const SwapStoreOptions& options() const { return options_; }

 private:
  struct File;
  struct Version;
  struct Entry {
    std::shared_ptr<Version> current;  // null until the first write succeeds
    bool writing = false;              // a write is in flight
  };
  struct WriteOp;
  struct ReadOp;
  struct Extent {
    File* file = nullptr;
    uint64_t offset = 0, bytes = 0;
  };

  SwapStore(IoQueue& queue, const SwapStoreOptions& options);
  Status add_file();  // caller holds grow_mu_
  Result<Extent> allocate(const std::string& key, uint64_t bytes);
  bool fit_locked(uint64_t bytes, Extent* out);
  void release_locked(const Extent& e);
  void retire_locked(const std::shared_ptr<Version>& v);
  Result<std::shared_ptr<WriteOp>> begin_write(const std::string& key, size_t len);
  void finish_write(WriteOp& op);
  void finish_read(const std::shared_ptr<Version>& v);
  Result<std::pair<bool, bool>> route(const File& file, const void* buf, uint64_t len);
  const std::shared_ptr<Version>* find_locked(const std::string& key) const;
  uint64_t keys_locked() const;
  SwapStoreStats stats_locked() const;

  IoQueue& queue_;
  IoEngine& engine_;
  SwapStoreOptions options_;
  uint64_t max_extent_;  // file_bytes - header
  mutable std::mutex mu_;  // index_, files_' allocators, counters
  std::condition_variable idle_cv_;
  std::mutex grow_mu_;    // serializes adding files (I/O), taken before mu_
  std::vector<std::unique_ptr<File>> files_;
  std::unordered_map<std::string, Entry> index_;
  uint64_t next_generation_ = 1;
  uint64_t ops_in_flight_ = 0;
  uint64_t logical_bytes_ = 0;
  uint64_t extents_ = 0;
  std::atomic<uint64_t> checksum_failures_{0};  // bumped on engine threads
  std::unique_ptr<SwapBouncePool> body_bounces_, tail_bounces_;  // unaligned bodies; padded tails
};

}  // namespace strata
