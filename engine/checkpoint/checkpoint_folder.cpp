// The checkpoint folder (checkpoint_folder.h), and the checks before a run writes into one or resumes from one
// (checkpoint.h): no earlier run's checkpoints, the data position's shards, what changed in the config.
#include "engine/checkpoint/checkpoint_folder.h"

#include <fcntl.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "common/log.h"
#include "engine/checkpoint/checkpoint.h"

namespace strata::engine {

namespace fs = std::filesystem;

// The step a checkpoint folder's name gives ("step_001200": 1200), or -1 for any other name.
int64_t checkpoint_step(const std::string& name) {
  if (!name.starts_with("step_") || name.size() == 5 || name[5] < '0' || name[5] > '9') return -1;  // no sign
  int64_t step = 0;
  const char* end = name.data() + name.size();
  const auto [ptr, ec] = std::from_chars(name.data() + 5, end, step);
  return ec == std::errc() && ptr == end ? step : -1;
}

// Puts the folder `from` in place of `to`. Where `to` exists, the two are exchanged in one step where the
// filesystem can (renameat2 RENAME_EXCHANGE), so `to` always names a whole checkpoint, and `from` then holds
// the old one; elsewhere the old one is moved aside to `from` first.
Status replace_dir(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (fs::exists(to, ec)) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) return Status::ok();
    if (errno != EINVAL && errno != ENOSYS)
      return Status::io_error("cannot exchange {} with {}: {}", from.string(), to.string(), std::strerror(errno));
    const fs::path aside = from.string() + ".old";
    fs::remove_all(aside, ec);
    fs::rename(to, aside, ec);
    if (ec) return Status::io_error("cannot move {} aside: {}", to.string(), ec.message());
    fs::rename(from, to, ec);
    if (ec) return Status::io_error("cannot rename {} to {}: {}", from.string(), to.string(), ec.message());
    fs::rename(aside, from, ec);  // for the caller to remove with the rest
    return Status::ok();
  }
  fs::rename(from, to, ec);
  if (ec) return Status::io_error("cannot rename {} to {}: {}", from.string(), to.string(), ec.message());
  return Status::ok();
}

// The folders under `dir` whose names start with "step_", listed before anything renames or removes them
// (doing so while iterating may skip or repeat entries).
std::vector<fs::path> step_folders(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> folders;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_directory(ec) && e.path().filename().string().starts_with("step_")) folders.push_back(e.path());
  }
  return folders;
}

// Removes the leftovers of saves that failed or were killed ("step_*.tmp": never a checkpoint `latest` could
// name; not "step_*.tmp.old", which can be the only copy of a step: see prune_checkpoints).
void remove_unfinished_saves(const std::string& checkpoint_dir) {
  std::error_code ec;
  for (const fs::path& p : step_folders(checkpoint_dir)) {
    if (p.filename().string().ends_with(".tmp")) fs::remove_all(p, ec);
  }
}

// Keeps the `keep` checkpoints with the highest steps, counting `written` (the one just saved, never removed:
// after a resume from an earlier step, the later steps of the abandoned run sort above it), and removes the
// leftovers of saves that failed or were killed. A "step_N.tmp.old" is replace_dir's fallback killed halfway:
// the old step_N moved aside. With a step_N beside it, the new one made it into place and the old one goes;
// without, it is the only copy of step N and goes back to its name (load_checkpoint reads it from there
// meanwhile).
void prune_checkpoints(const std::string& checkpoint_dir, const std::string& written, int keep) {
  std::error_code ec;
  remove_unfinished_saves(checkpoint_dir);
  std::vector<std::pair<int64_t, fs::path>> others;
  for (fs::path p : step_folders(checkpoint_dir)) {
    std::string n = p.filename().string();
    if (n == written || n.ends_with(".tmp")) continue;
    if (n.ends_with(".tmp.old")) {
      const fs::path original = p.parent_path() / n.substr(0, n.size() - 8);
      if (fs::exists(original, ec)) {
        fs::remove_all(p, ec);
        continue;
      }
      fs::rename(p, original, ec);
      if (ec) continue;  // left where load_checkpoint still finds it
      STRATA_LOG_WARN("checkpoint: {} was moved aside by a save that did not finish; restored", original.string());
      p = original;
      n = p.filename().string();
    }
    if (const int64_t step = checkpoint_step(n); step >= 0) others.emplace_back(step, p);
  }
  std::sort(others.begin(), others.end());
  const size_t kept = static_cast<size_t>(keep) - 1;
  for (size_t i = 0; i + kept < others.size(); ++i) {
    // Renamed first, in one step, to a name the next save removes: a kill during the removal leaves no
    // half-deleted folder under a checkpoint's name.
    const fs::path& p = others[i].second;
    const fs::path doomed = p.parent_path() / (p.filename().string() + ".pruned.tmp");
    fs::rename(p, doomed, ec);
    fs::remove_all(ec ? p : doomed, ec);
  }
}

