#include "engine/cli/bench_nvme.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "common/aligned.h"
#include "common/rng.h"
#include "common/timer.h"
#include "common/units.h"
#include "storage/checksum.h"
#include "storage/io_queue.h"
#include "storage/swap_store.h"

namespace strata::engine {

namespace {

enum class Pattern { kSeqWrite, kSeqRead, kRandWrite, kRandRead };
const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kSeqWrite: return "seq_write";
    case Pattern::kSeqRead: return "seq_read";
    case Pattern::kRandWrite: return "rand_write";
    case Pattern::kRandRead: return "rand_read";
  }
  return "?";
}
bool is_write(Pattern p) { return p == Pattern::kSeqWrite || p == Pattern::kRandWrite; }
bool is_random(Pattern p) { return p == Pattern::kRandWrite || p == Pattern::kRandRead; }

Result<std::vector<Pattern>> parse_patterns(const std::string& list) {
  std::vector<Pattern> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    bool found = false;
    for (Pattern p : {Pattern::kSeqWrite, Pattern::kSeqRead, Pattern::kRandWrite, Pattern::kRandRead}) {
      if (name == pattern_name(p)) out.push_back(p), found = true;
    }
    if (!found) return Status::invalid_argument("--pattern: unknown '{}' (valid: seq_read, seq_write, rand_read, rand_write)", name);
    start = comma + 1;
  }
  return out;
}

struct Point {
  std::string layer;
  Pattern pattern;
  uint64_t bytes;
  double seconds;
  uint64_t block, depth, threads;
  std::string engine;
  bool direct;
  double mib_per_s() const { return bytes / seconds / (1 << 20); }
};

// Work units in order: 0..n-1, or a seeded permutation (every unit once, like fio's random map).
std::vector<uint64_t> unit_order(uint64_t n, bool random, uint64_t seed) {
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (random) {
    Rng rng(seed);
    for (uint64_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  }
  return order;
}

// Issues n operations over `slots` buffer slots: slot i%slots is reused once its last op is done. Callers give
// twice the queue depth in slots; IoQueue itself caps what is in flight at the queue depth, and the spare
// slots let it refill from whichever request finishes first instead of waiting on the oldest (as fio does).
template <typename Issue>
Result<double> run_slots(uint64_t n, size_t slots, Issue issue) {
  auto batches = std::make_unique<IoBatch[]>(slots);
  Timer t;
  for (uint64_t i = 0; i < n; ++i) {
    const size_t s = i % slots;
    if (i >= slots) STRATA_RETURN_IF_ERROR(batches[s].wait());
    STRATA_RETURN_IF_ERROR(issue(i, s, &batches[s]));
  }
  for (size_t s = 0; s < slots; ++s) STRATA_RETURN_IF_ERROR(batches[s].wait());
  return t.seconds();
}

// Untimed, before each timed pattern: flush what earlier patterns left in the disk's (or the host's) write
// cache, so one pattern's writeback does not slow the next one's reads. fio's layout step does the same.
void settle(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::syncfs(fd);
  ::close(fd);
}

struct Setup {
  uint64_t size, block, tensor;
  uint32_t depth, threads;
  EngineKind kind;
  bool sqpoll, direct;
  uint64_t seed;
  std::string dir;
};

// The raw engine: block-sized requests on one preallocated file.
Status bench_engine(const Setup& s, const std::vector<Pattern>& patterns, std::vector<Point>* out) {
  STRATA_ASSIGN_OR_RETURN(auto engine, make_io_engine(EngineOptions{s.kind, s.threads, s.depth, s.sqpoll}));
  IoQueue queue(*engine, IoQueueOptions{s.block});
  const uint64_t n = s.size / s.block;
  const size_t slots = std::min<uint64_t>(2 * size_t{s.threads} * s.depth, n);  // no more buffers than blocks
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(slots * s.block, "bench.nvme.buffers", 4096));
  Rng rng(s.seed);
  for (size_t i = 0; i < buf.size() / 8; ++i) buf.as<uint64_t>()[i] = rng.next_u64();  // incompressible
  const iovec region{buf.data(), buf.size()};
  if (!engine->register_buffers({&region, 1}).is_ok()) { /* fixed buffers are an optimisation only */ }

  STRATA_RETURN_IF_ERROR(engine->create_dirs(s.dir));
  const std::string path = fmt::format("{}/strata-bench-nvme-{}.dat", s.dir, ::getpid());
  STRATA_ASSIGN_OR_RETURN(int file, engine->open(path, OpenOptions{true, true, s.direct}));
  struct Cleanup {
    IoEngine& e;
    int f;
    std::string p;
    ~Cleanup() {
      (void)e.close(f);
      (void)e.remove(p);
    }
  } cleanup{*engine, file, path};
  STRATA_RETURN_IF_ERROR(engine->allocate(file, s.size));

  bool written = false;
  for (Pattern p : patterns) {
    const bool write = is_write(p);
    if (!write && !written) {  // reads need the file written first (untimed)
      STRATA_RETURN_IF_ERROR(run_slots(n, slots, [&](uint64_t i, size_t slot, IoBatch* b) {
        queue.submit(IoRequest{IoOp::kWrite, file, i * s.block, buf.as<char>() + slot * s.block, s.block, {}}, b);
        return Status::ok();
      }).status());
    }
    settle(s.dir);
    const auto order = unit_order(n, is_random(p), s.seed + static_cast<uint64_t>(p));
    STRATA_ASSIGN_OR_RETURN(double secs, run_slots(n, slots, [&](uint64_t i, size_t slot, IoBatch* b) {
      queue.submit(IoRequest{write ? IoOp::kWrite : IoOp::kRead, file, order[i] * s.block,
                             buf.as<char>() + slot * s.block, s.block, {}},
                   b);
      return Status::ok();
    }));
    written = written || write;
    out->push_back(Point{"engine", p, n * s.block, secs, s.block, s.depth, s.threads, engine->name(),
                         engine->direct(file)});
  }
  engine->unregister_buffers();
  return Status::ok();
}

