#include "storage/swap_store.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "common/aligned.h"
#include "common/check.h"
#include "common/log.h"
#include "common/trace.h"
#include "storage/checksum.h"

namespace strata {

static_assert(std::endian::native == std::endian::little, "the swap file header is written in native byte order");

namespace {

constexpr uint64_t kGoldenRatio = 0x9e3779b97f4a7c15ull;
constexpr size_t kTailBounces = 64;                         // 4 KiB blocks for the padded tails of keys
constexpr uint64_t kBodyBounceBudget = uint64_t{16} << 20;  // chunk-sized bounces for unaligned callers

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

bool is_swap_file_name(const std::string& name) {
  const std::string_view n(name), prefix(kSwapFilePrefix), suffix(kSwapFileSuffix);
  return n.size() > prefix.size() + suffix.size() && n.starts_with(prefix) && n.ends_with(suffix);
}

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

// IoQueue's I/O errors name file and offset; the synchronous calls add the key (Corruption names it already).
Status name_key(Status st, const char* verb, const std::string& key) {
  if (st.code() != StatusCode::kIOError) return st;
  return st.with_context(fmt::format("swap store: {} key '{}'", verb, key));
}

// Removes the swap files in `dir` whose lock nobody holds: their process died without cleaning up.
Status remove_stale_files(IoEngine& engine, const std::string& dir) {
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> names, engine.list(dir));
  size_t removed = 0, live = 0;
  uint64_t bytes = 0;
  for (const std::string& name : names) {
    if (!is_swap_file_name(name)) continue;
    const std::string path = dir + "/" + name;
    Result<int> file = engine.open(path, OpenOptions{.create = false, .truncate = false, .direct = false});
    if (!file.is_ok()) continue;  // gone already: another process's start-up removed it
    Result<bool> locked = engine.try_lock(*file);
    if (!locked.is_ok()) STRATA_LOG_WARN("swap store: leaving {}: {}", path, locked.status().message());
    if (!locked.is_ok() || !*locked) {
      live += locked.is_ok();
      (void)engine.close(*file);
      continue;
    }
    Result<uint64_t> size = engine.size(*file);
    const Status st = engine.remove(path);  // while holding the lock, so nobody can take it for a live file
    (void)engine.close(*file);
    if (!st.is_ok()) {
      STRATA_LOG_WARN("swap store: cannot remove stale swap file: {}", st.message());
      continue;
    }
    ++removed;
    bytes += size.is_ok() ? size.value() : 0;
  }
  if (removed > 0)
    STRATA_LOG_INFO("swap store: removed {} stale swap file{} ({:.1f} MiB) left in {} by processes that died{}",
                    removed, removed == 1 ? "" : "s", mib(bytes), dir,
                    live > 0 ? fmt::format("; {} in use by live processes left alone", live) : "");
  return Status::ok();
}

}  // namespace

