// Token shards: round trips, and a clear Corruption (naming file and value) for every way a shard can be bad.
#include "storage/token_shard.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/rng.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
constexpr int kVocab = 50257;

class TokenShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_token_shard_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }

  // Writes raw bytes, bypassing the writer, to build broken files.
  void write_raw(const std::string& p, const std::vector<int32_t>& header, const std::vector<uint16_t>& tokens) {
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  }
  static std::vector<int32_t> header(int32_t count) {
    std::vector<int32_t> h(256, 0);
    h[0] = kTokenShardMagic;
    h[1] = kTokenShardVersion;
    h[2] = count;
    return h;
  }
  static std::vector<uint16_t> random_tokens(size_t n, uint64_t seed) {
    Rng rng(seed);
    std::vector<uint16_t> t(n);
    for (auto& x : t) x = static_cast<uint16_t>(rng.below(kVocab));
    return t;
  }

  fs::path dir_;
};

using ::strata::testing::expect_error;

TEST_F(TokenShardTest, RoundTripsOddSizes) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{12347}}) {
    const std::vector<uint16_t> tokens = random_tokens(n, 1000 + n);
    const std::string p = path("round.bin");
    ASSERT_TRUE(write_token_shard(p, tokens.data(), n).is_ok());
    EXPECT_FALSE(fs::exists(p + ".tmp"));
    EXPECT_EQ(fs::file_size(p), 1024 + 2 * n);
    auto shard = TokenShard::open(p, kVocab);
    ASSERT_TRUE(shard.is_ok()) << shard.status().to_string();
    ASSERT_EQ(shard->size(), n);
    EXPECT_EQ(shard->path(), p);
    EXPECT_FALSE(shard->wide());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ((*shard)[i], tokens[i]) << "n=" << n << " token " << i;
  }
}

// llm.c's "llama-3" form (dev/data/data_common.py): magic 20240801, version 7, uint32 tokens, for vocabularies
// past 65536 (Qwen's 151936 here).
TEST_F(TokenShardTest, WideTokensRoundTripInLlmCsLlama3Form) {
  constexpr int kWideVocab = 151936;
  Rng rng(11);
  std::vector<uint32_t> tokens(4097);
  for (auto& t : tokens) t = static_cast<uint32_t>(rng.below(kWideVocab));
  tokens[7] = kWideVocab - 1;
  const std::string p = path("wide.bin");
  ASSERT_TRUE(write_token_shard(p, tokens.data(), tokens.size()).is_ok());
  EXPECT_EQ(fs::file_size(p), 1024 + 4 * tokens.size());
  std::ifstream in(p, std::ios::binary);
  std::vector<int32_t> h(256);
  in.read(reinterpret_cast<char*>(h.data()), 1024);
  EXPECT_EQ(h[0], 20240801);
  EXPECT_EQ(h[1], 7);
  EXPECT_EQ(h[2], 4097);
  for (int i = 3; i < 256; ++i) ASSERT_EQ(h[i], 0) << "header[" << i << "]";
  auto shard = TokenShard::open(p, kWideVocab);
  ASSERT_TRUE(shard.is_ok()) << shard.status().to_string();
  EXPECT_TRUE(shard->wide());
  ASSERT_EQ(shard->size(), tokens.size());
  std::vector<int32_t> got(tokens.size() - 5);
  shard->copy(5, got.size(), got.data());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<int32_t>(tokens[5 + i])) << i;
  // A token at the vocabulary's size is named with its offset in the file, 4 bytes a token.
  expect_error(TokenShard::open(p, kWideVocab - 1).status(), StatusCode::kCorruption,
               {"wide.bin", "token 7", "file offset 1052", "is 151935", "151935"});
}

// The writer that takes a vocabulary picks the form: uint16 up to 65536 tokens (what llm.c's GPT-2 loaders
// read), uint32 above; a token outside the vocabulary is refused before anything is written.
TEST_F(TokenShardTest, WriterPicksTheFormFromTheVocabulary) {
  const std::vector<uint32_t> tokens = {50256, 464, 3139, 0};
  ASSERT_TRUE(write_token_shard(path("gpt2.bin"), tokens, 50257).is_ok());
  EXPECT_EQ(fs::file_size(path("gpt2.bin")), 1024 + 2 * tokens.size());
  ASSERT_TRUE(write_token_shard(path("edge.bin"), tokens, 65536).is_ok());
  EXPECT_EQ(fs::file_size(path("edge.bin")), 1024 + 2 * tokens.size());
  ASSERT_TRUE(write_token_shard(path("llama.bin"), tokens, 128256).is_ok());
  EXPECT_EQ(fs::file_size(path("llama.bin")), 1024 + 4 * tokens.size());
  for (const char* name : {"gpt2.bin", "edge.bin", "llama.bin"}) {
    auto shard = TokenShard::open(path(name), 128256);
    ASSERT_TRUE(shard.is_ok()) << shard.status().to_string();
    for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ((*shard)[i], tokens[i]) << name << " token " << i;
  }
  expect_error(write_token_shard(path("bad.bin"), tokens, 3139), StatusCode::kInvalidArgument,
               {"bad.bin", "token 0", "is 50256", "3139"});
  EXPECT_FALSE(fs::exists(path("bad.bin")));
}

