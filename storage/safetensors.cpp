#include "storage/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/json_parse.h"
#include "storage/checksum.h"
#include "storage/token_shard.h"  // write_file_atomic

namespace strata {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr const char* kMetadataKey = "__metadata__";
constexpr size_t kMaxChecksumChunk = size_t{1} << 30;

size_t chunks_of(size_t bytes, size_t chunk) { return bytes / chunk + (bytes % chunk != 0); }

// The checksum metadata's value: "v1 chunk=<bytes> header=<hex> data=<hex>,<hex>,...", every hash 16 digits.
std::string checksum_value(uint64_t header_hash, std::span<const uint64_t> data) {
  std::string s = fmt::format("v1 chunk={} header={:016x} data=", kSafetensorsChecksumChunk, header_hash);
  s.reserve(s.size() + 17 * data.size());
  for (size_t i = 0; i < data.size(); ++i) fmt::format_to(std::back_inserter(s), "{}{:016x}", i ? "," : "", data[i]);
  return s;
}

// The header's own hash: every header byte but the checksum value's (which holds it).
uint64_t header_hash(std::string_view header, size_t value_at, size_t value_len) {
  Xxh3Stream h;
  h.update(header.data(), value_at);
  h.update(header.data() + value_at + value_len, header.size() - value_at - value_len);
  return h.digest();
}

// A tensor's bytes, as they are written, hashed a chunk at a time from its start.
class ChunkHasher {
 public:
  explicit ChunkHasher(std::vector<uint64_t>* out) : out_(out) {}
  void add(std::span<const std::byte> b) {
    while (!b.empty()) {
      const size_t take = std::min(b.size(), kSafetensorsChecksumChunk - in_chunk_);
      if (in_chunk_ == 0 && take == kSafetensorsChecksumChunk) {
        out_->push_back(xxh3_64(b.data(), take));  // a whole chunk in one piece: the fast path
      } else {
        stream_.update(b.data(), take);
        in_chunk_ += take;
        if (in_chunk_ == kSafetensorsChecksumChunk) flush();
      }
      b = b.subspan(take);
    }
  }
  void end_tensor() {
    if (in_chunk_ > 0) flush();
  }

 private:
  void flush() {
    out_->push_back(stream_.digest());
    stream_.reset();
    in_chunk_ = 0;
  }
  std::vector<uint64_t>* out_;
  Xxh3Stream stream_;
  size_t in_chunk_ = 0;
};

// Parses "v1 chunk=N header=H data=h,h,..." into its parts; false if it is not exactly that.
bool parse_checksum_value(std::string_view v, size_t* chunk, uint64_t* header, std::vector<uint64_t>* data) {
  auto take = [&](std::string_view prefix) {
    if (!v.starts_with(prefix)) return false;
    v.remove_prefix(prefix.size());
    return true;
  };
  auto number = [&](auto* out, int base) {
    const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), *out, base);
    if (ec != std::errc() || p == v.data()) return false;
    v.remove_prefix(static_cast<size_t>(p - v.data()));
    return true;
  };
  auto hash = [&](uint64_t* out) {
    if (v.size() < 16 || v.substr(0, 16).find_first_not_of("0123456789abcdef") != std::string_view::npos) return false;
    const std::string_view digits = v.substr(0, 16);
    return std::from_chars(digits.data(), digits.data() + 16, *out, 16).ec == std::errc() && (v.remove_prefix(16), true);
  };
  if (!take("v1 chunk=") || !number(chunk, 10) || !take(" header=") || !hash(header) || !take(" data=")) return false;
  while (!v.empty()) {
    if (!data->empty() && !take(",")) return false;
    uint64_t h = 0;
    if (!hash(&h)) return false;
    data->push_back(h);
  }
  return true;
}

bool parse_safetensors_dtype(std::string_view s, DType* out) {
  if (s == "F32") *out = DType::kF32;
  else if (s == "BF16") *out = DType::kBF16;
  else if (s == "F16") *out = DType::kF16;
  else return false;
  return true;
}

