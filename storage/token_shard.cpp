#include "storage/token_shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "common/check.h"

namespace strata {
namespace {

// Closes a file descriptor on scope exit (errors on close of a read-only fd carry no information).
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly `n` bytes at `offset`, retrying short reads and EINTR.
Status pread_all(int fd, void* buf, size_t n, off_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, p + done, n - done, offset + static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::io_error("{}: read of {} bytes at offset {} failed: {}", path, n, offset, std::strerror(errno));
    if (r == 0)
      return Status::corruption("{}: file ended at offset {} while reading {} bytes at offset {}", path,
                                offset + static_cast<off_t>(done), n, offset);
    done += static_cast<size_t>(r);
  }
  return Status::ok();
}

Status write_all(int fd, const std::byte* p, size_t n, const std::string& path, size_t already) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::write(fd, p + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      return Status::io_error("{}: write failed at offset {}: {}", path, already + done, std::strerror(errno));
    if (r == 0) return Status::io_error("{}: write of {} bytes at offset {} wrote nothing", path, n - done,
                                        already + done);
    done += static_cast<size_t>(r);
  }
  return Status::ok();
}

// Writes exactly `n` bytes at `offset`, over bytes written before; retries short writes and EINTR.
Status pwrite_all(int fd, const std::byte* p, size_t n, size_t offset, const std::string& path) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pwrite(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return Status::io_error("{}: rewrite at offset {} failed: {}", path, offset + done,
                              r < 0 ? std::strerror(errno) : "nothing written");
    done += static_cast<size_t>(r);
  }
  return Status::ok();
}

}  // namespace

Status fsync_parent_dir(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::io_error("{}: cannot open directory to fsync: {}", dir.string(), std::strerror(errno));
  FdCloser closer{fd};
  if (::fsync(fd) != 0) return Status::io_error("{}: fsync of directory failed: {}", dir.string(), std::strerror(errno));
  return Status::ok();
}

Status write_file_atomic(const std::string& path, std::span<const std::span<const std::byte>> parts) {
  return write_file_atomic(path, [&](const AppendFn& append) -> Status {
    for (std::span<const std::byte> part : parts) STRATA_RETURN_IF_ERROR(append(part));
    return Status::ok();
  });
}

Status write_file_atomic(const std::string& path, const std::function<Status(const AppendFn&)>& produce) {
  return write_file_atomic(path, [&](const AppendFn& append, const OverwriteFn&) { return produce(append); });
}

Status write_file_atomic(const std::string& path,
                         const std::function<Status(const AppendFn&, const OverwriteFn&)>& produce) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::io_error("{}: cannot create: {}", tmp, std::strerror(errno));
  auto fail = [&](Status st) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return st;
  };
  size_t written = 0;
  auto append = [&](std::span<const std::byte> part) -> Status {
    STRATA_RETURN_IF_ERROR(write_all(fd, part.data(), part.size(), tmp, written));
    written += part.size();
    return Status::ok();
  };
  auto overwrite = [&](size_t offset, std::span<const std::byte> part) -> Status {
    if (offset > written || part.size() > written - offset)
      return Status::invalid_argument("{}: rewriting bytes [{}, {}) of the {} written", tmp, offset,
                                      offset + part.size(), written);
    return pwrite_all(fd, part.data(), part.size(), offset, tmp);
  };
  Status produced = produce(append, overwrite);
  if (!produced.is_ok()) return fail(produced);
  if (::fsync(fd) != 0) return fail(Status::io_error("{}: fsync failed: {}", tmp, std::strerror(errno)));
  // close() can report a deferred write error (NFS, quota): it must be checked before the rename.
  const int rc = ::close(fd);
  fd = -1;
  if (rc != 0) return fail(Status::io_error("{}: close failed: {}", tmp, std::strerror(errno)));
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    return fail(Status::io_error("cannot rename {} to {}: {}", tmp, path, std::strerror(errno)));
  return fsync_parent_dir(path);
}

Status write_text_atomic(const std::string& path, std::string_view text) {
  const std::span<const std::byte> part = std::as_bytes(std::span<const char>(text));
  return write_file_atomic(path, std::span<const std::span<const std::byte>>(&part, 1));
}

Result<std::string> read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::not_found("{}: cannot open input: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::io_error("{}: read failed", path);
  return ss.str();
}

