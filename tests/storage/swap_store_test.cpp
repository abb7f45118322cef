// The swap store on every engine (io_uring, POSIX, in-memory): round trips of awkward sizes and alignments, free
// and reuse, copy-on-write overwrites that survive failed writes, a full store and a full disk, crash cleanup,
// concurrency, corruption reports, and a long seeded loop under injected faults that must never return a wrong
// byte as good.
#include "storage/swap_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "common/aligned.h"
#include "common/rng.h"
#include "storage/fault_engine.h"
#include "storage/memory_engine.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr size_t kBlock = 64 << 10;        // IoQueue pieces: chunks are split into several
constexpr uint64_t kChunk = 96 << 10;      // checksum chunk, deliberately not a multiple of kBlock
constexpr uint64_t kFileBytes = 4 << 20;

// Checks the status has `code` and its message contains every one of `parts`.
void expect_error(const Status& st, StatusCode code, std::initializer_list<std::string> parts) {
  EXPECT_EQ(st.code(), code) << st.to_string();
  for (const auto& p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << "'" << p << "' not in: " << st.message();
}

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
size_t count_wrong(const char* got, const char* want, size_t n, std::string* where = nullptr) {
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

std::string temp_dir_name(const char* what) {
  static std::atomic<int> counter{0};
  return (fs::temp_directory_path() / fmt::format("strata_swap_{}_{}_{}", what, ::getpid(), counter++)).string();
}

Result<std::unique_ptr<IoEngine>> make_engine(const std::string& name) {
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

TEST_P(SwapStoreTest, RoundTripsAwkwardSizesAndAlignments) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  Rng rng(11);
  const size_t sizes[] = {1,          7,      4095,           4096,           4097,     kBlock - 1,
                          kBlock,     kBlock + 1, kChunk - 1, kChunk,         kChunk + 1, 2 * kChunk + 4096,
                          3 * kChunk + 4097, 5 * kBlock + 13};
  for (size_t n : sizes) {
    for (size_t wmis : {size_t{0}, size_t{1}, size_t{2053}}) {
      SCOPED_TRACE(fmt::format("size {} written from a buffer {} bytes past 4 KiB", n, wmis));
      const std::string key = fmt::format("k{}-{}", n, wmis);
      Buffer in(n, wmis);
      in.fill(rng);
      ASSERT_TRUE(s->write(key, in.data(), n).is_ok());
      for (size_t rmis : {size_t{0}, size_t{13}}) {
        Buffer out(n, rmis);
        ASSERT_TRUE(s->read(key, out.data(), n).is_ok()) << "read into a buffer " << rmis << " past 4 KiB";
        std::string where;
        ASSERT_EQ(count_wrong(out.data(), in.data(), n, &where), 0u) << where;
      }
      ASSERT_TRUE(s->free(key).is_ok());
    }
  }
  EXPECT_EQ(s->stats().used_bytes, 0u);
}

TEST_P(SwapStoreTest, BufferedFilesRoundTrip) {
  SwapStoreOptions o = options();
  o.direct = false;
  auto s = open(o);
  ASSERT_NE(s, nullptr);
  Rng rng(12);
  for (size_t n : {size_t{1}, size_t{4097}, size_t{kChunk + 3}}) {
    Buffer in(n, 5), out(n, 0);
    in.fill(rng);
    ASSERT_TRUE(s->write("b", in.data(), n).is_ok());
    ASSERT_TRUE(s->read("b", out.data(), n).is_ok());
    EXPECT_EQ(count_wrong(out.data(), in.data(), n), 0u) << "size " << n;
  }
}

// O_DIRECT writes a key's last block whole: the bytes after the key must be zeros, not whatever a bounce block
// held before (another key's data).
TEST_P(SwapStoreTest, TailPaddingIsWrittenAsZeros) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  std::vector<char> long_tail(4096 + 4000, 'x'), short_tail(4096 + 1, 'y');
  ASSERT_TRUE(s->write("long", long_tail.data(), long_tail.size()).is_ok());
  ASSERT_TRUE(s->write("short", short_tail.data(), short_tail.size()).is_ok());
  const SwapExtent e = s->locate("short").value();
  ASSERT_EQ(e.padded, 2u * 4096);
  const std::vector<char> padding = peek(e.path, e.offset + e.length, e.padded - e.length);
  EXPECT_EQ(padding, std::vector<char>(padding.size(), 0));
}

TEST_P(SwapStoreTest, ManyKeysInOneBatchThenOverwritten) {
  SwapStoreOptions o = options();
  o.file_bytes = 8 << 20;
  auto s = open(o);
  ASSERT_NE(s, nullptr);
  Rng rng(13);
  constexpr int kKeys = 60;
  std::vector<std::unique_ptr<Buffer>> in(kKeys);
  for (int round = 0; round < 2; ++round) {
    IoBatch writes;
    for (int k = round; k < kKeys; k += 1 + round) {  // round 1 overwrites every other key with a new size
      const size_t n = 1 + rng.below(200000);
      in[k] = std::make_unique<Buffer>(n, rng.below(2) ? 0 : rng.below(4096));
      in[k]->fill(rng);
      ASSERT_TRUE(s->write(fmt::format("key{}", k), in[k]->data(), n, &writes).is_ok());
    }
    ASSERT_TRUE(writes.wait().is_ok());
    IoBatch reads;
    std::vector<std::unique_ptr<Buffer>> out(kKeys);
    for (int k = 0; k < kKeys; ++k) {
      out[k] = std::make_unique<Buffer>(in[k]->size(), rng.below(2) ? 0 : rng.below(4096));
      ASSERT_TRUE(s->read(fmt::format("key{}", k), out[k]->data(), in[k]->size(), &reads).is_ok());
    }
    ASSERT_TRUE(reads.wait().is_ok());
    for (int k = 0; k < kKeys; ++k) {
      std::string where;
      ASSERT_EQ(count_wrong(out[k]->data(), in[k]->data(), in[k]->size(), &where), 0u)
          << "round " << round << " key" << k << " (" << in[k]->size() << " bytes):" << where;
    }
  }
  const SwapStoreStats st = s->stats();
  EXPECT_EQ(st.keys, uint64_t{kKeys});
  EXPECT_EQ(st.extents, uint64_t{kKeys});  // the overwritten versions went back
  uint64_t logical = 0;
  for (const auto& b : in) logical += b->size();
  EXPECT_EQ(st.logical_bytes, logical);
}

TEST_P(SwapStoreTest, FreeReturnsSpaceAndNeighboursCoalesce) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  const SwapStoreStats empty = s->stats();
  EXPECT_EQ(empty.free_bytes, kFileBytes - 4096);
  EXPECT_EQ(empty.free_extents, 1u);
  Rng rng(14);
  constexpr size_t n = 256 * 1024 + 1;  // 65 blocks on disk
  constexpr uint64_t padded = 65 * 4096;
  Buffer in(n, 0);
  in.fill(rng);
  for (const char* k : {"a", "b", "c", "d"}) ASSERT_TRUE(s->write(k, in.data(), n).is_ok());
  EXPECT_EQ(s->stats().used_bytes, 4 * padded);
  const uint64_t b_at = s->locate("b")->offset;
  ASSERT_TRUE(s->free("b").is_ok());
  ASSERT_TRUE(s->free("c").is_ok());
  EXPECT_EQ(s->stats().free_extents, 2u) << "b and c merge into one hole";
  // Exactly the hole's size: best fit puts it there, not in the larger free range after d.
  Buffer big(2 * padded, 0);
  big.fill(rng);
  ASSERT_TRUE(s->write("e", big.data(), big.size()).is_ok());
  EXPECT_EQ(s->locate("e")->offset, b_at);
  EXPECT_EQ(s->stats().free_extents, 1u);
  for (const char* k : {"a", "d", "e"}) ASSERT_TRUE(s->free(k).is_ok());
  const SwapStoreStats after = s->stats();
  EXPECT_EQ(after.used_bytes, 0u);
  EXPECT_EQ(after.extents, 0u);
  EXPECT_EQ(after.free_extents, 1u);
  EXPECT_EQ(after.largest_free_extent, kFileBytes - 4096);
  EXPECT_EQ(after.keys, 0u);
  EXPECT_EQ(after.logical_bytes, 0u);
  Buffer out(n, 0);
  expect_error(s->read("a", out.data(), n), StatusCode::kNotFound, {"'a'", dir_});
  expect_error(s->free("a"), StatusCode::kNotFound, {"'a'"});
}

