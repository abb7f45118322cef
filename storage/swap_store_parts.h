// swap_store_parts.h — SwapStore's internals that its two sources share (swap_store.cpp: files, extents, the
// index; swap_store_io.cpp: writes and reads): a key's chunking, a file's free extents, a key's versions, the
// bounce buffers and the operations in flight. Included by those two files only.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/aligned.h"
#include "common/trace.h"
#include "storage/checksum.h"
#include "storage/swap_store.h"

namespace strata {
namespace swap_parts {

constexpr uint64_t kGoldenRatio = 0x9e3779b97f4a7c15ull;

inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// How a key of `len` bytes is cut for checksums and transfers: body chunks of `chunk` bytes over its whole
// 4 KiB blocks (the last one shorter), then the tail (len % 4096 bytes, padded to a block on disk) as a chunk
// of its own. A function of the length only, so any buffer can read back what any buffer wrote.
struct Chunk {
  uint64_t offset = 0;  // in the key
  uint64_t len = 0;     // logical bytes
  bool tail = false;
};
class Chunking {
 public:
  Chunking(uint64_t len, uint64_t chunk)
      : len_(len), chunk_(chunk), body_(len / kSwapBlock * kSwapBlock), body_chunks_((body_ + chunk - 1) / chunk) {}
  size_t count() const { return body_chunks_ + (has_tail() ? 1 : 0); }
  bool has_body() const { return body_ > 0; }
  bool has_tail() const { return len_ > body_; }
  Chunk operator[](size_t i) const {
    if (i < body_chunks_) return {i * chunk_, std::min(chunk_, body_ - i * chunk_), false};
    return {body_, len_ - body_, true};
  }

 private:
  uint64_t len_, chunk_, body_;
  size_t body_chunks_;
};

}  // namespace swap_parts

struct SwapStore::File {
  int id = -1;
  std::string path;
  size_t alignment = 1;  // what the engine needs of offsets, lengths and buffers (4096 under O_DIRECT)
  // Free extents in whole 4 KiB blocks, kept coalesced: no two touch.
  std::map<uint64_t, uint64_t> free_by_offset;             // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> free_by_length;  // (length, offset): best fit is a lower_bound
  uint64_t free_bytes = 0;

  void insert_free(uint64_t offset, uint64_t len) {
    free_by_offset.emplace(offset, len);
    free_by_length.emplace(len, offset);
    free_bytes += len;
  }
  void erase_free(std::map<uint64_t, uint64_t>::iterator it) {
    free_by_length.erase({it->second, it->first});
    free_bytes -= it->second;
    free_by_offset.erase(it);
  }
};

// One version of a key: its extent and checksums. Immutable once committed, except readers/retired.
struct SwapStore::Version {
  std::string key;
  Extent extent;  // no file for an empty key
  uint64_t len = 0;
  uint64_t generation = 0;
  uint64_t seed = 0;           // XXH3 of the key seeded with the generation; chunk i hashes with seed + φ·(i+1)
  std::vector<uint64_t> sums;  // per chunk
  int readers = 0;             // under mu_: reads in flight
  bool retired = false;        // under mu_: replaced or freed; the extent returns when readers reach 0

  uint64_t chunk_seed(size_t i) const { return seed + swap_parts::kGoldenRatio * (i + 1); }
};

// Bounce buffers of one size, allocated together on first use (so that running out of memory is an error known
// before any I/O) and lent to one chunk at a time; acquire blocks while every one is in flight.
class SwapBouncePool {
 public:
  SwapBouncePool(size_t bytes, size_t count, std::string purpose)
      : bytes_(bytes), count_(count), purpose_(std::move(purpose)) {}

  Status ensure() {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = buffers_.size(); i < count_; ++i) {
      Result<AlignedBuffer> b = AlignedBuffer::allocate(bytes_, purpose_, kSwapBlock);
      if (!b.is_ok()) return buffers_.empty() ? b.status() : Status::ok();  // fewer only means less overlap
      free_.push_back(b->as<char>());
      buffers_.push_back(std::move(b).value());
    }
    return Status::ok();
  }
  // A buffer lent to one chunk. It comes back when the chunk's request is destroyed, success or not.
  struct Return {
    SwapBouncePool* pool;
    void operator()(char* p) const {
      std::lock_guard<std::mutex> lock(pool->mu_);
      pool->free_.push_back(p);
      pool->cv_.notify_one();
    }
  };
  using Lease = std::unique_ptr<char, Return>;
  Lease lend() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    Lease lease(free_.back(), Return{this});
    free_.pop_back();
    return lease;
  }

 private:
  const size_t bytes_, count_;
  const std::string purpose_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<AlignedBuffer> buffers_;
  std::vector<char*> free_;
};

// A write in flight. Every chunk's IoRequest::on_complete holds a reference, and IoQueue destroys a request
// (success or failure) before it tells the batch, so this destructor, which commits or rolls back, has run by
// the time the caller's batch.wait() returns.
struct SwapStore::WriteOp {
  SwapStore* store = nullptr;
  std::shared_ptr<Version> version;
  bool queued_all = false;         // every chunk was handed to the queue
  std::atomic<size_t> written{0};  // chunks whose every byte was written
  uint64_t traced = trace::begin();  // when it was queued, for the trace (common/trace.h)
  ~WriteOp() {
    if (queued_all) trace::end_async("nvme write", traced, static_cast<int64_t>(version->len));
    store->finish_write(*this);
  }
};

// A read in flight: keeps its version's extent allocated (readers > 0) until the last chunk's request is gone.
struct SwapStore::ReadOp {
  SwapStore* store = nullptr;
  std::shared_ptr<Version> version;
  uint64_t traced = trace::begin();
  ~ReadOp() {
    if (!version) return;
    trace::end_async("nvme read", traced, static_cast<int64_t>(version->len));
    store->finish_read(version);
  }

  // On an engine thread, once chunk i's bytes are in `data`.
  Status verify(size_t i, const swap_parts::Chunk& c, const char* data) const {
    const Version& v = *version;
    const uint64_t got = xxh3_64(data, c.len, v.chunk_seed(i));
    if (got == v.sums[i]) return Status::ok();
    store->checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    return Status::corruption(
        "swap store: checksum mismatch in {} at offset {} ({} bytes): key '{}' chunk {} of {} (bytes [{}, {}) of "
        "{}, write generation {}): XXH3 expected {:#018x}, got {:#018x}",
        v.extent.file->path, v.extent.offset + c.offset, c.len, v.key, i, v.sums.size(), c.offset,
        c.offset + c.len, v.len, v.generation, v.sums[i], got);
  }
};

}  // namespace strata