std::string shape_str(std::span<const int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// numel(shape) * elem, or false on overflow of size_t.
bool shape_bytes(std::span<const int64_t> shape, size_t elem, size_t* out) {
  size_t n = elem;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > SIZE_MAX / static_cast<size_t>(d)) return false;
    n *= static_cast<size_t>(d);
  }
  *out = n;
  return true;
}

// Parses one tensor entry of the header into `e` (offsets only; data pointers are set after validation).
Status parse_entry(const std::string& path, const std::string& name, const nlohmann::json& v, SafetensorsEntry* e) {
  auto bad = [&](const std::string& what) {
    return Status::corruption("{}: tensor '{}': {} (entry: {})", path, name, what, json_excerpt(v));
  };
  if (!v.is_object()) return bad("entry is not an object");
  auto dt = v.find("dtype");
  auto sh = v.find("shape");
  auto off = v.find("data_offsets");
  if (dt == v.end() || !dt->is_string()) return bad("missing or non-string \"dtype\"");
  if (sh == v.end() || !sh->is_array()) return bad("missing or non-array \"shape\"");
  if (off == v.end() || !off->is_array() || off->size() != 2) return bad("\"data_offsets\" is not [begin, end]");
  const std::string dtype_name = dt->get<std::string>();
  if (!parse_safetensors_dtype(dtype_name, &e->dtype))
    return Status::unimplemented("{}: tensor '{}' has dtype {}; Strata reads F32, BF16 and F16", path, name, dtype_name);
  for (const auto& d : *sh) {
    if (!d.is_number_unsigned()) return bad("shape has a dimension that is not a non-negative integer");
    e->shape.push_back(d.get<int64_t>());
  }
  for (const auto& o : *off)
    if (!o.is_number_unsigned()) return bad("data_offsets are not non-negative integers");
  e->name = name;
  e->begin = (*off)[0].get<size_t>();
  e->end = (*off)[1].get<size_t>();
  if (e->begin > e->end) return bad(fmt::format("data_offsets [{}, {}] run backwards", e->begin, e->end));
  size_t want = 0;
  if (!shape_bytes(e->shape, dtype_size(e->dtype), &want))
    return bad(fmt::format("shape {} overflows", shape_str(e->shape)));
  if (want != e->end - e->begin)
    return bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] span {}", shape_str(e->shape),
                           dtype_name, want, e->begin, e->end, e->end - e->begin));
  return Status::ok();
}

}  // namespace

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  return "?";
}

