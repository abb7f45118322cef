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
#include "storage/swap_store_parts.h"

namespace strata {

static_assert(std::endian::native == std::endian::little, "the swap file header is written in native byte order");

namespace {

using swap_parts::round_up;

constexpr size_t kTailBounces = 64;                         // 4 KiB blocks for the padded tails of keys
constexpr uint64_t kBodyBounceBudget = uint64_t{16} << 20;  // chunk-sized bounces for unaligned callers

double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

bool is_swap_file_name(const std::string& name) {
  const std::string_view n(name), prefix(kSwapFilePrefix), suffix(kSwapFileSuffix);
  return n.size() > prefix.size() + suffix.size() && n.starts_with(prefix) && n.ends_with(suffix);
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
