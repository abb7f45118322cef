// json_config_test.cpp — strict JSON config reading (common/json_config.h): typed getters, errors that name the
// file and the qualified key, unknown keys listed with the valid ones, absent sections, and read_json_file.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "common/json_config.h"

namespace strata {
namespace {

using nlohmann::json;

// Expects `s` to be InvalidArgument whose message contains every one of `parts`.
void expect_invalid(const Status& s, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.is_ok()) << "expected an error mentioning " << parts.front();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  for (const std::string& p : parts)
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
}

TEST(JsonSection, ReadsTypedValuesAndKeepsDefaultsWhenAbsent) {
  const json j = json::parse(R"({"n_layer": 12, "lr": 0.5, "use_bias": true, "name": "gpt2", "steps": 1e6,
                                 "width": 4.0, "unset": null})");
  JsonSection s(&j, "cfg.json", "model");
  int n_layer = 0, width = 0, unset = 77, missing = 5;
  int64_t steps = 0;
  double lr = 0;
  float lr_f = 0;
  bool use_bias = false;
  std::string name;
  ASSERT_TRUE(s.get_int("n_layer", &n_layer).is_ok());
  ASSERT_TRUE(s.get_int("steps", &steps).is_ok());  // 1e6 is an integer a user may write
  ASSERT_TRUE(s.get_int("width", &width).is_ok());  // so is 4.0
  ASSERT_TRUE(s.get_double("lr", &lr).is_ok());
  ASSERT_TRUE(s.get_double("lr", &lr_f).is_ok());
  ASSERT_TRUE(s.get_bool("use_bias", &use_bias).is_ok());
  ASSERT_TRUE(s.get_string("name", &name).is_ok());
  ASSERT_TRUE(s.get_int("unset", &unset).is_ok());  // null reads as absent
  ASSERT_TRUE(s.get_int("missing", &missing).is_ok());
  EXPECT_EQ(n_layer, 12);
  EXPECT_EQ(steps, 1000000);
  EXPECT_EQ(width, 4);
  EXPECT_EQ(lr, 0.5);
  EXPECT_EQ(lr_f, 0.5f);
  EXPECT_TRUE(use_bias);
  EXPECT_EQ(name, "gpt2");
  EXPECT_EQ(unset, 77);
  EXPECT_EQ(missing, 5);
  EXPECT_TRUE(s.finish().is_ok()) << s.finish().to_string();
  EXPECT_TRUE(s.present());
  EXPECT_EQ(s.qualified("n_layer"), "model.n_layer");
}

TEST(JsonSection, IntegerKeysAcceptIntegersAsDoubles) {
  const json j = json::parse(R"({"lr": 3})");
  JsonSection s(&j, "cfg.json", "");
  double lr = 0;
  ASSERT_TRUE(s.get_double("lr", &lr).is_ok());
  EXPECT_EQ(lr, 3.0);
}

TEST(JsonSection, TypeErrorsNameFileQualifiedKeyAndValue) {
  const json j = json::parse(R"({"training": {"lr": "fast", "steps": 2.5, "fp16": 1, "name": 3, "micro": 1e12,
                                              "huge": 18446744073709551615, "tiny_lr": 1e300}})");
  JsonSection root(&j, "cfg.json", "");
  JsonSection t = root.section("training");
  double lr = 0;
  int64_t steps = 0, huge = 0;
  int micro = 0;
  bool fp16 = false;
  std::string name;
  float tiny_lr = 0;
  expect_invalid(t.get_double("lr", &lr), {"cfg.json", "training.lr", "a number", "\"fast\""});
  expect_invalid(t.get_int("steps", &steps), {"cfg.json", "training.steps", "an integer", "2.5"});
  expect_invalid(t.get_bool("fp16", &fp16), {"training.fp16", "true or false", "1"});
  expect_invalid(t.get_string("name", &name), {"training.name", "a string", "3"});
  expect_invalid(t.get_int("micro", &micro), {"training.micro", "32-bit"});  // fits int64, not int
  expect_invalid(t.get_int("huge", &huge), {"training.huge", "integer"});    // beyond int64: no silent wrap
  expect_invalid(t.get_double("tiny_lr", &tiny_lr), {"training.tiny_lr", "float"});  // would become inf
  // A failed read leaves the output at its default.
  EXPECT_EQ(lr, 0.0);
  EXPECT_EQ(steps, 0);
  EXPECT_EQ(micro, 0);
  EXPECT_EQ(huge, 0);
}

