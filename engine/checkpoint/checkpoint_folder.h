// checkpoint_folder.h — a checkpoint folder's steps, put in place and pruned: the folder operations save_checkpoint
// and load_checkpoint (checkpoint.h) share, so that a killed save never leaves `latest` naming a partial step.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata::engine {

// The step a checkpoint folder's name gives ("step_001200": 1200), or -1 for any other name.
int64_t checkpoint_step(const std::string& name);

// Puts the folder `from` in place of `to`. Where `to` exists, the two are exchanged in one step where the
// filesystem can (renameat2 RENAME_EXCHANGE), so `to` always names a whole checkpoint, and `from` then holds
// the old one; elsewhere the old one is moved aside to `from` first.
Status replace_dir(const std::filesystem::path& from, const std::filesystem::path& to);

// The folders under `dir` whose names start with "step_", listed before anything renames or removes them
// (doing so while iterating may skip or repeat entries).
std::vector<std::filesystem::path> step_folders(const std::string& dir);

// Removes the leftovers of saves that failed or were killed ("step_*.tmp": never a checkpoint `latest` could
// name; not "step_*.tmp.old", which can be the only copy of a step: see prune_checkpoints).
void remove_unfinished_saves(const std::string& checkpoint_dir);

// Keeps the `keep` checkpoints with the highest steps, counting `written` (the one just saved, never removed:
// after a resume from an earlier step, the later steps of the abandoned run sort above it), and removes the
// leftovers of saves that failed or were killed. A "step_N.tmp.old" is replace_dir's fallback killed halfway:
// the old step_N moved aside. With a step_N beside it, the new one made it into place and the old one goes;
// without, it is the only copy of step N and goes back to its name (load_checkpoint reads it from there
// meanwhile).
void prune_checkpoints(const std::string& checkpoint_dir, const std::string& written, int keep);

// `dir`, or where replace_dir's fallback moved it aside ("<dir>.tmp.old") when a save of the same step was
// killed before putting the new one in its place: the checkpoint `latest` named is then there, whole.
std::filesystem::path moved_aside_if_missing(const std::filesystem::path& dir);

}  // namespace strata::engine
