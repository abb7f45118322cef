#include "storage/safetensors_shards.h"

#include <filesystem>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/json_parse.h"
#include "storage/token_shard.h"  // read_whole_file

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kIndexSuffix = ".index.json";
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

// The shard files the index maps tensors to, in order of first mention, and each tensor's shard.
struct Index {
  std::vector<std::string> shards;
  std::map<std::string, size_t> shard_of;  // tensor -> index in shards
};

Result<Index> read_index(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(const std::string text, read_whole_file(path));
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json(text, path));
  if (!j.is_object()) return Status::corruption("{}: a safetensors index is a JSON object", path);
  const auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object() || map->empty())
    return Status::corruption("{}: no \"weight_map\" object of tensor names to shard files", path);
  Index index;
  std::map<std::string, size_t> shard_number;
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string())
      return Status::corruption("{}: weight_map[\"{}\"] is {}, not a shard's file name", path, name,
                                json_excerpt(file));
    const std::string f = file.get<std::string>();
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos || f.find('\0') != std::string::npos)
      return Status::corruption("{}: weight_map[\"{}\"] is \"{}\", not a file name beside the index", path, name, f);
    const auto [it, added] = shard_number.emplace(f, index.shards.size());
    if (added) index.shards.push_back(f);
    index.shard_of.emplace(name, it->second);
  }
  return index;
}

}  // namespace

Result<SafetensorsShards> SafetensorsShards::open(const std::string& path) {
  std::error_code ec;
  std::string target = path;
  if (fs::is_directory(path, ec)) {
    const fs::path index = fs::path(path) / kIndexName, single = fs::path(path) / kSingleName;
    if (fs::exists(index, ec)) {
      target = index.string();
    } else if (fs::exists(single, ec)) {
      target = single.string();
    } else {
      return Status::not_found("{}: neither {} nor {} in the folder", path, kIndexName, kSingleName);
    }
  }
  SafetensorsShards s;
  s.path_ = target;
  if (!std::string_view(target).ends_with(kIndexSuffix)) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(target));
    for (const SafetensorsEntry& e : file.tensors()) s.file_of_name_.emplace(e.name, 0);
    s.files_.push_back(std::move(file));
    return s;
  }
  s.sharded_ = true;
  STRATA_ASSIGN_OR_RETURN(const Index index, read_index(target));
  const fs::path dir = fs::path(target).parent_path();
  for (size_t i = 0; i < index.shards.size(); ++i) {
    auto file = SafetensorsFile::open((dir / index.shards[i]).string());
    if (!file.is_ok()) return file.status().with_context(fmt::format("shard {} of the index {}", i + 1, target));
    for (const SafetensorsEntry& e : file->tensors()) {
      const auto mapped = index.shard_of.find(e.name);
      if (mapped == index.shard_of.end())
        return Status::corruption("{}: tensor '{}' is in the shard {} but not in the index's weight_map", target,
                                  e.name, index.shards[i]);
      if (mapped->second != i)
        return Status::corruption("{}: tensor '{}' is in the shard {}, but the index maps it to {}", target, e.name,
                                  index.shards[i], index.shards[mapped->second]);
      s.file_of_name_.emplace(e.name, i);  // once: a second shard holding it would be refused just above
    }
    s.files_.push_back(std::move(file).value());
  }
  for (const auto& [name, shard] : index.shard_of)
    if (s.file_of_name_.count(name) == 0)
      return Status::corruption("{}: the index maps tensor '{}' to {}, which does not hold it", target, name,
                                index.shards[shard]);
  return s;
}

const SafetensorsEntry* SafetensorsShards::find(std::string_view name) const {
  const auto it = file_of_name_.find(name);
  return it == file_of_name_.end() ? nullptr : files_[it->second].find(name);
}

const SafetensorsFile& SafetensorsShards::file_of(const SafetensorsEntry& e) const {
  const auto it = file_of_name_.find(e.name);
  STRATA_ASSERT_MSG(it != file_of_name_.end(), "an entry of another set of safetensors files");
  return files_[it->second];
}

std::vector<const SafetensorsEntry*> SafetensorsShards::tensors() const {
  std::vector<const SafetensorsEntry*> out;
  for (const SafetensorsFile& f : files_)
    for (const SafetensorsEntry& e : f.tensors()) out.push_back(&e);
  return out;
}

std::vector<std::string> SafetensorsShards::names() const {
  std::vector<std::string> out;
  for (const SafetensorsEntry* e : tensors()) out.push_back(e->name);
  return out;
}

bool SafetensorsShards::checksummed() const {
  for (const SafetensorsFile& f : files_)
    if (!f.checksummed()) return false;
  return !files_.empty();
}

}  // namespace strata