Status write_safetensors(const std::string& path, std::span<const SafetensorsTensor> tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::vector<size_t> sizes;
  sizes.reserve(tensors.size());
  size_t offset = 0, chunks = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey)
      return Status::invalid_argument("{}: tensor name '{}' is empty or reserved", path, t.name);
    if (header.contains(t.name)) return Status::invalid_argument("{}: tensor '{}' appears twice", path, t.name);
    size_t bytes = 0;
    if (!shape_bytes(t.shape, dtype_size(t.dtype), &bytes))
      return Status::invalid_argument("{}: tensor '{}' has a bad shape {}", path, t.name, shape_str(t.shape));
    if (bytes > 0 && t.data == nullptr && !t.fill && !t.view)
      return Status::invalid_argument("{}: tensor '{}' has {} bytes but no data", path, t.name, bytes);
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
    chunks += chunks_of(bytes, kSafetensorsChecksumChunk);
  }
  if (metadata.count(kSafetensorsChecksumKey) != 0)
    return Status::invalid_argument("{}: metadata key '{}' is the writer's own", path, kSafetensorsChecksumKey);
  // The checksums go in the header, which is written first: a value of the same length holds their place, and
  // is rewritten once the data has been hashed on its way out.
  const std::string placeholder = checksum_value(0, std::vector<uint64_t>(chunks, 0));
  nlohmann::json meta = metadata;
  meta[kSafetensorsChecksumKey] = placeholder;
  header[kMetadataKey] = std::move(meta);
  std::string text = header.dump();
  // Spaces up to a multiple of 8 keep the data section (and so every tensor) 8-byte aligned in the file.
  text.append((8 - text.size() % 8) % 8, ' ');
  const size_t quoted = text.find('"' + placeholder + '"');
  STRATA_ASSERT(quoted != std::string::npos);
  const size_t value_at = quoted + 1;
  const uint64_t own_hash = header_hash(text, value_at, placeholder.size());
  const uint64_t len = text.size();

  std::vector<uint64_t> hashes;
  hashes.reserve(chunks);
  ChunkHasher hasher(&hashes);
  std::vector<std::byte> staging;  // produced tensors, one at a time
  return write_file_atomic(path, [&](const AppendFn& append, const OverwriteFn& overwrite) -> Status {
    STRATA_RETURN_IF_ERROR(append(std::as_bytes(std::span<const uint64_t>(&len, 1))));
    STRATA_RETURN_IF_ERROR(append(std::as_bytes(std::span<const char>(text))));
    auto out = [&](std::span<const std::byte> bytes) {
      hasher.add(bytes);
      return append(bytes);
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
      const SafetensorsTensor& t = tensors[i];
      const size_t bytes = sizes[i];
      if (t.view) {
        for (size_t done = 0; done < bytes;) {
          Result<std::span<const std::byte>> viewed = t.view(done);
          if (!viewed.is_ok()) return viewed.status().with_context(fmt::format("{}: tensor '{}'", path, t.name));
          const std::span<const std::byte> piece = *viewed;
          if (piece.empty() || piece.size() > bytes - done) {
            return Status::internal("{}: tensor '{}' came as {} bytes at byte {}, its shape needs {} in all", path,
                                    t.name, piece.size(), done, bytes);
          }
          STRATA_RETURN_IF_ERROR(out(piece));
          done += piece.size();
        }
      } else if (t.fill) {
        staging.resize(bytes);
        STRATA_RETURN_IF_ERROR(t.fill(staging.data()).with_context(fmt::format("{}: tensor '{}'", path, t.name)));
        STRATA_RETURN_IF_ERROR(out(staging));
      } else {
        STRATA_RETURN_IF_ERROR(out({static_cast<const std::byte*>(t.data), bytes}));
      }
      hasher.end_tensor();
    }
    STRATA_ASSERT(hashes.size() == chunks);
    const std::string value = checksum_value(own_hash, hashes);
    STRATA_ASSERT(value.size() == placeholder.size());
    return overwrite(8 + value_at, std::as_bytes(std::span<const char>(value)));
  });
}

