// sample_test.cpp — `strata sample`'s generation loop against the model's own logits, recomputed here for every
// generated position over the window the sampler should have used (the last block_size tokens): greedy takes
// each step's most likely token, top-k draws stay among the k most likely, and the draws depend on the seed
// alone. The context runs past block_size, so the window slides. And `strata sample` itself on a file without
// checksums that holds a NaN.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/foreign_weights.h"
#include "engine/cli/sample_cmd.h"
#include "engine/model/gpt2/gpt2.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/engine/tiny_gpt2_files.h"
#include "tests/test_util.h"

namespace strata::engine {
namespace {

const GPT2Config kConfig{.n_layer = 2, .n_head = 2, .n_embd = 16, .vocab_size = 30, .block_size = 8};
// Longer than block_size: the window slides from the first draw.
constexpr std::array<int32_t, 10> kPrompt = {3, 17, 5, 22, 9, 1, 28, 14, 6, 11};

class SampleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto* m : {&model_, &reference_}) {
      ASSERT_OK_AND_ASSIGN(*m, GPT2::create(kConfig, *kernels::find_kernel_set("fast"),
                                            kernels::MatmulPrecision::kF32));
      ASSERT_OK((*m)->init_weights(11));
    }
  }
  // The tokens ranked by the reference model's logits for what follows ids[0, i), over its last block_size.
  std::vector<int32_t> ranked(const std::vector<int32_t>& ids, size_t i) {
    const size_t T = std::min<size_t>(i, kConfig.block_size);
    EXPECT_TRUE(reference_->forward(ids.data() + i - T, nullptr, 1, static_cast<int>(T)).is_ok());
    const float* row = reference_->logits() + (T - 1) * kConfig.vocab_size;
    std::vector<int32_t> order(kConfig.vocab_size);
    for (int v = 0; v < kConfig.vocab_size; ++v) order[v] = v;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    return order;
  }
  std::vector<int32_t> run(const SampleParams& p) {
    std::vector<int32_t> ids(kPrompt.begin(), kPrompt.end());
    const Status st = sample_tokens(*model_, p, &ids);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return ids;
  }

  std::unique_ptr<GPT2> model_, reference_;
};

TEST_F(SampleTest, GreedyTakesEachStepsMostLikelyTokenOverTheSlidingWindow) {
  SampleParams p;
  p.tokens = 12;
  p.temperature = 0;
  const std::vector<int32_t> ids = run(p);
  ASSERT_EQ(ids.size(), kPrompt.size() + 12);
  for (size_t i = kPrompt.size(); i < ids.size(); ++i) EXPECT_EQ(ids[i], ranked(ids, i)[0]) << "position " << i;
  p.temperature = 1;
  p.top_k = 1;
  EXPECT_EQ(run(p), ids);  // the top one alone is greedy too
}

TEST_F(SampleTest, DrawsStayInTheTopKAndDependOnTheSeedAlone) {
  SampleParams p;
  p.tokens = 12;
  p.temperature = 2.0;
  p.top_k = 3;
  p.seed = 5;
  const std::vector<int32_t> ids = run(p);
  EXPECT_EQ(run(p), ids);
  size_t not_first = 0;
  for (size_t i = kPrompt.size(); i < ids.size(); ++i) {
    const std::vector<int32_t> order = ranked(ids, i);
    EXPECT_NE(std::find(order.begin(), order.begin() + 3, ids[i]), order.begin() + 3) << "position " << i;
    not_first += ids[i] != order[0];
  }
  EXPECT_GT(not_first, 0u) << "at temperature 2 some draw should not be the most likely token";
  p.seed = 6;
  EXPECT_NE(run(p), ids);
  p.stop_token = ids[kPrompt.size()];  // ends after the first token it draws
  p.seed = 5;
  EXPECT_EQ(run(p).size(), kPrompt.size() + 1);
}

