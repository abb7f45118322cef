#include "storage/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "storage/token_shard.h"  // write_file_atomic

namespace strata {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr const char* kMetadataKey = "__metadata__";

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
    return Status::corruption("{}: tensor '{}': {} (entry: {})", path, name, what, v.dump());
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
  std::vector<std::span<const std::byte>> parts;
  parts.reserve(tensors.size() + 2);
  parts.emplace_back();  // length, then header: filled in below
  parts.emplace_back();
  size_t offset = 0;
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
    parts.emplace_back(static_cast<const std::byte*>(t.data), bytes);
    offset += bytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::string text = header.dump();
  // Spaces up to a multiple of 8 keep the data section (and so every tensor) 8-byte aligned in the file.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  parts[0] = std::as_bytes(std::span<const uint64_t>(&len, 1));
  parts[1] = std::as_bytes(std::span<const char>(text));
  std::vector<std::byte> staging;  // produced tensors, one at a time
  return write_file_atomic(path, [&](const AppendFn& append) -> Status {
    for (size_t i = 0; i < parts.size(); ++i) {
      const SafetensorsTensor* t = i >= 2 ? &tensors[i - 2] : nullptr;
      if (t != nullptr && t->view) {
        for (size_t done = 0; done < parts[i].size();) {
          Result<std::span<const std::byte>> viewed = t->view(done);
          if (!viewed.is_ok()) return viewed.status().with_context(fmt::format("{}: tensor '{}'", path, t->name));
          const std::span<const std::byte> bytes = *viewed;
          if (bytes.empty() || bytes.size() > parts[i].size() - done) {
            return Status::internal("{}: tensor '{}' came as {} bytes at byte {}, its shape needs {} in all", path,
                                    t->name, bytes.size(), done, parts[i].size());
          }
          STRATA_RETURN_IF_ERROR(append(bytes));
          done += bytes.size();
        }
        continue;
      }
      if (t == nullptr || !t->fill) {
        STRATA_RETURN_IF_ERROR(append(parts[i]));
        continue;
      }
      staging.resize(parts[i].size());
      STRATA_RETURN_IF_ERROR(t->fill(staging.data()).with_context(fmt::format("{}: tensor '{}'", path, t->name)));
      STRATA_RETURN_IF_ERROR(append(staging));
    }
    return Status::ok();
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
  const auto* text = reinterpret_cast<const char*>(base + 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, text + header_len);
  } catch (const nlohmann::json::parse_error& e) {
    return Status::corruption("{}: header ({} bytes at offset 8) is not valid JSON: {}", path, header_len, e.what());
  }
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
  return f;
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