void release_mapped_pages(const void* data, size_t bytes) {
  if (bytes == 0) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
  // Advice only: a failure leaves the pages resident, which is what not calling it does.
  (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::not_found("{}: no such safetensors file", path);
    return Status::io_error("{}: cannot open: {}", path, std::strerror(errno));
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Status::io_error("{}: fstat failed: {}", path, std::strerror(errno));
  }
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    return Status::corruption("{}: file is {} bytes, shorter than the 8-byte header length", path, file_size);
  }
  // The mapping keeps the file readable after the descriptor is closed.
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) return Status::io_error("{}: mmap of {} bytes failed: {}", path, file_size, std::strerror(map_errno));

  SafetensorsFile f;
  f.path_ = path;
  f.map_ = map;
  f.map_bytes_ = file_size;
  const auto* base = static_cast<const std::byte*>(map);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > file_size - 8 || header_len > kMaxHeaderBytes)
    return Status::corruption("{}: header length {} at offset 0 does not fit the file ({} bytes; at most {} allowed)",
                              path, header_len, file_size, std::min(file_size - 8, kMaxHeaderBytes));
  const std::string_view text(reinterpret_cast<const char*>(base + 8), header_len);
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json header,
                          parse_json(text, fmt::format("{}: header ({} bytes at offset 8)", path, header_len),
                                     StatusCode::kCorruption, {.max_bytes = kMaxHeaderBytes, .max_depth = 8}));
  if (!header.is_object()) return Status::corruption("{}: header is JSON but not an object", path);

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (!it->is_object()) return Status::corruption("{}: __metadata__ is not an object", path);
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          return Status::corruption("{}: __metadata__ value for '{}' is not a string: {}", path, m.key(), m->dump());
        f.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    STRATA_RETURN_IF_ERROR(parse_entry(path, it.key(), *it, &e));
    f.entries_.push_back(std::move(e));
  }

  const uint64_t data_start = 8 + header_len;
  const uint64_t data_bytes = file_size - data_start;
  for (const SafetensorsEntry& e : f.entries_) {
    if (e.end > data_bytes)
      return Status::corruption("{}: tensor '{}': data_offsets [{}, {}] run past the data section ({} bytes at offset {})",
                                path, e.name, e.begin, e.end, data_bytes, data_start);
  }
  std::sort(f.entries_.begin(), f.entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  size_t expected_begin = 0;
  for (size_t i = 0; i < f.entries_.size(); ++i) {
    const SafetensorsEntry& e = f.entries_[i];
    if (e.begin < expected_begin)
      return Status::corruption("{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", path, f.entries_[i - 1].name,
                                f.entries_[i - 1].begin, f.entries_[i - 1].end, e.name, e.begin, e.end);
    if (e.begin > expected_begin)
      return Status::corruption("{}: {} unclaimed bytes at data offset {} before tensor '{}'", path,
                                e.begin - expected_begin, expected_begin, e.name);
    expected_begin = e.end;
  }
  if (expected_begin != data_bytes)
    return Status::corruption("{}: {} trailing bytes after the last tensor (data section is {} bytes, tensors end at {})",
                              path, data_bytes - expected_begin, data_bytes, expected_begin);
  for (size_t i = 0; i < f.entries_.size(); ++i) {
    f.entries_[i].data = base + data_start + f.entries_[i].begin;
    f.by_name_.emplace(f.entries_[i].name, i);
  }
  if (auto it = f.metadata_.find(kSafetensorsChecksumKey); it != f.metadata_.end())
    STRATA_RETURN_IF_ERROR(f.read_checksums(text, it->second));
  return f;
}

Status SafetensorsFile::read_checksums(std::string_view header, const std::string& value) {
  std::vector<uint64_t> data;
  uint64_t stored = 0;
  if (!parse_checksum_value(value, &chunk_bytes_, &stored, &data) || chunk_bytes_ == 0 ||
      chunk_bytes_ > kMaxChecksumChunk) {
    return Status::corruption("{}: the checksums' __metadata__ '{}' is not \"v1 chunk=N header=H data=H,...\" (got '{:.80}')", path_,
                              kSafetensorsChecksumKey, value);
  }
  // The value's place in the raw header, which its hash leaves out; it holds only [a-z0-9=, ], so its JSON
  // form is itself, and its hashes make it unique.
  const std::string quoted = '"' + value + '"';
  const size_t at = header.find(quoted);
  if (at == std::string_view::npos || header.find(quoted, at + 1) != std::string_view::npos)
    return Status::corruption("{}: the checksum in the header is not where its writer put it", path_);
  const uint64_t computed = header_hash(header, at + 1, value.size());
  if (computed != stored) {
    return Status::corruption("{}: header (bytes [8, {})) fails its XXH3 checksum: stored {:016x}, computed {:016x}; "
                              "the file is damaged",
                              path_, 8 + header.size(), stored, computed);
  }
  first_chunk_.resize(entries_.size());
  size_t chunks = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    first_chunk_[i] = chunks;
    chunks += chunks_of(entries_[i].nbytes(), chunk_bytes_);
  }
  if (chunks != data.size()) {
    return Status::corruption("{}: header holds {} data checksums, its tensors have {} chunks of {} bytes", path_,
                              data.size(), chunks, chunk_bytes_);
  }
  chunk_hash_ = std::move(data);
  verified_ = std::make_unique<std::atomic<bool>[]>(chunks);
  return Status::ok();
}

