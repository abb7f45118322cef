// checkpoint.h — saving and restoring training state: one directory per step, never half-written.
//
// <checkpoint_dir>/step_000100/ holds model.safetensors (fp32 parameters under their canonical names),
// optimizer.safetensors (AdamW moments "m.<name>", "v.<name>"), and state.json (step, optimizer step count, data
// loader positions, the effective config). It is written as "step_000100.tmp" and renamed when complete, then
// <checkpoint_dir>/latest is replaced atomically with the new directory's name; a crash at any point leaves
// the previous checkpoint intact and `latest` pointing at a complete one. Runs on the training thread. The
// state is read and written through Model::read_params/write_params and the Optimizer interface, so offloaded
// runs checkpoint the same files, staged through host memory one unit at a time (a unit's m and v, written from
// there without another copy).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "engine/checkpoint/checkpoint_state.h"
#include "engine/checkpoint/foreign_weights.h"
#include "engine/checkpoint/state_pieces.h"
#include "engine/data/dataloader.h"
#include "engine/model/model.h"
#include "engine/optim/optimizer.h"

namespace strata::engine {

// The shards a loader reads, as a checkpoint records them.
std::vector<ShardRecord> shard_records(const DataLoader& loader);

// Where a resumed run continues in its data: the index, in `now` (the resumed run's shards), of the shard
// `saved[pos.shard]` the checkpoint's position is in. The same index when that shard is still there; another
// when shards were added or removed before it (the file found by name, once, with the same token count; a
// warning says so); an error naming the file when it is missing or has other tokens, since the run would
// silently read other data. Checkpoints without records (`saved` empty) continue at pos.shard. `what` names
// the config field ("data.train").
Result<size_t> resume_shard(const std::vector<ShardRecord>& saved, const DataLoader::Position& pos,
                            const std::vector<ShardRecord>& now, const std::string& what);

// The settings that differ between a checkpoint's config and the resumed run's, as "key: old -> new" with
// dotted keys ("training.lr: 0.0003 -> 0.0001"; "(unset)" for a key only one has), in key order.
std::vector<std::string> config_changes(const nlohmann::json& saved, const nlohmann::json& now);

// Creates `dir` if needed and proves it is writable by writing and removing a probe file; the error names the
// directory and the OS's reason. Called before training so a bad folder fails in the first second.
Status check_writable_dir(const std::string& dir, const std::string& what);

// Writes model weights alone (for fine-tuning or export) to a safetensors file, atomically.
Status save_model(const Model& model, const std::string& path);
// Loads weights into a model of the same config from our model.safetensors (or a step folder's), Hugging Face's
// GPT-2 or an llm.c model file (engine/checkpoint/foreign_weights.h); every tensor is checked before any is
// written, and errors name the file, the tensor and the config key that disagrees.
Status load_model(Model& model, const std::string& path_or_folder, const WeightsOpenOptions& options = {});
// The same into a model and its optimizer at the start of a run: the weights become the optimizer's master
// weights too and its moments zero (what load_model then opt.adopt_params() gives), a sub-group at a time
// straight from the file where the optimizer keeps its state offloaded (PieceState::load_state), so that
// a large model's units are never held whole outside the host budget.
Status load_model(Model& model, Optimizer& opt, const std::string& path_or_folder,
                  const WeightsOpenOptions& options = {});
// The model family's initial weights for `seed` (Model::init_weights's, the same bits) into a model and its
// optimizer likewise.
Status init_model(Model& model, Optimizer& opt, uint64_t seed);
// Whether `opt` gathers unit's state over ranks a piece at a time for a checkpoint (state_pieces.h).
bool gathers_pieces(Optimizer& opt, size_t unit);
// Unit u's weights, elements [offset, offset + dst.size()) of its whole layout (Model::whole_layout).
using WeightsFill = std::function<Status(size_t unit, size_t offset, std::span<float> dst)>;
// The weights `fill` gives into a model and its optimizer likewise.
Status load_model(Model& model, Optimizer& opt, const WeightsFill& fill);

// For a run that does not resume: `checkpoint_dir` must hold no checkpoint (an earlier run's, which this run's
// saves would replace step by step and prune); the error says which it found and the ways on.
Status check_no_checkpoints(const std::string& checkpoint_dir);

// Saves a checkpoint for `state.step` under `checkpoint_dir`; keeps the newest `keep` (0 = all). Returns the
// directory written. Unfinished saves' folders ("step_*.tmp", from a failed or killed save) go first, so that
// one left by a full disk does not make the next save fail too.
Result<std::string> save_checkpoint(const std::string& checkpoint_dir, const Model& model, Optimizer& opt,
                                    const TrainState& state, int keep);

// Under ZeRO-3, what the other ranks of a data-parallel group do while its rank 0 reads the units for a
// checkpoint: the same collective reads of each unit's parameters and moments (the units `include` accepts:
// with pipeline stages, the stage's own), in the same order, with nothing written. Where the optimizer gathers
// pieces (PieceState::gather_piece), each rank sends rank 0 its shard's a piece at a time, and no rank holds a
// unit whole.
Status take_part_in_checkpoint(const Model& model, Optimizer& opt, const std::function<bool(size_t unit)>& include);

// Resolves `path` (a step directory, or a checkpoint_dir containing `latest`; in a checkpoint_dir without one,
// left by a run stopped between its first save and writing `latest`, the complete step folder with the
// highest step) and restores model, optimizer and state (every tensor of both files checked before any is
// written; offloaded state a sub-group at a time, as load_model with an optimizer). The model config in the
// checkpoint must equal the model's; the error names the field.
// `check`, when given, sees the state before anything is loaded (minutes for a large model): an error from it
// is returned as is.
Result<TrainState> load_checkpoint(const std::string& path, Model& model, Optimizer& opt,
                                   const std::function<Status(const TrainState&)>& check = {});

}  // namespace strata::engine
