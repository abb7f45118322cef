// The I/O engine tests' shared parts (io_engine_test.cpp, io_engine_faults_test.cpp): random extents and their
// comparison, FlakyEngine (fails submits with EINTR/EAGAIN, or records them), and the fixture that opens each
// engine kind in a fresh folder.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/aligned.h"
#include "common/check.h"
#include "common/rng.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "tests/test_util.h"

namespace strata::io_test {

namespace fs = std::filesystem;

constexpr size_t kAlign = 4096;
constexpr size_t kBlock = size_t{64} << 10;  // IoQueue block size here: requests split into many pieces


inline void fill_random(void* dst, size_t n, Rng& rng) {
  auto* p = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng.next_u64();
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

// Byte-exact comparison reporting the mismatch count and the first 8 (index, got, want).
inline ::testing::AssertionResult bytes_equal(const void* got, const void* want, size_t n, const std::string& what) {
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

inline size_t differing_bits(const unsigned char* a, const unsigned char* b, size_t n) {
  size_t bits = 0;
  for (size_t i = 0; i < n; ++i) bits += std::popcount(static_cast<unsigned>(a[i] ^ b[i]));
  return bits;
}

inline AlignedBuffer aligned(size_t bytes, const char* purpose) {
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
inline std::vector<Extent> plan_extents(Rng& rng, size_t count, uint64_t start, bool aligned_io) {
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
inline size_t buffer_bytes(const std::vector<Extent>& ex) {
  size_t end = 0;
  for (const Extent& e : ex) end = std::max(end, e.at + e.len);
  return end;
}

// bytes_equal over just the extents' bytes (unaligned plans leave gaps between them in the buffers).
inline ::testing::AssertionResult extents_equal(const char* got, const char* want, const std::vector<Extent>& ex,
                                         const std::string& what) {
  for (const Extent& e : ex) {
    auto eq =
        bytes_equal(got + e.at, want + e.at, e.len, fmt::format("{}, extent at {} of {} bytes", what, e.offset, e.len));
    if (!eq) return eq;
  }
  return ::testing::AssertionSuccess();
}

// Writes every extent from `src` in one batch, then reads them all into `dst` in another.
inline Status write_then_read(IoQueue& q, int file, const std::vector<Extent>& ex, char* src, char* dst) {
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

}  // namespace strata::io_test
