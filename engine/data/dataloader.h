// dataloader.h — batches of (inputs, targets) from llm.c token shards, deterministic and resumable.
//
// A source is a file, a directory (every *.bin in it, sorted) or a glob ("data/sotu/sotu_train_*.bin"). Every
// shard is validated when the loader opens (magic, size against the header, token < vocab_size), so a corrupt
// shard stops the run before training starts rather than hours in. Batches are consecutive windows of B*T+1
// tokens (targets are inputs shifted by one), advancing by B*T; a shard too short for the next window moves to
// the next shard, and after the last shard the loader wraps to the first (an epoch). Only the current shard is
// held in memory. Not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "storage/token_shard.h"

namespace strata::engine {

// Expands a file / directory / glob into a sorted list of shard paths. NotFound naming the pattern if empty.
Result<std::vector<std::string>> expand_shard_pattern(const std::string& pattern);

class DataLoader {
 public:
  struct Position {
    size_t shard = 0;   // index into paths()
    size_t offset = 0;  // token offset of the next window in that shard
    uint64_t epoch = 0;
  };

  // `what` ("data.train") names the config field in errors.
  static Result<DataLoader> open(const std::string& pattern, int B, int T, int vocab_size, const std::string& what);

  // Fills inputs (B*T) and targets (B*T).
  Status next_batch(int32_t* inputs, int32_t* targets);
  Status reset() { return seek(Position{}); }
  Status seek(const Position& pos);
  Position position() const { return pos_; }

  const std::vector<std::string>& paths() const { return paths_; }
  const std::vector<size_t>& shard_tokens() const { return sizes_; }  // per shard, as paths()
  uint64_t total_tokens() const { return total_tokens_; }
  // Batches in one pass over all shards.
  uint64_t batches_per_epoch() const { return batches_per_epoch_; }

 private:
  Status load(size_t shard);
  std::vector<std::string> paths_;
  std::vector<size_t> sizes_;  // tokens per shard
  int B_ = 0, T_ = 0, vocab_size_ = 0;
  std::string what_;
  std::optional<TokenShard> current_;
  size_t current_index_ = SIZE_MAX;
  Position pos_;
  uint64_t total_tokens_ = 0;
  uint64_t batches_per_epoch_ = 0;
};

}  // namespace strata::engine
