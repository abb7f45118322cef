// token_shard.h — llm.c's token shard files (.bin), and the crash-safe whole-file write they share.
//
// Layout (little-endian; what llm.c's dev/data scripts write, data_common.py's two HEADERS_INFO forms):
//   int32  header[256]   [0] = magic, [1] = version, [2] = n (token count), the rest zero
//   tokens[n]            uint16 under magic 20240520, version 1 (llm.c's "gpt-2" form: vocabularies to 65536),
//                        uint32 under magic 20240801, version 7 (its "llama-3" form: Llama 3's 128256, Qwen's 151936)
// The file is exactly 1024 + 2n or 1024 + 4n bytes. open() checks that, and that every token is below the
// vocabulary size, so a loader can index an embedding table without a bounds check. Writes go to "<path>.tmp",
// are fsynced and renamed over <path>: a crash leaves the old file or the new one, never half a shard.
// Not here: batching and shuffling (the engine's data loader), tokenizing (engine/text/tokenizer.h).
// Threading: a TokenShard is immutable once opened; any number of threads may read it.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace strata {

static_assert(std::endian::native == std::endian::little, "token shards and safetensors are little-endian");

constexpr int32_t kTokenShardMagic = 20240520;  // uint16 tokens
constexpr int32_t kTokenShardVersion = 1;
constexpr int32_t kTokenShardMagic32 = 20240801;  // uint32 tokens
constexpr int32_t kTokenShardVersion32 = 7;
constexpr int kTokenShardMaxVocab16 = 65536;  // the largest vocabulary the uint16 form holds
constexpr size_t kTokenShardHeaderInts = 256;
constexpr size_t kTokenShardHeaderBytes = kTokenShardHeaderInts * sizeof(int32_t);

class TokenShard {
 public:
  // Reads and validates the shard at `path`. NotFound if it is missing; Corruption naming the file and the
  // offending value (and its offset or token index) for a bad magic, version, size or out-of-vocabulary token;
  // InvalidArgument if vocab_size is not positive.
  static Result<TokenShard> open(const std::string& path, int vocab_size);

  TokenShard(TokenShard&&) noexcept = default;
  TokenShard& operator=(TokenShard&&) noexcept = default;
  TokenShard(const TokenShard&) = delete;  // shards are up to hundreds of MB: copies must be explicit
  TokenShard& operator=(const TokenShard&) = delete;

  size_t size() const { return wide_ ? tokens32_.size() : tokens16_.size(); }
  // Whether the file holds uint32 tokens (the "llama-3" form).
  bool wide() const { return wide_; }
  uint32_t operator[](size_t i) const { return wide_ ? tokens32_[i] : tokens16_[i]; }
  // Tokens [offset, offset + n) as int32 (each below the vocabulary size open() was given).
  void copy(size_t offset, size_t n, int32_t* out) const;
  const std::string& path() const { return path_; }

 private:
  TokenShard() = default;
  std::string path_;
  bool wide_ = false;
  std::vector<uint16_t> tokens16_;  // the uint16 form's tokens, as the file holds them
  std::vector<uint32_t> tokens32_;  // the uint32 form's
};

// Writes n tokens as a shard at `path` (via "<path>.tmp", fsync, rename), in the uint16 form or the uint32 form.
// n must fit the int32 count field.
Status write_token_shard(const std::string& path, const uint16_t* tokens, size_t n);
Status write_token_shard(const std::string& path, const uint32_t* tokens, size_t n);
// The form a vocabulary of `vocab_size` needs: uint16 up to kTokenShardMaxVocab16 (what llm.c's GPT-2 loaders
// read), uint32 above. InvalidArgument naming the first token at or above vocab_size.
Status write_token_shard(const std::string& path, std::span<const uint32_t> tokens, int vocab_size);

// fsync of the directory holding `path`: makes a rename or creation there durable, not just the file's bytes.
Status fsync_parent_dir(const std::string& path);

// Writes the concatenation of `parts` to `path` crash-safely: "<path>.tmp" is written, fsynced and renamed
// over `path`, then the directory is fsynced so the rename itself survives a crash. On failure the temporary
// file is removed and the error names it. Shared by the token-shard and safetensors writers.
Status write_file_atomic(const std::string& path, std::span<const std::span<const std::byte>> parts);
// The same with the bytes produced as they are written: produce(append) calls append(piece) in order.
using AppendFn = std::function<Status(std::span<const std::byte>)>;
Status write_file_atomic(const std::string& path, const std::function<Status(const AppendFn&)>& produce);
// And with bytes already appended rewritten in place before the file is synced: overwrite(offset, bytes), inside
// what was appended (InvalidArgument otherwise). A header that holds the checksums of what follows it.
using OverwriteFn = std::function<Status(size_t offset, std::span<const std::byte>)>;
Status write_file_atomic(const std::string& path,
                         const std::function<Status(const AppendFn&, const OverwriteFn&)>& produce);
// write_file_atomic of one text (a JSON file, a name).
Status write_text_atomic(const std::string& path, std::string_view text);
// The whole file's bytes. NotFound naming it when it cannot be opened, IOError when reading fails.
Result<std::string> read_whole_file(const std::string& path);

}  // namespace strata
