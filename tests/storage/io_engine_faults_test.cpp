// I/O engines under injected faults: short transfers resumed, EIO and ENOSPC named with file, offset and errno,
// EINTR and EAGAIN retried (and given up on), torn writes and flipped bits passed through silently (the swap
// store's checksums catch them: swap_store_failure_test.cpp). Every engine kind, as io_engine_test.cpp.
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "storage/fault_engine.h"
#include "tests/storage/io_engine_fixture.h"

namespace strata {
namespace {

using io_test::aligned;
using io_test::buffer_bytes;
using io_test::bytes_equal;
using io_test::differing_bits;
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

class IoEngineFaultTest : public IoEngineTest {};

// 4. Short transfers ---------------------------------------------------------------------------------------------

TEST_P(IoEngineFaultTest, ShortTransfersAreResumed) {
  for (const bool direct : {true, false}) {
    const uint64_t seed = direct ? 21 : 22;
    SCOPED_TRACE(fmt::format("engine {}, {} file, seed {}", engine_->name(), direct ? "direct" : "buffered", seed));
    ASSERT_OK_AND_ASSIGN(const int f, open_new(direct ? "direct.bin" : "buffered.bin", direct));
    FaultEngine faulty(*engine_, FaultOptions{.seed = seed, .short_rate = 1});
    IoQueue q(faulty, queue_options());
    Rng rng(seed);
    const auto ex = plan_extents(rng, 16, direct ? kAlign : 3, direct);
    AlignedBuffer src = aligned(buffer_bytes(ex), "io_engine_test.src"),
                  dst = aligned(buffer_bytes(ex), "io_engine_test.dst");
    fill_random(src.data(), src.size(), rng);
    ASSERT_OK(write_then_read(q, f, ex, src.as<char>(), dst.as<char>()));
    EXPECT_TRUE(extents_equal(dst.as<char>(), src.as<char>(), ex, "read back through short transfers"));
    EXPECT_GT(q.stats().resumed_short, 0u);
    EXPECT_EQ(q.stats().resumed_short, faulty.counts().short_transfers);
    // What reached the file is right too, read without faults.
    faulty.set_enabled(false);
    std::memset(dst.data(), 0, dst.size());
    IoBatch batch;
    for (const Extent& e : ex)
      q.submit(IoRequest{IoOp::kRead, f, e.offset, dst.as<char>() + e.at, e.len, nullptr}, &batch);
    ASSERT_OK(batch.wait());
    EXPECT_TRUE(extents_equal(dst.as<char>(), src.as<char>(), ex, "read back without faults"));
  }
}

// 5. EIO and ENOSPC ----------------------------------------------------------------------------------------------

TEST_P(IoEngineFaultTest, EioNamesFileOffsetAndErrno) {
  ASSERT_OK_AND_ASSIGN(const int f, open_new("eio.bin", /*direct=*/false));
  std::vector<char> data(5 * 10000);
  Rng rng(31);
  fill_random(data.data(), data.size(), rng);
  {
    IoQueue clean(*engine_, queue_options());
    ASSERT_OK(clean.write(f, 12345, data.data(), data.size()));
  }
  FaultEngine faulty(*engine_, FaultOptions{.seed = 31, .eio_rate = 1});
  IoQueue q(faulty, queue_options());
  std::vector<char> back(data.size());
  const std::string p = path("eio.bin");
  expect_error(q.read(f, 22345, back.data(), 10000), StatusCode::kIOError,
               {"read of 10000 bytes", "offset 22345", p, "Input/output error (EIO)"});
  IoBatch batch;
  for (int i = 0; i < 5; ++i)
    q.submit(IoRequest{IoOp::kRead, f, 12345 + 10000u * i, back.data() + 10000 * i, 10000, nullptr}, &batch);
  expect_error(batch.wait(), StatusCode::kIOError, {p, "EIO", "(and 4 more failed requests)"});
  EXPECT_TRUE(batch.done());
  EXPECT_EQ(q.stats().failed, 6u);
  EXPECT_EQ(faulty.counts().eio, 6u);
  ASSERT_OK(batch.wait());  // the batch is reusable: its errors were reported once
}

TEST_P(IoEngineFaultTest, EnospcOnWritesNamesFileOffsetAndErrno) {
  ASSERT_OK_AND_ASSIGN(const int f, open_new("enospc.bin", /*direct=*/true));
  AlignedBuffer buf = aligned(8 * kAlign, "io_engine_test.buf");
  Rng rng(32);
  fill_random(buf.data(), buf.size(), rng);
  {
    IoQueue clean(*engine_, queue_options());
    ASSERT_OK(clean.write(f, 0, buf.data(), buf.size()));
  }
  FaultEngine faulty(*engine_, FaultOptions{.seed = 32, .enospc_rate = 1});
  IoQueue q(faulty, queue_options());
  const std::string p = path("enospc.bin");
  expect_error(q.write(f, 3 * kAlign, buf.data(), 2 * kAlign), StatusCode::kIOError,
               {"write of 8192 bytes", "offset 12288", p, "No space left on device (ENOSPC)"});
  IoBatch batch;
  for (int i = 0; i < 3; ++i)
    q.submit(IoRequest{IoOp::kWrite, f, kAlign * i, buf.as<char>() + kAlign * i, kAlign, nullptr}, &batch);
  expect_error(batch.wait(), StatusCode::kIOError, {p, "ENOSPC", "(and 2 more failed requests)"});
  EXPECT_EQ(faulty.counts().enospc, 4u);
  AlignedBuffer back = aligned(buf.size(), "io_engine_test.back");
  ASSERT_OK(q.read(f, 0, back.data(), back.size()));  // ENOSPC is for writes only
  EXPECT_TRUE(bytes_equal(back.data(), buf.data(), buf.size(), "data after failed writes"));
}

// 6. EINTR / EAGAIN ----------------------------------------------------------------------------------------------

TEST_P(IoEngineFaultTest, EintrAndEagainAreRetried) {
  constexpr int kFailures = 3;
  ASSERT_OK_AND_ASSIGN(const int f, open_new("retry.bin", /*direct=*/true));
  FlakyEngine flaky(*engine_, kFailures);
  IoQueue q(flaky, queue_options());
  Rng rng(41);
  const auto ex = plan_extents(rng, 8, 0, /*aligned_io=*/true);
  AlignedBuffer src = aligned(buffer_bytes(ex), "io_engine_test.src"),
                dst = aligned(buffer_bytes(ex), "io_engine_test.dst");
  fill_random(src.data(), src.size(), rng);
  ASSERT_OK(write_then_read(q, f, ex, src.as<char>(), dst.as<char>()));
  EXPECT_TRUE(bytes_equal(dst.data(), src.data(), buffer_bytes(ex), "read back after retries"));
  const IoQueueStats s = q.stats();
  EXPECT_EQ(s.retried, kFailures * s.pieces);
  EXPECT_EQ(flaky.forwarded(), s.pieces);
  EXPECT_EQ(flaky.seen(), (kFailures + 1) * s.pieces);
  EXPECT_EQ(s.failed, 0u);
}

TEST_P(IoEngineFaultTest, PersistentEagainGivesUpAfterMaxRetries) {
  ASSERT_OK_AND_ASSIGN(const int f, open_new("eagain.bin", /*direct=*/false));
  FlakyEngine flaky(*engine_, /*failures=*/-1);
  IoQueue q(flaky, IoQueueOptions{.block_size = kBlock, .max_retries = 5});
  std::vector<char> buf(3 * kBlock + 5, 'x');
  expect_error(q.write(f, 99, buf.data(), buf.size()), StatusCode::kIOError,
               {path("eagain.bin"), "offset", "Resource temporarily unavailable (EAGAIN)"});
  const IoQueueStats s = q.stats();
  EXPECT_EQ(s.pieces, 4u);
  EXPECT_EQ(s.retried, 5u * 4u);
  EXPECT_EQ(flaky.seen(), 6u * 4u);
  EXPECT_EQ(flaky.forwarded(), 0u);
  EXPECT_EQ(s.failed, 1u);
}

// 7. Silent corruption -------------------------------------------------------------------------------------------

// Torn writes and flipped bits report success: this layer cannot see them, which is why the swap store checksums.
TEST_P(IoEngineFaultTest, TornWritesCorruptSilently) {
  constexpr size_t kBytes = 16 * kBlock;
  ASSERT_OK_AND_ASSIGN(const int f, open_new("torn.bin", /*direct=*/true));
  FaultEngine faulty(*engine_, FaultOptions{.seed = 51, .torn_rate = 1});
  IoQueue q(faulty, queue_options());
  Rng rng(51);
  AlignedBuffer old_data = aligned(kBytes, "io_engine_test.old"), new_data = aligned(kBytes, "io_engine_test.new"),
                back = aligned(kBytes, "io_engine_test.back");
  fill_random(old_data.data(), kBytes, rng);
  fill_random(new_data.data(), kBytes, rng);
  faulty.set_enabled(false);
  ASSERT_OK(q.write(f, 0, old_data.data(), kBytes));
  faulty.set_enabled(true);
  ASSERT_OK(q.write(f, 0, new_data.data(), kBytes));  // a torn write reports success
  EXPECT_EQ(faulty.counts().torn, kBytes / kBlock);
  faulty.set_enabled(false);
  ASSERT_OK(q.read(f, 0, back.data(), kBytes));
  const auto* o = old_data.as<unsigned char>();
  const auto* n = new_data.as<unsigned char>();
  const auto* b = back.as<unsigned char>();
  EXPECT_FALSE(bytes_equal(b, n, kBytes, "torn")) << "the torn write reached the disk whole";
  // Each piece is a prefix of the new data (whole 4 KiB blocks, at least one) followed by the old data.
  for (size_t piece = 0; piece < kBytes / kBlock; ++piece) {
    const size_t begin = piece * kBlock;
    size_t prefix = 0;
    while (prefix < kBlock && b[begin + prefix] == n[begin + prefix]) ++prefix;
    prefix -= prefix % kAlign;  // a random old byte may equal the new one
    EXPECT_GE(prefix, kAlign) << "piece " << piece;
    EXPECT_LT(prefix, kBlock) << "piece " << piece;
    EXPECT_TRUE(
        bytes_equal(b + begin + prefix, o + begin + prefix, kBlock - prefix, fmt::format("piece {} tail", piece)));
  }
}

TEST_P(IoEngineFaultTest, FlippedBitsCorruptSilently) {
  constexpr size_t kBytes = 16 * kBlock + 3 * kAlign;  // 17 pieces
  ASSERT_OK_AND_ASSIGN(const int f, open_new("flip.bin", /*direct=*/true));
  FaultEngine faulty(*engine_, FaultOptions{.seed = 52, .flip_rate = 1});
  IoQueue q(faulty, queue_options());
  Rng rng(52);
  AlignedBuffer data = aligned(kBytes, "io_engine_test.data"), back = aligned(kBytes, "io_engine_test.back");
  fill_random(data.data(), kBytes, rng);
  ASSERT_OK(q.write(f, 0, data.data(), kBytes));  // flips touch reads only
  ASSERT_OK(q.read(f, 0, back.data(), kBytes));   // a flipped read reports success
  EXPECT_EQ(faulty.counts().flipped, 17u);
  for (size_t piece = 0; piece < 17; ++piece) {
    const size_t begin = piece * kBlock, len = std::min(kBlock, kBytes - begin);
    EXPECT_EQ(differing_bits(back.as<unsigned char>() + begin, data.as<unsigned char>() + begin, len), 1u)
        << "piece " << piece;
  }
  faulty.set_enabled(false);
  ASSERT_OK(q.read(f, 0, back.data(), kBytes));
  EXPECT_TRUE(bytes_equal(back.data(), data.data(), kBytes, "the disk itself is intact"));
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineFaultTest,
                         ::testing::Values("io_uring", "io_uring_sqpoll", "posix", "memory"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace strata
