// mpi_comm_test.cpp — run by CTest under `mpiexec -np 4` (oversubscribed on two cores): every collective and
// message of the MPI Communicator against its definition (integer-valued floats, so the sums are exact), the
// rank grid's coordinates and groups, refusal of a world that does not factor, a config that differs on one
// rank named on every rank, and a rank that does not arrive turning into a DeadlineExceeded error in time.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm/grid.h"
#include "comm/mpi_communicator.h"
#include "common/timer.h"

namespace strata::comm {
namespace {

std::unique_ptr<MpiCommunicator> world(double timeout_s = 60) {
  auto w = MpiCommunicator::world(MpiOptions{.timeout_s = timeout_s, .roll_call_s = std::min(2.0, timeout_s)});
  EXPECT_TRUE(w.is_ok()) << w.status().to_string();
  return std::move(w).value();
}

TEST(MpiCommTest, RunsOnFourRanks) { EXPECT_EQ(world()->size(), 4) << "run under mpiexec -np 4 (CTest does)"; }

TEST(MpiCommTest, CollectivesMatchTheirDefinitions) {
  auto w = world();
  const int r = w->rank(), n = w->size();
  constexpr size_t kCount = 1000;  // per rank
  std::vector<float> mine(kCount);
  for (size_t i = 0; i < kCount; ++i) mine[i] = static_cast<float>((r + 1) * 1000 + i);

  std::vector<float> sum(kCount), max(kCount);
  ASSERT_TRUE(w->all_reduce(mine.data(), sum.data(), kCount, DType::kF32, ReduceOp::kSum).is_ok());
  ASSERT_TRUE(w->all_reduce(mine.data(), max.data(), kCount, DType::kF32, ReduceOp::kMax).is_ok());
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(sum[i], static_cast<float>(1000 * n * (n + 1) / 2 + n * i)) << i;
    ASSERT_EQ(max[i], static_cast<float>(n * 1000 + i)) << i;
  }
  std::vector<float> inplace = mine;
  ASSERT_TRUE(w->all_reduce(inplace.data(), inplace.data(), kCount, DType::kF32, ReduceOp::kSum).is_ok());
  EXPECT_EQ(inplace, sum);

  std::vector<float> gathered(kCount * n);
  ASSERT_TRUE(w->all_gather(mine.data(), gathered.data(), kCount, DType::kF32).is_ok());
  for (int q = 0; q < n; ++q)
    for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(gathered[q * kCount + i], static_cast<float>((q + 1) * 1000 + i));

  // reduce_scatter of every rank's copy of `gathered` scaled by (rank + 1): shard r is sum(q+1) * its part.
  std::vector<float> scaled(gathered), shard(kCount);
  for (float& x : scaled) x *= static_cast<float>(r + 1);
  ASSERT_TRUE(w->reduce_scatter(scaled.data(), shard.data(), kCount, DType::kF32, ReduceOp::kSum).is_ok());
  for (size_t i = 0; i < kCount; ++i)
    ASSERT_EQ(shard[i], static_cast<float>(n * (n + 1) / 2) * gathered[r * kCount + i]) << i;

  for (int root = 0; root < n; ++root) {
    std::vector<uint16_t> b(17, static_cast<uint16_t>(r == root ? 40000 + root : 0));
    ASSERT_TRUE(w->broadcast(b.data(), b.size(), DType::kBF16, root).is_ok());
    EXPECT_EQ(b, std::vector<uint16_t>(17, static_cast<uint16_t>(40000 + root)));
  }

  // A ring: even ranks send first, odd ranks receive first (blocking messages).
  std::vector<float> from_left(kCount);
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  auto send = [&] { return w->send(mine.data(), kCount, DType::kF32, right, 7); };
  auto recv = [&] { return w->recv(from_left.data(), kCount, DType::kF32, left, 7); };
  if (r % 2 == 0) {
    ASSERT_TRUE(send().is_ok());
    ASSERT_TRUE(recv().is_ok());
  } else {
    ASSERT_TRUE(recv().is_ok());
    ASSERT_TRUE(send().is_ok());
  }
  EXPECT_EQ(from_left[0], static_cast<float>((left + 1) * 1000));
  EXPECT_TRUE(w->barrier().is_ok());

