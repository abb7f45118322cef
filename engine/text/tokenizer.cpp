#include "engine/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <tbb/enumerable_thread_specific.h>

#include "common/check.h"
#include "common/json_parse.h"

namespace strata::engine {
namespace {

// GPT-2's pre-tokenizer: contractions, letter runs, number runs, other-symbol runs (each with an optional
// leading space), then whitespace — where a whitespace run before a non-space leaves its last space to the
// next piece.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Pieces longer than this are encoded but not cached: they are rare (long whitespace or symbol runs) and
// would only bloat the cache.
constexpr size_t kMaxCachedPieceBytes = 128;
// The cache is dropped when it reaches this many pieces, bounding memory on large corpora.
constexpr size_t kMaxCacheEntries = 1 << 20;

// bytes_to_unicode from encoder.py: printable Latin-1 bytes stand for themselves; the other 68 bytes (controls,
// space, soft hyphen...) are shifted to U+0100.. in byte order, so every byte is a visible character.
std::array<uint32_t, 256> bytes_to_unicode() {
  std::array<uint32_t, 256> cp{};
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cp[b] = printable ? b : 256 + n++;
  }
  return cp;
}

// Decodes a string in GPT-2's byte alphabet (UTF-8 of the code points above) back to raw bytes. False if it
// is not valid UTF-8 or holds a character outside the alphabet.
bool alphabet_to_bytes(std::string_view s, const std::array<int, 324>& unicode_to_byte, std::string* out) {
  out->clear();
  for (size_t i = 0; i < s.size();) {
    const auto c0 = static_cast<unsigned char>(s[i]);
    uint32_t cp;
    if (c0 < 0x80) {
      cp = c0;
      i += 1;
    } else if ((c0 & 0xE0) == 0xC0 && i + 1 < s.size() && (static_cast<unsigned char>(s[i + 1]) & 0xC0) == 0x80) {
      cp = ((c0 & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
      i += 2;
    } else {
      return false;  // every alphabet character is below U+0800: one or two UTF-8 bytes
    }
    if (cp >= unicode_to_byte.size() || unicode_to_byte[cp] < 0) return false;
    out->push_back(static_cast<char>(unicode_to_byte[cp]));
  }
  return true;
}

Result<std::string> read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT)
      return Status::not_found("{}: no such file (the GPT-2 {}; scripts/fetch_data.sh --tokenizer-only fetches it)",
                               path, what);
    return Status::io_error("{}: cannot open {}: {}", path, what, std::strerror(errno));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::io_error("{}: read failed", path);
  return ss.str();
}

std::string abbreviate(std::string_view s) {
  return s.size() <= 60 ? std::string(s) : std::string(s.substr(0, 57)) + "...";
}

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

struct Merge {
  int32_t rank;    // line order in vocab.bpe: lower merges first
  int32_t result;  // the id of the concatenation
};

// A merge candidate: the pair starting at symbol `left`, as it was when queued.
struct Candidate {
  int32_t rank, left, left_id, right_id;
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
};

struct Symbol {
  int32_t id;  // -1 once merged into its left neighbour
  int32_t prev, next;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Everything one thread needs to encode: PCRE2 match state and a cache of piece -> ids (ids in `arena`).
struct ThreadState {
  explicit ThreadState(const pcre2_code* re)
      : match(pcre2_match_data_create_from_pattern(re, nullptr)),
        jit_stack(pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr)),
        context(pcre2_match_context_create(nullptr)) {
    STRATA_ASSERT(match != nullptr && jit_stack != nullptr && context != nullptr);
    // The default 32 KiB JIT stack is enough for ordinary text; a larger one keeps pathological inputs
    // (megabyte-long whitespace runs) from failing to match.
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ThreadState(const ThreadState&) = delete;
  ThreadState& operator=(const ThreadState&) = delete;
  ~ThreadState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(match);
  }

  pcre2_match_data* match;
  pcre2_jit_stack* jit_stack;
  pcre2_match_context* context;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>> cache;
  std::vector<int32_t> arena;
  std::vector<Symbol> symbols;  // BPE scratch
  std::vector<Candidate> heap, pending;
};

}  // namespace

