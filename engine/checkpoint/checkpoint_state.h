// checkpoint_state.h — a checkpoint's state.json: written with a checksum, and read as a schema, never
// believed.
//
// state.json holds what the tensors do not: the step, the optimizer's step count, the data position, the data
// shards it counts in and the effective config of the run that wrote it:
//   {"format": "strata-checkpoint", "version": 1, "step": S, "adam_steps": A,
//    "train_position": {"shard": i, "offset": o, "epoch": e}, "train_shards": [{"file": f, "tokens": n}, ...],
//    "config": {...}, "xxh3": "<16 hex digits>"}
// "xxh3" is XXH3-64 of the rest as written (nlohmann's dump(2), which the reader reproduces exactly from what
// it parsed): a flipped bit in the config section is caught like one in the tensors. Files from before it
// (and before "train_shards") are still read.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "engine/data/dataloader.h"

namespace strata::engine {

// One shard of a data source as a checkpoint records it: enough to tell whether a resumed run reads the same
// tokens from the position the checkpoint counts in.
struct ShardRecord {
  std::string file;     // the file's name without its folder (data moved elsewhere is still the same data)
  uint64_t tokens = 0;  // its token count
  bool operator==(const ShardRecord&) const = default;
};

struct TrainState {
  int step = 0;  // optimizer steps completed
  DataLoader::Position train_pos;
  std::vector<ShardRecord> train_shards;  // data.train's shards; empty in checkpoints from before they were kept
  nlohmann::json config;  // the effective config of the run that wrote it
};

// The text of state.json for `state` and the optimizer's step count.
std::string train_state_json(const TrainState& state, int64_t adam_steps);

// Parses state.json's text (`path` names it in errors). Corruption naming the file and the field for bad JSON,
// a checksum mismatch, an unknown or missing field, a wrong type, a number outside its field's range (step and
// adam_steps in [0, 2^31), adam_steps at most step, positions below 2^53), a data position outside the shards
// it records, or a format or version other than this one's. `adam_steps` gets the optimizer's step count.
Result<TrainState> parse_train_state(std::string_view text, const std::string& path, int64_t* adam_steps);

}  // namespace strata::engine
