// json_parse.h — parsing JSON that came from outside the process, as hostile until checked.
//
// Every JSON text Strata reads (configs, state.json, safetensors headers, tokenizer files, documents to
// tokenize) goes through parse_json. It bounds the text's size and its nesting depth before nlohmann sees it,
// so neither a 200,000-deep header nor anything later that walks the value recursively (dump() in an error
// message, a destructor) can exhaust the stack; it refuses a key that appears twice in one object, which
// nlohmann would silently resolve to the last; and it turns every nlohmann exception (a syntax error, a
// number past a double's range such as 1e400) into a Status naming the source and the byte offset. No
// exception escapes. Thread-safe (no shared state).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace strata {

struct JsonLimits {
  size_t max_bytes = size_t{256} << 20;  // Llama 3's tokenizer.json is 9 MB; safetensors allow 100 MB headers
  int max_depth = 64;                    // configs nest 4 deep, safetensors headers 3, tokenizer.json 6
};

// Parses `text`. On failure a Status of `code` (InvalidArgument for files users write, Corruption for files
// Strata wrote) whose message starts with `source` (a file name, "file:line") and says what and where: the
// byte offset of a syntax error or of the object past the depth bound, the key given twice.
Result<nlohmann::json> parse_json(std::string_view text, std::string_view source,
                                  StatusCode code = StatusCode::kInvalidArgument, const JsonLimits& limits = {});

// The value as compact JSON, cut to at most `max_chars` (ending "...") for an error message: a malformed entry
// of a 10 MB header is named, not repeated.
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 160);

}  // namespace strata