// ---- internals -------------------------------------------------------------------------------------------------

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

  uint64_t chunk_seed(size_t i) const { return seed + kGoldenRatio * (i + 1); }
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
  Status verify(size_t i, const Chunk& c, const char* data) const {
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

// ---- open and shutdown -----------------------------------------------------------------------------------------

SwapStore::SwapStore(IoQueue& queue, const SwapStoreOptions& options)
    : queue_(queue),
      engine_(queue.engine()),
      options_(options),
      max_extent_(options.file_bytes - kSwapBlock),
      body_bounces_(std::make_unique<SwapBouncePool>(
          options.checksum_chunk, std::clamp<uint64_t>(kBodyBounceBudget / options.checksum_chunk, 2, 8),
          "swap.bounce")),
      tail_bounces_(std::make_unique<SwapBouncePool>(kSwapBlock, kTailBounces, "swap.tail")) {}

Result<std::unique_ptr<SwapStore>> SwapStore::open(IoQueue& queue, const SwapStoreOptions& options) {
  SwapStoreOptions o = options;
  while (o.dir.size() > 1 && o.dir.back() == '/') o.dir.pop_back();
  if (o.dir.empty()) return Status::invalid_argument("swap store: no directory given (options.dir is empty)");
  if (o.rank < 0) return Status::invalid_argument("swap store in {}: rank must be >= 0, got {}", o.dir, o.rank);
  if (o.max_files == 0) return Status::invalid_argument("swap store in {}: max_files must be at least 1", o.dir);
  if (o.checksum_chunk == 0 || o.checksum_chunk % kSwapBlock != 0 || o.checksum_chunk > (uint64_t{1} << 30))
    return Status::invalid_argument("swap store in {}: checksum_chunk must be a multiple of 4096 up to 1 GiB, got {}",
                                    o.dir, o.checksum_chunk);
  o.file_bytes = round_up(o.file_bytes, kSwapBlock);
  if (o.file_bytes < 2 * kSwapBlock)
    return Status::invalid_argument("swap store in {}: file_bytes must be at least 8192 (a 4 KiB header and one "
                                    "block), got {}", o.dir, options.file_bytes);
  STRATA_RETURN_IF_ERROR(queue.engine().create_dirs(o.dir));
  STRATA_RETURN_IF_ERROR(remove_stale_files(queue.engine(), o.dir));
  std::unique_ptr<SwapStore> store(new SwapStore(queue, o));
  std::lock_guard<std::mutex> grow(store->grow_mu_);
  STRATA_RETURN_IF_ERROR(store->add_file());
  return store;
}

SwapStore::~SwapStore() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return ops_in_flight_ == 0; });
  }
  for (const auto& f : files_) {
    // Removed while still locked, so no other process's start-up can take it for a stale file meanwhile.
    if (Status st = engine_.remove(f->path); !st.is_ok()) STRATA_LOG_WARN("swap store: {}", st.message());
    if (Status st = engine_.close(f->id); !st.is_ok()) STRATA_LOG_WARN("swap store: {}", st.message());
  }
}

Status SwapStore::add_file() {
  const auto index = static_cast<uint32_t>(files_.size());  // grows only under grow_mu_, which we hold
  const auto pid = static_cast<uint32_t>(::getpid());
  const std::string path =
      fmt::format("{}/{}r{}-p{}-{}{}", options_.dir, kSwapFilePrefix, options_.rank, pid, index, kSwapFileSuffix);
  // Not truncated at open: a live store's file of the same name (two stores of one rank sharing a directory)
  // must be refused by the lock below, not emptied first.
  STRATA_ASSIGN_OR_RETURN(const int id,
                          engine_.open(path, OpenOptions{.create = true, .truncate = false, .direct = options_.direct}));
  auto give_up = [&](Status st, bool remove) {
    if (remove) (void)engine_.remove(path);
    (void)engine_.close(id);
    return st;
  };
  Result<bool> locked = engine_.try_lock(id);
  if (!locked.is_ok()) return give_up(locked.status(), false);
  if (!*locked)
    return give_up(Status::invalid_argument("swap store: {} is locked by another live swap store (two stores of rank "
                                            "{} in one directory?); give each store its own rank or directory",
                                            path, options_.rank),
                   false);
  if (Status st = engine_.allocate(id, options_.file_bytes); !st.is_ok()) {
    std::string kept;
    if (index > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      kept = fmt::format("; the {} keys already stored stay readable", keys_locked());
    }
    return give_up(Status(st.code(), fmt::format("swap store in {}: cannot add swap file {} ({} of at most {}) of {} "
                                                 "bytes ({:.1f} MiB): {}{}", options_.dir, path, index + 1,
                                                 options_.max_files, options_.file_bytes, mib(options_.file_bytes),
                                                 st.message(), kept)),
                   true);
  }
  Result<AlignedBuffer> block = AlignedBuffer::allocate(kSwapBlock, "swap.header", kSwapBlock);
  if (!block.is_ok()) return give_up(block.status(), true);
  SwapFileHeader h{};
  std::memcpy(h.magic, kSwapMagic, sizeof(kSwapMagic));
  h.version = kSwapVersion;
  h.header_bytes = h.extent_alignment = static_cast<uint32_t>(kSwapBlock);
  h.rank = static_cast<uint32_t>(options_.rank);
  h.pid = pid;
  h.file_index = index;
  h.file_bytes = options_.file_bytes;
  h.created_unix_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  h.checksum_chunk = options_.checksum_chunk;
  (void)::gethostname(h.host, sizeof(h.host) - 1);
  std::memcpy(block->data(), &h, sizeof(h));
  const uint64_t sum = xxh3_64(block->data(), kSwapBlock - 8);
  std::memcpy(block->as<char>() + kSwapBlock - 8, &sum, 8);
  if (Status st = queue_.write(id, 0, block->data(), kSwapBlock); !st.is_ok())
    return give_up(st.with_context(fmt::format("swap store: writing the header of {}", path)), true);

  auto f = std::make_unique<File>();
  f->id = id;
  f->path = path;
  f->alignment = engine_.alignment(id);
  STRATA_ASSERT(f->alignment > 0 && kSwapBlock % f->alignment == 0);
  f->insert_free(kSwapBlock, options_.file_bytes - kSwapBlock);
  std::lock_guard<std::mutex> lock(mu_);
  files_.push_back(std::move(f));
  return Status::ok();
}

