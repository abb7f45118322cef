// bench_adam_test.cpp — `strata bench adam` as users drive it: the count parser, and a small run whose JSON lines
// carry every field the issue names, one per working-copy dtype, with positive rates.
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/units.h"
#include "engine/cli/bench_adam.h"

namespace strata::engine {
namespace {

TEST(BenchAdamTest, ParseCountTakesDecimalSuffixesAndRefusesJunk) {
  EXPECT_EQ(parse_count("12345"), 12345u);
  EXPECT_EQ(parse_count("100M"), 100000000u);
  EXPECT_EQ(parse_count("1.5G"), 1500000000u);
  EXPECT_EQ(parse_count("2k"), 2000u);
  EXPECT_EQ(parse_count("1B"), 1000000000u);
  for (const char* bad : {"", "0", "-5", "1.5", "10X", "M", "1e30", "nan"}) EXPECT_EQ(parse_count(bad), 0u) << bad;
}

TEST(BenchAdamTest, JsonLinesCarryTheNamedFields) {
  BenchAdamOptions o;
  o.params = "70001";  // odd: SIMD tails in the last block
  o.steps = 2;
  o.json = true;
  ::testing::internal::CaptureStdout();
  const int rc = run_bench_adam(o);
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(rc, 0) << out;
  std::vector<nlohmann::json> rows;
  size_t at = 0;
  for (size_t nl; (nl = out.find('\n', at)) != std::string::npos; at = nl + 1)
    rows.push_back(nlohmann::json::parse(out.substr(at, nl - at)));
  ASSERT_EQ(rows.size(), 3u) << out;
  const char* dtypes[] = {"f32", "bf16", "f16"};
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    EXPECT_EQ(r.at("dtype"), dtypes[i]);
    EXPECT_EQ(r.at("params"), 70001);
    EXPECT_EQ(r.at("bytes_per_param"), i == 0 ? 28.0 : 30.0);
    for (const char* key : {"seconds_per_step", "params_per_s", "gb_per_s", "probe_gb_per_s", "ratio_to_probe"})
      EXPECT_GT(r.at(key).get<double>(), 0.0) << key;
  }
}

// --nvme runs the optimizer swap pipeline on a real folder and reports it against the disk and the pass.
TEST(BenchAdamTest, NvmeRunReportsTheSwapPipeline) {
  BenchAdamOptions o;
  o.params = "300001";
  o.dtype = "bf16";
  o.steps = 2;
  o.json = true;
  o.sub_group = "100k";
  o.nvme_dir = (std::filesystem::temp_directory_path() / ("strata_bench_adam_" + std::to_string(::getpid()))).string();
  ::testing::internal::CaptureStdout();
  const int rc = run_bench_adam(o);
  const std::string out = ::testing::internal::GetCapturedStdout();
  std::filesystem::remove_all(o.nvme_dir);
  ASSERT_EQ(rc, 0) << out;
  const size_t last_line = out.rfind('\n', out.size() - 2);
  const auto r = nlohmann::json::parse(out.substr(last_line + 1));
  EXPECT_EQ(r.at("bench"), "adam_nvme");
  EXPECT_EQ(r.at("sub_group"), 100000);
  for (const char* key : {"seconds_per_step", "disk_read_gb_per_s", "disk_mixed_gb_per_s", "disk_seconds",
                          "adam_seconds", "ratio_to_bound"})
    EXPECT_GT(r.at(key).get<double>(), 0.0) << key;
}

TEST(BenchAdamTest, BadCountIsAnErrorNamingTheFlag) {
  BenchAdamOptions o;
  o.params = "lots";
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run_bench_adam(o), 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("--params 'lots'"), std::string::npos);
}

}  // namespace
}  // namespace strata::engine
