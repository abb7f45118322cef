// tokenizer.h — the GPT-2 byte-level BPE tokenizer, token for token what OpenAI's encoder.py produces.
//
// Loads encoder.json (token string -> id; 50257 entries for GPT-2) and vocab.bpe (one merge per line, ranked by
// line, after a "#version" comment line). encode() splits text with GPT-2's pre-tokenizer pattern (PCRE2, UTF +
// UCP, JIT-compiled), maps each piece's UTF-8 bytes through the bytes_to_unicode alphabet, and applies merges
// lowest rank first, all occurrences of a pair left to right, as encoder.py does. "<|endoftext|>" in text is
// ordinary text, as in encoder.py; the EOT id is added by whoever builds documents (tokenize_cmd.h).
//
// Where this can differ from encoder.py (Python `regex`): only in which characters count as \s, \p{L}, \p{N}
// for the pre-tokenizer. PCRE2 (Unicode 14) agrees with Python's White_Space definition except for U+180E;
// the npm gpt-3-encoder port (JavaScript regex) also treats U+FEFF as space and U+0085 as not. Bytes that are
// not valid UTF-8 (which encoder.py never sees: it takes str) are not dropped: each invalid run becomes its
// own piece, so decode(encode(x)) == x for every byte string x.
//
// Not here: special-token parsing, other tokenizers (Llama's SentencePiece), token shards (storage/).
// Threading: a loaded Tokenizer is immutable except for per-thread BPE caches, so encode() and decode() may be
// called from any number of threads at once (the caches are per thread, created on a thread's first call).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace strata::engine {

class Tokenizer {
 public:
  // NotFound naming a missing file; Corruption naming the file (and the vocab.bpe line number) for bad JSON,
  // a malformed or repeated merge, a symbol or merge result missing from encoder.json, duplicate or sparse ids,
  // a token outside the byte alphabet, or no "<|endoftext|>" token.
  static Result<Tokenizer> load(const std::string& encoder_json_path, const std::string& vocab_bpe_path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text) const;
  // Appends the encoding of `text` to `out` (no allocation per call once `out` has grown).
  void encode_append(std::string_view text, std::vector<int32_t>* out) const;

  // The bytes the ids stand for, concatenated. An id outside [0, vocab_size()) (e.g. a sampled id in a padded
  // vocabulary) decodes to U+FFFD.
  std::string decode(std::span<const int32_t> ids) const;
  std::string_view token_bytes(int32_t id) const;  // empty for an id out of range

  int vocab_size() const;  // 50257 for GPT-2
  int32_t eot_token() const;  // "<|endoftext|>": 50256 for GPT-2

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Puts a GPT-2 tokenizer beside a Hugging Face model exported to `dir`, as transformers names its files:
// encoder.json as vocab.json, vocab.bpe as merges.txt (the same formats), and a tokenizer_config.json
// (model_max_length `max_length`), so that AutoTokenizer loads from the folder too. First checks that the files
// load and that their vocabulary is the model's `vocab_size` (InvalidArgument naming both otherwise).
Status export_hf_tokenizer(const std::string& encoder_json, const std::string& vocab_bpe, const std::string& dir,
                           int vocab_size, int max_length);

}  // namespace strata::engine
