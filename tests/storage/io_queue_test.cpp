// IoQueue's scheduling: a full queue makes submits wait in the queue rather than block their callers, freed
// slots go to waiting reads before waiting writes (but never starve the writes), writes in flight can be
// capped, and a line of waiting pieces behind an engine that completes on the submitting thread is handed on
// in a loop. (Splitting, resumes and errors run against every engine in io_engine_test.cpp.)
#include "storage/io_queue.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "storage/fault_engine.h"
#include "storage/memory_engine.h"
#include "tests/test_util.h"

namespace strata {
namespace {

constexpr size_t kBlock = size_t{64} << 10;

// Names requests' on_complete calls in the order they ran.
struct CompletionOrder {
  std::mutex mu;
  std::vector<std::string> done;
  std::function<Status()> note(std::string what) {
    return [this, what = std::move(what)] {
      std::lock_guard<std::mutex> lock(mu);
      done.push_back(what);
      return Status::ok();
    };
  }
};

// A full queue makes a submit wait in the queue, not block the caller; and a slot that frees goes to a waiting
// read before the writes that came earlier (the optimizer's swap pipeline relies on both: its next update
// needs the read, while the writes only free their buffers).
TEST(IoQueueTest, SubmitNeverBlocksAndReadsGoBeforeWaitingWrites) {
  MemoryEngine memory(MemoryEngineOptions{.lanes = 1, .queue_depth = 2});
  ASSERT_OK(memory.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, memory.open("/mem/order.bin", OpenOptions{.create = true, .direct = false}));
  FaultEngine disk(memory, FaultOptions{});  // no faults: a disk that is slow to write, as the test says
  IoQueue q(disk, IoQueueOptions{.block_size = kBlock});
  std::vector<char> data(5 * kBlock, 'w');
  ASSERT_OK(q.write(f, 0, data.data(), data.size()));  // something to read back
  CompletionOrder order;
  auto note = [&](std::string what) { return order.note(std::move(what)); };
  disk.hold_writes(true);
  IoBatch writes, read;
  // Two writes fill the lane's two slots (held by the disk), two more wait in the queue: none of these blocks.
  for (int i = 0; i < 4; ++i)
    q.submit(IoRequest{IoOp::kWrite, f, i * kBlock, data.data() + i * kBlock, kBlock, note(fmt::format("w{}", i))},
             &writes);
  EXPECT_EQ(disk.held_writes(), 2u);
  std::vector<char> back(kBlock);
  q.submit(IoRequest{IoOp::kRead, f, 4 * kBlock, back.data(), kBlock, note("r")}, &read);
  EXPECT_FALSE(read.done()) << "the read found a slot although both were taken";
  disk.hold_writes(false);
  ASSERT_OK(writes.wait());
  ASSERT_OK(read.wait());
  const std::vector<std::string>& done = order.done;
  const auto at = [&](const std::string& what) { return std::find(done.begin(), done.end(), what) - done.begin(); };
  ASSERT_EQ(done.size(), 5u);
  EXPECT_LT(at("r"), at("w2")) << fmt::format("completion order: {}", fmt::join(done, ","));
  EXPECT_LT(at("r"), at("w3")) << fmt::format("completion order: {}", fmt::join(done, ","));
  EXPECT_EQ(std::string(back.begin(), back.end()), std::string(kBlock, 'w'));
}

// The busy time counts only while the disk has pieces: a write held back for 60 ms counts about that long,
// and the idle time around it not at all.
TEST(IoQueueTest, BusyTimeIsTheTimeWithPiecesInTheEngine) {
  MemoryEngine memory(MemoryEngineOptions{.lanes = 1, .queue_depth = 2});
  ASSERT_OK(memory.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, memory.open("/mem/busy.bin", OpenOptions{.create = true, .direct = false}));
  FaultEngine disk(memory, FaultOptions{});
  IoQueue q(disk, IoQueueOptions{.block_size = kBlock});
  EXPECT_EQ(q.stats().busy_s, 0.0);
  std::vector<char> data(kBlock, 'b');
  disk.hold_writes(true);
  IoBatch batch;
  const auto start = std::chrono::steady_clock::now();
  q.submit(IoRequest{IoOp::kWrite, f, 0, data.data(), kBlock, nullptr}, &batch);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_GE(q.stats().busy_s, 0.055) << "the open period counts too";
  disk.hold_writes(false);
  ASSERT_OK(batch.wait());
  const double held = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double busy = q.stats().busy_s;
  EXPECT_GE(busy, 0.055);
  EXPECT_LE(busy, held);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_EQ(q.stats().busy_s, busy) << "an idle disk is not busy";
}

// Reads go first, but no more than a full queue's worth past a waiting write: a write somebody waits on (to
// reuse its buffer) is not held back by a stream of reads.
TEST(IoQueueTest, WaitingWritesAreNotStarvedByReads) {
  MemoryEngine memory(MemoryEngineOptions{.lanes = 1, .queue_depth = 1});
  ASSERT_OK(memory.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, memory.open("/mem/starve.bin", OpenOptions{.create = true, .direct = false}));
  FaultEngine disk(memory, FaultOptions{});
  IoQueue q(disk, IoQueueOptions{.block_size = kBlock});
  std::vector<char> data(4 * kBlock, 'd');
  ASSERT_OK(q.write(f, 0, data.data(), data.size()));
  CompletionOrder order;
  auto note = [&](std::string what) { return order.note(std::move(what)); };
  disk.hold_writes(true);
  IoBatch batch;
  std::vector<char> back(3 * kBlock);
  q.submit(IoRequest{IoOp::kWrite, f, 0, data.data(), kBlock, note("w0")}, &batch);  // the one slot, held
  q.submit(IoRequest{IoOp::kWrite, f, kBlock, data.data() + kBlock, kBlock, note("w1")}, &batch);
  for (int i = 0; i < 3; ++i)
    q.submit(IoRequest{IoOp::kRead, f, (1 + i) * kBlock, back.data() + i * kBlock, kBlock, note(fmt::format("r{}", i))},
             &batch);
  disk.hold_writes(false);
  ASSERT_OK(batch.wait());
  EXPECT_EQ(fmt::format("{}", fmt::join(order.done, ",")), "w0,r0,w1,r1,r2")
      << "one read (a queue of one slot) may pass the waiting write, then the write goes";
}

// max_write_bytes_in_flight keeps writes out of the engine beyond that many bytes even where slots are free, so a
// read that
// comes later finds a slot and goes at once instead of queueing in the device behind every write (the offload
// runtime's reads of optimizer state behind a sub-group's writes).
TEST(IoQueueTest, WritesInFlightAreCappedAndAReadPassesTheRest) {
  MemoryEngine memory(MemoryEngineOptions{.lanes = 1, .queue_depth = 4});
  ASSERT_OK(memory.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, memory.open("/mem/cap.bin", OpenOptions{.create = true, .direct = false}));
  FaultEngine disk(memory, FaultOptions{});
  std::vector<char> data(7 * kBlock);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>('a' + (i * 7) % 23);
  for (const uint32_t cap : {0u, 2u}) {  // in pieces of kBlock bytes
    SCOPED_TRACE(fmt::format("max_write_bytes_in_flight {} blocks", cap));
    IoQueue q(disk, IoQueueOptions{.block_size = kBlock, .max_write_bytes_in_flight = cap * kBlock});
    ASSERT_OK(q.write(f, 6 * kBlock, data.data() + 6 * kBlock, kBlock));  // what the read gets
    disk.hold_writes(true);
    IoBatch writes, read;
    for (int i = 0; i < 6; ++i)
      q.submit(IoRequest{IoOp::kWrite, f, i * kBlock, data.data() + i * kBlock, kBlock, nullptr}, &writes);
    EXPECT_EQ(disk.held_writes(), cap == 0 ? 4u : cap) << "writes handed to the engine";
    std::vector<char> back(kBlock);
    q.submit(IoRequest{IoOp::kRead, f, 6 * kBlock, back.data(), kBlock, nullptr}, &read);
    if (cap > 0) {
      ASSERT_OK(read.wait());  // a slot was free: it did not wait for any held write
      EXPECT_EQ(disk.held_writes(), cap);
      EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + 6 * kBlock));
    } else {
      EXPECT_FALSE(read.done()) << "every slot holds a write";
    }
    disk.hold_writes(false);
    ASSERT_OK(writes.wait());
    ASSERT_OK(read.wait());
    std::vector<char> all(data.size());
    ASSERT_OK(q.read(f, 0, all.data(), all.size()));
    EXPECT_TRUE(all == data);
  }
}