struct Tokenizer::Impl {
  ~Impl() { pcre2_code_free(re); }

  void encode_append(std::string_view text, std::vector<int32_t>* out) const;
  void encode_piece(ThreadState& ts, std::string_view piece, std::vector<int32_t>* out) const;
  void bpe(ThreadState& ts, std::string_view piece) const;

  std::vector<std::string> id_bytes;  // id -> the raw bytes it stands for
  std::array<int32_t, 256> byte_id{};  // byte -> its single-byte token
  std::unordered_map<uint64_t, Merge> merges;  // (left id, right id) -> merge
  int32_t eot = -1;
  pcre2_code* re = nullptr;
  mutable std::unique_ptr<tbb::enumerable_thread_specific<ThreadState>> threads;
};

// Applies the merges to one piece, leaving the resulting ids in the live symbols of ts.symbols. Equivalent to
// encoder.py's loop (take the lowest-ranked adjacent pair, merge every occurrence left to right, repeat) in
// O(n log n): a heap orders candidates by (rank, position); candidates created while one rank is being merged
// wait in `pending` until that rank is done, so a lower-ranked new pair never jumps ahead of the rest of the
// current rank's occurrences, just as in the reference's whole-word pass.
void Tokenizer::Impl::bpe(ThreadState& ts, std::string_view piece) const {
  const auto n = static_cast<int32_t>(piece.size());
  auto& sym = ts.symbols;
  sym.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    sym[static_cast<size_t>(i)] = {byte_id[static_cast<unsigned char>(piece[static_cast<size_t>(i)])], i - 1,
                                   i + 1 < n ? i + 1 : -1};
  auto& heap = ts.heap;
  auto& pending = ts.pending;
  heap.clear();
  pending.clear();
  auto candidate_at = [&](int32_t left, std::vector<Candidate>& into) {
    const int32_t right = sym[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const int32_t a = sym[static_cast<size_t>(left)].id, b = sym[static_cast<size_t>(right)].id;
    auto it = merges.find(pair_key(a, b));
    if (it != merges.end()) into.push_back({it->second.rank, left, a, b});
  };
  for (int32_t i = 0; i + 1 < n; ++i) candidate_at(i, heap);
  std::make_heap(heap.begin(), heap.end(), std::greater<>());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& l = sym[static_cast<size_t>(c.left)];
    // Stale if either side has changed since the candidate was queued (ids only ever grow into longer tokens,
    // so matching ids mean this exact pair is still there).
    if (l.id == c.left_id && l.next >= 0 && sym[static_cast<size_t>(l.next)].id == c.right_id) {
      Symbol& r = sym[static_cast<size_t>(l.next)];
      l.id = merges.find(pair_key(c.left_id, c.right_id))->second.result;
      r.id = -1;
      l.next = r.next;
      if (r.next >= 0) sym[static_cast<size_t>(r.next)].prev = c.left;
      if (l.prev >= 0) candidate_at(l.prev, pending);
      candidate_at(c.left, pending);
    }
    if (heap.empty() || heap.front().rank != c.rank) {
      for (const Candidate& p : pending) {
        heap.push_back(p);
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      }
      pending.clear();
    }
  }
}