TEST_P(SwapStoreTest, OverwriteSwitchesVersionAndReleasesTheOld) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  Rng rng(15);
  Buffer v1(100000, 0), v2(50001, 3), out(50001, 0);
  v1.fill(rng);
  v2.fill(rng);
  ASSERT_TRUE(s->write("k", v1.data(), v1.size()).is_ok());
  const uint64_t gen1 = s->locate("k")->generation;
  ASSERT_TRUE(s->write("k", v2.data(), v2.size()).is_ok());
  EXPECT_EQ(s->length("k").value(), v2.size());
  EXPECT_GT(s->locate("k")->generation, gen1);
  ASSERT_TRUE(s->read("k", out.data(), out.size()).is_ok());
  EXPECT_EQ(count_wrong(out.data(), v2.data(), v2.size()), 0u);
  EXPECT_EQ(s->stats().extents, 1u);
  EXPECT_EQ(s->stats().used_bytes, 13u * 4096);
}

TEST_P(SwapStoreTest, EmptyKeysAndClearErrorsForBadRequests) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->write("empty", nullptr, 0).is_ok());  // an empty key is a key like any other
  EXPECT_EQ(s->length("empty").value(), 0u);
  EXPECT_TRUE(s->read("empty", nullptr, 0).is_ok());
  std::vector<char> buf(10000, 7);
  expect_error(s->read("empty", buf.data(), 1), StatusCode::kInvalidArgument, {"'empty'", "holds 0 bytes"});
  EXPECT_TRUE(s->free("empty").is_ok());
  ASSERT_TRUE(s->write("k", buf.data(), buf.size()).is_ok());
  expect_error(s->read("k", buf.data(), 9999), StatusCode::kInvalidArgument, {"'k'", "10000", "9999"});
  expect_error(s->read("nope", buf.data(), 1), StatusCode::kNotFound, {"'nope'"});
  EXPECT_EQ(s->length("nope").status().code(), StatusCode::kNotFound);
  std::vector<char> huge(kFileBytes);
  expect_error(s->write("huge", huge.data(), huge.size()), StatusCode::kInvalidArgument, {"'huge'", "raise file_bytes"});
  SwapStoreOptions bad = options();
  bad.checksum_chunk = 1000;
  expect_error(SwapStore::open(*queue_, bad).status(), StatusCode::kInvalidArgument, {"checksum_chunk"});
  bad = options();
  bad.max_files = 0;
  expect_error(SwapStore::open(*queue_, bad).status(), StatusCode::kInvalidArgument, {"max_files"});
}

