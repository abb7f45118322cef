#include "engine/checkpoint/checkpoint_state.h"

#include <climits>
#include <set>

#include <fmt/format.h>

#include "common/json_parse.h"
#include "storage/checksum.h"

namespace strata::engine {
namespace {

constexpr const char* kFormat = "strata-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kChecksumKey = "xxh3";
constexpr uint64_t kMaxPosition = uint64_t{1} << 53;  // exact in any JSON reader's double

uint64_t state_hash(const nlohmann::json& j) {
  const std::string text = j.dump(2);
  return xxh3_64(text.data(), text.size());
}

// Reads the fields of one object, each checked by name; unknown keys are refused.
class Fields {
 public:
  Fields(const nlohmann::json& obj, const std::string& path, std::string where)
      : obj_(obj), path_(path), where_(std::move(where)) {}

  Status object() const {
    if (obj_.is_object()) return Status::ok();
    return Status::corruption("{}: {} is {}, not an object", path_, where_.empty() ? "the file" : where_,
                              obj_.type_name());
  }
  // An integer in [lo, hi]; `required` false leaves *out when absent.
  template <typename T>
  Status integer(const char* key, uint64_t lo, uint64_t hi, T* out, bool required = true) {
    known_.insert(key);
    auto it = obj_.find(key);
    if (it == obj_.end()) return required ? missing(key) : Status::ok();
    if (!it->is_number_integer()) return bad(key, *it, "an integer");
    const bool negative = !it->is_number_unsigned() && it->get<int64_t>() < 0;
    const uint64_t v = negative ? 0 : it->get<uint64_t>();
    if (negative || v < lo || v > hi) return bad(key, *it, fmt::format("in [{}, {}]", lo, hi).c_str());
    *out = static_cast<T>(v);
    return Status::ok();
  }
  Status string(const char* key, std::string* out) {
    known_.insert(key);
    auto it = obj_.find(key);
    if (it == obj_.end()) return missing(key);
    if (!it->is_string()) return bad(key, *it, "a string");
    *out = it->get<std::string>();
    return Status::ok();
  }
  const nlohmann::json* optional(const char* key) {
    known_.insert(key);
    auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
  }
  const nlohmann::json* required(const char* key, Status* st) {
    const nlohmann::json* v = optional(key);
    if (v == nullptr) *st = missing(key);
    return v;
  }
  Status finish() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (known_.count(it.key()) == 0)
        return Status::corruption("{}: unknown field '{}'", path_, name(it.key().c_str()));
    }
    return Status::ok();
  }
  std::string name(const char* key) const { return where_.empty() ? key : where_ + "." + key; }

 private:
  Status missing(const char* key) const { return Status::corruption("{}: no field '{}'", path_, name(key)); }
  Status bad(const char* key, const nlohmann::json& v, const char* want) const {
    return Status::corruption("{}: {} is {}, want {}", path_, name(key), json_excerpt(v), want);
  }
  const nlohmann::json& obj_;
  const std::string& path_;
  std::string where_;
  std::set<std::string> known_;
};

}  // namespace

std::string train_state_json(const TrainState& state, int64_t adam_steps) {
  nlohmann::json js = {
      {"format", kFormat},
      {"version", kVersion},
      {"step", state.step},
      {"adam_steps", adam_steps},
      {"train_position",
       {{"shard", state.train_pos.shard}, {"offset", state.train_pos.offset}, {"epoch", state.train_pos.epoch}}},
      {"config", state.config},
  };
  if (!state.train_shards.empty()) {
    nlohmann::json shards = nlohmann::json::array();
    for (const ShardRecord& r : state.train_shards) shards.push_back({{"file", r.file}, {"tokens", r.tokens}});
    js["train_shards"] = std::move(shards);
  }
  js[kChecksumKey] = fmt::format("{:016x}", state_hash(js));
  return js.dump(2) + "\n";
}