void Tokenizer::Impl::encode_piece(ThreadState& ts, std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.size() == 1) {
    out->push_back(byte_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (auto it = ts.cache.find(piece); it != ts.cache.end()) {
    const auto [off, len] = it->second;
    out->insert(out->end(), ts.arena.begin() + off, ts.arena.begin() + off + len);
    return;
  }
  bpe(ts, piece);
  const size_t start = out->size();
  for (int32_t i = 0; i >= 0; i = ts.symbols[static_cast<size_t>(i)].next) out->push_back(ts.symbols[static_cast<size_t>(i)].id);
  if (piece.size() > kMaxCachedPieceBytes) return;
  if (ts.cache.size() >= kMaxCacheEntries) {
    ts.cache.clear();
    ts.arena.clear();
  }
  const auto off = static_cast<uint32_t>(ts.arena.size());
  ts.arena.insert(ts.arena.end(), out->begin() + static_cast<ptrdiff_t>(start), out->end());
  ts.cache.emplace(std::string(piece), std::make_pair(off, static_cast<uint32_t>(out->size() - start)));
}

void Tokenizer::Impl::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  ThreadState& ts = threads->local();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t pos = 0;
  while (pos < n) {
    const int rc = pcre2_jit_match(re, subject, n, pos, 0, ts.match, ts.context);
    size_t start = n, end = n;
    if (rc >= 0) {
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ts.match);
      start = ov[0];
      end = ov[1];
    } else {
      // No match in the rest means it is all invalid UTF-8; anything else is a PCRE2 failure we cannot recover
      // from without silently changing the tokenization.
      STRATA_ASSERT_MSG(rc == PCRE2_ERROR_NOMATCH, "PCRE2 match failed in the GPT-2 pre-tokenizer");
    }
    // With PCRE2_MATCH_INVALID_UTF, invalid UTF-8 is skipped by the search: keep those bytes as their own piece.
    if (start > pos) encode_piece(ts, text.substr(pos, start - pos), out);
    STRATA_ASSERT(end > start || end == n);  // the pattern never matches the empty string
    if (end > start) encode_piece(ts, text.substr(start, end - start), out);
    pos = end;
  }
}

