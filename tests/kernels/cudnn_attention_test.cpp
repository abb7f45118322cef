// cudnn_attention_test.cpp — what of cuDNN's attention (kernels/cuda/cudnn_attention.cpp) can be checked without
// a GPU, and the record that makes more of it checkable:
// - cuDNN finalizes every tensor, operation and operation graph of both directions (each form the backend may
//   try) at GPT-2's shapes and at small ones;
// - on a GPU, its properties as cuDNN serializes them are printed on one line ("cuDNN device properties: ...");
//   kept in tests/fixtures/cudnn/NAME.json, they let a machine without that GPU have cuDNN choose the engines
//   and build both directions' plans for it (each backward form first) — the step that finds whether cuDNN has
//   a fused engine for these graphs at all. Running them needs the GPU (cuda_ops_test AttentionCudnn).
// Skips, saying why, where cuDNN cannot be loaded.
#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/cudnn_graph.h"
#include "tests/kernels/cuda_ops_test_util.h"

namespace strata::kernels::cuda {
namespace {

namespace fs = std::filesystem;

// GPT-2 124M's and the 2.5B model's shapes at B=8, T=1024, small ones with ragged last tiles, a head size of 128
// (the flash kernels take 32 and 64 only), and engine_gpu_train_test's (hs 16, T 37), which the GPU session also
// trains through cuDNN.
const std::vector<std::tuple<int, int, int, int>> kShapes = {
    {8, 1024, 12, 64}, {8, 1024, 32, 64}, {2, 67, 2, 64}, {1, 200, 8, 32}, {2, 256, 4, 128}, {3, 37, 4, 16}};

TEST(CudnnAttentionGraphs, FinalizeWithoutADevice) {
  if (const auto loaded = cudnn::load(); !loaded.is_ok())
    GTEST_SKIP() << "cuDNN not loadable here: " << loaded.status().message();
  for (auto [B, T, NH, hs] : kShapes) {
    SCOPED_TRACE(fmt::format("B={} T={} NH={} hs={}", B, T, NH, hs));
    std::string why;
    EXPECT_TRUE(cudnn_attention_graphs_finalize(B, T, NH, hs, &why)) << why;
  }
}

TEST(CudnnAttentionGraphs, PrintsTheDeviceProperties) {
  if (const Status s = cuda_available(); !s.is_ok()) GTEST_SKIP() << "no GPU to describe: " << s.message();
  if (const auto loaded = cudnn::load(); !loaded.is_ok())
    GTEST_SKIP() << "cuDNN not loadable here: " << loaded.status().message();
#ifdef STRATA_HAVE_CUDNN
  const auto json = cudnn::device_properties_json();
  ASSERT_TRUE(json.is_ok()) << json.status().to_string();
  ASSERT_FALSE(json.value().empty());
  EXPECT_EQ(json.value().find('\n'), std::string::npos) << "not one line";
  std::cout << "cuDNN device properties (" << cuda_device_description() << "): " << json.value() << "\n";
  // It must read back.
  EXPECT_TRUE(cudnn::device_properties(json.value()).is_ok());
#endif
}

// Where there is no GPU, the toolkit's stub of the driver library (whose soname, libcuda.so.1, cuDNN then finds
// already loaded) lets cuDNN compile its kernels; only loading them fails.
Status stand_in_for_the_driver() {
  if (cuda_available().is_ok()) return Status::ok();  // the real driver
  const std::string stub = std::string(STRATA_CUDA_STUBS_DIR) + "/libcuda.so";
  if (::dlopen(stub.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr)
    return Status::not_found("no driver and no stub of it ({})", ::dlerror());
  return Status::ok();
}

// cuDNN must choose an engine for both directions' graphs and compile its kernels, for each GPU recorded, at GPT-2
// 124M's and the 2.5B model's shapes and at small ones. The one recorded file until a GPU session prints the
// real properties: h100_sxm_from_specs.json, an H100 SXM's cudaDeviceProp written from its published figures.
TEST(CudnnAttentionGraphs, PlansForTheRecordedGpus) {
  if (const auto loaded = cudnn::load(); !loaded.is_ok())
    GTEST_SKIP() << "cuDNN not loadable here: " << loaded.status().message();
  if (const Status s = stand_in_for_the_driver(); !s.is_ok()) GTEST_SKIP() << s.message();
  const fs::path dir = fs::path(STRATA_SOURCE_DIR) / "tests/fixtures/cudnn";
  std::vector<fs::path> recorded;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".json") recorded.push_back(e.path());
  if (recorded.empty())
    GTEST_SKIP() << "no GPU's cuDNN properties recorded in " << dir.string()
                 << " (a GPU run of PrintsTheDeviceProperties prints them)";
  for (const fs::path& path : recorded) {
    std::ifstream in(path);
    std::stringstream json;
    json << in.rdbuf();
    for (const bool form : {true, false}) {  // the deterministic backward first, then the accumulating one first
      cuda_test::ScopedSwitch<bool> deterministic(cudnn_attention_deterministic, set_cudnn_attention_deterministic,
                                                  form);
      for (auto [B, T, NH, hs] : kShapes) {
        SCOPED_TRACE(fmt::format("{}: B={} T={} NH={} hs={}{}", path.filename().string(), B, T, NH, hs,
                                 form ? "" : ", accumulating dQ"));
        std::string how;
        EXPECT_TRUE(cudnn_attention_plans_for_device(json.str(), B, T, NH, hs, &how)) << how;
        EXPECT_NE(how.find(form ? "backward deterministic" : "backward accumulating"), std::string::npos)
            << "the backward took the other form";
        std::cout << fmt::format("{} B={} T={} NH={} hs={}: {}\n", path.filename().string(), B, T, NH, hs, how);
      }
    }
  }
}

}  // namespace
}  // namespace strata::kernels::cuda