// Pieces that wait for a slot behind an engine that completes on the submitting thread are handed on in a loop,
// not by recursion: four thousand of them through one slot, on a thread with a 256 KiB stack (a frame chain per
// piece would need several MiB).
TEST(IoQueueTest, ALongLineOfWaitingPiecesDoesNotRecurse) {
  MemoryEngine memory(MemoryEngineOptions{.lanes = 1, .queue_depth = 1});
  ASSERT_OK(memory.create_dirs("/mem"));
  ASSERT_OK_AND_ASSIGN(const int f, memory.open("/mem/line.bin", OpenOptions{.create = true, .direct = false}));
  IoQueue q(memory, IoQueueOptions{.block_size = 4096});
  struct Job {
    IoQueue* q;
    int f;
    std::vector<char> buf, back;
    Status wrote, read;
  } job{&q, f, std::vector<char>(size_t{4000} * 4096, 'x'), std::vector<char>(size_t{4000} * 4096), {}, {}};
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, size_t{256} << 10), 0);
  pthread_t t;
  ASSERT_EQ(pthread_create(
                &t, &attr,
                [](void* p) -> void* {
                  auto* j = static_cast<Job*>(p);
                  j->wrote = j->q->write(j->f, 0, j->buf.data(), j->buf.size());
                  j->read = j->q->read(j->f, 0, j->back.data(), j->back.size());
                  return nullptr;
                },
                &job),
            0);
  pthread_join(t, nullptr);
  pthread_attr_destroy(&attr);
  ASSERT_OK(job.wrote);
  ASSERT_OK(job.read);
  EXPECT_TRUE(job.back == job.buf);
  EXPECT_EQ(q.stats().pieces, 8000u);
}

}  // namespace
}  // namespace strata