TEST_P(SwapStoreTest, FailedWritesKeepThePreviousVersion) {
  FaultOptions fo;
  fo.enospc_rate = 1;
  FaultEngine faulty(*engine_, fo);
  IoQueue queue(faulty, IoQueueOptions{kBlock});
  faulty.set_enabled(false);
  auto s = open(options(), &queue);
  ASSERT_NE(s, nullptr);
  Rng rng(16);
  Buffer v1(70000, 0), v2(90000, 0), out(70000, 1);
  v1.fill(rng);
  v2.fill(rng);
  ASSERT_TRUE(s->write("k", v1.data(), v1.size()).is_ok());
  faulty.set_enabled(true);
  expect_error(s->write("k", v2.data(), v2.size()), StatusCode::kIOError, {"'k'", "ENOSPC"});
  expect_error(s->write("new", v2.data(), v2.size()), StatusCode::kIOError, {"'new'", "ENOSPC"});
  EXPECT_FALSE(s->contains("new"));
  EXPECT_EQ(s->length("k").value(), v1.size());
  EXPECT_EQ(s->stats().extents, 1u) << "the failed writes' extents went back";
  ASSERT_TRUE(s->read("k", out.data(), out.size()).is_ok());
  EXPECT_EQ(count_wrong(out.data(), v1.data(), v1.size()), 0u);
  faulty.set_enabled(false);
  EXPECT_GT(faulty.counts().enospc, 0u);
}

