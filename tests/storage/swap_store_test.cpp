// The swap store on every engine (io_uring, POSIX, in-memory): round trips of awkward sizes and alignments, free
// and reuse, copy-on-write overwrites that survive failed writes, a full store, file naming and locking,
// concurrency and corruption reports. Faults, full disks and crashes: swap_store_failure_test.cpp.
#include "storage/swap_store.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "common/rng.h"
#include "storage/fault_engine.h"
#include "tests/storage/swap_store_fixture.h"

namespace strata {
namespace {

using namespace swap_test;

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

INSTANTIATE_TEST_SUITE_P(Engines, SwapStoreTest, ::testing::Values("io_uring", "posix", "memory"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace strata
