#include "common/json_config.h"

#include "common/json_parse.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

namespace strata {

Result<nlohmann::json> read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::not_found("cannot open config file {}: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_json(ss.str(), path);
}

JsonSection::JsonSection(const nlohmann::json* obj, std::string source, std::string path)
    : obj_(obj), source_(std::move(source)), path_(std::move(path)) {}

std::string JsonSection::qualified(const char* key) const {
  return path_.empty() ? std::string(key) : path_ + "." + key;
}

const nlohmann::json* JsonSection::find(const char* key) {
  known_.insert(key);
  if (obj_ == nullptr) return nullptr;
  auto it = obj_->find(key);
  if (it == obj_->end() || it->is_null()) return nullptr;
  return &*it;
}

Status JsonSection::type_error(const char* key, const char* expected) const {
  return Status::invalid_argument("{}: {} must be {}, got {}", source_, qualified(key), expected,
                                  json_excerpt(obj_->at(key)));
}

Status JsonSection::get_int(const char* key, int64_t* out) {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return Status::ok();
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    return type_error(key, "a 64-bit integer");  // get<int64_t> would wrap it to a negative number
  }
  if (v->is_number_integer()) {
    *out = v->get<int64_t>();
    return Status::ok();
  }
  // 1e6 and 4.0 are integers a user may reasonably write.
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
      *out = static_cast<int64_t>(d);
      return Status::ok();
    }
  }
  return type_error(key, "an integer");
}

Status JsonSection::get_int_or_auto(const char* key, int64_t* out) {
  const nlohmann::json* v = find(key);
  if (v != nullptr && v->is_string() && v->get<std::string>() == "auto") return Status::ok();
  return get_int(key, out);
}

Status JsonSection::get_int(const char* key, int* out) {
  int64_t v = *out;
  STRATA_RETURN_IF_ERROR(get_int(key, &v));
  if (v < INT32_MIN || v > INT32_MAX) return type_error(key, "a 32-bit integer");
  *out = static_cast<int>(v);
  return Status::ok();
}

Status JsonSection::get_double(const char* key, double* out) {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return Status::ok();
  if (!v->is_number()) return type_error(key, "a number");
  *out = v->get<double>();
  return Status::ok();
}

Status JsonSection::get_double(const char* key, float* out) {
  double d = *out;
  STRATA_RETURN_IF_ERROR(get_double(key, &d));
  // 1e300 would become inf as a float: say so instead.
  if (std::isfinite(d) && !std::isfinite(static_cast<float>(d))) {
    return type_error(key, "a number within float range");
  }
  *out = static_cast<float>(d);
  return Status::ok();
}

Status JsonSection::get_bool(const char* key, bool* out) {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return Status::ok();
  if (!v->is_boolean()) return type_error(key, "true or false");
  *out = v->get<bool>();
  return Status::ok();
}

Status JsonSection::get_string(const char* key, std::string* out) {
  const nlohmann::json* v = find(key);
  if (v == nullptr) return Status::ok();
  if (!v->is_string()) return type_error(key, "a string");
  *out = v->get<std::string>();
  return Status::ok();
}

void JsonSection::accept_unused(const std::vector<const char*>& keys, std::vector<std::string>* present_names) {
  for (const char* k : keys) {
    if (find(k) != nullptr && present_names) present_names->push_back(qualified(k));
  }
}

JsonSection JsonSection::section(const char* key) {
  const nlohmann::json* v = find(key);
  return JsonSection(v, source_, qualified(key));
}

Status JsonSection::finish() const {
  if (obj_ == nullptr) return Status::ok();
  if (!obj_->is_object()) {
    return Status::invalid_argument("{}: {} must be an object, got {}", source_, path_.empty() ? "the config" : path_,
                                    json_excerpt(*obj_));
  }
  for (auto it = obj_->begin(); it != obj_->end(); ++it) {
    if (known_.count(it.key())) continue;
    std::string valid;
    for (const auto& k : known_) valid += (valid.empty() ? "" : ", ") + k;
    return Status::invalid_argument("{}: unknown key '{}'{}; valid keys{}: {}", source_, it.key(),
                                    path_.empty() ? "" : " in " + path_, path_.empty() ? "" : " of " + path_,
                                    valid);
  }
  return Status::ok();
}

}  // namespace strata
