// Pinned pool: exact page-rounded sizes, a hard budget that blocks, times out or fails at once, hooks for
// registration, the automatic budget's parsers on fake /proc and cgroup text, and a clean mlock failure.
#include "offload/pinned_pool.h"
#include "tests/test_util.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

std::unique_ptr<PinnedPool> make_pool(size_t budget, bool lock = true) {
  auto pool = PinnedPool::create({.budget_bytes = budget, .lock = lock});
  EXPECT_TRUE(pool.is_ok()) << pool.status().to_string();
  return std::move(pool).value();
}

using ::strata::testing::expect_error;

// Waits for a future from another thread; a hang is a failure, so abort loudly rather than wait for CTest.
template <typename T>
T await(std::future<T>& f, const char* what) {
  if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    std::fprintf(stderr, "pinned_pool_test: %s did not finish in 10 s\n", what);
    std::abort();
  }
  return f.get();
}

class PinnedPoolLockTest : public ::testing::TestWithParam<bool> {};

TEST_P(PinnedPoolLockTest, ExactPageRoundedSizesAndAccounting) {
  auto pool = make_pool(64 * kPage, GetParam());
  auto a = pool->acquire(kPage + 1, "activations");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_EQ(a->size(), kPage + 1);
  EXPECT_EQ(a->mapped_bytes(), 2 * kPage);  // 4097 bytes map 8192 with 4 KiB pages: no power-of-two classes
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % kPage, 0u);
  EXPECT_EQ(a->purpose(), "activations");
  for (size_t i = 0; i < a->size(); ++i) a->as<uint8_t>()[i] = static_cast<uint8_t>(i * 7 + 3);
  for (size_t i = 0; i < a->size(); ++i) ASSERT_EQ(a->as<uint8_t>()[i], static_cast<uint8_t>(i * 7 + 3)) << i;
  EXPECT_EQ(pool->used_bytes(), 2 * kPage);

  auto b = pool->acquire(5 * kPage, "params");  // an exact multiple stays as it is
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(b->mapped_bytes(), 5 * kPage);
  EXPECT_EQ(pool->used_bytes(), 7 * kPage);

  PinnedBuffer moved = std::move(a.value());
  EXPECT_FALSE(a.value());
  EXPECT_TRUE(moved);
  moved.reset();
  EXPECT_EQ(pool->used_bytes(), 5 * kPage);
  b->reset();
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_EQ(pool->peak_bytes(), 7 * kPage);
  EXPECT_EQ(pool->budget_bytes(), 64 * kPage);
}
INSTANTIATE_TEST_SUITE_P(LockAndNoLock, PinnedPoolLockTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "locked" : "unlocked"; });

TEST(PinnedPoolTest, ZeroBytesIsInvalid) {
  auto pool = make_pool(4 * kPage);
  expect_error(pool->try_acquire(0, "empty").status(), StatusCode::kInvalidArgument, {"empty", "0 bytes"});
}

TEST(PinnedPoolTest, SpentBudgetFailsOrTimesOut) {
  auto pool = make_pool(4 * kPage);
  auto all = pool->acquire(4 * kPage, "master.params");
  ASSERT_TRUE(all.is_ok()) << all.status().to_string();
  expect_error(pool->try_acquire(1, "adam.moments").status(), StatusCode::kOutOfMemory,
               {"adam.moments", "budget is spent", std::to_string(4 * kPage)});

  const auto t0 = std::chrono::steady_clock::now();
  auto late = pool->acquire_for(kPage, "grads", milliseconds(50));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(50));
  expect_error(late.status(), StatusCode::kOutOfMemory, {"grads", "timed out after 50 ms"});
  EXPECT_EQ(pool->waiting(), 0u);
  EXPECT_EQ(pool->used_bytes(), 4 * kPage);
}

