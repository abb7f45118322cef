// safetensors.h — reading and writing model weights in the safetensors format (Hugging Face's).
//
// Layout: u64 little-endian N; N bytes of UTF-8 JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
// optional "__metadata__": {string: string}}; then the data section, which offsets are relative to. As the
// reference implementation requires, the tensors tile the data section exactly: sorted by offset, each begins
// where the previous ended and the last ends at the end of the file. The writer pads the header with spaces to
// a multiple of 8 bytes so that every tensor starts 8-byte aligned in the file.
// Strata reads and writes F32, BF16 and F16 (common/dtype.h); other dtypes are refused by name.
// Not here: mapping names to a model's flat buffers (engine/), checkpoints' directory layout (engine/).
// Threading: a SafetensorsFile is immutable once opened (a read-only mapping); any number of threads may read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <atomic>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace strata {

// One tensor to write; `data` holds numel(shape) * dtype_size(dtype) bytes (may be null when that is zero).
// Or, with `fill` set instead, the writer calls fill(dst) when it reaches the tensor to produce exactly those
// bytes into its own buffer: a file larger than memory is written one tensor at a time (checkpoints of
// offloaded state), and an error from fill stops the write. Or, with `view` set, the writer asks for the bytes
// when it reaches the tensor and writes them from where they are: view(offset) gives the tensor's bytes from
// byte `offset` on, at least one and at most the rest, valid until the next call, and the writer calls it until
// it has them all. Produced tensors without a copy into the writer's buffer, in pieces as small as the producer
// likes (offloaded optimizer state: a sub-group at a time, from where it lies).
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  std::function<Status(void* dst)> fill;
  std::function<Result<std::span<const std::byte>>(size_t offset)> view = nullptr;
};

// Every file Strata writes carries XXH3-64 checksums in its metadata, under kSafetensorsChecksumKey: one of the
// header (every header byte but the value's own) and one per chunk of kSafetensorsChecksumChunk bytes of each
// tensor, counted from the tensor's start, in data-offset order. The value reads
//   "v1 chunk=16777216 header=<16 hex digits> data=<16 hex digits>,<16 hex digits>,..."
// Other readers (Hugging Face's safetensors, PEFT) see one more string in the metadata and ignore it.
inline constexpr const char* kSafetensorsChecksumKey = "strata.xxh3";
inline constexpr size_t kSafetensorsChecksumChunk = size_t{16} << 20;

// Writes `tensors` (data laid out in the order given) and `metadata` to `path` via "<path>.tmp", fsync and
// rename, with the checksums above (hashed as the bytes go out; the header is rewritten with them before the
// file is synced). InvalidArgument for an empty, duplicate or reserved ("__metadata__") name, a negative
// dimension or the checksum's metadata key; IOError naming the file otherwise.
Status write_safetensors(const std::string& path, std::span<const SafetensorsTensor> tensors,
                         const std::map<std::string, std::string>& metadata = {});

// One tensor of an open file. `data` points into the file's read-only mapping and lives as long as the file.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // data_offsets: bytes from the start of the data section
  const std::byte* data = nullptr;

  size_t nbytes() const { return end - begin; }
  size_t numel() const { return nbytes() / dtype_size(dtype); }
};

// "F32", "BF16", "F16": the names safetensors uses for Strata's dtypes.
const char* safetensors_dtype_name(DType t);

// Drops the pages of a read-only file mapping under [data, data + bytes), rounded out to whole pages, from the
// process's resident set (madvise MADV_DONTNEED); reading them again faults them in from the file. Reading a
// mapped file tensor by tensor and releasing each after its copy keeps a checkpoint many times the host budget
// from piling up in the resident set (the page cache keeps what the kernel can spare). Only for file mappings
// no one writes: on anonymous or written private memory it would discard the data.
void release_mapped_pages(const void* data, size_t bytes);

class SafetensorsFile {
 public:
  // Maps and validates `path`. NotFound if it is missing; Corruption naming the file (and the tensor) for a
  // header length past the end of the file, bad JSON (nested past 8 deep, a key twice), a malformed entry,
  // offsets out of range, overlapping or leaving gaps, a shape whose size disagrees with its offsets, or a
  // header that fails its checksum; Unimplemented for a dtype other than F32/BF16/F16. The data's checksums
  // are checked as it is read (verify).
  static Result<SafetensorsFile> open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // Whether the file carries Strata's checksums (every file Strata writes; not other projects' files).
  bool checksummed() const { return chunk_bytes_ != 0; }
  // Checks bytes [lo, hi) of tensor `e` (one of tensors()) against their checksums, each chunk once for the
  // life of the file (the chunks those bytes touch are hashed whole): Corruption naming the file, the tensor,
  // its bytes and their file offset on a mismatch. Ok for a file without checksums. read_into and read_range
  // call it; code that reads SafetensorsEntry::data itself must too. Thread-safe.
  Status verify(const SafetensorsEntry& e, size_t lo, size_t hi) const;
  // Every tensor's every chunk, each tensor's pages released after: `strata export` of a file it copies whole.
  Status verify_all() const;

  // nullptr if there is no tensor of that name.
  const SafetensorsEntry* find(std::string_view name) const;
  // The tensor's bytes, after checking it exists with exactly this dtype and shape; NotFound or
  // InvalidArgument naming the file, the tensor, and what was wanted and found. Not yet verified.
  Result<std::span<const std::byte>> expect(std::string_view name, DType dtype, std::span<const int64_t> shape) const;
  // expect(), copied to dst (the tensor's size), and its pages released from the resident set.
  Status read_into(std::string_view name, DType dtype, std::span<const int64_t> shape, void* dst) const;
  // The same for elements [first, first + count) of the tensor only (InvalidArgument past its end): a tensor
  // read in pieces, each piece's pages released as it is copied.
  Status read_range(std::string_view name, DType dtype, std::span<const int64_t> shape, size_t first, size_t count,
                    void* dst) const;

  const std::vector<SafetensorsEntry>& tensors() const { return entries_; }  // in data-offset order
  std::vector<std::string> names() const;                                  // in data-offset order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  void unmap();
  Status read_checksums(std::string_view header, const std::string& value);
  const std::byte* base() const { return static_cast<const std::byte*>(map_); }

  std::string path_;
  void* map_ = nullptr;  // the whole file, PROT_READ
  size_t map_bytes_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index in entries_
  std::map<std::string, std::string> metadata_;
  // The checksums, when the file has them (chunk_bytes_ 0 when not): each tensor's chunks from
  // first_chunk_[i] on in chunk_hash_, and which have been checked.
  size_t chunk_bytes_ = 0;
  std::vector<uint64_t> chunk_hash_;
  std::vector<size_t> first_chunk_;
  std::unique_ptr<std::atomic<bool>[]> verified_;
};

}  // namespace strata
