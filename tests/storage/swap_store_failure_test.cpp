// The swap store when things go wrong: a long seeded loop under injected faults on every engine that must never
// return a wrong byte as good, a full disk, and the stale files of crashed and killed processes.
#include "storage/swap_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "common/rng.h"
#include "storage/fault_engine.h"
#include "storage/memory_engine.h"
#include "tests/storage/swap_store_fixture.h"

namespace strata {
namespace {

using namespace swap_test;

// The long loop: random writes, reads and frees under every kind of injected fault, against a model of what
// was last written successfully. A read either fails or returns exactly those bytes.
TEST_P(SwapStoreTest, FaultLoopNeverReturnsWrongBytes) {
  FaultOptions fo;
  fo.seed = 22;
  fo.eio_rate = 0.03;
  fo.enospc_rate = 0.03;
  fo.short_rate = 0.04;
  fo.torn_rate = 0.04;
  fo.flip_rate = 0.04;
  FaultEngine faulty(*engine_, fo);
  IoQueue queue(faulty, IoQueueOptions{kBlock});
  faulty.set_enabled(false);
  SwapStoreOptions o = options();
  o.max_files = 6;
  auto s = open(o, &queue);
  ASSERT_NE(s, nullptr);
  faulty.set_enabled(true);

  struct Stored {
    std::vector<char> bytes;
    bool torn = false;  // a torn write reported success: only the checksum can tell
  };
  std::map<std::string, Stored> model;
  const int kOps = memory() ? 5000 : 1200;
  const size_t edge[] = {1, 4095, 4096, 4097, kBlock - 1, kBlock + 1, kChunk + 4097};
  Rng rng(23);
  uint64_t wrong = 0, reads_ok = 0, writes_failed = 0, torn_read_ok = 0, torn_caught = 0, flip_caught = 0, flip_harmless = 0;
  auto checked_read = [&](const std::string& key) {
    auto it = model.find(key);
    if (it == model.end()) {
      EXPECT_EQ(s->contains(key), false) << key;
      return;
    }
    const std::vector<char>& want = it->second.bytes;
    Buffer out(want.size(), rng.below(2) ? 0 : 1 + rng.below(4095));
    std::memset(out.data(), 0x5a, out.size());
    const FaultCounts before = faulty.counts();
    const Status st = s->read(key, out.data(), out.size());
    const bool flipped = faulty.counts().flipped > before.flipped;
    if (st.is_ok()) {
      ++reads_ok;
      std::string where;
      const size_t w = count_wrong(out.data(), want.data(), want.size(), &where);
      EXPECT_EQ(w, 0u) << "key " << key << " (" << want.size() << " bytes) read as good with wrong bytes:" << where;
      wrong += w;
      torn_read_ok += it->second.torn;
      flip_harmless += flipped;  // the flipped bit was in a tail block's padding
    } else {
      EXPECT_TRUE(st.code() == StatusCode::kCorruption || st.code() == StatusCode::kIOError) << st.to_string();
      if (st.code() == StatusCode::kCorruption) {
        torn_caught += it->second.torn;
        flip_caught += flipped && !it->second.torn;
      }
    }
  };
  for (int i = 0; i < kOps; ++i) {
    const std::string key = fmt::format("key{}", rng.below(12));
    const uint64_t what = rng.below(10);
    if (what < 4) {
      const size_t n = rng.below(3) == 0 ? edge[rng.below(std::size(edge))] : 1 + rng.below(260000);
      Buffer in(n, rng.below(2) ? 0 : 1 + rng.below(4095));
      in.fill(rng);
      const FaultCounts before = faulty.counts();
      IoBatch b;
      Status st = rng.below(2) ? s->write(key, in.data(), n) : s->write(key, in.data(), n, &b);
      if (st.is_ok()) st = b.wait();
      if (st.is_ok()) {
        model[key] = Stored{in.bytes(), faulty.counts().torn > before.torn};
        if (rng.below(2)) checked_read(key);  // read some back at once, so torn versions get read
      } else {
        ++writes_failed;
        EXPECT_EQ(st.code(), StatusCode::kIOError) << st.to_string();
        EXPECT_EQ(s->contains(key), model.count(key) > 0) << "a failed write changed what " << key << " holds";
      }
    } else if (what < 9) {
      checked_read(key);
    } else {
      const Status st = s->free(key);
      EXPECT_EQ(st.is_ok(), model.erase(key) > 0) << st.to_string();
    }
  }
  faulty.set_enabled(false);
  // Everything the model holds reads back exactly once the faults stop, except torn versions, which say so.
  for (const auto& [key, stored] : model) {
    Buffer out(stored.bytes.size(), 0);
    const Status st = s->read(key, out.data(), out.size());
    if (stored.torn) {
      EXPECT_EQ(st.code(), StatusCode::kCorruption) << key << ": " << st.to_string();
    } else {
      ASSERT_TRUE(st.is_ok()) << key << ": " << st.to_string();
      EXPECT_EQ(count_wrong(out.data(), stored.bytes.data(), stored.bytes.size()), 0u) << key;
    }
  }
  EXPECT_EQ(s->stats().keys, model.size());

  const FaultCounts c = faulty.counts();
  std::printf("%s", fmt::format("{}: {} ops, {} good reads, {} failed writes; faults: eio {} enospc {} short {} torn {} "
                                "flipped {}; torn caught {}, flips caught {} (in padding {})\n",
                                GetParam(), kOps, reads_ok, writes_failed, c.eio, c.enospc, c.short_transfers, c.torn,
                                c.flipped, torn_caught, flip_caught, flip_harmless).c_str());
  EXPECT_EQ(wrong, 0u);
  EXPECT_EQ(torn_read_ok, 0u) << "a torn write was read back as good";
  EXPECT_GT(c.eio, 0u);
  EXPECT_GT(c.enospc, 0u);
  EXPECT_GT(c.short_transfers, 0u);
  EXPECT_GT(c.torn, 0u);
  EXPECT_GT(c.flipped, 0u);
  EXPECT_GT(torn_caught, 0u);
  EXPECT_GT(flip_caught, 0u);
  EXPECT_GT(reads_ok, uint64_t(kOps) / 10);
}

// ---- engine-specific -----------------------------------------------------------------------------------------

TEST(SwapStoreMemoryTest, FullDiskNamesTheDirectoryAndKeepsWhatWasStored) {
  MemoryEngineOptions mo;
  mo.capacity_bytes = (5 << 20) / 2;  // room for two 1 MiB files, not three
  MemoryEngine engine(mo);
  IoQueue queue(engine, IoQueueOptions{kBlock});
  SwapStoreOptions o;
  o.dir = "/mem/swap";
  o.file_bytes = 1 << 20;
  auto opened = SwapStore::open(queue, o);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  auto& s = *opened;
  Rng rng(24);
  Buffer in(300000, 0);
  std::map<std::string, std::vector<char>> stored;
  Status st;
  for (int i = 0; st.is_ok(); ++i) {
    in.fill(rng);
    st = s->write(fmt::format("t{}", i), in.data(), in.size());
    if (st.is_ok()) stored[fmt::format("t{}", i)] = in.bytes();
  }
  expect_error(st, StatusCode::kIOError,
               {"/mem/swap/strata-swap-r0-p", "-2.swp (3 of at most 8)", "1048576 bytes", "ENOSPC",
                "6 keys already stored stay readable"});
  EXPECT_EQ(stored.size(), 6u);
  EXPECT_EQ(s->stats().files, 2u);
  EXPECT_EQ(engine.used_bytes(), uint64_t{2} << 20) << "the file that could not be reserved is gone";
  Buffer out(in.size(), 1);
  for (const auto& [key, bytes] : stored) {
    ASSERT_TRUE(s->read(key, out.data(), out.size()).is_ok()) << key;
    EXPECT_EQ(count_wrong(out.data(), bytes.data(), bytes.size()), 0u) << key;
  }
  ASSERT_TRUE(s->free("t0").is_ok());
  EXPECT_TRUE(s->write("after", in.data(), in.size()).is_ok()) << "freed space is usable again";
}

TEST(SwapStoreMemoryTest, LocksReleasedByACrashMakeFilesStale) {
  MemoryEngine engine;
  IoQueue queue(engine);
  ASSERT_TRUE(engine.create_dirs("/mem/swap").is_ok());
  auto f = engine.open("/mem/swap/strata-swap-r0-p1-0.swp", OpenOptions{.create = true, .truncate = false, .direct = false});
  ASSERT_TRUE(f.is_ok());
  ASSERT_TRUE(engine.allocate(*f, 1 << 20).is_ok());
  ASSERT_TRUE(engine.try_lock(*f).value());
  SwapStoreOptions o;
  o.dir = "/mem/swap";
  o.rank = 1;
  o.file_bytes = 1 << 20;
  {
    auto s = SwapStore::open(queue, o);  // the holder is alive: its file stays
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    EXPECT_EQ(engine.list("/mem/swap")->size(), 2u);
  }
  engine.crash();
  auto s = SwapStore::open(queue, o);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(engine.list("/mem/swap").value(), std::vector<std::string>{fmt::format("strata-swap-r1-p{}-0.swp", ::getpid())});
}

// Real processes: a child that is killed leaves its swap file behind (locked, as a store keeps it, until the
// kernel drops the lock with the process); the next store removes it, but not the file of a child still alive.
// The child makes its file with plain system calls, so that it starts no thread after fork.
TEST(SwapStoreProcessTest, FilesOfKilledProcessesAreRemovedLiveOnesKept) {
  const std::string dir = temp_dir_name("crash");
  fs::create_directories(dir);
  auto child = [&](int ready_fd) {
    const std::string path = fmt::format("{}/strata-swap-r0-p{}-0.swp", dir, ::getpid());
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd < 0 || ::fallocate(fd, 0, 0, 1 << 20) != 0 || ::flock(fd, LOCK_EX | LOCK_NB) != 0) _exit(3);
    char c = 1;
    if (::write(ready_fd, &c, 1) != 1) _exit(4);
    for (;;) ::pause();  // until killed: nothing is cleaned up, as in a crash
  };
  auto spawn = [&]() -> pid_t {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      child(fds[1]);
    }
    ::close(fds[1]);
    char c = 0;
    EXPECT_EQ(::read(fds[0], &c, 1), 1) << "the child could not make its swap file";
    ::close(fds[0]);
    return pid;
  };
  auto kill_child = [](pid_t pid) {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
  };
  auto swap_files = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().starts_with(kSwapFilePrefix)) names.push_back(e.path().filename().string());
    return names;
  };
  const pid_t dead = spawn();
  kill_child(dead);
  const pid_t alive = spawn();
  ASSERT_EQ(swap_files().size(), 2u);

  auto engine = make_io_engine(EngineOptions{EngineKind::kPosix});
  ASSERT_TRUE(engine.is_ok());
  IoQueue queue(**engine);
  SwapStoreOptions o;
  o.dir = dir;
  o.rank = 1;
  o.file_bytes = 1 << 20;
  {
    auto s = SwapStore::open(queue, o);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    const auto names = swap_files();
    EXPECT_EQ(names.size(), 2u);
    EXPECT_EQ(std::count(names.begin(), names.end(), fmt::format("strata-swap-r0-p{}-0.swp", dead)), 0);
    EXPECT_EQ(std::count(names.begin(), names.end(), fmt::format("strata-swap-r0-p{}-0.swp", alive)), 1);
  }
  kill_child(alive);
  {
    auto s = SwapStore::open(queue, o);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    EXPECT_EQ(swap_files().size(), 1u) << "only the new store's own file";
  }
  EXPECT_TRUE(swap_files().empty());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