// ---- allocator -------------------------------------------------------------------------------------------------

bool SwapStore::fit_locked(uint64_t bytes, Extent* out) {
  File* best = nullptr;
  std::set<std::pair<uint64_t, uint64_t>>::iterator best_it;
  for (const auto& f : files_) {
    auto it = f->free_by_length.lower_bound({bytes, 0});
    if (it != f->free_by_length.end() && (best == nullptr || it->first < best_it->first)) {
      best = f.get();
      best_it = it;
    }
  }
  if (best == nullptr) return false;
  const auto [len, offset] = *best_it;
  best->erase_free(best->free_by_offset.find(offset));
  if (len > bytes) best->insert_free(offset + bytes, len - bytes);
  *out = Extent{best, offset, bytes};
  ++extents_;
  return true;
}

void SwapStore::release_locked(const Extent& e) {
  if (e.file == nullptr) return;
  File& f = *e.file;
  uint64_t offset = e.offset, len = e.bytes;
  auto next = f.free_by_offset.lower_bound(offset);
  STRATA_ASSERT_MSG(next == f.free_by_offset.end() || next->first >= offset + len, "swap extent freed twice");
  if (next != f.free_by_offset.end() && next->first == offset + len) {
    len += next->second;
    f.erase_free(next++);
  }
  if (next != f.free_by_offset.begin()) {
    auto prev = std::prev(next);
    STRATA_ASSERT_MSG(prev->first + prev->second <= offset, "swap extent freed twice");
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      len += prev->second;
      f.erase_free(prev);
    }
  }
  f.insert_free(offset, len);
  --extents_;
}

Result<SwapStore::Extent> SwapStore::allocate(const std::string& key, uint64_t bytes) {
  Extent e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fit_locked(bytes, &e)) return e;
  }
  // Adding a file is I/O (fallocate, the header): done under grow_mu_ only, so reads, writes and frees go on.
  std::lock_guard<std::mutex> grow(grow_mu_);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fit_locked(bytes, &e)) return e;  // another thread freed space or added a file meanwhile
      if (files_.size() >= options_.max_files) {
        const SwapStoreStats s = stats_locked();
        return Status::out_of_memory(
            "swap store in {} is full: key '{}' needs {} bytes and all {} files of {} bytes are in use ({} bytes free "
            "in {} ranges, the largest {} bytes); free keys, or raise max_files or file_bytes",
            options_.dir, key, bytes, s.files, options_.file_bytes, s.free_bytes, s.free_extents,
            s.largest_free_extent);
      }
    }
    STRATA_RETURN_IF_ERROR(add_file());
  }
}