TEST_P(SwapStoreTest, FullStoreIsOutOfMemoryAndKeepsWhatItHas) {
  SwapStoreOptions o = options();
  o.file_bytes = 1 << 20;
  o.max_files = 2;
  auto s = open(o);
  ASSERT_NE(s, nullptr);
  Rng rng(17);
  Buffer in(200000, 0);
  std::map<std::string, std::vector<char>> stored;
  Status st;
  for (int i = 0; st.is_ok(); ++i) {
    in.fill(rng);
    const std::string key = fmt::format("t{}", i);
    st = s->write(key, in.data(), in.size());
    if (st.is_ok()) stored[key] = in.bytes();
  }
  expect_error(st, StatusCode::kOutOfMemory, {dir_, "is full", "all 2 files"});
  EXPECT_EQ(stored.size(), 10u);  // 5 extents of 49 blocks fit in each file's 255
  EXPECT_EQ(s->stats().files, 2u);
  Buffer out(in.size(), 0);
  for (const auto& [key, bytes] : stored) {
    ASSERT_TRUE(s->read(key, out.data(), out.size()).is_ok()) << key;
    EXPECT_EQ(count_wrong(out.data(), bytes.data(), bytes.size()), 0u) << key;
  }
  ASSERT_TRUE(s->free("t3").is_ok());
  EXPECT_TRUE(s->write("again", in.data(), in.size()).is_ok());
}

TEST_P(SwapStoreTest, FilesAreNamedLockedAddedLazilyAndRemoved) {
  SwapStoreOptions o = options();
  o.rank = 3;
  o.file_bytes = 1 << 20;
  auto s = open(o);
  ASSERT_NE(s, nullptr);
  const std::string first = fmt::format("strata-swap-r3-p{}-0.swp", ::getpid());
  EXPECT_EQ(swap_files(), std::vector<std::string>{first});
  const std::vector<char> block = peek(dir_ + "/" + first, 0, 4096);
  SwapFileHeader h;
  std::memcpy(&h, block.data(), sizeof(h));
  EXPECT_EQ(std::string(h.magic, 8), "STRATASW");
  EXPECT_EQ(h.version, kSwapVersion);
  EXPECT_EQ(h.header_bytes, 4096u);
  EXPECT_EQ(h.rank, 3u);
  EXPECT_EQ(h.pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(h.file_index, 0u);
  EXPECT_EQ(h.extent_alignment, 4096u);
  EXPECT_EQ(h.file_bytes, uint64_t{1} << 20);
  EXPECT_EQ(h.checksum_chunk, kChunk);
  EXPECT_NE(h.created_unix_ns, 0u);
  uint64_t sum;
  std::memcpy(&sum, block.data() + 4088, 8);
  EXPECT_EQ(sum, XXH3_64bits(block.data(), 4088));
  std::vector<char> big(900000, 1);
  ASSERT_TRUE(s->write("a", big.data(), big.size()).is_ok());
  EXPECT_EQ(s->stats().files, 1u);
  ASSERT_TRUE(s->write("b", big.data(), big.size()).is_ok());
  EXPECT_EQ(s->stats().files, 2u);
  EXPECT_EQ(s->locate("b")->path, dir_ + "/" + fmt::format("strata-swap-r3-p{}-1.swp", ::getpid()));
  EXPECT_EQ(swap_files().size(), 2u);
  s.reset();
  EXPECT_TRUE(swap_files().empty()) << "clean shutdown removes every file";
}

TEST_P(SwapStoreTest, TwoStoresOfOneRankInOneDirectoryAreRefused) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  std::vector<char> in(5000, 9), out(5000);
  ASSERT_TRUE(s->write("k", in.data(), in.size()).is_ok());
  expect_error(SwapStore::open(*queue_, options()).status(), StatusCode::kInvalidArgument,
               {"locked by another live swap store", "rank 0"});
  SwapStoreOptions other = options();
  other.rank = 1;
  auto s1 = open(other);
  ASSERT_NE(s1, nullptr);
  EXPECT_EQ(swap_files().size(), 2u);
  ASSERT_TRUE(s->read("k", out.data(), out.size()).is_ok()) << "the first store's file was not touched";
  EXPECT_EQ(in, out);
}

