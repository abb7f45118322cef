// I/O engines and IoQueue: every engine (io_uring, io_uring+SQPOLL, POSIX, in-memory) round-trips random
// requests byte for byte, and IoQueue's correctness logic (splitting, alignment and end-of-file errors naming
// file and offset, shutdown, registered buffers, file operations) is checked. Seeded: a failure names the engine
// and seed, so it replays. Under injected faults (short transfers, EIO, ENOSPC, EINTR/EAGAIN, silent
// corruption): io_engine_faults_test.cpp. The engine kinds one by one (MemoryEngine's own rules,
// make_io_engine's choice): io_engine_kinds_test.cpp. The shared fixture: io_engine_fixture.h.
#include "storage/io_engine.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "common/aligned.h"
#include "common/rng.h"
#include "storage/fault_engine.h"
#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "storage/uring_engine.h"
#include "tests/storage/io_engine_fixture.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using io_test::aligned;
using io_test::buffer_bytes;
using io_test::bytes_equal;
using io_test::Extent;
using io_test::extents_equal;
using io_test::fill_random;
using io_test::FlakyEngine;
using io_test::IoEngineTest;
using io_test::kAlign;
using io_test::kBlock;
using io_test::plan_extents;
using io_test::write_then_read;
using ::strata::testing::expect_error;

// 1. Round trips -------------------------------------------------------------------------------------------------

TEST_P(IoEngineTest, DirectRoundTripManyRequestsInOneBatch) {
  constexpr uint64_t kSeed = 11;
  SCOPED_TRACE(fmt::format("engine {}, seed {}", engine_->name(), kSeed));
  ASSERT_OK_AND_ASSIGN(const int f, open_new("direct.bin", /*direct=*/true));
  if (on_disk()) {
    EXPECT_TRUE(engine_->direct(f)) << "O_DIRECT refused by the filesystem of " << dir_;
  }
  IoQueue q(*engine_, queue_options());
  Rng rng(kSeed);
  const auto ex = plan_extents(rng, 24, /*start=*/kAlign * 3, /*aligned_io=*/true);
  AlignedBuffer src = aligned(buffer_bytes(ex), "io_engine_test.src"),
                dst = aligned(buffer_bytes(ex), "io_engine_test.dst");
  fill_random(src.data(), src.size(), rng);
  ASSERT_OK(write_then_read(q, f, ex, src.as<char>(), dst.as<char>()));
  EXPECT_TRUE(bytes_equal(dst.data(), src.data(), buffer_bytes(ex), "read back"));
  const IoQueueStats s = q.stats();
  EXPECT_EQ(s.requests, 2 * ex.size());
  EXPECT_GT(s.pieces, s.requests) << "64 KiB blocks should split the larger requests";
  EXPECT_EQ(s.failed, 0u);
  uint64_t end = 0;
  for (const Extent& e : ex) end = std::max(end, e.offset + e.len);
  ASSERT_OK_AND_ASSIGN(const uint64_t size, engine_->size(f));
  EXPECT_EQ(size, end);
  ASSERT_OK(engine_->close(f));
}

TEST_P(IoEngineTest, BufferedRoundTripOddSizesAndOffsets) {
  constexpr uint64_t kSeed = 12;
  SCOPED_TRACE(fmt::format("engine {}, seed {}", engine_->name(), kSeed));
  ASSERT_OK_AND_ASSIGN(const int f, open_new("buffered.bin", /*direct=*/false));
  EXPECT_FALSE(engine_->direct(f));
  EXPECT_EQ(engine_->alignment(f), 1u);
  IoQueue q(*engine_, queue_options());
  Rng rng(kSeed);
  const auto ex = plan_extents(rng, 20, /*start=*/1, /*aligned_io=*/false);
  std::vector<char> src(buffer_bytes(ex)), dst(buffer_bytes(ex));
  fill_random(src.data(), src.size(), rng);
  ASSERT_OK(write_then_read(q, f, ex, src.data(), dst.data()));
  EXPECT_TRUE(extents_equal(dst.data(), src.data(), ex, "read back"));
  // The synchronous conveniences too, one byte at an odd offset.
  const char one = '\x5a';
  char back = 0;
  ASSERT_OK(q.write(f, 7777777, &one, 1));
  ASSERT_OK(q.read(f, 7777777, &back, 1));
  EXPECT_EQ(back, one);
}