namespace {

template <typename Token>
Status write_shard(const std::string& path, const Token* tokens, size_t n, int32_t magic, int32_t version) {
  if (n > static_cast<size_t>(INT32_MAX))
    return Status::invalid_argument("{}: {} tokens do not fit a shard's int32 count (at most {})", path, n, INT32_MAX);
  int32_t header[kTokenShardHeaderInts] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(n);
  const std::span<const std::byte> parts[] = {
      std::as_bytes(std::span<const int32_t>(header)),
      std::as_bytes(std::span<const Token>(tokens, n)),
  };
  return write_file_atomic(path, parts);
}

// The first token at or above vocab_size, as a Corruption naming it; OK when there is none. A branch-free max
// (vectorised) first; the index is only searched for on failure.
template <typename Token>
Status check_tokens(const std::string& path, const std::vector<Token>& tokens, int vocab_size) {
  if (static_cast<uint64_t>(vocab_size) > std::numeric_limits<Token>::max()) return Status::ok();
  const auto limit = static_cast<Token>(vocab_size);
  Token max_token = 0;
  for (Token t : tokens) max_token = t > max_token ? t : max_token;
  for (size_t i = 0; max_token >= limit && i < tokens.size(); ++i) {
    if (tokens[i] >= limit)
      return Status::corruption("{}: token {} (file offset {}) is {}, not below the vocabulary size {}", path, i,
                                kTokenShardHeaderBytes + sizeof(Token) * i, tokens[i], vocab_size);
  }
  return Status::ok();
}

}  // namespace

Status write_token_shard(const std::string& path, const uint16_t* tokens, size_t n) {
  return write_shard(path, tokens, n, kTokenShardMagic, kTokenShardVersion);
}

Status write_token_shard(const std::string& path, const uint32_t* tokens, size_t n) {
  return write_shard(path, tokens, n, kTokenShardMagic32, kTokenShardVersion32);
}

Status write_token_shard(const std::string& path, std::span<const uint32_t> tokens, int vocab_size) {
  if (vocab_size <= 0) return Status::invalid_argument("{}: vocab_size must be positive, got {}", path, vocab_size);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= static_cast<uint32_t>(vocab_size))
      return Status::invalid_argument("{}: token {} is {}, not below the vocabulary size {}", path, i, tokens[i],
                                      vocab_size);
  if (vocab_size > kTokenShardMaxVocab16) return write_token_shard(path, tokens.data(), tokens.size());
  const std::vector<uint16_t> narrow(tokens.begin(), tokens.end());  // each below 65536: checked above
  return write_token_shard(path, narrow.data(), narrow.size());
}

Result<TokenShard> TokenShard::open(const std::string& path, int vocab_size) {
  if (vocab_size <= 0) return Status::invalid_argument("{}: vocab_size must be positive, got {}", path, vocab_size);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::not_found("{}: no such token shard", path);
    return Status::io_error("{}: cannot open token shard: {}", path, std::strerror(errno));
  }
  FdCloser closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0) return Status::io_error("{}: fstat failed: {}", path, std::strerror(errno));
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < kTokenShardHeaderBytes)
    return Status::corruption("{}: file is {} bytes, shorter than the {}-byte token shard header", path, file_size,
                              kTokenShardHeaderBytes);

  int32_t header[kTokenShardHeaderInts];
  STRATA_RETURN_IF_ERROR(pread_all(fd, header, sizeof(header), 0, path));
  size_t width = 0;  // bytes a token
  if (header[0] == kTokenShardMagic) {
    if (header[1] != kTokenShardVersion)
      return Status::corruption("{}: unsupported version {} at offset 4 (want {} after magic {})", path, header[1],
                                kTokenShardVersion, kTokenShardMagic);
    width = 2;
  } else if (header[0] == kTokenShardMagic32) {
    if (header[1] != kTokenShardVersion32)
      return Status::corruption("{}: unsupported version {} at offset 4 (want {} after magic {})", path, header[1],
                                kTokenShardVersion32, kTokenShardMagic32);
    width = 4;
  } else {
    return Status::corruption("{}: bad magic {} at offset 0 (want {}, or {} for 32-bit tokens): not an llm.c token "
                              "shard",
                              path, header[0], kTokenShardMagic, kTokenShardMagic32);
  }
  if (header[2] < 0) return Status::corruption("{}: negative token count {} at offset 8", path, header[2]);
  const auto count = static_cast<uint64_t>(header[2]);
  const uint64_t want_size = kTokenShardHeaderBytes + width * count;
  if (file_size != want_size)
    return Status::corruption(
        "{}: header says {} tokens, so the file should be {} bytes (1024 + {}*{}), but it is {} bytes", path, count,
        want_size, width, count, file_size);

  TokenShard shard;
  shard.path_ = path;
  if (width == 2) {
    shard.tokens16_.resize(count);
    STRATA_RETURN_IF_ERROR(pread_all(fd, shard.tokens16_.data(), 2 * count, kTokenShardHeaderBytes, path));
    STRATA_RETURN_IF_ERROR(check_tokens(path, shard.tokens16_, vocab_size));
  } else {
    shard.wide_ = true;
    shard.tokens32_.resize(count);
    STRATA_RETURN_IF_ERROR(pread_all(fd, shard.tokens32_.data(), 4 * count, kTokenShardHeaderBytes, path));
    STRATA_RETURN_IF_ERROR(check_tokens(path, shard.tokens32_, vocab_size));
  }
  return shard;
}

void TokenShard::copy(size_t offset, size_t n, int32_t* out) const {
  STRATA_ASSERT(offset + n <= size());
  if (wide_) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(tokens32_[offset + i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = tokens16_[offset + i];
  }
}

}  // namespace strata