// `dir`, or where replace_dir's fallback moved it aside ("<dir>.tmp.old") when a save of the same step was
// killed before putting the new one in its place: the checkpoint `latest` named is then there, whole.
fs::path moved_aside_if_missing(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / "state.json", ec)) return dir;
  const fs::path aside = dir.string() + ".tmp.old";
  if (!fs::exists(aside / "state.json", ec)) return dir;
  STRATA_LOG_WARN("checkpoint: {} is missing; reading the copy a save that did not finish moved aside, {}",
                  dir.string(), aside.string());
  return aside;
}

std::vector<ShardRecord> shard_records(const DataLoader& loader) {
  std::vector<ShardRecord> out;
  for (size_t i = 0; i < loader.paths().size(); ++i)
    out.push_back({fs::path(loader.paths()[i]).filename().string(), loader.shard_tokens()[i]});
  return out;
}

Result<size_t> resume_shard(const std::vector<ShardRecord>& saved, const DataLoader::Position& pos,
                            const std::vector<ShardRecord>& now, const std::string& what) {
  if (saved.empty()) return pos.shard;
  if (pos.shard >= saved.size())
    return Status::corruption("the checkpoint's {} position names shard {}, but it lists {} shards", what, pos.shard,
                              saved.size());
  const ShardRecord& at = saved[pos.shard];
  if (now != saved) {
    // Each side's shards the other lacks, named (the first few).
    auto missing_from = [](const std::vector<ShardRecord>& a, const std::vector<ShardRecord>& b) {
      std::string names;
      size_t n = 0;
      for (const ShardRecord& r : a) {
        if (std::find(b.begin(), b.end(), r) != b.end()) continue;
        if (++n <= 3) names += (names.empty() ? "" : ", ") + r.file;
      }
      if (n > 3) names += fmt::format(" and {} more", n - 3);
      return n == 0 ? std::string("none") : names;
    };
    STRATA_LOG_WARN("{} differs from the shards the checkpoint's run read: new {}; gone {}", what,
                    missing_from(now, saved), missing_from(saved, now));
  }
  if (pos.shard < now.size() && now[pos.shard] == at) return pos.shard;
  std::vector<size_t> found;
  for (size_t i = 0; i < now.size(); ++i) {
    if (now[i] == at) found.push_back(i);
  }
  if (found.size() == 1) {
    STRATA_LOG_WARN("{}: the checkpoint's position is in {}, now shard {} (it was shard {})", what, at.file,
                    found[0], pos.shard);
    return found[0];
  }
  std::string there = "no shard";
  if (pos.shard < now.size())
    there = fmt::format("{} ({} tokens)", now[pos.shard].file, now[pos.shard].tokens);
  return Status::invalid_argument(
      "{}: the checkpoint's position is token {} of {} ({} tokens, shard {} of the {} its run read), but {} its "
      "shards give {} there{}: resuming would read other data than the run it continues; resume with the data it "
      "trained on (state.json lists its shards)",
      what, pos.offset, at.file, at.tokens, pos.shard, saved.size(), what, there,
      found.size() > 1 ? fmt::format(", and {} shards have that name and size", found.size()) : std::string());
}

namespace {

void flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, std::string>* out) {
  if (j.is_object()) {  // an empty one adds no key
    for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
  } else {
    (*out)[prefix] = j.dump();
  }
}

}  // namespace

std::vector<std::string> config_changes(const nlohmann::json& saved, const nlohmann::json& now) {
  std::map<std::string, std::string> a, b;
  flatten(saved, "", &a);
  flatten(now, "", &b);
  std::vector<std::string> out;
  auto ia = a.begin();
  auto ib = b.begin();
  while (ia != a.end() || ib != b.end()) {
    if (ib == b.end() || (ia != a.end() && ia->first < ib->first)) {
      out.push_back(fmt::format("{}: {} -> (unset)", ia->first, ia->second));
      ++ia;
    } else if (ia == a.end() || ib->first < ia->first) {
      out.push_back(fmt::format("{}: (unset) -> {}", ib->first, ib->second));
      ++ib;
    } else {
      if (ia->second != ib->second) out.push_back(fmt::format("{}: {} -> {}", ia->first, ia->second, ib->second));
      ++ia;
      ++ib;
    }
  }
  return out;
}

Status check_no_checkpoints(const std::string& checkpoint_dir) {
  const fs::path dir(checkpoint_dir);
  std::error_code ec;
  std::string found;
  if (fs::exists(dir / "latest", ec)) {
    std::ifstream in(dir / "latest");
    std::string name;
    std::getline(in, name);
    found = fmt::format("'latest' names {}", name.empty() ? std::string("nothing") : name);
  } else {
    for (const fs::path& p : step_folders(checkpoint_dir)) {
      if (!p.filename().string().ends_with(".tmp") && fs::exists(p / "state.json", ec)) {
        found = p.filename().string();
        break;
      }
    }
  }
  if (found.empty()) return Status::ok();
  return Status::invalid_argument(
      "training.checkpoint_dir {} already holds checkpoints ({}): --resume continues that run; a new one would "
      "replace them step by step and prune them, so give it another folder (--checkpoint-dir), remove them, or set "
      "training.overwrite_checkpoints = true to start over there",
      checkpoint_dir, found);
}

}  // namespace strata::engine
