// `strata bench nvme` as a user drives it: byte counts, bad flags rejected with exit code 2 before any I/O, and
// small real runs whose --json lines carry every field the issue names, move the bytes asked for, and leave
// nothing behind in the directory.
#include "common/units.h"
#include "engine/cli/bench_nvme.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

TEST(ParseBytesTest, UnitsAndMalformedText) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("4k"), 4096u);
  EXPECT_EQ(parse_bytes("4K"), 4096u);
  EXPECT_EQ(parse_bytes("1M"), uint64_t{1} << 20);
  EXPECT_EQ(parse_bytes("512MiB"), uint64_t{512} << 20);
  EXPECT_EQ(parse_bytes("2G"), uint64_t{2} << 30);
  EXPECT_EQ(parse_bytes("1TB"), uint64_t{1} << 40);
  for (const char* bad : {"", "G", "1X", "1MM", "-1", "one", "99999999999999999999", "20000000T"}) EXPECT_EQ(parse_bytes(bad), 0u) << bad;
}

TEST(FormatBytesTest, ThreeSignificantDigitsInTheLargestUnitBelow1000) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(812), "812 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(12800), "12.5 KiB");
  EXPECT_EQ(format_bytes(uint64_t{256} << 10), "256 KiB");
  EXPECT_EQ(format_bytes(uint64_t{1023} << 10), "1.00 MiB");  // 1023 KiB rounds up into the next unit
  EXPECT_EQ(format_bytes(uint64_t{768} << 30), "768 GiB");
  EXPECT_EQ(format_bytes(uint64_t{15} << 40), "15.0 TiB");
  EXPECT_EQ(format_bytes(UINT64_MAX), "16.0 EiB");
}

class BenchNvmeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_bench_nvme_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    opts_.dir = (dir_ / "made" / "here").string();  // the bench makes missing directories
    opts_.size = "8M";
    opts_.block_size = "256K";
    opts_.tensor_size = "1M";
    opts_.queue_depth = 4;
    opts_.json = true;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs the bench with stdout captured; returns its exit code and the lines it printed.
  int run(std::vector<std::string>* lines) {
    std::fflush(stdout);
    const std::string out = (dir_ / "stdout.txt").string();
    const int saved = ::dup(1);
    FILE* f = std::fopen(out.c_str(), "w");
    ::dup2(::fileno(f), 1);
    const int rc = run_bench_nvme(opts_);
    std::fflush(stdout);
    ::dup2(saved, 1);
    ::close(saved);
    std::fclose(f);
    lines->clear();
    FILE* in = std::fopen(out.c_str(), "r");
    char buf[4096];
    while (std::fgets(buf, sizeof buf, in) != nullptr) lines->emplace_back(buf);
    std::fclose(in);
    return rc;
  }

  fs::path dir_;
  BenchNvmeOptions opts_;
};

TEST_F(BenchNvmeTest, BadFlagsExitTwoBeforeAnyIo) {
  std::vector<std::string> lines;
  for (auto set : std::vector<void (*)(BenchNvmeOptions&)>{
           [](BenchNvmeOptions& o) { o.size = "lots"; },
           [](BenchNvmeOptions& o) { o.block_size = "1000"; },  // not a multiple of 4K
           [](BenchNvmeOptions& o) { o.tensor_size = std::string(1, '0'); },  // a literal trips GCC 12 -Wrestrict
           [](BenchNvmeOptions& o) { o.size = "64K"; },  // smaller than the block
           [](BenchNvmeOptions& o) { o.queue_depth = 0; },
           [](BenchNvmeOptions& o) { o.engine = "libaio"; },
           [](BenchNvmeOptions& o) { o.patterns = "seq_read,sideways"; }}) {
    BenchNvmeOptions saved = opts_;
    set(opts_);
    EXPECT_EQ(run(&lines), 2);
    opts_ = saved;
  }
  EXPECT_FALSE(fs::exists(opts_.dir)) << "rejected runs must not touch the disk";
}

TEST_F(BenchNvmeTest, JsonLinesForEveryLayerAndPatternOnBothEngines) {
  for (const char* engine : {"io_uring", "posix"}) {
    SCOPED_TRACE(engine);
    opts_.engine = engine;
    std::vector<std::string> lines;
    ASSERT_EQ(run(&lines), 0);
    std::set<std::pair<std::string, std::string>> seen;
    size_t checksum_lines = 0;
    for (const std::string& line : lines) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("checksum")) {  // after the store layer: the checksum's rate on both paths
        ++checksum_lines;
        const auto& c = j.at("checksum");
        EXPECT_TRUE(c.at("path") == "avx2" || c.at("path") == "sse2") << line;
        EXPECT_GT(c.at("gb_per_s").get<double>(), 0) << line;
        EXPECT_GT(c.at("libxxhash_gb_per_s").get<double>(), 0) << line;
        continue;
      }
      const std::string layer = j.at("layer"), pattern = j.at("pattern");
      seen.emplace(layer, pattern);
      EXPECT_EQ(j.at("bytes").get<uint64_t>(), uint64_t{8} << 20) << line;
      EXPECT_GT(j.at("seconds").get<double>(), 0) << line;
      EXPECT_NEAR(j.at("mib_per_s").get<double>(), 8 / j.at("seconds").get<double>(), 1e-6 * j.at("mib_per_s").get<double>());
      EXPECT_EQ(j.at("block_size").get<uint64_t>(), 256u << 10);
      EXPECT_EQ(j.at("queue_depth").get<uint64_t>(), 4u);
      EXPECT_EQ(j.at("engine").get<std::string>(), engine);
    }
    EXPECT_EQ(lines.size(), 9u);
    EXPECT_EQ(checksum_lines, 1u);
    for (const char* layer : {"engine", "store"})
      for (const char* pattern : {"seq_write", "seq_read", "rand_write", "rand_read"})
        EXPECT_TRUE(seen.count({layer, pattern})) << layer << " " << pattern;
    EXPECT_TRUE(fs::is_empty(opts_.dir)) << "scratch and swap files must be removed";
  }
}

TEST_F(BenchNvmeTest, SweepEndsWithTheAioSection) {
  opts_.size = "4M";
  opts_.sweep = true;
  std::vector<std::string> lines;
  ASSERT_EQ(run(&lines), 0);
  ASSERT_FALSE(lines.empty());
  const auto last = nlohmann::json::parse(lines.back());
  const auto& aio = last.at("best").at("aio");
  for (const char* key : {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"})
    EXPECT_TRUE(aio.contains(key)) << key;
  EXPECT_GT(last.at("best").at("mib_per_s").get<double>(), 0);
  size_t store_lines = 0, checksum_lines = 0;
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    const auto j = nlohmann::json::parse(lines[i]);
    if (j.contains("checksum")) {
      ++checksum_lines;
      continue;
    }
    store_lines += j.at("layer") == "store";
  }
  EXPECT_EQ(store_lines, 2u);  // seq_write and seq_read at the best settings
  EXPECT_EQ(checksum_lines, 1u);
  EXPECT_TRUE(fs::is_empty(opts_.dir));
}

}  // namespace
}  // namespace strata::engine