TEST_F(TokenShardTest, WideFormChecksItsVersionAndSize) {
  auto h = header(2);
  h[0] = kTokenShardMagic32;
  h[1] = 1;  // the uint16 form's version under the uint32 form's magic
  write_raw(path("mixed.bin"), h, {1, 0, 2, 0});
  expect_error(TokenShard::open(path("mixed.bin"), kVocab).status(), StatusCode::kCorruption,
               {"mixed.bin", "version 1", "want 7", "20240801"});
  h[1] = kTokenShardVersion32;
  write_raw(path("half.bin"), h, {1, 2});  // 2 tokens of 2 bytes: half the uint32 form's bytes
  expect_error(TokenShard::open(path("half.bin"), kVocab).status(), StatusCode::kCorruption,
               {"half.bin", "2 tokens", "1032 bytes", "1024 + 4*2", "1028 bytes"});
}

TEST_F(TokenShardTest, HeaderMatchesLlmC) {
  const std::vector<uint16_t> tokens = {50256, 464, 3139};
  const std::string p = path("hdr.bin");
  ASSERT_TRUE(write_token_shard(p, tokens.data(), tokens.size()).is_ok());
  std::ifstream in(p, std::ios::binary);
  std::vector<int32_t> h(256);
  in.read(reinterpret_cast<char*>(h.data()), 1024);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 3);
  for (int i = 3; i < 256; ++i) ASSERT_EQ(h[i], 0) << "header[" << i << "]";
}

TEST_F(TokenShardTest, OverwriteReplacesWholeFile) {
  const std::string p = path("over.bin");
  const auto big = random_tokens(5000, 7);
  const auto small = random_tokens(3, 8);
  ASSERT_TRUE(write_token_shard(p, big.data(), big.size()).is_ok());
  ASSERT_TRUE(write_token_shard(p, small.data(), small.size()).is_ok());
  auto shard = TokenShard::open(p, kVocab);
  ASSERT_TRUE(shard.is_ok()) << shard.status().to_string();
  EXPECT_EQ(shard->size(), 3u);
}

TEST_F(TokenShardTest, MissingFileIsNotFound) {
  auto shard = TokenShard::open(path("nope.bin"), kVocab);
  expect_error(shard.status(), StatusCode::kNotFound, {"nope.bin"});
}

TEST_F(TokenShardTest, BadMagic) {
  auto h = header(2);
  h[0] = 20240519;
  write_raw(path("magic.bin"), h, {1, 2});
  expect_error(TokenShard::open(path("magic.bin"), kVocab).status(), StatusCode::kCorruption,
               {"magic.bin", "bad magic 20240519", "20240520"});
}

TEST_F(TokenShardTest, BadVersion) {
  auto h = header(2);
  h[1] = 7;
  write_raw(path("version.bin"), h, {1, 2});
  expect_error(TokenShard::open(path("version.bin"), kVocab).status(), StatusCode::kCorruption,
               {"version.bin", "version 7"});
}

TEST_F(TokenShardTest, ShorterThanHeader) {
  write_raw(path("short.bin"), std::vector<int32_t>(10, kTokenShardMagic), {});
  expect_error(TokenShard::open(path("short.bin"), kVocab).status(), StatusCode::kCorruption,
               {"short.bin", "40 bytes", "1024"});
}

TEST_F(TokenShardTest, TruncatedTokensNameBothSizes) {
  write_raw(path("trunc.bin"), header(100), random_tokens(99, 3));
  expect_error(TokenShard::open(path("trunc.bin"), kVocab).status(), StatusCode::kCorruption,
               {"trunc.bin", "100 tokens", "1224 bytes", "1222 bytes"});
}

TEST_F(TokenShardTest, TrailingBytesAreCorruption) {
  write_raw(path("long.bin"), header(4), random_tokens(5, 4));
  expect_error(TokenShard::open(path("long.bin"), kVocab).status(), StatusCode::kCorruption,
               {"long.bin", "4 tokens", "1032 bytes", "1034 bytes"});
}

TEST_F(TokenShardTest, NegativeCount) {
  write_raw(path("neg.bin"), header(-3), {});
  expect_error(TokenShard::open(path("neg.bin"), kVocab).status(), StatusCode::kCorruption, {"neg.bin", "-3"});
}

TEST_F(TokenShardTest, TokenOutsideVocabNamesIndexAndValue) {
  auto tokens = random_tokens(1000, 5);
  tokens[613] = 50257;
  tokens[900] = 60000;  // a later bad token: the first one is reported
  write_raw(path("vocab.bin"), header(1000), tokens);
  expect_error(TokenShard::open(path("vocab.bin"), kVocab).status(), StatusCode::kCorruption,
               {"vocab.bin", "token 613", "is 50257", "50257"});
  // The same file is fine for a larger (padded) vocabulary.
  EXPECT_TRUE(TokenShard::open(path("vocab.bin"), 65536).is_ok());
}

TEST_F(TokenShardTest, NonPositiveVocabIsInvalidArgument) {
  const uint16_t t = 1;
  ASSERT_TRUE(write_token_shard(path("v.bin"), &t, 1).is_ok());
  expect_error(TokenShard::open(path("v.bin"), 0).status(), StatusCode::kInvalidArgument, {"vocab_size"});
}

TEST_F(TokenShardTest, WriterRejectsTooManyTokens) {
  const uint16_t t = 1;
  // The count is checked before any byte is read, so a one-element buffer is safe here.
  expect_error(write_token_shard(path("huge.bin"), &t, size_t{1} << 31), StatusCode::kInvalidArgument,
               {"huge.bin", "2147483648"});
  EXPECT_FALSE(fs::exists(path("huge.bin")));
}

TEST_F(TokenShardTest, WriterNamesUnwritablePath) {
  const uint16_t t = 1;
  const std::string p = path("no_such_dir/x.bin");
  expect_error(write_token_shard(p, &t, 1), StatusCode::kIOError, {"no_such_dir/x.bin.tmp"});
}

}  // namespace
}  // namespace strata
