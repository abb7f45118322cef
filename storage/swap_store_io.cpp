// SwapStore's writes and reads (swap_store.h): chunked, checksummed, through the caller's memory where it is
// aligned and through bounce buffers where not. Files, extents and the index are in swap_store.cpp.
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/log.h"
#include "common/trace.h"
#include "storage/checksum.h"
#include "storage/swap_store.h"
#include "storage/swap_store_parts.h"

namespace strata {
namespace {

using swap_parts::Chunk;
using swap_parts::Chunking;
using swap_parts::round_up;

// IoQueue's I/O errors name file and offset; the synchronous calls add the key (Corruption names it already).
Status name_key(Status st, const char* verb, const std::string& key) {
  if (st.code() != StatusCode::kIOError) return st;
  return st.with_context(fmt::format("swap store: {} key '{}'", verb, key));
}

}  // namespace

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

}  // namespace strata
