// The engine kinds one by one: MemoryEngine's capacity and unlink rules, and make_io_engine's choice of engine
// and its failures (bad options, io_uring refused mid-way without leaking rings). The behaviour every engine
// shares is io_engine_test.cpp's.
#include "storage/io_engine.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "storage/uring_engine.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using ::strata::testing::expect_error;

constexpr size_t kBlock = size_t{64} << 10;  // IoQueue block size here: requests split into several pieces

// ---- engine-specific --------------------------------------------------------------------------------------------

TEST(MemoryEngineTest, CapacityMakesAllocateAndWritesFailWithEnospc) {
  MemoryEngine engine(MemoryEngineOptions{.capacity_bytes = uint64_t{1} << 20});
  ASSERT_OK(engine.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, engine.open("/mem/full.bin", OpenOptions{.create = true, .direct = false}));
  ASSERT_OK(engine.allocate(f, 1000));
  expect_error(engine.allocate(f, (uint64_t{1} << 20) + 1), StatusCode::kIOError,
               {"/mem/full.bin", "No space left on device (ENOSPC)"});
  EXPECT_EQ(engine.used_bytes(), 1000u);
  IoQueue q(engine, IoQueueOptions{.block_size = kBlock});
  std::vector<char> buf(3 * kBlock, 'm');
  expect_error(q.write(f, uint64_t{1} << 20, buf.data(), 7), StatusCode::kIOError,
               {"/mem/full.bin", "offset 1048576", "ENOSPC"});
  ASSERT_OK(q.write(f, 0, buf.data(), buf.size()));
}

// Regression: MemoryEngine::remove returned a removed file's space at once, while its comment (and unlink)
// keep the bytes until the last open handle goes; a full disk could then be over-filled through such handles.
TEST(MemoryEngineTest, RemovedFileKeepsItsSpaceWhileOpen) {
  MemoryEngine engine(MemoryEngineOptions{.capacity_bytes = uint64_t{1} << 20});
  ASSERT_OK(engine.create_dirs("/mem"));
  const OpenOptions create{.create = true, .direct = false};
  ASSERT_OK_AND_ASSIGN(const int f, engine.open("/mem/a.bin", create));
  ASSERT_OK(engine.allocate(f, 768 << 10));
  ASSERT_OK(engine.remove("/mem/a.bin"));
  EXPECT_EQ(engine.used_bytes(), uint64_t{768} << 10) << "the open handle still holds the bytes";
  ASSERT_OK_AND_ASSIGN(const int g, engine.open("/mem/b.bin", create));
  expect_error(engine.allocate(g, 768 << 10), StatusCode::kIOError, {"/mem/b.bin", "ENOSPC"});
  ASSERT_OK(engine.close(f));
  EXPECT_EQ(engine.used_bytes(), 0u) << "closing the last handle returns the space";
  ASSERT_OK(engine.allocate(g, 768 << 10));
}

// make_io_engine ---------------------------------------------------------------------------------------------------

bool uring_works(std::string* why) {
  auto e = UringEngine::create(EngineOptions{.kind = EngineKind::kUring});
  if (!e.is_ok()) *why = e.status().to_string();
  return e.is_ok();
}

TEST(MakeIoEngineTest, AutoPicksIoUringHere) {
  std::string why;
  if (!uring_works(&why)) GTEST_SKIP() << "io_uring unavailable here: " << why;
  ASSERT_OK_AND_ASSIGN(auto engine,
                       make_io_engine(EngineOptions{.kind = EngineKind::kAuto, .lanes = 2, .queue_depth = 4}));
  EXPECT_EQ(engine->name().rfind("io_uring", 0), 0u) << engine->name();
  EXPECT_EQ(engine->lanes(), 2u);
  EXPECT_EQ(engine->queue_depth(), 4u);
  ASSERT_OK_AND_ASSIGN(auto sq, make_io_engine(EngineOptions{.kind = EngineKind::kUring, .sqpoll = true}));
  EXPECT_EQ(sq->name(), "io_uring+sqpoll");
}