TEST(PinnedPoolTest, BlockedAcquireWakesWhenABufferIsReleased) {
  auto pool = make_pool(4 * kPage);
  auto held = pool->acquire(3 * kPage, "held");
  ASSERT_TRUE(held.is_ok());
  auto waiter = std::async(std::launch::async, [&] { return pool->acquire(2 * kPage, "waiter"); });
  while (pool->waiting() == 0) std::this_thread::sleep_for(milliseconds(1));
  EXPECT_EQ(waiter.wait_for(milliseconds(20)), std::future_status::timeout);
  held->reset();
  auto got = await(waiter, "the blocked acquire");
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(got->size(), 2 * kPage);
  EXPECT_EQ(pool->used_bytes(), 2 * kPage);
}

TEST(PinnedPoolTest, WaitersAreServedInOrderSoLargeRequestsAreNotStarved) {
  auto pool = make_pool(4 * kPage);
  auto small = pool->acquire(kPage, "small");
  auto big = pool->acquire(3 * kPage, "big");
  ASSERT_TRUE(small.is_ok() && big.is_ok());
  auto first = std::async(std::launch::async, [&] { return pool->acquire(3 * kPage, "first"); });
  while (pool->waiting() == 0) std::this_thread::sleep_for(milliseconds(1));
  small->reset();  // one page free, but "first" is ahead and needs three
  expect_error(pool->try_acquire(kPage, "jumper").status(), StatusCode::kOutOfMemory, {"jumper", "1 waiting"});
  expect_error(pool->acquire_for(kPage, "second", milliseconds(30)).status(), StatusCode::kOutOfMemory,
               {"second", "timed out"});
  big->reset();
  auto got = await(first, "the first waiter");
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_TRUE(pool->try_acquire(kPage, "second").is_ok());  // nobody waits now, and one page is free
}

// Threads contend for a budget of 8 pages while the hooks are swapped; the budget is never overshot, every map
// is matched by one unmap, and nothing is left behind.
TEST(PinnedPoolTest, ContendingThreadsNeverOvershootTheBudget) {
  auto pool = make_pool(8 * kPage, false);
  std::atomic<int64_t> registered{0};
  std::atomic<bool> overshoot{false};
  auto on_map = [&](void*, size_t n, const std::string&) {
    registered += static_cast<int64_t>(n);
    if (pool->used_bytes() > pool->budget_bytes()) overshoot = true;
  };
  auto on_unmap = [&](void*, size_t n, const std::string&) { registered -= static_cast<int64_t>(n); };
  std::vector<std::future<void>> workers;
  for (int t = 0; t < 4; ++t) {
    workers.push_back(std::async(std::launch::async, [&, t] {
      const std::string purpose = fmt::format("worker{}", t);
      for (int i = 0; i < 200; ++i) {
        auto b = pool->acquire_for(((t * 7 + i * 13) % (5 * kPage)) + 1, purpose, milliseconds(2000));
        ASSERT_TRUE(b.is_ok()) << b.status().to_string();
        b->as<uint8_t>()[b->size() - 1] = static_cast<uint8_t>(i);
        if (t == 0 && i % 50 == 0) pool->set_hooks(on_map, on_unmap);
      }
    }));
  }
  for (auto& w : workers) await(w, "a contending worker");
  pool->set_hooks({}, {});
  EXPECT_FALSE(overshoot.load());
  EXPECT_EQ(registered.load(), 0);
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_LE(pool->peak_bytes(), 8 * kPage);
}

TEST(PinnedPoolTest, RequestLargerThanTheBudgetFailsAtOnce) {
  auto pool = make_pool(2 * kPage + 100);  // not a page multiple: only two whole pages can ever be mapped
  for (size_t bytes : {2 * kPage + 1, 2 * kPage + 100, 3 * kPage}) {
    auto blocking = std::async(std::launch::async, [&] { return pool->acquire(bytes, "embedding"); });
    expect_error(await(blocking, "an oversized acquire").status(), StatusCode::kOutOfMemory,
                 {"embedding", std::to_string(bytes), std::to_string(2 * kPage + 100), "PinnedPoolOptions.budget_bytes",
                  "whole budget"});
  }
  EXPECT_TRUE(pool->try_acquire(2 * kPage, "fits").is_ok());
}