void SwapStore::retire_locked(const std::shared_ptr<Version>& v) {
  v->retired = true;
  logical_bytes_ -= v->len;
  if (v->readers == 0) release_locked(v->extent);
}

// ---- writes ----------------------------------------------------------------------------------------------------

Result<std::shared_ptr<SwapStore::WriteOp>> SwapStore::begin_write(const std::string& key, size_t len) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = index_[key];
    if (e.writing)
      return Status::invalid_argument(
          "swap store: write of key '{}' while an earlier write of it is in flight; wait for that batch first", key);
    e.writing = true;
    ++ops_in_flight_;
  }
  Result<Extent> extent = len > 0 ? allocate(key, round_up(len, kSwapBlock)) : Extent{};
  std::lock_guard<std::mutex> lock(mu_);
  if (!extent.is_ok()) {
    auto it = index_.find(key);
    it->second.writing = false;
    if (!it->second.current) index_.erase(it);
    if (--ops_in_flight_ == 0) idle_cv_.notify_all();
    return extent.status();
  }
  auto op = std::make_shared<WriteOp>();
  op->store = this;
  op->version = std::make_shared<Version>();
  Version& v = *op->version;
  v.key = key;
  v.len = len;
  v.extent = extent.value();
  v.generation = next_generation_++;
  v.seed = xxh3_64(key.data(), key.size(), v.generation);
  return op;
}

void SwapStore::finish_write(WriteOp& op) {
  const bool ok = op.queued_all && op.written.load(std::memory_order_relaxed) == op.version->sums.size();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(op.version->key);
  STRATA_ASSERT(it != index_.end() && it->second.writing);
  Entry& e = it->second;
  e.writing = false;
  if (ok) {
    if (e.current) retire_locked(e.current);
    e.current = op.version;
    logical_bytes_ += op.version->len;
  } else {
    release_locked(op.version->extent);  // the previous version, if any, stays current
    if (!e.current) index_.erase(it);
  }
  if (--ops_in_flight_ == 0) idle_cv_.notify_all();  // under the lock: the destructor may be waiting
}

// Which chunks of a transfer between `file` and `buf` can use the caller's memory, and bounces for the rest.
Result<std::pair<bool, bool>> SwapStore::route(const File& file, const void* buf, uint64_t len) {
  const Chunking chunks(len, options_.checksum_chunk);
  const bool direct_body = reinterpret_cast<uintptr_t>(buf) % file.alignment == 0;
  const bool direct_tail = file.alignment == 1;  // else the tail goes padded to a whole block, in a bounce
  if (!direct_body && chunks.has_body()) STRATA_RETURN_IF_ERROR(body_bounces_->ensure());
  if (!direct_tail && chunks.has_tail()) STRATA_RETURN_IF_ERROR(tail_bounces_->ensure());
  return std::pair{direct_body, direct_tail};
}

