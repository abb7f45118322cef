#include "storage/memory_engine.h"

#include <cerrno>
#include <cstring>

#include "common/check.h"

namespace strata {

namespace {
std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}
}  // namespace

Result<int> MemoryEngine::open(const std::string& path, const OpenOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it == files_.end()) {
    if (!options.create) return Status::io_error("open {}: {}", path, "No such file or directory (ENOENT)");
    if (!dirs_.count(parent_dir(path)))
      return Status::io_error("open {}: directory {} does not exist (ENOENT)", path, parent_dir(path));
    it = files_.emplace(path, std::make_shared<Data>()).first;
  } else if (options.truncate) {
    used_ -= it->second->bytes.size();
    it->second->bytes.clear();
  }
  const int id = next_id_++;
  open_[id] = Handle{path, it->second, options.direct, false};
  return id;
}

Status MemoryEngine::close(int file) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(file);
  // Unknown only after crash() dropped the handle under its owner, whose clean-up then closes it: EBADF.
  if (it == open_.end()) return Status::io_error("closing file handle {}: Bad file descriptor (EBADF)", file);
  if (it->second.holds_lock) it->second.data->locked = false;
  const std::shared_ptr<Data> data = std::move(it->second.data);
  open_.erase(it);
  if (data.use_count() == 1) used_ -= data->bytes.size();  // removed, and this was its last handle
  return Status::ok();
}

const std::string& MemoryEngine::path(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(file);
  STRATA_ASSERT(it != open_.end());
  return it->second.path;  // std::map nodes are stable until close
}

bool MemoryEngine::direct(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(file);
  STRATA_ASSERT(it != open_.end());
  return it->second.direct;
}

size_t MemoryEngine::alignment(int file) const { return direct(file) ? options_.direct_alignment : 1; }

Status MemoryEngine::grow(Data& d, uint64_t bytes) {
  if (bytes <= d.bytes.size()) return Status::ok();
  const uint64_t more = bytes - d.bytes.size();
  if (used_ + more > options_.capacity_bytes) return Status(StatusCode::kIOError, "No space left on device (ENOSPC)");
  d.bytes.resize(bytes, 0);
  used_ += more;
  return Status::ok();
}

Status MemoryEngine::allocate(int file, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Handle& h = open_.at(file);
  Status st = grow(*h.data, bytes);
  if (!st.is_ok()) return Status::io_error("reserving {} bytes for {}: {}", bytes, h.path, st.message());
  return Status::ok();
}

Result<uint64_t> MemoryEngine::size(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<uint64_t>(open_.at(file).data->bytes.size());
}

Result<bool> MemoryEngine::try_lock(int file) {
  std::lock_guard<std::mutex> lock(mu_);
  Handle& h = open_.at(file);
  if (h.holds_lock) return true;
  if (h.data->locked) return false;
  h.data->locked = h.holds_lock = true;
  return true;
}

Status MemoryEngine::create_dirs(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::string d = dir; !d.empty() && d != "." && d != "/"; d = parent_dir(d)) {
    dirs_.insert(d);
    if (d.find('/') == std::string::npos) break;
  }
  return Status::ok();
}

Status MemoryEngine::remove(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return Status::io_error("removing {}: No such file or directory (ENOENT)", path);
  // Like unlink: open handles keep the bytes; the space is returned when the last one goes.
  if (it->second.use_count() == 1) used_ -= it->second->bytes.size();  // else its last close returns it
  files_.erase(it);
  return Status::ok();
}

Result<std::vector<std::string>> MemoryEngine::list(const std::string& dir) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!dirs_.count(dir)) return Status::not_found("directory {} does not exist", dir);
  std::vector<std::string> names;
  for (const auto& [path, data] : files_)
    if (parent_dir(path) == dir) names.push_back(path.substr(dir.size() + 1));
  return names;
}

int64_t MemoryEngine::transfer(RawIo* io) {
  if (shut_down_) return -ECANCELED;
  Handle& h = open_.at(io->file);
  Data& d = *h.data;
  if (io->op == IoOp::kRead) {
    if (io->offset >= d.bytes.size()) return 0;
    const uint64_t n = std::min<uint64_t>(io->len, d.bytes.size() - io->offset);
    std::memcpy(io->buf, d.bytes.data() + io->offset, n);
    return static_cast<int64_t>(n);
  }
  if (!grow(d, io->offset + io->len).is_ok()) return -ENOSPC;
  std::memcpy(d.bytes.data() + io->offset, io->buf, io->len);
  return io->len;
}

void MemoryEngine::submit(RawIo* const* ios, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    RawIo* io = ios[i];
    int64_t res;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t a = alignment_locked(io->file);
      const bool aligned = io->offset % a == 0 && io->len % a == 0 && reinterpret_cast<uintptr_t>(io->buf) % a == 0;
      res = aligned ? transfer(io) : -EINVAL;  // what O_DIRECT says to unaligned transfers
    }
    io->done(io, res);  // outside the lock: done may submit again
  }
}

size_t MemoryEngine::alignment_locked(int file) const {
  return open_.at(file).direct ? options_.direct_alignment : 1;
}

void MemoryEngine::shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shut_down_ = true;
}

uint64_t MemoryEngine::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

void MemoryEngine::crash() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, h] : open_)
    if (h.holds_lock) h.data->locked = false;
  open_.clear();
}

}  // namespace strata