// The swap store: tensor-sized keys, with extent allocation and checksums on every write and read.
Status bench_store(const Setup& s, const std::vector<Pattern>& patterns, std::vector<Point>* out) {
  STRATA_ASSIGN_OR_RETURN(auto engine, make_io_engine(EngineOptions{s.kind, s.threads, s.depth, s.sqpoll}));
  IoQueue queue(*engine, IoQueueOptions{s.block});
  // Buffers for twice the bytes the engine keeps in flight (threads * depth blocks), as in bench_engine.
  const uint64_t n = s.size / s.tensor;
  const size_t slots = std::min<uint64_t>(std::max<size_t>(2, 2 * size_t{s.threads} * s.depth * s.block / s.tensor), n);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(slots * s.tensor, "bench.nvme.tensors", 4096));
  Rng rng(s.seed);
  for (size_t i = 0; i < buf.size() / 8; ++i) buf.as<uint64_t>()[i] = rng.next_u64();
  const iovec region{buf.data(), buf.size()};
  if (!engine->register_buffers({&region, 1}).is_ok()) { /* optional */ }

  SwapStoreOptions so;
  so.dir = s.dir;
  so.file_bytes = (n + slots + 1) * s.tensor + (uint64_t{1} << 20);  // room for copy-on-write overwrites
  so.max_files = 1;
  so.checksum_chunk = s.block;
  so.direct = s.direct;
  STRATA_ASSIGN_OR_RETURN(auto store, SwapStore::open(queue, so));
  auto key = [](uint64_t i) { return fmt::format("t{}", i); };
  bool written = false;
  for (Pattern p : patterns) {
    const bool write = is_write(p);
    if (!write && !written) {
      STRATA_RETURN_IF_ERROR(run_slots(n, slots, [&](uint64_t i, size_t slot, IoBatch* b) {
        return store->write(key(i), buf.as<char>() + slot * s.tensor, s.tensor, b);
      }).status());
    }
    settle(s.dir);
    const auto order = unit_order(n, is_random(p), s.seed + static_cast<uint64_t>(p));
    STRATA_ASSIGN_OR_RETURN(double secs, run_slots(n, slots, [&](uint64_t i, size_t slot, IoBatch* b) {
      char* slot_buf = buf.as<char>() + slot * s.tensor;
      return write ? store->write(key(order[i]), slot_buf, s.tensor, b)
                   : store->read(key(order[i]), slot_buf, s.tensor, b);
    }));
    written = written || write;
    out->push_back(Point{"store", p, n * s.tensor, secs, s.block, s.depth, s.threads, engine->name(), s.direct});
  }
  store.reset();
  engine->unregister_buffers();
  return Status::ok();
}