  // Bad input is refused by name, before any rank waits on another.
  const Status bf16 = w->all_reduce(mine.data(), sum.data(), kCount, DType::kBF16, ReduceOp::kSum);
  EXPECT_EQ(bf16.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bf16.message().find("fp32 only"), std::string::npos) << bf16.to_string();
  EXPECT_EQ(w->send(mine.data(), 1, DType::kF32, n, 0).code(), StatusCode::kInvalidArgument);
}

// A reduce-scatter larger than one piece (cut into pieces of kReducePiece per rank, packed) and an all-gather in
// place (send is this rank's part of recv) give what their definitions say.
TEST(MpiCommTest, LargeReduceScatterAndInPlaceAllGather) {
  auto w = world();
  const int r = w->rank(), n = w->size();
  const size_t count = 2 * MpiCommunicator::kReducePiece + 777;  // two whole pieces and a short one
  std::vector<float> whole(count * n), shard(count);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>((i % 4093) * (r + 1));
  ASSERT_TRUE(w->reduce_scatter(whole.data(), shard.data(), count, DType::kF32, ReduceOp::kSum).is_ok());
  const float ranks = static_cast<float>(n * (n + 1) / 2);
  for (size_t i = 0; i < count; ++i) ASSERT_EQ(shard[i], ranks * static_cast<float>((r * count + i) % 4093)) << i;

  std::vector<float> gathered(count * n, -1.0f);
  std::copy(shard.begin(), shard.end(), gathered.begin() + static_cast<std::ptrdiff_t>(r * count));
  ASSERT_TRUE(w->all_gather(gathered.data() + r * count, gathered.data(), count, DType::kF32).is_ok());
  for (size_t i = 0; i < gathered.size(); ++i) ASSERT_EQ(gathered[i], ranks * static_cast<float>(i % 4093)) << i;
}

// Every (tp, pp) that factors 4 ranks: coordinates round-trip, and a sum over each group adds exactly the world
// ranks that share the other two coordinates.
TEST(MpiCommTest, GridGroupsAreTheRanksSharingTheOtherCoordinates) {
  auto w = world();
  for (const auto& [tp, pp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {1, 2}, {2, 2}, {4, 1}, {1, 4}}) {
    SCOPED_TRACE(::testing::Message() << "tp " << tp << " pp " << pp);
    auto g = RankGrid::create(*w, tp, pp);
    ASSERT_TRUE(g.is_ok()) << g.status().to_string();
    RankGrid& grid = *g.value();
    EXPECT_EQ(grid.tp_size() * grid.dp_size() * grid.pp_size(), 4);
    for (int q = 0; q < 4; ++q) EXPECT_EQ(grid.world_rank(grid.coords(q)), q);
    const GridCoords me = grid.me();
    EXPECT_EQ(grid.tp().rank(), me.tp);
    EXPECT_EQ(grid.dp().rank(), me.dp);
    EXPECT_EQ(grid.pp().rank(), me.pp);
    struct Case {
      Communicator* c;
      int GridCoords::*varies;
    };
    for (const Case& k : {Case{&grid.tp(), &GridCoords::tp}, Case{&grid.dp(), &GridCoords::dp},
                          Case{&grid.pp(), &GridCoords::pp}}) {
      float x = static_cast<float>(1 << w->rank()), got = 0;
      ASSERT_TRUE(k.c->all_reduce(&x, &got, 1, DType::kF32, ReduceOp::kSum).is_ok());
      int want = 0;
      for (int q = 0; q < 4; ++q) {
        GridCoords c = grid.coords(q);
        c.*k.varies = me.*k.varies;  // q shares my group if only that coordinate differs
        if (c.tp == me.tp && c.dp == me.dp && c.pp == me.pp) want += 1 << q;
      }
      EXPECT_EQ(got, static_cast<float>(want)) << k.c->name();
    }
  }
  const auto bad = RankGrid::create(*w, 3, 1);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("tensor_parallel_size 3"), std::string::npos) << bad.status().to_string();
}

