// checkpoint_state_test.cpp — state.json read as a schema (engine/checkpoint/checkpoint_state.h): each value that a
// hand-edited or damaged file held at 82c4702, and that was believed then (an assertion, a step truncated to
// 32 bits, a negative position), is now a Corruption naming the file and the field; the checksum catches a
// change anywhere, the config section included; files from before the checksum still read.
#include <string>

#include <gtest/gtest.h>

#include "engine/checkpoint/checkpoint_state.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

using nlohmann::json;
using ::strata::testing::expect_error;

TrainState sample_state() {
  TrainState st;
  st.step = 38;
  st.train_pos = {.shard = 1, .offset = 640, .epoch = 2};
  st.train_shards = {{"a_train_000000.bin", 3000}, {"a_train_000001.bin", 2000}};
  st.config = {{"training", {{"lr", 3e-4}, {"max_steps", 100}}}};
  return st;
}

// The file as written, with the checksum dropped (a hand-edited or older file) and `edit` applied.
std::string edited(void (*edit)(json&)) {
  json j = json::parse(train_state_json(sample_state(), 37));
  j.erase("xxh3");
  edit(j);
  return j.dump(2);
}

void expect_refused(const std::string& text, std::initializer_list<std::string> words) {
  int64_t adam = 0;
  auto r = parse_train_state(text, "ck/step_000038/state.json", &adam);
  ASSERT_FALSE(r.is_ok()) << "accepted: " << text;
  expect_error(r.status(), StatusCode::kCorruption, words);
  EXPECT_NE(r.status().message().find("ck/step_000038/state.json"), std::string::npos) << r.status().message();
}

TEST(CheckpointStateTest, RoundTripsWithItsChecksum) {
  int64_t adam = 0;
  ASSERT_OK_AND_ASSIGN(TrainState st, parse_train_state(train_state_json(sample_state(), 37), "s.json", &adam));
  EXPECT_EQ(st.step, 38);
  EXPECT_EQ(adam, 37);
  EXPECT_EQ(st.train_pos.shard, 1u);
  EXPECT_EQ(st.train_pos.offset, 640u);
  EXPECT_EQ(st.train_pos.epoch, 2u);
  EXPECT_EQ(st.train_shards, sample_state().train_shards);
  EXPECT_EQ(st.config, sample_state().config);
  // Without the checksum (a file from before it) the same.
  ASSERT_OK_AND_ASSIGN(TrainState old, parse_train_state(edited([](json&) {}), "s.json", &adam));
  EXPECT_EQ(old.step, 38);
}

TEST(CheckpointStateTest, AChangeAnywhereFailsTheChecksum) {
  std::string text = train_state_json(sample_state(), 37);
  const size_t at = text.find("0.0003");
  ASSERT_NE(at, std::string::npos);
  text[at + 5] = '4';  // lr 0.0004: valid JSON, valid values, not what was saved
  expect_refused(text, {"fails its XXH3 checksum", "damaged"});
}

TEST(CheckpointStateTest, NegativeAdamStepsAreRefusedNotAnAssertion) {
  expect_refused(edited([](json& j) { j["adam_steps"] = -1; }), {"adam_steps is -1"});
  expect_refused(edited([](json& j) { j["adam_steps"] = 39; }), {"adam_steps is 39", "[0, 38]"});
}

TEST(CheckpointStateTest, ANegativeOffsetIsRefusedNotAnAssertion) {
  expect_refused(edited([](json& j) { j["train_position"]["offset"] = -100; }), {"train_position.offset is -100"});
}

TEST(CheckpointStateTest, AStepPast32BitsIsRefusedNotTruncated) {
  expect_refused(edited([](json& j) { j["step"] = 1000000000000; }), {"step is 1000000000000", "[0, 2147483647]"});
  expect_refused(edited([](json& j) { j["step"] = -3; }), {"step is -3"});
  expect_refused(edited([](json& j) { j["step"] = 2.5; }), {"step is 2.5", "an integer"});
  expect_refused(edited([](json& j) { j["step"] = "38"; }), {"step is \"38\"", "an integer"});
}

TEST(CheckpointStateTest, APositionOutsideItsShardsIsRefused) {
  expect_refused(edited([](json& j) { j["train_position"]["offset"] = 1000000000000000; }),
                 {"train_position.offset is 1000000000000000, past the 2000 tokens of a_train_000001.bin"});
  expect_refused(edited([](json& j) { j["train_position"]["shard"] = 2; }),
                 {"train_position.shard is 2, but train_shards lists 2"});
  expect_refused(edited([](json& j) { j["train_shards"][0]["tokens"] = -5; }), {"train_shards[0].tokens is -5"});
}

TEST(CheckpointStateTest, AnotherFormatOrVersionIsRefused) {
  expect_refused(edited([](json& j) { j["version"] = 9; }), {"version 9", "reads version 1"});
  expect_refused(edited([](json& j) { j["format"] = "other"; }), {"format is 'other'", "strata-checkpoint"});
}

TEST(CheckpointStateTest, MissingAndUnknownFieldsAreRefused) {
  expect_refused(edited([](json& j) { j.erase("step"); }), {"no field 'step'"});
  expect_refused(edited([](json& j) { j["train_position"].erase("epoch"); }), {"no field 'train_position.epoch'"});
  expect_refused(edited([](json& j) { j["stepp"] = 3; }), {"unknown field 'stepp'"});
  expect_refused(edited([](json& j) { j["config"] = 3; }), {"config is number"});
  expect_refused("[1, 2]", {"not an object"});
  expect_refused("{\"step\": 1e400}", {"not valid JSON"});
}

}  // namespace
}  // namespace strata::engine