TEST_P(IoEngineTest, ConcurrentSubmittersFromFourThreads) {
  constexpr int kThreads = 4, kRounds = 3;
  constexpr uint64_t kRegion = uint64_t{4} << 20;
  SCOPED_TRACE(fmt::format("engine {}, seeds 100..{}", engine_->name(), 100 + kThreads - 1));
  ASSERT_OK_AND_ASSIGN(const int f, open_new("shared.bin", /*direct=*/true));
  IoQueue q(*engine_, queue_options());
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Rng rng(100 + t);
      for (int round = 0; round < kRounds && failures[t].empty(); ++round) {
        const auto ex = plan_extents(rng, 10, t * kRegion, /*aligned_io=*/true);  // < 2 MiB: stays in the region
        AlignedBuffer src = aligned(buffer_bytes(ex), "io_engine_test.src"),
                      dst = aligned(buffer_bytes(ex), "io_engine_test.dst");
        fill_random(src.data(), src.size(), rng);
        if (Status st = write_then_read(q, f, ex, src.as<char>(), dst.as<char>()); !st.is_ok())
          failures[t] = st.to_string();
        else if (auto eq = bytes_equal(dst.data(), src.data(), buffer_bytes(ex), "read back"); !eq)
          failures[t] = fmt::format("round {}: {}", round, eq.message());
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  EXPECT_EQ(q.stats().failed, 0u);
}

// 2. Alignment ---------------------------------------------------------------------------------------------------

TEST_P(IoEngineTest, DirectRejectsUnalignedOffsetLengthAndBufferBeforeAnyIo) {
  ASSERT_OK_AND_ASSIGN(const int f, open_new("direct.bin", /*direct=*/true));
  if (!engine_->direct(f)) GTEST_SKIP() << "the filesystem of " << dir_ << " refuses O_DIRECT";
  EXPECT_EQ(engine_->alignment(f), kAlign);
  FlakyEngine counting(*engine_, /*failures=*/0);  // passes everything through, counting it
  IoQueue q(counting, queue_options());
  AlignedBuffer buf = aligned(4 * kAlign, "io_engine_test.buf");
  char* b = buf.as<char>();
  const std::string p = path("direct.bin");
  expect_error(q.write(f, 512, b, kAlign), StatusCode::kInvalidArgument, {p, "offset 512", "aligned to 4096"});
  expect_error(q.write(f, 0, b, kAlign + 1), StatusCode::kInvalidArgument, {p, "got offset 0, length 4097"});
  expect_error(q.read(f, kAlign, b + 1, kAlign), StatusCode::kInvalidArgument,
               {p, fmt::format("buffer {:#x}", reinterpret_cast<uintptr_t>(b + 1))});
  EXPECT_EQ(counting.seen(), 0u) << "an unaligned request reached the engine";
  EXPECT_EQ(q.stats().failed, 3u);
  EXPECT_EQ(q.stats().pieces, 0u);
  ASSERT_OK_AND_ASSIGN(const uint64_t size, engine_->size(f));
  EXPECT_EQ(size, 0u) << "nothing may have been written";
  ASSERT_OK(q.write(f, kAlign, b, 2 * kAlign));  // and aligned still works
  EXPECT_EQ(counting.seen(), 1u);
}

// 3. End of file -------------------------------------------------------------------------------------------------

TEST_P(IoEngineTest, ReadPastEndOfFileFailsNamingFileAndOffset) {
  Rng rng(13);
  std::vector<char> data(10000), back(1 << 18);
  fill_random(data.data(), data.size(), rng);
  ASSERT_OK_AND_ASSIGN(const int f, open_new("short.bin", /*direct=*/false));
  IoQueue q(*engine_, queue_options());
  ASSERT_OK(q.write(f, 0, data.data(), data.size()));
  const std::string p = path("short.bin");
  expect_error(q.read(f, 10000, back.data(), 100), StatusCode::kIOError,
               {"end of file", p, "offset 10000", "after 0 bytes"});
  expect_error(q.read(f, 20000, back.data(), 1), StatusCode::kIOError, {"end of file", p, "offset 20000"});
  // A read that spans the end fails too, rather than coming back short.
  expect_error(q.read(f, 9000, back.data(), 2000), StatusCode::kIOError,
               {"end of file", p, "offset 9000", "after 1000 bytes"});
  expect_error(q.read(f, 0, back.data(), back.size()), StatusCode::kIOError, {"end of file", p});  // many pieces
  ASSERT_OK(q.read(f, 9000, back.data(), 1000));  // exactly up to the end is fine
  EXPECT_TRUE(bytes_equal(back.data(), data.data() + 9000, 1000, "tail"));

  // The same on a direct file whose end is block-aligned.
  ASSERT_OK_AND_ASSIGN(const int d, open_new("short_direct.bin", /*direct=*/true));
  AlignedBuffer buf = aligned(8 * kAlign, "io_engine_test.buf");
  fill_random(buf.data(), 3 * kAlign, rng);
  ASSERT_OK(q.write(d, 0, buf.data(), 3 * kAlign));
  const std::string pd = path("short_direct.bin");
  expect_error(q.read(d, 2 * kAlign, buf.data(), 2 * kAlign), StatusCode::kIOError,
               {"end of file", pd, "offset 8192", "after 4096 bytes"});
  expect_error(q.read(d, 3 * kAlign, buf.data(), kAlign), StatusCode::kIOError, {"end of file", pd, "offset 12288"});
  EXPECT_EQ(q.stats().failed, 6u);
}

// 8. Shutdown ----------------------------------------------------------------------------------------------------

TEST_P(IoEngineTest, SubmitAfterShutdownFailsWithEcanceled) {
  ASSERT_OK_AND_ASSIGN(const int f, open_new("shut.bin", /*direct=*/false));
  IoQueue q(*engine_, queue_options());
  std::vector<char> buf(3 * kBlock + 1, 'q');
  ASSERT_OK(q.write(f, 0, buf.data(), buf.size()));
  engine_->shutdown();
  engine_->shutdown();  // idempotent
  const std::string p = path("shut.bin");
  expect_error(q.write(f, 10, buf.data(), buf.size()), StatusCode::kIOError, {p, "ECANCELED"});
  expect_error(q.read(f, 10, buf.data(), 100), StatusCode::kIOError,
               {p, "offset 10", "Operation canceled (ECANCELED)"});
  IoBatch batch;
  for (int i = 0; i < 3; ++i) q.submit(IoRequest{IoOp::kRead, f, 0, buf.data(), 5, nullptr}, &batch);
  expect_error(batch.wait(), StatusCode::kIOError, {"ECANCELED", "(and 2 more failed requests)"});
}

TEST_P(IoEngineTest, ShutdownWithIoInFlightCompletesEverything) {
  constexpr int kRequests = 48;
  constexpr size_t kLen = 4 * kBlock;
  ASSERT_OK_AND_ASSIGN(const int f, open_new("inflight.bin", /*direct=*/true));
  // Short transfers make completions resubmit, so some resumes meet the stopped engine.
  FaultEngine faulty(*engine_, FaultOptions{.seed = 61, .short_rate = 0.5});
  IoQueue q(faulty, queue_options());
  AlignedBuffer buf = aligned(kLen, "io_engine_test.buf");
  Rng rng(61);
  fill_random(buf.data(), kLen, rng);
  IoBatch batch;
  std::atomic<int> completed{0};
  std::thread submitter([&] {
    for (int i = 0; i < kRequests; ++i) {
      q.submit(IoRequest{IoOp::kWrite, f, kLen * i, buf.data(), kLen,
                         [&] {
                           completed.fetch_add(1);
                           return Status::ok();
                         }},
               &batch);
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  faulty.shutdown();
  submitter.join();
  const Status st = batch.wait();  // must return, not hang
  EXPECT_TRUE(batch.done());
  EXPECT_EQ(q.stats().requests, static_cast<uint64_t>(kRequests));
  EXPECT_EQ(completed.load() + static_cast<int>(q.stats().failed), kRequests) << "every request ends exactly once";
  if (!st.is_ok()) expect_error(st, StatusCode::kIOError, {"ECANCELED", path("inflight.bin")});
}

// Regression: the queue's contract is that "the destructor waits for" its in-flight requests, but
// IoQueue::finish_piece releases the lane slot ~IoQueue waits on before running on_complete and counting a
// failure, so the destructor returns early (and a failing on_complete then writes to the freed queue).
TEST_P(IoEngineTest, DestroyingQueueWaitsForInFlightRequests) {
  ASSERT_OK_AND_ASSIGN(const int f, open_new("destroy.bin", /*direct=*/true));
  AlignedBuffer buf = aligned(4 * kBlock, "io_engine_test.buf");
  Rng rng(62);
  fill_random(buf.data(), buf.size(), rng);
  IoBatch batch;  // outlives the queue
  std::atomic<bool> finished{false};
  {
    IoQueue q(*engine_, queue_options());
    q.submit(IoRequest{IoOp::kWrite, f, 0, buf.data(), buf.size(),
                       [&] {
                         std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a slow checksum
                         finished.store(true);
                         return Status::ok();
                       }},
             &batch);
  }
  EXPECT_TRUE(finished.load()) << "~IoQueue returned while a request's on_complete was still running";
  ASSERT_OK(batch.wait());
  EXPECT_TRUE(finished.load());
}

// 10. Registered buffers -----------------------------------------------------------------------------------------

TEST_P(IoEngineTest, RegisteredBuffersFixedAndUnfixedPathsAgree) {
  constexpr size_t kRegistered = size_t{1} << 20, kTotal = 2 * kRegistered;
  ASSERT_OK_AND_ASSIGN(const int f, open_new("fixed.bin", /*direct=*/true));
  AlignedBuffer src = aligned(kTotal, "io_engine_test.src"), dst = aligned(kTotal, "io_engine_test.dst");
  Rng rng(71);
  fill_random(src.data(), kTotal, rng);
  // Only the first half of each buffer is registered: requests inside it, across its end, and outside it.
  const iovec regions[] = {{src.data(), kRegistered}, {dst.data(), kRegistered}};
  ASSERT_OK(engine_->register_buffers(regions));
  auto* uring = dynamic_cast<UringEngine*>(engine_.get());
  if (is_uring()) {
    ASSERT_NE(uring, nullptr);
    EXPECT_EQ(uring->fixed_buffers(), 2u);
  }
  IoQueue q(*engine_, queue_options());
  const std::vector<Extent> ex = {{0, kRegistered / 2, 0},
                                  {kRegistered / 2 + kAlign * 9, kRegistered / 2 + kAlign * 7, kRegistered * 3 / 4},
                                  {kTotal, kRegistered / 2, kRegistered * 3 / 2}};
  ASSERT_OK(write_then_read(q, f, ex, src.as<char>(), dst.as<char>()));
  EXPECT_TRUE(extents_equal(dst.as<char>(), src.as<char>(), ex, "read back"));
  engine_->unregister_buffers();
  if (uring != nullptr) {
    EXPECT_EQ(uring->fixed_buffers(), 0u);
  }
  std::memset(dst.data(), 0, kTotal);
  ASSERT_OK(q.read(f, ex[0].offset, dst.data(), ex[0].len));
  EXPECT_TRUE(bytes_equal(dst.data(), src.data(), ex[0].len, "after unregister"));
}

// Buffers added and removed one at a time while transfers from them are in flight: the data is right either
// way, and the table holds what was added.
TEST_P(IoEngineTest, BuffersAddedAndRemovedWhileTransfersRun) {
  constexpr size_t kBytes = size_t{4} << 20;
  ASSERT_OK_AND_ASSIGN(const int f, open_new("added.bin", /*direct=*/true));
  AlignedBuffer src = aligned(kBytes, "io_engine_test.src"), dst = aligned(kBytes, "io_engine_test.dst");
  Rng rng(73);
  fill_random(src.data(), kBytes, rng);
  auto* uring = dynamic_cast<UringEngine*>(engine_.get());
  const bool sqpoll = GetParam() == "io_uring_sqpoll";
  const Status added = engine_->add_buffer(src.data(), kBytes);
  if (!sqpoll && !added.is_ok() && (added.code() == StatusCode::kUnimplemented ||
                                    added.message().find("ENOMEM") != std::string::npos))
    GTEST_SKIP() << "io_uring fixed buffers are not available here: " << added.to_string();
  if (sqpoll) {
    EXPECT_EQ(added.code(), StatusCode::kUnimplemented) << added.to_string();
  } else {
    ASSERT_OK(added);
  }
  IoQueue q(*engine_, queue_options());
  IoBatch writes;
  q.submit(IoRequest{IoOp::kWrite, f, 0, src.data(), kBytes, {}}, &writes);
  engine_->remove_buffer(src.data());  // with the writes in flight
  ASSERT_OK(writes.wait());
  if (!sqpoll) ASSERT_OK(engine_->add_buffer(dst.data(), kBytes));
  if (uring != nullptr && !sqpoll) {
    EXPECT_EQ(uring->fixed_buffers(), 1u);
  }
  ASSERT_OK(q.read(f, 0, dst.data(), kBytes));
  EXPECT_TRUE(bytes_equal(dst.data(), src.data(), kBytes, "read back"));
  engine_->remove_buffer(dst.data());
  if (uring != nullptr) {
    EXPECT_EQ(uring->fixed_buffers(), 0u);
  }
  if (uring != nullptr) {
    EXPECT_FALSE(engine_->add_buffer(nullptr, 0).is_ok());
  }
}

// 11. File operations --------------------------------------------------------------------------------------------

TEST_P(IoEngineTest, CreateDirsListAllocateRemove) {
  const std::string sub = path("a/b/c");
  ASSERT_OK(engine_->create_dirs(sub));
  ASSERT_OK(engine_->create_dirs(sub));  // existing is fine
  ASSERT_OK(engine_->create_dirs(sub + "/nested"));
  if (on_disk()) {
    EXPECT_TRUE(fs::is_directory(sub));
  }
  ASSERT_OK_AND_ASSIGN(auto empty, engine_->list(sub));
  EXPECT_TRUE(empty.empty());
  OpenOptions create{.create = true, .truncate = true, .direct = true};
  ASSERT_OK_AND_ASSIGN(const int x, engine_->open(sub + "/x.bin", create));
  ASSERT_OK_AND_ASSIGN(const int y, engine_->open(sub + "/y.bin", create));
  EXPECT_EQ(engine_->path(x), sub + "/x.bin");
  ASSERT_OK_AND_ASSIGN(auto names, engine_->list(sub));
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"x.bin", "y.bin"})) << "names only, regular files only";

  constexpr uint64_t kReserve = (uint64_t{1} << 20) + 3 * kAlign;
  ASSERT_OK(engine_->allocate(x, kReserve));
  ASSERT_OK_AND_ASSIGN(uint64_t size, engine_->size(x));
  EXPECT_EQ(size, kReserve);
  ASSERT_OK(engine_->allocate(x, kAlign));  // never shrinks
  ASSERT_OK_AND_ASSIGN(size, engine_->size(x));
  EXPECT_EQ(size, kReserve);
  ASSERT_OK(engine_->sync(x));

  ASSERT_OK(engine_->close(y));
  ASSERT_OK(engine_->remove(sub + "/y.bin"));
  ASSERT_OK_AND_ASSIGN(names, engine_->list(sub));
  EXPECT_EQ(names, (std::vector<std::string>{"x.bin"}));
  expect_error(engine_->remove(sub + "/y.bin"), StatusCode::kIOError, {sub + "/y.bin", "ENOENT"});
  expect_error(engine_->list(path("missing")).status(), StatusCode::kNotFound, {path("missing")});
  expect_error(engine_->open(path("missing.bin"), OpenOptions{}).status(), StatusCode::kIOError,
               {path("missing.bin"), "ENOENT"});
  ASSERT_OK(engine_->close(x));
}

TEST_P(IoEngineTest, TryLockExcludesASecondOpenOfTheSameFile) {
  ASSERT_OK_AND_ASSIGN(const int a, open_new("lock", /*direct=*/false));
  ASSERT_OK_AND_ASSIGN(const int b, engine_->open(path("lock"), OpenOptions{.direct = false}));
  ASSERT_OK_AND_ASSIGN(bool got, engine_->try_lock(a));
  EXPECT_TRUE(got);
  ASSERT_OK_AND_ASSIGN(got, engine_->try_lock(a));
  EXPECT_TRUE(got) << "the holder may ask again";
  ASSERT_OK_AND_ASSIGN(got, engine_->try_lock(b));
  EXPECT_FALSE(got) << "a second open took the lock while the first held it";
  ASSERT_OK(engine_->close(a));
  ASSERT_OK_AND_ASSIGN(got, engine_->try_lock(b));
  EXPECT_TRUE(got) << "closing the holder releases the lock";
  ASSERT_OK(engine_->close(b));
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineTest, ::testing::Values("io_uring", "io_uring_sqpoll", "posix", "memory"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Regression: IoQueue::submit says a run costs "one engine submit (one io_uring_submit)", but it takes lanes
// round-robin, so a run alternates 0,1,0,1... and UringEngine::submit (which batches consecutive same-lane
// transfers) ends up making one io_uring_submit per piece.
TEST(IoQueueTest, RunGroupsEachLanesPiecesTogether) {
  MemoryEngine memory(MemoryEngineOptions{.lanes = 2, .queue_depth = 8});
  ASSERT_OK(memory.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, memory.open("/mem/runs.bin", OpenOptions{.create = true, .direct = false}));
  FlakyEngine recorder(memory, /*failures=*/0);
  IoQueue q(recorder, IoQueueOptions{.block_size = kBlock});
  std::vector<char> buf(8 * kBlock, 'r');
  ASSERT_OK(q.write(f, 0, buf.data(), buf.size()));
  const auto calls = recorder.calls();
  ASSERT_EQ(calls.size(), 1u) << "8 pieces fit in the free slots: one run";
  const std::vector<uint32_t>& lanes = calls[0];
  size_t groups = 1;
  for (size_t i = 1; i < lanes.size(); ++i) groups += lanes[i] != lanes[i - 1];
  EXPECT_EQ(groups, 2u) << "lanes in the run: " << fmt::format("{}", fmt::join(lanes, ","))
                        << " (each change of lane costs UringEngine one more io_uring_submit)";
}

}  // namespace
}  // namespace strata
