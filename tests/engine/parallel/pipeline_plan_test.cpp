// pipeline_plan_test.cpp — the pipeline's stage plan: contiguous non-empty block ranges covering the model once,
// balanced by forward FLOPs (the tied head weighs as much as several blocks), never worse than an even split.
#include <algorithm>

#include <gtest/gtest.h>

#include "engine/parallel/pipeline.h"

namespace strata::engine {
namespace {

void expect_valid(const PipelinePlan& plan, int n_layer) {
  ASSERT_FALSE(plan.stages.empty());
  int next = 0;
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const PipelineStage& st = plan.stages[s];
    EXPECT_EQ(st.first, next) << "stage " << s;
    EXPECT_LT(st.first, st.end) << "stage " << s << " is empty";
    EXPECT_EQ(st.embedding, s == 0);
    EXPECT_EQ(st.head, s + 1 == plan.stages.size());
    next = st.end;
  }
  EXPECT_EQ(next, n_layer);
}

TEST(PipelinePlanTest, BalancesTheHeadAgainstBlocks) {
  GPT2Config gpt2;  // GPT-2 124M
  gpt2.n_layer = 12, gpt2.n_head = 12, gpt2.n_embd = 768, gpt2.vocab_size = 50257, gpt2.block_size = 1024;
  const double C = 768, block = 24 * C * C + 2 * C * 1025, head = 2 * C * 50257;
  for (int P = 1; P <= 12; ++P) {
    SCOPED_TRACE(P);
    const PipelinePlan plan = plan_pipeline(gpt2, 1024, P);
    expect_valid(plan, 12);
    // Never worse than the even split (the first 12 mod P stages one block more).
    double even = 0;
    for (int s = 0; s < P; ++s) {
      const int blocks = 12 / P + (s < 12 % P ? 1 : 0);
      even = std::max(even, blocks * block + (s == P - 1 ? head : 0.0));
    }
    EXPECT_LE(*std::max_element(plan.flops.begin(), plan.flops.end()), even);
  }
  const PipelinePlan two = plan_pipeline(gpt2, 1024, 2);
  EXPECT_LT(two.stages[1].end - two.stages[1].first, two.stages[0].end - two.stages[0].first)
      << "the head's stage gets fewer blocks: " << two.describe();
  EXPECT_EQ(two.owner(0), 0) << "the embedding lives on the first stage";
  EXPECT_EQ(two.owner(13), 1) << "ln_f on the last";
  const PipelinePlan each = plan_pipeline(gpt2, 1024, 12);
  for (int s = 0; s < 12; ++s) EXPECT_EQ(each.owner(static_cast<size_t>(s) + 1), s);
}

}  // namespace
}  // namespace strata::engine
