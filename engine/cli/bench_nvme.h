// bench_nvme.h — `strata bench nvme`: throughput of the NVMe tier on the user's own disk, for the raw I/O
// engine (IoQueue over io_uring or POSIX) and for the swap store (allocation + per-chunk XXH3 checksums).
// `--sweep` tries a grid of block sizes, queue depths and threads and prints the best as DeepSpeed's `aio`
// config section. Compare with fio via scripts/bench_nvme_vs_fio.sh.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace strata::engine {

struct BenchNvmeOptions {
  std::string dir = ".";
  std::string size = "1G";
  std::string block_size = "1M";
  std::string tensor_size = "8M";  // store layer: bytes per key
  uint32_t queue_depth = 32;
  uint32_t threads = 1;
  std::string engine = "auto";
  std::string patterns = "seq_write,seq_read,rand_write,rand_read";
  std::string layer = "both";  // engine | store | both
  bool sqpoll = false;
  bool buffered = false;
  bool sweep = false;
  bool json = false;
  uint64_t seed = 1;
};

void add_bench_nvme_command(CLI::App& bench, BenchNvmeOptions& opts);
int run_bench_nvme(const BenchNvmeOptions& opts);

}  // namespace strata::engine
