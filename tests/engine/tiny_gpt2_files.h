// tiny_gpt2_files.h — writes a miniature GPT-2 tokenizer (encoder.json + vocab.bpe) for tests that must not
// depend on the fetched GPT-2 files: the 256 byte tokens with ids equal to their byte values, then any extra
// tokens, then "<|endoftext|>".
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::testing {

// encoder.py's bytes_to_unicode(b), as UTF-8.
inline std::string gpt2_byte_char(int b) {
  auto printable = [](int c) { return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF); };
  int cp = b;
  if (!printable(b)) {
    cp = 256;
    for (int c = 0; c < b; ++c) cp += printable(c) ? 0 : 1;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

inline std::string write_text_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

// Writes `dir`/encoder.json (ids: bytes 0..255, then `extra` from 256, then <|endoftext|>) and returns its path.
inline std::string write_tiny_encoder(const std::filesystem::path& dir, const std::vector<std::string>& extra = {}) {
  nlohmann::json enc = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) enc[gpt2_byte_char(b)] = b;
  int id = 256;
  for (const auto& t : extra) enc[t] = id++;
  enc["<|endoftext|>"] = id;
  return write_text_file(dir / "encoder.json", enc.dump());
}

}  // namespace strata::testing
