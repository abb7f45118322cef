// tensor_parallel_test.cpp — the tensor-parallel split of GPT-2's units (engine/model/unit_split.h): every rank's
// slices of a unit, assembled, give back the whole unit; the slices have the shapes Megatron-LM's column- and
// row-parallel linears need; the replicated ranges are the replicated tensors; and a sum of squares that leaves
// ranges out counts every other element once.
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "engine/model/gpt2/gpt2.h"
#include "engine/model/unit_split.h"

namespace strata::engine {
namespace {

// A GPT-2 block of width C in the canonical order, as GPT2::create lays it out.
FlatLayout block_layout(int64_t C) {
  FlatLayout b;
  b.add("h.0.ln_1.weight", {C});
  b.add("h.0.ln_1.bias", {C});
  b.add("h.0.attn.c_attn.weight", {3 * C, C});
  b.add("h.0.attn.c_attn.bias", {3 * C});
  b.add("h.0.attn.c_proj.weight", {C, C});
  b.add("h.0.attn.c_proj.bias", {C});
  b.add("h.0.ln_2.weight", {C});
  b.add("h.0.ln_2.bias", {C});
  b.add("h.0.mlp.c_fc.weight", {4 * C, C});
  b.add("h.0.mlp.c_fc.bias", {4 * C});
  b.add("h.0.mlp.c_proj.weight", {C, 4 * C});
  b.add("h.0.mlp.c_proj.bias", {C});
  return b;
}

UnitSplit split_of(FlatLayout whole, int size) {
  std::vector<TensorSplit> splits;
  for (const TensorSpec& s : whole.specs()) splits.push_back(gpt2_tensor_split(s.name));
  return UnitSplit(std::move(whole), std::move(splits), size);
}

TEST(TensorParallelSplit, SlicesAssembleToTheWholeUnit) {
  for (int size : {1, 2, 4}) {
    const UnitSplit split = split_of(block_layout(8), size);
    std::vector<float> whole(split.whole().numel());
    std::iota(whole.begin(), whole.end(), 1.0f);
    std::vector<float> rebuilt(whole.size(), 0.0f);
    for (int r = 0; r < size; ++r) {
      std::vector<float> local(split.local(r).numel(), -1.0f);
      split.slice(whole.data(), r, local.data());
      split.assemble(local.data(), r, rebuilt.data());
    }
    EXPECT_EQ(rebuilt, whole) << "size " << size;
  }
}

TEST(TensorParallelSplit, ShapesAreMegatronsColumnAndRowParallelLinears) {
  const int64_t C = 8;
  const UnitSplit split = split_of(block_layout(C), 2);
  const FlatLayout& l = split.local(1);
  auto shape = [&](const char* name) { return l.find(name)->shape; };
  EXPECT_EQ(shape("h.0.attn.c_attn.weight"), (std::vector<int64_t>{3 * C / 2, C}));
  EXPECT_EQ(shape("h.0.attn.c_attn.bias"), (std::vector<int64_t>{3 * C / 2}));
  EXPECT_EQ(shape("h.0.attn.c_proj.weight"), (std::vector<int64_t>{C, C / 2}));
  EXPECT_EQ(shape("h.0.attn.c_proj.bias"), (std::vector<int64_t>{C}));
  EXPECT_EQ(shape("h.0.mlp.c_fc.weight"), (std::vector<int64_t>{2 * C, C}));
  EXPECT_EQ(shape("h.0.mlp.c_proj.weight"), (std::vector<int64_t>{C, 2 * C}));
  EXPECT_EQ(shape("h.0.ln_2.weight"), (std::vector<int64_t>{C}));
  // Rank 1's q rows are the whole q's second half, then its k and v halves: an ordinary QKV of C/2 per part.
  std::vector<float> whole(split.whole().numel());
  std::iota(whole.begin(), whole.end(), 0.0f);
  std::vector<float> local(l.numel());
  split.slice(whole.data(), 1, local.data());
  const size_t w_off = split.whole().find("h.0.attn.c_attn.bias")->offset;
  const size_t l_off = l.find("h.0.attn.c_attn.bias")->offset;
  for (int part = 0; part < 3; ++part)
    for (int i = 0; i < C / 2; ++i)
      EXPECT_EQ(local[l_off + part * C / 2 + i], whole[w_off + part * C + C / 2 + i]) << "part " << part << " " << i;
  // Row-parallel: rank 1 holds the second half of each row's input columns.
  const size_t pw = split.whole().find("h.0.attn.c_proj.weight")->offset;
  const size_t pl = l.find("h.0.attn.c_proj.weight")->offset;
  EXPECT_EQ(local[pl + 3 * (C / 2) + 1], whole[pw + 3 * C + C / 2 + 1]);
}

// The vocabulary of 97 over 2 ranks: 49 and 48 rows; over 4: 25, 25, 25, 22.
TEST(TensorParallelSplit, UnevenVocabularySlices) {
  FlatLayout emb;
  emb.add("wte", {97, 4});
  emb.add("wpe", {16, 4});
  const UnitSplit two = split_of(emb, 2);
  EXPECT_EQ(two.local(0).find("wte")->shape[0], 49);
  EXPECT_EQ(two.local(1).find("wte")->shape[0], 48);
  EXPECT_EQ(two.max_local_numel(), 49u * 4 + 16 * 4);
  EXPECT_EQ(row_slice(97, 3, 4).start, 75);
  EXPECT_EQ(row_slice(97, 3, 4).count, 22);
  // wpe is replicated: rank 1's only replicated range is its wpe, right after its 48 wte rows.
  EXPECT_EQ(two.replicated_ranges(1), (Ranges{{48 * 4, 16 * 4}}));
}

TEST(TensorParallelSplit, ReplicatedRangesAreMergedAndInOrder) {
  const UnitSplit split = split_of(block_layout(8), 2);
  const FlatLayout& l = split.local(0);
  const Ranges r = split.replicated_ranges(0);
  // ln_1 (weight, bias) merged; c_proj.bias, ln_2 (weight, bias) merged; mlp.c_proj.bias.
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], (std::pair<size_t, size_t>{0, 16}));
  EXPECT_EQ(r[1], (std::pair<size_t, size_t>{l.find("h.0.attn.c_proj.bias")->offset, 24}));
  EXPECT_EQ(r[2], (std::pair<size_t, size_t>{l.find("h.0.mlp.c_proj.bias")->offset, 8}));
}

TEST(SumSquaresExcluding, CountsEveryElementOutsideTheRangesOnce) {
  std::vector<float> x(100);
  std::iota(x.begin(), x.end(), 1.0f);
  auto sum_squares = [](const float* p, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += double(p[i]) * p[i];
    return s;
  };
  const Ranges excluded = {{5, 10}, {30, 5}, {90, 20}};
  auto expect = [&](size_t offset, size_t n) {
    double want = 0;
    for (size_t i = offset; i < offset + n; ++i) {
      bool out = false;
      for (const auto& [o, len] : excluded) out |= i >= o && i < o + len;
      if (!out) want += double(x[i]) * x[i];
    }
    EXPECT_EQ(sum_squares_excluding(x.data() + offset, offset, n, excluded, sum_squares), want)
        << "offset " << offset << " n " << n;
  };
  expect(0, 100);
  expect(7, 50);   // starts inside a range
  expect(32, 60);  // ends inside a range
  expect(40, 10);  // between ranges
  expect(6, 3);    // inside one
  EXPECT_EQ(sum_squares_excluding(x.data(), 0, 100, {}, sum_squares), sum_squares(x.data(), 100));
}

}  // namespace
}  // namespace strata::engine