// The store's checksum on one core: XXH3 on the path storage/checksum.h takes, and as Debian's libxxhash
// (baseline x86-64) computes it, over the same 64 MiB; medians of 5 passes each, in GB/s.
void print_checksum_rates(bool json) {
  constexpr size_t kBytes = size_t{64} << 20;
  auto buf = AlignedBuffer::allocate(kBytes, "bench.nvme.checksum", 4096);
  if (!buf.is_ok()) return;
  Rng rng(3);
  for (size_t i = 0; i < kBytes / 8; ++i) buf->as<uint64_t>()[i] = rng.next_u64();
  static volatile uint64_t sink = 0;  // the hashes are kept, so no pass is optimised away
  auto rate = [&](auto hash) {
    std::vector<double> secs;
    for (int r = 0; r < 5; ++r) {
      Timer t;
      sink = sink + hash(buf->data(), kBytes, static_cast<uint64_t>(r));
      secs.push_back(t.seconds());
    }
    return kBytes / median(secs) / 1e9;
  };
  const double ours = rate([](const void* p, size_t n, uint64_t seed) { return xxh3_64(p, n, seed); });
  const double lib = rate([](const void* p, size_t n, uint64_t seed) { return XXH3_64bits_withSeed(p, n, seed); });
  if (json) {
    std::printf("%s\n", nlohmann::json{{"bench", "nvme"},
                                       {"checksum", {{"path", xxh3_path()}, {"gb_per_s", ours},
                                                     {"libxxhash_gb_per_s", lib}}}}
                             .dump()
                             .c_str());
  } else {
    std::printf("checksums (XXH3, one core): %.1f GB/s on the %s path, libxxhash %.1f GB/s (%.2fx)\n", ours,
                xxh3_path(), lib, ours / lib);
  }
}

nlohmann::json point_json(const Point& p) {
  return {{"bench", "nvme"}, {"layer", p.layer},     {"pattern", pattern_name(p.pattern)},
          {"bytes", p.bytes}, {"seconds", p.seconds}, {"mib_per_s", p.mib_per_s()},
          {"block_size", p.block}, {"queue_depth", p.depth}, {"threads", p.threads},
          {"engine", p.engine}, {"direct", p.direct}};
}

void print_point(const Point& p, bool json) {
  if (json) {
    std::printf("%s\n", point_json(p).dump().c_str());
  } else {
    std::printf("%-6s  %-10s  %7s  %4llu  %3llu  %10.1f MiB/s  %7.3f s  (%s%s)\n", p.layer.c_str(),
                pattern_name(p.pattern), fmt::format("{}K", p.block >> 10).c_str(),
                static_cast<unsigned long long>(p.depth), static_cast<unsigned long long>(p.threads), p.mib_per_s(),
                p.seconds, p.engine.c_str(), p.direct ? ", O_DIRECT" : ", buffered");
  }
  std::fflush(stdout);
}

}  // namespace

void add_bench_nvme_command(CLI::App& bench, BenchNvmeOptions& o) {
  CLI::App* cmd = bench.add_subcommand("nvme", "Disk throughput of the raw I/O engine and the checksummed swap store");
  cmd->add_option("--dir", o.dir, "Directory on the disk to measure (a scratch file is made and removed)")
      ->capture_default_str();
  cmd->add_option("--size", o.size, "Bytes per pattern (K/M/G suffixes)")->capture_default_str();
  cmd->add_option("--pattern", o.patterns, "Comma list of seq_write, seq_read, rand_write, rand_read")
      ->capture_default_str();
  cmd->add_option("--block-size", o.block_size, "Bytes per request (K/M suffixes)")->capture_default_str();
  cmd->add_option("--queue-depth", o.queue_depth, "Requests in flight per thread")->capture_default_str();
  cmd->add_option("--threads", o.threads, "io_uring rings or POSIX threads (DeepSpeed: intra_op_parallelism)")
      ->capture_default_str();
  cmd->add_option("--engine", o.engine, "auto, io_uring or posix")->capture_default_str();
  cmd->add_option("--layer", o.layer, "engine, store or both")
      ->check(CLI::IsMember({"engine", "store", "both"}))
      ->capture_default_str();
  cmd->add_option("--tensor-size", o.tensor_size, "Store layer: bytes per stored tensor")->capture_default_str();
  cmd->add_flag("--sqpoll", o.sqpoll, "io_uring: kernel-side submission polling");
  cmd->add_flag("--buffered", o.buffered, "Go through the page cache (no O_DIRECT)");
  cmd->add_flag("--sweep", o.sweep, "Try block sizes x queue depths x threads; print the best as the aio section");
  cmd->add_option("--seed", o.seed, "Seed for data and random orders")->capture_default_str();
  cmd->add_flag("--json", o.json, "One JSON object per line per pattern and layer");
}