Status SafetensorsFile::verify(const SafetensorsEntry& e, size_t lo, size_t hi) const {
  if (!checksummed() || lo >= hi) return Status::ok();
  const size_t i = static_cast<size_t>(&e - entries_.data());
  STRATA_ASSERT(i < entries_.size() && hi <= e.nbytes());
  for (size_t c = lo / chunk_bytes_; c * chunk_bytes_ < hi; ++c) {
    const size_t k = first_chunk_[i] + c;
    if (verified_[k].load(std::memory_order_acquire)) continue;
    const size_t from = c * chunk_bytes_, n = std::min(chunk_bytes_, e.nbytes() - from);
    const uint64_t computed = xxh3_64(e.data + from, n);
    if (computed != chunk_hash_[k]) {
      return Status::corruption("{}: tensor '{}': bytes [{}, {}) of it (file offset {}) fail their XXH3 checksum: "
                                "stored {:016x}, computed {:016x}; the file is damaged",
                                path_, e.name, from, from + n, static_cast<size_t>(e.data + from - base()), chunk_hash_[k],
                                computed);
    }
    verified_[k].store(true, std::memory_order_release);
  }
  return Status::ok();
}

Status SafetensorsFile::verify_all() const {
  for (const SafetensorsEntry& e : entries_) {
    STRATA_RETURN_IF_ERROR(verify(e, 0, e.nbytes()));
    release_mapped_pages(e.data, e.nbytes());
  }
  return Status::ok();
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    entries_ = std::move(o.entries_);  // data pointers stay valid: the mapping itself does not move
    by_name_ = std::move(o.by_name_);
    metadata_ = std::move(o.metadata_);
    chunk_bytes_ = o.chunk_bytes_;
    chunk_hash_ = std::move(o.chunk_hash_);
    first_chunk_ = std::move(o.first_chunk_);
    verified_ = std::move(o.verified_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

Result<std::span<const std::byte>> SafetensorsFile::expect(std::string_view name, DType dtype,
                                                           std::span<const int64_t> shape) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return Status::not_found("{}: no tensor named '{}' ({} tensors in the file)", path_, name, entries_.size());
  if (e->dtype != dtype || !std::equal(shape.begin(), shape.end(), e->shape.begin(), e->shape.end()))
    return Status::invalid_argument("{}: tensor '{}' is {} {}, want {} {}", path_, name, safetensors_dtype_name(e->dtype),
                                    shape_str(e->shape), safetensors_dtype_name(dtype), shape_str(shape));
  return std::span<const std::byte>(e->data, e->nbytes());
}

Status SafetensorsFile::read_into(std::string_view name, DType dtype, std::span<const int64_t> shape,
                                  void* dst) const {
  size_t numel = 1;
  for (const int64_t d : shape) numel *= static_cast<size_t>(d);
  return read_range(name, dtype, shape, 0, numel, dst);
}

Status SafetensorsFile::read_range(std::string_view name, DType dtype, std::span<const int64_t> shape, size_t first,
                                   size_t count, void* dst) const {
  STRATA_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, expect(name, dtype, shape));
  const size_t esize = dtype_size(dtype), numel = bytes.size() / esize;
  if (first > numel || count > numel - first)
    return Status::invalid_argument("{}: elements [{}, {}) of tensor '{}', which has {}", path_, first, first + count,
                                    name, numel);
  const std::span<const std::byte> piece = bytes.subspan(first * esize, count * esize);
  STRATA_RETURN_IF_ERROR(verify(*find(name), first * esize, (first + count) * esize));
  std::memcpy(dst, piece.data(), piece.size());
  release_mapped_pages(piece.data(), piece.size());
  return Status::ok();
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const SafetensorsEntry& e : entries_) out.push_back(e.name);
  return out;
}

}  // namespace strata