TEST_F(SampleTest, BadContextOrParametersAreRefused) {
  std::vector<int32_t> none;
  EXPECT_FALSE(sample_tokens(*model_, SampleParams{}, &none).is_ok());
  std::vector<int32_t> outside = {1, kConfig.vocab_size};
  const Status st = sample_tokens(*model_, SampleParams{}, &outside);
  EXPECT_NE(st.to_string().find("outside the model's vocabulary"), std::string::npos) << st.to_string();
  SampleParams p;
  p.temperature = -1;
  std::vector<int32_t> ids = {1};
  EXPECT_FALSE(sample_tokens(*model_, p, &ids).is_ok());
}

// An llm.c file (no checksums) with a NaN in a position row the sample never reaches: refused by name, as
// training.init_from and export refuse it, and sampled to the end with --allow-non-finite.
TEST(SampleCommandTest, NonFiniteWeightsAreRefusedUnlessAllowed) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("strata_sample_cmd_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // The tiny tokenizer has 257 tokens; llm.c pads the vocabulary to 384 rows.
  const GPT2Config c{.n_layer = 1, .n_head = 2, .n_embd = 16, .vocab_size = 260, .block_size = 8};
  ASSERT_OK_AND_ASSIGN(auto model, GPT2::create(c, *kernels::find_kernel_set("fast"), kernels::MatmulPrecision::kF32));
  ASSERT_OK(model->init_weights(3));
  ASSERT_OK(save_model(*model, (dir / "model.safetensors").string()));
  const std::string bin = (dir / "model.bin").string();
  ASSERT_OK(export_weights((dir / "model.safetensors").string(), WeightsFormat::kLlmc, bin));
  {
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f.seekp(1024 + (384 + 7) * 16 * 4);  // wpe row 7: the last position, past this sample's 2 + 3 tokens
    f.write(reinterpret_cast<const char*>(&nan), 4);
  }
  SampleOptions o;
  o.model = bin;
  o.prompt = "ab";
  o.encoder_path = ::strata::testing::write_tiny_encoder(dir);
  o.vocab_path = ::strata::testing::write_text_file(dir / "vocab.bpe", "#version: 0.2\n");
  o.params.tokens = 3;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int refused = run_sample(o);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(refused, 1);
  EXPECT_NE(err.find("'wpe' element 112 is nan"), std::string::npos) << err;
  EXPECT_NE(err.find("--allow-non-finite"), std::string::npos) << err;
  o.allow_non_finite = true;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int allowed = run_sample(o);
  const std::string allowed_err = ::testing::internal::GetCapturedStderr();
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(allowed, 0) << allowed_err;
  EXPECT_TRUE(out.starts_with("ab")) << out;
  fs::remove_all(dir);
}

// A token may end inside a character: the printed text holds it back until it is whole.
TEST(Utf8WholePrefixTest, HoldsBackOnlyACharacterThatIsNotWholeYet) {
  EXPECT_EQ(utf8_whole_prefix("ab", 0), 2u);
  EXPECT_EQ(utf8_whole_prefix("ab\xC3", 0), 2u);           // é's first byte
  EXPECT_EQ(utf8_whole_prefix("ab\xC3\xA9", 0), 4u);       // é
  EXPECT_EQ(utf8_whole_prefix("ab\xE2\x82", 1), 2u);       // € cut after two of its three bytes
  EXPECT_EQ(utf8_whole_prefix("ab\xE2\x82\xAC", 2), 5u);   // €
  EXPECT_EQ(utf8_whole_prefix("\xF0\x9F\x98", 0), 0u);     // an emoji's first three bytes
  EXPECT_EQ(utf8_whole_prefix("\xF0\x9F\x98\x80", 0), 4u);
  EXPECT_EQ(utf8_whole_prefix("a\x80\x80", 1), 3u);        // stray continuation bytes: printed as they are
}

}  // namespace
}  // namespace strata::engine
