// json_parse_test.cpp — parsing JSON from outside the process (common/json_parse.h): the depth and size bounds,
// duplicate keys, numbers past a double's range, and errors that name the source and the byte.
#include <string>

#include <gtest/gtest.h>

#include "common/json_parse.h"

namespace strata {
namespace {

void expect_refused(const Result<nlohmann::json>& r, StatusCode code, const std::string& part) {
  ASSERT_FALSE(r.is_ok()) << "accepted; expected an error mentioning " << part;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(part), std::string::npos) << "'" << part << "' not in: " << r.status().message();
}

TEST(ParseJson, ReadsWhatPlainParseReads) {
  const std::string text = R"({"a": [1, 2.5, "x", {"b": null}], "c": {"d": true}, "e": "{[not brackets]}"})";
  Result<nlohmann::json> r = parse_json(text, "t.json");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(*r, nlohmann::json::parse(text));
}

// The safetensors header that crashed export, sample and --init-from with a SIGSEGV: 200,000 levels deep.
TEST(ParseJson, AHeaderNested200000DeepIsRefusedNotAStackOverflow) {
  std::string text = "{\"t\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  expect_refused(parse_json(text, "deep.safetensors", StatusCode::kCorruption), StatusCode::kCorruption,
                 "deep.safetensors: JSON nested more than 64 deep (at byte 69)");
  // Unbalanced too: the bound comes before the parser.
  expect_refused(parse_json(std::string(100000, '{'), "open.json"), StatusCode::kInvalidArgument, "nested more");
}

TEST(ParseJson, BracketsInsideStringsDoNotCountTowardTheDepth) {
  const std::string text = "{\"s\": \"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"}";
  Result<nlohmann::json> r = parse_json(text, "s.json");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->at("s").get<std::string>().size(), 2001u);
}

// 1e400 was an uncaught out_of_range (SIGABRT) in the safetensors reader.
TEST(ParseJson, ANumberPastADoublesRangeIsAnErrorNotAnAbort) {
  expect_refused(parse_json(R"({"x": {"data_offsets": [0, 1e400]}})", "big.safetensors", StatusCode::kCorruption),
                 StatusCode::kCorruption, "big.safetensors: not valid JSON");
}

TEST(ParseJson, ADuplicateKeyIsRefusedByNameAndPlace) {
  expect_refused(parse_json(R"({"wte": 1, "wpe": 2, "wte": 3})", "dup.json"), StatusCode::kInvalidArgument,
                 "dup.json: key 'wte' appears twice in the top-level object");
  expect_refused(parse_json(R"({"model": {"cfg": {"n": 1, "n": 1}}})", "dup.json"), StatusCode::kInvalidArgument,
                 "key 'n' appears twice in object 'model.cfg'");
  // The same key in sibling objects is fine.
  EXPECT_TRUE(parse_json(R"({"a": {"n": 1}, "b": {"n": 2}, "c": [{"n": 3}, {"n": 4}]})", "ok.json").is_ok());
}

TEST(ParseJson, SyntaxErrorsNameTheByte) {
  expect_refused(parse_json(R"({"a": 1,, "b": 2})", "bad.json"), StatusCode::kInvalidArgument, "bad.json: not valid JSON (byte 9)");
  expect_refused(parse_json(R"({"a": 1} trailing)", "tail.json"), StatusCode::kInvalidArgument, "tail.json: not valid JSON");
  expect_refused(parse_json("", "empty.json"), StatusCode::kInvalidArgument, "empty.json: not valid JSON");
}

TEST(ParseJson, TheSizeBoundIsCheckedFirst) {
  JsonLimits small;
  small.max_bytes = 16;
  expect_refused(parse_json(R"({"a": "0123456789abcdef"})", "big.json", StatusCode::kInvalidArgument, small),
                 StatusCode::kInvalidArgument, "big.json: 25 bytes of JSON, past the 16 bytes Strata reads");
}

TEST(JsonExcerpt, CutsLongValuesAndKeepsShortOnes) {
  EXPECT_EQ(json_excerpt(nlohmann::json{{"a", 1}}), R"({"a":1})");
  const std::string long_one = json_excerpt(nlohmann::json(std::string(1000, 'x')), 20);
  EXPECT_EQ(long_one, "\"" + std::string(19, 'x') + "...");
  // Invalid UTF-8 in a string does not throw.
  EXPECT_FALSE(json_excerpt(nlohmann::json(std::string("\xff\xfe"))).empty());
}

}  // namespace
}  // namespace strata