Result<TrainState> parse_train_state(std::string_view text, const std::string& path, int64_t* adam_steps) {
  STRATA_ASSIGN_OR_RETURN(nlohmann::json js, parse_json(text, path, StatusCode::kCorruption));
  Fields top(js, path, "");
  STRATA_RETURN_IF_ERROR(top.object());
  // The checksum first: a damaged file is called damaged, whatever field the damage reached.
  if (const nlohmann::json* sum = top.optional(kChecksumKey); sum != nullptr) {
    const std::string stored = sum->is_string() ? sum->get<std::string>() : json_excerpt(*sum);
    nlohmann::json rest = js;
    rest.erase(kChecksumKey);
    const std::string computed = fmt::format("{:016x}", state_hash(rest));
    if (stored != computed) {
      return Status::corruption("{}: fails its XXH3 checksum (stored {}, computed {}): the file is damaged", path,
                                stored, computed);
    }
  }
  std::string format;
  int version = 0;
  STRATA_RETURN_IF_ERROR(top.string("format", &format));
  if (format != kFormat) return Status::corruption("{}: format is '{}', want '{}'", path, format, kFormat);
  STRATA_RETURN_IF_ERROR(top.integer("version", 0, INT_MAX, &version));
  if (version != kVersion)
    return Status::corruption("{}: version {} (this Strata reads version {})", path, version, kVersion);

  TrainState st;
  STRATA_RETURN_IF_ERROR(top.integer("step", 0, INT_MAX, &st.step));
  STRATA_RETURN_IF_ERROR(top.integer("adam_steps", 0, static_cast<uint64_t>(st.step), adam_steps));

  Status missing;
  const nlohmann::json* pos = top.required("train_position", &missing);
  STRATA_RETURN_IF_ERROR(missing);
  Fields p(*pos, path, "train_position");
  STRATA_RETURN_IF_ERROR(p.object());
  STRATA_RETURN_IF_ERROR(p.integer("shard", 0, kMaxPosition, &st.train_pos.shard));
  STRATA_RETURN_IF_ERROR(p.integer("offset", 0, kMaxPosition, &st.train_pos.offset));
  STRATA_RETURN_IF_ERROR(p.integer("epoch", 0, kMaxPosition, &st.train_pos.epoch));
  STRATA_RETURN_IF_ERROR(p.finish());

  if (const nlohmann::json* shards = top.optional("train_shards"); shards != nullptr) {
    if (!shards->is_array() || shards->empty())
      return Status::corruption("{}: train_shards is {}, want a non-empty array", path, json_excerpt(*shards));
    for (size_t i = 0; i < shards->size(); ++i) {
      Fields r((*shards)[i], path, fmt::format("train_shards[{}]", i));
      ShardRecord rec;
      STRATA_RETURN_IF_ERROR(r.object());
      STRATA_RETURN_IF_ERROR(r.string("file", &rec.file));
      STRATA_RETURN_IF_ERROR(r.integer("tokens", 1, kMaxPosition, &rec.tokens));
      STRATA_RETURN_IF_ERROR(r.finish());
      st.train_shards.push_back(std::move(rec));
    }
    if (st.train_pos.shard >= st.train_shards.size()) {
      return Status::corruption("{}: train_position.shard is {}, but train_shards lists {}", path, st.train_pos.shard,
                                st.train_shards.size());
    }
    const ShardRecord& at = st.train_shards[st.train_pos.shard];
    if (st.train_pos.offset > at.tokens) {
      return Status::corruption("{}: train_position.offset is {}, past the {} tokens of {} (train_shards[{}])", path,
                                st.train_pos.offset, at.tokens, at.file, st.train_pos.shard);
    }
  }
  if (const nlohmann::json* config = top.optional("config"); config != nullptr && !config->is_null()) {
    if (!config->is_object()) return Status::corruption("{}: config is {}, want an object", path, config->type_name());
    st.config = *config;
  } else {
    st.config = nlohmann::json::object();
  }
  STRATA_RETURN_IF_ERROR(top.finish());
  return st;
}

}  // namespace strata::engine