TEST(PinnedPoolTest, HooksSeeEveryMapAndUnmapOnce) {
  auto pool = make_pool(16 * kPage);
  std::vector<std::pair<void*, size_t>> maps, unmaps;
  std::vector<std::string> map_purposes, unmap_purposes;
  pool->set_hooks(
      [&](void* p, size_t n, const std::string& purpose) {
        maps.emplace_back(p, n);
        map_purposes.push_back(purpose);
      },
      [&](void* p, size_t n, const std::string& purpose) {
        unmaps.emplace_back(p, n);
        unmap_purposes.push_back(purpose);
      });
  auto a = pool->acquire(100, "a");
  auto b = pool->acquire(3 * kPage - 5, "b");
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_EQ(maps.size(), 2u);
  EXPECT_EQ(maps[0], std::make_pair(a->data(), kPage));
  EXPECT_EQ(maps[1], std::make_pair(b->data(), 3 * kPage));
  void* a_data = a->data();
  a->reset();
  ASSERT_EQ(unmaps.size(), 1u);
  EXPECT_EQ(unmaps[0], std::make_pair(a_data, kPage));
  EXPECT_EQ(map_purposes, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(unmap_purposes, std::vector<std::string>{"a"});

  size_t live = 0;
  pool->for_each_live([&](void* p, size_t n, const std::string& purpose) {
    EXPECT_EQ(p, b->data());
    EXPECT_EQ(n, 3 * kPage);
    EXPECT_EQ(purpose, "b");
    ++live;
  });
  EXPECT_EQ(live, 1u);

  // Replacing the hooks unregisters live buffers from the old set and registers them with the new one.
  std::vector<std::pair<void*, size_t>> maps2;
  pool->set_hooks([&](void* p, size_t n, const std::string& purpose) {
    maps2.emplace_back(p, n);
    EXPECT_EQ(purpose, "b");
  }, {});
  ASSERT_EQ(unmaps.size(), 2u);
  EXPECT_EQ(unmap_purposes.back(), "b");
  EXPECT_EQ(unmaps[1], std::make_pair(b->data(), 3 * kPage));
  ASSERT_EQ(maps2.size(), 1u);
  EXPECT_EQ(maps2[0], std::make_pair(b->data(), 3 * kPage));
  b->reset();
  EXPECT_EQ(unmaps.size(), 2u);
}

TEST(PinnedPoolTest, ReportNamesPurposes) {
  auto pool = make_pool(16 * kPage);
  auto m1 = pool->acquire(kPage, "optimizer.moments");
  auto m2 = pool->acquire(2 * kPage, "optimizer.moments");
  auto g = pool->acquire(10, "grads");
  ASSERT_TRUE(m1.is_ok() && m2.is_ok() && g.is_ok());
  const std::string r = pool->report();
  EXPECT_NE(r.find("optimizer.moments: " + std::to_string(3 * kPage) + " bytes"), std::string::npos) << r;
  EXPECT_NE(r.find("in 2 buffer(s)"), std::string::npos) << r;
  EXPECT_NE(r.find("grads: " + std::to_string(kPage) + " bytes"), std::string::npos) << r;
  EXPECT_NE(r.find(std::to_string(4 * kPage) + " bytes"), std::string::npos) << r;
  EXPECT_NE(r.find("MiB"), std::string::npos) << r;
}

TEST(PinnedPoolDeathTest, DestroyingAPoolWithLiveBuffersNamesThem) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto pool = make_pool(4 * kPage, false);
        auto held = pool->acquire(1, "gradients");
        pool.reset();
      },
      "live buffer.*'gradients'");
}

