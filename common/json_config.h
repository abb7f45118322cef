// json_config.h — strict reading of JSON configuration sections.
//
// A JsonSection wraps one JSON object and its dotted path ("model", "training"). Each get_* reads an optional
// key into an output (leaving the default when absent) and fails with InvalidArgument naming "file: path.key"
// and the expected type on a wrong type. finish() fails on any key no get_* asked for, listing the valid keys —
// so a typo never silently falls back to a default. Not thread-safe.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace strata {

// Reads and parses a JSON file; errors name the file (and line/column for syntax errors).
Result<nlohmann::json> read_json_file(const std::string& path);

class JsonSection {
 public:
  // `source` names where the JSON came from (a file path) for messages; `path` is the dotted section path.
  JsonSection(const nlohmann::json* obj, std::string source, std::string path);

  // Whether the section exists at all (an absent section reads as empty: every key keeps its default).
  bool present() const { return obj_ != nullptr; }

  Status get_int(const char* key, int64_t* out);
  Status get_int(const char* key, int* out);
  Status get_double(const char* key, double* out);
  Status get_double(const char* key, float* out);
  Status get_bool(const char* key, bool* out);
  Status get_string(const char* key, std::string* out);
  // get_int, except that the string "auto" (DeepSpeed configs written for the Hugging Face integration use it
  // for values the framework fills in) leaves the default.
  Status get_int_or_auto(const char* key, int64_t* out);
  // Keys that are accepted by name but whose value Strata does not act on yet: read them so finish()
  // accepts them, and return their names so the caller can warn.
  void accept_unused(const std::vector<const char*>& keys, std::vector<std::string>* present_names);
  // A nested section (may be absent).
  JsonSection section(const char* key);
  // Fails if the object has a key that no get_*/section/accept_unused call named.
  Status finish() const;

  std::string qualified(const char* key) const;  // "model.n_layer"

 private:
  const nlohmann::json* find(const char* key);
  Status type_error(const char* key, const char* expected) const;

  const nlohmann::json* obj_;
  std::string source_;
  std::string path_;
  std::set<std::string> known_;
};

}  // namespace strata