int run_bench_nvme(const BenchNvmeOptions& o) {
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "strata bench nvme: %s\n", st.to_string().c_str());
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  };
  Setup s;
  s.size = parse_bytes(o.size);
  s.block = parse_bytes(o.block_size);
  s.tensor = parse_bytes(o.tensor_size);
  s.depth = o.queue_depth;
  s.threads = o.threads;
  s.sqpoll = o.sqpoll;
  s.direct = !o.buffered;
  s.seed = o.seed;
  s.dir = o.dir;
  if (s.size == 0) return fail(Status::invalid_argument("--size '{}' is not a byte count like 1G or 512M", o.size));
  if (s.block == 0 || s.block % 4096 != 0 || s.block > (1u << 30))
    return fail(Status::invalid_argument("--block-size '{}' must be a multiple of 4K, at most 1G", o.block_size));
  if (s.tensor == 0 || s.tensor % 4096 != 0)
    return fail(Status::invalid_argument("--tensor-size '{}' must be a multiple of 4K", o.tensor_size));
  if (s.size < s.block || s.size < s.tensor)
    return fail(Status::invalid_argument("--size {} is smaller than the block or tensor size", o.size));
  if (s.depth == 0 || s.threads == 0)
    return fail(Status::invalid_argument("--queue-depth and --threads must be positive"));
  auto kind = parse_engine_kind(o.engine);
  if (!kind.is_ok()) return fail(kind.status().with_context("--engine"));
  s.kind = kind.value();
  auto patterns = parse_patterns(o.patterns);
  if (!patterns.is_ok()) return fail(patterns.status());

  std::vector<Point> points;
  if (!o.json) {
    std::printf("strata bench nvme: %s, %s per pattern, dir %s\n", o.sweep ? "sweep" : "single setting",
                o.size.c_str(), o.dir.c_str());
    std::printf("%-6s  %-10s  %7s  %4s  %3s  %16s  %9s\n", "layer", "pattern", "block", "qd", "thr", "throughput",
                "time");
  }
  if (o.sweep) {
    const std::vector<Pattern> seq = {Pattern::kSeqWrite, Pattern::kSeqRead};
    struct Best {
      double score = 0;
      Setup setup;
    } best;
    for (uint64_t block : {uint64_t{256} << 10, uint64_t{1} << 20, uint64_t{4} << 20}) {
      for (uint32_t depth : {8u, 32u, 64u}) {
        for (uint32_t threads : {1u, 2u}) {
          Setup t = s;
          t.block = block;
          t.depth = depth;
          t.threads = threads;
          if (t.size < t.block) continue;
          const size_t first = points.size();
          if (Status st = bench_engine(t, seq, &points); !st.is_ok()) return fail(st);
          double score = 0;
          for (size_t i = first; i < points.size(); ++i) {
            print_point(points[i], o.json);
            score += points[i].mib_per_s() / 2;
          }
          if (score > best.score) best = Best{score, t};
        }
      }
    }
    // The store (allocation + checksums) at the best engine settings, so users see what the tier will deliver.
    const size_t first = points.size();
    if (Status st = bench_store(best.setup, seq, &points); !st.is_ok()) return fail(st);
    for (size_t i = first; i < points.size(); ++i) print_point(points[i], o.json);
    print_checksum_rates(o.json);
    const nlohmann::json aio = {{"block_size", best.setup.block},
                                {"queue_depth", best.setup.depth},
                                {"intra_op_parallelism", best.setup.threads},
                                {"single_submit", false},
                                {"overlap_events", true}};
    if (o.json) {
      std::printf("%s\n", nlohmann::json{{"bench", "nvme"}, {"best", {{"aio", aio}, {"mib_per_s", best.score}}}}.dump().c_str());
    } else {
      std::printf("\nbest (mean of seq_read and seq_write, %.1f MiB/s) as a config section:\n\"aio\": %s\n",
                  best.score, aio.dump(2).c_str());
    }
    return 0;
  }
  const bool engine_layer = o.layer != "store", store_layer = o.layer != "engine";
  if (engine_layer) {
    const size_t first = points.size();
    if (Status st = bench_engine(s, patterns.value(), &points); !st.is_ok()) return fail(st);
    for (size_t i = first; i < points.size(); ++i) print_point(points[i], o.json);
  }
  if (store_layer) {
    const size_t first = points.size();
    if (Status st = bench_store(s, patterns.value(), &points); !st.is_ok()) return fail(st);
    for (size_t i = first; i < points.size(); ++i) print_point(points[i], o.json);
    print_checksum_rates(o.json);
  }
  return 0;
}

}  // namespace strata::engine