TEST(MakeIoEngineTest, PosixKindGivesPosix) {
  ASSERT_OK_AND_ASSIGN(auto engine,
                       make_io_engine(EngineOptions{.kind = EngineKind::kPosix, .lanes = 3, .queue_depth = 5}));
  EXPECT_EQ(engine->name(), "posix");
  EXPECT_EQ(engine->lanes(), 3u);
  EXPECT_EQ(engine->queue_depth(), 5u);
}

TEST(MakeIoEngineTest, ParseEngineKind) {
  const std::pair<const char*, EngineKind> good[] = {{"auto", EngineKind::kAuto},
                                                     {"io_uring", EngineKind::kUring},
                                                     {"uring", EngineKind::kUring},
                                                     {"posix", EngineKind::kPosix}};
  for (const auto& [name, kind] : good) {
    ASSERT_OK_AND_ASSIGN(const EngineKind got, parse_engine_kind(name));
    EXPECT_EQ(got, kind) << name;
  }
  for (const char* bad : {"", "aio", "POSIX", "io-uring", "spdk"})
    expect_error(parse_engine_kind(bad).status(), StatusCode::kInvalidArgument,
                 {fmt::format("'{}'", bad), "auto", "io_uring", "posix"});
  EXPECT_STREQ(engine_kind_name(EngineKind::kUring), "io_uring");
  EXPECT_STREQ(io_op_name(IoOp::kWrite), "write");
}

TEST(MakeIoEngineTest, BadLanesOrDepthAreInvalidArgument) {
  for (const EngineKind kind : {EngineKind::kAuto, EngineKind::kUring, EngineKind::kPosix}) {
    SCOPED_TRACE(engine_kind_name(kind));
    expect_error(make_io_engine(EngineOptions{.kind = kind, .lanes = 0}).status(), StatusCode::kInvalidArgument,
                 {"lanes"});
    expect_error(make_io_engine(EngineOptions{.kind = kind, .queue_depth = 0}).status(), StatusCode::kInvalidArgument,
                 {"queue_depth"});
  }
  expect_error(make_io_engine(EngineOptions{.kind = EngineKind::kUring, .queue_depth = 5000}).status(),
               StatusCode::kInvalidArgument, {"queue_depth", "5000"});
}

// Regression: kAuto falls back to POSIX on any io_uring error, so a bad queue depth (a config mistake, not a
// kernel that "lacks or refuses" io_uring) silently yields the slower engine with a misleading warning.
TEST(MakeIoEngineTest, AutoRejectsQueueDepthInsteadOfFallingBack) {
  std::string why;
  if (!uring_works(&why)) GTEST_SKIP() << "io_uring unavailable here: " << why;
  auto made = make_io_engine(EngineOptions{.kind = EngineKind::kAuto, .queue_depth = 5000});
  if (made.is_ok()) {
    ADD_FAILURE() << "kAuto with queue_depth 5000 gave engine '" << made.value()->name() << "'";
  } else {
    expect_error(made.status(), StatusCode::kInvalidArgument, {"queue_depth", "5000"});
  }
}

size_t open_fds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Regression: when ring k > 0 fails to initialise, UringEngine::create dropped rings 0..k-1 without
// io_uring_queue_exit, leaking their descriptors and mappings.
TEST(MakeIoEngineTest, UringCreateFailureLeaksNoRings) {
  std::string why;
  if (!uring_works(&why)) GTEST_SKIP() << "io_uring unavailable here: " << why;
  rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0) << std::strerror(errno);
  const int probe = ::dup(0);  // the lowest free descriptor number
  ASSERT_GE(probe, 0) << std::strerror(errno);
  ::close(probe);
  const size_t before = open_fds();
  rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(probe) + 1;  // room for exactly one more descriptor: ring 0 gets it
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0) << std::strerror(errno);
  auto made = UringEngine::create(EngineOptions{.kind = EngineKind::kUring, .lanes = 3, .queue_depth = 4});
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0) << std::strerror(errno);
  ASSERT_FALSE(made.is_ok()) << "ring creation should have run out of descriptors";
  expect_error(made.status(), StatusCode::kIOError, {"io_uring_queue_init", "EMFILE"});
  EXPECT_EQ(open_fds(), before) << "the rings made before the failure were not closed";
}

}  // namespace
}  // namespace strata
