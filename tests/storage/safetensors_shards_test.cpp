// safetensors_shards_test.cpp — a model's weights as one safetensors file or as shards with their index
// (storage/safetensors_shards.h): the committed Hugging Face-style fixture (tests/fixtures/llama/, two shards) opens
// by folder, by index and shard by shard alike, and every inconsistency between the index and its shards is refused
// by name before any weight is read.
#include "storage/safetensors_shards.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using ::strata::testing::expect_error;

const fs::path kFixture = fs::path(STRATA_SOURCE_DIR) / "tests/fixtures/llama/llama_tied_gqa";
constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
constexpr const char* kShard2 = "model-00002-of-00002.safetensors";

class SafetensorsShardsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_shards_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    for (const char* f : {kShard1, kShard2, "model.safetensors.index.json"}) fs::copy_file(kFixture / f, dir_ / f);
    std::ifstream in(kFixture / "model.safetensors.index.json");
    index_ = nlohmann::json::parse(in);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string index_path() const { return (dir_ / "model.safetensors.index.json").string(); }
  void write_index(const nlohmann::json& j) const { std::ofstream(index_path()) << j.dump(2); }

  fs::path dir_;
  nlohmann::json index_;
};

TEST_F(SafetensorsShardsTest, TheFolderTheIndexAndTheShardsGiveTheSameTensors) {
  auto by_folder = SafetensorsShards::open(dir_.string());
  ASSERT_TRUE(by_folder.is_ok()) << by_folder.status().to_string();
  EXPECT_TRUE(by_folder->sharded());
  EXPECT_EQ(by_folder->files().size(), 2u);
  EXPECT_EQ(by_folder->names().size(), index_["weight_map"].size());
  auto by_index = SafetensorsShards::open(index_path());
  ASSERT_TRUE(by_index.is_ok()) << by_index.status().to_string();
  EXPECT_EQ(by_index->names(), by_folder->names());
  // Each tensor comes from the shard the index names, bytes and all.
  for (const auto& [name, shard] : index_["weight_map"].items()) {
    const SafetensorsEntry* e = by_folder->find(name);
    ASSERT_NE(e, nullptr) << name;
    auto alone = SafetensorsFile::open((dir_ / shard.get<std::string>()).string());
    ASSERT_TRUE(alone.is_ok());
    const SafetensorsEntry* want = alone->find(name);
    ASSERT_NE(want, nullptr) << name << " in " << shard;
    EXPECT_EQ(e->shape, want->shape) << name;
    ASSERT_EQ(e->nbytes(), want->nbytes());
    EXPECT_EQ(std::memcmp(e->data, want->data, e->nbytes()), 0) << name;
    EXPECT_EQ(by_folder->file_of(*e).path(), (dir_ / shard.get<std::string>()).string());
    ASSERT_OK(by_folder->verify(*e, 0, e->nbytes()));
  }
  EXPECT_EQ(by_folder->find("lm_head.weight"), nullptr) << "the fixture's head is tied";
  EXPECT_FALSE(by_folder->checksummed()) << "transformers' files carry no Strata checksums";
  // One shard on its own is a set of one file.
  auto one = SafetensorsShards::open((dir_ / kShard1).string());
  ASSERT_TRUE(one.is_ok()) << one.status().to_string();
  EXPECT_FALSE(one->sharded());
  EXPECT_NE(one->find("model.embed_tokens.weight"), nullptr);
}

TEST_F(SafetensorsShardsTest, AFolderWithoutEitherFileIsNotFound) {
  fs::remove(index_path());
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kNotFound,
               {dir_.string(), "model.safetensors.index.json", "model.safetensors"});
}

TEST_F(SafetensorsShardsTest, AMissingShardIsNamedWithTheIndex) {
  fs::remove(dir_ / kShard2);
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kNotFound,
               {kShard2, "shard 2 of the index", "model.safetensors.index.json"});
}

TEST_F(SafetensorsShardsTest, ATensorTheIndexMapsElsewhereIsRefused) {
  auto j = index_;
  j["weight_map"]["model.norm.weight"] = kShard1;  // it is in shard 2
  write_index(j);
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption,
               {"'model.norm.weight'", kShard2, "maps it to", kShard1});
}

TEST_F(SafetensorsShardsTest, ATensorTheIndexLeavesOutIsRefused) {
  auto j = index_;
  j["weight_map"].erase("model.norm.weight");
  write_index(j);
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption,
               {"'model.norm.weight'", kShard2, "not in the index"});
}

TEST_F(SafetensorsShardsTest, ATensorTheIndexMapsButNoShardHoldsIsRefused) {
  auto j = index_;
  j["weight_map"]["lm_head.weight"] = kShard2;
  write_index(j);
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption,
               {"'lm_head.weight'", kShard2, "does not hold it"});
}

TEST_F(SafetensorsShardsTest, AShardNameWithAPathIsRefusedBeforeAnythingIsOpened) {
  for (const char* bad : {"../model-00001-of-00002.safetensors", "/etc/passwd", "..", ""}) {
    auto j = index_;
    j["weight_map"]["model.norm.weight"] = bad;
    write_index(j);
    expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption,
                 {"model.norm.weight", "not a file name beside the index"});
  }
}

TEST_F(SafetensorsShardsTest, AMalformedIndexIsRefusedByName) {
  write_index(nlohmann::json::array());
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption, {"JSON object"});
  write_index({{"metadata", {}}});
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption, {"weight_map"});
  write_index({{"weight_map", {{"model.norm.weight", 7}}}});
  expect_error(SafetensorsShards::open(dir_.string()).status(), StatusCode::kCorruption,
               {"weight_map[\"model.norm.weight\"] is 7"});
}

}  // namespace
}  // namespace strata