TEST(MpiCommTest, ARankWithAnotherConfigIsNamedOnEveryRank) {
  auto w = world();
  EXPECT_TRUE(check_same_run(*w, "{\"model\": 1}").is_ok());
  const Status st = check_same_run(*w, w->rank() == 2 ? "{\"model\": 2}" : "{\"model\": 1}");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("rank(s) 2 run a different configuration"), std::string::npos) << st.to_string();
}

// Rank 3 arrives 6 s late at an all-reduce whose timeout is 1 s: the others fail with DeadlineExceeded naming
// the call and the group well before it arrives (after the timeout and a 1 s roll call: about 2 s, bounded at
// 4.5 so that 4 ranks on 2 busy cores still pass), and the group is poisoned; its late arrival lets the abandoned
// requests complete, so the communicators are freed cleanly and the world goes on.
TEST(MpiCommTest, ARankThatDoesNotArriveIsADeadlineNotAHang) {
  auto w = world();
  auto quick_world = world(1.0);
  auto g = quick_world->split(0, w->rank(), "late");
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  std::unique_ptr<Communicator> late = std::move(g).value();
  float x = 1, y = 0;
  if (w->rank() == 3) {
    std::this_thread::sleep_for(std::chrono::seconds(6));
    EXPECT_TRUE(late->all_reduce(&x, &y, 1, DType::kF32, ReduceOp::kSum).is_ok());
    EXPECT_EQ(y, 4.0f);
  } else {
    Timer t;
    const Status st = late->all_reduce(&x, &y, 1, DType::kF32, ReduceOp::kSum);
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.to_string();
    EXPECT_LT(t.seconds(), 4.5) << "it gave up at the timeout and the roll call, not when the late rank came";
    EXPECT_NE(st.message().find("all_reduce(sum)"), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find("group 'late'"), std::string::npos) << st.to_string();
    // The roll call names the rank that never came, and only it (the others wait in the same call).
    EXPECT_NE(st.message().find("rank(s) 3 of group 'late' did not answer"), std::string::npos) << st.to_string();
    EXPECT_EQ(late->barrier().code(), StatusCode::kDeadlineExceeded) << "poisoned";
  }
  late.reset();
  quick_world.reset();
  EXPECT_TRUE(w->barrier().is_ok());
}

// What the ranks do while one writes a checkpoint: raise their timeout for a wait known to be long, then put
// it back. The same late rank that fails the 1 s group above is waited for.
TEST(MpiCommTest, ARaisedTimeoutWaitsForALateRankAndCanBeLoweredAgain) {
  auto w = world();
  auto quick_world = world(1.0);
  auto g = quick_world->split(0, w->rank(), "patient");
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  std::unique_ptr<Communicator> patient = std::move(g).value();
  EXPECT_EQ(patient->timeout(), 1.0);
  patient->set_timeout(10.0);
  float x = 1, y = 0;
  if (w->rank() == 3) std::this_thread::sleep_for(std::chrono::seconds(2));
  const Status st = patient->all_reduce(&x, &y, 1, DType::kF32, ReduceOp::kSum);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(y, 4.0f);
  patient->set_timeout(1.0);
  EXPECT_EQ(patient->timeout(), 1.0);
  EXPECT_TRUE(patient->barrier().is_ok());
  patient.reset();
  quick_world.reset();
  EXPECT_TRUE(w->barrier().is_ok());
}

}  // namespace
}  // namespace strata::comm
