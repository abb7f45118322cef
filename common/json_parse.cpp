#include "common/json_parse.h"

#include <set>
#include <vector>

namespace strata {
namespace {

// The byte offset where nesting first passes `max_depth`, or npos. Brackets inside strings do not count; an
// unterminated string just ends the scan (the parser then reports it).
size_t too_deep_at(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return i;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return std::string_view::npos;
}

// Where a value sits, for a message: "the top level", "'model'", "'model.n_layer'".
std::string where(const std::vector<std::string>& path) {
  if (path.empty()) return "the top-level object";
  std::string s;
  for (const std::string& p : path) s += (s.empty() ? "" : ".") + p;
  return "object '" + s + "'";
}

}  // namespace

Result<nlohmann::json> parse_json(std::string_view text, std::string_view source, StatusCode code,
                                  const JsonLimits& limits) {
  if (text.size() > limits.max_bytes) {
    return Status(code, fmt::format("{}: {} bytes of JSON, past the {} bytes Strata reads", source, text.size(),
                                    limits.max_bytes));
  }
  if (const size_t at = too_deep_at(text, limits.max_depth); at != std::string_view::npos) {
    return Status(code, fmt::format("{}: JSON nested more than {} deep (at byte {})", source, limits.max_depth, at));
  }
  // One set of keys per open object, and the key path to it, for duplicates.
  struct Open {
    std::set<std::string> keys;
    std::string last_key;
  };
  std::vector<Open> open;
  std::vector<std::string> path;
  std::string duplicate;
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start:
        if (!open.empty()) path.push_back(open.back().last_key);
        open.emplace_back();
        break;
      case E::object_end:
        open.pop_back();
        if (!path.empty() && open.size() == path.size()) path.pop_back();
        break;
      case E::key: {
        std::string key = parsed.get<std::string>();
        if (!open.back().keys.insert(key).second && duplicate.empty())
          duplicate = fmt::format("key '{}' appears twice in {}", key, where(path));
        open.back().last_key = std::move(key);
        break;
      }
      default:
        break;
    }
    return true;
  };
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::parse_error& e) {
    return Status(code, fmt::format("{}: not valid JSON (byte {}): {}", source, e.byte, e.what()));
  } catch (const nlohmann::json::exception& e) {  // out_of_range: a number past a double's range (1e400)
    return Status(code, fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!duplicate.empty()) return Status(code, fmt::format("{}: {}", source, duplicate));
  return value;
}

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > max_chars) {
    s.resize(max_chars);
    s += "...";
  }
  return s;
}

}  // namespace strata
