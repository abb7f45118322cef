// I/O engines and IoQueue: every engine (io_uring, io_uring+SQPOLL, POSIX, in-memory) round-trips random
// requests byte for byte, and IoQueue's correctness logic (splitting, short-transfer resume, EINTR/EAGAIN
// retry, alignment and end-of-file errors, errno text naming file and offset, shutdown) is checked against
// injected faults. Seeded: a failure names the engine and seed, so it replays. The engine kinds one by one
// (MemoryEngine's own rules, make_io_engine's choice): io_engine_kinds_test.cpp.
#include "storage/io_engine.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "common/aligned.h"
#include "common/check.h"
#include "common/rng.h"
#include "storage/fault_engine.h"
#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "storage/uring_engine.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr size_t kAlign = 4096;
constexpr size_t kBlock = size_t{64} << 10;  // IoQueue block size here: requests split into many pieces


using ::strata::testing::expect_error;

void fill_random(void* dst, size_t n, Rng& rng) {
  auto* p = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng.next_u64();
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

// Byte-exact comparison reporting the mismatch count and the first 8 (index, got, want).
::testing::AssertionResult bytes_equal(const void* got, const void* want, size_t n, const std::string& what) {
  const auto* g = static_cast<const unsigned char*>(got);
  const auto* w = static_cast<const unsigned char*>(want);
  size_t bad = 0;
  std::string first;
  for (size_t i = 0; i < n; ++i) {
    if (g[i] == w[i]) continue;
    if (bad++ < 8) first += fmt::format("\n    [{}] got {:#04x} want {:#04x}", i, g[i], w[i]);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << n << " bytes differ; first:" << first;
}

size_t differing_bits(const unsigned char* a, const unsigned char* b, size_t n) {
  size_t bits = 0;
  for (size_t i = 0; i < n; ++i) bits += std::popcount(static_cast<unsigned>(a[i] ^ b[i]));
  return bits;
}

AlignedBuffer aligned(size_t bytes, const char* purpose) {
  auto b = AlignedBuffer::allocate(bytes, purpose, kAlign);
  STRATA_ASSERT_MSG(b.is_ok(), "test buffer allocation failed");
  return std::move(b).value();
}

// Non-overlapping [offset, offset + len) extents from `start`, in random order. Aligned: multiples of 4096, up to
// 160 blocks (so up to 10 pieces of kBlock). Unaligned: the awkward sizes first (1, 4095, 4097, block +- 1...),
// then random ones, at odd offsets.
struct Extent {
  uint64_t offset;
  size_t len;
  size_t at;  // where the extent's bytes sit in the test's buffer
};
std::vector<Extent> plan_extents(Rng& rng, size_t count, uint64_t start, bool aligned_io) {
  static constexpr size_t kAwkward[] = {1, 4095, 4097, kBlock - 1, kBlock + 1, 3 * kBlock + 13, 7};
  std::vector<Extent> out;
  uint64_t file_pos = start;
  size_t buf_pos = 0;
  for (size_t i = 0; i < count; ++i) {
    size_t len, gap;
    if (aligned_io) {
      len = kAlign * (1 + rng.below(160));
      gap = kAlign * rng.below(4);
    } else {
      len = i < std::size(kAwkward) ? kAwkward[i] : 1 + rng.below(5 * kBlock);
      gap = rng.below(5000);
    }
    file_pos += gap;
    out.push_back({file_pos, len, buf_pos});
    file_pos += len;
    buf_pos += len + (aligned_io ? 0 : 1 + rng.below(7));  // unaligned buffers too
  }
  for (size_t i = out.size(); i > 1; --i) std::swap(out[i - 1], out[rng.below(i)]);  // submission order
  return out;
}
size_t buffer_bytes(const std::vector<Extent>& ex) {
  size_t end = 0;
  for (const Extent& e : ex) end = std::max(end, e.at + e.len);
  return end;
}

// bytes_equal over just the extents' bytes (unaligned plans leave gaps between them in the buffers).
::testing::AssertionResult extents_equal(const char* got, const char* want, const std::vector<Extent>& ex,
                                         const std::string& what) {
  for (const Extent& e : ex) {
    auto eq =
        bytes_equal(got + e.at, want + e.at, e.len, fmt::format("{}, extent at {} of {} bytes", what, e.offset, e.len));
    if (!eq) return eq;
  }
  return ::testing::AssertionSuccess();
}

// Writes every extent from `src` in one batch, then reads them all into `dst` in another.
Status write_then_read(IoQueue& q, int file, const std::vector<Extent>& ex, char* src, char* dst) {
  IoBatch batch;
  for (const Extent& e : ex) q.submit(IoRequest{IoOp::kWrite, file, e.offset, src + e.at, e.len, nullptr}, &batch);
  STRATA_RETURN_IF_ERROR(batch.wait());
  for (const Extent& e : ex) q.submit(IoRequest{IoOp::kRead, file, e.offset, dst + e.at, e.len, nullptr}, &batch);
  return batch.wait();
}

// Test-only engine: fails the first `failures` attempts of each transfer with -EINTR, -EAGAIN, -EINTR, ...
// inside submit, then forwards it; failures < 0 fails every attempt with -EAGAIN. Counts and records what it
// sees (failures == 0 makes it a pure recorder).
class FlakyEngine final : public IoEngine {
 public:
  FlakyEngine(IoEngine& inner, int failures) : inner_(inner), failures_(failures) {}

  std::string name() const override { return "flaky(" + inner_.name() + ")"; }
  uint32_t lanes() const override { return inner_.lanes(); }
  uint32_t queue_depth() const override { return inner_.queue_depth(); }
  Result<int> open(const std::string& path, const OpenOptions& o) override { return inner_.open(path, o); }
  Status close(int file) override { return inner_.close(file); }
  const std::string& path(int file) const override { return inner_.path(file); }
  bool direct(int file) const override { return inner_.direct(file); }
  Status allocate(int file, uint64_t bytes) override { return inner_.allocate(file, bytes); }
  Result<uint64_t> size(int file) const override { return inner_.size(file); }
  Status sync(int file) override { return inner_.sync(file); }
  Result<bool> try_lock(int file) override { return inner_.try_lock(file); }
  Status create_dirs(const std::string& dir) override { return inner_.create_dirs(dir); }
  Status remove(const std::string& path) override { return inner_.remove(path); }
  Result<std::vector<std::string>> list(const std::string& dir) const override { return inner_.list(dir); }
  size_t alignment(int file) const override { return inner_.alignment(file); }
  void shutdown() override { inner_.shutdown(); }

  void submit(RawIo* const* ios, size_t n) override {
    std::vector<RawIo*> pass;
    std::vector<std::pair<RawIo*, int64_t>> fail;
    std::vector<uint32_t> lanes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < n; ++i) {
        RawIo* io = ios[i];
        ++seen_;
        lanes.push_back(io->lane);
        int& attempts = attempts_[io];  // keyed by the transfer; erased when it goes through
        if (failures_ < 0 || attempts < failures_) {
          fail.emplace_back(io, failures_ < 0 || attempts % 2 == 1 ? -EAGAIN : -EINTR);
          ++attempts;
        } else {
          attempts_.erase(io);
          pass.push_back(io);
        }
      }
      forwarded_ += pass.size();
      calls_.push_back(std::move(lanes));
    }
    for (auto& [io, err] : fail) io->done(io, err);
    if (!pass.empty()) inner_.submit(pass.data(), pass.size());
  }

  uint64_t seen() const {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }
  uint64_t forwarded() const {
    std::lock_guard<std::mutex> lock(mu_);
    return forwarded_;
  }
  // The lanes of the transfers in each submit call, in order.
  std::vector<std::vector<uint32_t>> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  IoEngine& inner_;
  const int failures_;
  mutable std::mutex mu_;
  std::map<RawIo*, int> attempts_;
  uint64_t seen_ = 0, forwarded_ = 0;
  std::vector<std::vector<uint32_t>> calls_;
};