// An mlock that RLIMIT_MEMLOCK refuses is an OutOfMemory that says how to fix it, not an abort. Capabilities are
// per thread, so a helper thread drops CAP_IPC_LOCK for itself only; the soft limit is restored afterwards.
TEST(PinnedPoolTest, MlockBeyondRlimitMemlockFailsCleanly) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer runtimes replace mlock with a no-op, so no limit can refuse it";
#endif
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 1 << 20;
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < low.rlim_cur) low.rlim_cur = saved.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_MEMLOCK, &low), 0);
  auto pool = make_pool(1 << 22, true);
  auto unlocked = make_pool(1 << 22, false);
  auto result = std::async(std::launch::async, [&]() -> std::pair<bool, Status> {
    __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
    if (::syscall(SYS_capget, &hdr, data) != 0) return {false, Status()};
    data[0].effective &= ~(1u << CAP_IPC_LOCK);
    if (::syscall(SYS_capset, &hdr, data) != 0) return {false, Status()};
    auto locked = pool->acquire(low.rlim_cur + kPage, "swap.staging");
    EXPECT_TRUE(unlocked->acquire(low.rlim_cur + kPage, "unlocked").is_ok());
    return {true, locked.status()};
  });
  auto [ran, st] = await(result, "the mlock attempt");
  ASSERT_EQ(::setrlimit(RLIMIT_MEMLOCK, &saved), 0);
  if (!ran) GTEST_SKIP() << "cannot drop CAP_IPC_LOCK with capset here";
  expect_error(st, StatusCode::kOutOfMemory,
               {"swap.staging", "RLIMIT_MEMLOCK", std::to_string(low.rlim_cur), "ulimit -l"});
  EXPECT_EQ(pool->used_bytes(), 0u);
}

// --- the automatic budget -------------------------------------------------------------------------------------

TEST(AutoBudgetTest, ParsesMeminfoCgroupFilesAndCapabilities) {
  EXPECT_EQ(parse_meminfo_available("MemTotal:       32768000 kB\nMemFree:  1 kB\nMemAvailable:   24380844 kB\n"),
            uint64_t{24380844} * 1024);
  EXPECT_EQ(parse_meminfo_available("MemTotal: 1 kB\n"), std::nullopt);
  EXPECT_EQ(parse_cgroup_bytes("1073741824\n"), uint64_t{1073741824});
  EXPECT_EQ(parse_cgroup_bytes("max\n"), std::nullopt);
  EXPECT_EQ(parse_cgroup_bytes("9223372036854771712\n"), std::nullopt);  // cgroup v1's "no limit"
  EXPECT_EQ(parse_cgroup_bytes(""), std::nullopt);
  EXPECT_EQ(parse_cgroup_bytes("12ab"), std::nullopt);
  const char* hybrid = "9:name=systemd:/\n5:cpu,memory:/job/42\n0::/user.slice/run.scope\n";
  EXPECT_EQ(parse_cgroup_path(hybrid, true), "/user.slice/run.scope");
  EXPECT_EQ(parse_cgroup_path(hybrid, false), "/job/42");
  EXPECT_EQ(parse_cgroup_path("3:cpuset:/\n", false), std::nullopt);
  EXPECT_EQ(parse_cgroup_path("3:cpuset:/\n", true), std::nullopt);
  EXPECT_TRUE(parse_cap_ipc_lock("Name:\tx\nCapPrm:\t0\nCapEff:\t000001fffeffffff\n"));
  EXPECT_FALSE(parse_cap_ipc_lock("CapPrm:\t0000000000004000\nCapEff:\t0000000000000000\n"));
  EXPECT_TRUE(parse_cap_ipc_lock("CapEff:\t0000000000004000"));
  EXPECT_FALSE(parse_cap_ipc_lock(""));
}

class CgroupTreeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata_cgroup_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    root_ = templ;
  }
  void TearDown() override { fs::remove_all(root_); }
  void put(const std::string& rel, const std::string& text) {
    fs::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  fs::path root_;
};