TEST_P(SwapStoreTest, StaleFilesAreRemovedAtOpenLiveOnesKept) {
  ASSERT_TRUE(engine_->create_dirs(dir_).is_ok());
  make_file("strata-swap-r9-p1-0.swp", 1 << 20, false);  // its owner died: nobody holds the lock
  make_file("strata-swap-r9-p1-1.swp", 1 << 20, false);
  const int live = make_file("strata-swap-r8-p2-0.swp", 1 << 20, true);
  make_file("notes.txt", 10, false);
  {
    auto s = open();
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(swap_files(), (std::vector<std::string>{fmt::format("strata-swap-r0-p{}-0.swp", ::getpid()),
                                                       "strata-swap-r8-p2-0.swp"}));
  }
  EXPECT_EQ(swap_files(), std::vector<std::string>{"strata-swap-r8-p2-0.swp"});
  auto names = engine_->list(dir_);
  ASSERT_TRUE(names.is_ok());
  EXPECT_NE(std::find(names->begin(), names->end(), "notes.txt"), names->end());
  EXPECT_TRUE(engine_->close(live).is_ok());
}

TEST_P(SwapStoreTest, PendingWriteRefusesReadWriteAndFree) {
  GateEngine gate(*engine_);
  IoQueue queue(gate, IoQueueOptions{kBlock});
  auto s = open(options(), &queue);
  ASSERT_NE(s, nullptr);
  Rng rng(18);
  Buffer v1(10000, 0), v2(10000, 0), out(10000, 0);
  v1.fill(rng);
  v2.fill(rng);
  ASSERT_TRUE(s->write("k", v1.data(), v1.size()).is_ok());
  gate.shut_gate();
  IoBatch batch;
  ASSERT_TRUE(s->write("k", v2.data(), v2.size(), &batch).is_ok());
  ASSERT_TRUE(s->write("first", v2.data(), v2.size(), &batch).is_ok());
  EXPECT_GT(gate.held(), 0u);
  expect_error(s->read("k", out.data(), out.size(), &batch), StatusCode::kInvalidArgument, {"'k'", "in flight"});
  expect_error(s->write("k", v1.data(), v1.size(), &batch), StatusCode::kInvalidArgument, {"'k'", "in flight"});
  expect_error(s->free("k"), StatusCode::kInvalidArgument, {"'k'", "in flight"});
  EXPECT_TRUE(s->contains("k"));
  EXPECT_FALSE(s->contains("first"));
  EXPECT_EQ(s->length("k").value(), v1.size());
  gate.open_gate();
  ASSERT_TRUE(batch.wait().is_ok());
  ASSERT_TRUE(s->read("k", out.data(), out.size()).is_ok());
  EXPECT_EQ(count_wrong(out.data(), v2.data(), v2.size()), 0u);
  EXPECT_TRUE(s->contains("first"));
}

TEST_P(SwapStoreTest, ExtentOutlivesFreeWhileReadInFlight) {
  GateEngine gate(*engine_);
  IoQueue queue(gate, IoQueueOptions{kBlock});
  auto s = open(options(), &queue);
  ASSERT_NE(s, nullptr);
  Rng rng(19);
  Buffer v1(150000, 0), v2(150000, 0), out(150000, 7);
  v1.fill(rng);
  v2.fill(rng);
  ASSERT_TRUE(s->write("k", v1.data(), v1.size()).is_ok());
  const SwapExtent old = s->locate("k").value();
  gate.shut_gate();
  IoBatch reading, writing;
  ASSERT_TRUE(s->read("k", out.data(), out.size(), &reading).is_ok());
  ASSERT_TRUE(s->free("k").is_ok());
  EXPECT_FALSE(s->contains("k"));
  EXPECT_EQ(s->stats().extents, 1u) << "held by the read in flight";
  ASSERT_TRUE(s->write("x", v2.data(), v2.size(), &writing).is_ok());  // allocated while the read is in flight
  EXPECT_EQ(s->stats().extents, 2u);
  gate.open_gate();
  ASSERT_TRUE(writing.wait().is_ok());
  ASSERT_TRUE(reading.wait().is_ok());
  EXPECT_NE(s->locate("x")->offset, old.offset) << "the freed extent was reused while a read of it was in flight";
  EXPECT_EQ(count_wrong(out.data(), v1.data(), v1.size()), 0u);
  EXPECT_EQ(s->stats().extents, 1u) << "the old extent went back when the read finished";
}