// ---- the engines ------------------------------------------------------------------------------------------------

class IoEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = fmt::format("strata_io_{}_{}_{}", ::getpid(), info->test_suite_name(), info->name());
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() / name;
    fs::remove_all(dir_);
    fs::create_directories(dir_);

    const std::string& kind = GetParam();
    if (kind == "memory") {
      engine_ =
          std::make_unique<MemoryEngine>(MemoryEngineOptions{.direct_alignment = kAlign, .lanes = 2, .queue_depth = 8});
    } else {
      EngineOptions o;
      o.kind = kind == "posix" ? EngineKind::kPosix : EngineKind::kUring;
      o.lanes = kind == "posix" ? 3 : 2;
      o.queue_depth = 8;
      o.sqpoll = kind == "io_uring_sqpoll";
      auto made = make_io_engine(o);
      if (!made.is_ok()) {
        if (o.kind == EngineKind::kUring) GTEST_SKIP() << "io_uring unavailable here: " << made.status().to_string();
        FAIL() << made.status().to_string();
      }
      engine_ = std::move(made).value();
    }
    ASSERT_OK(engine_->create_dirs(dir_.string()));  // the in-memory engine keeps its own directory tree
  }
  void TearDown() override {
    engine_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  Result<int> open_new(const std::string& name, bool direct) {
    return engine_->open(path(name), OpenOptions{.create = true, .truncate = true, .direct = direct});
  }
  bool on_disk() const { return GetParam() != "memory"; }
  bool is_uring() const { return GetParam().rfind("io_uring", 0) == 0; }
  static IoQueueOptions queue_options() { return IoQueueOptions{.block_size = kBlock, .max_retries = 16}; }

  fs::path dir_;
  std::unique_ptr<IoEngine> engine_;
};

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

// 4. Short transfers ---------------------------------------------------------------------------------------------

TEST_P(IoEngineTest, ShortTransfersAreResumed) {
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

TEST_P(IoEngineTest, EioNamesFileOffsetAndErrno) {
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

TEST_P(IoEngineTest, EnospcOnWritesNamesFileOffsetAndErrno) {
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

TEST_P(IoEngineTest, EintrAndEagainAreRetried) {
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

TEST_P(IoEngineTest, PersistentEagainGivesUpAfterMaxRetries) {
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
TEST_P(IoEngineTest, TornWritesCorruptSilently) {
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

TEST_P(IoEngineTest, FlippedBitsCorruptSilently) {
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
