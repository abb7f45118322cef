#include "common/trace.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const char* name) {
  return (fs::temp_directory_path() / (std::string(name) + "." + std::to_string(getpid()) + ".json")).string();
}

nlohmann::json load(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(TraceTest, OffRecordsNothing) {
  const std::string path = temp_path("trace_off");
  trace::start(16);
  ASSERT_TRUE(trace::write(path).is_ok());  // stops it
  { trace::Span s("while off", 1); }
  trace::instant("while off too");
  trace::end_async("nor this", trace::begin());
  EXPECT_EQ(trace::recorded(), 0u);
  fs::remove(path);
}

TEST(TraceTest, SpansInstantsAndAsyncIntervalsFromSeveralThreads) {
  const std::string path = temp_path("trace_threads");
  trace::start(1024);
  trace::name_thread("main \"quoted\"");
  uint64_t transfer = 0;
  {
    trace::Span outer("outer", 7);
    transfer = trace::begin();
    std::thread worker([] {
      trace::name_thread("worker");
      for (int i = 0; i < 3; ++i) trace::Span s("work", i);
    });
    worker.join();
    trace::instant("mark");
  }
  trace::end_async("transfer", transfer, 4096);
  ASSERT_TRUE(trace::write(path).is_ok());
  const nlohmann::json j = load(path);
  std::map<std::string, int> count;
  std::map<int, std::string> thread_names;
  double outer_ts = -1, outer_dur = -1;
  std::vector<double> work_ts;
  for (const auto& e : j["traceEvents"]) {
    const std::string ph = e["ph"];
    if (ph == "M") {
      thread_names[e["tid"]] = e["args"]["name"];
      continue;
    }
    ++count[ph + ":" + e["name"].get<std::string>()];
    if (e["name"] == "outer") {
      outer_ts = e["ts"];
      outer_dur = e["dur"];
      EXPECT_EQ(e["args"]["arg"], 7);
    }
    if (e["name"] == "work") work_ts.push_back(e["ts"]);
    if (ph == "b") {
      EXPECT_EQ(e["args"]["arg"], 4096);
    }
  }
  EXPECT_EQ(count["X:outer"], 1);
  EXPECT_EQ(count["X:work"], 3);
  EXPECT_EQ(count["i:mark"], 1);
  EXPECT_EQ(count["b:transfer"], 1);
  EXPECT_EQ(count["e:transfer"], 1);
  ASSERT_EQ(work_ts.size(), 3u);
  for (double t : work_ts) {  // inside the span that was open while they ran
    EXPECT_GE(t, outer_ts);
    EXPECT_LE(t, outer_ts + outer_dur);
  }
  std::vector<std::string> names;
  for (const auto& [tid, name] : thread_names) names.push_back(name);
  EXPECT_NE(std::find(names.begin(), names.end(), "main \"quoted\""), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "worker"), names.end());
  fs::remove(path);
}

TEST(TraceTest, AFullBufferDropsAndCounts) {
  const std::string path = temp_path("trace_full");
  trace::start(4);
  for (int i = 0; i < 10; ++i) trace::instant("tick", i);
  EXPECT_EQ(trace::recorded(), 4u);
  EXPECT_EQ(trace::dropped(), 6u);
  ASSERT_TRUE(trace::write(path).is_ok());
  const nlohmann::json j = load(path);
  size_t ticks = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["name"] == "tick") ++ticks;
  }
  EXPECT_EQ(ticks, 4u);
  fs::remove(path);
}

TEST(TraceTest, AnUnwritablePathIsAnErrorNamingIt) {
  trace::start(4);
  const Status st = trace::write("/nonexistent-dir/trace.json");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.to_string().find("/nonexistent-dir/trace.json"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace strata
