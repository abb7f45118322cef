// pipeline_plan_test.cpp — the pipeline's stage plan: contiguous non-empty block ranges covering the model once,
// balanced by forward FLOPs (the tied head weighs as much as several blocks), never worse than an even split; and
// which stages hold each unit, from its role alone (an untied head, no position embedding, another order).
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model/gpt2/gpt2.h"
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
    const PipelinePlan plan = plan_pipeline(gpt2_unit_specs(gpt2), gpt2_pipeline_costs(gpt2, 1024), P);
    expect_valid(plan, 12);
    // Never worse than the even split (the first 12 mod P stages one block more).
    double even = 0;
    for (int s = 0; s < P; ++s) {
      const int blocks = 12 / P + (s < 12 % P ? 1 : 0);
      even = std::max(even, blocks * block + (s == P - 1 ? head : 0.0));
    }
    EXPECT_LE(*std::max_element(plan.flops.begin(), plan.flops.end()), even);
  }
  const PipelinePlan two = plan_pipeline(gpt2_unit_specs(gpt2), gpt2_pipeline_costs(gpt2, 1024), 2);
  EXPECT_LT(two.stages[1].end - two.stages[1].first, two.stages[0].end - two.stages[0].first)
      << "the head's stage gets fewer blocks: " << two.describe();
  EXPECT_EQ(two.owner(0), 0) << "the embedding lives on the first stage";
  EXPECT_EQ(two.owner(13), 1) << "ln_f on the last";
  const PipelinePlan each = plan_pipeline(gpt2_unit_specs(gpt2), gpt2_pipeline_costs(gpt2, 1024), 12);
  for (int s = 0; s < 12; ++s) EXPECT_EQ(each.owner(static_cast<size_t>(s) + 1), s);
}

// A family of another shape: an untied head listed before the final norm, no position embedding (the embedding
// is the token table alone), the blocks after both. Which stage holds what is the roles', not the indices'.
std::vector<UnitSpec> untied_family(int n_layer) {
  auto unit = [](std::string name, UnitRole role, int block = -1) {
    FlatLayout layout;
    layout.add(name + ".weight", {4, 2});
    return UnitSpec{.name = name, .layout = std::move(layout), .role = role, .block = block};
  };
  std::vector<UnitSpec> units{unit("embed", UnitRole::kEmbedding), unit("lm_head", UnitRole::kHead),
                              unit("norm", UnitRole::kFinalNorm)};
  for (int l = n_layer; l-- > 0;) units.push_back(unit("layers." + std::to_string(l), UnitRole::kBlock, l));
  return units;
}

TEST(PipelinePlanTest, StagesHoldUnitsByTheirRoles) {
  const std::vector<UnitSpec> units = untied_family(6);
  const PipelinePlan plan = plan_pipeline(units, {.block = 1.0, .head = 2.0}, 3);
  expect_valid(plan, 6);
  ASSERT_EQ(plan.holders.size(), units.size());
  EXPECT_EQ(plan.holders[0], std::vector<int>{0}) << "the embedding, untied: the first stage only";
  EXPECT_EQ(plan.holders[1], std::vector<int>{2}) << "the head: the last";
  EXPECT_EQ(plan.holders[2], std::vector<int>{2}) << "the final norm: the last";
  for (size_t u = 3; u < units.size(); ++u) {
    const int b = units[u].block;
    ASSERT_EQ(plan.holders[u].size(), 1u) << units[u].name;
    const PipelineStage& st = plan.stages[static_cast<size_t>(plan.owner(u))];
    EXPECT_TRUE(b >= st.first && b < st.end) << units[u].name << " on " << plan.describe();
  }
  EXPECT_TRUE(plan.shared_units().empty()) << "nothing is tied";
  // The balance sees the head's weight: blocks cost 1, the head 2, so 6 blocks over 3 stages are 3 | 2 | 1.
  EXPECT_EQ(plan.stages[2].end - plan.stages[2].first, 1) << plan.describe();
}

TEST(PipelinePlanTest, ATiedHeadIsSharedByTheEndsOnly) {
  GPT2Config gpt2;
  gpt2.n_layer = 4, gpt2.n_head = 2, gpt2.n_embd = 8, gpt2.vocab_size = 64, gpt2.block_size = 16;
  const std::vector<UnitSpec> units = gpt2_unit_specs(gpt2);
  for (int P = 1; P <= 4; ++P) {
    SCOPED_TRACE(P);
    const PipelinePlan plan = plan_pipeline(units, gpt2_pipeline_costs(gpt2, 16), P);
    ASSERT_EQ(plan.holders.size(), units.size());
    for (size_t u = 0; u < units.size(); ++u) {
      const bool tied = units[u].role == UnitRole::kEmbedding && P > 1;
      EXPECT_EQ(plan.holders[u].size(), tied ? 2u : 1u) << units[u].name;
    }
    if (P == 1) {
      EXPECT_TRUE(plan.shared_units().empty()) << "one stage holds the tied embedding once";
    } else {
      EXPECT_EQ(plan.shared_units(), std::vector<size_t>{0});
      EXPECT_EQ(plan.holders[0], (std::vector<int>{0, P - 1}));
    }
  }
}

}  // namespace
}  // namespace strata::engine
