// swap_store_fixture.h — what the swap-store suites share: their sizes, caller buffers at any alignment, an
// engine that can hold transfers, the engines by name, and the parameterized SwapStoreTest fixture (its
// INSTANTIATE_TEST_SUITE_P is in swap_store_test.cpp, and covers the TEST_Ps of every file in the binary).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/aligned.h"
#include "common/rng.h"
#include "storage/io_engine.h"
#include "storage/io_queue.h"
#include "storage/memory_engine.h"
#include "storage/swap_store.h"
#include "tests/test_util.h"

namespace strata::swap_test {

namespace fs = std::filesystem;

inline constexpr size_t kBlock = 64 << 10;        // IoQueue pieces: chunks are split into several
inline constexpr uint64_t kChunk = 96 << 10;      // checksum chunk, deliberately not a multiple of kBlock
inline constexpr uint64_t kFileBytes = 4 << 20;

using ::strata::testing::expect_error;

// Caller memory that starts `misalign` bytes past a 4 KiB boundary, filled from a seeded generator.
class Buffer {
 public:
  Buffer(size_t n, size_t misalign) : n_(n) {
    auto b = AlignedBuffer::allocate(n + misalign + 1, "test.swap", 4096);
    EXPECT_TRUE(b.is_ok()) << b.status().to_string();
    storage_ = std::move(b).value();
    p_ = storage_.as<char>() + misalign;
  }
  void fill(Rng& rng) {
    for (size_t i = 0; i < n_; ++i) p_[i] = static_cast<char>(rng.next_u64() | 1);  // never all zeros
  }
  char* data() const { return p_; }
  size_t size() const { return n_; }
  std::vector<char> bytes() const { return std::vector<char>(p_, p_ + n_); }

 private:
  AlignedBuffer storage_;
  char* p_ = nullptr;
  size_t n_;
};

// Number of bytes that differ, with the first few indices in `where`.
inline size_t count_wrong(const char* got, const char* want, size_t n, std::string* where = nullptr) {
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) {
    if (got[i] == want[i]) continue;
    if (where != nullptr && wrong < 4) *where += fmt::format(" [{}] got {:#04x} want {:#04x}", i, got[i] & 0xff, want[i] & 0xff);
    ++wrong;
  }
  return wrong;
}

// Holds every transfer while shut, so a test can look at a store with writes and reads in flight.
class GateEngine final : public IoEngine {
 public:
  explicit GateEngine(IoEngine& inner) : inner_(inner) {}
  ~GateEngine() override { open_gate(); }
  std::string name() const override { return "gate(" + inner_.name() + ")"; }
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
  void shutdown() override { open_gate(); }
  void submit(RawIo* const* ios, size_t n) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shut_) {
        held_.insert(held_.end(), ios, ios + n);
        return;
      }
    }
    inner_.submit(ios, n);
  }
  void shut_gate() {
    std::lock_guard<std::mutex> lock(mu_);
    shut_ = true;
  }
  void open_gate() {
    std::vector<RawIo*> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      shut_ = false;
      held.swap(held_);
    }
    if (!held.empty()) inner_.submit(held.data(), held.size());
  }
  size_t held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_.size();
  }

 private:
  IoEngine& inner_;
  mutable std::mutex mu_;
  bool shut_ = false;
  std::vector<RawIo*> held_;
};

inline std::string temp_dir_name(const char* what) {
  static std::atomic<int> counter{0};
  return (fs::temp_directory_path() / fmt::format("strata_swap_{}_{}_{}", what, ::getpid(), counter++)).string();
}

inline Result<std::unique_ptr<IoEngine>> make_engine(const std::string& name) {
  if (name == "memory") {
    MemoryEngineOptions o;
    o.direct_alignment = 4096;  // insist on what O_DIRECT insists on
    o.lanes = 2;
    o.queue_depth = 8;
    return std::unique_ptr<IoEngine>(std::make_unique<MemoryEngine>(o));
  }
  EngineOptions o;
  o.kind = name == "io_uring" ? EngineKind::kUring : EngineKind::kPosix;
  o.lanes = 2;
  o.queue_depth = 8;
  return make_io_engine(o);
}

class SwapStoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = temp_dir_name("test");
    auto engine = make_engine(GetParam());
    if (!engine.is_ok()) GTEST_SKIP() << GetParam() << " engine unavailable here: " << engine.status().to_string();
    engine_ = std::move(engine).value();
    queue_ = std::make_unique<IoQueue>(*engine_, IoQueueOptions{kBlock});
  }
  void TearDown() override {
    queue_.reset();
    engine_.reset();
    fs::remove_all(dir_);
  }
  bool memory() const { return GetParam() == "memory"; }

  SwapStoreOptions options() const {
    SwapStoreOptions o;
    o.dir = dir_;
    o.file_bytes = kFileBytes;
    o.max_files = 4;
    o.checksum_chunk = kChunk;
    return o;
  }
  std::unique_ptr<SwapStore> open(const SwapStoreOptions& o, IoQueue* queue = nullptr) {
    auto s = SwapStore::open(queue ? *queue : *queue_, o);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }
  std::unique_ptr<SwapStore> open() { return open(options()); }

  // Swap files in dir_, through the engine (the memory engine's files are not on disk).
  std::vector<std::string> swap_files() const {
    auto names = engine_->list(dir_);
    std::vector<std::string> out;
    if (!names.is_ok()) return out;
    for (const auto& n : names.value())
      if (n.starts_with(kSwapFilePrefix)) out.push_back(n);
    std::sort(out.begin(), out.end());
    return out;
  }
  // Makes a file of `bytes` in dir_; with `locked`, keeps it open and locked and returns its id, else -1.
  int make_file(const std::string& name, uint64_t bytes, bool locked) {
    auto f = engine_->open(dir_ + "/" + name, OpenOptions{.create = true, .truncate = true, .direct = false});
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    EXPECT_TRUE(engine_->allocate(*f, bytes).is_ok());
    if (locked) {
      auto l = engine_->try_lock(*f);
      EXPECT_TRUE(l.is_ok() && *l);
      return *f;
    }
    EXPECT_TRUE(engine_->close(*f).is_ok());
    return -1;
  }
  // Reads or rewrites bytes of a file behind the store's back.
  std::vector<char> peek(const std::string& path, uint64_t offset, size_t n) {
    std::vector<char> out(n);
    auto f = engine_->open(path, OpenOptions{.create = false, .truncate = false, .direct = false});
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    EXPECT_TRUE(queue_->read(*f, offset, out.data(), n).is_ok());
    EXPECT_TRUE(engine_->close(*f).is_ok());
    return out;
  }
  void flip_byte(const std::string& path, uint64_t offset) {
    auto f = engine_->open(path, OpenOptions{.create = false, .truncate = false, .direct = false});
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    char c = 0;
    ASSERT_TRUE(queue_->read(*f, offset, &c, 1).is_ok());
    c = static_cast<char>(c ^ 0x10);
    ASSERT_TRUE(queue_->write(*f, offset, &c, 1).is_ok());
    ASSERT_TRUE(engine_->close(*f).is_ok());
  }

  std::string dir_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<IoQueue> queue_;
};

}  // namespace strata::swap_test
