// safetensors_shards.h — one model's weights in one safetensors file or in several shards with their index, as
// transformers' save_pretrained writes them (model.safetensors, or model-00001-of-0000N.safetensors … and
// model.safetensors.index.json), read as one set of named tensors.
//
// The index is {"metadata": {...}, "weight_map": {tensor name: shard file name}}. open() checks it before any
// weight is read: every shard it names is a plain file name in the index's folder (no path) and opens as a
// safetensors file (safetensors.h: its own checks); every tensor it maps is in that shard; no shard holds a
// tensor the index does not map to it, and no tensor is in two shards. Each failure names the index, the shard and
// the tensor. Shards are mapped, not read: a tensor's bytes are paged in when read and can be released after
// (release_mapped_pages), so a model many times the host's memory is read one tensor at a time.
// Threading: immutable once opened; any number of threads may read.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "storage/safetensors.h"

namespace strata {

class SafetensorsShards {
 public:
  // `path`: a safetensors file; an index (a file whose name ends in ".index.json"); or a folder holding
  // model.safetensors.index.json or, failing that, model.safetensors. NotFound naming what was looked for.
  static Result<SafetensorsShards> open(const std::string& path);

  // nullptr if no shard has a tensor of that name.
  const SafetensorsEntry* find(std::string_view name) const;
  // The shard holding `e` (an entry find() or tensors() gave), for its checks and its bytes.
  const SafetensorsFile& file_of(const SafetensorsEntry& e) const;
  // SafetensorsFile::verify on the shard holding e.
  Status verify(const SafetensorsEntry& e, size_t lo, size_t hi) const { return file_of(e).verify(e, lo, hi); }
  // Every shard's tensors, shard by shard in the index's order of first mention, each in data-offset order.
  std::vector<const SafetensorsEntry*> tensors() const;
  std::vector<std::string> names() const;
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // Whether every shard carries Strata's checksums.
  bool checksummed() const;
  // The index's path, or the single file's.
  const std::string& path() const { return path_; }
  bool sharded() const { return sharded_; }

 private:
  SafetensorsShards() = default;
  std::string path_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> file_of_name_;  // tensor name -> index in files_
};

}  // namespace strata