TEST(JsonSection, UnknownKeyErrorListsValidKeys) {
  const json j = json::parse(R"({"model": {"n_layer": 2, "n_layers": 3, "n_head": 4}})");
  JsonSection root(&j, "cfg.json", "");
  JsonSection m = root.section("model");
  int n_layer = 0, n_head = 0, n_embd = 0;
  ASSERT_TRUE(m.get_int("n_layer", &n_layer).is_ok());
  ASSERT_TRUE(m.get_int("n_head", &n_head).is_ok());
  ASSERT_TRUE(m.get_int("n_embd", &n_embd).is_ok());  // absent, but asked for: a valid key
  expect_invalid(m.finish(), {"cfg.json", "'n_layers'", "model", "n_embd, n_head, n_layer"});
  EXPECT_TRUE(root.finish().is_ok());  // "model" was asked for
}

TEST(JsonSection, UnknownTopLevelKey) {
  const json j = json::parse(R"({"modle": {}, "training": {}})");
  JsonSection root(&j, "run.json", "");
  (void)root.section("model");
  (void)root.section("training");
  expect_invalid(root.finish(), {"run.json", "'modle'", "model, training"});
}

TEST(JsonSection, AbsentSectionsReadAsEmpty) {
  const json j = json::parse(R"({"training": {}})");
  JsonSection root(&j, "cfg.json", "");
  JsonSection zero = root.section("zero_optimization");
  EXPECT_FALSE(zero.present());
  JsonSection param = zero.section("offload_param");  // nested inside an absent one: absent too
  EXPECT_FALSE(param.present());
  EXPECT_EQ(param.qualified("device"), "zero_optimization.offload_param.device");
  int stage = 2;
  std::string device = "cpu";
  EXPECT_TRUE(zero.get_int("stage", &stage).is_ok());
  EXPECT_TRUE(param.get_string("device", &device).is_ok());
  EXPECT_EQ(stage, 2);
  EXPECT_EQ(device, "cpu");
  EXPECT_TRUE(param.finish().is_ok());
  EXPECT_TRUE(zero.finish().is_ok());
  EXPECT_TRUE(root.section("training").present());
  EXPECT_TRUE(root.finish().is_ok());
}

TEST(JsonSection, NestedErrorsUseTheFullPath) {
  const json j = json::parse(R"({"zero_optimization": {"offload_param": {"device": 1, "pin_mem": true}}})");
  JsonSection root(&j, "ds.json", "");
  JsonSection param = root.section("zero_optimization").section("offload_param");
  std::string device;
  expect_invalid(param.get_string("device", &device), {"ds.json", "zero_optimization.offload_param.device"});
  expect_invalid(param.finish(), {"'pin_mem'", "zero_optimization.offload_param", "device"});
}

TEST(JsonSection, SectionThatIsNotAnObject) {
  const json j = json::parse(R"({"model": 3})");
  JsonSection root(&j, "cfg.json", "");
  JsonSection m = root.section("model");
  int n = 1;
  EXPECT_TRUE(m.get_int("n_layer", &n).is_ok());  // nothing to read in a number
  EXPECT_EQ(n, 1);
  expect_invalid(m.finish(), {"cfg.json", "model must be an object", "3"});
  const json top = json::parse("[1, 2]");
  expect_invalid(JsonSection(&top, "cfg.json", "").finish(), {"the config must be an object"});
}

TEST(JsonSection, AcceptUnusedReportsPresentKeys) {
  const json j = json::parse(R"({"aio": {"block_size": 1048576, "queue_depth": 8, "overlap_events": true}})");
  JsonSection root(&j, "ds.json", "");
  JsonSection aio = root.section("aio");
  int64_t block = 0;
  ASSERT_TRUE(aio.get_int("block_size", &block).is_ok());
  std::vector<std::string> unused;
  aio.accept_unused({"queue_depth", "overlap_events", "single_submit"}, &unused);
  EXPECT_EQ(unused, (std::vector<std::string>{"aio.queue_depth", "aio.overlap_events"}));
  EXPECT_TRUE(aio.finish().is_ok()) << aio.finish().to_string();
  aio.accept_unused({"queue_depth"}, nullptr);  // a null list is allowed
}

// --- read_json_file -------------------------------------------------------------------------------------------

class ReadJsonFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_json_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }
  std::filesystem::path dir_;
};

TEST_F(ReadJsonFile, ParsesAFile) {
  const std::string path = write("ok.json", R"({"model": {"n_layer": 2}})");
  Result<json> r = read_json_file(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)["model"]["n_layer"], 2);
}

TEST_F(ReadJsonFile, MissingFileIsNotFoundNamingThePath) {
  const std::string path = (dir_ / "absent.json").string();
  Result<json> r = read_json_file(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
}

TEST_F(ReadJsonFile, SyntaxErrorNamesThePathAndPlace) {
  const std::string path = write("bad.json", "{\"model\": {\"n_layer\": 2,}\n}");
  Result<json> r = read_json_file(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("line 1"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace strata
