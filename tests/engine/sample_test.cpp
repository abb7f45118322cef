// sample_test.cpp — `strata sample`'s generation loop against the model's own logits, recomputed here for every
// generated position over the window the sampler should have used (the last block_size tokens): greedy takes
// each step's most likely token, top-k draws stay among the k most likely, and the draws depend on the seed
// alone. The context runs past block_size, so the window slides.
#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "engine/gpt2.h"
#include "engine/sample_cmd.h"
#include "kernels/cpu/cpu_kernels.h"
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
      ASSERT_OK((*m)->init_gpt2(11));
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