Result<Tokenizer> Tokenizer::load(const std::string& encoder_json_path, const std::string& vocab_bpe_path) {
  auto impl = std::make_unique<Impl>();
  const std::array<uint32_t, 256> b2u = bytes_to_unicode();
  std::array<int, 324> u2b;
  u2b.fill(-1);
  for (int b = 0; b < 256; ++b) u2b[b2u[static_cast<size_t>(b)]] = b;

  // encoder.json: token (in the byte alphabet) -> id; the ids must be exactly 0..n-1.
  STRATA_ASSIGN_OR_RETURN(std::string enc_text, read_text_file(encoder_json_path, "encoder.json"));
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json enc, parse_json(enc_text, encoder_json_path, StatusCode::kCorruption));
  if (!enc.is_object() || enc.empty())
    return Status::corruption("{}: want a non-empty JSON object of token -> id", encoder_json_path);
  const size_t vocab = enc.size();
  impl->id_bytes.resize(vocab);
  std::vector<bool> seen(vocab, false);
  std::unordered_map<std::string, int32_t> bytes_to_id;
  bytes_to_id.reserve(vocab);
  std::string bytes;
  for (auto it = enc.begin(); it != enc.end(); ++it) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() >= vocab)
      return Status::corruption("{}: token '{}' has id {}, want an integer in [0, {})", encoder_json_path,
                                abbreviate(it.key()), json_excerpt(*it), vocab);
    const auto id = it->get<int32_t>();
    if (seen[static_cast<size_t>(id)])
      return Status::corruption("{}: id {} is used twice (again by token '{}')", encoder_json_path, id, abbreviate(it.key()));
    seen[static_cast<size_t>(id)] = true;
    if (!alphabet_to_bytes(it.key(), u2b, &bytes))
      return Status::corruption("{}: token '{}' (id {}) has a character outside GPT-2's byte alphabet",
                                encoder_json_path, abbreviate(it.key()), id);
    impl->id_bytes[static_cast<size_t>(id)] = bytes;
    bytes_to_id.emplace(bytes, id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id.end())
      return Status::corruption("{}: no token for the single byte 0x{:02x}", encoder_json_path, b);
    impl->byte_id[static_cast<size_t>(b)] = it->second;
  }
  auto eot = bytes_to_id.find("<|endoftext|>");
  if (eot == bytes_to_id.end()) return Status::corruption("{}: no \"<|endoftext|>\" token", encoder_json_path);
  impl->eot = eot->second;

  // vocab.bpe: "#version..." then one "left right" merge per line, rank = order.
  STRATA_ASSIGN_OR_RETURN(std::string bpe_text, read_text_file(vocab_bpe_path, "vocab.bpe"));
  std::vector<std::string_view> lines;
  for (size_t start = 0; start <= bpe_text.size();) {
    size_t nl = bpe_text.find('\n', start);
    if (nl == std::string::npos) nl = bpe_text.size();
    std::string_view line(bpe_text.data() + start, nl - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    start = nl + 1;
  }
  if (!lines.empty() && lines.back().empty()) lines.pop_back();  // the newline ending the last line
  if (lines.empty() || !lines[0].starts_with("#version"))
    return Status::corruption("{}:1: want a '#version' comment line first, got '{}'", vocab_bpe_path,
                              lines.empty() ? "" : abbreviate(lines[0]));
  impl->merges.reserve(lines.size());
  std::string left_bytes, right_bytes;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    const size_t line_no = i + 1;
    const size_t sp = line.find(' ');
    const std::string_view left = line.substr(0, sp);
    const std::string_view right = sp == std::string_view::npos ? std::string_view() : line.substr(sp + 1);
    if (left.empty() || right.empty() || right.find_first_of(" \t") != std::string_view::npos)
      return Status::corruption("{}:{}: malformed merge '{}' (want two symbols separated by one space)",
                                vocab_bpe_path, line_no, abbreviate(line));
    if (!alphabet_to_bytes(left, u2b, &left_bytes) || !alphabet_to_bytes(right, u2b, &right_bytes))
      return Status::corruption("{}:{}: merge '{}' has a character outside GPT-2's byte alphabet", vocab_bpe_path,
                                line_no, abbreviate(line));
    auto l = bytes_to_id.find(left_bytes), r = bytes_to_id.find(right_bytes);
    auto m = bytes_to_id.find(left_bytes + right_bytes);
    if (l == bytes_to_id.end() || r == bytes_to_id.end())
      return Status::corruption("{}:{}: merge '{}': symbol '{}' is not a token in {}", vocab_bpe_path, line_no,
                                abbreviate(line), l == bytes_to_id.end() ? left : right, encoder_json_path);
    if (m == bytes_to_id.end())
      return Status::corruption("{}:{}: merge '{}': its result is not a token in {}", vocab_bpe_path, line_no,
                                abbreviate(line), encoder_json_path);
    const auto [pos, inserted] =
        impl->merges.emplace(pair_key(l->second, r->second), Merge{static_cast<int32_t>(i - 1), m->second});
    if (!inserted)
      return Status::corruption("{}:{}: merge '{}' repeats line {}", vocab_bpe_path, line_no, abbreviate(line),
                                pos->second.rank + 2);
  }

  int err = 0;
  PCRE2_SIZE err_off = 0;
  impl->re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED,
                           PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_off, nullptr);
  if (impl->re == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return Status::internal("PCRE2 cannot compile the GPT-2 pattern at offset {}: {}", err_off, reinterpret_cast<char*>(msg));
  }
  // pcre2_jit_match needs JIT code; a PCRE2 built without JIT support is a packaging problem worth naming.
  if (int rc = pcre2_jit_compile(impl->re, PCRE2_JIT_COMPLETE); rc != 0)
    return Status::internal("PCRE2 JIT compile of the GPT-2 pattern failed ({}); is libpcre2 built with JIT?", rc);
  impl->threads = std::make_unique<tbb::enumerable_thread_specific<ThreadState>>(impl->re);
  return Tokenizer(std::move(impl));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  impl_->encode_append(text, &out);
  return out;
}

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  impl_->encode_append(text, out);
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && static_cast<size_t>(id) < impl_->id_bytes.size()) out += impl_->id_bytes[static_cast<size_t>(id)];
    else out += "\xEF\xBF\xBD";  // U+FFFD
  }
  return out;
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_bytes.size()) return {};
  return impl_->id_bytes[static_cast<size_t>(id)];
}

int Tokenizer::vocab_size() const { return static_cast<int>(impl_->id_bytes.size()); }
int32_t Tokenizer::eot_token() const { return impl_->eot; }

}  // namespace strata::engine