TEST_F(CgroupTreeTest, V2HeadroomIsTheSmallestOverAncestors) {
  put("user.slice/memory.max", "800000\n");  // the slice binds: 800000 - 700000
  put("user.slice/memory.current", "700000\n");
  put("user.slice/run.scope/memory.max", "1000000\n");
  put("user.slice/run.scope/memory.current", "400000\n");
  std::string where;
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "0::/user.slice/run.scope\n", &where), uint64_t{100000});
  EXPECT_NE(where.find("user.slice/memory.max"), std::string::npos) << where;
  put("user.slice/memory.max", "max\n");
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "0::/user.slice/run.scope\n", &where), uint64_t{600000});
  put("user.slice/run.scope/memory.max", "max\n");
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "0::/user.slice/run.scope\n", &where), std::nullopt);
}

TEST_F(CgroupTreeTest, V1FallbackNamespacedRootAndMissingFiles) {
  std::string where;
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "0::/\n4:memory:/job\n", &where), std::nullopt);  // no files
  put("memory/job/memory.limit_in_bytes", "5000000\n");
  put("memory/job/memory.usage_in_bytes", "1000000\n");
  put("memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "0::/\n4:memory:/job\n", &where), uint64_t{4000000});
  EXPECT_NE(where.find("memory.limit_in_bytes"), std::string::npos) << where;
  // Usage above the limit leaves no headroom rather than wrapping around.
  put("memory/job/memory.usage_in_bytes", "6000000\n");
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "4:memory:/job\n", &where), uint64_t{0});
  // A path that is not under the mount (a cgroup namespace) falls back to the mount's own files.
  put("memory.max", "3000000\n");
  put("memory.current", "1000000\n");
  EXPECT_EQ(read_cgroup_headroom(root_.string(), "0::/elsewhere\n", &where), uint64_t{2000000});
}

TEST(AutoBudgetTest, EightyPercentOfTheSmallerCappedByMemlock) {
  BudgetInputs in;
  in.mem_available = uint64_t{10} << 30;
  in.cgroup_headroom = uint64_t{5} << 30;
  in.cgroup_where = "fake/memory.max";
  in.cap_ipc_lock = true;
  in.memlock_limit = 8 << 20;
  auto b = compute_auto_budget(in);
  EXPECT_EQ(b.bytes, (uint64_t{4} << 30));
  EXPECT_NE(b.source.find("cgroup headroom"), std::string::npos) << b.source;
  EXPECT_NE(b.source.find("fake/memory.max"), std::string::npos) << b.source;

  in.cgroup_headroom.reset();
  b = compute_auto_budget(in);
  EXPECT_EQ(b.bytes, (uint64_t{8} << 30));
  EXPECT_NE(b.source.find("MemAvailable"), std::string::npos) << b.source;

  in.cap_ipc_lock = false;  // locking without CAP_IPC_LOCK: RLIMIT_MEMLOCK binds
  b = compute_auto_budget(in);
  EXPECT_EQ(b.bytes, size_t{8} << 20);
  EXPECT_NE(b.source.find("RLIMIT_MEMLOCK"), std::string::npos) << b.source;
  in.lock = false;  // ... but not when nothing is locked
  EXPECT_EQ(compute_auto_budget(in).bytes, (uint64_t{8} << 30));

  in.mem_available = 10001;  // rounded down to whole pages
  EXPECT_EQ(compute_auto_budget(in).bytes, 4096u);
  in.mem_available.reset();
  EXPECT_EQ(compute_auto_budget(in).bytes, 0u);
}

TEST(AutoBudgetTest, CreateWithBudgetZeroDerivesAPositiveBudget) {
  for (bool lock : {true, false}) {
    auto pool = PinnedPool::create({.budget_bytes = 0, .lock = lock});
    ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
    EXPECT_GT((*pool)->budget_bytes(), 0u);
    EXPECT_EQ((*pool)->budget_bytes() % kPage, 0u);
    EXPECT_NE((*pool)->budget_source().find("80% of"), std::string::npos) << (*pool)->budget_source();
    auto b = (*pool)->try_acquire(3 * kPage + 1, "probe");
    EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  }
}

}  // namespace
}  // namespace strata::offload