Status SwapStore::write(const std::string& key, const void* buf, size_t len, IoBatch* batch) {
  STRATA_ASSERT(batch != nullptr);
  if (len > 0 && buf == nullptr)
    return Status::invalid_argument("swap store: write of key '{}' ({} bytes) from a null buffer", key, len);
  if (len > max_extent_)
    return Status::invalid_argument("swap store: key '{}' has {} bytes, more than a swap file holds ({} bytes); raise "
                                    "file_bytes", key, len, max_extent_);
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<WriteOp> op, begin_write(key, len));
  Version& v = *op->version;
  const Chunking chunks(len, options_.checksum_chunk);
  v.sums.resize(chunks.count());
  if (len > 0) {
    // On an error here nothing is queued yet: dropping `op` rolls the write back.
    STRATA_ASSIGN_OR_RETURN(const auto direct, route(*v.extent.file, buf, len));
    struct State {
      std::shared_ptr<WriteOp> op;  // first, so it is released last: the bounce goes back while the store lives
      SwapBouncePool::Lease bounce;
    };
    for (size_t i = 0; i < chunks.count(); ++i) {
      const Chunk c = chunks[i];
      const char* src = static_cast<const char*>(buf) + c.offset;
      auto state = std::make_shared<State>();
      state->op = op;
      IoRequest r;
      r.op = IoOp::kWrite;
      r.file = v.extent.file->id;
      r.offset = v.extent.offset + c.offset;
      if (c.tail ? direct.second : direct.first) {
        r.buf = const_cast<char*>(src);
        r.len = c.len;
      } else {
        state->bounce = (c.tail ? tail_bounces_ : body_bounces_)->lend();
        char* b = state->bounce.get();
        std::memcpy(b, src, c.len);
        r.len = round_up(c.len, kSwapBlock);
        std::memset(b + c.len, 0, r.len - c.len);  // the padding is zeros, not another key's bytes
        r.buf = b;
      }
      // Hashed once the chunk is written, on the engine's thread: its bytes stay put until the batch completes
      // (the caller's, or the bounce this request holds), so the caller only queues, and a key's chunks are
      // hashed while its later chunks are still moving. Each chunk has its own entry of `sums`, and the version
      // is committed only after every on_complete has run (the last reference to `op` goes with them).
      r.on_complete = [state = std::move(state), i, bytes = static_cast<const char*>(r.buf), len = c.len,
                       seed = v.chunk_seed(i)] {
        state->op->version->sums[i] = xxh3_64(bytes, len, seed);
        state->op->written.fetch_add(1, std::memory_order_relaxed);
        return Status::ok();
      };
      queue_.submit(std::move(r), batch);
    }
  }
  op->queued_all = true;
  return Status::ok();  // an empty key commits as `op` goes here
}

Status SwapStore::write(const std::string& key, const void* buf, size_t len) {
  IoBatch batch;
  STRATA_RETURN_IF_ERROR(write(key, buf, len, &batch));
  return name_key(batch.wait(), "writing", key);
}

// ---- reads -----------------------------------------------------------------------------------------------------

void SwapStore::finish_read(const std::shared_ptr<Version>& v) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_ASSERT(v->readers > 0);
  if (--v->readers == 0 && v->retired) release_locked(v->extent);
  if (--ops_in_flight_ == 0) idle_cv_.notify_all();
}

Status SwapStore::read(const std::string& key, void* buf, size_t len, IoBatch* batch) {
  STRATA_ASSERT(batch != nullptr);
  auto op = std::make_shared<ReadOp>();
  op->store = this;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end() && it->second.writing)
      return Status::invalid_argument(
          "swap store: read of key '{}' while a write of it is in flight; wait for that batch first", key);
    if (it == index_.end()) return Status::not_found("swap store in {}: no key '{}'", options_.dir, key);
    Version& v = *it->second.current;
    if (v.len != len)
      return Status::invalid_argument("swap store: key '{}' holds {} bytes; asked to read {}", key, v.len, len);
    if (len > 0 && buf == nullptr)
      return Status::invalid_argument("swap store: read of key '{}' ({} bytes) into a null buffer", key, len);
    ++v.readers;
    ++ops_in_flight_;
    op->version = it->second.current;
  }
  if (len == 0) return Status::ok();
  const Version& v = *op->version;
  STRATA_ASSIGN_OR_RETURN(const auto direct, route(*v.extent.file, buf, len));
  const Chunking chunks(len, options_.checksum_chunk);
  struct State {
    std::shared_ptr<ReadOp> op;  // first, so it is released last
    SwapBouncePool::Lease bounce;
    size_t index = 0;
    Chunk chunk;
    char* dst = nullptr;
  };
  for (size_t i = 0; i < chunks.count(); ++i) {
    const Chunk c = chunks[i];
    auto state = std::make_shared<State>();
    state->op = op;
    state->index = i;
    state->chunk = c;
    state->dst = static_cast<char*>(buf) + c.offset;
    IoRequest r;
    r.op = IoOp::kRead;
    r.file = v.extent.file->id;
    r.offset = v.extent.offset + c.offset;
    if (c.tail ? direct.second : direct.first) {
      r.buf = state->dst;
      r.len = c.len;
      r.on_complete = [state = std::move(state)] { return state->op->verify(state->index, state->chunk, state->dst); };
    } else {
      state->bounce = (c.tail ? tail_bounces_ : body_bounces_)->lend();
      r.buf = state->bounce.get();
      r.len = round_up(c.len, kSwapBlock);
      r.on_complete = [state = std::move(state)] {
        Status st = state->op->verify(state->index, state->chunk, state->bounce.get());
        if (st.is_ok()) std::memcpy(state->dst, state->bounce.get(), state->chunk.len);
        return st;
      };
    }
    queue_.submit(std::move(r), batch);
  }
  return Status::ok();
}