TEST_P(SwapStoreTest, ConcurrentWritersAndReadersOnDifferentKeys) {
  SwapStoreOptions o = options();
  o.max_files = 6;
  auto s = open(o);
  ASSERT_NE(s, nullptr);
  Rng seed_rng(20);
  Buffer shared(300001, 0);
  shared.fill(seed_rng);
  ASSERT_TRUE(s->write("shared", shared.data(), shared.size()).is_ok());
  std::atomic<uint64_t> wrong{0}, failures{0}, ops{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Rng rng(100 + t);
      std::map<std::string, std::vector<char>> model;
      for (int i = 0; i < 120; ++i) {
        const std::string key = fmt::format("t{}-k{}", t, rng.below(6));
        const uint64_t what = rng.below(10);
        ops.fetch_add(1);
        if (what < 4) {
          Buffer in(1 + rng.below(200000), rng.below(2) ? 0 : 1 + rng.below(4095));
          in.fill(rng);
          IoBatch b;
          Status st = rng.below(2) ? s->write(key, in.data(), in.size()) : s->write(key, in.data(), in.size(), &b);
          if (st.is_ok()) st = b.wait();
          if (st.is_ok())
            model[key] = in.bytes();
          else
            failures.fetch_add(1);
        } else if (what < 9) {
          const bool mine = what < 7 && model.count(key);
          const std::string k = mine ? key : "shared";
          const std::vector<char>& want = mine ? model[key] : shared.bytes();
          Buffer out(want.size(), rng.below(2) ? 0 : 1 + rng.below(4095));
          if (!s->read(k, out.data(), out.size()).is_ok())
            failures.fetch_add(1);
          else
            wrong.fetch_add(count_wrong(out.data(), want.data(), want.size()));
        } else if (model.count(key)) {
          if (!s->free(key).is_ok()) failures.fetch_add(1);
          model.erase(key);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_EQ(ops.load(), 480u);
}

TEST_P(SwapStoreTest, CorruptionNamesFileOffsetKeyAndChunk) {
  auto s = open();
  ASSERT_NE(s, nullptr);
  Rng rng(21);
  const size_t n = 3 * kChunk + 100;  // chunks 0-2 of kChunk bytes, chunk 3 the 100-byte tail
  Buffer in(n, 0);
  in.fill(rng);
  for (const char* k : {"body", "tail", "padding"}) ASSERT_TRUE(s->write(k, in.data(), n).is_ok());

  const SwapExtent body = s->locate("body").value();
  flip_byte(body.path, body.offset + kChunk + 5);
  for (size_t mis : {size_t{0}, size_t{9}}) {
    Buffer out(n, mis);
    expect_error(s->read("body", out.data(), n), StatusCode::kCorruption,
                 {body.path, fmt::format("offset {}", body.offset + kChunk), "'body'", "chunk 1 of 4", "expected"});
  }
  const SwapExtent tail = s->locate("tail").value();
  flip_byte(tail.path, tail.offset + 3 * kChunk + 99);
  Buffer out(n, 0);
  expect_error(s->read("tail", out.data(), n), StatusCode::kCorruption, {"'tail'", "chunk 3 of 4"});
  // A flip in the padding after the key's last byte changes nothing a read returns.
  const SwapExtent pad = s->locate("padding").value();
  flip_byte(pad.path, pad.offset + n + 10);
  ASSERT_TRUE(s->read("padding", out.data(), n).is_ok());
  EXPECT_EQ(count_wrong(out.data(), in.data(), n), 0u);
  EXPECT_EQ(s->stats().checksum_failures, 3u);
}

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

INSTANTIATE_TEST_SUITE_P(Engines, SwapStoreTest, ::testing::Values("io_uring", "posix", "memory"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

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