Status SwapStore::read(const std::string& key, void* buf, size_t len) {
  IoBatch batch;
  STRATA_RETURN_IF_ERROR(read(key, buf, len, &batch));
  return name_key(batch.wait(), "reading", key);
}

// ---- the rest --------------------------------------------------------------------------------------------------

Status SwapStore::free(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it != index_.end() && it->second.writing)
    return Status::invalid_argument("swap store: free of key '{}' while a write of it is in flight", key);
  if (it == index_.end() || !it->second.current)
    return Status::not_found("swap store in {}: no key '{}' to free", options_.dir, key);
  retire_locked(it->second.current);  // the extent returns now, or when the last read of it finishes
  index_.erase(it);
  return Status::ok();
}

const std::shared_ptr<SwapStore::Version>* SwapStore::find_locked(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() || !it->second.current ? nullptr : &it->second.current;
}

bool SwapStore::contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find_locked(key) != nullptr;
}

Result<size_t> SwapStore::length(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto* v = find_locked(key);
  if (v == nullptr) return Status::not_found("swap store in {}: no key '{}'", options_.dir, key);
  return static_cast<size_t>((*v)->len);
}

Result<SwapExtent> SwapStore::locate(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto* v = find_locked(key);
  if (v == nullptr) return Status::not_found("swap store in {}: no key '{}'", options_.dir, key);
  const Extent& e = (*v)->extent;
  return SwapExtent{e.file ? e.file->path : std::string(), e.offset, (*v)->len, e.bytes, (*v)->generation};
}

uint64_t SwapStore::keys_locked() const {
  uint64_t keys = 0;
  for (const auto& [key, e] : index_) keys += e.current != nullptr;
  return keys;
}

SwapStoreStats SwapStore::stats_locked() const {
  SwapStoreStats s;
  s.capacity_bytes = uint64_t{options_.max_files} * max_extent_;
  s.files = static_cast<uint32_t>(files_.size());
  s.reserved_bytes = s.files * options_.file_bytes;
  for (const auto& f : files_) {
    s.free_bytes += f->free_bytes;
    s.free_extents += f->free_by_offset.size();
    if (!f->free_by_length.empty())
      s.largest_free_extent = std::max(s.largest_free_extent, f->free_by_length.rbegin()->first);
  }
  s.used_bytes = s.files * max_extent_ - s.free_bytes;
  s.logical_bytes = logical_bytes_;
  s.extents = extents_;
  s.keys = keys_locked();
  s.checksum_failures = checksum_failures_.load(std::memory_order_relaxed);
  return s;
}

SwapStoreStats SwapStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_locked();
}

std::vector<std::string> SwapStore::file_paths() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> paths;
  for (const auto& f : files_) paths.push_back(f->path);
  return paths;
}

}  // namespace strata
